"""The verify-gate's sans-IO core: the verifier's digest (:mod:`.digest`), its answer schema and parsers
(:mod:`.verdict`), the per-turn state machine (:mod:`.outcome`) and the user's prohibitions (:mod:`.prohibitions`)."""
