"""Keeping full garbage-collection passes short while thousands of requests are held.

CPython's full (generation 2) collection walks every tracked object. With 10 000
queued requests that is about 800 000 objects and a stop of 0.2–0.5 s, during which
no stream is relayed. Nearly everything such a pass walks is long-lived (open
connections, parked handlers), and it frees next to nothing.

So after a slow full pass the heap is frozen (``gc.freeze``) and later passes skip
it. Frozen objects are still freed by reference counting as soon as they are let go;
only reference cycles among them wait. Those are collected once the load that led to
the freeze has fallen to a quarter: the heap is then unfrozen, collected once (a pass
over what is left, a quarter-sized stop) and frozen again. What one freeze can hold
back is bounded by the heap it froze; in the soak benchmark it was under a hundred objects.

At start-up (``settle_heap``) what is already allocated is frozen, young passes wait for more new objects
and full passes are spaced further apart than CPython's defaults. One ``PauseHook`` per process times every collection for the keeper and for
the ``slotproxy_gc_pause_seconds`` metric.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..limiter import Clock, Timer

__all__ = ["Collector", "HeapKeeper", "PauseHook", "process_pauses", "settle_heap"]

log = logging.getLogger("slotproxy")

YOUNG_PASS_AFTER = 2000
"""New objects (allocations less deallocations) between two young collections: CPython's 700 is less than
what sixteen small requests in flight hold at once, so a busy relay ran a young pass every 29 requests that
freed nothing (its requests' objects die by reference counting once they end) and moved the live ones on to
older generations: 4–5 µs a request. At 2 000 the same load runs one every few thousand requests, each about
0.5 ms (``bench/RESULTS.md``, "The ceiling: young collections")."""

FULL_PASS_AFTER = 100
"""Younger collections between two full ones: ten times CPython's 10. A fleet opening a thousand streams at
once grows the heap by a quarter several times over, and each time CPython walks all of it in a full pass
that frees next to nothing (17–39 ms each, no stream relayed meanwhile). With this, no collection stopped
the loop for over 10 ms and the added chunk-gap p99 at 1 000 streams fell from 9–12 ms to 5–7 ms, at the
same peak RSS (``bench/RESULTS.md``, "Lean, third pass")."""

SLOW_FULL_PASS = 0.05
CHECK_EVERY = 1.0
LOAD_DROP = 4


class Collector(Protocol):
    """The parts of the :mod:`gc` module the keeper uses (a fake one in tests)."""

    callbacks: list[Any]

    def freeze(self) -> None: ...

    def unfreeze(self) -> None: ...

    def collect(self) -> int: ...


def settle_heap() -> None:
    """At start-up: what is allocated so far lives as long as the process, so it is frozen out of every
    later pass; young passes wait for ``YOUNG_PASS_AFTER`` new objects, and full passes are spaced
    ``FULL_PASS_AFTER`` younger ones apart."""
    gc.collect()
    gc.freeze()
    _, middle, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_PASS_AFTER, middle, FULL_PASS_AFTER)


PauseListener = Callable[[int, float], None]
"""Told each collection's generation and how long it stopped the process, in seconds."""


class PauseHook:
    """Times every collection through the collector's hook and tells its listeners. Listeners run inside
    the collector: they only record."""

    def __init__(self, collector: Collector = gc, timer: Callable[[], float] = time.perf_counter) -> None:
        self._collector = collector
        self._timer = timer
        self._started: float | None = None
        self._listeners: list[PauseListener] = []

    def listen(self, listener: PauseListener) -> None:
        if not self._listeners:
            self._collector.callbacks.append(self._on_collection)
        self._listeners.append(listener)

    def forget(self, listener: PauseListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)
        if not self._listeners and self._on_collection in self._collector.callbacks:
            self._collector.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._timer()
        elif self._started is not None:
            took, self._started = self._timer() - self._started, None
            for listener in list(self._listeners):
                listener(info["generation"], took)


@functools.cache
def process_pauses() -> PauseHook:
    """The interpreter's collector has one hook list: one ``PauseHook`` on it per process."""
    return PauseHook()


class HeapKeeper:
    """Watches full collections; freezes the heap after a slow one, collects it when load is down to a quarter.

    ``load`` is the number of requests the proxy holds (queued or in flight).
    """

    def __init__(self, load: Callable[[], int], clock: Clock, *, collector: Collector = gc,
                 pauses: PauseHook | None = None, timer: Callable[[], float] = time.perf_counter,
                 slow_pass: float = SLOW_FULL_PASS, check_every: float = CHECK_EVERY) -> None:
        self._load = load
        self._clock = clock
        self._gc = collector
        self._pauses = pauses or process_pauses()
        self._timer = timer
        self._slow_pass = slow_pass
        self._check_every = check_every
        self._slow: float | None = None
        self._frozen_at_load: int | None = None
        self._collecting = False
        self._next: Timer | None = None

    def start(self) -> None:
        self._pauses.listen(self._on_pause)
        self._next = self._clock.call_later(self._check_every, self.check)

    def stop(self) -> None:
        self._pauses.forget(self._on_pause)
        if self._next is not None:
            self._next.cancel()
            self._next = None

    def _on_pause(self, generation: int, took: float) -> None:
        """Runs inside the collector: only notes a slow full pass; the check acts on it later."""
        if generation == 2 and not self._collecting and took > self._slow_pass:
            self._slow = max(took, self._slow or 0.0)

    def check(self) -> None:
        """Once a second: freeze after a slow pass, or collect what a freeze held once load is down to a quarter."""
        self._next = self._clock.call_later(self._check_every, self.check)
        load = self._load()
        if self._frozen_at_load is not None and load * LOAD_DROP <= self._frozen_at_load:
            self._collect_frozen(load)
        elif self._slow is not None:
            took, self._slow = self._slow, None
            self._gc.freeze()
            self._frozen_at_load = max(load, self._frozen_at_load or 0, 1)
            log.info("a full garbage collection took %.0f ms with %d request(s) held; heap frozen so later "
                     "passes skip it", took * 1000, load)

    def _collect_frozen(self, load: int) -> None:
        started = self._timer()
        self._collecting = True
        try:
            self._gc.unfreeze()
            freed = self._gc.collect()
            self._gc.freeze()
        finally:
            self._collecting = False
        log.info("load fell from %d to %d request(s): heap collected once (%d freed, %.0f ms) and frozen again",
                 self._frozen_at_load, load, freed, (self._timer() - started) * 1000)
        self._frozen_at_load = None
        self._slow = None
