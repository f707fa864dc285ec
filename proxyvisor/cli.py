"""The ``proxyvisor`` command line: ``serve``, ``wrap``, ``demo``, ``replay``, ``condense``.

Each command parses its options here and hands a validated :class:`~proxyvisor.config.Config` to the module that
does the work. Exit codes: 0 success, 1 a failure while running, 2 bad usage or configuration (argparse and
:class:`~proxyvisor.config.ConfigError`), and for ``wrap`` the wrapped command's own code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence

from . import __version__
from .config import Config, ConfigError, find_config_file, load
from .rules import DEFAULT_VIEW_BUDGET, FORMATS, VIEW_BUDGET

_FILES = """\
files and environment:
  config file     --config PATH, else $PROXYVISOR_CONFIG, else $XDG_CONFIG_HOME/proxyvisor/config.toml
                  (~/.config/proxyvisor/config.toml); without one the built-in defaults apply: the
                  embedded scripted upstream, which needs no API key. Every setting is documented in
                  the repository's config.toml.
  state dir       [state] dir, else $PROXYVISOR_STATE_DIR, else $XDG_STATE_HOME/proxyvisor
                  (~/.local/state/proxyvisor): per-session JSONL ledgers and memory/, one file
                  per project of what learning kept (written only with supervision enabled).
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=100)


def _common(parser: argparse.ArgumentParser, log_help: str = "") -> None:
    """Add the options every command has; ``log_help`` says more about ``--log-level`` for this command."""
    parser.add_argument("--config", metavar="PATH", help="configuration file to use (see 'files and environment' below)")
    parser.add_argument("--state-dir", metavar="DIR", help="state directory (overrides [state] dir)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help=f"log verbosity on stderr (default: %(default)s){log_help}; logs never contain "
                             "credentials")


def _supervision_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--no-supervision", dest="supervision", action="store_false", default=None,
                       help="run as a transparent byte relay: nothing parsed, written or added "
                            "(overrides [supervisor] enabled)")
    group.add_argument("--supervision", dest="supervision", action="store_true",
                       help="enable supervision (overrides [supervisor] enabled)")


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def session_id_arg(value: str) -> str:
    from .store import SESSION_ID

    if not SESSION_ID.match(value):
        raise argparse.ArgumentTypeError(f"invalid session id {value!r}: use 1-128 of [A-Za-z0-9._-], "
                                         "starting with a letter or digit")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proxyvisor", formatter_class=_Formatter,
        description=textwrap.dedent("""\
            proxyvisor sits between an LLM agent and its model endpoint. It speaks the three wire formats
            agents use (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses), streaming and not.
            Supervision is on by default: it keeps a ledger per session, reads and hides the model's
            self-report, runs loop / no-progress / recovery detectors and steers with advisory notes,
            verifies turn-ending answers (verify-gate) and condenses oversized tool output for the model's
            copy. With it off (--no-supervision) proxyvisor is a byte relay that writes nothing. Delegated
            child work under per-pool breakers is separate, off by default ('proxyvisor routing').
            """),
        epilog=textwrap.dedent("""\
            examples:
              proxyvisor demo                      an example agent through the proxy, no API key needed
              proxyvisor wrap -- claude -p "fix the failing test"
              proxyvisor batch tasks.jsonl --agent 'claude -p {prompt}'
                                                   run each task, verified, and report the outcomes
              proxyvisor serve --port 8377         then point ANTHROPIC_BASE_URL / OPENAI_BASE_URL at it
              proxyvisor replay trajectory.jsonl   replay a recorded agent session through the pipeline
              proxyvisor replay --gate run.jsonl   ... and show what the verify-gate decides at every stop
              proxyvisor condense build.log --task "why did it fail?"
                                                   what the model would see of a large tool output
              proxyvisor info                      the latest session's counters (the agent can send /info)
              proxyvisor memory list               what proxyvisor learnt in this project (forget removes it)
              claude mcp add proxyvisor -- proxyvisor mcp
                                                   let an agent ask proxyvisor itself (MCP tools over stdio)

            Run 'proxyvisor COMMAND --help' for a command's options.
            """) + "\n" + _FILES)
    parser.add_argument("--version", action="version", version=f"proxyvisor {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the proxy until interrupted", formatter_class=_Formatter,
        description=textwrap.dedent("""\
            Serve the proxy on [proxy] host:port (default 127.0.0.1:8377) until SIGINT or SIGTERM.

            Endpoints (each also under the session prefix /s/{session}/ and the run prefix /r/{run}/):
              POST /v1/chat/completions       OpenAI Chat Completions
              POST /v1/messages               Anthropic Messages (the query string, e.g. ?beta=true, is kept)
              POST /v1/responses              OpenAI Responses
              POST /v1/messages/count_tokens  GET /v1/models
              (the model paths also answer without their /v1, e.g. POST /messages, and go upstream with it)
              POST /proxyvisor/delegate       run one child for a role ([model_routing] enabled)
              GET  /proxyvisor/sessions       the session ids (needs [proxy] admin_token in x-proxyvisor-admin)
              GET  /proxyvisor/sessions/ID/info, .../ID/plan   one session as JSON (its id is the key)
              GET  /proxyvisor/ui             the web view's page, no authentication
              GET  /proxyvisor/ui/api/...     the web view's data (the session list and pools: admin token)
              HEAD /   GET /healthz           liveness, no authentication

            Point an agent at it with ANTHROPIC_BASE_URL=http://127.0.0.1:8377 (no /v1) or
            OPENAI_BASE_URL=http://127.0.0.1:8377/v1. Binding a non-loopback address requires
            [proxy] auth_token; clients then send it in the 'x-proxyvisor-auth' header.
            """), epilog=_FILES)
    serve.add_argument("--host", help=f"address to bind (overrides [proxy] host; default {Config().proxy.host})")
    serve.add_argument("--port", type=int, help="port to bind, 0 for a free one (overrides [proxy] port; default "
                                                f"{Config().proxy.port})")
    _supervision_flags(serve)
    _common(serve)

    wrap = commands.add_parser(
        "wrap", help="run an agent command through a private proxy", formatter_class=_Formatter,
        description=textwrap.dedent("""\
            Start the proxy on a free loopback port, run CMD with its base URLs pointed at it, and return
            CMD's exit code. The agent gets a fresh, unguessable run prefix in:
              ANTHROPIC_BASE_URL  http://127.0.0.1:PORT/r/RUN
              OPENAI_BASE_URL     http://127.0.0.1:PORT/r/RUN/v1   (also OPENAI_API_BASE)
              PROXYVISOR_URL      the same as ANTHROPIC_BASE_URL, for agents configured by hand
              PROXYVISOR_SESSION  RUN (with --session: ID), which names the run's current session
            A request that names its own session (Claude Code's session id, which 'claude --resume'
            keeps) belongs to that session, as under 'serve', so a resumed conversation goes on in the
            session of the runs before; one that names none is session RUN. With --session ID every
            request is session ID (the prefix is /r/RUN/s/ID).
            Codex ignores OPENAI_BASE_URL, so when CMD is 'codex' wrap inserts, right after it,
              -c openai_base_url="URL"                  for the built-in openai provider
              -c model_providers.NAME.base_url="URL"    for each provider in $CODEX_HOME/config.toml (~/.codex)
            (URL is OPENAI_BASE_URL's value); '-c' options of your own come later and win.
            SIGTERM, SIGHUP and SIGQUIT are forwarded to CMD (a terminal's Ctrl-C reaches it directly).
            At exit, a summary of each session the run's requests went to goes to stderr (this run's
            requests only; --quiet: none): model requests, errors and tool rounds, upstream tokens and
            cost, what supervision did (self-reports, detector fires and steer notes, verify-gate
            outcomes, condensed results and tokens saved, supervisor model calls with their tokens, cost
            and time, the tool authorizer's checks and blocks, the upstream pools that refused or
            failed), the /info and /plan questions proxyvisor answered itself, and the proxy overhead
            (proxyvisor's own time, without the upstream's and the supervisor model's).
            With --no-supervision: model requests, errors and overhead, counted in memory; nothing is
            written.
            """),
        epilog=textwrap.dedent("""\
            examples:
              proxyvisor wrap -- claude -p 'list the files'
              proxyvisor wrap -- codex exec 'list the files'
              proxyvisor wrap -- sh -c 'my-agent --api-base "$OPENAI_BASE_URL"'   an agent set up by hand
            """) + "\n" + _FILES)
    wrap.add_argument("--session", metavar="ID", type=session_id_arg,
                      help="put every request in this session, whatever session the agent names (1-128 of A-Z "
                           "a-z 0-9 . _ -)")
    wrap.add_argument("--quiet", action="store_true",
                      help="print no session summary at exit and no notice at start (that the upstream is the "
                           "built-in scripted model, the supervisor model's name); warnings and errors still print")
    _supervision_flags(wrap)
    _common(wrap)
    wrap.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD ...", help="the agent command (after --)")

    demo = commands.add_parser(
        "demo", help="show an example agent working through the proxy", formatter_class=_Formatter,
        description=textwrap.dedent("""\
            Run a small example agent through the proxy against the embedded scripted upstream, in each of
            the three wire formats, streaming, and show what passed through: the requests, the tool call the
            model made, the tool result the agent sent back, the final answer, the proxy's overhead and the
            session ledger. Then an agent that loops: the model's self-report (hidden from the agent), the
            loop detector firing, and the steer note that ends the loop. Then a large tool output condensed
            for the model. Then a premature "done" (a fix claimed without running the tests) held by the
            verify-gate, the turn reworked until the tests pass and verified, and /info answered by proxyvisor
            itself. Then a model that delegates review work to a child role (the proxy runs the child and
            continues the turn), and the child's pool cooling down on a 429 and recovering through its
            half-open probe. Needs no API key and no network.
            """), epilog=_FILES)
    demo.add_argument("--format", choices=[*FORMATS, "all"], default="all",
                      help="which wire format(s) to show (default: %(default)s)")
    _common(demo)

    replay = commands.add_parser(
        "replay", help="replay a recorded agent trajectory through the pipeline", formatter_class=_Formatter,
        description=textwrap.dedent("""\
            Drive a recorded trajectory (JSON lines, one Chat Completions message per line: the corpus
            format) through the proxy request by request, exactly as the agent sent it: for each assistant
            message, the history before it is sent, and the scripted upstream answers with the recorded
            assistant turn. Prints a timeline, one line per round (per assistant turn); with supervision on,
            also the state of the reply's self-report, the detectors that fired (signal@line of the round
            they fired at) and the steer note added to the request. --json gives the same as JSON lines.

            With --condense, oversized tool results are condensed as the proxy would: with the model of
            [supervisor.model], or, when none is configured, by the deterministic condenser (the scripted
            upstream answers condenser calls with no verdict; test runs, builds and installs never ask a
            model; no key). Each round then shows the decision for its oversized results (tokens before and
            after, the spill file holding the original) and the tokens the narrowed results saved in that
            request.

            With --gate, the verify-gate judges the replay as it would judge the live agent: supervision and
            the gate on, the verifier on the supervisor route: by default the session's own, which in a
            replay is the embedded scripted upstream and answers with its fixed verifier policy (no key, no
            network: a plain rule reading the digest, not a model's judgement); a [supervisor.model] that
            picks the litellm route (api_base or api_key_env) makes that model judge. Every stop (a recorded reply without tool calls) is judged; the run's
            last assistant message is its final answer, so when it is a tool call (a harness's submit
            action, e.g. mini-swe-agent's "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", SWE-agent's
            "submit") it is presented as a text answer and what followed it is left out. A replay cannot
            play the rework the gate would ask for, so each stop ends at the gate's first judgment (re-entry
            budget 0, no nudges): a stop with gaps ends "unverified" with them. Under each stop the timeline
            shows, from the request's ledger record: whether the gate ran; what decided (free evidence, or
            the model); the outcome (verified, unknown, failed, unverified) and whether it passed; the
            reason; the gaps; the verifier input's size (digest, in tokens). A last line gives the counts
            and the final label: the outcome at the last stop ("no verdict" when the gate gave none).
            --gate --json prints one JSON object per stop: round, message (0-based line of the reply),
            gated, decided_by (evidence | model | null), outcome, passed, reason, gaps, verdicts,
            digest_tokens.

            The replay's ledger and spill files go to a temporary state directory, removed at the end, so a
            replay never shows up among your sessions (proxyvisor info); --state-dir DIR keeps them in DIR.

            Exit status: 0 every round came back as recorded (with --gate, a gap is not a failure: it is
            reported); 1 a round came back changed or failed; 2 the file is unreadable, not a trajectory or
            holds no messages.

            Examples:
              proxyvisor replay run.jsonl --format messages --stream
              proxyvisor replay --gate examples/replay/forbidden-then-permitted-tests.jsonl
              proxyvisor replay --gate --json run.jsonl | jq -c '{message, decided_by, outcome, gaps}'
            """), epilog=_FILES)
    replay.add_argument("file", metavar="FILE.jsonl", help="the trajectory to replay")
    replay.add_argument("--format", choices=FORMATS, default="chat",
                        help="wire format to send the history in (default: %(default)s)")
    replay.add_argument("--stream", action="store_true", help="send streaming requests")
    replay.add_argument("--json", action="store_true", help="print the timeline as JSON lines")
    replay.add_argument("--condense", action="store_true",
                        help="condense oversized tool results ([supervisor.model], else the scripted condenser)")
    replay.add_argument("--gate", action="store_true",
                        help="judge every stop with the verify-gate and show its decision (the scripted "
                             "verifier policy unless [supervisor.model] picks a litellm model)")
    _supervision_flags(replay)
    _common(replay)

    condense = commands.add_parser(
        "condense", help="show what the model would get of a large tool output (and what a condenser sees)",
        formatter_class=_Formatter,
        description=textwrap.dedent("""\
            Treat FILE as one large plain-text tool result and print what the model's copy of a request would
            hold instead of it (the agent always keeps its full output). The header gives FILE's size in tokens
            (tiktoken cl100k_base) and whether it is above [supervisor.condense] tokens_threshold, i.e. whether
            the proxy would condense it at all.

            Above the threshold, the condensed result follows: FILE's own lines byte for byte (lines over 500
            characters clipped head and tail, the cut marked), "[… K lines omitted: original lines A-B …]"
            markers, a count and the first and last line number for each repeated diagnostic, and a closing
            notice naming FILE as the full original, all within [supervisor.condense] budget_tokens (4,000 by
            default). It is chosen without a model (the deterministic condenser: diagnostics grouped by
            template, failure sections, task terms, the runner's last lines, head and tail) when no
            [supervisor.model] name is set, when FILE looks like a test run, build or install named in
            deterministic_kinds, or when the model call fails; otherwise one condenser call chooses the line
            numbers from a numbered view of FILE ("  42| text", within --budget). api_base = "scripted:" calls
            the embedded scripted upstream, which leaves the choice to the deterministic condenser, as demo and
            replay do: no key, no network. Nothing is written in any case.

            exit status: 0 the result came out (a failed condenser call is named, and the deterministic
            condenser decided); 1 FILE or --green is unreadable; 2 bad usage or configuration.
            """),
        epilog=textwrap.dedent("""\
            examples:
              proxyvisor condense build.log --task "Why did the build fail?"
              proxyvisor condense build.log --task "Why did the build fail?" --green last-good-build.log
              proxyvisor condense pytest.txt --task "Which tests fail and why?" --view --budget 4000
              proxyvisor condense out.txt --task "Did the install succeed?" --json | jq .condensed.kept_ranges
            """) + "\n" + _FILES)
    condense.add_argument("file", metavar="FILE", help="the tool output to condense (any bytes; read as UTF-8)")
    condense.add_argument("--task", required=True, metavar="TEXT",
                          help="the agent's current request: it picks the focus terms of the view and is the "
                               "condenser's task context")
    condense.add_argument("--budget", type=int, metavar="N",
                          help=f"tokens of numbered view a condenser model gets, {VIEW_BUDGET} (default: "
                               f"[supervisor.condense] view_budget_tokens, {DEFAULT_VIEW_BUDGET}: a result alone in "
                               "its round gets the whole budget)")
    condense.add_argument("--green", metavar="GREEN_FILE",
                          help="the output of the last successful run of the same command: a failing FILE then "
                               "leads with its lines new against it (numbers, ids, paths, timestamps masked)")
    condense.add_argument("--view", action="store_true",
                          help="print the numbered view a condenser model would get before the result")
    condense.add_argument("--json", action="store_true",
                          help="print one JSON object: sizes, threshold, kind, the view (text, visible_ranges, "
                               "tokens), diagnostic line numbers and condensed (text, tokens, kept_ranges, "
                               "spill_path, condenser, ...; null below the threshold)")
    _common(condense)
    batch = commands.add_parser(
        "batch", help="run a file of agent tasks, each verified by the gate, and report the outcomes",
        formatter_class=_Formatter,
        description=textwrap.dedent("""\
            Run an agent once per task of TASKS.jsonl, each run through its own proxied session with the
            verify-gate on and headless (no user: a turn that stops while still in progress is nudged on), and
            write a report of each task's outcome. One proxy serves every task on a free loopback port; the
            agent gets ANTHROPIC_BASE_URL, OPENAI_BASE_URL and OPENAI_API_BASE pointing at its session, as with
            'proxyvisor wrap' (and Codex its -c overrides). Supervision is on whatever the configuration says.

            task file: JSON lines, one object per task (blank lines skipped):
              {"id": "fix-calc", "prompt": "Fix add() in calc.py and run its test."}
              id         required; 1-64 of A-Z a-z 0-9 . _ - starting with a letter or digit, unique: it names
                         the task's session (ID-RANDOM), log files and --workdir-template folder
              prompt     required; the task text
              workdir    optional; the folder to run this task's agent in (created if missing; relative to
                         the task file's folder)
              timeout_s  optional; seconds for this task (overrides --timeout)
              env        optional; {"NAME": "value"} added to this task's agent environment
            Any other key, a line that is not a JSON object, a repeated id, a NUL byte in a value, or a prompt
            or env entry longer than Linux passes to a program (131,072 bytes per argument or environment
            string, MAX_ARG_STRLEN; the prompt goes in PROXYVISOR_PROMPT too) is an error naming the line,
            reported before any task runs.

            agent command: --agent is one command line, split into words as a POSIX shell would, then run
            directly, not through a shell. In each word, {prompt}, {id}, {workdir} and {session} are replaced
            by the task's values as they are: a value is never split or re-read, so {prompt} and '{prompt}'
            are the same one word (with text around it, e.g. --task={prompt}, still one word). Any other {name}
            is an error. The agent also gets PROXYVISOR_TASK_ID, PROXYVISOR_PROMPT, PROXYVISOR_URL and
            PROXYVISOR_SESSION in its environment: for pipes and redirections use
            sh -c '... "$PROXYVISOR_PROMPT" ...' (a {prompt} pasted into a shell script would be read as code).
            Each agent runs in its working directory (the task's workdir, else --workdir-template, else a fresh
            folder under the temporary directory, kept afterwards), with stdin empty and in its own process
            group; a task whose folder cannot be made ends with that error (no_verdict) and the others run.
            Past its timeout, or on Ctrl-C / SIGTERM, the group gets SIGTERM, then SIGKILL 5 s later (at once on
            a second Ctrl-C); whatever an agent leaves running in its group is killed when it exits.

            outcome of a task: the label the gate gave the last turn of its session that ended with a verdict:
              verified     the state changed and a recognised check ran after it, and the verifier passed it
              unknown      the verifier passed it on reading alone (no change, e.g. a question answered)
              failed       the same gaps came back after new evidence
              unverified   the re-entry budget was spent with gaps left, or the verifier was unavailable
              no_verdict   no turn ended with a verdict: the gate is off ([supervisor.gate] enabled = false),
                           the agent crashed, timed out or was stopped before its answer (or its folder could
                           not be made), or it made no model request offering it tools (only those are gated)
            The verifier is the session's own model by default (each request's upstream, credentials and
            model; [supervisor.model] in config.toml picks another); on the embedded scripted upstream it
            answers with a fixed policy (offline).

            report files (--report PREFIX; default STATE/batch/batch-YYYYMMDD-HHMMSS, STATE the state directory,
            so nothing lands in the current folder unless asked; its folder is made, or found unwritable, before
            any task runs; the last line on stderr names the files):
              PREFIX.jsonl   one JSON object per task that started, in task-file order: id, session, outcome,
                             exit_code, error, seconds, gate_rounds (verifier passes), gaps, reentries, nudges,
                             detector_fires, steers, requests, input_tokens, output_tokens, cost_usd (upstream
                             plus supervisor model), cost_known, workdir, stdout, stderr
              PREFIX.md      the run's facts (wall time, --require-verified, ...), the same values as a
                             Markdown table with totals (agent seconds: summed over tasks), and each task's
                             session and files
              PREFIX-logs/   ID.stdout and ID.stderr of every agent
            The session ledgers stay in the state directory (ledger/SESSION.jsonl): 'proxyvisor info SESSION'.
            A progress bar ("done 3/7 · verified 2 · running 4") and one line per finished task go to
            stderr; the gate's per-turn messages are logged at info level, as the outcome is in the report.

            exit status: 0 every task's agent exited 0 (with --require-verified: and every task is verified);
            1 some agent exited non-zero, timed out or could not start (with --require-verified: or some task is
            not verified, i.e. not outcome verified with exit 0; those tasks are named on stderr); 2 bad usage,
            task file, agent command, report folder or configuration (nothing ran); 130 interrupted by Ctrl-C, 143 by SIGTERM (the report covers the tasks that started).
            """),
        epilog=textwrap.dedent("""\
            examples:
              proxyvisor batch tasks.jsonl --agent 'claude -p {prompt} --allowedTools Bash' --parallel 4
              proxyvisor batch tasks.jsonl --agent 'codex exec --skip-git-repo-check {prompt}' \\
                  --workdir-template 'runs/{id}' --require-verified --report reports/nightly
              proxyvisor batch examples/batch/tasks.jsonl --config examples/batch/config.toml \\
                  --agent 'python -m proxyvisor.example_agent {prompt}'     offline: the scripted model
            """) + "\n" + _FILES)
    batch.add_argument("tasks", metavar="TASKS.jsonl", help="the task file (see 'task file' above)")
    batch.add_argument("--agent", required=True, metavar="CMD",
                       help="the agent command line, with {prompt} (see 'agent command' above)")
    batch.add_argument("--parallel", type=_positive_int, default=1, metavar="N",
                       help="tasks to run at once (default: %(default)s)")
    batch.add_argument("--timeout", type=_positive_float, default=1800.0, metavar="S",
                       help="seconds each task's agent may run (default: %(default)g); a task's timeout_s wins")
    batch.add_argument("--workdir-template", metavar="DIR",
                       help="each task's working directory, with {id}, e.g. 'runs/{id}' (created if missing; "
                            "a relative one is relative to the current folder, where a task's own workdir is "
                            "relative to the task file's folder; default: a fresh temporary folder per task, kept)")
    batch.add_argument("--require-verified", action="store_true",
                       help="exit 1 unless every task's outcome is verified and its agent exited 0")
    batch.add_argument("--report", metavar="PREFIX",
                       help="write PREFIX.jsonl, PREFIX.md and PREFIX-logs/ (default: batch/batch-YYYYMMDD-HHMMSS "
                            "in the state directory)")
    _common(batch)
    from .routing_cli import register as register_routing

    register_routing(commands, _common, _Formatter)  # supervision, delegate, health: each sets a handler
    from .info_cli import register as register_info

    register_info(commands, _common, _Formatter)  # info, plan: each sets a handler
    from .memory_cli import register as register_memory

    register_memory(commands, _common, _Formatter)  # memory list|show|forget: sets a handler
    from .mcp_cli import register as register_mcp

    register_mcp(commands, _common, _Formatter)  # mcp: sets a handler (the MCP SDK is imported only when it runs)
    for command in commands.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def _config(args: argparse.Namespace) -> Config:
    named = find_config_file(args.config)
    # A writer creates the file it names; until then the configuration is the defaults.
    missing = getattr(args, "creates_config", False) and named is not None and not named.exists()
    config = Config() if missing else load(args.config)
    changes: dict[str, dict[str, object]] = {}
    if getattr(args, "supervision", None) is not None:
        changes["supervisor"] = {"enabled": args.supervision}
    if args.state_dir:
        changes["state"] = {"dir": args.state_dir}
    proxy = {k: v for k in ("host", "port") if (v := getattr(args, k, None)) is not None}
    if proxy:
        changes["proxy"] = proxy
    return config.with_overrides(**changes) if changes else config


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
"""This package's folder: a frame is proxyvisor's own when its file lies in it (a folder of that name elsewhere on
the path, such as the clone's own, is not)."""


class OneLineFormatter(logging.Formatter):
    """One log line per record: an exception is shown as its type, its message and the innermost frame of
    proxyvisor's own code (``file.py:LINE``), never as a traceback, unless ``tracebacks`` (``--log-level debug``)."""

    def __init__(self, fmt: str, *, tracebacks: bool) -> None:
        super().__init__(fmt)
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        if self.tracebacks or not record.exc_info:
            return super().format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text = saved
        _type, exc, tb = saved[0]
        where = ""
        for frame in traceback.extract_tb(tb):
            if os.path.abspath(frame.filename).startswith(_PACKAGE + os.sep):
                where = f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        return f"{line} [{detail}{where}]"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would name them with the top-level usage; the command's own is the useful one
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("proxyvisor %(levelname)s %(name)s: %(message)s",
                                          tracebacks=args.log_level == "debug"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    try:
        return _dispatch(parser, args)
    except BaseException as exc:  # noqa: BLE001 - turn what trio wraps in exception groups into clear exits
        leaf = _leaf(exc)
        if isinstance(leaf, ConfigError):
            print(f"proxyvisor: configuration error: {leaf}", file=sys.stderr)
            return 2
        from .store import StoreUnusable

        if isinstance(leaf, StoreUnusable):
            print(f"proxyvisor: {leaf}", file=sys.stderr)
            return 1
        if isinstance(leaf, KeyboardInterrupt):
            return 130
        if isinstance(leaf, BrokenPipeError):
            # The reader went away (e.g. `| head`): stop quietly, and keep Python from complaining at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if isinstance(leaf, OSError) and leaf.errno is not None:
            print(f"proxyvisor: {leaf.strerror or leaf}" + (f": {leaf.filename}" if leaf.filename else ""),
                  file=sys.stderr)
            return 1
        raise


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    config = _config(args)
    if args.command in ("wrap", "demo", "batch"):
        # Their proxy is private to this process and its child: loopback only, so no token is needed (the agent
        # could not send one anyway).
        config = config.with_overrides(proxy={"host": "127.0.0.1", "auth_token": ""})
    from .config import validate

    validate(config)
    handler: Callable[[argparse.Namespace, Config], int] | None = getattr(args, "handler", None)
    if handler is not None:
        return handler(args, config)
    if args.command == "serve":
        from .serve import serve

        return serve(config)
    if args.command == "wrap":
        from .wrap import wrap

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error("wrap needs a command, e.g. proxyvisor wrap -- claude -p 'hi'")
        return wrap(config, cmd, session=args.session, quiet=args.quiet)
    if args.command == "demo":
        from .demo import demo

        return demo(config, args.format)
    if args.command == "replay":
        from .replay import replay_command

        if args.gate and args.supervision is False:
            parser.error("replay --gate needs supervision: drop --no-supervision")
        return replay_command(config, args.file, args.format, args.stream, args.json, args.condense, args.gate,
                              keep_state=bool(args.state_dir))
    if args.command == "batch":
        from .batch import BatchError, Options, batch_command

        options = Options(args.agent, args.parallel, args.timeout, args.workdir_template)
        try:
            return batch_command(config, args.tasks, options, args.require_verified, args.report)
        except BatchError as exc:
            print(f"proxyvisor: {exc}", file=sys.stderr)
            return 2
    if args.command == "condense":
        from .condense_cli import condense_command

        return condense_command(config, args.file, args.task, args.budget, args.json, args.green, args.view)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
