"""Lines and tokens of a tool result: the one place that splits text and counts tokens.

**Lines** are separated by ``\\n`` only, as ``wc -l`` and ``sed -n Np`` count them: a ``\\r`` before the ``\\n``
(CRLF) or anywhere else in a line (a progress bar's bare carriage return) belongs to the line's bytes. A final
line without ``\\n`` is a line; the empty string after a trailing ``\\n`` is not. Joining :func:`split_lines`'
output gives back the text exactly, which is what byte-for-byte reconstruction relies on.

**Tokens** are counted with tiktoken's ``cl100k_base``, the encoding litellm itself uses for its estimates (the
counts differ from o200k_base by about 2% on the corpus, and it loads three times faster). tiktoken downloads
encodings on first use, which fails offline, so ``TIKTOKEN_CACHE_DIR`` is pointed at the copies litellm bundles
(DESIGN.md, principle 3), found without importing litellm, which costs seconds.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tiktoken

ENCODING = "cl100k_base"


def split_lines(text: str) -> list[str]:
    """The lines of ``text``, each with its own ``\\n`` (if any); ``"".join(result) == text``."""
    pieces = text.split("\n")
    lines = [piece + "\n" for piece in pieces[:-1]]
    if pieces[-1]:
        lines.append(pieces[-1])
    return lines


def line_count(text: str) -> int:
    """``len(split_lines(text))``, without building the list."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def newline_of(lines: list[str]) -> str:
    """``"\\r\\n"`` when most of the terminated lines end with CRLF, else ``"\\n"``: the style for added lines."""
    terminated = [line for line in lines if line.endswith("\n")]
    crlf = sum(1 for line in terminated if line.endswith("\r\n"))
    return "\r\n" if terminated and crlf * 2 > len(terminated) else "\n"


def body_of(line: str) -> str:
    """A line without its terminator (``\\n`` or ``\\r\\n``)."""
    if line.endswith("\r\n"):
        return line[:-2]
    return line[:-1] if line.endswith("\n") else line


# Control characters would corrupt a terminal or hide text in the condenser's view; their Unicode "control
# pictures" (U+2400 + code) keep them visible, one character each. Tabs stay: they are layout.
_VISIBLE = {code: 0x2400 + code for code in range(32) if code != 9} | {127: 0x2421}
_SURROGATE = re.compile("[\ud800-\udfff]")


def scrub(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes read with ``surrogateescape``, or ``\\ud800`` escapes in
    JSON) replaced by U+FFFD, so that it encodes as UTF-8 and can be sent to a model."""
    return _SURROGATE.sub("\ufffd", text)


def visible(body: str) -> str:
    """``body`` :func:`scrub`-bed, with control characters other than tab shown as control pictures (``\\r``
    becomes ``␍``)."""
    return scrub(body).translate(_VISIBLE)


def use_bundled_tokenizers() -> None:
    """Point tiktoken at the encoding files litellm bundles (found without importing litellm, which takes
    seconds), unless ``TIKTOKEN_CACHE_DIR`` names a folder already: tiktoken otherwise downloads an encoding on
    its first use, which fails offline."""
    spec = importlib.util.find_spec("litellm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        folder = os.path.join(root, "litellm_core_utils", "tokenizers")
        if os.path.isdir(folder):
            os.environ.setdefault("TIKTOKEN_CACHE_DIR", folder)
            return


@functools.cache
def encoding() -> tiktoken.Encoding:
    """The ``cl100k_base`` encoding, loaded on the first call (0.3-0.5 s, part of it holding the GIL)."""
    use_bundled_tokenizers()
    import tiktoken

    return tiktoken.get_encoding(ENCODING)


def count_tokens(text: str) -> int:
    """Tokens of ``text`` in ``cl100k_base``; special-token strings in tool output count as plain text."""
    return len(encoding().encode_ordinary(text)) if text else 0


def tokens_may_exceed(text: str, limit: int) -> bool:
    """False when ``text`` surely has at most ``limit`` tokens (:func:`count_tokens`), found without counting: a
    token covers at least one UTF-8 byte, and a character takes one byte in an ASCII string (a constant-time
    check), at most four in any other (otherwise its bytes are counted, only when that can decide it)."""
    chars = len(text)
    if chars > limit:
        return True
    if text.isascii() or chars * 4 <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def count_each(texts: list[str]) -> list[int]:
    """:func:`count_tokens` of each text."""
    encode = encoding().encode_ordinary
    return [len(encode(t)) if t else 0 for t in texts]


def clip_tokens(text: str, max_tokens: int) -> str:
    """``text`` if it has at most ``max_tokens`` tokens, else its first two thirds and last third of that many
    tokens around a ``[… N tokens omitted …]`` marker, so both edges of an over-long block survive."""
    codec = encoding()
    tokens = codec.encode_ordinary(text)
    if len(tokens) <= max_tokens:
        return text
    head = max_tokens * 2 // 3
    tail = max_tokens - head
    omitted = len(tokens) - head - tail
    return (codec.decode(tokens[:head]) + f"\n[… {omitted} tokens omitted …]\n"
            + codec.decode(tokens[len(tokens) - tail:]))


def clip_chars(text: str, max_chars: int) -> str:
    """Like :func:`clip_tokens`, in characters (tool-call arguments: head 2/3, tail 1/3)."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    return text[:head] + f"[… {len(text) - head - tail} chars omitted …]" + text[len(text) - tail:]
