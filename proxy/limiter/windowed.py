"""A provider limiter's token windows: which key a request with a window cost may take now, what holds a
waiter that cannot, the one timer that wakes the queue when a held head's room will exist, and what the
provider's answers say of the windows, and the waiters of a model group costed again when its estimates moved.

Pure, like the rest of the core: time and the timer come from the injected clock; the limiter that owns it
is told through ``on_room`` (a window may have room now: grant waiters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import policy
from .clock import Clock, Timer
from .lease import Lease
from .level import LimitLevel
from .queue import ClassedQueue, Waiter
from .window import OTHER_GROUP, WindowBook, WindowId, WindowSettings

__all__ = ["ProviderWindows"]


class ProviderWindows:
    def __init__(self, settings: WindowSettings, clock: Clock, on_room: Callable[[], None],
                 queue: ClassedQueue) -> None:
        self.book = WindowBook(settings)
        self._clock = clock
        self._on_room = on_room
        self._queue = queue
        """The owning limiter's queue, whose waiters ``recost`` costs again."""
        self.wake: float | None = None
        """When the earliest held head will have room (found by the limiter's last look at its queue)."""
        self.blocked: set[WindowId] = set()
        """The windows holding a head in the limiter's current look at its queue: a later head needing one of
        them waits behind it, or small requests would pass a large one for ever."""
        self._timer: Timer | None = None
        self._timer_at = math.inf

    @classmethod
    def reloaded(cls, current: ProviderWindows | None, settings: WindowSettings | None, clock: Clock,
                 on_room: Callable[[], None], queue: ClassedQueue) -> ProviderWindows | None:
        """The windows after a config (re)load: none, new ones, or the current ones with their new limits."""
        if settings is None:
            return None
        if current is None:
            return cls(settings, clock, on_room, queue)
        if settings != current.book.settings:
            current.book.apply(settings, clock.time())
        return current

    # ----- admission -------------------------------------------------------------

    def fit(self, pool: Sequence[LimitLevel], pinned: str | None, preferred: str | None, group: str,
            cost: Mapping[str, float], now: float) -> tuple[str | None, float]:
        """The key a request with this cost may take now, and 0.0; else None and how long until the earliest
        of its windows has room (inf: no key has a slot free to wait for).

        ``pinned`` is a key of ``pool`` with a slot free that the request must have; without it, among the
        pool's keys with a slot free, only those whose windows have room are candidates (``preferred``, the
        conversation's previous key, first, as ``policy.choose_key`` chooses).
        """
        book = self.book
        if not pool:
            return None, book.wait_for(None, group, cost, now)
        if pinned is not None:
            return pinned, book.wait_for(pinned, group, cost, now)
        candidates: list[tuple[str, int | None]] = []
        wait = math.inf
        for level in pool:
            if not level.has_room():
                continue
            name = level.key.key or ""
            key_wait = book.wait_for(name, group, cost, now)
            if key_wait <= 0:
                candidates.append((name, level.free_slots()))
            elif key_wait < wait:
                wait = key_wait
        if candidates:
            return policy.choose_key(candidates, preferred), 0.0
        return None, wait

    def hold(self, waiter: Waiter, pool: Sequence[LimitLevel], wait: float, now: float) -> None:
        """A head its windows hold for ``wait`` seconds: note which, counting it once on each, and when the
        queue must look again."""
        book, cost, group = self.book, waiter.cost, waiter.group or OTHER_GROUP
        assert cost is not None
        if not pool or waiter.key is not None:
            held = book.blocked_by(waiter.key if pool else None, group, cost, now)
        else:
            held = [window for level in pool if level.has_room()
                    for window in book.blocked_by(level.key.key or "", group, cost, now)]
        book.count_held(window for window in held if window not in waiter.held_by)
        waiter.held_by = tuple(held)
        self.blocked.update(held)
        if wait < math.inf and (self.wake is None or now + wait < self.wake):
            self.wake = now + wait

    def admits(self, waiter: Waiter, pool: Sequence[LimitLevel], key: str | None, wait: float, now: float) -> bool:
        """Whether a head ``fit`` found ``wait`` seconds from room (on ``key``) may go now: not while its windows
        hold it (``hold``), nor while it needs a window an earlier head is held by (it waits its turn)."""
        if wait > 0:
            self.hold(waiter, pool, wait, now)
            return False
        blocked = self.blocked
        if not blocked:
            return True
        assert waiter.cost is not None
        group = waiter.group or OTHER_GROUP
        owner = key if pool else None
        return not any(amount and (owner, group, name) in blocked for name, amount in waiter.cost.items())

    def arm(self) -> None:
        """One timer for the held heads, at the earliest time one of them will have room (a timer already set
        earlier stays: when it fires, the queue looks again and this sets the next one)."""
        when = self.wake
        if when is None or (self._timer is not None and self._timer_at <= when):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._clock.call_later(when - self._clock.time(), self._refilled)

    def _refilled(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._on_room()

    def take(self, lease: Lease, key: str | None, group: str | None, cost: Mapping[str, float]) -> None:
        group = group or OTHER_GROUP
        self.book.take(key, group, cost, lease.granted_at)
        lease.cost, lease.group = cost, group

    def ended(self, lease: Lease) -> None:
        if lease.cost is not None and lease.group is not None:
            self.book.ended(lease.key, lease.group, lease.cost)

    def recost(self, group: str) -> int:
        """The estimates of model ``group`` moved (``providers.recost``, the rule): each of its waiters the
        shell can cost again (``Waiter.recost``) takes its fresh cost in place, up or down. The queue's order is
        (starred, prompt start, arrival), never the cost, so no heap moves: O(the group's waiters), and acquire
        and release stay O(log n). Admission is looked at again at once, in queue order: a held head whose
        cost dropped may go now, and the waiters behind it after it. Returns how many costs changed."""
        changed = 0
        for waiter in self._queue.of_group(group):
            recost = waiter.recost
            if recost is None or not waiter.queued:  # one taken out by an earlier one's estimate is left alone
                continue
            fresh = recost()
            if fresh and fresh != waiter.cost:
                waiter.cost = fresh
                changed += 1
        if changed:
            self._on_room()
        return changed

    # ----- what answers say ------------------------------------------------------------

    def settle_windows(self, lease: Lease, actual: Mapping[str, float], rules: Mapping[str, str],
                       admitted: Mapping[str, float] | None = None) -> None:
        """Reconcile the windows a request took from with the usage its answer reported (once per lease):
        ``actual`` is what each window counted, ``rules`` how it is reconciled (``window.SETTLE_RULES``),
        ``admitted`` what the provider charged each when it admitted the request (``WindowBook.settle``).
        A window the answer reported nothing for keeps its estimate."""
        cost, group = lease.cost, lease.group
        if cost is None or group is None or lease.windows_settled:
            return
        lease.windows_settled = True
        now = self._clock.time()
        room = False
        for window, charged in cost.items():
            if window in actual and window in rules:
                room = self.book.settle(lease.key, group, window, charged, actual[window], rules[window], now,
                                        granted_at=lease.granted_at,
                                        admitted=None if admitted is None else admitted.get(window)) or room
        if room:
            self._on_room()

    def report_window_hit(self, key: str | None, group: str | None, window: str, until: float,
                          then: float = 0.0) -> None:
        """A 429 named this window: it is emptied until ``until``, when it holds ``then``; the slots' limit is
        not touched."""
        self.book.hit(key, group or OTHER_GROUP, window, until, self._clock.time(), then)

    def report_window_limits(self, key: str | None, group: str | None, limits: Mapping[str, int]) -> None:
        """The limits an answer's headers announced for the windows of (key, group) (with ``learn``)."""
        now = self._clock.time()
        changed = False
        for window, limit in limits.items():
            changed = self.book.learn(key, group or OTHER_GROUP, window, limit, now) or changed
        if changed:
            self._on_room()

    def report_window_remaining(self, key: str | None, group: str | None, remaining: Mapping[str, float],
                                answered_at: float) -> None:
        """What an answer at ``answered_at`` said was left: the room believed is never more than that, less
        what was sent since."""
        self.book.correct_all(key, group or OTHER_GROUP, remaining, self._clock.time(), answered_at)

    def beyond_windows(self, lease: Lease) -> list[str]:
        """The windows ``lease``'s cost exceeds whole: a window 429 on such a request is relayed, not retried."""
        if lease.cost is None or lease.group is None:
            return []
        return self.book.beyond_capacity(lease.key, lease.group, lease.cost, self._clock.time())

    def window_limits(self, key: str | None, group: str | None) -> dict[str, int]:
        """The window limits in force for (key, group): which windows a request's cost must name."""
        return self.book.limits_for(key, group or OTHER_GROUP)

    # ----- observing -------------------------------------------------------------

    def status(self, queue: ClassedQueue, now: float) -> Callable[[str | None], tuple[dict[str, Any], ...]]:
        """The windows of a key (None: the provider's own), as status shows them, with the waiters each holds
        now: every waiter of a class whose head it holds."""
        holding: dict[WindowId, int] = {}
        for head, waiting in queue.held_heads():
            for window in head.held_by:
                holding[window] = holding.get(window, 0) + waiting
        book = self.book

        def windows(key: str | None) -> tuple[dict[str, Any], ...]:
            return tuple(book.status(key, now=now, holding=holding))
        return windows
