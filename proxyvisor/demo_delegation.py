"""The delegation part of ``proxyvisor demo``: a child role, and a pool's breaker opening and closing again.

The demo's own policy turns delegation on for one role, ``reviewer``, on the ``scripted`` adapter (no key, no
network), whatever the configuration says. The same example agent asks five times for a review; the scripted
parent model calls the ``reviewer`` delegation tool each time, and the child's scripted model answers:

1. with a review: the proxy runs the child, continues the turn with its result, and the agent sees only the
   parent's continued answer; the request's ledger line carries the child's evidence;
2. with a 429 and ``Retry-After: 1``, then a review: the pool ``scripted:scripted`` cools down for that second,
   the hand-off is run again once it is over, as the pool's half-open probe, and the parent gets the review; both
   attempts are in the evidence;
3. with a 429 on each of its three attempts: the hand-off becomes a dead letter, and the parent model gets an
   error result naming it;
4. not at all: the pool is cooling, so the proxy refuses the delegation without starting a child;
5. after the cooldown, with a review again: this child is the pool's one half-open probe, and its success makes
   the pool healthy.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import trio
from rich.console import Console
from rich.markup import escape

from .config import ChildrenConfig, Config, ModelRoutingConfig, RoleConfig
from .demo import agent_turn, opening, say
from .proxy.formats import WireFormat
from .proxy.service import running
from .scripted.runtime import ScriptedRuntime
from .store import Store

ROLE = RoleConfig("reviewer", adapter="scripted", description="Reviews a file and reports what is wrong with it.")
TASK = "Have app.py reviewed, then tell me what the reviewer said."
COOLDOWN_S = 1


def _call(n: int) -> dict[str, Any]:
    return {"text": "I will ask the reviewer.\n",
            "tool_calls": [{"name": "reviewer", "arguments": {"prompt": "Review app.py and list its problems."},
                            "id": f"call_review_{n}"}]}


LIMITED = {"fault": {"status": 429, "retry_after": str(COOLDOWN_S), "message": "rate limit exceeded"}}
ROUNDS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] = [
    ("a review", [_call(1), {"text": "The reviewer says app.py is fine, but wants a test for empty input."}],
     [{"text": "app.py is fine; add a test for empty input."}]),
    ("a rate limit, then a review", [_call(2), {"text": "The reviewer says app.py is fine."}],
     [LIMITED, {"text": "app.py is fine."}]),
    ("a rate limit on every attempt",
     [_call(3), {"text": "The reviewer is rate-limited just now; I will go on without it."}], [LIMITED] * 3),
    ("a cooling pool", [_call(4), {"text": "The reviewer is still cooling down; I will try again later."}], []),
    ("the half-open probe", [_call(5), {"text": "The reviewer is back: app.py is fine."}],
     [{"text": "app.py is fine."}]),
]


def demo_config(config: Config) -> Config:
    """``config`` with the demo's routing policy: delegation on, the one ``reviewer`` role on ``scripted``."""
    routing = msgspec.structs.replace(ModelRoutingConfig(), enabled=True, roles=(ROLE,),
                                      adapters_dir=config.model_routing.adapters_dir,
                                      children=msgspec.structs.replace(ChildrenConfig(), retry_backoff_s=0.5))
    return msgspec.structs.replace(config, model_routing=routing).with_overrides(supervisor={"enabled": True})


async def run_delegating_agent(config: Config, store: Store, fmt: WireFormat, console: Console) -> None:
    """The five rounds of the module docstring, printed as they happen."""
    session = f"demo-delegate-{fmt.name}-{int(time.time())}"
    async with running(demo_config(config), port=0, store=store) as proxy:
        parent = proxy.scripted[next(iter(proxy.scripted))]
        delegation = proxy.pipeline.delegation
        assert delegation is not None  # demo_config turns it on
        runtime = delegation.delegator.runtime("scripted")
        assert isinstance(runtime, ScriptedRuntime)  # the scripted adapter's
        child, health = runtime.upstream, delegation.delegator.health
        console.print(f"[bold]A model that delegates to a child role[/bold]  ({fmt.label}, streaming)")
        say(console, None, "role [cyan]reviewer[/cyan] on the scripted adapter: the model is offered one tool, "
            "'reviewer', whose input is a prompt; the proxy runs the child, never the agent")
        async with httpx.AsyncClient(timeout=60) as client:
            for number, (what, steps, child_steps) in enumerate(ROUNDS, 1):
                if number == len(ROUNDS):
                    recovery = health.get("scripted:scripted").recovery_at(time.time())
                    wait = max(0.0, recovery - time.time()) if recovery else 0.0
                    say(console, None, f"[dim]... {wait:.1f} s until the pool's cooldown runs out[/dim]")
                    await trio.sleep(wait + 0.05)
                parent.queue(*steps)
                child.queue(*child_steps)
                say(console, None, f"round {number} ({what})")
                say(console, "[cyan]user[/cyan]", TASK)
                turn, _overhead, status = await agent_turn(client, f"{proxy.url}/s/{session}", fmt, opening(TASK))
                calls = ", ".join(c.name for c in turn.tool_calls) or "none"
                say(console, "[magenta]model[/magenta]", f"answers: {escape(' '.join(turn.text.split()))}  "
                    f"[dim](status {status}; tool calls the agent saw: {calls})[/dim]")
                for d in store.read_ledger(session)[-1].get("delegations", ()):
                    _show(d, console)
                pool = health.get("scripted:scripted")
                recovery = pool.recovery_at(time.time())
                until = f", recovers in {recovery - time.time():.1f} s" if recovery else ""
                state = pool.effective_state(time.time())
                say(console, "[red]breaker[/red]", f"pool scripted:scripted is {state}{until}")
    say(console, None, "the agent never saw a call of 'reviewer': each turn came back as the model's continued answer")


def _show(d: dict[str, Any], console: Console) -> None:
    probe = ", the half-open probe" if d.get("health_probe") else ""
    error = f"; {d['error_category']}" if d.get("error_category") else ""
    wait = f", retry after {d['retry_after_s']} s" if d.get("retry_after_s") else ""
    runs = [a["outcome"] + (f" ({a['error_category']})" if a.get("error_category") else "")
            for a in d.get("attempts") or () if a["outcome"] != "refused"]
    tried = f"\n{len(runs)} attempts: {', '.join(runs)}" if len(runs) > 1 else ""
    letter = (f"\ndead letter {d['dead_letter']}: `proxyvisor delegate --dead-letters` lists it"
              if d.get("dead_letter") else "")
    say(console, "[red]supervisor[/red]", f"ran {d['role']}: {d['status']}{error}{wait}{tried}{letter}\n"
        f"on {d.get('gen_ai.provider.name')} / {d.get('gen_ai.request.model')}, pool {d.get('capacity_scope')} "
        f"{d.get('health_state')} at dispatch{probe}\ntrace {d.get('trace_id')}")
