"""Idle deadlines for every upstream exchange in flight, with one timer between them.

A relayed exchange must end when upstream goes quiet for ``idle_timeout``: no
final headers, or no next chunk. A timer per exchange re-armed on every read
(what aiohttp's ``sock_read`` does) costs a timer handle per chunk; here a
chunk only moves the exchange's ``expires_at``. The deadlines sit in the
limiter's ``Deadlines`` (one timer for the earliest); an entry that has moved on
when its time comes is put back with its new time, and one that has finished is
dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..limiter.clock import Timer
from ..limiter.deadlines import Deadlines

__all__ = ["IdleWatch", "Watch"]


class _LoopTime:
    """The running loop's monotonic time and timers (a wall clock that jumps must not end an exchange)."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay), callback)


class Watch:
    """One exchange's idle deadline; ``fire()`` (also the watchdog's abort) cancels its task."""

    __slots__ = ("_now", "_owner", "_task", "delay", "done", "expires_at", "fired", "queued")

    def __init__(self, owner: IdleWatch, task: asyncio.Task[object], delay: float, now: Callable[[], float]) -> None:
        self._owner = owner
        self._task = task
        self.delay = delay
        self._now = now
        """The loop's clock (``loop.time``), bound once: asking for the running loop costs a system call."""
        self.expires_at = now() + delay
        self.done = False
        self.fired = False
        self.queued = True
        """Still watched, neither fired nor closed (what ``Deadlines`` asks of its entries)."""

    def progress(self) -> None:
        """Upstream made progress just now."""
        self.expires_at = self._now() + self.delay

    def fire(self) -> None:
        if self.queued:
            self.queued = False
            self.fired = True
            self._task.cancel()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.queued = False
            self._owner._closed()

    def absorbed(self) -> bool:
        """Whether a CancelledError was this watch's alone; the client leaving as well still cancels."""
        return self.fired and self._task.uncancel() == 0


class IdleWatch:
    def __init__(self) -> None:
        self._clock = _LoopTime()
        self._deadlines: Deadlines[Watch] = Deadlines(self._clock, self._due)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def watch(self, delay: float, task: asyncio.Task[Any] | None = None) -> Watch:
        """A deadline ``delay`` seconds from now for ``task`` (the current one by default); ``close()`` it
        when done."""
        loop = asyncio.get_running_loop()
        task = task or asyncio.current_task(loop)
        assert task is not None
        entry = Watch(self, task, delay, loop.time)
        self._live += 1
        self._deadlines.add(entry, entry.expires_at)
        return entry

    def _closed(self) -> None:
        self._live -= 1
        self._deadlines.settle(self._live)

    def _due(self, entry: Watch) -> None:
        if entry.expires_at > self._clock.time():
            self._deadlines.add(entry, entry.expires_at)
        else:
            entry.fire()
