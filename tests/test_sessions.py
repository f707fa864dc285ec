"""Session identity (first match wins, DESIGN.md "Sessions") and the bounded session table."""

from __future__ import annotations

import orjson
import pytest

from proxyvisor.proxy.formats import CHAT, MESSAGES, RESPONSES
from proxyvisor.proxy.sessions import SESSION_ID, InvalidSession, SessionTable, identify, split_prefix
from proxyvisor.store import Store

from helpers import raw_stream, request_body

CLAUDE_USER_ID = orjson.dumps({"device_id": "d" * 64, "account_uuid": "",
                               "session_id": "6f1c2b1e-0d3a-4a55-9c2e-1f0e7d2c9b11"}).decode()


def headers_of(values: dict[str, str]):
    lowered = {k.lower(): v for k, v in values.items()}
    return lambda name: lowered.get(name)


def test_identity_order_first_match_wins() -> None:
    headers = {"x-proxyvisor-session": "pv", "X-Claude-Code-Session-Id": "claude", "session-id": "codex",
               "x-session-id": "opencode"}
    body = request_body("messages", metadata={"user_id": CLAUDE_USER_ID})
    assert identify("from-path", headers_of(headers), MESSAGES, body) == ("from-path", "path")
    expected = [("pv", "header:x-proxyvisor-session"), ("claude", "header:x-claude-code-session-id"),
                ("codex", "header:session-id"), ("opencode", "header:x-session-id")]
    for (value, source), name in zip(expected, list(headers)):
        assert identify(None, headers_of(headers), MESSAGES, body) == (value, source)
        del headers[name]
    assert identify(None, headers_of({}), MESSAGES, body) == ("6f1c2b1e-0d3a-4a55-9c2e-1f0e7d2c9b11", "body")
    del body["metadata"]
    session, source = identify(None, headers_of({}), MESSAGES, body)
    assert source == "hash" and session.startswith("h-") and SESSION_ID.match(session)


def test_body_hints_of_each_format() -> None:
    none = headers_of({})
    claude_less = request_body("messages", metadata={"user_id": "user-7"})
    assert identify(None, none, MESSAGES, claude_less) == ("user-7", "body")
    assert identify(None, none, CHAT, request_body("chat", user="alice")) == ("alice", "body")
    assert identify(None, none, RESPONSES, request_body("responses", prompt_cache_key="thread-1", user="bob")) == \
        ("thread-1", "body")
    assert identify(None, none, RESPONSES, request_body("responses", user="bob")) == ("bob", "body")


@pytest.mark.parametrize("hint", ["../../etc/passwd", "a/b", ".hidden", "x" * 200, "sess\n", "ünï", ""])
def test_body_hints_that_are_not_safe_ids_are_hashed(hint: str) -> None:
    session, _source = identify(None, headers_of({}), CHAT, request_body("chat", user=hint))
    assert SESSION_ID.fullmatch(session), session
    assert "/" not in session and "\n" not in session
    Store.ledger_path(Store("/tmp/unused"), session)  # accepted by the store


SYSTEM = "Act as an expert software developer. Take requests for changes to the supplied code."
CANNED = [{"role": "user", "content": "Change the greeting to be more casual"},
          {"role": "assistant", "content": "Ok, I will:\n\n1. Switch the greeting text."},
          {"role": "user", "content": "I switched to a new code base."},
          {"role": "assistant", "content": "Ok."}]
"""Like aider's: the same example exchange opens every run (client-captures/aider_0.86.2_edit_request.json)."""


def aider_run(fmt, prompt: str, answers: int = 0) -> list[dict]:
    """The request bodies of one harness run that sends no id: canned examples, then ``prompt``, then the history
    growing by an answer and a user message ``answers`` times."""
    history = [*CANNED, {"role": "user", "content": prompt}]
    bodies = []
    for turn in range(answers + 1):
        bodies.append(fmt.request_from_chat([{"role": "system", "content": SYSTEM}, *history], "m", True))
        history += [{"role": "assistant", "content": f"Answer {turn} to {prompt}"},
                    {"role": "user", "content": f"Now step {turn + 1}."}]
    return bodies


@pytest.mark.parametrize("fmt", [CHAT, MESSAGES, RESPONSES], ids=lambda f: f.name)
def test_clients_without_an_id_get_a_session_per_conversation(fmt) -> None:
    none = headers_of({})
    table = SessionTable(idle_s=60, max_sessions=10)

    def session(body: dict, now: float = 0.0) -> str:
        sid, source = identify(None, none, fmt, body, table.conversations, now)
        assert source == "hash" and SESSION_ID.match(sid)
        return sid

    first = [session(body, now=i) for i, body in enumerate(aider_run(fmt, "change the greeting", answers=3))]
    assert len(set(first)) == 1  # one run's growing history: one session
    second = session(aider_run(fmt, "add a test")[0], now=5)
    assert second != first[0]  # same system prompt and canned messages, another first message: another run
    assert session(aider_run(fmt, "add a test")[0], now=6) == second  # the same request again: a retry
    # A run that continues from an earlier point of the first run (a client re-sending after an edit) stays in it.
    assert session(aider_run(fmt, "change the greeting", answers=1)[1], now=7) == first[0]
    # The system prompt and canned messages alone match no run.
    assert session(fmt.request_from_chat([{"role": "system", "content": SYSTEM}, *CANNED], "m", True), 8) \
        not in (first[0], second)
    # Idle beyond idle_s: the conversation is no longer live, and the same start is a new run.
    assert session(aider_run(fmt, "add a test")[0], now=100) != second


async def test_two_aider_runs_through_the_proxy_are_two_sessions(start_proxy, state_dir) -> None:
    async with start_proxy() as rp:
        for prompt, answers in (("change the greeting", 2), ("add a test", 0)):
            for body in aider_run(CHAT, prompt, answers):
                reply, _ = await raw_stream(rp.url, "chat", body)
                assert reply.status_code == 200
    store = Store(state_dir)
    assert sorted(len(store.read_ledger(sid)) for sid in store.sessions()) == [1, 3]


@pytest.mark.parametrize("bad", ["..", "../x", ".x", "-x", "a/b", "a b", "a%2Fb", "", "x" * 129, "x\n", "é"])
def test_invalid_ids_are_refused_everywhere(bad: str) -> None:
    if "/" not in bad:  # "/s/a/b/..." is session "a" on path "/b/..."
        with pytest.raises(InvalidSession):
            split_prefix(f"/s/{bad}/v1/messages")
    if bad:  # an empty header counts as absent
        with pytest.raises(InvalidSession):
            identify(None, headers_of({"x-proxyvisor-session": bad}), CHAT, {})
        for name in ("x-claude-code-session-id", "session-id", "x-session-id"):
            # A client's own header is its business: hashed into a valid id, never refused.
            session, source = identify(None, headers_of({name: bad}), CHAT, {})
            assert SESSION_ID.match(session) and session != bad and source == "header:" + name
    with pytest.raises(ValueError):
        Store("/tmp/unused").ledger_path(bad)


def test_split_prefix() -> None:
    assert split_prefix("/s/abc-1.2_3/v1/messages") == ("abc-1.2_3", "/v1/messages")
    assert split_prefix("/s/abc") == ("abc", "/")
    assert split_prefix("/v1/messages") == (None, "/v1/messages")
    assert split_prefix("/sx/abc/v1/messages") == (None, "/sx/abc/v1/messages")


def test_session_table_evicts_idle_sessions() -> None:
    table = SessionTable(idle_s=10, max_sessions=100)
    table.touch("a", now=0)
    table.touch("b", now=5)
    table.touch("a", now=12)  # a is fresh again; b has been idle for 7 s
    assert {s.id for s in table.all()} == {"a", "b"}
    dropped = table.evict(now=15.5)
    assert [s.id for s in dropped] == ["b"] and table.get("b") is None
    assert table.get("a").created == 0 and table.get("a").last_seen == 12
    assert [s.id for s in table.evict(now=100)] == ["a"] and len(table) == 0


def test_session_table_is_bounded_least_recently_seen_first() -> None:
    table = SessionTable(idle_s=1e9, max_sessions=3)
    for i, sid in enumerate("abcd"):
        table.touch(sid, now=i)
    assert [s.id for s in table.all()] == ["b", "c", "d"]
    table.touch("b", now=10)
    table.touch("e", now=11)
    assert [s.id for s in table.all()] == ["d", "b", "e"]
    session = table.touch("e", now=12)
    session.requests += 1
    assert table.get("e").requests == 1 and len(table) == 3


async def test_proxy_counts_requests_per_session(proxy) -> None:
    for sid in ("one", "one", "two"):
        reply, _ = await raw_stream(proxy.url + f"/s/{sid}", "chat", request_body("chat"))
        assert reply.status_code == 200
    sessions = proxy.pipeline.sessions
    assert sessions.get("one").requests == 2 and sessions.get("two").requests == 1
    assert sessions.get("one").formats == {"chat"}
