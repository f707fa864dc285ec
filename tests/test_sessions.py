"""Session identity (first match wins, DESIGN.md "Sessions") and the bounded session table."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from proxyvisor.proxy.bodies import BodyCache
from proxyvisor.proxy.formats import BY_NAME, CHAT, MESSAGES, RESPONSES
from proxyvisor.proxy.sessions import (SESSION_ID, SESSIONS_PER_RUN, Conversations, InvalidSession, SessionTable,
                                       _history_keys, _item_keys, identify, split_prefix,
                                       unprefixed)
from proxyvisor.store import Store

from helpers import http_client, raw_stream, request_body

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


REPO_MAP = [{"role": "user", "content": "Here are summaries of some files present in my git repository:\n\ngreet.py"},
            {"role": "assistant", "content": "Ok, I won't try and edit those files without asking first."}]
REMINDER = "\n\nReply with SEARCH/REPLACE blocks only."


def aider_interactive(fmt, turns: list[tuple[str, str]], files: str = "greet.py") -> list[dict]:
    """The request bodies of an interactive aider-like run: each turn ``(prompt, answer)`` asked in order. As
    aider orders them: system, canned examples, repo map, the turns done (prompt without the reminder, the answer
    as delivered), the chat files, then the current prompt with a reminder appended. So a request never extends
    the one before it: the chat files moved behind the turn just done."""
    bodies, done = [], []
    for prompt, answer in turns:
        chat_files = [{"role": "user", "content": f"I have added these files to the chat: {files}"},
                      {"role": "assistant", "content": "Ok, any changes I propose will be to those files."}]
        bodies.append(fmt.request_from_chat([{"role": "system", "content": SYSTEM}, *CANNED, *REPO_MAP, *done,
                                             *chat_files, {"role": "user", "content": prompt + REMINDER}], "m", True))
        done += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return bodies


@pytest.mark.parametrize("fmt", [CHAT, MESSAGES, RESPONSES], ids=lambda f: f.name)
def test_aider_interactive_turns_join_the_session_whose_answer_they_carry(fmt) -> None:
    table = SessionTable(idle_s=60, max_sessions=10)
    clock = iter(range(100))

    def run(turns: list[tuple[str, str]], files: str = "greet.py") -> list[str]:
        sids = []
        for body, (_prompt, answer) in zip(aider_interactive(fmt, turns, files), turns):
            now = next(clock)
            sid, source = identify(None, headers_of({}), fmt, body, table.conversations, now)
            assert source == "hash"
            # The answer as the client got it: aider trims the text it keeps.
            table.conversations.answered(fmt, body, sid, f"\n{answer}  \n", [], now)
            sids.append(sid)
        return sids

    first = run([("make the greeting casual", "greet.py\n<<<<<<< SEARCH\nHello\n=======\nHi\n>>>>>>> REPLACE"),
                 ("and add a name", "Done."),
                 ("now a test", "tests/test_greet.py\n<<<<<<< SEARCH\n=======\ndef test(): ...\n>>>>>>> REPLACE")])
    assert len(set(first)) == 1  # one run's turns: one session, though no request extends the one before
    # Another run with the same system prompt, examples and repo map is another session. It answers "Done." too
    # (delivered to two sessions, that text identifies neither) and "Ok." (the canned example's text: never a
    # link, or every run would join this one).
    second = run([("rename greet", "greet.py\n<<<<<<< SEARCH\ndef greet\n=======\ndef hello\n>>>>>>> REPLACE"),
                  ("also the docs", "Done."), ("thanks", "Ok."), ("one more", "Ok.")], files="docs.md")
    assert second[0] not in first and len(set(second)) == 1
    third = run([("a new task", "Ok.")])
    assert third[0] not in first + second
    # The first run's next turn carries "Done." (ambiguous now) and its earlier answers: it stays in its session.
    assert run([("make the greeting casual", "greet.py\n<<<<<<< SEARCH\nHello\n=======\nHi\n>>>>>>> REPLACE"),
                ("and add a name", "Done."), ("now a test", "x"), ("last", "y")])[-1] == first[0]


def test_a_tool_call_id_delivered_links_a_rewritten_history() -> None:
    """An SDK program that rewrites its earlier messages (a summary in place of the first turns) keeps its
    session through the ids of the tool calls it was answered with."""
    table = SessionTable(idle_s=60, max_sessions=10)
    start = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list the files"}]
    first = MESSAGES.request_from_chat(start, "m", False)
    sid, _ = identify(None, headers_of({}), MESSAGES, first, table.conversations, 0)
    table.conversations.answered(MESSAGES, first, sid, "", ["toolu_01A"], 1)
    rewritten = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "(summary) list the files"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "toolu_01A", "type": "function", "function": {"name": "Bash",
                                                                          "arguments": '{"command": "ls"}'}}]},
                 {"role": "tool", "tool_call_id": "toolu_01A", "content": "a.py"}]
    body = MESSAGES.request_from_chat(rewritten, "m", False)
    assert identify(None, headers_of({}), MESSAGES, body, table.conversations, 2) == (sid, "hash")
    # Past idle_s the answer is no link any more.
    assert identify(None, headers_of({}), MESSAGES, body, table.conversations, 100)[0] != sid


async def test_aider_interactive_turns_through_the_proxy_are_one_session(start_proxy, state_dir) -> None:
    report = '<sup>{"state":"progressing","focus":"greeting","next":"test","carry":[],"plan":null}</sup>'
    answers = ["greet.py\n<<<<<<< SEARCH\nHello\n=======\nHi\n>>>>>>> REPLACE", "Added the name.",
               "Renamed it."]
    async with start_proxy([{"text": f"{answers[0]}\n{report}"}, {"text": f"{answers[1]}\n{report}"},
                            {"text": answers[2]}]) as rp:
        turns = [("make the greeting casual", answers[0]), ("and add a name", answers[1])]
        for stream, body in zip((True, False), aider_interactive(CHAT, turns)):
            body["stream"] = stream
            reply, data = await raw_stream(rp.url, "chat", body)
            assert reply.status_code == 200 and b"<sup>" not in data  # the client gets the answer without it
        # Another run, same system prompt, examples and repo map: another session.
        reply, _ = await raw_stream(rp.url, "chat", aider_interactive(CHAT, [("rename greet", answers[2])])[0])
        assert reply.status_code == 200
        # The first run's third turn echoes the second answer, which came as JSON without its self-report.
        third = aider_interactive(CHAT, [*turns, ("now a test", "")])[2]
        reply, _ = await raw_stream(rp.url, "chat", third)
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
    assert split_prefix("/s/abc-1.2_3/v1/messages") == ("abc-1.2_3", "/v1/messages", None)
    assert split_prefix("/s/abc") == ("abc", "/", None)
    assert split_prefix("/v1/messages") == (None, "/v1/messages", None)
    assert split_prefix("/sx/abc/v1/messages") == (None, "/sx/abc/v1/messages", None)
    assert split_prefix("/r/run1/v1/messages") == (None, "/v1/messages", "run1")
    assert split_prefix("/r/run1/s/mine/v1/messages") == ("mine", "/v1/messages", "run1")
    assert split_prefix("/r/run1") == (None, "/", "run1")
    assert split_prefix("/rx/run1/v1/messages") == (None, "/rx/run1/v1/messages", None)
    # One order: a run prefix after a session prefix is no prefix, and its path no endpoint.
    assert split_prefix("/s/mine/r/run1/v1/messages") == ("mine", "/r/run1/v1/messages", None)
    for bad in ("/r/../v1/messages", "/r//v1/messages", "/r/run1/s/.x/v1/messages"):
        with pytest.raises(InvalidSession):
            split_prefix(bad)


def test_a_model_api_path_sent_without_its_version_is_the_path_it_means() -> None:
    """A client whose base URL lacks ``/v1`` (the AI SDK's providers take ``ANTHROPIC_BASE_URL`` as ending in it)
    reaches the same endpoints, prefixed or not; other paths stay as they are."""
    assert split_prefix("/messages") == (None, "/v1/messages", None)
    assert split_prefix("/r/run1/messages") == (None, "/v1/messages", "run1")
    assert split_prefix("/s/mine/chat/completions") == ("mine", "/v1/chat/completions", None)
    assert split_prefix("/r/run1/s/mine/responses") == ("mine", "/v1/responses", "run1")
    assert [split_prefix(p).path for p in ("/messages/count_tokens", "/models")] == [
        "/v1/messages/count_tokens", "/v1/models"]
    assert [split_prefix(p).path for p in ("/healthz", "/v1/v1/messages", "/messages/x", "/chat")] == [
        "/healthz", "/v1/v1/messages", "/messages/x", "/chat"]
    assert unprefixed("/r/run1/messages") == "/v1/messages"


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "relay"])
async def test_a_request_to_a_path_without_the_version_reaches_the_api_it_means(start_proxy,
                                                                                supervised: bool) -> None:
    """``POST /messages`` (the AI SDK's Anthropic provider at a base URL with no ``/v1``) is answered as
    ``/v1/messages`` is, in its format, and goes upstream as ``/v1/messages``."""
    async with start_proxy(supervised=supervised) as rp, http_client(rp.url) as client:
        for path, fmt in (("/messages", "messages"), ("/r/run1/chat/completions", "chat")):
            response = await client.post(path, json=request_body(fmt))
            assert response.status_code == 200, response.text
            assert BY_NAME[fmt].parse_response(response.json()).tool_calls
            assert rp.scripted["scripted"].requests[-1][0] == BY_NAME[fmt].path


def test_a_runs_request_names_its_own_session_else_is_the_runs() -> None:
    """Under a run prefix (what ``wrap`` hands the agent) a request that names its session, by a header or in its
    body, belongs to that session, as without the prefix; one that names none is the run's session, not a session
    of its conversation; a session prefix still forces the session."""
    claude = request_body("messages", metadata={"user_id": CLAUDE_USER_ID})
    assert identify(None, headers_of({"x-claude-code-session-id": "claude"}), MESSAGES, claude, run="r1") == \
        ("claude", "header:x-claude-code-session-id")
    assert identify(None, headers_of({}), MESSAGES, claude, run="r1") == \
        ("6f1c2b1e-0d3a-4a55-9c2e-1f0e7d2c9b11", "body")
    anonymous = request_body("messages")
    conversations = Conversations(3600, 100)
    for _ in range(2):
        assert identify(None, headers_of({}), MESSAGES, anonymous, conversations, 0.0, "r1") == ("r1", "run")
    assert identify("forced", headers_of({"x-claude-code-session-id": "claude"}), MESSAGES, claude,
                    run="r1") == ("forced", "path")


def test_the_table_names_the_sessions_of_a_run_latest_last_and_outlives_their_eviction() -> None:
    table = SessionTable(idle_s=10, max_sessions=2)
    table.touch("run1", now=0, run="run1")
    table.touch("claude", now=1, run="run1")
    table.touch("other", now=2, run="run2")
    table.touch("claude", now=3, run="run2")  # the session resumed by a later run
    assert table.sessions_of("run1") == ["run1", "claude"] and table.sessions_of("run2") == ["other", "claude"]
    table.touch("run1", now=4, run="run1")
    assert table.sessions_of("run1") == ["claude", "run1"]
    table.evict(now=100)
    assert len(table) == 0 and table.sessions_of("run1") == ["claude", "run1"]
    table.touch("x", now=101, run="run3")  # at most max_sessions runs: the least recently used goes
    assert table.sessions_of("run2") == [] and table.sessions_of("run3") == ["x"]
    for n in range(SESSIONS_PER_RUN + 1):
        table.touch(f"s{n}", now=102, run="run3")
    assert table.sessions_of("run3") == [f"s{n}" for n in range(1, SESSIONS_PER_RUN + 1)]


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


async def test_a_bad_run_id_is_a_400_in_the_clients_format_and_a_good_one_is_recorded(proxy) -> None:
    reply, data = await raw_stream(proxy.url + "/r/.x", "messages", request_body("messages"))
    assert reply.status_code == 400 and orjson.loads(data)["type"] == "error", data  # Anthropic's error shape
    assert b"invalid run id in path" in data
    reply, data = await raw_stream(proxy.url + "/r/run-1/s/.x", "messages", request_body("messages"))
    assert reply.status_code == 400 and orjson.loads(data)["type"] == "error", data  # past both prefixes
    assert b"invalid session id in path" in data
    reply, _ = await raw_stream(proxy.url + "/r/run-1", "messages", request_body("messages"),
                                {"x-claude-code-session-id": "claude-1"})
    assert reply.status_code == 200
    assert proxy.pipeline.sessions.sessions_of("run-1") == ["claude-1"]
    assert [line["run"] for line in proxy.pipeline.store.read_ledger("claude-1")] == ["run-1"]


def test_a_replica_takes_in_the_links_another_recorded_and_asks_nothing_for_a_history_it_knows() -> None:
    one, two = Conversations(3600, 64), Conversations(3600, 64)
    shared: dict[bytes, str] = {}
    one.on_keep = two.on_keep = lambda key, session: shared.__setitem__(key, session or "")
    first = request_body("chat")
    session = one.session_for(CHAT, first, 0.0)
    assert one.wanted(CHAT, first, 1.0) == [], "its last item is known here: nothing to ask"
    one.answered(CHAT, first, session, "Looking.", ["call_1"], 1.0)
    later = {**first, "messages": first["messages"] + [
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}]}
    assert one.wanted(CHAT, later, 2.0) == [], "the answer the client got was delivered here: nothing to ask"
    keys = two.wanted(CHAT, later, 2.0)
    assert keys and len(keys) <= 3 * 4
    two.learn({k: shared[k] for k in keys if k in shared}, 2.0)
    assert two.session_for(CHAT, later, 2.0) == session, "the other replica's session, not a new one"


@pytest.mark.parametrize("fmt_name", ["chat", "messages", "responses"])
def test_the_answer_keys_of_a_grown_history_read_from_its_new_items_are_those_of_a_whole_read(fmt_name: str) -> None:
    """Whether an answer's text is already in the history is looked up in the keys of all its items, kept from one
    request to the next (a history that only grew is read from its new items on): a random run of growing,
    compacted, edited and retried histories, parsed as the proxy parses them, gives at every step the keys of a
    whole read of a plain copy."""
    fmt, rng, cache = BY_NAME[fmt_name], random.Random(5), BodyCache()
    chat: list[dict[str, Any]] = [{"role": "system", "content": "You code."}, {"role": "user", "content": "Go."}]
    for step in range(400):
        roll = rng.random()
        if roll < 0.1 and len(chat) > 6:
            chat = chat[:2] + chat[len(chat) // 2:]
        elif roll < 0.15 and len(chat) > 3:
            at = rng.randrange(2, len(chat))
            chat[at] = {**chat[at], "content": f"edited {step}"} if chat[at]["role"] != "tool" else chat[at]
        elif roll >= 0.2:
            text = rng.choice(["Done.", "Looking.", f"Step {step}."])
            chat += [{"role": "assistant", "content": text, "tool_calls": [
                {"id": f"c{step}", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": f"c{step}", "content": "ok"}]
        body = fmt.request_from_chat(orjson.loads(orjson.dumps(chat)), "m", False, ())
        parsed = cache.loads(fmt.history_field, fmt.name, orjson.dumps(body))
        items = fmt.history(parsed)
        if rng.random() < 0.2 and len(items) > 3:  # an item put in the history's middle, as a steer note is
            note = fmt.request_from_chat([{"role": "assistant", "content": f"Note {step}."}], "m", False, ())
            items.insert(rng.randrange(1, len(items)), fmt.history(note)[0])
        plain = orjson.loads(orjson.dumps(parsed))
        want = {key for item in fmt.history(plain) for key in _item_keys(fmt, item)}
        for _ in range(rng.randrange(1, 3)):
            assert _history_keys(fmt, fmt.history(parsed)) == want
    assert cache.reused > 200
