"""Security (issue 7, item 6): where proxyvisor listens, where it sends, what it names files after, and that no
credential ever leaves it except to the configured upstream.

The translation path's own cases (body fields that would steer litellm, a key quoted back in a litellm error)
are in ``test_translate.py``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.adapters.state import DiskKV
from proxyvisor.adapters.failures import Failure
from proxyvisor.adapters.health import Cooldown
from proxyvisor.adapters.health_store import HealthStore
from proxyvisor.scripted.upstream import ScriptedUpstream, policy
from proxyvisor.proxy.condense_decisions import Decision, DecisionCache
from proxyvisor.proxy.spill import SpillStore
from proxyvisor.config import Config
from proxyvisor.proxy.formats import CHAT, MESSAGES, RESPONSES
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.sessions import SESSION_ID, InvalidSession, identify, split_prefix
from proxyvisor.store import Store

from helpers import FORMATS, TOOL_STEP, closed_port, files_under, raw_stream, request_body, serve_handler
from test_reliability_crash import start_serve

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def listening_addresses(pid: int, port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp{,6}) on which process ``pid``'s network namespace listens on
    ``port``."""
    found = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


# ---- where it listens ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's socket table (Linux)")
def test_serve_listens_on_loopback_only_by_default(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    proc, url = start_serve(config, tmp_path / "serve.log")
    try:
        port = int(url.rsplit(":", 1)[1])
        assert url.startswith("http://127.0.0.1:")
        assert listening_addresses(proc.pid, port) == ["0100007F"]  # 127.0.0.1, and nothing else
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert Config().proxy.host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "example.com"])
def test_a_non_loopback_bind_without_an_auth_token_is_refused_before_binding(host: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "serve", "--host", host, "--port", "0"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert "auth_token" in done.stderr and "listening" not in done.stderr
    # The same rule for every command that starts a proxy, from the configuration file.
    config = tmp_path / "config.toml"
    config.write_text(f'[proxy]\nhost = "{host}"\n')
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "wrap", "--config", str(config), "--", "true"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and "auth_token" in done.stderr


def test_wrap_gives_each_run_a_fresh_unguessable_run_prefix(tmp_path: Path) -> None:
    script = "import os; print(os.environ['PROXYVISOR_SESSION'], os.environ['ANTHROPIC_BASE_URL'])"
    seen = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "proxyvisor", "wrap", "--quiet", "--state-dir",
                               str(tmp_path / "state"), "--", sys.executable, "-c", script],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        run, base = done.stdout.split()
        assert re.fullmatch(r"[0-9a-f]{32}", run)  # 128 random bits (secrets.token_hex)
        assert base.endswith(f"/r/{run}")
        seen.append(run)
    assert seen[0] != seen[1]


# ---- where it sends -----------------------------------------------------------------------------------------


class Counter:
    """A server that only counts: nothing may ever reach it."""

    def __init__(self) -> None:
        self.hits: list[str] = []

    async def __call__(self, request: Request) -> Response:
        self.hits.append(request.target)
        return Response(200, [(b"content-type", b"application/json")], b"{}")


async def raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head + body)
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
async def test_no_header_target_or_body_field_redirects_the_upstream(supervised: bool, start_proxy,
                                                                      scripted_server) -> None:
    evil = Counter()
    async with serve_handler(evil) as evil_url, \
            start_proxy(supervised=supervised, upstream_url=scripted_server.url) as rp:
        evil_host = evil_url.removeprefix("http://")
        steering_headers = {"host": evil_host, "x-forwarded-host": evil_host, "x-forwarded-proto": "http",
                            "forwarded": f"host={evil_host};proto=http", "x-original-url": evil_url + "/v1/x",
                            "x-rewrite-url": evil_url, "x-proxyvisor-upstream": evil_url,
                            "x-http-method-override": "CONNECT"}
        steering_body = {"base_url": evil_url, "api_base": evil_url + "/v1", "url": evil_url,
                         "endpoint": evil_url, "upstream": evil_url, "baseURL": evil_url}
        for fmt in FORMATS:
            reply, _ = await raw_stream(rp.url, fmt, request_body(fmt, **steering_body), headers=steering_headers)
            assert reply.status_code == 200
            assert scripted_server.script.requests[-1][2]["host"] == scripted_server.url.removeprefix("http://")
        body = orjson.dumps(request_body("chat"))
        for target in (f"{evil_url}/v1/chat/completions", f"//{evil_host}/v1/chat/completions",
                       f"/s/x//{evil_host}/v1/chat/completions", f"/v1/chat/completions@{evil_host}",
                       f"/v1/chat/completions/..//{evil_host}/v1/chat/completions", f"http:/{evil_host}/v1/models",
                       f"{evil_host}/v1/chat/completions"):
            head = (f"POST {target} HTTP/1.1\r\nhost: {evil_host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
            answer = await raw_request(rp.port, head, body)
            assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 404 ")), (target, answer[:200])
        answer = await raw_request(rp.port, f"CONNECT {evil_host} HTTP/1.1\r\nhost: {evil_host}\r\n"
                                            "connection: close\r\n\r\n".encode())
        assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 404 ", b"HTTP/1.1 405 "))
        # A query string goes to the configured upstream with the path it belongs to, nowhere else.
        reply, _ = await raw_stream(rp.url + "/s/q", "messages", request_body("messages"))
        assert reply.status_code == 200
    assert evil.hits == []


# ---- session ids and file names -----------------------------------------------------------------------------

_ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["..", "../..", ".", "/", "a/../../b", "..%2f..%2f", "%2e%2e", "\\..\\..", "a\x00b", "~root", "-rf", "CON",
     "a\nb", " a", "a" * 200, "é" * 10, "𝓊"])


def inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


@settings(max_examples=300, deadline=None)
@given(_ANY_TEXT)
def test_no_session_id_from_a_path_header_or_body_names_a_file_outside_the_state_dir(text: str) -> None:
    root = Path("/tmp/proxyvisor-never-written/state")
    store = Store(root)
    ids = []
    if "/" not in text:
        try:
            ids.append(split_prefix(f"/s/{text}/v1/messages")[0])
        except InvalidSession:
            pass
    try:
        ids.append(identify(None, {"x-proxyvisor-session": text}.get, CHAT, {})[0])
    except InvalidSession:
        pass
    for fmt, body in ((CHAT, {"user": text}), (RESPONSES, {"prompt_cache_key": text}),
                      (MESSAGES, {"metadata": {"user_id": text}}),
                      (MESSAGES, {"metadata": {"user_id": orjson.dumps({"session_id": text}).decode()}})):
        ids.append(identify(None, {}.get, fmt, body)[0])  # a body id is never refused: hashed when unsafe
    for session in ids:
        assert SESSION_ID.match(session)
        assert inside(store.ledger_path(session), root / "ledger")
    spill = SpillStore(root / "spill")
    path = spill.path_for(text, text, "0123456789abcdef" * 4)
    assert inside(path, root / "spill") and path.parent.parent == (root / "spill").resolve()


async def test_traversal_attempts_in_urls_are_refused_and_write_nothing(proxy, state_dir: Path,
                                                                         tmp_path: Path) -> None:
    """Sent raw: an HTTP client would resolve the dot segments itself."""
    body = orjson.dumps(request_body("messages"))
    for session in ("..", "../..", "../../x", "..%2F..%2Fx", "%2e%2e", ".%2e", "a%00", "a%2Fb", "./x", "~"):
        head = (f"POST /s/{session}/v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        answer = await raw_request(proxy.port, head, body)
        assert answer.startswith(b"HTTP/1.1 400 "), (session, answer[:200])
    for value in ("../x", "..", "/etc/passwd", "a\\b"):
        reply, _ = await raw_stream(proxy.url, "chat", request_body("chat"), headers={"x-proxyvisor-session": value})
        assert reply.status_code == 400, value
    assert files_under(state_dir) == [] and not (tmp_path / "x").exists()
    for value in ("../x", "..", "/etc/passwd", "a\\b"):  # a client's own header: hashed into a safe id
        reply, _ = await raw_stream(proxy.url, "chat", request_body("chat"), headers={"session-id": value})
        assert reply.status_code == 200, value
    ledgers = sorted((state_dir / "ledger").glob("*.jsonl"))
    assert len(ledgers) == 4 and all(inside(path, state_dir) for path in files_under(state_dir))
    assert not (tmp_path / "x").exists()


# ---- credentials --------------------------------------------------------------------------------------------

CLIENT_KEY = "sk-canary-client-" + os.urandom(12).hex()
CONFIG_KEY = "sk-canary-config-" + os.urandom(12).hex()
TOKEN = "canary-token-" + os.urandom(12).hex()
QUOTING_401 = {"fault": {"status": 401, "message": f"Incorrect API key provided: {CONFIG_KEY}"}}


class Echo:
    """A hostile upstream: answers 401 and quotes every header it got back in the error message."""

    async def __call__(self, request: Request) -> Response:
        quoted = "; ".join(f"{k.decode()}={v.decode('latin-1')}" for k, v in request.headers)
        body = orjson.dumps({"error": {"message": f"Incorrect API key provided. You sent: {quoted}",
                                       "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        return Response(401, [(b"content-type", b"application/json")], body)


def plan(extra: list[dict[str, Any]]) -> list[tuple[str, bool, dict[str, Any]]]:
    """(format, stream, scripted step) of each request :func:`exercise` sends: every format, streamed and not,
    through success, 429, 500, a reset mid-stream, then ``extra``."""
    return [(fmt, stream, step) for fmt in FORMATS for stream in (False, True)
            for step in [TOOL_STEP, {"fault": {"status": 429}}, {"fault": {"status": 500, "message": "boom"}},
                         *([{"fault": {"reset_after_events": 2}}] if stream else []), *extra]]


async def exercise(url: str, upstream: ScriptedUpstream | None, extra: list[dict[str, Any]]) -> list[bytes]:
    """Send :func:`plan`'s requests with the canary credentials (queueing their steps on ``upstream`` when
    given); every answer's body and headers as the client got them."""
    returned = []
    for fmt, stream, step in plan(extra):
        if upstream is not None:
            upstream.queue(step)
        headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-proxyvisor-auth": TOKEN}
        if fmt == "messages":
            headers["x-api-key"] = CLIENT_KEY
        reply, data = await raw_stream(url + "/s/canary", fmt, request_body(fmt, stream), headers=headers)
        returned.append(data + repr(reply.headers.raw).encode())
    return returned


def assert_no_canary(*texts: bytes | str, keys: tuple[str, ...] = (CLIENT_KEY, CONFIG_KEY, TOKEN)) -> None:
    for text in texts:
        data = text.encode() if isinstance(text, str) else text
        for key in keys:
            assert key.encode() not in data, data[max(0, data.find(key.encode()) - 300):][:600]


def everything_under(*roots: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in files_under(*roots) if p.is_file())


@pytest.mark.parametrize("configured", [True, False], ids=["configured-key", "client-key"])
async def test_a_canary_key_never_appears_in_state_logs_or_answers(configured: bool, start_proxy, state_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """Both kinds of credential, success and every error path, upstreams quoting the key back included; the state
    directory, the logs at DEBUG (every logger) and every answer the client got are searched. A client may be
    quoted its own key by its upstream; never the key configured for proxyvisor."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("PV_CANARY_KEY", CONFIG_KEY)
    fields = {"api_key_env": "PV_CANARY_KEY"} if configured else {}
    async with start_proxy(upstream=fields, breakers=False) as rp:
        returned = await exercise(rp.url, rp.scripted["scripted"], [QUOTING_401] if configured else [])
        sent = rp.scripted["scripted"].requests[0][2]
        assert (CONFIG_KEY if configured else CLIENT_KEY) in str(sent)  # it did go to the upstream
    async with serve_handler(Echo()) as echo_url, start_proxy(upstream_url=echo_url, upstream=fields,
                                                                           breakers=False) as rp:
        returned += await exercise(rp.url, None, [])
    async with start_proxy(upstream_url=f"http://127.0.0.1:{closed_port()}", upstream=fields, breakers=False) as rp:
        returned += await exercise(rp.url, None, [])
    out, err = capfd.readouterr()
    if configured:  # the scripted 401 of each format and mode, and every answer of the echoing upstream
        assert sum(b"[redacted]" in r for r in returned) == 2 * len(FORMATS) + len(plan([]))
    assert_no_canary(*returned, keys=(CONFIG_KEY, TOKEN) if not configured else (CLIENT_KEY, CONFIG_KEY, TOKEN))
    assert_no_canary(everything_under(state_dir), caplog.text, out, err)
    assert caplog.records  # something was logged at all


class RefusesSupervisor(ScriptedUpstream):
    """Answers the agent's requests as the scripted upstream does, and every supervisor model call (the verifier's,
    on the session's route) with :class:`Echo`'s 401 quoting every header it got."""

    async def __call__(self, request: Request) -> Response:
        fmt = {f.path: f for f in (CHAT, MESSAGES, RESPONSES)}.get(request.path)
        if fmt is not None and policy(fmt, orjson.loads(request.body)) is not None:
            self.refused = getattr(self, "refused", 0) + 1
            return await Echo()(request)
        return await super().__call__(request)


@pytest.mark.parametrize("configured", [True, False], ids=["configured-key", "client-key"])
async def test_a_canary_key_never_appears_when_the_sessions_route_refuses_the_verifier(
        configured: bool, start_proxy, state_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The verifier's call takes the agent's route with its credentials (or the configured key); the upstream
    refuses it and quotes them back. The turn's label gives the reason, and no ledger line, state file or log line
    holds a key, nor does any answer."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("PV_CANARY_KEY", CONFIG_KEY)
    upstream = RefusesSupervisor([{"text": "Done."}] * 6)
    fields = {"api_key_env": "PV_CANARY_KEY"} if configured else {}
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url, upstream=fields, gate=True) as rp:
        returned = []
        for fmt in FORMATS:
            for stream in (False, True):
                headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY}
                reply, data = await raw_stream(rp.url + "/s/canary", fmt, request_body(fmt, stream),
                                               headers=headers)
                assert reply.status_code == 200 and b"Done." in data
                returned.append(data + repr(reply.headers.raw).encode())
    assert upstream.refused == 2 * len(FORMATS)
    ledger = Store(state_dir).read_ledger("canary")
    reasons = [line["gate"]["reason"] for line in ledger]
    assert all("refused the supervisor call (401)" in r and "[redacted]" in r for r in reasons), reasons
    assert_no_canary(*returned, everything_under(state_dir), caplog.text)


def test_a_canary_key_never_appears_in_serves_debug_log(tmp_path: Path) -> None:
    """The real command, logging at DEBUG to stderr, behind an auth token: chat and messages on the embedded
    scripted upstream playing the plan (its 401 quoting the configured key), responses on an upstream that
    refuses connections."""
    state = tmp_path / "state"
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps([step for fmt, _s, step in plan([QUOTING_401]) if fmt != "responses"]))
    config = tmp_path / "config.toml"
    config.write_text(f'[proxy]\nauth_token = "{TOKEN}"\n[state]\ndir = "{state}"\n'
                      '[supervisor.breakers]\nenabled = false\n'
                      f'[upstreams.down]\nurl = "http://127.0.0.1:{closed_port()}"\nformats = ["responses"]\n'
                      'api_key_env = "PV_CANARY_KEY"\n'
                      f'[upstreams.scripted]\nscript = "{script}"\napi_key_env = "PV_CANARY_KEY"\n')
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "proxyvisor", "serve", "--config", str(config), "--port", "0",
                             "--log-level", "debug"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=log.open("wb"), env=dict(os.environ, PV_CANARY_KEY=CONFIG_KEY))
    try:
        deadline = time.monotonic() + 30
        while b"listening on" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        url = re.search(rb"listening on (http://127\.0\.0\.1:\d+)", log.read_bytes()).group(1).decode()
        returned = trio.run(exercise, url, None, [QUOTING_401])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert sum(b"[redacted]" in r for r in returned) == 4  # chat and messages, streamed and not
    assert sum(b"unreachable" in r for r in returned) == len(plan([QUOTING_401])) // 3
    assert_no_canary(log.read_bytes(), everything_under(state), *returned)
    assert b"WARNING proxyvisor.pipeline" in log.read_bytes()  # the error paths were logged


# ---- private files ------------------------------------------------------------------------------------------


def test_every_state_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """Folders 0700 and files 0600 under a umask of 0, for every writer of the state directory."""
    state = tmp_path / "state"
    old = os.umask(0)
    try:
        Store(state).append_ledger("s1", {"ok": True})
        spill = SpillStore(state / "spill")
        spill.write(spill.path_for("s1", "Bash", "ab" * 32), "output\n")
        cache = DecisionCache(DiskKV(state / "condense"))
        cache.settle("k", Decision(None, "kept", 1, 1, 1, 1))
        cache.close()
        health = HealthStore(DiskKV(state / "health"), Cooldown())
        health.settle_sync("a:b", 1.0, Failure("capacity", True, "known_failed"))
        health.close()
    finally:
        os.umask(old)
    loose = [f"{p.relative_to(tmp_path)} {stat.S_IMODE(p.stat().st_mode):o}" for p in [state, *files_under(state)]
             if stat.S_IMODE(p.stat().st_mode) != (0o700 if p.is_dir() else 0o600)]
    assert loose == []
