"""Condense: the model sees the lines that matter of an oversized tool result, verbatim (seed 003, "Condense").

A plain-text tool result above ``[supervisor.condense] tokens_threshold`` is shown to one condenser call per
round as a numbered view; the model answers line ranges only, and the model's copy of the result is rebuilt from
the original's own bytes, with gap markers and the path of a spill file holding the full original. Decisions
are sticky per tool result, so every later request of the session carries identical bytes.

Modules, core first (sans-IO: no trio, sockets or clocks):

- :mod:`.text`: lines (``\\n`` only, terminators kept) and tiktoken counts;
- :mod:`.signals`: diagnostic lines and focus terms;
- :mod:`.view`: the numbered view within a token budget;
- :mod:`.ranges`, :mod:`.protocol`: the condenser's prompt and the validation of its answer;
- :mod:`.reconstruct`: the narrowed text; :mod:`.adaptive`: the optional per-session threshold;

and the shell: :mod:`.decisions` (diskcache), :mod:`.spill` (files), :mod:`.model` (the litellm call),
:mod:`.engine` (one round), :mod:`.offline` (``proxyvisor condense FILE``).
"""

from .decisions import Decision, DecisionCache
from .engine import CondenseEngine, RoundReport, ToolResult, effective_threshold
from .protocol import TaskContext
from .spill import SpillStore

__all__ = ["CondenseEngine", "Decision", "DecisionCache", "RoundReport", "SpillStore", "TaskContext", "ToolResult",
           "effective_threshold"]
