"""Condense: the model sees the lines that matter of an oversized tool result, verbatim (seed 003, "Condense").

A plain-text tool result above ``[supervisor.condense] tokens_threshold`` is narrowed to at most ``budget_tokens``:
its lines are chosen by the deterministic condenser (test runs, builds, installs, and whenever no model answers)
or by one condenser call per round, shown a numbered view, that answers line ranges only. The model's copy of the
result is rebuilt from the original's own bytes, with gap markers, repeated diagnostics counted, long lines
clipped, and the path of a spill file holding the full original. Decisions are sticky per tool result, so every
later request of the session carries identical bytes.

This package is the sans-IO core (no trio, sockets, files or clocks; an import-linter contract in
``pyproject.toml`` keeps it so):

- :mod:`.text`: lines (``\\n`` only, terminators kept) and tiktoken counts;
- :mod:`.signals`: diagnostic lines and focus terms; :mod:`.mask`: line templates;
- :mod:`.baseline`: a run's command, kind and outcome, and its lines new against the last green run;
- :mod:`.view`: the numbered view within a token budget;
- :mod:`.ranges`, :mod:`.protocol`: the condenser's prompt and the validation of its answer;
- :mod:`.select`: which lines fit a result's budget (the deterministic condenser, or around a model's choice);
- :mod:`.reconstruct`: the narrowed text; :mod:`.adaptive`: the optional per-session threshold.

Its shell lives in :mod:`proxyvisor.proxy`: ``condense_decisions`` (diskcache), ``spill`` (files),
``condense_engine`` (one round of condenser calls) and ``condensing`` (the request stage); the offline command
``proxyvisor condense FILE`` is :mod:`proxyvisor.condense_cli`.
"""
