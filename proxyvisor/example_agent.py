"""A small example agent: an OpenAI-SDK chat loop with one ``bash`` tool.

Run it as ``python -m proxyvisor.example_agent "PROMPT"``. It sends the prompt to ``$OPENAI_BASE_URL`` (Chat
Completions, not streamed) with the key ``$OPENAI_API_KEY`` (a placeholder when unset: the embedded scripted
upstream needs none), runs every ``bash`` call the model makes in the current directory, sends the results back,
and stops when the model answers without a tool call: that answer goes to stdout. The model is ``--model``, else
``$PROXYVISOR_AGENT_MODEL``, else ``scripted-model``.

It is what ``proxyvisor batch`` is shown with in the README and tested with (``proxyvisor batch TASKS.jsonl
--agent 'python -m proxyvisor.example_agent {prompt}'``); it is not a serious agent: no sandbox, no approval.

A tool result starts with ``exit code: N`` (what proxyvisor's receipts read a command's success from), then the
command's stdout and stderr together, clipped to :data:`OUTPUT_CHARS` (head and tail). A command running longer
than ``--tool-timeout`` seconds is killed with its whole process group and reported as exit code 124.

Exit status: 0 the model gave a final answer; 1 the model endpoint failed (the error goes to stderr); 2 bad
usage; 3 the model still called tools after ``--max-turns`` requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from openai.types.chat import (ChatCompletionAssistantMessageParam, ChatCompletionFunctionToolParam,
                                   ChatCompletionMessageParam)

DEFAULT_MODEL = "scripted-model"
OUTPUT_CHARS = 16_000
SYSTEM = ("You are a coding agent working in the current directory. Use the bash tool to inspect and change "
          "files and to run checks. When the task is finished, answer without calling a tool.")
BASH_TOOL: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the current directory; returns its exit code and output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}


def run_bash(command: str, timeout_s: float) -> str:
    """Run ``command`` with ``bash -c`` in the current directory; ``exit code: N`` and the combined output,
    clipped to :data:`OUTPUT_CHARS` characters. Past ``timeout_s`` seconds its process group is killed (124)."""
    process = subprocess.Popen(["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        code = 124
        output += f"\n[killed after {timeout_s:g} s]".encode()
    text = output.decode("utf-8", "replace")
    if len(text) > OUTPUT_CHARS:
        half = OUTPUT_CHARS // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"
    return f"exit code: {code}\n{text}"


def _call_result(call: Any, timeout_s: float) -> str:
    if call.function.name != "bash":
        return f"exit code: 127\nno such tool: {call.function.name!r}; the only tool is bash"
    try:
        command = json.loads(call.function.arguments or "{}").get("command")
    except (json.JSONDecodeError, AttributeError):
        command = None
    if not isinstance(command, str) or not command.strip():
        return "exit code: 2\nthe bash tool needs a 'command' string argument"
    return run_bash(command, timeout_s)


def run(prompt: str, model: str, max_turns: int, tool_timeout_s: float) -> int:
    """The agent loop (module docstring); returns the exit status."""
    import openai  # imported here so that --help stays fast

    client = openai.OpenAI(api_key=os.environ.get("OPENAI_API_KEY") or "proxyvisor-example-agent", max_retries=2)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": prompt}]
    for _ in range(max_turns):
        try:
            completion = client.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
        except openai.OpenAIError as exc:
            print(f"example_agent: the model call failed: {exc}", file=sys.stderr)
            return 1
        message = completion.choices[0].message
        if not message.tool_calls:
            print(message.content or "")
            return 0
        messages.append(cast("ChatCompletionAssistantMessageParam", message.model_dump(exclude_none=True)))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _call_result(call, tool_timeout_s)})
    print(f"example_agent: no final answer after {max_turns} model requests", file=sys.stderr)
    return 3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxyvisor.example_agent", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the task")
    parser.add_argument("--model", default=os.environ.get("PROXYVISOR_AGENT_MODEL") or DEFAULT_MODEL,
                        help="model name (default: $PROXYVISOR_AGENT_MODEL, else %(default)s)")
    parser.add_argument("--max-turns", type=int, default=50, metavar="N",
                        help="most model requests before giving up (default: %(default)s)")
    parser.add_argument("--tool-timeout", type=float, default=120.0, metavar="S",
                        help="seconds one bash command may run (default: %(default)s)")
    args = parser.parse_args(argv)
    return run(args.prompt, args.model, args.max_turns, args.tool_timeout)


if __name__ == "__main__":
    sys.exit(main())
