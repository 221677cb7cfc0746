"""Idle deadlines for every upstream exchange in flight, with one timer between them.

A relayed exchange must end when upstream goes quiet for ``idle_timeout``: no
final headers, or no next chunk. A timer per exchange re-armed on every read
(what aiohttp's ``sock_read`` does) costs a timer handle per chunk; here a
chunk only moves the exchange's ``expires_at``. The one timer is armed for the
earliest entry of a heap; an entry that has moved on is pushed back with its
new time when it reaches the top, and one that has finished is dropped then,
or when the heap is compacted.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["IdleWatch", "Watch"]


class Watch:
    """One exchange's idle deadline; ``fire()`` (also the watchdog's abort) cancels its task."""

    __slots__ = ("_owner", "_task", "delay", "done", "expires_at", "fired")

    def __init__(self, owner: IdleWatch, task: asyncio.Task[object], delay: float, now: float) -> None:
        self._owner = owner
        self._task = task
        self.delay = delay
        self.expires_at = now + delay
        self.done = False
        self.fired = False

    def touch(self, now: float) -> None:
        """Upstream made progress at ``now`` (the loop's time)."""
        self.expires_at = now + self.delay

    def fire(self) -> None:
        if not self.fired and not self.done:
            self.fired = True
            self._task.cancel()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._owner._closed()

    def absorbed(self) -> bool:
        """Whether a CancelledError was this watch's alone; the client leaving as well still cancels."""
        return self.fired and self._task.uncancel() == 0


class IdleWatch:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for: float | None = None

    def __len__(self) -> int:
        return self._live

    def watch(self, delay: float) -> Watch:
        """A deadline ``delay`` seconds from now for the current task; ``close()`` it when done."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        entry = Watch(self, task, delay, loop.time())
        heapq.heappush(self._heap, (entry.expires_at, next(self._order), entry))
        self._live += 1
        if self._armed_for is None or entry.expires_at < self._armed_for:
            self._arm(loop, entry.expires_at)
        return entry

    def _closed(self) -> None:
        self._live -= 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [item for item in self._heap if not item[2].done]
            heapq.heapify(self._heap)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = when
        self._timer = loop.call_at(when, self._due)

    def _due(self) -> None:
        self._timer = self._armed_for = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if entry.done or entry.fired:
                continue
            if entry.expires_at > now:
                heapq.heappush(heap, (entry.expires_at, next(self._order), entry))
            else:
                entry.fire()
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        if heap:
            self._arm(loop, heap[0][0])
