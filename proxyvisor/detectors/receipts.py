"""Receipts and rounds: what each tool call did, read from the agent's own history.

A **receipt** is one tool call with its result: the tool, its arguments, the target it addresses, a digest of its
result, whether it failed, and whether it changed something. A **round** is one model decision: the tool calls
of one assistant turn (a parallel batch is one round) with their results, or a turn without tool calls. Rules
(``reference/in-session-supervisor-mechanics.md`` sections 2 and 11.4; seed 003 "Detectors"):

- **Target**: the non-empty strings (or string-list elements) under argument keys whose lowercase name contains
  ``path`` or ``file``, with a leading ``./`` removed.
- **Error**: a search that found nothing (the command's last part is ``grep``/``rg``/``ag``/``git grep``, its exit
  status 1 or, with none shown, the client's error flag, and its output empty but for that status) is no error;
  otherwise the client's flag (Anthropic ``is_error: true``) wins; otherwise an exit status in the head or tail of
  the output (``Exit code 1``, ``<returncode>1</returncode>``, ``Process exited with code 2``...) decides;
  otherwise an explicit ``is_error: false`` means success; otherwise error markers in the head or tail of the
  output (a Python traceback, ``command not found``, ``No such file or directory``, ``error:`` lines...). A call
  whose result never arrived counts as failed. A check whose output shows a failing runner summary failed, whatever
  its exit status (a run piped through ``tail`` exits 0).
- **Check** (:mod:`.checks`): a command execution that is not read-only inspection and either runs a check
  command (tests, a build, a linter) or prints a runner summary is a check; it ``passed`` unless it failed (above),
  and its receipt quotes the latest runner summary line of its output. A check command whose runner could not
  start (:func:`~.checks.runner_missing`) is no check, nor is one that writes into a pipe and shows no runner summary
  (:func:`~.checks.piped_check`: the exit status is the pipe's), nor is one that shows no runner summary and whose
  success was never told (no exit status in its output and no ``is_error: false``: a client such as opencode sends
  the bare output, where a crash or a runner whose summary is not recognised looks like a quiet success). Every
  other call is no check.
- **Mutation**, strongest signal first: a tool named in ``[supervisor.detectors] mutating_tools`` (declared); a
  **runner** (its schema's ``command``/``cmd`` property is a free-form string, or, with no schema, the call passes
  one) is judged by its command text only: an intent word or a shell write (``sed -i``, ``>`` redirection, ``rm``,
  ``git commit``...) makes it a *guessed* mutation; any other tool is a declared mutation when an intent word is
  in its name or in its ``command``/``action``/``operation`` argument. Intent words (28, Octomind's list):
  write, edit, create, replace, apply, insert, delete, remove, patch, mkdir, rename, move, update, set, send,
  publish, post, upload, schedule, book, approve, reject, cancel, deploy, install, commit, push, merge.
- **Command execution**: a call with a non-empty ``command``/``cmd`` that is a runner or not a mutation; its
  key covers the tool and all arguments (another working directory is another command).
- **Result digest**: the output with volatile fields masked (timestamps, clock times, durations, hex ids and
  addresses, UUIDs), so a poll whose only change is its timestamp repeats, while a job whose output advances
  (counts, new lines) does not.

Pure functions and a small state machine (:class:`RoundReader`); no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..transcript import Message, ToolOutput, ToolUse, harness_context
from . import checks
from .checks import words

INTENT_WORDS = frozenset(
    "write edit create replace apply insert delete remove patch mkdir rename move update set send publish post "
    "upload schedule book approve reject cancel deploy install commit push merge".split())

NONE, GUESSED, DECLARED = "none", "guessed", "declared"
"""Mutation levels: not a mutation; a runner whose command text reads as a write; declared by name or schema."""

UNRECORDED = b"unrecorded"
"""The text key of an implied round: a turn the client did not keep in its history."""

_SHELL_WRITE = re.compile(
    r"(?:^|[\s;&|(`])(?:sed\s+(?:-\w*\s+)*-i|rm|rmdir|mv|cp|mkdir|touch|tee|chmod|chown|ln|truncate|dd|patch|"
    r"git\s+(?:apply|commit|checkout|reset|rm|mv|add|merge|rebase|stash|restore|cherry-pick|push|am|switch)|"
    r"(?:pip3?|uv\s+pip|npm|pnpm|yarn|apt(?:-get)?|brew|cargo|go)\s+(?:install|add|i|uninstall|remove)|"
    r"make\s+install)(?=\s|$|;)"
    r"|(?<![0-9&>])>>?\s*(?!&|/dev/null)[^\s&|;>]", re.M)
# The branches are "<returncode>...", and "exit..." or "return..." at a word's start (any case). The pattern takes
# their first character first, from a case-exact class (under re.I the engine would not use it), so the engine skips
# in C to the next "<", "e" or "r" instead of trying every position; each branch then starts with its second
# character's case-exact class, which the engine tests before entering the branch (most "e"s and "r"s of prose go
# no further), and says with look-behinds which first character it took and that a word starts there.
_EXIT = re.compile(
    r"(?-i:[<eErR])(?:(?-i:[rR])(?<=<.)eturncode>\s*(-?\d+)\s*</returncode>"
    r"|(?-i:[xX])(?<=e.)(?<!\w..)it(?:ed)?(?: with)?(?: status| code)\s*[:=]?\s*(-?\d+)"
    r"|(?-i:[eE])(?<=r.)(?<!\w..)turn ?code\s*[:=]?\s*(-?\d+)"
    r"|(?-i:[xX])(?<=e.)(?<!\w..)it_code[\"']?\s*[:=]\s*(-?\d+))", re.I)
# Error markers, in two patterns the engine can skip through in C: phrases anywhere (each starts with a literal;
# "error(s)" at a word start), and, found by the newline before them, line starts.
_ERROR_PHRASES = re.compile(
    r"Traceback \(most recent call last\)|<tool_use_error>|command not found|No such file or directory|"
    r"Permission denied|error(?<!\werror)\(s\)")
_ERROR_LINES = re.compile(r"\n(?:(?:error|fatal|Error|ERROR|FATAL)\b[^\n]{0,40}?:|\w*(?:Error|Exception): )")
_TAG_LINE = re.compile(r"^\s*</?[A-Za-z_][\w-]*>\s*$|^\s*Error:?\s*$", re.M)
_NEAR_EMPTY = 40
_EDGE = 400  # characters of an output's head and tail that exit statuses and error markers are read from
# Every field starts after a character that is no ASCII letter, digit or underscore (the start of the text is given
# one, a newline), taken as group 1 and put back: a pattern that starts with a character class lets the engine skip
# in C to the next character that can start a match (a third of the cost of trying every position with a
# look-behind, as a look-ahead or look-behind first did). Every field ends on an ASCII letter or digit, so the
# character before the next field is never part of this one. A field starts with a digit or a hex letter: the
# look-ahead saying so gives up other positions after one test.
_VOLATILE = re.compile(
    r"([^0-9A-Za-z_])(?=[\da-fA-F])(?:"
    r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
    r"|\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"
    r"|\d+(?:\.\d+)?\s?(?:ms|s|sec|secs|seconds|milliseconds|us|µs|ns|min|minutes)\b"
    r"|0x[0-9a-fA-F]+\b"
    r"|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    r"|(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{6,16}\b)")
_MASK_LIMIT = 64 * 1024  # beyond this many characters an output is digested as it is (masking costs O(size))


UNSERIALISABLE = hashlib.blake2b(b"unserialisable", digest_size=16).digest()
"""The :func:`digest` of any parts nested too deep to be read: it tells none of them apart."""


def digest(*parts: Any) -> bytes:
    """A 16-byte digest of JSON-serialisable ``parts`` (keys sorted, so argument order does not matter).

    Values nested deeper than orjson serialises (254 levels) are digested from their ``repr`` instead; nested too
    deep for that too (about 1,000 levels), all parts have one digest, :data:`UNSERIALISABLE`."""
    try:
        data = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        try:
            data = repr(parts).encode("utf-8", "surrogatepass")
        except RecursionError:
            return UNSERIALISABLE
    return hashlib.blake2b(data, digest_size=16).digest()


def result_digest(text: str) -> bytes:
    """The digest of a tool output with its volatile fields masked (module docstring)."""
    if len(text) <= _MASK_LIMIT:
        text = _VOLATILE.sub(r"\1#", "\n" + text)[1:]
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def targets(arguments: Mapping[str, Any]) -> tuple[str, ...]:
    """Path-like arguments: strings under keys containing ``path`` or ``file``, ``./`` removed, sorted."""
    found = []
    for key, value in arguments.items():
        lowered = key.lower()
        if "path" not in lowered and "file" not in lowered:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item.strip():
                item = item.strip()
                found.append(item[2:] if item.startswith("./") else item)
    return tuple(sorted(found))


def command_text(arguments: Mapping[str, Any]) -> str | None:
    """The ``command`` (or ``cmd``) argument as text: a string, or a list of strings joined by spaces."""
    for key in ("command", "cmd"):
        value = arguments.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return " ".join(value)
    return None


def _free_form_string(prop: Any) -> bool:
    if not isinstance(prop, dict) or any(k in prop for k in ("enum", "const", "$ref")):
        return False
    kind = prop.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    return any(_free_form_string(p) for key in ("anyOf", "oneOf")
               for p in (prop[key] if isinstance(prop.get(key), list) else ()))


def is_runner(schema: Mapping[str, Any] | None, arguments: Mapping[str, Any]) -> bool:
    """True for a free-form command runner: its schema's ``command``/``cmd`` property is a free-form string (no
    ``enum``, ``const`` or ``$ref``; ``anyOf``/``oneOf`` searched), or, when the schema declares no properties,
    the call passes a ``command``/``cmd`` string."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    if isinstance(props, dict) and props:
        return any(_free_form_string(props.get(key)) for key in ("command", "cmd"))
    return command_text(arguments) is not None


def writes(command: str) -> bool:
    """Whether shell ``command`` writes (module docstring, "Mutation": an intent word or a shell write)."""
    return bool(words(command) & INTENT_WORDS or _SHELL_WRITE.search(command))


def mutation_level(name: str, arguments: Mapping[str, Any], schema: Mapping[str, Any] | None,
                   mutating_tools: frozenset[str]) -> str:
    """:data:`NONE`, :data:`GUESSED` or :data:`DECLARED` for one call (module docstring, "Mutation")."""
    if name in mutating_tools:
        return DECLARED
    if is_runner(schema, arguments):
        return GUESSED if writes(command_text(arguments) or "") else NONE
    if words(name) & INTENT_WORDS:
        return DECLARED
    for key in ("command", "action", "operation"):
        value = arguments.get(key)
        if isinstance(value, str) and words(value) & INTENT_WORDS:
            return DECLARED
    return NONE


def _error_marker(text: str) -> bool:
    """Whether ``text`` holds an error marker (module docstring, "Error")."""
    return _ERROR_PHRASES.search(text) is not None or _ERROR_LINES.search("\n" + text) is not None


def _exit_status(edges: str) -> int | None:
    # Every branch of _EXIT holds "exit" or "return"; in ASCII text, where re.I and lower() agree, a text without
    # either has no exit status (most outputs: two scans in C instead of the pattern tried at each position).
    if edges.isascii() and "exit" not in (lowered := edges.lower()) and "return" not in lowered:
        return None
    for match in _EXIT.finditer(edges):
        return int(next(g for g in match.groups() if g is not None))
    return None


def _found_nothing(output: ToolOutput, status: int | None) -> bool:
    """Whether a search's result says it found nothing: exit status 1 (or none shown, with the client's error
    flag) and no text beyond that status and its wrapper tags (at most :data:`_NEAR_EMPTY` characters)."""
    if status != 1 and not (status is None and output.is_error):
        return False
    if len(output.text) > _EDGE:
        return False
    rest = _TAG_LINE.sub("", _EXIT.sub("", output.text))
    return len(rest.strip()) <= _NEAR_EMPTY and not _error_marker(rest)


def failed(output: ToolOutput | None, command: str | None = None) -> bool:
    """Whether a tool result reports failure (module docstring, "Error"); a missing result counts as failed.
    ``command``: the call's command text, when it is a command execution (a search that found nothing is no
    failure)."""
    if output is None:
        return True
    edges = _edges(output.text)
    status = _exit_status(edges)
    # The output first: it rules out most results at once, where telling a search reads the whole command.
    if command is not None and _found_nothing(output, status) and checks.is_search(command):
        return False
    if output.is_error:
        return True
    if status is not None:
        return status != 0
    if output.is_error is False:
        return False
    return _error_marker(edges)


def _edges(text: str) -> str:
    """The head and tail of an output, where exit statuses and error markers are read (:data:`_EDGE`)."""
    return text if len(text) <= 2 * _EDGE else text[:_EDGE] + "\n" + text[-_EDGE:]


def _told_success(output: ToolOutput) -> bool:
    """Whether a tool result says its command succeeded: the client's ``is_error: false``, or exit status 0."""
    return output.is_error is False or _exit_status(_edges(output.text)) == 0


@dataclass(frozen=True, slots=True)
class Receipt:
    """One tool call and its result, reduced to what the detectors compare (keys are 16-byte digests).

    ``call_key`` covers the tool and its arguments; ``result_key`` the masked result; ``identity`` the whole call
    (tool, arguments, result, error status: what a loop repeats); ``observation`` what was learnt (the target, or
    with none the whole call, with the result and error status: what novelty compares, so the same output for
    the same file under reworded arguments is not new). ``command`` is the command text of a command execution,
    else None. ``check`` is :data:`~.checks.PASSED`, :data:`~.checks.FAILED` or :data:`~.checks.NONE` (module
    docstring, "Check"); ``summary`` the runner summary line its output ends with (for a failed check without one,
    its output's last line), or "".
    """

    tool: str
    call_key: bytes
    target: tuple[str, ...]
    result_key: bytes
    error: bool
    mutation: str
    command: str | None
    identity: bytes
    observation: bytes
    check: str = checks.NONE
    summary: str = ""


def receipt(use: ToolUse, output: ToolOutput | None, schema: Mapping[str, Any] | None,
            mutating_tools: frozenset[str] = frozenset()) -> Receipt:
    """The receipt of one call. ``schema`` is the tool's argument schema from the request, None if not offered."""
    level = mutation_level(use.name, use.arguments, schema, mutating_tools)
    command = command_text(use.arguments)
    runner = is_runner(schema, use.arguments)
    is_command = bool(command and command.strip()) and (runner or level == NONE)
    call_key = digest(use.name, use.arguments)
    target = targets(use.arguments)
    result_key = result_digest(output.text) if output is not None else b""
    error = failed(output, command if is_command else None)
    check, line = checks.NONE, ""
    if is_command and command is not None and not checks.is_inspection(command):
        check_command = checks.is_check_command(command)
        found = checks.summary(output.text, check_command) if output is not None else None
        # A check that writes into a pipe and shows no runner summary told nothing (the pipe's status is its last
        # command's); nor did one whose runner could not start, nor one whose success no status or flag told.
        if found is not None or (check_command and not (error and output is not None
                                                          and checks.runner_missing(output.text))
                                 and (error or (not checks.piped_check(command) and output is not None
                                                and _told_success(output)))):
            error = error or (found is not None and found.outcome == checks.FAILED)
            check = checks.FAILED if error else checks.PASSED
            line = found.line if found else checks.last_line(output.text) if error and output is not None else ""
    identity = digest(call_key.hex(), result_key.hex(), error)
    observation = digest(use.name, list(target) if target else call_key.hex(), result_key.hex(), error)
    return Receipt(use.name, call_key, target, result_key, error, level, command if is_command else None,
                   identity, observation, check, line)


CACHED_BYTES = 64 << 20
"""Memory the receipt caches of all sessions keep at most, together (:data:`POOL`). Reuse pays when a session reads
its history again from the start (a rewrite), which only the sessions active now do: 64 MiB keeps some 60 full
turns of 2,048 calls each, where a bound per session (1.1 MB at 2,048 receipts) would let the 1,024 sessions a
process holds (``[proxy] max_sessions``) keep 1.1 GB."""
ENTRY_BYTES = 560
"""Memory a kept receipt takes besides its strings, measured (tracemalloc, CPython 3.11): the receipt and its four
16-byte digests (about 325 bytes), its entry in :class:`ReceiptPool` with its key (about 125), and the room the
pool's table keeps for entries dropped while it turns over (up to about 110)."""


class ReceiptPool:
    """The receipts every :class:`ReceiptCache` of a process keeps, by key, the least recently used dropped first
    once they take more than ``limit`` bytes (:func:`_size`): a session idle since does not hold memory an active
    one could reuse. A key names its cache's receipts alone (:class:`ReceiptCache` salts it). Not locked: one thread
    uses a pool (the proxy's event loop, where histories are read; a worker thread unpickling a state makes caches
    of it, which read no receipt)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        """Bytes the kept receipts take (:func:`_size`)."""
        self._found: OrderedDict[bytes, Receipt] = OrderedDict()

    def __len__(self) -> int:
        return len(self._found)

    def get(self, key: bytes) -> Receipt | None:
        """The receipt kept under ``key``, now the most recently used; None if not kept."""
        found = self._found.get(key)
        if found is not None:
            self._found.move_to_end(key)
        return found

    def put(self, key: bytes, found: Receipt) -> None:
        """Keep ``found`` under ``key`` (new to this pool), dropping the least recently used receipts past
        :attr:`limit`; a receipt larger than the limit alone is not kept, and drops nothing."""
        size = _size(found)
        if size > self.limit:
            return
        self._found[key] = found
        self.size += size
        while self.size > self.limit:
            self.size -= _size(self._found.popitem(last=False)[1])


def _size(found: Receipt) -> int:
    """The bytes ``found`` keeps alive in a :class:`ReceiptPool`: :data:`ENTRY_BYTES` and its strings (an agent
    writing files through its shell, ``cat > f <<EOF``, makes commands of many KB). A string shared with another
    object is counted all the same: the bound errs low."""
    size = ENTRY_BYTES + sys.getsizeof(found.tool) + len(found.summary)
    if found.target:
        size += sys.getsizeof(found.target) + sum(map(sys.getsizeof, found.target))
    if found.command is not None:
        size += sys.getsizeof(found.command)
    return size


POOL = ReceiptPool(CACHED_BYTES)
"""The process's receipts (:class:`ReceiptCache`'s default pool)."""
_CACHES = itertools.count()
"""Numbers each :class:`ReceiptCache` of the process, its keys' salt."""


class ReceiptCache:
    """Receipts by content, so a history read again from its start (rewritten: compaction, an edit, a summary in
    front) computes only the receipts of calls it has not seen before.

    A receipt is a pure function of the call's tool name and arguments, its result's text and error flag (or the
    result's absence), whether the tool is a runner (the only thing its schema decides) and the mutating tools: the
    key is a digest of all of them but the last, which is fixed per cache (``mutating_tools``), salted with this
    cache's own number, so a session finds its own receipts alone. Digesting a result reads its whole text once, in
    C, and keeps 16 bytes of it; computing its receipt masks and scans it in Python, several times the cost. The
    receipts are kept in ``pool`` (by default the process's, :data:`POOL`, bounded in bytes across sessions); a
    call whose arguments are nested too deep to digest (:data:`UNSERIALISABLE`) is computed each time. Its state
    (``__getstate__``, what a pickle holds) is its ``mutating_tools`` alone: the receipts are this process's
    memory, never part of a stored session state; unpickled, it is a new cache of :data:`POOL`."""

    def __init__(self, mutating_tools: frozenset[str] = frozenset(), pool: ReceiptPool | None = None) -> None:
        self.mutating_tools = mutating_tools
        self.pool = pool if pool is not None else POOL
        self._salt = next(_CACHES).to_bytes(16, "little")

    def __getstate__(self) -> dict[str, Any]:
        return {"mutating_tools": self.mutating_tools}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ReceiptCache.__init__(self, state["mutating_tools"])  # a new cache of POOL, its own salt

    def receipt(self, use: ToolUse, output: ToolOutput | None, schema: Mapping[str, Any] | None) -> Receipt:
        """:func:`receipt` of the call, the one computed before for the same content if the pool kept it."""
        head = digest(use.name, use.arguments, is_runner(schema, use.arguments),
                      "absent" if output is None else output.is_error)
        if head == UNSERIALISABLE:  # arguments nested past what a digest reads: the key would be every such call's
            return receipt(use, output, schema, self.mutating_tools)
        hasher = hashlib.blake2b(head, digest_size=16, salt=self._salt)
        if output is not None:
            hasher.update(output.text.encode("utf-8", "surrogatepass"))
        key = hasher.digest()
        found = self.pool.get(key)
        if found is None:
            found = receipt(use, output, schema, self.mutating_tools)
            self.pool.put(key, found)
        return found


@dataclass(frozen=True, slots=True)
class Round:
    """One model decision. ``index`` is the history position where it starts (its first assistant item, or the
    repeated prompt of an implied round). ``receipts`` is empty for a turn without tool calls, whose text is
    ``text_key`` (:data:`UNRECORDED` for an implied round: a turn the client dropped from its history)."""

    index: int
    receipts: tuple[Receipt, ...] = ()
    text_key: bytes | None = None
    implied: bool = False

    @property
    def key(self) -> bytes:
        """Order-free identity of the round: its calls with their results, or its text."""
        if self.receipts:
            return digest(sorted(r.identity.hex() for r in self.receipts))
        return digest("text", (self.text_key or b"").hex())


_REPROMPT = re.compile(
    r"exactly (?:one|1|_one_) (?:action|function call|tool call|command|code block)"
    r"|found \d+ (?:actions|code blocks|commands)"
    r"|\bformat(?:ting)? error|(?:was|were|is) not (?:formatted|parsed) correctly|incorrectly formatted"
    r"|(?:could not|couldn't|unable to|failed to) parse (?:your|the) (?:last |previous )?"
    r"(?:output|response|reply|action)"
    r"|\bno tool calls? (?:were |was )?(?:found|detected|provided|present|made)"
    r"|(?:did not|didn't|does not|doesn't) (?:use|include|contain|make|call) any (?:tool|function)"
    r"|(?:your|the) (?:last |previous )?(?:output|response|reply|message) (?:was )?(?:malformed|invalid|empty)"
    r"|(?:please )?(?:resend|re-send|retry) (?:your|the) (?:last |previous )?(?:output|response|reply|action)",
    re.I)
REPROMPT_CHARS = 4_000
"""A harness's re-prompt is short boilerplate; a longer message is a user's own, whatever it says."""


def is_reprompt(text: str, previous: str | None) -> bool:
    """Whether a user message is a harness's re-prompt rather than a genuine user turn: it repeats the previous
    prompt (``previous``), or, within its first :data:`REPROMPT_CHARS` characters, says the model's previous
    output was malformed, had no tool call or must be resent (mini-swe-agent's "Please always provide EXACTLY ONE
    action", SWE-agent's "Your output was not formatted correctly", "No tool calls found in the response")."""
    if previous is not None and text == previous:
        return True
    return len(text) <= REPROMPT_CHARS and _REPROMPT.search(text) is not None


@dataclass(frozen=True, slots=True)
class UserTurn:
    """A genuine user turn at history position ``index``: it resets the detectors' windows."""

    index: int


@dataclass
class _OpenRound:
    index: int
    text: list[str] = field(default_factory=list)
    uses: list[ToolUse] = field(default_factory=list)
    outputs: dict[str, ToolOutput] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    """Ids of ``uses`` without an output yet: a set, so a round of N calls and N result messages costs O(N),
    not O(N^2) (10,000 calls in one message, issue 7)."""


class RoundReader:
    """Reads history messages in order and yields rounds and genuine user turns. Feed each message once.

    Pairing (mechanics reference 11.4): consecutive assistant items form one round (Responses sends a message item
    and function-call items separately); results are paired with its calls by id; a round ends when every call
    has its result, or when the next user or assistant item starts (a result that never came is a failure).

    User messages: a **re-prompt** (:func:`is_reprompt`: a harness complaining about the model's previous output,
    or a message repeating the previous user text with no tool round in between) continues the current turn; when
    the model's answer it complains about was not recorded (no assistant item since the previous user message or
    the last tool round), the client dropped it, and an implied round without tool calls stands in for it. Every
    other user message is a genuine :class:`UserTurn`. A re-prompt neither resets the detectors' windows nor moves
    the turn's start (the verify-gate's digest window, the plan's turn). A user message that is only harness
    context (:func:`~proxyvisor.transcript.harness_context`: Codex's environment, a Claude Code reminder alone) is
    not read at all: it neither starts a turn nor ends a round.
    """

    def __init__(self, mutating_tools: frozenset[str] = frozenset(), cache: ReceiptCache | None = None) -> None:
        self.mutating_tools = mutating_tools
        self.cache = cache if cache is not None else ReceiptCache(mutating_tools)
        """Where receipts come from: a tracker passes its own, kept across the readers of a thread's rewrites
        (its ``mutating_tools`` must be this reader's)."""
        self._open: _OpenRound | None = None
        self._last_prompt: str | None = None
        self._answered = True
        """Whether an assistant item came since the previous user message or the last tool round."""
        self._tool_rounds_since_prompt = 0
        self.turn_receipts: dict[str, Receipt] = {}
        """The receipts of the current user turn's calls, by call id (the verify-gate reads them instead of
        computing them again); a new dict at each genuine user turn. A dict only ever gains calls, at its end: a
        call id used again (a client numbering each round's calls from 0) makes a new dict with that call's new
        receipt, so a reader that kept what it saw of this dict (the session state's stored chunks) knows it by
        identity and length."""

    def feed(self, index: int, message: Message, schemas: Mapping[str, Mapping[str, Any]]) -> list[Round | UserTurn]:
        """The rounds and user turns completed by ``message`` (at history position ``index``)."""
        out: list[Round | UserTurn] = []
        role = message.role
        if role == "assistant":
            if self._open is not None and self._open.outputs:
                out += self._close(schemas)
            self._answered = True
            if self._open is None:
                self._open = _OpenRound(index)
            if message.text:
                self._open.text.append(message.text)
            self._open.uses += message.tool_uses
            self._open.missing.update(u.id for u in message.tool_uses if u.id not in self._open.outputs)
        elif role == "tool":
            if self._open is not None and self._open.uses:
                for result in message.tool_outputs:
                    self._open.outputs.setdefault(result.call_id, result)
                    self._open.missing.discard(result.call_id)
                if not self._open.missing:
                    out += self._close(schemas)
        elif role == "user" and not harness_context(message.text):
            if self._open is not None:
                out += self._close(schemas)
            previous = self._last_prompt if not self._tool_rounds_since_prompt else None
            if is_reprompt(message.text, previous) and self._last_prompt is not None:
                if not self._answered:
                    out.append(Round(index, text_key=UNRECORDED, implied=True))
            else:
                out.append(UserTurn(index))
                self.turn_receipts = {}
            self._last_prompt = message.text
            self._answered = False
            self._tool_rounds_since_prompt = 0
        return out

    def _close(self, schemas: Mapping[str, Mapping[str, Any]]) -> list[Round]:
        open_round, self._open = self._open, None
        assert open_round is not None
        if not open_round.uses:
            return [Round(open_round.index, text_key=digest("".join(open_round.text)))]
        self._tool_rounds_since_prompt += 1
        self._answered = False
        receipts = tuple(self.cache.receipt(u, open_round.outputs.get(u.id), schemas.get(u.name))
                         for u in open_round.uses)
        if any(u.id in self.turn_receipts for u in open_round.uses):
            self.turn_receipts = dict(self.turn_receipts)
        self.turn_receipts.update((u.id, r) for u, r in zip(open_round.uses, receipts))
        return [Round(open_round.index, receipts)]


def read_rounds(messages: Iterable[Message], schemas: Mapping[str, Mapping[str, Any]] | None = None,
                mutating_tools: frozenset[str] = frozenset()) -> list[Round | UserTurn]:
    """All complete rounds and user turns of a whole history (a convenience over :class:`RoundReader`)."""
    reader = RoundReader(mutating_tools)
    out: list[Round | UserTurn] = []
    for index, message in enumerate(messages):
        out += reader.feed(index, message, schemas or {})
    return out
