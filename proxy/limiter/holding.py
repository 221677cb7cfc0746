"""What holds a queued waiter, in words, for its queue span: the provider's pause, usage gate or limit, the
keys of its pool, its model cap, the key it is pinned to, its token windows, or only the waiters ahead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .lease import AdmissionGate
from .level import LimitLevel
from .queue import Waiter

__all__ = ["holder_words", "what_holds"]


class _Limiter(Protocol):
    """What is read of the provider's limiter."""

    @property
    def level(self) -> LimitLevel: ...

    @property
    def gate(self) -> AdmissionGate | None: ...

    @property
    def _pool(self) -> Sequence[LimitLevel]: ...

    @property
    def _models(self) -> Mapping[str, LimitLevel]: ...

    def _pinned_room(self, key: str) -> bool: ...


def what_holds(limiter: _Limiter, waiter: Waiter) -> str:
    """Read when the waiter is queued (its windows, as they held it last, are read at its grant)."""
    level = limiter.level
    if level.available_at() is not None:
        return "provider paused"
    if limiter.gate is not None and not limiter.gate.admits():
        return "usage gate"
    if not level.has_room():
        return "provider limit"
    if limiter._pool and not any(key.has_room() for key in limiter._pool):
        return "keys"
    model = limiter._models.get(waiter.pattern) if waiter.pattern is not None else None
    if model is not None and not model.has_room():
        return f"model {waiter.pattern}"
    if waiter.key is not None and not limiter._pinned_room(waiter.key):
        return f"key {waiter.key}"
    return holder_words(waiter) or "queue"


def holder_words(waiter: Waiter) -> str | None:
    """``window input_tokens_per_minute`` (with its key when a pool holds it) when windows held the waiter
    last, else what held it when it came."""
    if not waiter.held_by:
        return waiter.holder
    names = dict.fromkeys(window if key is None else f"{window} (key {key})" for key, _, window in waiter.held_by)
    return "window " + ", ".join(names)
