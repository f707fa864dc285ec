"""Secret-looking values in free text: whether a text holds one (:func:`holds_secret`) and the text with each
replaced by ``[redacted]`` (:func:`redact`). Pure. Every place that keeps secrets out of what it stores, logs or
shows uses these two: learning's records (a record holding a secret is dropped whole), normalised failure messages,
dead letters' prompts, the supervisor route's refusal reasons.

What counts as a secret (:data:`SHAPES`), each with the part that is replaced:

- an assignment whose name holds ``SECRET``, ``TOKEN`` (not ``tokenizer``), ``PASSWORD``/``PASSWD``, ``API_KEY``,
  ``ACCESS_KEY``, ``PRIVATE_KEY`` or ``CREDENTIAL`` (any case, ``-`` or ``_`` or nothing between the words):
  ``AWS_SECRET_ACCESS_KEY=...``, ``password: ...``, ``"api-key": "..."``; the value, when it is at least 6
  characters, holds a letter and is no reference (``$VAR``, ``${VAR}``, ``<your-key>``, ``%VAR%``, a call, an
  attribute path such as ``settings.api_key``, the word ``redacted``);
- the password of a URL's userinfo (``postgres://admin:PASSWORD@db``);
- an ``Authorization`` header's credentials (``Basic``, ``Bearer``, ``token`` or bare), and ``Bearer X`` anywhere
  (``X`` at least 8 characters, with a digit);
- the known key shapes: AWS access key ids (``AKIA``/``ASIA``), Google API keys (``AIza``), npm tokens
  (``npm_``), GitHub tokens (``gh[pousr]_``, ``github_pat_``), Slack tokens (``xox?-``), OpenAI and Anthropic keys
  (``sk-...``), Stripe keys (``sk_live_``, ``rk_live_``, ``_test_`` alike), JWTs, PEM private key blocks (what
  follows the ``BEGIN`` line up to the ``END`` line, or to the end of the text);
- a password given in words: ``password hunter2hunter2``, ``password is ...`` (the next word, at least 6
  characters with a digit or a symbol, so "the password field" is no secret).

Plus, for both functions, the ``known`` credentials the caller holds (those a request carried), matched exactly.

Why not Yelp's detect-secrets (1.5.0, evaluated; ``bench/redact.py`` compares them on the corpus): its plugins
that name a shape miss half of what a session leaks (an assigned ``AWS_SECRET_ACCESS_KEY``, ``Authorization:
Basic``, ``AIza``, ``npm_`` outside an ``.npmrc`` line, ``sk-proj-``, a password in words); its high-entropy
plugins, run on free text, flag commit hashes, UUIDs, paths and prose alike (1,985 of the corpus's 2,287
messages); it costs some 0.8 ms a message where this module takes 0.02 ms (medians); and its settings are
process-wide state, not a pure function a worker thread may call.

Cost: one pass of a handful of linear regular expressions; no pattern backtracks more than a bounded word, so the
time grows with the text's length and nothing else. Callers that read large texts bound what they pass.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

REDACTED = "[redacted]"
_VALUE = r"[^\s\"'`,;()<>{}\[\]]"
"""A character of an assigned value: anything up to a space, a quote, a separator or a bracket."""


def _assigned(match: re.Match[str]) -> bool:
    """An assigned value is a secret when it holds a letter and is no reference: no call (``os.environ.get(...)``),
    no attribute path (``settings.api_key``), not the word ``redacted``."""
    value = match.group("s")
    return _LETTER.search(value) is not None and not match.string.startswith("(", match.end()) \
        and _ATTRIBUTE.fullmatch(value) is None and value.lower() != "redacted"


_LETTER = re.compile(r"[A-Za-z]")
_ATTRIBUTE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class Shape:
    """A secret's shape: ``pattern``, whose group ``s`` is what is replaced (the text around it, such as a name, a
    scheme or a header, is kept), and ``accept``, which a match must also pass (checked in Python rather than by a
    lookaround, which would rescan the rest of a long word at each match and make the time quadratic)."""

    pattern: re.Pattern[str]
    accept: Callable[[re.Match[str]], bool] = lambda _match: True

    def matches(self, text: str) -> Iterator[re.Match[str]]:
        return (m for m in self.pattern.finditer(text) if self.accept(m))


SHAPES: tuple[Shape, ...] = (
    # The name is matched from its keyword on (not from its start, which would rescan a long word at each of its
    # characters), at most 64 characters of it; the value possessively, so a failed match is not retried inside it.
    Shape(re.compile(r"(?i:secret|token(?!iz)|passw(?:or)?d|api[-_]?key|access[-_]?key|private[-_]?key|credential)"
                     r"[A-Za-z0-9_.-]{0,64}+[\"']?\s*[:=]\s*[\"']?(?P<s>(?![$<%{])" + _VALUE + r"{6,}+)"),
          _assigned),
    Shape(re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]{0,30}://[^\s/:@\"']{1,128}:(?P<s>[^\s/@\"']{1,512})@")),
    Shape(re.compile(r"(?i:authorization)[\"']?\s*[:=]\s*[\"']?(?:(?i:basic|bearer|token|digest)\s+)?"
                     r"(?P<s>[A-Za-z0-9._~+/=-]{8,})")),
    # A lookahead here reads one word: the next "bearer " cannot start inside it (a word has no space).
    Shape(re.compile(r"(?i:bearer)\s+(?P<s>(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,})")),
    Shape(re.compile(r"(?P<s>\b(?:AKIA|ASIA)[A-Z0-9]{16}\b|\bAIza[0-9A-Za-z_-]{30,}|\bnpm_[A-Za-z0-9]{20,}"
                     r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}|\bxox[abposr]-[A-Za-z0-9-]{10,}"
                     r"|\bsk-[A-Za-z0-9_-]{6,}|\b[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"
                     r"|\beyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}(?:\.[A-Za-z0-9_-]+)?)")),
    Shape(re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?P<s>[\s\S]*?)(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)")),
    Shape(re.compile(r"(?i:passw(?:or)?d|passphrase)\s+(?:(?i:is|was|of)\s+)?[\"']?"
                     r"(?P<s>(?=[^\s\"']*[0-9!@#$%^&*+=?~])[^\s\"'.,;]{6,}+)")),
)
"""The shapes of a secret (module docstring), in the order :func:`redact` applies them."""


def holds_secret(text: str, known: Iterable[str] = ()) -> bool:
    """Whether ``text`` holds a secret-looking value (:data:`SHAPES`) or one of the ``known`` credentials."""
    return any(k and k in text for k in known) or any(next(shape.matches(text), None) for shape in SHAPES)


CUT_MARGIN = 1_000
"""Characters past a cut that are redacted or checked with what is kept (:func:`past_cut`)."""


def past_cut(text: str, limit: int) -> str:
    """What of ``text`` to redact or check when only its first ``limit`` characters are kept: those and
    :data:`CUT_MARGIN` more, so a secret the cut runs through is seen whole (cut in two, a key may no longer look
    like one, and its kept half would go out)."""
    return text[:limit + CUT_MARGIN]


def redact_cut(text: str, limit: int, known: Iterable[str] = (), mark: str = "") -> str:
    """``text`` redacted (:func:`redact`, over :func:`past_cut`) and then cut to at most ``limit`` characters,
    ``mark`` ending a text that was cut (within the ``limit``)."""
    out = redact(past_cut(text, limit), known)
    return out if len(out) <= limit else out[:limit - len(mark)] + mark


def redact(text: str, known: Iterable[str] = ()) -> str:
    """``text`` with every ``known`` credential and every secret-looking value (:data:`SHAPES`) replaced by
    ``[redacted]``; the rest of it as it was."""
    for secret in known:
        if secret:
            text = text.replace(secret, REDACTED)
    for shape in SHAPES:
        text = shape.pattern.sub(functools.partial(_replace, shape), text)
    return text


def _replace(shape: Shape, match: re.Match[str]) -> str:
    if not shape.accept(match):
        return match.group()
    start, end = match.span("s")
    whole = match.group()
    return whole[:start - match.start()] + REDACTED + whole[end - match.start():]
