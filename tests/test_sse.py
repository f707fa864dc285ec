"""The sans-IO SSE parser: splitting the input anywhere never changes the events (WHATWG event-stream grammar)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.proxy.sse import Block, Event, EventTooLarge, SSEParser, SSEScanner, events, last_event_start

# Field values: any text without line breaks, multi-byte UTF-8 included (astral plane too).
_value = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12)
_name = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FF, blacklist_characters=":"), min_size=1,
                max_size=8)
_eol = st.sampled_from(["\r\n", "\n", "\r"])


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[Event]]:
    """A valid event stream (comments, ignored fields, mixed line endings) and the events it must produce."""
    lines: list[str] = []
    expected: list[Event] = []
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            lines.append(":" + draw(_value))  # a comment (":" alone is the usual keep-alive)
        name = draw(st.none() | _name)
        if name is not None:
            lines.append("event: " + name)
        values = []
        for value in draw(st.lists(_value, max_size=4)):
            if draw(st.booleans()):
                lines.append("data: " + value)
                values.append(value)
            else:  # without the optional space, a leading space of the value itself is the one removed
                lines.append("data:" + value)
                values.append(value.removeprefix(" "))
            if draw(st.booleans()):
                lines.append(draw(st.sampled_from(["id: 7", "retry: 1000", "unknown-field: x"])))
        lines.append("")
        if values:
            expected.append(Event(name, "\n".join(values)))
    text, previous = "", ""
    for line in lines:
        eol = draw(_eol)
        if previous == "\r" and not line and eol == "\n":
            eol = "\r"  # CR, then LF alone on an empty line, would read as one CRLF
        text, previous = text + line + eol, eol
    return text.encode("utf-8"), expected


@settings(max_examples=200, deadline=None)
@given(streams(), st.data())
def test_any_split_gives_the_same_events(stream: tuple[bytes, list[Event]], data: st.DataObject) -> None:
    raw, expected = stream
    assert SSEParser().feed(raw) == expected
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12), label="cuts"))
    parser = SSEParser()
    events = []
    previous = 0
    for cut in cuts + [len(raw)]:
        events += parser.feed(raw[previous:cut])  # repeated cuts feed empty chunks, which must be harmless
        previous = cut
    assert events == expected
    assert parser.pending() == 0


def test_data_lines_join_and_space_rules() -> None:
    raw = b"event: a\r\ndata:x\r\ndata:  two spaces\r\ndata\r\n\r\n: comment\n\ndata: \xc3\xa9\xf0\x9f\x8e\x89\n\n"
    assert SSEParser().feed(raw) == [Event("a", "x\n two spaces\n"), Event(None, "é🎉")]


def test_cr_then_lf_in_separate_chunks_is_one_line_ending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: one\r") == []
    assert parser.feed(b"") == []
    assert parser.feed(b"\n") == []
    assert parser.feed(b"data: two\r\n\r") == [Event(None, "one\ntwo")]
    assert parser.feed(b"\n") == []


def test_event_without_data_is_not_dispatched_and_invalid_utf8_is_replaced() -> None:
    parser = SSEParser()
    assert parser.feed(b"event: ping\n\n") == []
    assert parser.feed(b"data: \xff\xfe ok\n\n") == [Event(None, "\ufffd\ufffd ok")]


def test_incomplete_event_waits() -> None:
    parser = SSEParser()
    assert parser.feed(b"event: x\ndata: partial") == []
    assert parser.pending() > 0
    assert parser.feed(b"\n\n") == [Event("x", "partial")]


@settings(max_examples=300, deadline=None)
@given(streams(), st.data())
def test_any_split_gives_the_scanner_the_same_blocks(stream: tuple[bytes, list[Event]], data: st.DataObject) -> None:
    """The one scanner: blocks whose bytes joined are the stream's and whose events are the grammar's, the same
    however the input is cut (the supervised path relays unchanged blocks as these bytes)."""
    raw, expected = stream
    whole = SSEScanner()
    blocks = whole.feed(raw)
    assert whole.finish() == b""  # every generated stream ends with a blank line
    assert b"".join(block.raw for block in blocks) == raw
    assert events(blocks) == expected
    for block in blocks:  # each block is one event: scanned alone, it gives its own event again
        alone = SSEScanner()
        assert events(alone.feed(block.raw)) == ([block.event] if block.event else [])
        assert alone.finish() == b""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12), label="cuts"))
    scanner, got, previous = SSEScanner(), [], 0
    for cut in cuts + [len(raw)]:
        got += scanner.feed(raw[previous:cut])
        previous = cut
    assert scanner.finish() == b""
    assert b"".join(block.raw for block in got) == raw
    assert events(got) == expected


def test_a_stream_cut_inside_an_event_leaves_its_bytes_unfinished() -> None:
    scanner = SSEScanner()
    assert scanner.feed(b"data: one\n\ndata: tw") == [Block(b"data: one\n\n", Event(None, "one"))]
    assert scanner.pending == len(b"data: tw")
    assert scanner.finish() == b"data: tw"
    scanner = SSEScanner()  # a blank line ended by a CR is complete; an LF after it is no unfinished event
    assert events(scanner.feed(b"data: one\r\r")) == [Event(None, "one")]
    assert scanner.feed(b"\n") == [Block(b"\n", None)]
    assert scanner.finish() == b""


def test_an_event_past_the_limit_raises_with_the_events_before_it() -> None:
    first = b"data: one\n\n"
    for make in (lambda: SSEParser(max_event=16), lambda: _Blocks(max_event=32)):
        reader = make()
        with pytest.raises(EventTooLarge) as raised:
            reader.feed(first + b"data: " + b"x" * 40)  # a line that has not ended counts
        assert raised.value.complete in ([Event(None, "one")], [first])
        reader = make()
        assert reader.feed(first) in ([Event(None, "one")], [first])
        reader.feed(b"data: " + b"x" * 8)
        with pytest.raises(EventTooLarge):
            reader.feed(b"x" * 30 + b"\n\n")  # an event completed past the limit is refused as well


class _Blocks(SSEScanner):
    """The scanner, its blocks as bytes (to compare with the parser's events in one test)."""

    def feed(self, chunk: bytes) -> list[bytes]:  # type: ignore[override]
        try:
            return [block.raw for block in super().feed(chunk)]
        except EventTooLarge as exc:
            raise EventTooLarge(exc.limit, [block.raw for block in exc.complete]) from None


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_the_last_event_starting_in_a_chunk_is_found_from_its_end(eol: str) -> None:
    def chunk(text: str) -> bytes:
        return text.replace("|", eol).encode()

    assert last_event_start(chunk("data: a||data: b||")) == len(chunk("data: a||"))
    assert last_event_start(chunk("data: a||: ping||data: [DONE]||")) == len(chunk("data: a||: ping||"))
    assert last_event_start(chunk("data: a|data: b||")) == -1  # one event from the first byte, or one going on
    assert last_event_start(chunk("tail of an event||data: x")) == len(chunk("tail of an event||"))
    assert last_event_start(b"") == -1
    assert last_event_start(chunk("data: a|||data: b|")) == len(chunk("data: a|||"))
