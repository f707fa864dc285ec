"""The scripted upstream as the tool authorizer's judge: a fixed, deterministic answer to its two calls.

On the session's own route (or ``[supervisor.model] api_base = "scripted:"``) the authorizer's judge and
confirmation calls (``proxyvisor.gate.authorize``) reach the embedded scripted upstream, which recognises them by
their system prompts and answers from the document alone, with this policy (a plain word rule, not a judgement):

- the judge proposes a block for each call whose name or arguments hold a content word (3+ letters) of a
  prohibition in force, citing the prohibition's user turn and the call's ``command``/``cmd`` argument (else the
  call itself); otherwise it allows;
- the confirmation confirms when the cited argument holds a content word of the cited prohibition.

``proxyvisor demo``-style runs and the real-client tests use it; it stands for a judge, it measures nothing.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..gate.authorize import CONFIRM_INSTRUCTIONS, JUDGE_INSTRUCTIONS, TOOL_PATH
from ..gate.prohibitions import forbidden_words
from ..proxy.formats import WireFormat

MARKS = (JUDGE_INSTRUCTIONS[:60], CONFIRM_INSTRUCTIONS[:60])
_RULE = re.compile(r'user:(\d+): ("(?:[^"\\]|\\.)*")')
_CALL = re.compile(r"^\[call:([^\]]*)\] (\S+) (\{.*\})$", re.M)
_CITED = re.compile(r"^CITED PROHIBITION \(user:\d+\): (\".*\")$", re.M)
_ARGUMENT = re.compile(r"^CITED ARGUMENT \([^)]*\): (.*)$", re.M)


def _hits(rule: str, text: str) -> bool:
    lowered = text.lower()
    return any(len(word) >= 3 and word in lowered for word in forbidden_words(rule))


def answer(fmt: WireFormat, body: dict[str, Any]) -> str:
    """The answer text to a judge or confirmation call (module docstring)."""
    system, document = fmt.fingerprint_parts(body)
    if system.startswith(MARKS[1]):
        cited, argument = _CITED.search(document), _ARGUMENT.search(document)
        confirmed = bool(cited and argument and _hits(orjson.loads(cited[1]), argument[1]))
        return orjson.dumps({"confirmed": confirmed, "reason": "the cited argument does what the user prohibited"
                             if confirmed else "the argument does not name what the user prohibited"}).decode()
    line = next((x for x in document.splitlines() if x.startswith("PROHIBITIONS IN FORCE")), "")
    rules = [(int(turn), orjson.loads(text)) for turn, text in _RULE.findall(line)]
    blocks = []
    for call_id, name, arguments in _CALL.findall(document):
        args = orjson.loads(arguments)
        rule = next(((turn, text) for turn, text in rules if _hits(text, name + " " + arguments)), None)
        if rule is not None:
            path = next((f"/{key}" for key in ("command", "cmd") if key in args), TOOL_PATH)
            blocks.append({"call": call_id, "source": f"user:{rule[0]}", "path": path,
                           "reason": "The call does what the user prohibited"})
    return orjson.dumps({"blocks": blocks}).decode()
