"""What holds a queued waiter, in words, for its queue span: the provider's pause, usage gate or limit, the
keys of its pool, its model cap, the key it is pinned to, its token windows, or only the waiters ahead.

Both backends name it alike, and the words are made here only: a level is named by its code (``paused``,
``gate``, ``limit``, ``keys``, ``queue``, or a level id, ``m:<pattern>`` or ``k:<key>``), which
``what_holds`` finds in memory and the Redis scripts' ``what_holds`` finds in Lua (``lua_prelude``), and
``level_words`` puts in words; the windows that held it are put in words by ``window_words``.
``tests/backends/test_held_by.py`` holds the two to the same words.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from .lease import AdmissionGate
from .level import LimitLevel
from .queue import Waiter

__all__ = ["GATE", "KEYS", "LIMIT", "PAUSED", "QUEUE", "holder_words", "level_words", "what_holds", "window_words"]

PAUSED, GATE, LIMIT, KEYS, QUEUE = "paused", "gate", "limit", "keys", "queue"
"""The codes of what holds a waiter that is not a model cap, a key or a window."""

_WORDS = {PAUSED: "provider paused", GATE: "usage gate", LIMIT: "provider limit", KEYS: "keys", QUEUE: "queue"}


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
    code = _code(limiter, waiter)
    return (holder_words(waiter) if code == QUEUE else None) or level_words(code)


def _code(limiter: _Limiter, waiter: Waiter) -> str:
    """The first level without room for the waiter, in the order admission asks them (the Lua asks alike)."""
    level = limiter.level
    if level.available_at() is not None:
        return PAUSED
    if limiter.gate is not None and not limiter.gate.admits():
        return GATE
    if not level.has_room():
        return LIMIT
    if limiter._pool and not any(key.has_room() for key in limiter._pool):
        return KEYS
    model = limiter._models.get(waiter.pattern) if waiter.pattern is not None else None
    if model is not None and not model.has_room():
        return f"m:{waiter.pattern}"
    if waiter.key is not None and not limiter._pinned_room(waiter.key):
        return f"k:{waiter.key}"
    return QUEUE


def level_words(code: str) -> str:
    """``provider limit``, ``model opus-*``, ``key a``...: the words for a level's code."""
    if code.startswith("m:"):
        return f"model {code[2:]}"
    if code.startswith("k:"):
        return f"key {code[2:]}"
    return _WORDS.get(code, code)


def window_words(held: Iterable[tuple[str | None, str]]) -> str:
    """``window input_tokens_per_minute`` for the windows (key, window) that held a waiter, with the key
    when a pool's key holds it (None: the provider's own windows)."""
    names = dict.fromkeys(window if key is None else f"{window} (key {key})" for key, window in held)
    return "window " + ", ".join(names)


def holder_words(waiter: Waiter) -> str | None:
    """The windows that held the waiter last, else what held it when it came."""
    if not waiter.held_by:
        return waiter.holder
    return window_words((key, window) for key, _, window in waiter.held_by)
