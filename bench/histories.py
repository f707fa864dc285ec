"""Synthetic agent histories of a chosen size, in the three wire formats, for the benchmarks' size sweeps.

An agent's request, as Claude Code or Codex sends it on a long session: a long system prompt, a few dozen tool
schemas, a first user task, then many tool rounds (the model's short text and one tool call, the tool's output:
mostly a few hundred bytes to a few KB, now and then a large file or log of 30-60 KB). :class:`History` builds one
of about ``size`` bytes and hands out the bodies of that session as it goes on: ``body(n)`` is the history grown
by ``n`` further small rounds, each request the previous one plus one round, as an agent sends them. The bodies
are joined from pieces serialised once, so the load generator does not pay a full serialisation per request.
Nothing here is read from the corpus.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

from bench.common import MODEL, prose

FORMATS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
MARKER = "[bench:agent-history]"
"""In every history's first user message: the scripted upstream's step for it (:data:`TOOL_ROUND`) is marked so."""
TOOL_ROUND = {"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}], "until": "never " + "sent",
              "marker": MARKER}
"""The scripted upstream's answer to every request of these histories: a tool call, as mid-session (the turn goes
on, so no verify-gate runs: what is measured is the request side and the relay of the answer)."""
TOOLS = ("Bash", "Read", "Edit", "Grep", "Glob", "Write", "TodoWrite", "WebFetch")


def _tool_schemas(rng: random.Random, n: int) -> list[tuple[str, str, dict[str, Any]]]:
    names = list(TOOLS) + [f"mcp__tool_{i}" for i in range(n - len(TOOLS))]
    out = []
    for name in names[:n]:
        props = {f"arg_{j}": {"type": rng.choice(["string", "integer", "boolean"]), "description": prose(rng, 30)}
                 for j in range(5)}
        out.append((name, prose(rng, 150), {"type": "object", "properties": {"command": {"type": "string"}, **props},
                                           "required": ["command"], "additionalProperties": False}))
    return out


def _output(rng: random.Random, large: bool) -> str:
    lines = rng.randint(600, 1200) if large else rng.randint(5, 120)
    return "\n".join(f"{i:5d}  {prose(rng, rng.randint(4, 10))}" for i in range(lines))


class History:
    """One synthetic session in ``fmt`` (``chat``, ``messages`` or ``responses``) whose first body is about
    ``size`` bytes; ``stream`` sets the request's ``stream`` flag."""

    def __init__(self, fmt: str, size: int, stream: bool = False, seed: int = 11) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
        self.fmt, self.stream = fmt, stream
        self.rng = rng = random.Random(seed)
        self.system = prose(rng, 1500)
        self.tools = _tool_schemas(rng, 24)
        self.items: list[bytes] = [orjson.dumps(i) for i in self._user(
            f"{MARKER} Fix the failing tests in this repository, then tell me what was wrong.")]
        self.rounds = 0
        self.grown: list[bytes] = []
        while len(self.body(0)) < size:
            self.items += self._round(large=self.rounds % 12 == 5)

    @property
    def path(self) -> str:
        return PATHS[self.fmt]

    def body(self, n: int) -> bytes:
        """The request of this session with ``n`` small rounds more than the first one (bytes, JSON)."""
        while len(self.grown) < 2 * n:  # two items a round
            self.grown += self._round(large=False)
        items = b"[" + b",".join(self.items + self.grown[:2 * n]) + b"]"
        return self._wrap(items)

    def _wrap(self, items: bytes) -> bytes:
        head: dict[str, Any] = {"model": MODEL}
        tail: dict[str, Any] = {"stream": self.stream}
        if self.fmt == "chat":
            tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                     for n, d, p in self.tools]
            system = orjson.dumps({"role": "system", "content": self.system})
            items = b"[" + system + (b"," if len(items) > 2 else b"") + items[1:]
            tail.update(tools=tools, max_tokens=4096)
            key = b"messages"
        elif self.fmt == "messages":
            head.update(max_tokens=4096, system=[{"type": "text", "text": self.system}])
            tail["tools"] = [{"name": n, "description": d, "input_schema": p} for n, d, p in self.tools]
            key = b"messages"
        else:
            head["instructions"] = self.system
            tail["tools"] = [{"type": "function", "name": n, "description": d, "parameters": p}
                             for n, d, p in self.tools]
            key = b"input"
        return orjson.dumps(head)[:-1] + b',"' + key + b'":' + items + b"," + orjson.dumps(tail)[1:]

    def _user(self, text: str) -> list[Any]:
        if self.fmt == "responses":
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
        return [{"role": "user", "content": text}]

    def _round(self, large: bool) -> list[bytes]:
        """One tool round: the model's text and tool call, then the tool's output (two serialised items)."""
        rng = self.rng
        self.rounds += 1
        call_id = f"call_{self.rounds:05d}"
        name = rng.choice(TOOLS[:5])
        args = {"command": f"{name.lower()} src/module_{rng.randint(0, 99)}.py --line {rng.randint(1, 999)}"}
        text, output = prose(rng, rng.randint(8, 40)), _output(rng, large)
        if self.fmt == "chat":
            items: list[Any] = [
                {"role": "assistant", "content": text, "tool_calls": [{"id": call_id, "type": "function", "function": {
                    "name": name, "arguments": orjson.dumps(args).decode()}}]},
                {"role": "tool", "tool_call_id": call_id, "content": output}]
        elif self.fmt == "messages":
            items = [
                {"role": "assistant", "content": [{"type": "text", "text": text},
                                                  {"type": "tool_use", "id": call_id, "name": name, "input": args}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": output}]}]
        else:
            items = [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
                {"type": "function_call", "call_id": call_id, "name": name, "arguments": orjson.dumps(args).decode()},
                {"type": "function_call_output", "call_id": call_id, "output": output}]
            return [orjson.dumps(items[0]) + b"," + orjson.dumps(items[1]), orjson.dumps(items[2])]
        return [orjson.dumps(i) for i in items]
