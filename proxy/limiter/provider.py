"""One provider's limiter: slots, waiters, pause, auto-reduction, cooldown and watchdog.

This is the pure core. It decides who gets a slot and when; it never awaits. The
shell (a backend) parks callers on futures and passes ``on_grant`` callbacks in.
Time comes from an injected :class:`~proxy.limiter.clock.Clock`, so every decision
here can be replayed on fake time.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import ProxyError, QueueFull, QueueTimeout
from . import policy
from .clock import Clock, Timer
from .deadlines import Deadlines
from .level import LimitLevel
from .policy import QUEUE_LISTED, LimitKey
from .queue import Priority, Waiter, WaiterQueue

__all__ = [
    "AdmissionGate",
    "Lease",
    "LimiterSettings",
    "ProviderLimiter",
    "ProviderStatus",
    "SlotLease",
    "WaiterStatus",
]

log = logging.getLogger("slotproxy.limiter")

@dataclass(frozen=True, slots=True)
class LimiterSettings:
    limit: int | None = None
    release_cooldown: float = 0.0
    default_pause: float = 30.0
    overload_pause: float = 5.0
    slot_timeout: float | None = 900.0
    queue_timeout: float | None = 600.0
    max_queue: int = 10_000
    recovery_after: float | None = None


class AdmissionGate(Protocol):
    """An extra admission condition beyond the limit (the usage gate)."""

    def admits(self) -> bool:
        """May one more request be admitted now?"""

    def admitted(self) -> None:
        """One request was just admitted."""

    def request_poll(self) -> None:
        """Something changed (a release, a new waiter): look at upstream again."""

    def status(self) -> dict[str, object]: ...


class SlotLease(Protocol):
    """What the relay needs of a held slot, whichever backend granted it."""

    priority: Priority
    seq: int
    granted_at: float
    queue_wait: float
    reclaimed: bool
    on_reclaim: Callable[[], None] | None

    def release(self) -> None: ...

    def headers_received(self) -> None: ...


class Lease:
    """A held slot. ``release()`` may be called any number of times; only the first counts."""

    __slots__ = (
        "_limiter",
        "_watchdog",
        "granted_at",
        "headers_at",
        "on_reclaim",
        "priority",
        "queue_wait",
        "reclaimed",
        "released",
        "seq",
    )

    def __init__(
        self, limiter: ProviderLimiter, priority: Priority, seq: int, granted_at: float, queue_wait: float
    ) -> None:
        self._limiter = limiter
        self.priority = priority
        self.seq = seq
        self.granted_at = granted_at
        self.queue_wait = queue_wait
        self.on_reclaim: Callable[[], None] | None = None
        self.headers_at: float | None = None
        self.released = False
        self.reclaimed = False
        self._watchdog: Timer | None = None

    def release(self) -> None:
        self._limiter._release(self)

    def headers_received(self) -> None:
        """Upstream answered with headers: from now on its usage count includes this request."""
        self.headers_at = self._limiter._clock.time()


@dataclass(frozen=True, slots=True)
class WaiterStatus:
    workspace: str
    starred: bool
    prompt_started_at: int
    waited_ms: int
    conversation: str | None


@dataclass(frozen=True, slots=True)
class ProviderStatus:
    """Everything observable about one provider, read from one snapshot."""

    provider: str
    limit: int | None
    configured_limit: int | None
    in_flight: int
    queued: int
    paused: bool
    paused_until: int | None
    cooldown_ms: int
    auto_reduced: bool
    auto_reduced_from: int | None
    notice: str | None
    queue: tuple[WaiterStatus, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    usage: dict[str, object] | None = None
    local_in_flight: int | None = None
    """Slots held by this replica, where slots are shared by several (the Redis backend)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "limit": self.limit,
            "configured_limit": self.configured_limit,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "paused": self.paused,
            "paused_until": self.paused_until,
            "cooldown_ms": self.cooldown_ms,
            "auto_reduced": self.auto_reduced,
            "auto_reduced_from": self.auto_reduced_from,
            "notice": self.notice,
            "queue": [
                {
                    "workspace": w.workspace,
                    "starred": w.starred,
                    "prompt_started_at": w.prompt_started_at,
                    "waited_ms": w.waited_ms,
                    "conversation": w.conversation,
                }
                for w in self.queue
            ],
            "usage": self.usage,
            "rejected": {
                "queue_full": self.counters.get("queue_full", 0),
                "queue_timeout": self.counters.get("queue_timeouts", 0),
            },
            **({} if self.local_in_flight is None else {"local_in_flight": self.local_in_flight}),
        }


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class ProviderLimiter:
    def __init__(
        self,
        name: str,
        settings: LimiterSettings,
        clock: Clock,
        *,
        starred: frozenset[str] = frozenset(),
    ) -> None:
        self.name = name
        self._clock = clock
        self._settings = settings
        self._starred = frozenset(starred)
        self._queue = WaiterQueue()
        self._deadlines: Deadlines[Waiter] = Deadlines(clock, self._expire)
        self._arrivals = itertools.count()
        self._dispatching = False
        self._active: set[Lease] = set()
        self.gate: AdmissionGate | None = None
        self.on_change: Callable[[], None] | None = None
        self.counters = {"granted": 0, "queue_full": 0, "queue_timeouts": 0, "reclaims": 0}
        self.level = LimitLevel(LimitKey(name), settings, clock, on_room=self._dispatch, on_change=self._changed)
        """The provider's own limit. Every slot is counted here, and at each of ``_more_levels``."""
        self._more_levels: tuple[LimitLevel, ...] = ()

    # ----- admission -------------------------------------------------------------

    def next_arrival(self) -> int:
        """An arrival number; a retried request keeps its first one, and so its place."""
        return next(self._arrivals)

    def try_acquire(self, priority: Priority, seq: int | None = None) -> Lease | None:
        """The fast path: a slot now, or None when the caller must queue.

        Nobody may overtake a waiter, so a non-empty queue always means None.
        """
        if len(self._queue) or not self._may_grant():
            return None
        return self._grant(priority, self.next_arrival() if seq is None else seq, queue_wait=0.0)

    def enqueue(
        self,
        priority: Priority,
        on_grant: Callable[[Lease], None],
        on_reject: Callable[[ProxyError], None] | None = None,
        seq: int | None = None,
        client_wait: float | None = None,
    ) -> Waiter:
        """Queue a request; ``on_grant(lease)`` is called when its turn comes.

        ``on_reject(error)`` is called instead if it times out (QueueTimeout: after
        queue_timeout, or ``client_wait`` when that is shorter) or the queue is shed
        (shutdown). Raises QueueFull when ``max_queue`` waiters are already queued,
        and QueueTimeout when ``client_wait`` leaves it no time to wait at all.
        """
        if len(self._queue) >= self._settings.max_queue:
            self.counters["queue_full"] += 1
            log.warning("provider=%s queue full (%d waiting): request refused", self.name, len(self._queue))
            raise QueueFull(
                f"slotproxy queue for provider '{self.name}' is full ({self._settings.max_queue} waiting); retry later",
                retry_after=self._retry_after_hint(),
            )
        now = self._clock.time()
        if client_wait is None:  # the policy's answer without a client deadline, without the call
            limit, client_bound = self._settings.queue_timeout, False
        else:
            limit, client_bound = policy.queue_wait_limit(self._settings.queue_timeout, client_wait)
        if limit is not None and limit <= 0:
            self.counters["queue_timeouts"] += 1
            raise QueueTimeout(policy.queue_timeout_message(self.name, self._settings.queue_timeout, client_bound),
                               retry_after=self._retry_after_hint())
        waiter = Waiter(
            priority=priority,
            seq=self.next_arrival() if seq is None else seq,
            enqueued_at=now,
            on_grant=on_grant,
            on_reject=on_reject,
            starred=priority.starred or priority.workspace in self._starred,
            client_bound=client_bound,
        )
        self._queue.push(waiter)
        if limit is not None:
            self._deadlines.add(waiter, now + limit)
        self._dispatch()
        if waiter.queued and self.gate is not None:
            self.gate.request_poll()
        return waiter

    def cancel(self, waiter: Waiter) -> None:
        """The waiter's client left: take it out of the queue; it is never granted."""
        if self._queue.remove(waiter):
            waiter.forget_callbacks()
            self._deadlines.settle(len(self._queue))

    def _expire(self, waiter: Waiter) -> None:
        if not self._queue.remove(waiter):
            return
        on_reject = waiter.on_reject
        waiter.forget_callbacks()
        self.counters["queue_timeouts"] += 1
        log.warning(
            "provider=%s request from workspace=%s timed out after %.1fs in the queue",
            self.name, waiter.priority.workspace, self._clock.time() - waiter.enqueued_at,
        )
        if on_reject is not None:
            on_reject(QueueTimeout(policy.queue_timeout_message(self.name, self._settings.queue_timeout,
                                                                waiter.client_bound),
                                   retry_after=self._retry_after_hint()))

    def shed(self, error: ProxyError) -> int:
        """Reject every waiter (graceful shutdown); returns how many there were."""
        count = 0
        self._deadlines.clear()
        while (waiter := self._queue.pop()) is not None:
            count += 1
            on_reject = waiter.on_reject
            waiter.forget_callbacks()
            if on_reject is not None:
                on_reject(error)
        return count

    def _retry_after_hint(self) -> float:
        return self.level.retry_after_hint()

    # ----- granting --------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self.level.in_flight

    @property
    def limit(self) -> int | None:
        return self.level.limit

    @property
    def queued(self) -> int:
        return len(self._queue)

    def paused(self) -> bool:
        return self.level.paused_until is not None

    def _may_grant(self) -> bool:
        """Room at every level at once, and the usage gate (if any) agrees."""
        if not self.level.has_room():
            return False
        for level in self._more_levels:
            if not level.has_room():
                return False
        return self.gate is None or self.gate.admits()

    def _grant(self, priority: Priority, seq: int, queue_wait: float) -> Lease:
        now = self._clock.time()
        lease = Lease(self, priority, seq, granted_at=now, queue_wait=queue_wait)
        self.level.take()
        for level in self._more_levels:
            level.take()
        self._active.add(lease)
        self.counters["granted"] += 1
        if self.gate is not None:
            self.gate.admitted()
        if self._settings.slot_timeout is not None:
            lease._watchdog = self._clock.call_later(self._settings.slot_timeout, lambda: self._reclaim(lease))
        return lease

    def _dispatch(self) -> None:
        """Grant waiters in order while there is room.

        A grant callback may release its lease at once (its client left in the
        same instant); that re-enters here, so re-entry just returns and lets the
        outer loop, which re-checks the room on every turn, carry on.
        """
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while len(self._queue) and self._may_grant():
                waiter = self._queue.pop()
                if waiter is None:
                    break
                on_grant = waiter.on_grant
                waiter.forget_callbacks()
                lease = self._grant(waiter.priority, waiter.seq, queue_wait=self._clock.time() - waiter.enqueued_at)
                if on_grant is not None:
                    on_grant(lease)
        finally:
            self._dispatching = False
            self._deadlines.settle(len(self._queue))

    def dispatch(self) -> None:
        """Grant whoever may go now (after a usage poll answered, say)."""
        self._dispatch()

    def unseen_since(self, sent_at: float) -> int:
        """Held slots a usage figure measured at ``sent_at`` may not include yet."""
        return sum(
            1 for lease in self._active
            if lease.granted_at > sent_at or lease.headers_at is None or lease.headers_at > sent_at
        )

    # ----- releasing -------------------------------------------------------------

    def _release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        if lease._watchdog is not None:
            lease._watchdog.cancel()
        self._free_slot(lease)

    def _reclaim(self, lease: Lease) -> None:
        """The watchdog: a slot held past slot_timeout is taken back and its holder told to abort."""
        if lease.released:
            return
        lease.released = lease.reclaimed = True
        self.counters["reclaims"] += 1
        log.warning(
            "provider=%s watchdog reclaimed a slot held for %.1fs (slot_timeout) from workspace=%s",
            self.name, self._clock.time() - lease.granted_at, lease.priority.workspace,
        )
        if lease.on_reclaim is not None:
            lease.on_reclaim()
        self._free_slot(lease)

    def _free_slot(self, lease: Lease) -> None:
        self._active.discard(lease)
        if self.gate is not None:
            self.gate.request_poll()
        free_now = self.level.give_back()
        for level in self._more_levels:
            free_now &= level.give_back()
        if free_now:
            self._dispatch()

    # ----- backoff ---------------------------------------------------------------

    def report_backoff(self, cause: str, wait: float | None = None, *, sent_at: float | None = None,
                       reduce: bool = True) -> None:
        """Upstream said "slow down": the level that answered pauses, and lowers its limit once per burst
        when ``reduce`` (a status in ``reduce_statuses``; an overload only pauses).

        ``sent_at`` is when the reporting request was granted. A request granted
        before the latest reduction belongs to the burst that caused it, so its
        429 extends the pause but does not lower the limit again.
        """
        self.level.report_backoff(cause, wait, sent_at=sent_at, reduce=reduce)

    # ----- control ---------------------------------------------------------------

    def set_limit(self, limit: int | None) -> None:
        """A manual limit (admin API or a YAML edit): applies at once and clears any auto-reduction."""
        self.level.set_limit(limit)

    def set_cooldown(self, seconds: float) -> None:
        self.level.set_cooldown(seconds)

    def set_starred(self, workspaces: frozenset[str]) -> None:
        """Change the starred set; waiters already queued move to their new place."""
        if workspaces == self._starred:
            return
        self._starred = frozenset(workspaces)
        self._queue.restar(self._starred)

    def apply_settings(self, settings: LimiterSettings) -> None:
        """A config reload. A changed YAML limit or cooldown counts as a manual change.

        A changed queue_timeout applies to requests queued from now on.
        """
        self._settings = settings
        self.level.apply_settings(settings)

    def export_state(self) -> dict[str, Any]:
        return self.level.export_state()

    def restore_state(self, state: dict[str, Any]) -> None:
        """Apply persisted runtime state over the config (see ``LimitLevel.restore_state``)."""
        self.level.restore_state(state)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ----- observing -------------------------------------------------------------

    def statistics(self, *, queue_detail: bool = True) -> ProviderStatus:
        """The status snapshot; the queue listing holds the next ``QUEUE_LISTED`` waiters at most."""
        now = self._clock.time()
        queue: tuple[WaiterStatus, ...] = ()
        if queue_detail:
            queue = tuple(
                WaiterStatus(
                    workspace=w.priority.workspace,
                    starred=w.starred,
                    prompt_started_at=policy.prompt_ms(w.priority.prompt_started_at),
                    waited_ms=_ms(now - w.enqueued_at),
                    conversation=w.priority.conversation,
                )
                for w in self._queue.in_order(QUEUE_LISTED)
            )
        level = self.level
        paused_until = level.paused_until
        return ProviderStatus(
            provider=self.name,
            limit=level.limit,
            configured_limit=level.configured_limit,
            in_flight=level.in_flight,
            queued=len(self._queue),
            paused=paused_until is not None,
            paused_until=None if paused_until is None else _ms(paused_until),
            cooldown_ms=_ms(level.cooldown),
            auto_reduced=level.auto_reduced_from is not None,
            auto_reduced_from=level.auto_reduced_from,
            notice=level.notice,
            queue=queue,
            counters={**self.counters, **level.counters},
            usage=self.gate.status() if self.gate is not None else None,
        )
