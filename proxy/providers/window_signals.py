"""Reading the token windows from providers' answers: the limits and the room they announce, and which
window a 429 names.

Anthropic announces ``anthropic-ratelimit-{input-tokens,output-tokens,requests}-{limit,remaining,reset}``
(resets in RFC 3339; token ``-remaining`` rounded to the nearest thousand), and its 429 says "... of 40,000
input tokens per minute". Its ``anthropic-ratelimit-tokens-*`` only repeats the most restrictive of the
token windows and is not a window of its own. OpenAI announces ``x-ratelimit-{limit,remaining,reset}-
{tokens,requests}`` (resets as durations such as ``6m0s``), and its 429 says "... on tokens per min (TPM):
Limit 30000, Used 29000, Requested 2000". A window is named as the config names it (``WINDOW_NAMES``).

Pure: the caller passes the headers (case-insensitive, or with lower-case names), the body and the time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from .budgets import (
    MAX_HOLD,
    header_count,
    lowercase_headers,
    reset_duration,
    reset_instant,
)

__all__ = ["HEADER_NAMES", "REMAINING_HEADERS", "Dialect", "window_hit", "window_limits", "window_remaining"]

Dialect = Literal["anthropic", "openai"]

RATE_LIMIT_STATUS = 429

_HEADER_WINDOWS: dict[str, dict[str, str]] = {
    "anthropic": {
        "input_tokens_per_minute": "anthropic-ratelimit-input-tokens-{}",
        "output_tokens_per_minute": "anthropic-ratelimit-output-tokens-{}",
        "requests_per_minute": "anthropic-ratelimit-requests-{}",
    },
    "openai": {
        "tokens_per_minute": "x-ratelimit-{}-tokens",
        "requests_per_minute": "x-ratelimit-{}-requests",
    },
}
HEADER_NAMES: dict[str, tuple[str, ...]] = {
    dialect: tuple(pattern.format(part) for pattern in windows.values() for part in ("limit", "remaining", "reset"))
    for dialect, windows in _HEADER_WINDOWS.items()}
"""Every header (lower case) the window readers read, by dialect: a caller with many headers may pass only
these."""
REMAINING_HEADERS: dict[str, tuple[tuple[str, str], ...]] = {
    dialect: tuple((window, pattern.format("remaining")) for window, pattern in windows.items())
    for dialect, windows in _HEADER_WINDOWS.items()}
"""(window, its ``-remaining`` header in lower case), by dialect."""

_MAX_READ = 64 * 1024
"""A window's name is in the first words of an error body; nothing past this is searched."""
_NAMED_WINDOW = re.compile(r"\b(input tokens|output tokens|tokens|requests) per min(?:ute)?\b", re.IGNORECASE)
_NAMED: dict[str, dict[str, str]] = {
    "anthropic": {"input tokens": "input_tokens_per_minute", "output tokens": "output_tokens_per_minute",
                  "requests": "requests_per_minute"},
    "openai": {"tokens": "tokens_per_minute", "requests": "requests_per_minute"},
}


def window_limits(dialect: Dialect, headers: Mapping[str, str]) -> dict[str, int]:
    """The per-minute limit of each window the answer announces (``*-limit`` headers of 1 or more)."""
    folded = lowercase_headers(headers)
    limits = {}
    for window, pattern in _HEADER_WINDOWS[dialect].items():
        limit = header_count(folded.get(pattern.format("limit")))
        if limit:
            limits[window] = limit
    return limits


def window_remaining(dialect: Dialect, headers: Mapping[str, str], now: float) -> dict[str, tuple[float, float | None]]:
    """Each announced window's room: ``(remaining, reset_at)``, the reset as epoch seconds (None when it is
    missing or unreadable). Anthropic's token counts are returned as announced, rounded (the limiter core allows
    for that: ``limiter.window.ROUNDED_REMAINING``)."""
    folded = lowercase_headers(headers)
    room: dict[str, tuple[float, float | None]] = {}
    for window, pattern in _HEADER_WINDOWS[dialect].items():
        remaining = header_count(folded.get(pattern.format("remaining")))
        if remaining is not None:
            room[window] = (float(remaining), _reset_at(dialect, folded.get(pattern.format("reset")), now))
    return room


def window_hit(dialect: Dialect, status: int, headers: Mapping[str, str], body: bytes | str | None) -> str | None:
    """The window a 429 names, or None when it names none (an other 429 keeps the usual backoff rules).

    The error message's words come first ("... 40,000 input tokens per minute", "... on tokens per min
    (TPM)"), then a window whose ``-remaining`` header is 0. A per-day limit is not a window.
    """
    if status != RATE_LIMIT_STATUS:
        return None
    named = _named_in(dialect, body)
    if named is not None:
        return named
    folded = lowercase_headers(headers)
    for window, pattern in _HEADER_WINDOWS[dialect].items():
        if header_count(folded.get(pattern.format("remaining"))) == 0:
            return window
    return None


def _named_in(dialect: Dialect, body: bytes | str | None) -> str | None:
    if not body:
        return None
    text = body[:_MAX_READ].decode("utf-8", "replace") if isinstance(body, bytes) else body[:_MAX_READ]
    for match in _NAMED_WINDOW.finditer(text):
        window = _NAMED[dialect].get(match.group(1).lower())
        if window is not None:
            return window
    return None


def _reset_at(dialect: Dialect, raw: str | None, now: float) -> float | None:
    if dialect == "anthropic":
        return reset_instant(raw, now)
    delay = reset_duration(raw)
    return None if delay is None or delay > MAX_HOLD else now + delay
