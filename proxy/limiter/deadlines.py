"""Deadlines with one timer for them all, not one each: the queue timeouts of both backends, and the
relay's idle timeouts (``proxy.http.idle``).

Deadlines sit in a min-heap and one timer is armed for the earliest. A waiter
that leaves early (granted, cancelled) is not searched for: it is skipped when it
reaches the top, or dropped when the heap is compacted. Its callbacks are cleared
when it leaves, so what lingers is small.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from .clock import Clock, Timer

__all__ = ["Deadlines", "Expiring"]


class Expiring(Protocol):
    @property
    def queued(self) -> bool:
        """Still waiting: False once granted, cancelled or expired."""


W = TypeVar("W", bound=Expiring)


class Deadlines(Generic[W]):
    def __init__(self, clock: Clock, on_due: Callable[[W], None]) -> None:
        self._clock = clock
        self._on_due = on_due
        self._order = itertools.count()
        self._heap: list[tuple[float, int, W]] = []
        self._timer: Timer | None = None
        self._armed_for: float | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, waiter: W, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), waiter))
        if self._armed_for is None or deadline < self._armed_for:
            self._arm(deadline)

    def settle(self, live: int) -> None:
        """Drop waiters that already left from the top; compact when mostly dead.

        The timer is left armed when the last one leaves: a lone request at a time would otherwise set a
        timer and cancel it every time. The next waiter is most often due later than it, so it needs none;
        when the timer fires with nothing due, it is not armed again."""
        if not self._heap:
            return
        while self._heap and not self._heap[0][2].queued:
            heapq.heappop(self._heap)
        if len(self._heap) > 2 * live + 64:
            self._heap = [entry for entry in self._heap if entry[2].queued]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._armed_for = None

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = when
        self._timer = self._clock.call_later(when - self._clock.time(), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._armed_for = None
        now = self._clock.time()
        while self._heap:
            deadline, _, waiter = self._heap[0]
            if waiter.queued and deadline > now:
                break
            heapq.heappop(self._heap)
            if waiter.queued:
                self._on_due(waiter)  # may add() entries, arming for one that is not the earliest
        if self._heap and (self._armed_for is None or self._heap[0][0] < self._armed_for):
            self._arm(self._heap[0][0])
