"""What every wire format provides, and the assistant turn that formats render.

A :class:`WireFormat` holds one API's knowledge: its path, its JSON error shape, its SSE event grammar, where
usage and session hints live in its bodies, and how an assistant turn is written in it. Nothing outside
``proxyvisor/proxy/formats/`` branches on a format's name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from ... import wirejson
from . import largejson
from ...transcript import Message, StreamEditor, StreamSplice, TextEdit, TextFilter

# status -> Anthropic's error type: its errors page names 400, 401, 403, 404, 413, 429, 500, 504 and 529
# (overloaded_error is 529's alone) and uses invalid_request_error for any other 4xx; its other 5xx are api_error.
_ANTHROPIC_TYPES: dict[int, str] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class Item(dict[str, Any]):
    """A history item of a parsed request body (``proxyvisor.proxy.bodies``), maybe shared by later requests that
    repeat it. Never changed in place: an edit goes to a copy put in its place, so ``derived`` (values computed
    from the item, by name: its :class:`~.transcript.Message` per format, its serialised bytes...) stays true."""

    __slots__ = ("derived",)

    def __init__(self, value: dict[str, Any]) -> None:
        super().__init__(value)
        self.derived: dict[Hashable, Any] = {}


class ByIdentity:
    """Values computed from parts of request bodies that are never changed in place (like :class:`Item`: the values
    before and after a body's history, which ``proxyvisor.proxy.bodies`` shares between the requests that repeat
    them, such as the tool declarations), by the part's identity: a request that repeats the very same object gets
    what was computed from it. Each value is kept with its object, so that object's id cannot be reused while it is
    kept; at most ``size`` are kept (all forgotten at once past it)."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._kept: dict[int, tuple[Any, Any]] = {}

    def get(self, part: Any, make: Callable[[Any], Any]) -> Any:
        """``make(part)``, computed once per object ``part`` while it is kept."""
        kept = self._kept.get(id(part))
        if kept is not None and kept[0] is part:
            return kept[1]
        value = make(part)
        if len(self._kept) >= self.size:
            self._kept.clear()
        self._kept[id(part)] = (part, value)
        return value


def derived(item: Any) -> dict[Hashable, Any] | None:
    """Where values computed from ``item`` may be kept (None: not an :class:`Item`, compute them each time)."""
    return item.derived if type(item) is Item else None


def edited(item: Any, key: Hashable, make: Callable[..., dict[str, Any]], *args: Any) -> Any:
    """``make(*args)``: a copy of history item ``item`` with an edit, to put in its place (or an item to put right
    after it: :func:`notes_after`). For an :class:`Item`, made once per ``key`` (what the edit depends on) and kept
    on it, as an :class:`Item` too: a later request making the same edit gets the same copy, and with it what was
    derived from the copy (its serialised bytes)."""
    kept = derived(item)
    if kept is None:
        return make(*args)
    copy = kept.get(key)
    if copy is None:
        copy = kept[key] = Item(make(*args))
    return copy


def resumed(items: list[Any], key: str) -> tuple[int, Any]:
    """Where a scan of history ``items`` goes on from the one an earlier request's history kept under ``key``
    (:func:`keep_scan`): (how many of the first items it read, what it kept), when this history starts with the
    same items (the history only grew: the earlier items are the very same objects, ``proxyvisor.proxy.bodies``);
    else (0, None), to read it whole. What was kept is taken off the item it was on: the scan keeps it again on its
    own history's last item."""
    for back in range(len(items) - 1, -1, -1):
        kept = derived(items[back])
        if kept is not None and key in kept:
            read, state = kept.pop(key)
            if len(read) <= len(items) and items[:len(read)] == read:  # equal items give the same reading
                return len(read), state
            break
    return 0, None


def keep_scan(items: list[Any], key: str, state: Any) -> None:
    """Keep ``state``, a scan's reading of all of history ``items``, on its last :class:`Item` for the next
    request's :func:`resumed` (nothing when it has none: that history is read whole next time)."""
    last = next((item for item in reversed(items) if type(item) is Item), None)
    if last is not None:
        last.derived[key] = (list(items), state)


def with_field(item: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``item`` with ``value`` under ``key`` (an :func:`edited` ``make``)."""
    return {**item, key: value}


def error_types(status: int) -> tuple[str, str]:
    """(OpenAI type, Anthropic type) of an error with HTTP status ``status``, the types each API sends with it.

    OpenAI's API has few types: ``invalid_request_error`` for a 4xx (a bad key, an unknown model, a body too large
    alike, told apart by ``code``), ``requests`` for a 429 (a limit on requests; ``tokens`` for one on tokens) and
    ``server_error`` for every 5xx; the names Anthropic's API gives by status (``authentication_error``,
    ``timeout_error``...) are not among them."""
    openai = "requests" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return openai, _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def openai_error_code(status: int) -> str | None:
    """The ``code`` of an error of ``status`` when nothing more specific is known: a 429's is
    ``rate_limit_exceeded``, else None (null). OpenAI's API sends a specific code (``invalid_api_key``,
    ``model_not_found``, ``context_length_exceeded``...) or null, never the type again; clients branch on it (the
    openai SDK's ``APIError.code`` is an optional string)."""
    return "rate_limit_exceeded" if status == 429 else None


def openai_error_body(status: int, message: str, code: str | None = None) -> bytes:
    """OpenAI's error body (Chat Completions and Responses alike) for ``status``: ``code`` or
    :func:`openai_error_code`."""
    return dumps({"error": {"message": message, "type": error_types(status)[0], "param": None,
                            "code": code or openai_error_code(status)}})


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant turn, one the client runs. ``arguments`` is the JSON object the model passes
    to the tool (a freeform tool's input read as :func:`~.freeform.arguments`); ``name`` is namespace-qualified
    (:func:`~.freeform.qualified`); ``kind`` is ``function`` (JSON arguments), ``custom`` (a freeform input) or,
    for a call of a built-in tool type, that type (``local_shell``, ``computer``...)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    kind: str = "function"
    item: Any = field(default=None, compare=False, repr=False)
    """The call as the response held it (its output item, ``tool_use`` block or ``tool_calls`` entry), when it was
    read from one: :meth:`WireFormat.render` and :meth:`WireFormat.render_stream` write it back as it came, of any
    call type (a built-in one too: ``local_shell_call``, ``computer_call``...)."""


@dataclass(frozen=True)
class AssistantTurn:
    """An assistant response independent of format: text, then zero or more tool calls.

    ``input_tokens``/``output_tokens`` are reported as usage (tokens) when the turn is rendered; None reports 0:
    an answer proxyvisor or its scripted model makes costs no model tokens, and a client prices whatever it is told.
    """

    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None

    @property
    def usage(self) -> tuple[int, int]:
        """(input, output) tokens to report: the set counts, 0 for those not set."""
        return self.input_tokens or 0, self.output_tokens or 0


@dataclass
class Usage:
    """Token counts read from a response (tokens). ``None`` when the response did not report them."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    estimated: bool = False
    """Whether proxyvisor counted some of them itself (``proxyvisor.proxy.estimate``)."""

    def add(self, other: Usage) -> None:
        if other.input_tokens is not None:
            self.input_tokens = other.input_tokens
        if other.output_tokens is not None:
            self.output_tokens = other.output_tokens


@dataclass(frozen=True)
class ToolSpec:
    """A tool a request offers: its namespace-qualified name (:func:`~.freeform.qualified`), JSON schema for the
    arguments (empty for a freeform tool), description and ``kind``: ``function`` (JSON arguments), ``custom`` (a
    freeform string input, :mod:`.freeform`) or a built-in tool type as declared (``web_search``,
    ``local_shell``, Anthropic's ``bash_20250124``...)."""

    name: str
    schema: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    kind: str = "function"


@dataclass(frozen=True)
class CallResult:
    """The result of one tool call, to be written into a history: the call's id, its text, whether it failed."""

    call_id: str
    text: str
    is_error: bool = False


def args_of(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as an object, from an object or a JSON string; non-JSON text is kept under "raw"."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        value = wirejson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"raw": arguments}
    return value if isinstance(value, dict) else {"raw": arguments}


def chat_text(content: Any) -> str:
    """The text of a Chat-Completions ``content``: a string, or the ``text`` of each part of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def leading_system(items: list[Any]) -> int | None:
    """The position of the last of the system/developer messages a history starts with (the end of its system
    prompt), or None when it starts with something else."""
    last = None
    for index, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("role") in ("system", "developer")
                and item.get("type", "message") == "message"):
            break
        last = index
    return last


def as_list(value: Any) -> list[Any]:
    """``value`` if it is a list, else an empty list (bodies come from clients and upstreams: any JSON at all)."""
    return value if isinstance(value, list) else []


def arguments_of(value: Any) -> dict[str, Any]:
    """Tool-call arguments as an object, whatever the JSON value (:func:`args_of`, total)."""
    return args_of(value) if isinstance(value, (dict, str)) else {}


def notes_after(items: list[Any], notes: list[tuple[int, str]],
                make: Callable[[str], dict[str, Any]]) -> list[tuple[int, Any]]:
    """For :func:`interleave`: each note ``(index, text)`` as the history item ``make(text)``, kept on
    ``items[index]``, the item it follows (:func:`edited`), so a later request that places the same note after the
    same item sends the same object, its bytes written once."""
    return [(index, edited(items[index], ("note", text), make, text)) for index, text in notes]


def interleave(items: list[Any], notes: list[tuple[int, Any]]) -> list[Any]:
    """``items`` with each note's item placed right after position ``index`` (``notes`` ascending by index)."""
    return interleave_runs(items, [(index, [item]) for index, item in notes])


def interleave_runs(items: list[Any], runs: list[tuple[int, list[Any]]]) -> list[Any]:
    """``items`` with each run of items placed right after position ``index`` (``runs`` ascending by index)."""
    out: list[Any] = []
    start = 0
    for index, run in runs:
        out += items[start:index + 1]
        out += run
        start = index + 1
    out += items[start:]
    return out


@dataclass(frozen=True)
class Graft:
    """Where a part-blocked batch's blocked calls and their results go in a later request's history
    (:meth:`WireFormat.graft`): ``replace``, copies to put in place of the agent's items, by position; ``runs``,
    new items to put right after a position (ascending)."""

    replace: dict[int, Any] = field(default_factory=dict)
    runs: list[tuple[int, list[Any]]] = field(default_factory=list)


def beside(elements: Sequence[Any], id_of: Callable[[Any], str | None], order: Sequence[str],
           new: Mapping[str, Any], start: int = 0) -> list[tuple[int, list[Any]]] | None:
    """Runs (:func:`interleave_runs`) that put ``new``'s elements (by call id) among ``elements`` from position
    ``start`` on (an assistant message's content, a ``tool_calls`` list, a history) where ``order`` (the call ids
    of the batch, in the model's order) puts them: each right after the element of the call it follows in
    ``order``, or, following none there, right before the first. ``id_of`` gives an element's call id (None: not
    one). None when no other call of ``order`` is among ``elements``."""
    positions: dict[str, int] = {}
    for position in range(start, len(elements)):
        call_id = id_of(elements[position])
        if call_id is not None and call_id in order and call_id not in new and call_id not in positions:
            positions[call_id] = position
    if not positions:
        return None
    runs: dict[int, list[Any]] = {}
    anchor = min(positions.values()) - 1
    for call_id in order:
        if call_id in positions:
            anchor = positions[call_id]
        elif call_id in new:
            runs.setdefault(anchor, []).append(new[call_id])
    return sorted(runs.items())


def shared_prefix(before: list[bytes], after: list[bytes]) -> int:
    """How many bytes of ``before`` (a request's :meth:`WireFormat.prompt`, its pieces in order) begin ``after``
    too: the part of the earlier request a provider's prompt cache can serve to the later one."""
    shared = 0
    for old, new in zip(before, after):
        if old == new:
            shared += len(old)
            continue
        low, high = 0, min(len(old), len(new))
        while low < high:  # bisected: a long piece is compared in a few memcmp calls, not byte by byte
            mid = (low + high + 1) // 2
            if old[:mid] == new[:mid]:
                low = mid
            else:
                high = mid - 1
        return shared + low
    return shared


def has_non_text(content: Any) -> bool:
    """True when ``content`` is a list of typed parts and one of them is not text (an image, a document...)."""
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") not in ("text", "input_text", "output_text") for p in content)


def edit_parts(content: Any, edit: TextEdit) -> Any:
    """``content`` (a string, or a list of parts with ``text``) with each text rewritten by ``edit``."""
    if isinstance(content, str):
        return edit(content)
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = edit(part["text"])
    return content


def retext(content: Any, text: str, part_type: str) -> Any:
    """A tool result's ``content`` holding ``text`` instead, in the same shape: a string (or nothing) becomes
    ``text``; a list of text parts becomes its last part alone with ``text`` (its other keys, such as Anthropic's
    ``cache_control`` breakpoint, kept); ``part_type`` is the text part's type for a list without a usable part."""
    if isinstance(content, list):
        last = content[-1] if content and isinstance(content[-1], dict) else {"type": part_type}
        return [{**last, "text": text}]
    return text


def sse(data: bytes | str, event: str | None = None) -> bytes:
    """One SSE event: an optional ``event:`` line, one ``data:`` line, a blank line."""
    if isinstance(data, str):
        data = data.encode()
    return _data_line(event) + data + b"\n\n"


def sse_pieces(data: Iterable[bytes], event: str | None = None) -> list[bytes]:
    """:func:`sse` of the bytes ``data`` holds in order, as pieces, never joined (an event may be 100 MB)."""
    return [_data_line(event), *data, b"\n\n"]


def _data_line(event: str | None) -> bytes:
    """What comes before an event's data: its ``event:`` line, if it has a name, and ``data: ``."""
    return (b"event: " + event.encode() + b"\ndata: ") if event else b"data: "


def dumps(obj: Any) -> bytes:
    return wirejson.dumps(obj)


def sse_json(obj: Any, event: str | None = None, large: bool = False) -> list[bytes]:
    """``[sse(dumps(obj), event)]``; with ``large`` (an object read from big data), the same bytes in pieces,
    encoded a slice at a time (:func:`.largejson.dumps`), never joined."""
    if not large:
        return [sse(dumps(obj), event)]
    return sse_pieces(largejson.dumps(obj), event)


def event_object(data: str) -> dict[str, Any] | None:
    """An SSE event's data as a JSON object, or None when it is not one (``[DONE]``, a keep-alive, bad JSON).

    The ``{`` check first makes a non-object cost no parse, and makes a successful parse always a dict. Data of
    :data:`~.largejson.SLICE` characters or more is read in bounded steps (:func:`.largejson.loads`).
    """
    if not data.startswith("{"):
        return None
    try:
        obj: dict[str, Any] = wirejson.loads(data) if len(data) < largejson.SLICE else largejson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj


def words(text: str) -> list[str]:
    """Split text into word-sized deltas that join back to exactly ``text``."""
    if not text:
        return []
    out, start = [], 0
    for i, ch in enumerate(text):
        if ch == " " and i > start:
            out.append(text[start:i])
            start = i
    out.append(text[start:])
    return out


def split_json(arguments: dict[str, Any] | str) -> list[str]:
    """The tool arguments as JSON (an object, or the JSON text a call carries, kept as it is), in two fragments, as
    providers stream them."""
    text = arguments if isinstance(arguments, str) else wirejson.dumps(arguments).decode()
    mid = len(text) // 2
    return [text[:mid], text[mid:]] if mid else [text]


class WireFormat:
    """One API wire format. Subclasses are singletons exported by ``proxyvisor.proxy.formats``."""

    name: ClassVar[str]
    path: ClassVar[str]
    label: ClassVar[str]
    keepalive: ClassVar[bytes] = b": proxyvisor is working on this turn\n\n"
    """What keeps a held stream alive while proxyvisor works (a child runs, the verifier judges): an SSE
    comment, which every SSE client skips and which resets its read timeout."""

    stream_end: ClassVar[tuple[bytes, ...]] = ()
    """Bytes only an event that ends a stream of the format holds (its last event, or an error event): a stream
    whose last event holds none was cut short, however cleanly its connection closed. Empty: the format has no
    such event."""

    def ends_stream(self, data: bytes) -> bool:
        """Whether ``data`` holds one of :attr:`stream_end`."""
        return any(marker in data for marker in self.stream_end)

    # ---- errors -------------------------------------------------------------------------------------------
    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        """The API's JSON error body for ``status``; ``code`` is a machine-readable error code to keep (an
        upstream's ``context_length_exceeded``, on which clients compact), None for the status's default."""
        raise NotImplementedError

    def stream_error(self, status: int, message: str, last_chunk: bytes = b"") -> bytes:
        """The SSE event(s) that end a broken stream with an error the client's SDK raises."""
        raise NotImplementedError

    # ---- reading requests and responses ---------------------------------------------------------------------
    def session_hint(self, body: dict[str, Any]) -> str | None:
        """The client's own conversation id carried in the body, if any."""
        return None

    def fingerprint_parts(self, body: dict[str, Any]) -> tuple[str, str]:
        """(system prompt, first user message) as text, for the hash fallback of session identity and the key of
        a conversation's thread. The first user message is the first that is not only harness context
        (:func:`~proxyvisor.transcript.harness_context`), after the context messages before it, joined by
        newlines: Codex's environment alone is the same for every conversation in a directory."""
        raise NotImplementedError

    def tools(self, body: dict[str, Any]) -> list[ToolSpec]:
        """Every tool the request offers, wherever it is declared, in order (unknown shapes are skipped)."""
        raise NotImplementedError

    def ends_with_tool_result(self, body: dict[str, Any]) -> bool:
        """True when the latest turn of the request holds a tool result rather than a user message."""
        raise NotImplementedError

    def usage(self, response: dict[str, Any]) -> Usage:
        """Token usage of a non-streaming response body."""
        raise NotImplementedError

    def stream_usage(self, event: str | None, data: dict[str, Any]) -> Usage | None:
        """Token usage carried by one SSE event, or None."""
        raise NotImplementedError

    def request_from_chat(self, messages: list[dict[str, Any]], model: str, stream: bool,
                          tools: tuple[ToolSpec, ...] = ()) -> dict[str, Any]:
        """A request body in this format carrying a Chat-Completions-shaped history (the corpus format):
        system text, user text, assistant text with tool calls, and tool results paired by call id; ``tools``
        are offered in the format's own tool shape."""
        raise NotImplementedError

    def parse_response(self, response: dict[str, Any]) -> AssistantTurn:
        """The assistant turn of a non-streaming response body (text blocks joined, tool calls in order): every
        call the client is to run, of any call type; calls the API ran itself (hosted tools) are not among them."""
        raise NotImplementedError

    def assemble(self, events: list[tuple[str | None, str]]) -> AssistantTurn:
        """The assistant turn of a complete SSE stream, given its events as (event name, data) pairs."""
        return self.parse_response(self.stream_response(events))

    # ---- writing responses --------------------------------------------------------------------------------
    def render(self, turn: AssistantTurn, model: str) -> dict[str, Any]:
        """The complete non-streaming response body for ``turn``."""
        raise NotImplementedError

    def render_stream(self, turn: AssistantTurn, model: str, request: dict[str, Any]) -> list[bytes]:
        """The SSE events, in order, that stream ``turn`` in this format's grammar."""
        raise NotImplementedError

    @staticmethod
    def now() -> int:
        return int(time.time())

    # ---- supervision: reading a history, adding proxyvisor's text, rewriting replies ---------------------------
    def history(self, body: dict[str, Any]) -> list[Any]:
        """The request's history items in order (messages, or Responses input items); the list is the body's own,
        so positions in it are positions for :meth:`insert_notes`. By default the list under
        :attr:`history_field` (an empty list when that is not a list)."""
        items = body.get(self.history_field)
        return items if isinstance(items, list) else []

    def prompt(self, body: dict[str, Any]) -> list[bytes]:
        """``body`` in the order a provider's prompt cache reads it, as pieces of JSON: first every field but the
        history (tools, system prompt, settings; keys sorted), then each history item as the body serialises it.
        Two requests share a cache prefix as far as their pieces agree (:func:`shared_prefix`)."""
        rest = {k: v for k, v in body.items() if k != self.history_field}
        return [wirejson.dumps(rest, option=orjson.OPT_SORT_KEYS), *map(wirejson.dumps, self.history(body))]

    def message(self, item: Any) -> Message:
        """One history item as a format-neutral :class:`~.transcript.Message` (unknown shapes: role ``other``);
        kept on an :class:`Item`."""
        kept = derived(item)
        if kept is None:
            return self.read_message(item)
        message: Message | None = kept.get(self.name)
        if message is None:
            message = kept[self.name] = self.read_message(item)
        return message

    def read_message(self, item: Any) -> Message:
        """:meth:`message`, read from ``item``."""
        raise NotImplementedError

    def add_instruction(self, body: dict[str, Any], text: str) -> None:
        """Append ``text`` to the end of the system prompt, in place, leaving everything before it unchanged."""
        raise NotImplementedError

    def insert_notes(self, body: dict[str, Any], notes: list[tuple[int, str]]) -> None:
        """Put each user-side note ``(index, text)`` right after history item ``index`` (positions of the history
        as sent, ascending; notes at one position go in the order given), in place, in one pass over the history."""
        raise NotImplementedError

    def replace_tool_results(self, body: dict[str, Any], texts: Mapping[str, str]) -> set[str]:
        """Put ``texts[call_id]`` in place of the text of each tool result whose call id is a key (the model's copy
        of a condensed result): the item holding it is replaced in the history by a copy (the agent's item, maybe
        shared with later requests, :class:`Item`, stays as sent; an :class:`Item`'s copy is kept on it, so the
        next request with the same texts gets the same copy). Only text changes: no item is added, removed or
        reordered, so every tool call keeps its result, and a result holding non-text parts (images, documents)
        is left alone. Returns the call ids replaced."""
        done: set[str] = set()
        items = self.history(body)
        for index in self._holding(items, texts.keys()):
            item = items[index]
            wanted = tuple((call_id, texts[call_id]) for holder, key, call_id in self.result_slots(item)
                           if isinstance(call_id, str) and call_id in texts and not has_non_text(holder.get(key)))
            if not wanted:
                continue
            done.update(call_id for call_id, _ in wanted)
            items[index] = edited(item, ("condensed", wanted), self._with_results, item, dict(wanted))
        return done

    def _holding(self, items: list[Any], ids: AbstractSet[str]) -> list[int]:
        """The positions in history ``items`` of the items holding a tool result whose call id is among ``ids``
        (ascending). Where the results are is kept on the history's last :class:`Item` for the next request, which
        sends the same items first: only its items after them are read (the history only grew), the others found
        by their call ids. A history whose first items are not those (equal) is read whole."""
        start, found = resumed(items, "results_at")
        where: dict[str, list[int]] = found if found is not None else {}
        out = sorted({at for call_id in ids for at in where.get(call_id, ())})
        for index in range(start, len(items)):
            item = items[index]
            kept = derived(item)
            held = kept.get("result_ids") if kept is not None else None
            if held is None:
                held = frozenset(call_id for _, _, call_id in self.result_slots(item) if isinstance(call_id, str))
                if kept is not None:
                    kept["result_ids"] = held
            for call_id in held:
                where.setdefault(call_id, []).append(index)
            if held and not ids.isdisjoint(held):
                out.append(index)
        keep_scan(items, "results_at", where)
        return out

    result_part_type: ClassVar[str]
    """The ``type`` of a text part in a tool result's content (what :func:`retext` writes)."""

    def result_slots(self, item: Any) -> Iterator[tuple[dict[str, Any], str, Any]]:
        """Each tool result in history item ``item`` as (the dict holding it, the key of its content, its call id
        as sent, unchecked), for :meth:`replace_tool_results`."""
        raise NotImplementedError

    def copy_results(self, item: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``item`` whose :meth:`result_slots` holders are its own (the item's dict, by default)."""
        return dict(item)

    def _with_results(self, item: dict[str, Any], texts: dict[str, str]) -> dict[str, Any]:
        new = self.copy_results(item)
        for holder, key, call_id in self.result_slots(new):
            if call_id in texts and not has_non_text(holder.get(key)):
                holder[key] = retext(holder.get(key), texts[call_id], self.result_part_type)
        return new

    def edit_response(self, response: dict[str, Any], edit: TextEdit) -> None:
        """Rewrite every assistant text of a non-streaming response body with ``edit``, in place."""
        raise NotImplementedError

    def ask_settings(self, body: dict[str, Any], max_tokens: int | None, temperature: float | None, top_p: float,
                     effort: str, completion_tokens: bool = False) -> None:
        """Add a supervisor call's settings to a request ``body`` from :meth:`request_from_chat`, in place: the token
        limit (None: none added; ``completion_tokens``: Chat's ``max_completion_tokens``), ``temperature``, ``top_p``
        when below 1, and the reasoning ``effort`` where the format takes one (empty: none); ``temperature`` None
        leaves the sampling out (a plain request)."""
        if max_tokens is not None:  # else the limit request_from_chat set (Anthropic requires one)
            body[self.limit_key(completion_tokens)] = max_tokens
        if temperature is None:
            return
        body["temperature"] = temperature
        if top_p < 1.0:
            body["top_p"] = top_p
        if effort:
            self.ask_effort(body, effort)

    def limit_key(self, completion_tokens: bool) -> str:
        """The request field of the output token limit (``completion_tokens``: Chat's newer name)."""
        raise NotImplementedError

    def ask_effort(self, body: dict[str, Any], effort: str) -> None:
        """Add the reasoning ``effort`` to ``body`` where the format takes one (by default it does not)."""

    def ask_schema(self, body: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
        """Ask, in a request ``body``, for an answer that is JSON matching ``schema`` (named ``name``), in place."""
        raise NotImplementedError

    def schema_answer(self, response: dict[str, Any], name: str) -> str:
        """The answer text of a response to a request :meth:`ask_schema` shaped (its JSON)."""
        return self.parse_response(response).text

    def append_text(self, response: dict[str, Any], text: str) -> None:
        """Add ``text`` at the end of a non-streaming response body's answer, in place, the way
        ``stream_splice(...).add_text`` adds it to a stream: after a blank line at the end of the answer's last text
        (its last text block, the message's content, its last message's last text part), or as new text when the
        answer has none. Clients that show only the last text (``claude -p``, ``codex exec``) show both."""
        raise NotImplementedError

    def stream_editor(self, new_filter: Callable[[], TextFilter], edit: TextEdit) -> StreamEditor:
        """An editor for this format's SSE stream: each assistant text part's deltas go through their own filter
        from ``new_filter``; full-text copies of a part (done events, final response objects) go through ``edit``."""
        raise NotImplementedError

    # ---- continuing a turn: proxyvisor's own tools, a reply written back as history, spliced streams ------------
    history_field: ClassVar[str]
    """The body key holding the history (:meth:`history`)."""

    def add_tools(self, body: dict[str, Any], tools: list[ToolSpec]) -> None:
        """Offer ``tools`` (with their descriptions) after the client's own tools, in place."""
        raise NotImplementedError

    def insert_items(self, body: dict[str, Any], runs: list[tuple[int, list[Any]]]) -> None:
        """Put each run of history items right after history item ``index`` (positions of the history as sent,
        ascending, at most one run per position), in place."""
        if runs:
            body[self.history_field] = interleave_runs(self.history(body), runs)

    def user_item(self, text: str) -> Any:
        """A history item carrying ``text`` as a user message (the same shape in all three formats)."""
        return {"role": "user", "content": text}

    def extend_history(self, body: dict[str, Any], items: list[Any]) -> None:
        """Append ``items`` to the history, in place (a new list: the old one may be shared)."""
        body[self.history_field] = self.history(body) + list(items)

    def stream_response(self, events: list[tuple[str | None, str]]) -> dict[str, Any]:
        """The non-streaming response body equivalent to a complete SSE stream, given its events as (event name,
        data) pairs: everything a history needs to carry the reply on (thinking blocks and their signatures,
        reasoning items, tool calls with their ids), not only what :meth:`parse_response` reads."""
        raise NotImplementedError

    def assistant_items(self, response: dict[str, Any], keep: Callable[[str], bool]) -> list[Any]:
        """A non-streaming response body as the history items that carry it in a next request, without the tool
        calls whose name ``keep`` rejects."""
        raise NotImplementedError

    def tool_results(self, results: list[CallResult]) -> list[Any]:
        """History items that answer tool calls with ``results`` (in the order given), as a client would send."""
        raise NotImplementedError

    def without_calls(self, response: dict[str, Any], ids: Collection[str], text: bool = True) -> dict[str, Any]:
        """A copy of a non-streaming response body without the tool calls whose ids are in ``ids`` (of any call
        type; everything else as it was), and, unless ``text``, without its assistant text. ``response`` itself
        is not changed."""
        raise NotImplementedError

    def graft(self, items: list[Any], start: int, response: dict[str, Any], results: list[CallResult]) -> Graft:
        """Where the calls of a part-blocked batch the agent never received go in a later request's history
        ``items`` (the agent's, as sent), past position ``start`` (the agent's last item when the batch came):
        each call of ``response`` (the model's whole batch) that ``results`` answers goes into the agent's copy of
        the response, beside the calls it came with, in the model's order (:func:`beside`), and its result goes
        among their results, so the model sees its turn as it made it. Nothing (an empty :class:`Graft`) when the
        agent's items hold none of the batch's other calls or none of their results: a call is never put back
        without its result."""
        raise NotImplementedError

    def stream_splice(self, hold: Callable[[str], bool], stop: bool = False) -> StreamSplice:
        """A :class:`~.transcript.StreamSplice` for this format's streams, holding back from the first call of a
        tool whose name ``hold`` selects and, with ``stop``, keeping back the stop of a stream without tool
        calls."""
        raise NotImplementedError
