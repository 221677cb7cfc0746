"""The limiter's rules, once: pure functions of numbers and time, applied by every backend.

The memory backend calls these directly. The Redis backend's Lua scripts cannot
call Python, so they receive what these functions decide as arguments or as
fields of the provider's settings hash (notice templates, the listing length,
the Retry-After hint's inputs), and the few rules Lua must still apply inside one
atomic script (admission, the same-burst test, one reduction step, one recovery
step) are held to these functions by ``tests/backends/test_policy_vs_lua.py``,
which runs the same event sequences through both and compares every status field.

Time is always an argument (seconds, or integer milliseconds where Lua shares the
rule), never read here.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

__all__ = [
    "CLIENT_DEADLINE_MARGIN",
    "COUNTERS",
    "MAX_LIMIT",
    "QUEUE_LISTED",
    "STICKY_CONVERSATIONS",
    "LimitKey",
    "StickyKeys",
    "auto_reduce_notice",
    "choose_key",
    "default_pause",
    "model_pattern",
    "pause_length",
    "pool_paused_until",
    "prompt_ms",
    "queue_key",
    "queue_timeout_message",
    "queue_wait_limit",
    "recovering_notice",
    "recovery_step",
    "reduced_limit",
    "retry_after_hint",
    "same_burst",
    "share_cap",
    "socket_key",
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


STICKY_CONVERSATIONS = 10_000
"""Conversations whose last key is remembered (the least recently used is forgotten first)."""


@dataclass(frozen=True, slots=True)
class LimitKey:
    """What one slot is counted against: a provider, one key of its pool, or one of its model caps.
    Each is a level of its own, so a rule written for one applies at every level."""

    provider: str
    key: str | None = None
    model: str | None = None

    def __str__(self) -> str:
        """As every backend's log lines name it: ``provider=anthropic key=team-a``."""
        if self.key is not None:
            return f"provider={self.provider} key={self.key}"
        if self.model is not None:
            return f"provider={self.provider} model={self.model}"
        return f"provider={self.provider}"


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
    """A backoff belongs to the burst that already lowered the limit when the limit is paused (a pause
    ending this very instant still counts: nothing was granted since it began), or when its request was
    granted before the latest reduction: it extends the pause only."""
    if paused_until is not None and paused_until >= now:
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


def choose_key(candidates: Sequence[tuple[str, int | None]], preferred: str | None) -> str | None:
    """Which key of a pool a request takes. ``candidates`` are the keys that may take one now (not paused,
    not held for their budget, a slot free), in config order, each with its free slots (None: no limit).

    The conversation's previous key if it is one of them (the provider's prompt cache is warm there),
    else the one with the most free slots, ties in config order; None when no key may take one."""
    best: str | None = None
    best_free = -1
    for name, free in candidates:
        if name == preferred:
            return name
        room = MAX_LIMIT + 1 if free is None else free
        if room > best_free:
            best, best_free = name, room
    return best


def socket_key(with_room: Sequence[tuple[str, int | None]], unblocked: Sequence[str], pool: Sequence[str],
               preferred: str | None) -> str | None:
    """The key a new WebSocket opens its upstream socket with (its responses then wait for that key's slot).

    As a grant would choose (``with_room``: see ``choose_key``); when no key has a slot free, the
    conversation's previous key or else the first key that is neither paused nor held (``unblocked``, in
    config order); when every key is blocked, the first of the pool. None without a pool."""
    chosen = choose_key(with_room, preferred)
    if chosen is not None:
        return chosen
    if unblocked:
        return preferred if preferred in unblocked else unblocked[0]
    return pool[0] if pool else None


def pool_paused_until(own: float | None, key_ends: Sequence[float | None]) -> float | None:
    """When a provider with a pool may grant again: its own pause, else, while every available key is
    paused or held (``key_ends``: when each key's pause or hold ends, None for a key free of both), the
    earliest end among them; None when it is not paused."""
    if own is not None or not key_ends:
        return own
    earliest: float | None = None
    for end in key_ends:
        if end is None:
            return None
        if earliest is None or end < earliest:
            earliest = end
    return earliest


def model_pattern(model: str | None, patterns: Sequence[str]) -> str | None:
    """The first model-cap pattern (shell-style, case-sensitive) a request's model matches, if any."""
    if model is None:
        return None
    for pattern in patterns:
        if fnmatchcase(model, pattern):
            return pattern
    return None


def share_cap(max_share: float | None, capacity: int | None) -> int | None:
    """The most slots one workspace may hold while another waits: ``ceil(max_share × capacity)``,
    at least one; None when there is no share or no finite capacity to take it of."""
    if max_share is None or capacity is None:
        return None
    return max(1, math.ceil(max_share * capacity - 1e-9))


class StickyKeys:
    """The key each recent conversation last took, the least recently used forgotten first."""

    __slots__ = ("_keys", "_size")

    def __init__(self, size: int = STICKY_CONVERSATIONS) -> None:
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._size = size

    def get(self, conversation: str | None) -> str | None:
        if conversation is None:
            return None
        key = self._keys.get(conversation)
        if key is not None:
            self._keys.move_to_end(conversation)
        return key

    def remember(self, conversation: str | None, key: str | None) -> None:
        if conversation is None or key is None:
            return
        keys = self._keys
        if keys.get(conversation) == key:
            keys.move_to_end(conversation)
            return
        keys[conversation] = key
        keys.move_to_end(conversation)
        if len(keys) > self._size:
            keys.popitem(last=False)


def queue_key(starred: bool, prompt_started_at: float, arrival: int) -> int:
    """Queue order packed in one int: starred first, then the oldest prompt (whole milliseconds,
    as the Redis backend compares them), then arrival. Smaller goes first."""
    started = int(prompt_started_at * 1000)  # prompt_ms, written out: this runs on every enqueue
    if started < 0:
        started = 0
    elif started > _PROMPT_MS_MAX:
        started = _PROMPT_MS_MAX
    return (0 if starred else _UNSTARRED) | (started << _ARRIVAL_BITS) | arrival
