"""A save holds a thread as it is, whatever changed it and however (``proxyvisor.proxy.supervise.Thread.changes``,
``Thread.holders``): each public way a thread changes shows in the next save with no call to note it (a request taking
it, its exchange's delegations, grafts and self-report, a field set after the request, a change deep inside it
while a request holds it), and a save of a thread nothing changed reuses its pickle."""

from __future__ import annotations

import os
import threading
from typing import Any

import orjson
import pytest

from proxyvisor.config import SupervisorConfig
from proxyvisor.proxy import session_state
from proxyvisor.proxy.formats import CHAT
from proxyvisor.proxy.formats.base import CallResult
from proxyvisor.proxy.relay import UpstreamReply
from proxyvisor.proxy.session_state import decode, encode
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import Exchange, SessionSupervision, Supervisor, Thread

from test_recite_prefix import report
from test_steer import BASH, _history

def _body(rounds: int) -> dict[str, Any]:
    """A chat request whose history has ``rounds`` tool rounds."""
    return orjson.loads(orjson.dumps(CHAT.request_from_chat(_history(rounds), "m", False, (BASH,))))


class _Saves:
    """A session's saves, as encoded (with the pickles kept) and read back by another process."""

    def __init__(self) -> None:
        self.supervisor = Supervisor(SupervisorConfig())
        self.session = Session("s", 0.0, 0.0)
        self.pickled = 0
        """Threads pickled so far."""

    def request(self, rounds: int) -> Exchange:
        return self.supervisor.begin(self.session, CHAT, _body(rounds))

    @property
    def state(self) -> SessionSupervision:
        assert self.session.supervision is not None
        return self.session.supervision

    def saved(self) -> Thread:
        """The session's one thread as the next save stores it."""
        value = encode(self.state, os.urandom(16)).value
        (thread,) = decode(value).state.threads.values()
        return thread


@pytest.fixture
def saves(monkeypatch: pytest.MonkeyPatch) -> _Saves:
    found = _Saves()
    pickled = session_state._pickled

    def counted(obj: Any, reductions: Any) -> Any:
        found.pickled += isinstance(obj, Thread)
        return pickled(obj, reductions)

    monkeypatch.setattr(session_state, "_pickled", counted)
    return found


def test_each_public_change_of_a_thread_is_in_the_next_save(saves: _Saves) -> None:
    first = saves.request(1)
    first.close()
    assert saves.saved().tracker.fed == 4
    # A request taking the thread reads its history into it.
    exchange = saves.request(2)
    assert saves.saved().tracker.fed == 6
    # The exchange's changes, each seen by the save right after it.
    exchange.remember([{"role": "assistant", "content": "delegated"}])
    assert [d.items for d in saves.saved().delegated] == [[{"role": "assistant", "content": "delegated"}]]
    exchange.graft({"role": "assistant", "content": "batch"}, [CallResult("call_x", "blocked", True)])
    assert [g.results for g in saves.saved().grafted] == [[CallResult("call_x", "blocked", True)]]
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Done. " + report("done")},
                           "finish_reason": "stop"}]}
    exchange.reply(UpstreamReply(200, [(b"content-type", b"application/json")], orjson.dumps(answer)))
    assert saves.saved().state == "done"
    # A change deep inside the thread, no field set: saved while the request holds it...
    exchange.thread.planning.goal = "deep"
    assert saves.saved().planning.goal == "deep"
    exchange.thread.planning.goal = "deeper"
    assert saves.saved().planning.goal == "deeper"
    # ...and once it is over too (its end counts as a change), then no more pickles while nothing changes.
    exchange.close()
    exchange.close()  # once only
    assert exchange.thread.holders == 0
    before = saves.pickled
    assert saves.saved().planning.goal == "deeper"
    assert saves.pickled == before + 1
    assert saves.saved().planning.goal == "deeper"
    assert saves.pickled == before + 1, "nothing changed: the kept pickle"
    # A field set after the request (the verify-gate's verdict cancelled after the answer went out).
    exchange.thread.plan_signal = "reassess"
    assert saves.saved().plan_signal == "reassess"
    assert saves.pickled == before + 2


def test_an_exchange_never_closed_ends_its_hold_when_freed(saves: _Saves) -> None:
    exchange = saves.request(1)
    thread = exchange.thread
    assert thread.holders == 1
    saves.saved()
    before = saves.pickled
    saves.saved()
    assert saves.pickled == before + 1, "held: pickled by every save"
    del exchange
    assert thread.holders == 0
    saves.saved()
    saves.saved()
    assert saves.pickled == before + 2, "freed: pickled once more, then kept"


def test_an_exchange_freed_on_another_thread_leaves_its_hold_to_end_on_its_own(saves: _Saves) -> None:
    """The garbage collector freeing an exchange in a worker thread does not count the thread's holders there (it
    would race the event loop's counting): the next exchange made on the exchange's own thread ends the hold."""
    exchange = saves.request(1)
    thread = exchange.thread
    worker = threading.Thread(target=exchange.__del__)  # what the collector runs, in a worker thread
    worker.start()
    worker.join()
    assert thread.holders == 1
    saves.request(2).close()
    assert thread.holders == 0
    del exchange  # freed on its own thread now: its hold ended once only
    assert thread.holders == 0


def test_a_thread_other_requests_do_not_take_keeps_its_pickle(saves: _Saves) -> None:
    """Two threads of a session: a request of one pickles it alone again."""
    saves.request(1).close()
    other = Supervisor(SupervisorConfig())
    body = _body(1)
    body["messages"][1]["content"] = "Another task."
    other.begin(saves.session, CHAT, body).close()
    encode(saves.state, os.urandom(16))
    before = saves.pickled
    saves.request(2).close()
    encode(saves.state, os.urandom(16))
    assert saves.pickled == before + 1
    assert [t.holders for t in saves.state.threads.values()] == [0, 0]
