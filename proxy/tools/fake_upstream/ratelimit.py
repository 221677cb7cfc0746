"""The rate-limit side of the fake's answers: the headers that announce a key's windows, the waits its 429s
state, and the wire forms of both (OpenAI's durations, Anthropic's RFC 3339 instants and rounded counts).

With ``window_requests`` set, every model answer past the header checks (200 or
429, streamed or not) announces its key's window as it stands once this request
was counted:

==========================================  ====================================
``x-ratelimit-limit-requests``              OpenAI routes: ``window_requests``
``x-ratelimit-remaining-requests``          what is left of them
``x-ratelimit-reset-requests``              the wait till the window resets,
                                            rounded up to the ms: ``0.25s``,
                                            ``1.5s`` (at most 3 decimals, under
                                            a minute), ``6m0s``, ``1h2m3s``
``x-ratelimit-limit-tokens``                ``WINDOW_TOKENS`` (1000000)
``x-ratelimit-remaining-tokens``            that less ``TOKENS_PER_REQUEST``
                                            (100) per request admitted
``x-ratelimit-reset-tokens``                as ``x-ratelimit-reset-requests``
``anthropic-ratelimit-requests-limit``      Anthropic: ``window_requests``
``anthropic-ratelimit-requests-remaining``  what is left of them
``anthropic-ratelimit-requests-reset``      the instant the window resets,
                                            RFC 3339 UTC with microseconds:
                                            ``2026-12-01T10:00:02.500000Z``
``anthropic-ratelimit-tokens-limit``        as ``x-ratelimit-limit-tokens``
``anthropic-ratelimit-tokens-remaining``    as ``x-ratelimit-remaining-tokens``
``anthropic-ratelimit-tokens-reset``        as the requests' ``-reset``
``anthropic-ratelimit-unified-status``      with ``unified``: ``allowed`` while
                                            requests remain, else ``rejected``
``anthropic-ratelimit-unified-reset``       with ``unified``: the reset, in
                                            epoch seconds rounded up
==========================================  ====================================

With the per-minute windows (``windows``), every model answer (200 or 429)
announces instead each window that holds its route, as it stands once this
request was charged: OpenAI's ``x-ratelimit-{limit,remaining,reset}-tokens``
(``tokens_per_minute``) and ``-requests``, the reset the wait till the bucket
is full in the duration form above; Anthropic's ``anthropic-ratelimit-
{input-tokens,output-tokens,requests}-{limit,remaining,reset}``, token
``-remaining`` rounded to the nearest thousand (halves up), the reset the
instant the bucket is full (RFC 3339), and ``anthropic-ratelimit-tokens-*``
repeating the token window with the least remaining. A window that refuses a
request answers 429 with Retry-After and retry-after-ms (the wait till it has
room) and the provider's body: OpenAI ``{"error": {"message": "Rate limit
reached for MODEL in organization org-fake on tokens per min (TPM): Limit L,
Used U, Requested R. Please try again in 1.2s. Visit ...", "type": "tokens",
"param": null, "code": "rate_limit_exceeded"}}`` (``requests per min (RPM)``,
type ``requests``; above the whole window, ``Request too large for ...``);
Anthropic ``{"type": "error", "error": {"type": "rate_limit_error", "message":
"This request would exceed the rate limit for your organization (ORG) of
450,000 input tokens per minute. For details, ..."}}`` (``output tokens``,
``requests``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from .windows import INPUT, OUTPUT, REQUESTS, TOKENS

__all__ = [
    "ANTHROPIC_ORGANIZATION",
    "ANTHROPIC_WINDOWS",
    "OPENAI_WINDOWS",
    "ORGANIZATION",
    "TOKENS_PER_REQUEST",
    "WINDOW_TOKENS",
    "WindowState",
    "nearest_thousand",
    "openai_duration",
    "retry_after_headers",
    "rfc3339",
]

WINDOW_TOKENS = 1_000_000
TOKENS_PER_REQUEST = 100

ORGANIZATION = "org-fake"
ANTHROPIC_ORGANIZATION = "00000000-0000-4000-8000-00000000fa4e"
OPENAI_WINDOWS = {TOKENS: ("tokens", "TPM"), REQUESTS: ("requests", "RPM")}
ANTHROPIC_WINDOWS = {INPUT: ("input-tokens", "input tokens"), OUTPUT: ("output-tokens", "output tokens"),
                      REQUESTS: ("requests", "requests")}

def retry_after_headers(seconds: float) -> dict[str, str]:
    """Retry-After (whole seconds, rounded up, at least 1) and retry-after-ms (exact) for a wait."""
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(round(seconds * 1000))}


def nearest_thousand(count: int) -> int:
    """``count`` rounded to the nearest thousand (halves up), as Anthropic rounds token ``-remaining``."""
    return (count + 500) // 1000 * 1000


def openai_duration(seconds: float) -> str:
    """A wait the way OpenAI's ``x-ratelimit-reset-*`` put it: ``0.25s``, ``1.5s``, ``6m0s``, ``1h2m3s``.

    Rounded up to the millisecond, so a client that waits that long finds the window reset.
    """
    ms = max(0, math.ceil(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def rfc3339(epoch: float) -> str:
    """``epoch`` as RFC 3339 UTC with microseconds: ``2026-12-01T10:00:02.500000Z``."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class WindowState:
    """A key's window as one answer announces it, once that request was counted."""

    limit: int
    admitted: int
    left: float

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.admitted)

    @property
    def tokens_remaining(self) -> int:
        return max(0, WINDOW_TOKENS - TOKENS_PER_REQUEST * self.admitted)
