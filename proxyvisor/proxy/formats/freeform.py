"""Freeform (``custom``) tools and namespaced tool names: how a call's input becomes arguments.

A **freeform tool** (OpenAI ``{"type": "custom", ...}``, in Responses and Chat Completions) takes one free string,
possibly held to a grammar, instead of a JSON object; its calls carry that string as ``input``. Everything that
reasons about calls (receipts, the gate's digest, condense) reads arguments, so a freeform call is read as the
arguments :func:`arguments` gives:

- ``{"input": TEXT}`` always, and what the text does when it can be read:
- ``cmd``: the command, for a tool named like a shell (:data:`SHELL_TOOLS`), whose input is a command line; or
  the literal commands, one per line, of the nested shell-tool calls of a **script**: an input that calls other
  tools as ``tools.NAME(INPUT)`` (Codex's ``exec`` takes JavaScript that way: ``await tools.exec_command({cmd:
  "pytest -q"})``); a command built at run time (a variable) cannot be read and is left out;
- ``action``: the names of the script's other nested tools, space-separated (``apply_patch``), so a script that
  edits through a nested tool reads as one that calls it.

So the receipts' rules apply unchanged: a call with ``cmd`` is a command runner judged by its command text, and a
call without one is judged by its tool name and ``action``.

**Namespaces** (Responses ``{"type": "namespace", "name": N, "tools": [...]}``): a call to a namespaced tool
carries its ``name`` and its ``namespace`` apart. A tool is named ``N.NAME`` here (:func:`qualified`), except in
the default namespace ``functions``, which calls address without a ``namespace`` field (observed with Codex
0.171.0): its tools keep their own names. OpenAI tool names hold no ``.``, so :func:`split` inverts it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolSpec

SHELL_TOOLS = frozenset({"bash", "sh", "shell", "zsh", "terminal", "exec_command", "execute_bash", "execute_command",
                         "run_command", "run_shell_command", "run_terminal_cmd", "shell_command", "local_shell"})
"""Names (lower case) of tools that run a shell command: Claude Code ``Bash``, Codex ``exec_command``, Gemini CLI
``run_shell_command``, mini-swe-agent and opencode ``bash``, OpenHands ``execute_bash``, Responses ``local_shell``."""

DEFAULT_NAMESPACE = "functions"
"""The namespace whose tools calls address by name alone."""

_NESTED = re.compile(r"\btools\s*(?:\.\s*([A-Za-z_$][\w$]*)|\[\s*([\"'])([A-Za-z_$][\w$.-]*)\2\s*\])\s*\(\s*")
_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"|\'((?:[^\'\\\n]|\\.)*)\'|`((?:[^`\\$]|\\.|\$(?!\{))*)`', re.S)
_COMMAND_KEY = re.compile(r"[{,]\s*[\"']?(?:cmd|command)[\"']?\s*:\s*")
_ESCAPE = re.compile(r"\\(u\{[0-9a-fA-F]+\}|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|\n|.)", re.S)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v", "0": "\0", "\n": ""}
_MAX_CALLS = 64  # nested calls read per script: a script's input comes from the model, so reading it is bounded
_OBJECT_SPAN = 4096  # characters of an object input searched for its command


def qualified(namespace: Any, name: str) -> str:
    """The name of tool ``name`` declared in (or called with) ``namespace`` (module docstring)."""
    if isinstance(namespace, str) and namespace and namespace != DEFAULT_NAMESPACE:
        return f"{namespace}.{name}"
    return name


def split(name: str) -> tuple[str | None, str]:
    """(namespace or None, name as the API spells it) of a :func:`qualified` name."""
    namespace, dot, rest = name.partition(".")
    return (namespace, rest) if dot and namespace and rest else (None, name)


def arguments(name: str, text: str) -> dict[str, Any]:
    """The arguments a freeform call of tool ``name`` with input ``text`` is read as (module docstring)."""
    args: dict[str, Any] = {"input": text}
    if split(name)[1].lower() in SHELL_TOOLS:
        args["cmd"] = text
        return args
    commands, others = [], []
    for tool, command in _nested_calls(text):
        if tool.lower() in SHELL_TOOLS:
            if command is not None:
                commands.append(command)
        elif tool not in others:
            others.append(tool)
    if commands:
        args["cmd"] = "\n".join(commands)
    if others:
        args["action"] = " ".join(others)
    return args


def input_of(arguments: dict[str, Any]) -> str:
    """The input string of a freeform call with ``arguments`` (:func:`arguments`' ``input``; other arguments
    as JSON)."""
    text = arguments.get("input")
    return text if isinstance(text, str) else json.dumps(arguments)


def nested_shell(spec: ToolSpec) -> str | None:
    """The nested shell tool a freeform script tool's description shows it calling (``tools.exec_command(...)``),
    or None when ``spec`` is no such tool."""
    if spec.kind != "custom":
        return None
    return next((m.group(1) or m.group(3) for m in _NESTED.finditer(spec.description)
                 if (m.group(1) or m.group(3)).lower() in SHELL_TOOLS), None)


def runs_commands(spec: ToolSpec) -> bool:
    """Whether freeform tool ``spec`` runs shell commands: named like a shell, or a script calling a shell tool."""
    return spec.kind == "custom" and (split(spec.name)[1].lower() in SHELL_TOOLS or nested_shell(spec) is not None)


def command_input(spec: ToolSpec, command: str) -> str:
    """The input with which freeform tool ``spec`` runs ``command``: a script calling its nested shell tool and
    printing the result, or the command itself."""
    shell = nested_shell(spec)
    if shell is None:
        return command
    return f"text(await tools.{shell}({{cmd: {json.dumps(command)}}}));"


def _nested_calls(text: str) -> list[tuple[str, str | None]]:
    """Each ``tools.NAME(INPUT)`` call of a script, in order: the tool and its literal command (a string input, or
    the ``cmd``/``command`` string of an object input), None when it has none."""
    found: list[tuple[str, str | None]] = []
    for match in _NESTED.finditer(text):
        if len(found) == _MAX_CALLS:
            break
        tool = match.group(1) or match.group(3)
        start = match.end()
        command = None
        literal = _STRING.match(text, start)
        if literal is not None:
            command = _unescape(literal)
        elif text.startswith("{", start):
            end = _object_end(text, start, min(len(text), start + _OBJECT_SPAN))
            key = _COMMAND_KEY.search(text, start, end)
            value = _STRING.match(text, key.end(), end) if key is not None else None
            command = _unescape(value) if value is not None else None
        found.append((tool, command))
    return found


def _object_end(text: str, start: int, limit: int) -> int:
    """The position after the object literal opening at ``start`` (brackets counted, strings skipped), or
    ``limit`` when it does not close before."""
    depth, i = 0, start
    while i < limit:
        ch = text[i]
        if ch in "\"'`":
            literal = _STRING.match(text, i, limit)
            i = literal.end() if literal is not None else i + 1
            continue
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return limit


def _unescape(literal: re.Match[str]) -> str:
    raw = next((g for g in literal.groups() if g is not None), "")

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        if code[0] in "ux" and len(code) > 1:
            try:
                return chr(int(code[1:].strip("{}"), 16))
            except (ValueError, OverflowError):
                return code
        return _ESCAPES.get(code, code)

    return _ESCAPE.sub(one, raw)


def result_text(text: str) -> str:
    """A freeform tool's result part as the command's own output: a script's nested shell call answers a JSON
    object (Codex: ``{"chunk_id": ..., "exit_code": 1, "output": "..."}``), whose ``output`` is what the command
    printed, followed by its exit status (``Process exited with code N``); any other text as it is."""
    if not text.startswith("{") or '"output"' not in text:
        return text
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    if not isinstance(obj, dict) or not isinstance(output := obj.get("output"), str):
        return text
    code = obj.get("exit_code")
    return output + (f"\nProcess exited with code {code}" if isinstance(code, int) else "")
