"""Command line of delegation and routing: ``routing``, ``delegate`` and ``health`` (registered by cli.py).

- ``proxyvisor routing show|enable|disable|set ...``: read and write ``[model_routing]`` through
  :mod:`proxyvisor.adapters.settings` (validated against the adapter descriptors, locked, atomic, comments kept,
  a malformed file fails closed); ``proxyvisor supervision ...``, its former name, still works for one release,
  with a deprecation notice on stderr;
- ``proxyvisor delegate --role R PROMPT``: run one child now and print its shaped result (``--json``: with its
  evidence); ``proxyvisor delegate --record ID``: print a claim-checked result; ``proxyvisor delegate
  --dead-letters``: list the hand-offs that failed transiently on every attempt;
- ``proxyvisor health show|clear``: per-pool breaker state; clearing is the only way state is forgotten.

Exit codes: 0 done; 1 the child failed or was refused; 2 bad usage, configuration, or a request the policy
cannot satisfy (also: delegation disabled, or the policy does not apply to it); 128 + N when signal N (SIGTERM,
SIGINT, SIGHUP) stopped ``delegate``, after its child was stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from .adapters.descriptors import Registry, TargetError, registry_for
from .adapters.health import named
from .adapters.overview import health_json, routing_json
from .config import Config, ModelRoutingConfig, RouteTarget, default_config_path, find_config_file
from .rules import CHILD_WALL_CLOCK, COMPLEXITY, FALLBACK_POLICIES, ROUTING_MODES

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals on which ``delegate`` stops its child before it exits (128 + the signal's number)."""

_SET_HELP = textwrap.dedent("""\
    Change the routing policy in the configuration file (created if missing). Only the options given change;
    an empty value ("") removes a field so it is inherited again. Every write is checked against the adapter
    descriptors: an unknown adapter, a model the adapter does not declare, or an effort on an adapter without
    effort_selection is refused with the reason, and nothing is written. A model given without an adapter
    names the adapter whose catalog declares it.

    examples:
      proxyvisor routing set --mode adaptive --complexity-threshold COMPLICATED \\
          --fallback-policy next_eligible --max-parallel 3
      proxyvisor routing set --orchestrator-adapter claude-code --orchestrator-model claude-sonnet-5 \\
          --orchestrator-effort medium
      proxyvisor routing set --role reviewer --role-model claude-haiku-4-5 --role-effort low
      proxyvisor routing set --role architect --role-supervises reviewer
      proxyvisor routing set --remove-role reviewer
    """)


_DELEGATE_HELP = textwrap.dedent("""\
    Run PROMPT as child work of role R on the runtime the policy resolves (delegation must be enabled:
    'proxyvisor routing enable'), under the pool breaker, the child clocks and the claim check, and print
    the shaped result on stdout: the text of a finished child, {text, finish_reason} for a stopped or
    truncated one; a failure or refusal goes to stderr as an error result. In suggest mode, print the route
    instead of running it. TRACEPARENT, when set, is the parent trace (the child joins it).

    A role is a named kind of child work (a reviewer, a test writer): one [model_routing.roles.R] table of
    the configuration file, giving the adapter it runs on (an agent CLI such as claude-code or codex, a
    litellm model, the offline scripted one), its model and effort (empty: inherited from
    [model_routing.orchestrator], then the adapter's defaults), a description, and the roles it may
    delegate to. There are none by default: add one with 'proxyvisor routing set --role R ...' or by hand;
    'proxyvisor routing show' lists them with the adapter, model and effort each resolves to. The child
    gets PROMPT and nothing else of the caller's context.

    Progress goes to stderr, one plain line per event: the child started, idle warnings, a retry and its
    wait, a stop and why. On SIGTERM, SIGINT (Ctrl-C) or SIGHUP the child is stopped (SIGTERM to its process
    group, SIGKILL after [model_routing.children] stop_grace_s) before delegate exits.

    A child that fails transiently before producing any output (a 429 that is no quota, a 529 or other 5xx,
    a refused connection) is run again, up to [model_routing.children] attempts runs in all (3), after
    retry_backoff_s (1 s, doubling per retry, never less than the provider's Retry-After nor than a cooling
    pool's cooldown: the route's fallbacks are tried meanwhile), and only inside the child's wall_clock_s.
    A child that produced output, ran a tool, timed out or failed otherwise is never run again. Each run is
    in the evidence (--json: evidence.attempts). When no attempt is left the hand-off becomes a dead letter,
    kept under the state directory (dead_letters/, private files) for dead_letter_retention_s, at most
    dead_letters_kept of them: the error names its id, and --dead-letters lists it with its role, prompt,
    route, attempts and last failure, oldest first.

    exit status: 0 the child answered (or, in suggest mode, the route is printed; --dead-letters: listed,
    none included); 1 the child failed (a dead letter included) or was refused (a cooling pool, the parallel
    cap, the budget), or --record ID is unknown; 2 bad usage, configuration or a request the policy cannot
    satisfy (also: delegation disabled); 128 + N stopped by signal N, after its child was stopped.
    """)

_DELEGATE_EXAMPLES_HELP = textwrap.dedent("""\
    examples:
      proxyvisor routing enable
      proxyvisor routing set --role reviewer --role-adapter claude-code --role-model claude-haiku-4-5
      proxyvisor delegate --role reviewer "Review the diff of HEAD~1 and list concrete problems."
      proxyvisor delegate --role reviewer --json "$(cat task.txt)" | jq .evidence
      proxyvisor delegate --record clm_0123456789abcdef0123     a long result the claim check stored
      proxyvisor delegate --dead-letters                        hand-offs that failed on every attempt
      proxyvisor delegate --dead-letters --json | jq -r '.dead_letters[].prompt'
    """)


def _add_routing(commands: Any, name: str, help_text: str, common: Callable[..., None],
                 formatter: type, handler: Callable[[argparse.Namespace, Config], int]) -> None:
    sup = commands.add_parser(name, help=help_text, formatter_class=formatter, description=textwrap.dedent("""\
        Show or change [model_routing]: whether delegation to child runtimes is on (off by default), the
        trigger mode, the orchestrator and per-role targets (adapter, model, effort), fallback, parallelism and
        cooldowns. Comments and unrelated sections of the file are kept. Supervision itself ([supervisor]:
        self-report, detectors, verify-gate; on by default) is not changed here."""))
    actions = sup.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print the complete policy, resolved routes and adapters",
                              formatter_class=formatter)
    show.add_argument("--json", action="store_true", help="print JSON")
    common(show)
    for action_name, text in (("enable", "turn delegation on (health state is never cleared by this)"),
                              ("disable", "turn delegation off: no child, probe, state write or token")):
        action = actions.add_parser(action_name, help=text, formatter_class=formatter)
        common(action)
        action.set_defaults(creates_config=True)
    setter = actions.add_parser("set", help="change policy fields", formatter_class=formatter, description=_SET_HELP)
    built_in = ModelRoutingConfig()
    setter.add_argument("--mode", choices=ROUTING_MODES,
                        help="when the policy applies: explicit = always, adaptive = at or above the complexity "
                             "threshold, suggest = print the route, run nothing (built-in default: "
                             f"{built_in.mode})")
    setter.add_argument("--complexity-threshold", choices=COMPLEXITY,
                        help="the lowest request complexity adaptive mode delegates, CLEAR < COMPLICATED < COMPLEX "
                             f"< CHAOTIC (built-in default: {built_in.complexity_threshold})")
    setter.add_argument("--fallback-policy", choices=FALLBACK_POLICIES,
                        help="what to do when the route's pool is cooling down: fail_closed = refuse with the "
                             "soonest recovery, same_adapter_default = the adapter's default model, next_eligible "
                             f"= another adapter of the policy (built-in default: {built_in.fallback_policy})")
    setter.add_argument("--max-parallel", type=int, metavar="N",
                        help=f"most child runs alive at once, at least 1 (built-in default: {built_in.max_parallel})")
    setter.add_argument("--max-depth", type=int, metavar="N",
                        help="longest delegation chain in hops from the agent, at least 1 (built-in default: "
                             f"{built_in.max_depth})")
    setter.add_argument("--cooldown-default", type=float, metavar="S",
                        help="seconds of a pool's first cooldown when the provider gives no Retry-After, doubled "
                             f"per trip (built-in default: {built_in.cooldown.default_seconds:g})")
    setter.add_argument("--cooldown-maximum", type=float, metavar="S",
                        help=f"longest cooldown, seconds (built-in default: {built_in.cooldown.maximum_seconds:g})")
    setter.add_argument("--wall-clock", type=float, metavar="S",
                        help=f"a child's wall-clock limit, {CHILD_WALL_CLOCK} s (built-in default: "
                             f"{built_in.children.wall_clock_s:g})")
    setter.add_argument("--orchestrator-adapter", metavar="ADAPTER",
                        help="the adapter every role without one of its own runs on ('proxyvisor routing show' "
                             "lists them; built-in default: none)")
    setter.add_argument("--orchestrator-model", metavar="MODEL",
                        help="the model of every role without one of its own (built-in default: the adapter's)")
    setter.add_argument("--orchestrator-effort", metavar="EFFORT",
                        help="the effort of every role without one of its own (built-in default: the adapter's)")
    setter.add_argument("--role", metavar="R", help="the role the --role-* options change (created if new)")
    for key, what in (("adapter", "adapter"), ("model", "model; alone, it also sets the adapter declaring it"),
                      ("effort", "effort, one its adapter declares")):
        setter.add_argument(f"--role-{key}", metavar=key.upper(), help=f"the role's {what} (empty: the orchestrator's)")
    setter.add_argument("--role-description", metavar="TEXT",
                        help="what the role does: the description of its tool, which the agent's model reads")
    setter.add_argument("--role-supervises", metavar="R1,R2",
                        help="roles this role may delegate to, comma-separated (replaces the list; \"\" = none)")
    setter.add_argument("--remove-role", metavar="R", help="delete a role")
    common(setter)
    setter.set_defaults(creates_config=True)
    sup.set_defaults(handler=handler)


def register(commands: Any, common: Callable[..., None], formatter: type) -> None:
    """Add the ``routing``, ``delegate`` and ``health`` commands to the ``proxyvisor`` subparsers, and
    ``supervision``, the deprecated name of ``routing``; each sets ``handler(args, config) -> exit code``.
    ``common(parser, log_help="")`` adds the options every command has (``log_help``: more on ``--log-level``)."""
    _add_routing(commands, "routing", "show or change the delegation and routing policy ([model_routing])",
                 common, formatter, _routing)
    _add_routing(commands, "supervision", "deprecated name of 'routing' (removed in the next release)", common,
                 formatter, _deprecated_routing)

    delegate = commands.add_parser("delegate", help="run one child for a role and print its result",
                                   formatter_class=formatter, description=_DELEGATE_HELP,
                                   epilog=_DELEGATE_EXAMPLES_HELP)
    delegate.add_argument("prompt", nargs="?", metavar="PROMPT",
                          help="the child's task, as one argument (quote it): all the child receives")
    delegate.add_argument("--role", metavar="R",
                          help="the role to run: a [model_routing.roles.R] table (see above; 'proxyvisor routing "
                               "show' lists them); required unless --record or --dead-letters")
    delegate.add_argument("--record", metavar="ID", help="print a stored (claim-checked) result and exit")
    delegate.add_argument("--dead-letters", action="store_true",
                          help="list the dead letters (hand-offs that failed transiently on every attempt; see "
                               "above), oldest first, and exit; with --json as {\"dead_letters\": [...]}")
    delegate.add_argument("--complexity", choices=COMPLEXITY,
                          help="the request's complexity; in adaptive mode a child runs only at or above "
                               "[model_routing] complexity_threshold (default: none, below every threshold)")
    for key in ("adapter", "model", "effort"):
        delegate.add_argument(f"--{key}", metavar=key.upper(),
                              help=f"run on this {key} instead of the role's (default: the role's resolved {key})")
    delegate.add_argument("--json", action="store_true",
                          help="print the result, status, evidence and dead letter id as JSON")
    common(delegate, log_help="; at the default the child's progress shows as plain lines, info and debug add "
                              "the logger detail, error shows errors only")
    delegate.set_defaults(handler=_delegate)

    health = commands.add_parser("health", help="show or clear per-pool breaker state", formatter_class=formatter,
                                 description=textwrap.dedent("""\
        Each model pool is healthy, cooling_down after a failure, or half_open (one recovery probe allowed):
        the pools of delegated children (<adapter>:<bucket>, or <adapter>) and of the agent's own requests
        (upstream:<upstream>:<model>, under [supervisor.breakers]). State is shared by every proxy using the
        state directory, survives restarts and is forgotten only by 'clear'."""))
    hactions = health.add_subparsers(dest="action", metavar="ACTION", required=True)
    hshow = hactions.add_parser("show", help="print the pools' state", formatter_class=formatter)
    hshow.add_argument("name", nargs="?", metavar="POOL|ADAPTER",
                       help="one pool (ADAPTER:BUCKET or upstream:NAME:MODEL), every pool of an adapter, of an "
                            "upstream (upstream:NAME) or of the agent (upstream) (default: every pool); a name no "
                            "pool or adapter has is an error")
    hshow.add_argument("--json", action="store_true", help="print JSON")
    common(hshow)
    hclear = hactions.add_parser("clear", help="forget pool state", formatter_class=formatter)
    hclear.add_argument("name", nargs="?", metavar="POOL|ADAPTER",
                        help="one pool (ADAPTER:BUCKET or upstream:NAME:MODEL, as 'health show' names it), every "
                             "pool of an adapter, of an upstream (upstream:NAME) or of the agent (upstream) "
                             "(default: every pool); a name no pool or adapter has, or an empty one, is an error")
    common(hclear)
    health.set_defaults(handler=_health)


# ---- routing -------------------------------------------------------------------------------------------


def _config_path(args: argparse.Namespace) -> Path:
    return find_config_file(args.config) or default_config_path()


def _assign(table: Any, key: str, value: Any) -> None:
    if value is None:
        return
    if value == "":
        if key in table:
            del table[key]
        return
    table[key] = value


def _infer_adapter(registry: Registry, model: str | None, adapter: str) -> str:
    """The adapter a model belongs to, when the write names none and exactly one catalog declares it."""
    if not model or adapter:
        return ""
    owners = registry.adapter_of_model(model)
    if len(owners) == 1:
        return owners[0]
    raise TargetError(f"model {model!r} is declared by {', '.join(owners) if owners else 'no adapter'}; "
                      "name the adapter")


POLICY_FIELDS = ("mode", "complexity_threshold", "fallback_policy", "max_parallel", "max_depth", "cooldown_default",
                 "cooldown_maximum", "wall_clock", "orchestrator_adapter", "orchestrator_model", "orchestrator_effort",
                 "role", "role_adapter", "role_model", "role_effort", "role_description", "role_supervises",
                 "remove_role")
"""The fields of a policy change (:func:`write_policy`), named as the options of ``routing set`` (``--max-parallel``
is ``max_parallel``). ``role_supervises`` is a comma-separated string."""


def _set_change(fields: Mapping[str, Any], registry: Registry) -> Callable[..., tuple[set[str] | None, bool]]:
    from .adapters.settings import routing_table

    def change(doc: Any, current: Any) -> tuple[set[str] | None, bool]:
        top = routing_table(doc)
        for key in ("mode", "complexity_threshold", "fallback_policy", "max_parallel", "max_depth"):
            _assign(top, key, fields.get(key))
        if fields.get("cooldown_default") is not None or fields.get("cooldown_maximum") is not None:
            cooldown = routing_table(doc, "cooldown")
            _assign(cooldown, "default_seconds", fields.get("cooldown_default"))
            _assign(cooldown, "maximum_seconds", fields.get("cooldown_maximum"))
        if fields.get("wall_clock") is not None:
            _assign(routing_table(doc, "children"), "wall_clock_s", fields["wall_clock"])
        roles: set[str] | None = set()
        orchestrator = False
        given = {k: fields.get(f"orchestrator_{k}") for k in ("adapter", "model", "effort")}
        if any(v is not None for v in given.values()):
            table = routing_table(doc, "orchestrator")
            adapter = given["adapter"] if given["adapter"] is not None else current.orchestrator.adapter
            given["adapter"] = _infer_adapter(registry, given["model"], adapter) or given["adapter"]
            for key, value in given.items():
                _assign(table, key, value)
            roles, orchestrator = None, True
        name = fields.get("role")
        if name:
            table = routing_table(doc, "roles", name)
            role = current.role(name)
            role_adapter = fields.get("role_adapter")
            adapter = role_adapter if role_adapter is not None else (role.adapter if role else "")
            inherited = adapter or current.orchestrator.adapter
            inferred = _infer_adapter(registry, fields.get("role_model"), inherited)
            _assign(table, "adapter", inferred or role_adapter)
            for key in ("model", "effort", "description"):
                _assign(table, key, fields.get(f"role_{key}"))
            if fields.get("role_supervises") is not None:
                table["supervises"] = [r for r in (s.strip() for s in fields["role_supervises"].split(",")) if r]
            if roles is not None:
                roles.add(name)
        if fields.get("remove_role"):
            existing = routing_table(doc, "roles")
            if fields["remove_role"] not in existing:
                raise TargetError(f"role {fields['remove_role']!r} is not configured")
            del existing[fields["remove_role"]]
        return roles, orchestrator

    return change


def write_policy(path: Path, action: str, fields: Mapping[str, Any], registry: Registry) -> Config:
    """Apply ``action`` to ``[model_routing]`` of the configuration file at ``path`` (created if missing) and return
    the new configuration: ``enable``, ``disable``, or ``set`` with ``fields`` (:data:`POLICY_FIELDS`; a missing or
    None field is left alone, ``""`` removes it so it is inherited again). Validated against the descriptors in
    ``registry``, locked, atomic, comments kept (:func:`proxyvisor.adapters.settings.update`).

    Raises:
        SettingsError: the file is malformed, the result is invalid, a target is rejected (the message says why),
            a role's field is given without the role, or the lock could not be taken; nothing was written.
        TargetError: a model no single adapter declares, or removing a role that is not configured.
    """
    from .adapters.settings import SettingsError, routing_table, update

    if action in ("enable", "disable"):
        on = action == "enable"

        def change(doc: Any, current: Any) -> tuple[set[str] | None, bool]:
            routing_table(doc)["enabled"] = on
            return (None, True) if on else (set(), False)

        return update(path, change, registry)
    if action != "set":
        raise ValueError(f"unknown action {action!r}")
    role_fields = [f for f in POLICY_FIELDS if f.startswith("role_") and fields.get(f) is not None]
    if role_fields and not fields.get("role"):
        raise SettingsError(f"{', '.join(role_fields)} given without role (--role R): name the role to change; "
                            "nothing written")
    return update(path, _set_change(fields, registry), registry)


def _print_policy(config: Config, registry: Registry) -> None:
    r = config.model_routing
    state = "enabled" if r.enabled else "disabled (turn on: proxyvisor routing enable)"
    print(f"delegation: {state}   [{config.source}]")
    print(f"mode: {r.mode}   complexity_threshold: {r.complexity_threshold}   fallback_policy: {r.fallback_policy}")
    print(f"max_parallel: {r.max_parallel}   max_depth: {r.max_depth}   cooldown: {r.cooldown.default_seconds:g} s "
          f"first, {r.cooldown.maximum_seconds:g} s at most")
    c = r.children
    print(f"children: wall clock {c.wall_clock_s:g} s, idle warning {c.idle_warn_s:g} s, idle cancel "
          f"{c.idle_cancel_s:g} s, stop grace {c.stop_grace_s:g} s, claim check over {c.claim_check_chars} "
          f"characters, budget {c.budget_tokens or 'unlimited'} tokens")
    o = r.orchestrator
    print(f"orchestrator: adapter={o.adapter or '-'} model={o.model or '-'} effort={o.effort or '-'}")
    shown = routing_json(config, registry)
    resolved = shown["resolved"]
    print("roles:" if r.roles else "roles: none")
    for role in r.roles:
        route = resolved[role.name]
        target = (f"{route['adapter']} / {route['model'] or '(runtime default)'} / {route['effort'] or '-'}  "
                  f"(pool {route['capacity_scope']})") if "adapter" in route else f"UNAVAILABLE: {route['unavailable']}"
        saved = f"saved: adapter={role.adapter or '-'} model={role.model or '-'} effort={role.effort or '-'}"
        print(f"  {role.name}: {target}\n    {saved}; supervises: {', '.join(role.supervises) or '-'}")
    print("adapters:")
    for adapter_id, a in shown["adapters"].items():
        status = "ready" if a["ready"] else f"unavailable: {a['unavailable']}"
        models = ", ".join(f"{m['id']} ({m['bucket'] or adapter_id})" for m in a["models"]) or "any model string"
        print(f"  {adapter_id}: {status}\n    capabilities: {', '.join(a['capabilities'])}; models: {models}; "
              f"efforts: {', '.join(a['efforts']) or '-'}")
    for error in registry.errors:
        print(f"  (skipped) {error}")


def _deprecated_routing(args: argparse.Namespace, config: Config) -> int:
    print("proxyvisor: 'supervision' is deprecated and will be removed in the next release: use "
          f"'proxyvisor routing {args.action}'", file=sys.stderr)
    return _routing(args, config)


def _routing(args: argparse.Namespace, config: Config) -> int:
    from .adapters.settings import SettingsError

    registry = registry_for(config.model_routing.adapters_dir)
    if args.action == "show":
        if args.json:
            print(orjson.dumps(routing_json(config, registry), option=orjson.OPT_INDENT_2).decode())
        else:
            _print_policy(config, registry)
        return 0
    path = _config_path(args)
    try:
        new = write_policy(path, args.action, {f: getattr(args, f, None) for f in POLICY_FIELDS}, registry)
    except (SettingsError, TargetError) as exc:
        print(f"proxyvisor: refused: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: written; delegation is {'enabled' if new.model_routing.enabled else 'disabled'}")
    return 0


# ---- delegate -------------------------------------------------------------------------------------------


@contextmanager
def _progress_lines(plain: bool) -> Iterator[None]:
    """With ``plain`` (the default log level), show the child's progress records as plain lines on stderr
    (``proxyvisor: worker started on ...``), info ones included, while other records keep to the log level;
    otherwise the progress records are logged like any other, at the level asked for."""
    if not plain:
        yield
        return
    from .adapters.runtime import progress_log

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("proxyvisor: %(message)s"))
    level, propagate = progress_log.level, progress_log.propagate
    progress_log.addHandler(handler)
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False
    try:
        yield
    finally:
        progress_log.removeHandler(handler)
        progress_log.setLevel(level)
        progress_log.propagate = propagate


def _dead_letters(config: Config, as_json: bool) -> int:
    from .adapters.dead_letters import DeadLetterStore

    children = config.model_routing.children
    store = DeadLetterStore(config.state_dir() / "dead_letters", children.dead_letter_retention_s,
                            children.dead_letters_kept)
    try:
        letters = store.all()
    finally:
        store.close()
    if as_json:
        print(orjson.dumps({"dead_letters": letters}, option=orjson.OPT_INDENT_2).decode())
        return 0
    if not letters:
        print("no dead letters: no hand-off failed on every attempt")
        return 0
    for letter in letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(letter.get("created_at", 0)))
        route, failure = letter.get("route") or {}, letter.get("failure") or {}
        wait = f" (retry after {failure['retry_after_s']} s)" if failure.get("retry_after_s") else ""
        prompt = " ".join(str(letter.get("prompt", "")).split())
        print(f"{letter['id']}  {when}  role {letter.get('role')} on {route.get('capacity_scope')}: "
              f"{letter.get('reason')}\n  last failure: {failure.get('category')}: {failure.get('message')}{wait}"
              f"\n  prompt ({letter.get('prompt_chars', len(prompt)):,} characters): "
              f"{prompt[:200] + ('…' if len(prompt) > 200 else '')}")
    return 0


def _delegate(args: argparse.Namespace, config: Config) -> int:
    from .adapters.results import ClaimStore
    from .adapters.state import backend_of

    if args.dead_letters:
        return _dead_letters(config, args.json)
    if args.record:
        store = ClaimStore(backend_of(config).kv(ClaimStore.NAMESPACE), config.model_routing.children.claim_retention_s)
        record = store.get(args.record)
        if record is None:
            print(f"proxyvisor: no stored result {args.record!r} (unknown or expired)", file=sys.stderr)
            return 1
        sys.stdout.write(record["text"])
        return 0
    if not args.role or not args.prompt:
        print("proxyvisor: delegate needs --role R and a PROMPT (or --record ID, or --dead-letters)", file=sys.stderr)
        return 2
    if not config.model_routing.enabled:
        print("proxyvisor: delegation is disabled; nothing ran (turn it on: proxyvisor routing enable)",
              file=sys.stderr)
        return 2
    import trio

    from .adapters.delegate import FAILED, OK, REFUSED, SKIPPED, Delegation, Delegator

    delegator = Delegator(config)
    override = RouteTarget(args.adapter or "", args.model or "", args.effort or "")
    stopped_by: list[int] = []

    async def run() -> Delegation | None:
        # A signal cancels the delegation, which stops the child (its process group: SIGTERM, then SIGKILL after
        # stop_grace_s) before this returns; the child runs in a session of its own, so nothing else reaches it.
        with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                async def on_signal() -> None:
                    async for signum in signals:
                        stopped_by.append(signum)
                        print(f"proxyvisor: {signal.Signals(signum).name}: stopping the child (SIGTERM, then SIGKILL "
                              f"after {config.model_routing.children.stop_grace_s:g} s)", file=sys.stderr, flush=True)
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(on_signal)
                result = await delegator.delegate(args.role, args.prompt, complexity=args.complexity,
                                                  override=override, traceparent=os.environ.get("TRACEPARENT"))
                nursery.cancel_scope.cancel()
                return result
        return None

    try:
        with _progress_lines(args.log_level == "warning"):
            result = trio.run(run)
    finally:
        delegator.close()
    if result is None:
        name = signal.Signals(stopped_by[0]).name
        print(f"proxyvisor: delegate stopped by {name}; the child was stopped, nothing was printed", file=sys.stderr)
        return 128 + stopped_by[0]
    if args.json:
        print(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2).decode())
    elif result.status in (OK, SKIPPED):
        print(result.result.as_text())
    elif result.reason:  # nothing ran: say why as a command does, not as the tool result a model would get
        print(f"proxyvisor: nothing ran: {result.reason.removeprefix('invalid: ')}", file=sys.stderr)
    else:
        print(result.result.as_text(), file=sys.stderr)
    if result.status in (OK, SKIPPED):
        return 0
    return 1 if result.status in (FAILED, REFUSED) else 2


# ---- health ---------------------------------------------------------------------------------------------


def _declared_pools(config: Config, registry: Registry) -> list[str]:
    """Every pool the adapter descriptors declare (each adapter's own and the ``<adapter>:<bucket>`` of its models),
    and the agent's pools of each configured upstream (``upstream:NAME``, a prefix of its ``upstream:NAME:MODEL``)."""
    return list(dict.fromkeys([*(pool for d in registry.descriptors.values()
                                 for pool in (d.id, *(d.pool(m.id) for m in d.models))),
                               *_upstream_pools(config)]))


def _upstream_pools(config: Config) -> list[str]:
    from .proxy.breakers import PREFIX

    return [f"{PREFIX}:{u.name}" for u in config.upstreams]


def _names_a_pool(name: str, recorded: list[str], config: Config, registry: Registry) -> bool:
    """Whether ``name`` is a pool or an adapter ``health show|clear`` can mean: one with recorded health, one the
    descriptors or the configured upstreams declare (:func:`_declared_pools`), or one they meter (an adapter with
    ``pool_per_model`` any ``<adapter>:<model>``, an upstream any ``upstream:NAME:<model>``)."""
    if any(named(pool, name) for pool in (*recorded, *_declared_pools(config, registry))):
        return True
    if any(named(name, upstream) for upstream in _upstream_pools(config)):
        return True
    adapter, _, model = name.partition(":")
    descriptor = registry.descriptors.get(adapter)
    return descriptor is not None and descriptor.pool_per_model and bool(model)


def _health(args: argparse.Namespace, config: Config) -> int:
    from .adapters.health_store import routing_health
    from .adapters.state import backend_of

    store = routing_health(backend_of(config), config.model_routing.cooldown)
    name: str | None = args.name
    done = "cleared" if args.action == "clear" else "shown"
    if name is not None and not name.strip():
        # An unset "$POOL" in a script: never read as "every pool".
        print(f"proxyvisor: health {args.action}: the pool name is empty; nothing {done} (name a pool or "
              f"an adapter as 'health show' lists them, 'upstream' for every pool of the agent, or give no name for "
              f"every pool)", file=sys.stderr)
        return 2
    try:
        pools = store.all()
        if name is not None:
            recorded = [p.pool for p in pools]
            registry = registry_for(config.model_routing.adapters_dir)
            if not _names_a_pool(name, recorded, config, registry):
                known = sorted(set(recorded) | set(_declared_pools(config, registry)))
                print(f"proxyvisor: no pool or adapter is named {name!r}; nothing {done} (known pools: "
                      f"{', '.join(known) or 'none'})", file=sys.stderr)
                return 1
        if args.action == "clear":
            cleared = store.clear(name)
            print(f"cleared {len(cleared)} pool(s)" + (f": {', '.join(cleared)}" if cleared else ""))
            return 0
        shown = health_json([p for p in pools if name is None or named(p.pool, name)], time.time())
        rows = shown["pools"]
        if args.json:
            print(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())
            return 0
        if not rows:
            print("no pool has recorded health: every pool is healthy" if name is None else
                  f"{name}: healthy (no pool of it has recorded health)")
            return 0
        for row in rows:
            extra = f", recovers in {row['recovers_in_s']:g} s" if row["recovers_in_s"] is not None else ""
            extra += " (probe in flight)" if row["probe_in_flight"] else ""
            last = f" (last failure: {row['last_category']})" if row["last_category"] else ""
            print(f"{row['pool']}: {row['state']}{extra}; failures in a row: {row['failure_count']}{last}")
        return 0
    finally:
        store.close()
