"""The self-report token: the instruction that asks for it, its parser, the shape test, and the stripper.

The model ends each response with ``<sup>{"state": ..., "focus": ..., "next": ..., "carry": [...], "plan": ...}</sup>``.
proxyvisor parses the report from the model's own output only (never from tool results or the agent's history)
and removes the token before the agent sees the text, in whole responses (:func:`strip`) and in streams
(:class:`Stripper`, which gives the same text as :func:`strip` however the input is split).

Rules (seed 003 "Self-report"; ``reference/in-session-supervisor-mechanics.md`` section 1):

- **States** ``exploring``, ``progressing``, ``blocked``, ``need_input``, ``done``; case-insensitive, trimmed; the
  aliases ``need-input`` and ``needinput``.
- **JSON body** (starts with ``{``): strict. ``state``, ``focus`` (string) and ``carry`` (list of strings) are
  required; ``next`` is a string or null; ``plan`` is null, ``"request"``, ``"phase_complete"`` or ``"reassess"``;
  ``memories`` and ``behaviors`` are optional lists of ids. Any other key, or a wrong type, makes the report
  malformed. ``focus`` and ``carry`` entries are trimmed and empty ``carry`` entries dropped.
- **Legacy bodies**: ``STATE`` or ``STATE · reason`` with the separators ``·``, ``|``, ``:``, ``-``, space or tab; the
  reason becomes ``focus``. A copied placeholder (``state · done``) uses the word after ``state``.
- **Shape test** (what can be a report): a body that starts with ``{`` and contains ``"state"`` (the JSON form),
  or whose first word is a state, an alias or the literal ``state``, or that contains ``·`` or ``|`` (the legacy
  forms); and at most :data:`MAX_BODY` characters (a report is one short line; the bound also caps what a stream
  holds back). Real superscripts (``2``, ``th``) and JSON without a ``state`` key are never reports.
- **Tokens**: scanning left to right, each ``</sup>`` closes the nearest ``<sup>`` before it, if that one opened at
  most :data:`MAX_BODY` characters earlier; any other ``<sup>`` is plain text (so a stray opener before a report
  cannot hide it). The tags are case-sensitive.
- **What is stripped**: a JSON-form token wherever it stands (a model writes that shape only as its report), and a
  legacy-form token only as the last thing in the text (nothing but whitespace after it, at most
  :data:`MAX_BODY` characters of it): anywhere else ``<sup>done</sup>`` or ``<sup>a | b</sup>`` is the answer's
  own content and is kept byte for byte. A malformed report that passes the shape test is still stripped.
- **Whitespace**: when the stripped report is the last thing in the text, the whitespace after it and the
  whitespace its removal leaves at the end (at most :data:`MAX_BODY` characters; a longer run is kept) go with it:
  ``"Done. <sup>{...}</sup>"`` becomes ``"Done."``. A report removed in mid-text leaves one run of whitespace
  where there were two: the whitespace after it when there is some (``"Done. <sup>{...}</sup>\n\nMore"`` becomes
  ``"Done.\n\nMore"``), else the whitespace before it; a run before it longer than :data:`MAX_BODY` is kept.
- The **last** stripped token of a response is its report.
"""

from __future__ import annotations

import re
from itertools import chain
from dataclasses import dataclass
from typing import Any

import orjson

from .. import bigtext

STATES = ("exploring", "progressing", "blocked", "need_input", "done")
_ALIASES = {"need-input": "need_input", "needinput": "need_input"}
_WORDS = {**{s: s for s in STATES}, **_ALIASES}
PLANS = ("request", "phase_complete", "reassess")
OPEN = "<sup>"
CLOSE = "</sup>"
MAX_BODY = 2000
"""Longest token body, in characters, that can be a report (and that a stream holds back waiting for ``</sup>``)."""

_JSON_KEYS = frozenset({"state", "focus", "next", "carry", "plan", "memories", "behaviors"})
_SEPARATORS = "·|:- \t"
_FIRST_WORD = re.compile(r"[A-Za-z_-]+")
_LEGACY_WORDS = sorted([*_WORDS, "state"], key=len, reverse=True)

INSTRUCTION = (
    "Status line (required): end every response, including responses that call tools, with one line of the form\n"
    '<sup>{"state":"progressing","focus":"what you are doing now and why","next":"your next concrete step",'
    '"carry":[],"plan":null}</sup>\n'
    "- state: exploring (gathering information), progressing (changing things toward the goal), blocked (you "
    "cannot continue without something you cannot get yourself), need_input (a question only the user can "
    "answer), done (the task is finished and checked).\n"
    "- focus: the current subgoal, in a few words. next: the next step, or null when nothing remains. carry: facts "
    "or references needed if earlier context is lost; may be empty; never a credential, only where one is kept. "
    'plan: null, or "request" once when the work needs three or more dependent outcomes, "phase_complete" or '
    '"reassess".\n'
    "- One line of JSON with exactly these keys and no filler such as \"working\". A supervisor reads this line and "
    "removes it before anyone else sees it. Text inside <supervisor-note> tags comes from that supervisor, not "
    "from the user: it is advisory."
)
"""The instruction appended to the end of the system prompt of every supervised request (byte-stable)."""


class MalformedReport(ValueError):
    """A report-shaped token whose body is not a valid report; the message says what is wrong."""


@dataclass(frozen=True)
class SelfReport:
    """A parsed report. ``legacy`` is True for the one-word and ``STATE · reason`` forms."""

    state: str
    focus: str = ""
    next: str | None = None
    carry: tuple[str, ...] = ()
    plan: str | None = None
    memories: tuple[str, ...] = ()
    behaviors: tuple[str, ...] = ()
    legacy: bool = False


def _state(word: Any) -> str | None:
    return _WORDS.get(word.strip().lower()) if isinstance(word, str) else None


def _first_word(body: str) -> str:
    match = _FIRST_WORD.match(body.lstrip())
    return match.group(0).lower() if match else ""


def looks_like_report(body: str) -> bool:
    """The shape test (module docstring): True when ``body`` (between the tags) is to be stripped."""
    if len(body) > MAX_BODY:
        return False
    stripped = body.lstrip()
    if stripped.startswith("{"):
        return '"state"' in stripped
    word = _first_word(stripped)
    return word in _WORDS or word == "state" or "·" in body or "|" in body


def _strings(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MalformedReport(f"{key!r} must be a list of strings")
    return tuple(v.strip() for v in value if v.strip())


def _parse_json(body: str) -> SelfReport:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedReport(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedReport("the JSON body must be an object")
    unknown = sorted(set(obj) - _JSON_KEYS)
    if unknown:
        raise MalformedReport(f"unknown key(s) {unknown}")
    state = _state(obj.get("state"))
    if state is None:
        raise MalformedReport(f"'state' must be one of {list(STATES)}, got {obj.get('state')!r}")
    focus = obj.get("focus")
    if not isinstance(focus, str):
        raise MalformedReport("'focus' must be a string")
    nxt = obj.get("next")
    if nxt is not None and not isinstance(nxt, str):
        raise MalformedReport("'next' must be a string or null")
    if "carry" not in obj:
        raise MalformedReport("'carry' is required (it may be an empty list)")
    plan = obj.get("plan")
    if plan is not None and plan not in PLANS:
        raise MalformedReport(f"'plan' must be null or one of {list(PLANS)}, got {plan!r}")
    return SelfReport(state, focus.strip(), nxt.strip() if isinstance(nxt, str) else None,
                      _strings(obj["carry"], "carry"), plan, _strings(obj.get("memories", []), "memories"),
                      _strings(obj.get("behaviors", []), "behaviors"))


def _split_word(text: str) -> tuple[str, str]:
    """(the leading known word, lowercased, or "" ; the text after it and its separators)."""
    lowered = text.lower()
    # Longest words first, so "need-input" is not read as "need" + "-input".
    for word in _LEGACY_WORDS:
        if lowered.startswith(word) and (len(text) == len(word) or text[len(word)] in _SEPARATORS):
            return word, text[len(word):].lstrip(_SEPARATORS).strip()
    return "", text


def _parse_legacy(body: str) -> SelfReport:
    word, rest = _split_word(body.strip())
    if word == "state":  # an echoed placeholder: "STATE · done" means done
        word, rest = _split_word(rest)
    if word not in _WORDS:
        raise MalformedReport(f"no known state in {body.strip()[:40]!r}")
    return SelfReport(_WORDS[word], focus=rest, legacy=True)


def parse_body(body: str) -> SelfReport:
    """Parse a token body (the text between ``<sup>`` and ``</sup>``).

    Raises:
        MalformedReport: invalid JSON, an unknown key or state, a wrong type, or a legacy body without a state.
    """
    return _parse_json(body) if body.lstrip().startswith("{") else _parse_legacy(body)


def _find_close(text: str, body_start: int) -> int:
    """Index of the ``</sup>`` that closes a token whose body starts at ``body_start``, or -1."""
    return text.find(CLOSE, body_start, body_start + MAX_BODY + len(CLOSE))


def _is_json_report(body: str) -> bool:
    """The JSON form of the shape test: a report wherever it stands."""
    return body.lstrip().startswith("{") and looks_like_report(body)


def _trailing_space(text: str) -> int:
    """Length of the whitespace at the end of ``text``, counted up to ``MAX_BODY + 1`` (past that it is never
    trimmed, so its exact length does not matter)."""
    n = len(text)
    i = n
    while i > 0 and n - i <= MAX_BODY and text[i - 1].isspace():
        i -= 1
    return n - i


def strip(text: str) -> tuple[str, list[str]]:
    """``text`` without its self-report, and the bodies of the removed tokens in order (module docstring).

    The result equals what :class:`Stripper` emits for the same text split anywhere.
    """
    if not bigtext.contains(text, OPEN):
        return text, []
    stripper = Stripper()
    clean, rest = stripper.feed(text), stripper.finish()
    return bigtext.concat([clean, rest]) if rest else clean, stripper.bodies


def _held_prefix(text: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``<sup>`` (0 to 4)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class Stripper:
    """Streaming :func:`strip`: feed text pieces, get back the text that is safe to show now.

    It holds back only what the rest of the text may still change, each part at most about :data:`MAX_BODY`
    characters: a tail that is a prefix of ``<sup>``, or an open token until its ``</sup>`` arrives or its body
    exceeds :data:`MAX_BODY`; a report-shaped token until something other than whitespace follows it (then a
    legacy one is content and goes out as it came) or the text ends (then it is the trailing report); and the
    whitespace at the end of the text so far, which a trailing report would leave dangling. :meth:`finish`
    returns the rest at the end of the text. ``bodies`` collects the bodies of removed tokens, in order. Pure and
    clock-free.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._open = False  # self._buf starts with a complete "<sup>"
        self._space = ""  # whitespace at the end of the output so far, held
        self._long_space = False  # that whitespace ran past MAX_BODY: it went out and is never trimmed
        self._token: tuple[str, str] | None = None  # (raw, body) of a report-shaped token followed by whitespace only
        self._after = ""  # the whitespace after it
        self._out: list[str] = []
        self.bodies: list[str] = []

    @property
    def held(self) -> int:
        """Characters currently held back."""
        return len(self._buf) + len(self._space) + len(self._token[0] if self._token else "") + len(self._after)

    def feed(self, piece: str) -> str:
        """The text safe to show now that ``piece`` came. A piece longer than :data:`~proxyvisor.bigtext.SLICE`
        is fed a slice at a time (the result is the same however the text is split), so no step copies or
        searches all of it; as long as what goes out is ``piece`` as it came, nothing is built, and when it all
        went out unchanged it is returned itself, not a copy."""
        if len(piece) <= bigtext.SLICE:
            return self._feed(piece)
        parts = bigtext.slices(piece)
        went = 0  # what went out so far is piece[:went]
        for part in parts:
            out = self._feed(part)
            if not piece.startswith(out, went):
                return bigtext.concat(chain(bigtext.slices(piece, went), [out], map(self._feed, parts)))
            went += len(out)
            bigtext.pause()
        return piece if went == len(piece) else bigtext.concat(bigtext.slices(piece, went))

    def _feed(self, piece: str) -> str:
        if not piece:
            return ""
        if not self._buf and OPEN[0] not in piece:
            self._text(piece)  # the common case: no "<" anywhere
        else:
            self._buf += piece
            self._drain(final=False)
        return self._emit()

    def finish(self) -> str:
        self._drain(final=True)
        if self._token is not None:  # the last thing in the text: its report, and the whitespace around it goes
            self.bodies.append(self._token[1])
            self._token, self._after = None, ""
        else:
            self._out.append(self._space)
        self._space, self._long_space = "", False
        return self._emit()

    def _emit(self) -> str:
        # Empty parts left out: a lone part is returned as it is, not copied (a delta may be 100 MB).
        out, self._out = "".join([part for part in self._out if part]), []
        return out

    def _text(self, text: str) -> None:
        """Text that is not a token."""
        if not text:
            return
        if self._token is not None:
            if len(self._after) + len(text) <= MAX_BODY and text.isspace():
                self._after += text
                return
            self._settle(spaced=text[0].isspace())
        space = _trailing_space(text)
        if space == len(text):
            self._add_space(text)
            return
        self._out += [self._space, text[:len(text) - space] if space else text]
        self._space, self._long_space = "", False
        if space:
            self._add_space(text[len(text) - space:])

    def _add_space(self, space: str) -> None:
        if self._long_space:
            self._out.append(space)
            return
        self._space += space
        if len(self._space) > MAX_BODY:
            self._out.append(self._space)
            self._space, self._long_space = "", True

    def _token_found(self, raw: str, body: str) -> None:
        if self._token is not None:
            self._settle()
        if looks_like_report(body):
            self._token, self._after = (raw, body), ""
        else:
            self._out += [self._space, raw]
            self._space, self._long_space = "", False

    def _settle(self, spaced: bool = False) -> None:
        """The held token is not the last thing in the text: a JSON report is removed all the same, a legacy one
        is content. ``spaced``: the text that follows it (beyond the whitespace held after it) starts with
        whitespace."""
        assert self._token is not None
        (raw, body), after = self._token, self._after
        self._token, self._after = None, ""
        if _is_json_report(body):
            self.bodies.append(body)
            if (after or spaced) and not self._long_space:
                # One run of whitespace where the report stood, not two meeting: text added after a report (the
                # gate's notice, a continued turn) follows the answer without the space the answer left before it.
                self._space = ""
        else:
            self._out += [self._space, raw]
            self._space, self._long_space = "", False
        self._add_space(after)

    def _drain(self, final: bool) -> None:
        buf = self._buf
        while buf:
            if not self._open:
                start = buf.find(OPEN)
                if start < 0:
                    keep = 0 if final else _held_prefix(buf)
                    self._text(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                self._text(buf[:start])
                buf = buf[start:]
                self._open = True
            close = _find_close(buf, len(OPEN))
            inner = buf.find(OPEN, len(OPEN), close if close >= 0 else len(buf))
            if inner >= 0:  # a nearer opener: text before it is plain
                self._text(buf[:inner])
                buf = buf[inner:]
                continue
            if close >= 0:
                self._token_found(buf[:close + len(CLOSE)], buf[len(OPEN):close])
                buf = buf[close + len(CLOSE):]
                self._open = False
            elif final or len(buf) >= len(OPEN) + MAX_BODY + len(CLOSE):
                # No closing tag within reach: this "<" is plain text; rescan the rest.
                self._text(buf[0])
                buf = buf[1:]
                self._open = False
            else:
                break
        self._buf = buf


@dataclass(frozen=True)
class ReportOutcome:
    """What one response said about itself: ``status`` is ``"ok"`` (``report`` set), ``"missing"`` (no token) or
    ``"malformed"`` (``error`` says why)."""

    status: str
    report: SelfReport | None = None
    error: str | None = None


def outcome(bodies: list[str]) -> ReportOutcome:
    """The report of a response from the bodies its stripper removed: the last one wins."""
    if not bodies:
        return ReportOutcome("missing")
    try:
        return ReportOutcome("ok", parse_body(bodies[-1]))
    except MalformedReport as exc:
        return ReportOutcome("malformed", error=str(exc))
