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

from dataclasses import dataclass

__all__ = [
    "CLIENT_DEADLINE_MARGIN",
    "COUNTERS",
    "MAX_LIMIT",
    "QUEUE_LISTED",
    "LimitKey",
    "auto_reduce_notice",
    "default_pause",
    "pause_length",
    "prompt_ms",
    "queue_key",
    "queue_timeout_message",
    "queue_wait_limit",
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

CLIENT_DEADLINE_MARGIN = 5.0
"""A request whose client sent its own timeout is answered this long before that timeout ends."""

_PROMPT_MS_BITS = 48
_ARRIVAL_BITS = 40
_PROMPT_MS_MAX = (1 << _PROMPT_MS_BITS) - 1
_UNSTARRED = 1 << (_PROMPT_MS_BITS + _ARRIVAL_BITS)


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


def default_pause(reduces: bool, default_pause: float, overload_pause: float) -> float:
    """The pause when no wait is stated: ``default_pause`` for a rate limit (it also lowers the limit),
    ``overload_pause`` for an overload (a provider-wide condition: it pauses only)."""
    return default_pause if reduces else overload_pause


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
    return max(0, int(prompt_started_at * 1000))


def queue_wait_limit(queue_timeout: float | None, client_wait: float | None) -> tuple[float | None, bool]:
    """How long a request may wait in the queue, and whether the client's own deadline is what bounds it
    (its SDK's timeout, less a margin, so it gets a clean 503 rather than giving up on its own)."""
    if client_wait is not None and (queue_timeout is None or client_wait < queue_timeout):
        return client_wait, True
    return queue_timeout, False


def queue_timeout_message(provider: str, queue_timeout: float | None, client_bound: bool) -> str:
    if client_bound:
        return (f"no slot on provider '{provider}' within the client's own timeout (X-Stainless-Timeout, "
                f"less {CLIENT_DEADLINE_MARGIN:g}s); answered before it gives up, retry later")
    return (f"waited longer than queue_timeout ({queue_timeout or 0:g}s) for a slot on provider '{provider}'; "
            "retry later")


def queue_key(starred: bool, prompt_started_at: float, arrival: int) -> int:
    """Queue order packed in one int: starred first, then the oldest prompt (whole milliseconds,
    as the Redis backend compares them), then arrival. Smaller goes first."""
    started = int(prompt_started_at * 1000)  # prompt_ms, written out: this runs on every enqueue
    if started < 0:
        started = 0
    elif started > _PROMPT_MS_MAX:
        started = _PROMPT_MS_MAX
    return (0 if starred else _UNSTARRED) | (started << _ARRIVAL_BITS) | arrival
