"""The web view (``proxyvisor.proxy.web``): its endpoints under the session model, its page in real headless
Chromium driven by Selenium, live over SSE and after a restart of the proxy on the same state directory.

The browser test needs Chromium and its driver from Debian (``apt-get install chromium chromium-driver``) and
Selenium from PyPI (the test extras). Outside CI a missing one skips it with the reason; in CI (``CI`` set) it
fails. Screenshots go to the test's temporary folder; their paths are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from proxyvisor.config import Config, parse
from proxyvisor.proxy.formats import CHAT, ToolSpec
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.proxy.web import LISTENERS, LedgerFeed
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

ADMIN = "adm+7c1e9/x="
"""An admin token with characters a form decoder would change ("+" read as a space)."""
AUTH = "auth-42b0d"
SESSION = "ui-demo-5f3a"
OTHER = "ui-other-91d2"
QUOTA = "[task:quota]"
DELEGATING = "ui-review-c40e"
REVIEW = "[task:review]"
AGENT = "claude-cli/2.0.14 (external, cli)"
HOSTILE_MODEL = '<img src=x onerror="window.__pv_xss=1">model'
"""A model name that would run script if the page put data into markup."""
_IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WAIT_S = 20.0
"""The longest any page condition is waited for."""
REPORT = '<sup>{{"state":"{state}","focus":"build","next":"check","carry":[],"plan":null}}</sup>'
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})


def config() -> Config:
    """Both tokens set, and delegation on with a ``reviewer`` role on the built-in scripted adapter."""
    return parse({"proxy": {"admin_token": ADMIN, "auth_token": AUTH},
                  "model_routing": {"enabled": True, "roles": {"reviewer": {
                      "adapter": "scripted", "description": "Reviews code and says what is wrong."}}}}, source="test")


def build_output() -> str:
    """A failing build's output, far above the condense threshold: condensed without a model (kind ``build``)."""
    lines = [f"CC src/module_{n}.c -o build/module_{n}.o" for n in range(1800)]
    lines += ["src/module_1200.c:88:13: error: 'frob_limit' undeclared (first use in this function)",
              "make: *** [Makefile:42: build/module_1200.o] Error 1", "BUILD FAILED in 41s"]
    return "\n".join(lines) + "\n"


def _call(call_id: str, command: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "Bash", "arguments": orjson.dumps({"command": command}).decode()}}


class Agent:
    """A scripted agent session in the chat format: each :meth:`step` sends the history so far, as an agent does,
    and appends the answer and the tool result given."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url = client, url
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": "Make the build pass."}]

    async def step(self, result: str | None = None) -> dict[str, Any]:
        body = CHAT.request_from_chat(orjson.loads(orjson.dumps(self.messages)), HOSTILE_MODEL, False, (BASH,))
        reply = await self.client.post(f"{self.url}/s/{SESSION}{CHAT.path}", json=body,
                                       headers={"x-proxyvisor-auth": AUTH, "user-agent": AGENT})
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        self.messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        for call in message.get("tool_calls") or ():
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result or ""})
        return dict(message)


def script() -> list[dict[str, Any]]:
    """The model's side: a build (its failing output condensed), the same status poll three times (the loop
    detector fires and steers), then an edit and a claim of success with no check after it (the verify-gate finds
    a gap and sends the turn back)."""
    report = REPORT.format(state="progressing")
    poll = {"text": f"Checking the build status.\n{report}",
            "tool_calls": [{"name": "Bash", "arguments": {"command": "cat build/status"}}]}
    return [
        {"text": f"Building first.\n{report}", "tool_calls": [{"name": "Bash", "arguments": {"command": "make all"}}]},
        poll, poll, poll,
        {"text": f"Fixing the declaration.\n{report}",
         "tool_calls": [{"name": "Bash", "arguments": {"command": "sed -i s/frob_limt/frob_limit/ src/module_1200.c"}}]},
        {"text": "Fixed: the build passes now.\n" + REPORT.format(state="done")},
        {"text": "Fixed: the build passes now.\n" + REPORT.format(state="done")},
        {"text": "Fixed: the build passes now.\n" + REPORT.format(state="done")},
        {"fault": {"status": 429, "retry_after": "120"}, "marker": QUOTA},
        {"text": "Let me ask the reviewer.", "marker": REVIEW,
         "tool_calls": [{"name": "reviewer", "arguments": {"prompt": "Review app.py for bugs."}}]},
        {"text": "The reviewer found nothing wrong with app.py.", "marker": REVIEW},
    ]


async def delegated(client: httpx.AsyncClient, url: str) -> None:
    """A request of a third session whose answer hands work to the ``reviewer`` role: a child runs, and the turn
    goes on with its result."""
    body = CHAT.request_from_chat([{"role": "user", "content": f"{REVIEW} Have app.py reviewed."}], "scripted-model",
                                  False, (BASH,))
    reply = await client.post(f"{url}/s/{DELEGATING}{CHAT.path}", json=body, headers={"x-proxyvisor-auth": AUTH})
    assert reply.status_code == 200 and "found nothing wrong" in reply.text


async def rate_limited(client: httpx.AsyncClient, url: str) -> None:
    """A request of another session, for another model, that the upstream answers 429: its pool cools down."""
    body = CHAT.request_from_chat([{"role": "user", "content": f"{QUOTA} Summarise the log."}], "other-model",
                                  False, (BASH,))
    reply = await client.post(f"{url}/s/{OTHER}{CHAT.path}", json=body, headers={"x-proxyvisor-auth": AUTH})
    assert reply.status_code == 429


RESULTS = [build_output(), "building: 3 of 7", "building: 3 of 7", "building: 3 of 7", "", None]
"""The tool result the agent gets for each of the script's turns (None: the turn ends)."""


async def run_session(agent: Agent) -> None:
    await run_session_from(agent, 0)


async def run_session_from(agent: Agent, first: int, after: Callable[[int], Awaitable[None]] | None = None) -> None:
    """Play the agent's side from request ``first`` (0-based), awaiting ``after(n)`` after request ``n``."""
    for n in range(first, len(RESULTS)):
        await agent.step(RESULTS[n])
        if after is not None:
            await after(n)


@asynccontextmanager
async def proxy_session(tmp_path: Path, port: int = 0) -> AsyncIterator[tuple[RunningProxy, Store, httpx.AsyncClient]]:
    """A proxy (admin and auth tokens set) over the state dir ``tmp_path / "state"``, and a client for it."""
    store = Store(tmp_path / "state")
    async with running(config(), port=port, store=store, scripted={"scripted": ScriptedUpstream(script())}) as rp, \
            httpx.AsyncClient(base_url=rp.url, timeout=60, headers={"x-proxyvisor-auth": AUTH}) as client:
        yield rp, store, client


async def test_the_overview_on_a_health_store_that_cannot_be_used_is_an_error_naming_it(tmp_path: Path) -> None:
    culprit = tmp_path / "state" / "health" / "cache.db"
    culprit.parent.mkdir(parents=True)
    culprit.write_text("garbage\n")
    async with proxy_session(tmp_path) as (_, _, client):
        reply = await client.get("/proxyvisor/ui/api/overview", headers={"x-proxyvisor-admin": ADMIN})
    assert reply.status_code == 500
    assert reply.json()["error"]["message"].startswith(f"the health store cannot be used: {culprit} cannot be read")


async def test_the_page_is_static_and_the_data_follows_the_session_model(tmp_path: Path) -> None:
    async with proxy_session(tmp_path) as (rp, store, client):
        await run_session(Agent(client, rp.url))
        await rate_limited(client, rp.url)
        await delegated(client, rp.url)
        anonymous = httpx.AsyncClient(base_url=rp.url, timeout=30)
        # The page holds no data: a browser loads it without headers; its policy allows its own files only.
        page = await anonymous.get("/proxyvisor/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff"
        for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
            reply = await anonymous.get(f"/proxyvisor/ui/{name}")
            assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
        # The data needs what every endpoint needs: the auth token, then the admin token or the session's id.
        assert (await anonymous.get(f"/proxyvisor/ui/api/sessions/{SESSION}")).status_code == 401
        for path in ("sessions", "overview", "events"):
            refused = await client.get(f"/proxyvisor/ui/api/{path}")
            assert refused.status_code == 403 and "admin token" in refused.json()["error"]["message"]
            wrong = await client.get(f"/proxyvisor/ui/api/{path}", headers={"x-proxyvisor-admin": "guess"})
            assert wrong.status_code == 403
        assert (await client.get("/proxyvisor/ui/api/sessions/no-such-session")).status_code == 404
        assert (await client.get("/proxyvisor/ui/api/sessions/..%2Fetc")).status_code == 400
        assert (await client.post(f"/proxyvisor/ui/api/sessions/{SESSION}")).status_code == 405
        admin = {"x-proxyvisor-admin": ADMIN}
        reviewing, other, row = (await client.get("/proxyvisor/ui/api/sessions", headers=admin)).json()["sessions"]
        mine = (await client.get(f"/proxyvisor/ui/api/sessions/{SESSION}")).json()
        review = (await client.get(f"/proxyvisor/ui/api/sessions/{DELEGATING}")).json()
        overview = (await client.get("/proxyvisor/ui/api/overview", headers=admin)).json()
    await anonymous.aclose()
    lines = store.read_ledger(SESSION)
    assert row["id"] == SESSION and row["agent"] == "claude-cli/2.0.14" and row["model"] == HOSTILE_MODEL
    assert row["requests"] == len(lines) == 6 and row["gate_outcomes"] == {"unverified": 1}
    assert row["fires"] == {"loop": 1} and row["state"] == "done" and row["in_memory"] is True
    # A session's view: the /info object, and the timeline step by step.
    assert mine["info"]["requests"] == 6 and mine["info"]["gate"]["reentries"] == 2
    steps = mine["timeline"]
    assert [s["n"] for s in steps] == [1, 2, 3, 4, 5, 6] and mine["omitted"] == 0
    (condensed,) = steps[1]["condensed"]["items"]
    assert condensed["tool"] == "Bash" and condensed["condenser"] == "deterministic"
    assert condensed["tokens_before"] > 5 * condensed["tokens_after"]
    assert Path(condensed["spill_path"]).is_file() and Path(condensed["spill_path"]).read_text() == build_output()
    assert steps[4]["signals"] == ["loop"] and steps[4]["steer"]["signal"] == "loop"
    assert steps[4]["steer"]["note"].startswith('<supervisor-note signal="loop">Your last three tool rounds')
    gate = steps[5]["gate"]
    assert (gate["verdicts"], gate["reentries"], gate["outcome"]) == (["gaps"] * 3, 2, "unverified")
    assert gate["gaps"] == ["no check ran after the last change"]
    assert steps[5]["report"] == {"status": "ok", "state": "done"}
    assert (other["id"], other["requests"], other["errors"]) == (OTHER, 1, 1)  # most recent first
    assert reviewing["id"] == DELEGATING
    (handoff,) = review["timeline"][0]["delegations"]
    assert (handoff["role"], handoff["status"], handoff["adapter"]) == ("reviewer", "ok", "scripted")
    assert handoff["runs"] == [{"attempt": 1, "outcome": "answered", "pool": "scripted:scripted",
                               "error_category": None}]
    # Pools and routing: the pool that got a 429 cools down; the built-in scripted adapter can run.
    assert overview["breakers"] is True and overview["routing"]["adapters"]["scripted"]["ready"] is True
    (pool,) = overview["health"]["pools"]
    assert (pool["pool"], pool["state"], pool["last_category"]) == ("upstream:scripted:other-model", "cooling_down",
                                                                   "capacity")
    assert 100 < pool["recovers_in_s"] <= 120


async def test_events_tell_a_listener_of_each_ledger_line_of_its_session(tmp_path: Path) -> None:
    async with proxy_session(tmp_path) as (rp, _store, client):
        agent = Agent(client, rp.url)
        async with client.stream("GET", f"/proxyvisor/ui/api/sessions/{SESSION}/events") as events:
            assert events.headers["content-type"] == "text/event-stream"
            lines = events.aiter_lines()
            with trio.fail_after(WAIT_S):
                assert await anext(lines) == "retry: 2000"
                assert await anext(lines) == "event: ready"
                await agent.step()
                while await anext(lines) != "event: ledger":
                    pass
                data = orjson.loads((await anext(lines)).removeprefix("data: "))
        assert data["session"] == SESSION and data["status"] == 200
    # Closed streams are let go of.
    assert not rp.pipeline.web.feed.listeners


async def test_a_listener_that_falls_behind_is_told_to_resync() -> None:
    feed = LedgerFeed()
    body, never_read = feed.stream("s1").body, feed.stream("s2").body
    assert not isinstance(body, bytes) and not isinstance(never_read, bytes)
    assert b"event: ready" in await body.__anext__()
    for n in range(300):  # more than a listener's backlog
        feed.publish("s1", {"time": str(n), "status": 200})
    assert (await body.__anext__()).startswith(b"event: resync")
    assert (await body.__anext__()).startswith(b"event: ledger")
    await body.aclose()  # type: ignore[attr-defined]
    await never_read.aclose()  # type: ignore[attr-defined]
    assert not feed.listeners


async def test_event_streams_are_bounded() -> None:
    feed = LedgerFeed()
    bodies = [feed.stream(None).body for _ in range(LISTENERS)]
    for body in bodies:
        assert not isinstance(body, bytes)
        await body.__anext__()  # listening
    refused = feed.stream("s1")
    assert refused.status == 503 and b"too many event streams" in refused.body  # type: ignore[operator]
    for body in bodies:
        await body.aclose()  # type: ignore[union-attr]
    assert not feed.listeners and feed.stream("s1").status == 200


def test_the_page_script_builds_text_never_markup() -> None:
    """Tool output and model text are untrusted: the script puts them into text nodes only."""
    source = (Path(__file__).parents[1] / "proxyvisor" / "proxy" / "webui" / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "DOMParser", "createContextualFragment"):
        assert sink not in source, sink


# ---- the page in a real browser -------------------------------------------------------------------------------

def _unavailable(reason: str) -> None:
    if _IN_CI:
        pytest.fail(f"{reason} (CI is set, so the browser test must run)")
    pytest.skip(reason)


@contextmanager
def chromium(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium from Debian under its chromedriver, with a fresh profile and everything that would reach
    for the network off (the machine has none: Chromium would wait on refused connections)."""
    for program in (CHROMIUM, CHROMEDRIVER):
        if not os.access(program, os.X_OK):
            _unavailable(f"{program} is not installed (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1440,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(WAIT_S)
        driver.set_script_timeout(WAIT_S)
        yield driver
    finally:
        driver.quit()


class Page:
    """The web view in ``driver``, each call run off the event loop (Selenium blocks) so the proxy keeps serving."""

    def __init__(self, driver: Any, shots: Path) -> None:
        self.driver, self.shots = driver, shots

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(call, *args)

    async def open(self, url: str) -> None:
        await self.run(self.driver.get, url)

    async def js(self, script: str, *args: Any) -> Any:
        return await self.run(self.driver.execute_script, script, *args)

    async def texts(self, selector: str) -> list[str]:
        found: list[str] = await self.js(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent)", selector)
        return found

    async def wait(self, what: str, check: Callable[[], Any]) -> None:
        """Wait (at most :data:`WAIT_S`) until ``await check()`` is true."""
        with trio.move_on_after(WAIT_S):
            while not await check():
                await trio.sleep(0.1)
            return
        await self.shot("timeout")
        raise AssertionError(f"the page never showed {what}; it shows: {await self.js('return document.body.innerText')}")

    async def wait_text(self, selector: str, text: str) -> None:
        async def shown() -> bool:
            return any(text in t for t in await self.texts(selector))
        await self.wait(f"{text!r} in {selector}", shown)

    async def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        height = await self.js("return Math.max(document.body.scrollHeight, 800)")
        await self.run(self.driver.set_window_size, 1440, min(int(height) + 120, 6000))
        await self.run(self.driver.save_screenshot, str(path))
        print(f"screenshot: {path}")
        return path


async def _shows_the_session_as_the_ledger_has_it(page: Page) -> None:
    """The session's timeline as :func:`script` made it: the condensed build, the loop and its steer note, the
    gated turn; the model's name (markup) as text."""
    await page.wait_text("[data-test=timeline] [data-n='6'] [data-test=gate-outcome]", "unverified")
    build = "[data-test=timeline] [data-n='2'] "
    assert (await page.texts(build + "[data-test=condensed-item] .badge")) == ["deterministic"]
    (tokens,) = await page.texts(build + "[data-test=condensed-tokens]")
    assert tokens.endswith(" tokens (saved " + tokens.split(" (saved ")[1]) and " → " in tokens
    (spill,) = await page.texts(build + "[data-test=spill-path]")
    assert spill.startswith("full original: ") and Path(spill.removeprefix("full original: ")).is_file()
    loop = "[data-test=timeline] [data-n='5'] "
    assert await page.texts(loop + "[data-test=fire]") == ["fired: loop"]
    (note,) = await page.texts(loop + "[data-test=steer-note]")
    assert note.startswith('<supervisor-note signal="loop">Your last three tool rounds repeated the same calls')
    gated = "[data-test=timeline] [data-n='6'] "
    assert await page.texts(gated + "[data-test=verdict]") == ["gaps (evidence)", "gaps (model)", "gaps (model)"]
    assert await page.texts(gated + "[data-test=reentries]") == ["2 re-entries"]
    assert await page.texts(gated + "[data-test=gaps] li") == ["no check ran after the last change"]
    assert await page.texts(gated + "[data-test=report-state]") == ["state: done"]
    # Untrusted text stays text: the model's name is shown as written and nothing of it ran.
    assert HOSTILE_MODEL in await page.js("return document.body.innerText")
    assert await page.js("return window.__pv_xss === undefined && document.querySelectorAll('main img').length === 0")


async def test_the_page_shows_a_session_live_and_after_a_restart(tmp_path: Path) -> None:
    """Real headless Chromium: the session list and a session's timeline update over SSE while the agent works
    (no reload), and once the proxy restarts on the same state directory, the page reconnects and shows the same,
    rebuilt from the ledgers."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with chromium(tmp_path) as driver:
        page = Page(driver, shots)
        async with proxy_session(tmp_path) as (rp, _store, client):
            port = rp.port
            # The listing: opened before any session, with the tokens in the fragment (never sent in a URL).
            await page.open(f"{rp.url}/proxyvisor/ui#admin={ADMIN}&auth={AUTH}")
            await page.wait_text("[data-test=notice]", "No session yet")
            await page.wait_text("#live", "live")
            assert "admin=" not in await page.js("return location.href")  # taken out of the address bar
            await page.js("window.__not_reloaded = true")
            agent = Agent(client, rp.url)
            await agent.step(RESULTS[0])
            await page.wait_text(f"[data-session='{SESSION}'] [data-test=requests]", "1")
            # A session's own view, following the agent as it works.
            await page.js("location.hash = arguments[0]", f"session={SESSION}")
            await page.wait_text("[data-test=timeline] [data-n='1'] [data-test=status]", "200")

            async def after(n: int) -> None:
                await page.wait(f"step {n + 1} in the timeline", lambda: page.js(
                    "return document.querySelector(`[data-test=timeline] [data-n='${arguments[0]}']`) !== null",
                    n + 1))
            await run_session_from(agent, 1, after)
            await _shows_the_session_as_the_ledger_has_it(page)
            assert await page.js("return window.__not_reloaded === true")  # all of it arrived live
            await page.wait_text("#live", "live")
            await page.shot("session-live")
            await rate_limited(client, rp.url)
            await page.js("location.hash = ''")
            await page.wait_text(f"[data-session='{OTHER}'] [data-test=requests]", "1")
            await page.wait_text(f"[data-session='{SESSION}'] [data-test=gate-outcomes]", "unverified 1")
            await page.shot("sessions")
            await page.js("location.hash = 'view=pools'")
            await page.wait_text("[data-pool='upstream:scripted:other-model'] [data-test=breaker]", "cooling_down")
            assert "ready" in await page.texts("[data-adapter=scripted] [data-test=readiness]")
            assert await page.texts("[data-role=reviewer] td") == ["reviewer", "scripted / scripted-model", "scripted:scripted", "–"]
            await page.shot("pools")
            # A delegation and its child run.
            await delegated(client, rp.url)
            await page.js(f"location.hash = 'session={DELEGATING}'")
            await page.wait_text("[data-test=timeline] [data-n='1'] [data-test=delegation-status]", "ok")
            assert await page.texts("[data-test=timeline] [data-n='1'] .runs li") == ["child run 1: answered"]
            await page.shot("delegation")
            await page.js(f"location.hash = 'session={SESSION}'")
            await page.wait_text("[data-test=timeline] [data-n='6'] [data-test=gate-outcome]", "unverified")
        # The proxy is gone: the page says so, and reconnects by itself to the next one on the same state dir.
        await page.wait_text("#live", "reconnecting")
        async with proxy_session(tmp_path, port=port) as (rp, _store, _client):
            await page.wait_text("[data-test=session-id] + .badge", "from the ledger")
            await page.wait_text("#live", "live")
            await _shows_the_session_as_the_ledger_has_it(page)
            assert await page.js("return window.__not_reloaded === true")
            # A fresh load of the page after the restart shows the same.
            await page.open(f"{rp.url}/proxyvisor/ui#session={SESSION}")
            await _shows_the_session_as_the_ledger_has_it(page)
            await page.shot("session-after-restart")
