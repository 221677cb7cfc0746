"""The limiter's rules, once: pure functions of numbers and time, applied by every backend.

The memory backend calls these directly. The Redis backend's Lua scripts cannot
call Python, so they receive what these functions decide as arguments or as
fields of the provider's settings hash (notice templates, the listing length,
the Retry-After hint's inputs), and the few rules Lua must still apply inside one
atomic script (admission, the same-burst test, one reduction step, one recovery
step) are held to these functions by ``tests/limiter/test_policy_vs_lua.py``,
which runs the same event sequences through both and compares every status field.

Time is always an argument (seconds, or integer milliseconds where Lua shares the
rule), never read here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "COUNTERS",
    "MAX_LIMIT",
    "QUEUE_LISTED",
    "LimitKey",
    "auto_reduce_notice",
    "pause_length",
    "prompt_ms",
    "queue_key",
    "recovering_notice",
    "recovery_step",
    "reduced_limit",
    "retry_after_hint",
    "same_burst",
    "validate_limit",
]

MAX_LIMIT = 100_000
"""The largest concurrency limit accepted anywhere (config, admin API, a limiter)."""

QUEUE_LISTED = 1000
"""Waiters listed in a status snapshot: the head of the queue, so status stays cheap with 10 000 waiting."""

COUNTERS = ("granted", "queue_full", "queue_timeouts", "reclaims", "backoffs", "auto_reductions")
"""The counters every backend keeps per limit, by these names."""

_PROMPT_MS_BITS = 48
_ARRIVAL_BITS = 40


@dataclass(frozen=True, slots=True)
class LimitKey:
    """What one slot is counted against. Today a provider; a key of its pool or a model cap later,
    each a level of its own, so a rule written for a key applies at every level."""

    provider: str

    def __str__(self) -> str:
        return self.provider


def validate_limit(limit: object) -> int | None:
    """A limit: a whole number from 1 to ``MAX_LIMIT``, or None for unlimited."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be a positive integer or null (at most {MAX_LIMIT}), got {limit!r}")
    return limit


def auto_reduce_notice(limit: int | str, cause: str) -> str:
    return f"Concurrency limit auto-reduced to {limit} after a {cause} — restore manually when ready."


def recovering_notice(limit: int | str, target: int | str, after: float) -> str:
    return (f"Concurrency limit auto-reduced, recovering: now {limit} of {target} "
            f"after {after:g}s without a backoff.")


def pause_length(stated_wait: float | None, default_pause: float) -> float:
    """How long a backoff pauses: the upstream's stated wait, else ``default_pause``."""
    return default_pause if stated_wait is None else max(0.0, stated_wait)


def same_burst(now: float, paused_until: float | None, sent_at: float | None, last_reduction_at: float) -> bool:
    """A backoff belongs to the burst that already lowered the limit when the limit is paused,
    or when its request was granted before the latest reduction: it extends the pause only."""
    if paused_until is not None and paused_until > now:
        return True
    return sent_at is not None and sent_at <= last_reduction_at


def reduced_limit(limit: int | None) -> int | None:
    """One reduction step: one less, never below 1; None (no step) when unlimited or already 1."""
    if limit is None or limit <= 1:
        return None
    return limit - 1


def recovery_step(limit: int, target: int) -> tuple[int, bool]:
    """One recovery step toward ``target``: the new limit, and whether the reduction is over."""
    raised = min(target, limit + 1)
    return raised, raised >= target


def retry_after_hint(now: float, paused_until: float | None) -> float:
    """Retry-After on a proxy-made 503: the rest of the pause, at least a second."""
    if paused_until is not None and paused_until > now:
        return max(1.0, paused_until - now)
    return 1.0


def prompt_ms(prompt_started_at: float) -> int:
    """A prompt start as both backends compare it: whole epoch milliseconds."""
    return max(0, math.floor(prompt_started_at * 1000))


def queue_key(starred: bool, prompt_started_at: float, arrival: int) -> int:
    """Queue order packed in one int: starred first, then the oldest prompt (whole milliseconds,
    as the Redis backend compares them), then arrival. Smaller goes first."""
    started = min(prompt_ms(prompt_started_at), (1 << _PROMPT_MS_BITS) - 1)
    return ((0 if starred else 1) << (_PROMPT_MS_BITS + _ARRIVAL_BITS)) | (started << _ARRIVAL_BITS) | arrival
