"""Normalised failures of child runs (seed 000, "Normalized failure metadata").

Every adapter turns its runtime's native errors into a :class:`Failure`: a ``category``, whether the same request
is worth sending again later (``retryable``), the provider-supplied wait (``retry_after_s``) and whether the child
may have done something before failing (``outcome``). The kernel never guesses: only a retryable ``capacity``
failure opens a pool's breaker, and an ``unknown`` outcome is never retried or rerouted automatically.

This module holds the shared pieces adapters build on: the HTTP status rules (:func:`from_http`), the wording of
common provider limits (:func:`from_text`) and retry delays (:func:`retry_after_header`,
:func:`retry_after_in_text`). It imports no SDK.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime

from ..redact import redact_cut

CAPACITY, AUTH, UNAVAILABLE, TIMEOUT, PROVIDER, INVALID = (
    "capacity", "auth", "unavailable", "timeout", "provider", "invalid")
CATEGORIES = (CAPACITY, AUTH, UNAVAILABLE, TIMEOUT, PROVIDER, INVALID)
KNOWN_FAILED, UNKNOWN = "known_failed", "unknown"
OUTCOMES = (KNOWN_FAILED, UNKNOWN)
_MESSAGE_LIMIT = 300


@dataclass(frozen=True)
class Failure:
    """A normalised failure.

    ``retry_after_s`` is a positive whole number of seconds (at most :data:`RETRY_AFTER_CAP_S` when a provider said
    it) or None; ``message`` is a short human summary (at
    most 300 characters, credentials masked), never a provider payload, so it may be logged and persisted.
    """

    category: str
    retryable: bool
    outcome: str
    retry_after_s: int | None = None
    message: str = ""

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown failure category {self.category!r}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown failure outcome {self.outcome!r}")
        if self.retry_after_s is not None and self.retry_after_s <= 0:
            raise ValueError("retry_after_s must be positive")
        object.__setattr__(self, "message", summary(self.message))

    @property
    def transient(self) -> bool:
        """Worth sending again after a wait: retryable and known to have done nothing (``known_failed``), i.e. a
        429 that is no quota, a 529 or other 5xx, a refused connection. A timeout or a connection reset is not
        (its outcome is unknown), nor a quota, an auth failure or an invalid request (not retryable)."""
        return self.retryable and self.outcome == KNOWN_FAILED

    @property
    def quota(self) -> bool:
        """An account quota that needs billing action (OpenAI's ``insufficient_quota``, Anthropic's "credit
        balance is too low"): capacity, but no wait ends it, so it is not retryable."""
        return self.category == CAPACITY and not self.retryable

    @property
    def opens_breaker(self) -> bool:
        """Only a retryable capacity failure opens a pool's breaker (seed 000)."""
        return self.category == CAPACITY and self.retryable


# Wordings of an account quota that needs billing action (one provider answers it with a 429, another a 400).
_QUOTA = ("insufficient_quota", "check your plan and billing", "credit balance is too low")

def summary(message: str) -> str:
    """``message`` on one line, secret-looking values redacted (``proxyvisor.redact``), cut to 300 characters."""
    return redact_cut(" ".join(str(message).split()), _MESSAGE_LIMIT, mark="…")


RETRY_AFTER_CAP_S = 86_400
"""The longest provider-supplied wait honoured, in seconds (one day). A wait decides how long a pool cools, and that
state is persisted and shared by every proxy on the state dir until it expires or ``proxyvisor health clear``: a
provider's daily limit resets within a day, so a longer wait is a broken or hostile header, capped so that it
cannot block a pool for years."""

_DELAY_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?\Z")
"""A delay as a header carries it: digits, perhaps a fraction (RFC 9110's ``delay-seconds`` is digits only); no
sign, exponent, ``inf`` or ``nan``, and only ASCII digits."""


def _seconds(value: float) -> int | None:
    """``value`` seconds as a whole number of seconds, 1 to :data:`RETRY_AFTER_CAP_S` (beyond the cap: the cap);
    None when it is not positive or not a number."""
    if math.isnan(value) or value <= 0:
        return None
    return RETRY_AFTER_CAP_S if value >= RETRY_AFTER_CAP_S else max(1, math.ceil(value))


def _delay(value: str, unit_s: float) -> int | None:
    """A header's delay in ``unit_s`` seconds (1, or 0.001 for ``retry-after-ms``), or None if it is not one."""
    value = value.strip()
    return _seconds(float(value) * unit_s) if _DELAY_SECONDS.match(value) else None


def _http_date(value: str, now: float) -> int | None:
    """The seconds from ``now`` until an HTTP date (always GMT, RFC 9110 §5.6.7), or None if it is not one."""
    try:
        when = parsedate_to_datetime(value.strip())
        if when.tzinfo is None:  # "-0000": no zone said; an HTTP date is GMT
            when = when.replace(tzinfo=timezone.utc)
        return _seconds(when.timestamp() - now)
    except (TypeError, ValueError, IndexError, OverflowError, OSError):
        return None


def retry_after_header(value: str | None, now: float, milliseconds: str | None = None) -> int | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or an HTTP date; RFC 9110 §10.2.3) or, failing
    that, a ``retry-after-ms`` header (OpenAI). ``now`` is the wall clock (Unix seconds).

    Returns a whole number from 1 to :data:`RETRY_AFTER_CAP_S` (a longer wait is cut to the cap), or None when
    neither header holds a wait: absent, zero, negative, a date in the past, ``inf``, ``nan``, an exponent or
    anything else unparsable. Never raises, whatever the strings.
    """
    if value and (seconds := _delay(value, 1) or _http_date(value, now)):
        return seconds
    return _delay(milliseconds, 0.001) if milliseconds else None


_UNITS = {"ms": 0.001, "millisecond": 0.001, "s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60,
          "h": 3600, "hr": 3600, "hour": 3600, "d": 86400, "day": 86400}
_UNIT = r"(?:ms|milliseconds?|seconds?|secs?|s|minutes?|mins?|m|hours?|hrs?|h|days?|d)(?![a-z])"
_DURATION = r"((?:\d+(?:\.\d+)?\s*" + _UNIT + r"\s*)+)"
_DELAY_PATTERNS = (
    re.compile(r"retry[-_ ]?after(?:[-_ ]?s)?[\"']?\s*[:=]?\s*(\d+(?:\.\d+)?)(?!\s*(?:ms|m\b|min|h\b|hour|d\b|day))",
               re.I),
    re.compile(r"(?:try again|retry|retrying|resets?|available again)\s+(?:in|after)\s+" + _DURATION, re.I),
    re.compile(r"retry[-_ ]?after\s*[:=]?\s*" + _DURATION, re.I),
    re.compile(r"\"?retryDelay\"?\s*:\s*\"(\d+(?:\.\d+)?)s\"", re.I),
)
_EPOCH = re.compile(r"limit reached\|(\d{10})\b", re.I)
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)", re.I)


def _duration(text: str) -> float:
    total = 0.0
    for number, unit in _PART.findall(text):
        unit = unit.lower()
        unit = unit if unit in _UNITS else unit.rstrip("s")
        total += float(number) * _UNITS.get(unit, 1)
    return total


def retry_after_in_text(text: str, now: float) -> int | None:
    """A provider-supplied wait carried in an error message, in whole seconds, or None.

    Understands "retry after 30 seconds", "Retry-After: 30", "try again in 6.5s" / "in 1m30s" / "in 2 hours",
    ``"retryDelay": "37s"`` and the reset time of a usage limit (``... limit reached|1767225600``, Unix seconds,
    made relative to ``now``), cut to :data:`RETRY_AFTER_CAP_S`.
    """
    epoch = _EPOCH.search(text)
    if epoch:
        return _seconds(int(epoch.group(1)) - now)
    for i, pattern in enumerate(_DELAY_PATTERNS):
        match = pattern.search(text)
        if match:
            value = float(match.group(1)) if i in (0, 3) else _duration(match.group(1))
            if value > 0:
                return _seconds(value)
    return None


def _has(text: str, *words: str) -> bool:
    return any(w in text for w in words)


def from_text(text: str, now: float) -> Failure | None:
    """Classify an error message by its wording; None when nothing in it is recognised.

    Order matters: provider overload (529, 5xx) is checked before capacity (429) so that an overload can never
    cool a pool, and an account quota that needs billing action is capacity but not retryable.
    """
    low = text.lower()
    wait = retry_after_in_text(text, now)
    if _has(low, "overloaded", "529", "internal server error", "server-side issue", "service unavailable",
            "bad gateway", " 500", " 502", " 503", "status 500", "status 502", "status 503"):
        return Failure(PROVIDER, True, KNOWN_FAILED, wait, text)
    if _has(low, *_QUOTA):
        return Failure(CAPACITY, False, KNOWN_FAILED, None, text)
    if _has(low, "429", "rate limit", "rate_limit", "ratelimit", "too many requests", "usage limit",
            "quota exceeded", "exceeded your current quota", "resource_exhausted", "resource exhausted",
            "limit reached", "hit your limit", "throttl"):
        return Failure(CAPACITY, True, KNOWN_FAILED, wait, text)
    if _has(low, "401", "403", "unauthorized", "unauthorised", "invalid api key", "invalid x-api-key",
            "incorrect api key", "authentication", "permission denied", "forbidden", "not logged in", "/login",
            "invalid_api_key", "api key"):
        return Failure(AUTH, False, KNOWN_FAILED, None, text)
    if _has(low, "timed out", "timeout", "time out", "deadline exceeded"):
        return Failure(TIMEOUT, True, UNKNOWN, None, text)
    if _has(low, "connection refused", "econnrefused", "could not resolve", "name or service not known",
            "no such host", "command not found", "no such file or directory"):
        return Failure(UNAVAILABLE, True, KNOWN_FAILED, None, text)
    if _has(low, "connection reset", "econnreset", "broken pipe", "connection closed", "connection error",
            "network error", "disconnected"):
        return Failure(UNAVAILABLE, True, UNKNOWN, None, text)
    if _has(low, "400", "404", "invalid request", "invalid_request", "bad request", "not found", "context length",
            "context window", "too long", "unsupported", "invalid model", "does not exist"):
        return Failure(INVALID, False, KNOWN_FAILED, None, text)
    return None


def unclassified(text: str) -> Failure:
    """The category of a failure nobody recognised: ``provider``, not retryable, outcome unknown (the child may
    have done anything before it failed), so it is neither replayed nor mistaken for success."""
    return Failure(PROVIDER, False, UNKNOWN, None, text or "the child failed without saying why")


def from_http(status: int, message: str, now: float, retry_after: str | None = None,
              retry_after_ms: str | None = None) -> Failure:
    """Normalise an HTTP error status from a model API.

    429 is capacity (retryable, unless the wording says the account's quota needs billing action); 529 and
    other 5xx are provider and retryable, never capacity; 504 and 408 are timeouts with an unknown outcome;
    401, 402 and 403 are auth; other 4xx are invalid. ``retry_after``/``retry_after_ms`` are the response
    headers; a wait in the message counts when they are absent.
    """
    wait = retry_after_header(retry_after, now, retry_after_ms) or retry_after_in_text(message, now)
    text = f"HTTP {status}: {message}" if message else f"HTTP {status}"
    if status == 429:
        if _has(message.lower(), *_QUOTA):
            return Failure(CAPACITY, False, KNOWN_FAILED, None, text)
        return Failure(CAPACITY, True, KNOWN_FAILED, wait, text)
    if status in (408, 504):
        return Failure(TIMEOUT, True, UNKNOWN, None, text)
    if status >= 500:
        return Failure(PROVIDER, True, KNOWN_FAILED, wait, text)
    if status in (401, 402, 403):
        return Failure(AUTH, False, KNOWN_FAILED, None, text)
    return Failure(INVALID, False, KNOWN_FAILED, None, text)
