"""Fake upstreams for the tests and the benchmarks: connection-level faults a well-behaved server never shows.

:class:`KeepAliveUpstream` is a raw HTTP/1.1 server (h11 on a trio stream, no proxyvisor code) that keeps its
connections alive and drops them without a word, as providers and load balancers do; :func:`serve` puts any such
connection handler on a free loopback port. Nothing here is used by the proxy itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import h11
import trio

_JSON = [(b"content-type", b"application/json")]


class KeepAliveUpstream:
    """A connection handler for ``trio.serve_listeners``: answers every request with a small JSON 200
    (``{"n":N}``, N counting its answers; ``delay_s`` seconds before each) and keeps the connection open, never
    sending ``Connection: close``. It drops connections without saying so:

    - ``answers``: after that many answers on a connection, the next request that arrives gets no byte of
      response (with ``half_head``: half a status line) and the connection is closed;
    - ``idle_s``: a connection that got no request for ``idle_s`` seconds after an answer is closed, and the close
      takes ``close_latency_s`` seconds to reach the peer (a request sent meanwhile crosses it).

    Counts connections ``opened`` and ``open`` now, ``requests`` received and ``answered``; ``all_closed`` is set
    whenever no connection is open after one was.
    """

    def __init__(self, delay_s: float = 0.0, answers: int | None = None, half_head: bool = False,
                 idle_s: float = float("inf"), close_latency_s: float = 0.0) -> None:
        self.delay_s, self.answers, self.half_head = delay_s, answers, half_head
        self.idle_s, self.close_latency_s = idle_s, close_latency_s
        self.opened = self.open = self.requests = self.answered = 0
        self.all_closed = trio.Event()

    async def __call__(self, stream: trio.SocketStream) -> None:
        self.opened += 1
        self.open += 1
        conn = h11.Connection(h11.SERVER)
        answered = 0
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    with trio.move_on_after(self.idle_s if answered else float("inf")) as idle:
                        data = await stream.receive_some(65536)
                    if idle.cancelled_caught:
                        await trio.sleep(self.close_latency_s)  # the close is on its way
                        return
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.EndOfMessage):
                    self.requests += 1
                    if answered == self.answers:
                        if self.half_head:
                            await stream.send_all(b"HTTP/1.1 2")
                        return
                    await trio.sleep(self.delay_s)
                    answered += 1
                    self.answered += 1
                    body = b'{"n":%d}' % self.answered
                    await stream.send_all(conn.send(h11.Response(status_code=200, headers=[
                        *_JSON, (b"content-length", b"%d" % len(body))])) + conn.send(h11.Data(data=body))
                        + conn.send(h11.EndOfMessage()))
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (trio.BrokenResourceError, h11.ProtocolError):
            return
        finally:
            self.open -= 1
            if not self.open:
                self.all_closed.set()
            await trio.aclose_forcefully(stream)


async def serve(nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]) -> str:
    """Serve the connection ``handler`` on a free loopback port until ``nursery`` is cancelled; returns its base
    URL (``http://127.0.0.1:PORT``)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(trio.serve_listeners, handler, listeners)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
