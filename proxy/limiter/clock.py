"""Time as an input: the limiter reads the time and sets timers only through a Clock."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Clock", "FakeClock", "LoopClock", "Timer"]


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Wall-clock time in epoch seconds, and one-shot timers."""

    def time(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer: ...


class LoopClock:
    """The production clock: ``time.time()`` and the running asyncio loop's timers."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self.time: Callable[[], float] = time.time
        """``time.time`` itself: read several times a request, and a method around it would cost a frame."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        loop = self._loop or asyncio.get_running_loop()
        return loop.call_later(max(0.0, delay), callback)


class _FakeTimer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that only moves when told to; timers fire in deadline order during advance()."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer, Callable[[], None]]] = []
        self._order = itertools.count()
        self.timers_set = 0
        """How many timers were ever set: what a test of "sets no timer" counts."""

    def time(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        self.timers_set += 1
        timer = _FakeTimer()
        heapq.heappush(self._timers, (self._now + max(0.0, delay), next(self._order), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, firing every timer that falls due, each at its own deadline."""
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer, callback = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            callback()
        self._now = target

    @property
    def pending(self) -> int:
        return sum(1 for entry in self._timers if not entry[2].cancelled)
