"""Reading a key's budget from the rate-limit headers providers put on every answer.

OpenAI sends ``x-ratelimit-remaining-{requests,tokens}`` with
``x-ratelimit-reset-{requests,tokens}`` as durations (``1s``, ``6m0s``, ``20ms``);
Anthropic sends ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
{remaining,reset}`` with RFC 3339 resets, and for subscription plans
``anthropic-ratelimit-unified-status`` with ``anthropic-ratelimit-unified-reset``
(epoch seconds or RFC 3339). A key whose requests are spent, or whose unified
status is ``rejected``, is held until its reset: a request sent before then
would only get a 429.

Pure: the caller passes the headers and the time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime

from ..limiter import Budget

__all__ = ["MAX_HOLD", "header_count", "lowercase_headers", "read_budget", "reset_duration", "reset_instant"]

MAX_HOLD = 8 * 86400.0
"""A reset further ahead than this (the longest window providers announce is 7 days) is not believed."""

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_ANTHROPIC_TOKENS = ("tokens", "input-tokens", "output-tokens")


def read_budget(headers: Mapping[str, str], now: float) -> Budget | None:
    """The budget the headers announce (None when they announce none). Unreadable values are skipped."""
    requests = header_count(headers.get("x-ratelimit-remaining-requests"))
    tokens = header_count(headers.get("x-ratelimit-remaining-tokens"))
    requests_reset = _after(now, reset_duration(headers.get("x-ratelimit-reset-requests")))
    tokens_reset = _after(now, reset_duration(headers.get("x-ratelimit-reset-tokens")))
    anthropic_requests = header_count(headers.get("anthropic-ratelimit-requests-remaining"))
    if anthropic_requests is not None:
        requests = anthropic_requests
        requests_reset = reset_instant(headers.get("anthropic-ratelimit-requests-reset"), now)
    for kind in _ANTHROPIC_TOKENS:
        remaining = header_count(headers.get(f"anthropic-ratelimit-{kind}-remaining"))
        if remaining is not None and (tokens is None or remaining < tokens):
            tokens = remaining
            tokens_reset = reset_instant(headers.get(f"anthropic-ratelimit-{kind}-reset"), now)
    status = headers.get("anthropic-ratelimit-unified-status")
    unified_reset = reset_instant(headers.get("anthropic-ratelimit-unified-reset"), now)
    if requests is None and tokens is None and status is None:
        return None
    holds = []
    if requests == 0 and requests_reset is not None:
        holds.append(requests_reset)
    if status is not None and status.strip().lower() == "rejected" and unified_reset is not None:
        holds.append(unified_reset)
    held_until = max(holds) if holds else None
    resets = [t for t in (requests_reset, tokens_reset, unified_reset) if t is not None]
    reset_at = held_until if held_until is not None else (min(resets) if resets else None)
    return Budget(remaining_requests=requests, remaining_tokens=tokens, reset_at=reset_at, held_until=held_until,
                  requests_reset=requests_reset)


def header_count(raw: str | None) -> int | None:
    """A count header's value (digits only); None when absent or unreadable."""
    if raw is None:
        return None
    raw = raw.strip()
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 15 else None


def reset_duration(raw: str | None) -> float | None:
    """An OpenAI reset duration: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if raw is None:
        return None
    raw = raw.strip()
    if not raw or len(raw) > 40:
        return None
    total, position = 0.0, 0
    for part in _DURATION_PART.finditer(raw):
        if part.start() != position:
            return None
        total += float(part.group(1)) * _UNITS[part.group(2)]
        position = part.end()
    return total if position == len(raw) else None


def reset_instant(raw: str | None, now: float) -> float | None:
    """A reset time: RFC 3339, or epoch seconds (Anthropic's unified reset)."""
    if raw is None:
        return None
    raw = raw.strip()
    if raw.isdigit() and len(raw) <= 12:
        return _believed(float(raw), now)
    try:
        moment = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return _believed(moment.timestamp(), now)


def _after(now: float, delay: float | None) -> float | None:
    return None if delay is None else _believed(now + delay, now)


def _believed(at: float, now: float) -> float | None:
    return at if at <= now + MAX_HOLD else None


def lowercase_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names folded to lower case; the first of duplicate names wins."""
    folded: dict[str, str] = {}
    for name, value in headers.items():
        if isinstance(name, str) and isinstance(value, str):
            folded.setdefault(name.lower(), value)
    return folded
