"""Waiters ordered by (starred, prompt start, arrival), in a heap with lazy deletion.

Push and pop are O(log n). A cancelled waiter is only marked; it is skipped when it
reaches the top, and the heap is compacted when dead entries outnumber live ones, so
cancellation is O(1) amortised and nothing ever sorts the queue on insert.

A provider's queue (``ClassedQueue``) is one such heap per class of waiter (its model
cap, its workspace when ``max_share`` is set, the key it is pinned to, its model group
when token windows are held): a waiter whose class cannot go never holds up a waiter of
another class behind it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ProxyError
from .policy import queue_key

__all__ = ["ClassedQueue", "Priority", "Recost", "Waiter", "WaiterClass", "WaiterQueue", "reject_all"]

WaiterClass = tuple[str | None, str | None, str | None, str | None] | None
"""Which heap of its provider's queue a waiter is in: (model cap pattern, workspace when shares apply, the
pool key it must have, its model group when windows apply), or None for the provider's one heap of waiters
any slot may serve."""

Recost = Callable[[], Mapping[str, float] | None]
"""A waiter's own estimate, asked again when its model group's estimates moved: what it would cost its windows
now (None: what it has stays)."""


class Priority(NamedTuple):
    """What a request says about itself: its place in the queue, and how it came (a tuple: built on every
    request)."""

    prompt_started_at: float
    workspace: str = "default"
    starred: bool = False
    conversation: str | None = None
    transport: str = "http"
    """``http``, or ``websocket`` for a response asked for on a WebSocket (shown in the queue listing)."""


@dataclass(eq=False, slots=True)
class Waiter:
    priority: Priority
    seq: int
    enqueued_at: float
    on_grant: Callable[[Any], None] | None
    on_reject: Callable[[Any], None] | None = None
    starred: bool = False
    queued: bool = True
    client_bound: bool = False
    """Its wait is bounded by the client's own deadline rather than queue_timeout."""
    pattern: str | None = None
    """The model cap its model matched when it came (None: none applies)."""
    key: str | None = None
    """The pool key it must be granted on (a WebSocket's responses go on the key its socket opened with)."""
    model: str | None = None
    """The model the request named (shown while it holds its slot)."""
    waiter_class: WaiterClass = None
    cost: Mapping[str, float] | None = None
    """What it will take from its windows (None: no window applies to it)."""
    group: str | None = None
    """The model group of its windows."""
    held_by: tuple[tuple[str | None, str, str], ...] = ()
    """The windows that held it when it last came up and could not go (key, group, window)."""
    holder: str | None = None
    """What held it when it came and could not go (``holding.what_holds``): traces show it."""
    recost: Recost | None = None
    """How the shell that queued it costs it again (``ProviderWindows.recost``); None: its cost stays."""

    def forget_callbacks(self) -> None:
        """Drop the references to the caller's future once the waiter has left the queue."""
        self.on_grant = None
        self.on_reject = None

    def __lt__(self, other: Waiter) -> bool:
        """Never the deciding compare: two heap entries tie on their key only when one of them is dead."""
        return False

    def sort_key(self) -> int:
        """(starred, prompt start, arrival) packed into one int: one C-level compare per heap step."""
        return queue_key(self.starred, self.priority.prompt_started_at, self.seq)


def _key(entry: tuple[int, Waiter]) -> int:
    return entry[0]


class WaiterQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, Waiter]] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, waiter: Waiter) -> None:
        heapq.heappush(self._heap, (waiter.sort_key(), waiter))
        self._live += 1

    def pop(self) -> Waiter | None:
        while self._heap:
            _, waiter = heapq.heappop(self._heap)
            if waiter.queued:
                waiter.queued = False
                self._live -= 1
                return waiter
        return None

    def head(self) -> tuple[int, Waiter]:
        """The first live waiter with its sort key (the queue must not be empty)."""
        heap = self._heap
        while not heap[0][1].queued:
            heapq.heappop(heap)
        return heap[0]

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (its client left or it timed out); False if it was not queued."""
        if not waiter.queued:
            return False
        waiter.queued = False
        self._live -= 1
        if len(self._heap) > 64 and self._live * 2 < len(self._heap):
            self._rebuild()
        return True

    def live(self) -> list[Waiter]:
        """Its waiters still queued, in no particular order: O(its entries)."""
        return [waiter for _, waiter in self._heap if waiter.queued]

    def take_workspace(self, workspace: str) -> list[Waiter]:
        """Take out every waiter of ``workspace``, in queue order: O(n log n), for a rare event (its spend cap
        reached), never on the way of a grant."""
        taken = [waiter for waiter in self.in_order() if waiter.priority.workspace == workspace]
        if taken:
            for waiter in taken:
                waiter.queued = False
            self._live -= len(taken)
            self._rebuild()
        return taken

    def restar(self, starred_workspaces: frozenset[str]) -> None:
        """Re-evaluate each waiter's star against a new starred set and restore heap order."""
        for _, waiter in self._heap:
            waiter.starred = waiter.priority.starred or waiter.priority.workspace in starred_workspaces
        self._rebuild()

    def in_order(self, limit: int | None = None) -> Iterator[Waiter]:
        """Live waiters in admission order, the first ``limit`` of them (for status; not on a hot path)."""
        live = (entry for entry in self._heap if entry[1].queued)
        ordered = sorted(live, key=_key) if limit is None else heapq.nsmallest(limit, live, key=_key)
        for _, waiter in ordered:
            yield waiter

    def _rebuild(self) -> None:
        self._heap = [(w.sort_key(), w) for _, w in self._heap if w.queued]
        heapq.heapify(self._heap)


class ClassedQueue:
    """A provider's queue: one ``WaiterQueue`` per class of waiter; ``count`` is the waiters in all of them."""

    __slots__ = ("_heaps", "count")

    def __init__(self) -> None:
        self._heaps: dict[WaiterClass, WaiterQueue] = {}
        self.count = 0

    def push(self, waiter: Waiter, waiter_class: WaiterClass) -> None:
        waiter.waiter_class = waiter_class
        queue = self._heaps.get(waiter_class)
        if queue is None:
            queue = self._heaps[waiter_class] = WaiterQueue()
        queue.push(waiter)
        self.count += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (its client left or it timed out); False if it was not queued."""
        queue = self._heaps.get(waiter.waiter_class)
        if queue is None or not queue.remove(waiter):
            return False
        self.count -= 1
        if not len(queue):
            del self._heaps[waiter.waiter_class]
        return True

    def pop_head(self, waiter: Waiter) -> None:
        """The chosen waiter is the head of its class: popped off its heap, not merely marked (a retry
        re-queues with the same place, and must not meet its old entry there)."""
        queue = self._heaps[waiter.waiter_class]
        queue.pop()
        self.count -= 1
        if not len(queue):
            del self._heaps[waiter.waiter_class]

    def heads(self) -> list[tuple[int, Waiter]]:
        """Each class's first waiter with its sort key, in queue order."""
        heads = [queue.head() for queue in self._heaps.values()]
        if len(heads) > 1:
            heads.sort(key=_key)
        return heads

    def held_heads(self) -> Iterator[tuple[Waiter, int]]:
        """Each class's first waiter that a window held, with how many waiters its class holds (status)."""
        for queue in self._heaps.values():
            if len(queue):
                head = queue.head()[1]
                if head.held_by:
                    yield head, len(queue)

    def of_group(self, group: str) -> list[Waiter]:
        """The waiters with a window cost in model ``group`` (their class names it), in no particular order."""
        found: list[Waiter] = []
        for waiter_class, queue in self._heaps.items():
            if waiter_class is not None and waiter_class[3] == group:
                found += queue.live()
        return found

    def take_all(self) -> list[Waiter]:
        """Empty the queue: every waiter it held, class by class in queue order, no longer queued."""
        heaps, self._heaps, self.count = self._heaps, {}, 0
        taken = []
        for queue in heaps.values():
            while (waiter := queue.pop()) is not None:
                taken.append(waiter)
        return taken

    def take_workspace(self, workspace: str) -> list[Waiter]:
        """Take out every waiter of ``workspace``, class by class in queue order; the others keep their place."""
        taken: list[Waiter] = []
        for waiter_class, queue in list(self._heaps.items()):
            taken += queue.take_workspace(workspace)
            if not len(queue):
                del self._heaps[waiter_class]
        self.count -= len(taken)
        return taken

    def restar(self, starred_workspaces: frozenset[str]) -> None:
        for queue in self._heaps.values():
            queue.restar(starred_workspaces)

    def in_order(self, limit: int) -> list[Waiter]:
        """The first ``limit`` waiters in queue order over every class (for status; not on a hot path)."""
        if len(self._heaps) == 1:
            return list(next(iter(self._heaps.values())).in_order(limit))
        merged = heapq.merge(*(queue.in_order(limit) for queue in self._heaps.values()), key=Waiter.sort_key)
        return list(itertools.islice(merged, limit))


def reject_all(waiters: Iterable[Waiter], error: ProxyError) -> int:
    """Answer each waiter taken out of its queue with ``error``; returns how many there were."""
    count = 0
    for waiter in waiters:
        on_reject = waiter.on_reject
        waiter.forget_callbacks()
        if on_reject is not None:
            on_reject(error)
        count += 1
    return count
