"""The watchdog: slots held past ``slot_timeout`` are taken back, with one timer for all of them.

Every slot of a provider has the same timeout, so the order slots were taken in is
the order they fall due: they are kept in that order, a take or a return sets no
timer, and the one timer waits for the oldest. A changed timeout applies to the
slots held now as well, counted from when each was taken. Both backends keep one
per provider.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from .clock import Clock, Timer

__all__ = ["SlotWatchdog"]

S = TypeVar("S", bound=Hashable)


class SlotWatchdog(Generic[S]):
    def __init__(self, clock: Clock, on_due: Callable[[S], None], timeout: float | None = None) -> None:
        self._clock = clock
        self._on_due = on_due
        self._timeout = timeout
        self._held: dict[S, float] = {}
        """Held slots in the order they were taken, with when."""
        self._timer: Timer | None = None
        self._sweeping = False

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[S]:
        return iter(self._held)

    def hold(self, slot: S) -> None:
        self._held[slot] = self._clock.time()
        if self._timer is None and not self._sweeping and self._timeout is not None:
            self._timer = self._clock.call_later(self._timeout, self._sweep)

    def drop(self, slot: S) -> None:
        """The slot was returned (or taken back): it is not watched any more. The timer is left to run out
        (as ``Deadlines`` leaves its own): the next slot taken is due after it, so it sets none."""
        self._held.pop(slot, None)

    def set_timeout(self, timeout: float | None) -> None:
        if timeout == self._timeout:
            return
        self._timeout = timeout
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held and timeout is not None:
            self._timer = self._clock.call_later(0.0, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        timeout = self._timeout
        if timeout is None:
            return
        now = self._clock.time()
        self._sweeping = True  # a slot taken back may be granted to a waiter: it joins the end, no timer
        try:
            while self._held:
                oldest, taken_at = next(iter(self._held.items()))
                if taken_at + timeout > now:
                    break
                self.drop(oldest)
                self._on_due(oldest)
        finally:
            self._sweeping = False
        if self._held:
            due = next(iter(self._held.values())) + timeout
            self._timer = self._clock.call_later(due - now, self._sweep)
