"""Undoing an HTTP body's content codings (``Content-Encoding``: gzip, deflate, br) within a size bound.

Pure functions, no I/O: the relay decodes an upstream's error body to search it for the configured key
(:mod:`.relay`). The bound is enforced while decoding, so a body that inflates past it (a zip bomb) is refused
after at most about twice the bound was produced, never inflated whole.
"""

from __future__ import annotations

import zlib


class UndecodableBody(ValueError):
    """A body whose codings cannot be undone: an unknown coding, data invalid or cut short for its coding, or more
    decoded bytes than the bound allows. The message says which, without quoting the body."""


def decode(data: bytes, codings: str, limit: int) -> bytes:
    """``data`` with the content codings ``codings`` undone.

    ``codings`` is the ``Content-Encoding`` value, the codings in the order they were applied
    (``"gzip"``, ``"deflate, br"``); ``identity`` and empty entries are no-ops; names are case-insensitive.
    ``limit`` is the most bytes any decoding step may produce.

    Raises:
        UndecodableBody: a coding other than gzip, x-gzip, deflate, br and identity (br also when no brotli
            decoder is installed); data that is invalid or cut short for its coding; more than ``limit`` bytes.
    """
    for coding in reversed([c.strip().lower() for c in codings.split(",")]):
        if coding in ("", "identity"):
            continue
        if coding in ("gzip", "x-gzip"):
            data = _inflate(data, zlib.MAX_WBITS | 16, limit, "gzip", members=True)
        elif coding == "deflate":
            # RFC 9110 deflate is zlib-wrapped, but some servers send a raw deflate stream: accept both, as
            # browsers and curl do; a zlib header is a deflate method nibble and a check sum divisible by 31.
            wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and ((data[0] << 8) | data[1]) % 31 == 0
            data = _inflate(data, zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS, limit, "deflate", members=False)
        elif coding == "br":
            data = _unbrotli(data, limit)
        else:
            raise UndecodableBody(f"unknown content coding {coding!r}")
    return data


def _too_large(name: str, limit: int) -> UndecodableBody:
    return UndecodableBody(f"{name} body decodes to more than {limit} bytes")


def _inflate(data: bytes, wbits: int, limit: int, name: str, members: bool) -> bytes:
    """One zlib-family stream (or, with ``members``, consecutive gzip members, which clients decode in turn)."""
    out: list[bytes] = []
    size = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            piece = inflater.decompress(data, limit + 1 - size)
        except zlib.error:
            raise UndecodableBody(f"invalid {name} data") from None
        size += len(piece)
        if size > limit:
            raise _too_large(name, limit)
        out.append(piece)
        if not inflater.eof:
            raise UndecodableBody(f"{name} body cut short")
        data = inflater.unused_data
        if not data:
            return b"".join(out)
        if not members:
            raise UndecodableBody(f"data after the end of the {name} stream")


def _unbrotli(data: bytes, limit: int) -> bytes:
    try:
        import brotli
    except ImportError:
        raise UndecodableBody("no brotli decoder is installed") from None
    decompressor = brotli.Decompressor()
    try:
        # The output buffer stops growing once it reaches the limit: it may end up to twice as large.
        out: bytes = decompressor.process(data, output_buffer_limit=limit + 1)
    except brotli.error:
        raise UndecodableBody("invalid br data") from None
    if len(out) > limit:
        raise _too_large("br", limit)
    if not decompressor.is_finished():
        raise UndecodableBody("br body cut short")
    return out
