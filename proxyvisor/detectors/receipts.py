"""Receipts and rounds: what each tool call did, read from the agent's own history.

A **receipt** is one tool call with its result: the tool, its arguments, the target it addresses, a digest of its
result, whether it failed, and whether it changed something. A **round** is one model decision: the tool calls
of one assistant turn (a parallel batch is one round) with their results, or a turn without tool calls. Rules
(``reference/in-session-supervisor-mechanics.md`` sections 2 and 11.4; seed 003 "Detectors"):

- **Target**: the non-empty strings (or string-list elements) under argument keys whose lowercase name contains
  ``path`` or ``file``, with a leading ``./`` removed.
- **Error**: the client's flag (Anthropic ``is_error: true``) wins; otherwise an exit status in the head or tail of
  the output (``Exit code 1``, ``<returncode>1</returncode>``, ``Process exited with code 2``...) decides;
  otherwise an explicit ``is_error: false`` means success; otherwise error markers in the head or tail of the
  output (a Python traceback, ``command not found``, ``No such file or directory``, ``error:`` lines...). A call
  whose result never arrived counts as failed.
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
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..proxy.formats.transcript import Message, ToolOutput, ToolUse

INTENT_WORDS = frozenset(
    "write edit create replace apply insert delete remove patch mkdir rename move update set send publish post "
    "upload schedule book approve reject cancel deploy install commit push merge".split())

NONE, GUESSED, DECLARED = "none", "guessed", "declared"
"""Mutation levels: not a mutation; a runner whose command text reads as a write; declared by name or schema."""

UNRECORDED = b"unrecorded"
"""The text key of an implied round: a turn the client did not keep in its history."""

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NON_WORD = re.compile(r"[^A-Za-z0-9]+")
_SHELL_WRITE = re.compile(
    r"(?:^|[\s;&|(`])(?:sed\s+(?:-\w*\s+)*-i|rm|rmdir|mv|cp|mkdir|touch|tee|chmod|chown|ln|truncate|dd|patch|"
    r"git\s+(?:apply|commit|checkout|reset|rm|mv|add|merge|rebase|stash|restore|cherry-pick|push|am|switch)|"
    r"(?:pip3?|uv\s+pip|npm|pnpm|yarn|apt(?:-get)?|brew|cargo|go)\s+(?:install|add|i|uninstall|remove)|"
    r"make\s+install)(?=\s|$|;)"
    r"|(?<![0-9&>])>>?\s*(?!&|/dev/null)[^\s&|;>]", re.M)
_EXIT = re.compile(
    r"<returncode>\s*(-?\d+)\s*</returncode>|\bexit(?:ed)?(?: with)?(?: status| code)\s*[:=]?\s*(-?\d+)"
    r"|\breturn ?code\s*[:=]?\s*(-?\d+)|\bexit_code[\"']?\s*[:=]\s*(-?\d+)", re.I)
_ERROR_MARKERS = re.compile(
    r"Traceback \(most recent call last\)|<tool_use_error>|command not found|No such file or directory|"
    r"Permission denied|\berror\(s\)|^(?:error|fatal|Error|ERROR|FATAL)\b[^\n]{0,40}?:|^\w*(?:Error|Exception): ",
    re.M)
_EDGE = 400  # characters of an output's head and tail that exit statuses and error markers are read from
# Every branch starts at a word boundary, written as a look-behind so the engine rejects most positions at once
# (three times faster than a leading \b on each branch).
_VOLATILE = re.compile(
    r"(?<![0-9A-Za-z_])(?:"
    r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
    r"|\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"
    r"|\d+(?:\.\d+)?\s?(?:ms|s|sec|secs|seconds|milliseconds|us|µs|ns|min|minutes)\b"
    r"|0x[0-9a-fA-F]+\b"
    r"|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    r"|(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{6,16}\b)")
_MASK_LIMIT = 64 * 1024  # beyond this many characters an output is digested as it is (masking costs O(size))


def digest(*parts: Any) -> bytes:
    """A 16-byte digest of JSON-serialisable ``parts`` (keys sorted, so argument order does not matter).

    Values nested deeper than orjson serialises (254 levels) are digested from their ``repr`` instead."""
    try:
        data = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        try:
            data = repr(parts).encode("utf-8", "surrogatepass")
        except RecursionError:
            data = b"unserialisable"
    return hashlib.blake2b(data, digest_size=16).digest()


def result_digest(text: str) -> bytes:
    """The digest of a tool output with its volatile fields masked (module docstring)."""
    if len(text) <= _MASK_LIMIT:
        text = _VOLATILE.sub("#", text)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def words(text: str) -> set[str]:
    """Lowercase words of ``text`` with camelCase split (``SetCookie`` gives ``set`` and ``cookie``)."""
    return set(_NON_WORD.sub(" ", _CAMEL.sub(" ", text)).lower().split())


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


def mutation_level(name: str, arguments: Mapping[str, Any], schema: Mapping[str, Any] | None,
                   mutating_tools: frozenset[str]) -> str:
    """:data:`NONE`, :data:`GUESSED` or :data:`DECLARED` for one call (module docstring, "Mutation")."""
    if name in mutating_tools:
        return DECLARED
    if is_runner(schema, arguments):
        command = command_text(arguments) or ""
        return GUESSED if words(command) & INTENT_WORDS or _SHELL_WRITE.search(command) else NONE
    if words(name) & INTENT_WORDS:
        return DECLARED
    for key in ("command", "action", "operation"):
        value = arguments.get(key)
        if isinstance(value, str) and words(value) & INTENT_WORDS:
            return DECLARED
    return NONE


def failed(output: ToolOutput | None) -> bool:
    """Whether a tool result reports failure (module docstring, "Error"); a missing result counts as failed."""
    if output is None:
        return True
    if output.is_error:
        return True
    text = output.text
    edges = text if len(text) <= 2 * _EDGE else text[:_EDGE] + "\n" + text[-_EDGE:]
    for match in _EXIT.finditer(edges):
        code = next(g for g in match.groups() if g is not None)
        return int(code) != 0
    if output.is_error is False:
        return False
    return _ERROR_MARKERS.search(edges) is not None


@dataclass(frozen=True, slots=True)
class Receipt:
    """One tool call and its result, reduced to what the detectors compare (keys are 16-byte digests).

    ``call_key`` covers the tool and its arguments; ``result_key`` the masked result; ``identity`` the whole call
    (tool, arguments, result, error status: what a loop repeats); ``observation`` what was learnt (the target, or
    with none the whole call, with the result and error status: what novelty compares, so the same output for
    the same file under reworded arguments is not new). ``command`` is the command text of a command execution,
    else None.
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
    error = failed(output)
    identity = digest(call_key.hex(), result_key.hex(), error)
    observation = digest(use.name, list(target) if target else call_key.hex(), result_key.hex(), error)
    return Receipt(use.name, call_key, target, result_key, error, level, command if is_command else None,
                   identity, observation)


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

    User messages: a message that repeats the previous user text with no tool round in between is a **repeated
    prompt** (a harness re-asking, e.g. "No tool calls found in the response"), not a genuine turn; when no turn
    at all was recorded since the previous prompt, the client dropped the model's answer, and an implied round
    without tool calls stands in for it. Every other user message is a :class:`UserTurn`.
    """

    def __init__(self, mutating_tools: frozenset[str] = frozenset()) -> None:
        self.mutating_tools = mutating_tools
        self._open: _OpenRound | None = None
        self._last_prompt: str | None = None
        self._rounds_since_prompt = 0
        self._tool_rounds_since_prompt = 0
        self.turn_receipts: dict[str, Receipt] = {}
        """The receipts of the current user turn's calls, by call id (the verify-gate reads them instead of
        computing them again); emptied at each genuine user turn."""

    def feed(self, index: int, message: Message, schemas: Mapping[str, Mapping[str, Any]]) -> list[Round | UserTurn]:
        """The rounds and user turns completed by ``message`` (at history position ``index``)."""
        out: list[Round | UserTurn] = []
        role = message.role
        if role == "assistant":
            if self._open is not None and self._open.outputs:
                out += self._close(schemas)
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
        elif role == "user":
            if self._open is not None:
                out += self._close(schemas)
            repeated = message.text == self._last_prompt and not self._tool_rounds_since_prompt
            if repeated and not self._rounds_since_prompt:
                out.append(Round(index, text_key=UNRECORDED, implied=True))
            elif not repeated:
                out.append(UserTurn(index))
                self.turn_receipts = {}
            self._last_prompt = message.text
            self._rounds_since_prompt = self._tool_rounds_since_prompt = 0
        return out

    def _close(self, schemas: Mapping[str, Mapping[str, Any]]) -> list[Round]:
        open_round, self._open = self._open, None
        assert open_round is not None
        self._rounds_since_prompt += 1
        if not open_round.uses:
            return [Round(open_round.index, text_key=digest("".join(open_round.text)))]
        self._tool_rounds_since_prompt += 1
        receipts = tuple(receipt(u, open_round.outputs.get(u.id), schemas.get(u.name), self.mutating_tools)
                         for u in open_round.uses)
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
