"""One provider's limiter: slots, waiters, pause, auto-reduction, cooldown and watchdog.

This is the pure core. It decides who gets a slot and when; it never awaits. The
shell (a backend) parks callers on futures and passes ``on_grant`` callbacks in.
Time comes from an injected :class:`~proxy.limiter.clock.Clock`, so every decision
here can be replayed on fake time.

A slot is taken at every level that applies, at once or not at all: the
provider's limit, the model cap the request's model matches, and one key of the
pool. The queue is one priority order, kept as one heap per *class* of waiter
(its model cap, and its workspace when ``max_share`` is set; ``queue.ClassedQueue``):
a waiter whose cap is full never holds up a waiter of another class behind it.
Each grant looks at the head of each class only, so it costs O(classes + log n).

With token windows, a request also takes its cost from every window of its key and model group at once
(``windowed``); its group joins its class, so a head a window holds never holds back another group.

Its settings and the lease it grants are in ``lease``; what it reports, in ``status``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ProxyError, QueueFull, QueueTimeout, UnknownLimit
from . import policy
from .clock import Clock
from .deadlines import Deadlines
from .holding import holder_words, what_holds
from .lease import AdmissionGate, Lease, LimiterSettings
from .level import Budget, LimitLevel
from .policy import QUEUE_LISTED, LimitKey, StickyKeys
from .queue import ClassedQueue, Priority, Waiter, WaiterClass, reject_all
from .status import (
    ModelStatus,
    ProviderStatus,
    WaiterStatus,
    budget_of,
    holder_statuses,
    key_status,
    ms,
    waiter_statuses,
)
from .watchdog import SlotWatchdog
from .window import OTHER_GROUP
from .windowed import ProviderWindows

__all__ = ["ProviderLimiter"]

log = logging.getLogger("slotproxy.limiter")


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
        self._waiting = ClassedQueue()
        self._deadlines: Deadlines[Waiter] = Deadlines(clock, self._expire)
        self._arrivals = itertools.count()
        self._dispatching = False
        self._active: SlotWatchdog[Lease] = SlotWatchdog(clock, self._reclaim, settings.slot_timeout)
        """The held leases, in grant order, under the watchdog."""
        self._by_workspace: dict[str, int] = {}
        self._sticky = StickyKeys()
        self.gate: AdmissionGate | None = None
        self.on_change: Callable[[], None] | None = None
        self.counters = {"granted": 0, "queue_full": 0, "queue_timeouts": 0, "reclaims": 0}
        self.level = LimitLevel(LimitKey(name), settings, clock, on_room=self._dispatch, on_change=self._changed)
        """The provider's own limit. Every slot is counted here, and at its key and model levels."""
        self._keys: dict[str, LimitLevel] = {}
        self._pool: tuple[LimitLevel, ...] = ()
        self._models: dict[str, LimitLevel] = {}
        self._patterns: tuple[str, ...] = ()
        self._build_levels(settings)
        self._windows = ProviderWindows.reloaded(None, settings.windows, clock, self._dispatch, self._waiting)

    def _build_levels(self, settings: LimiterSettings) -> None:
        """Key and model levels for these settings; a level that stays keeps its state (a changed YAML
        limit is a manual change, as at the provider's level)."""
        def level_for(old: dict[str, LimitLevel], name: str, limit: int | None, key: LimitKey) -> LimitLevel:
            level = old.get(name)
            if level is None:
                return LimitLevel(key, settings.level_settings(limit), self._clock,
                                  on_room=self._dispatch, on_change=self._changed)
            level.apply_settings(settings.level_settings(limit))
            return level

        self._keys = {key.name: level_for(self._keys, key.name, key.limit, LimitKey(self.name, key=key.name))
                      for key in settings.keys}
        self._pool = tuple(self._keys[key.name] for key in settings.pool())
        self._models = {cap.pattern: level_for(self._models, cap.pattern, cap.limit,
                                               LimitKey(self.name, model=cap.pattern))
                        for cap in settings.models}
        self._patterns = tuple(self._models)

    # ----- admission -------------------------------------------------------------

    def next_arrival(self) -> int:
        """An arrival number; a retried request keeps its first one, and so its place."""
        return next(self._arrivals)

    def try_acquire(self, priority: Priority, seq: int | None = None, model: str | None = None,
                    key: str | None = None, cost: Mapping[str, float] | None = None,
                    group: str | None = None) -> Lease | None:
        """The fast path: a slot now, or None when the caller must queue.

        Nobody may overtake a waiter, so a non-empty queue always means None (``enqueue``
        then grants at once whoever may go, a request for a model with room among them).
        ``key`` pins the slot to that key of the pool (ignored without a pool). ``cost`` is what the
        request takes from the windows of its model ``group`` (ignored when no window is held).
        """
        if self._waiting.count or not self._provider_room():
            return None
        pattern = policy.model_pattern(model, self._patterns) if self._patterns else None
        if pattern is not None and not self._models[pattern].has_room():
            return None
        if cost and self._windows is not None:
            if self._pool and key is not None and not self._pinned_room(key):
                return None
            key, wait = self._windows.fit(self._pool, key if self._pool else None,
                                          self._sticky.get(priority.conversation), group or OTHER_GROUP, cost,
                                          self._clock.time())
            if wait > 0:
                return None
        elif self._pool:
            key = (key if self._pinned_room(key) else None) if key is not None \
                else self._choose_key(priority.conversation)
            if key is None:
                return None
        else:
            key = None
        lease = self._grant(priority, self.next_arrival() if seq is None else seq, 0.0, pattern, key, cost, group)
        lease.model = model
        lease.starred = priority.starred or priority.workspace in self._starred
        return lease

    def _pinned_room(self, key: str) -> bool:
        """Whether a waiter pinned to ``key`` may go: the key is in the pool and has a slot free."""
        level = self._keys.get(key)
        return level is not None and level in self._pool and level.has_room()

    def socket_key(self, conversation: str | None) -> str | None:
        """The key a new WebSocket opens with (``policy.socket_key``); None without a pool."""
        if not self._pool:
            return None
        with_room = [(level.key.key or "", level.free_slots()) for level in self._pool if level.has_room()]
        unblocked = [level.key.key or "" for level in self._pool if level.available_at() is None]
        return policy.socket_key(with_room, unblocked, [level.key.key or "" for level in self._pool],
                                 self._sticky.get(conversation))

    def enqueue(
        self,
        priority: Priority,
        on_grant: Callable[[Lease], None],
        on_reject: Callable[[ProxyError], None] | None = None,
        seq: int | None = None,
        client_wait: float | None = None,
        model: str | None = None,
        key: str | None = None,
        cost: Mapping[str, float] | None = None,
        group: str | None = None,
    ) -> Waiter:
        """Queue a request; ``on_grant(lease)`` is called when its turn comes (on ``key`` when given, a key
        of the pool, with ``cost`` taken from the windows of its model ``group``).

        ``on_reject(error)`` is called instead if it times out (QueueTimeout: after
        queue_timeout, or ``client_wait`` when that is shorter) or the queue is shed
        (shutdown). Raises QueueFull when ``max_queue`` waiters are already queued,
        ``client_wait`` that leaves no time to wait at all times out at once, unless the
        request is granted at once.
        """
        if self._waiting.count >= self._settings.max_queue:
            self.counters["queue_full"] += 1
            log.warning("provider=%s queue full (%d waiting): request refused", self.name, self._waiting.count)
            raise QueueFull(
                f"slotproxy queue for provider '{self.name}' is full ({self._settings.max_queue} waiting); retry later",
                retry_after=self._retry_after_hint(),
            )
        now = self._clock.time()
        if client_wait is None:  # the policy's answer without a client deadline, without the call
            limit, client_bound = self._settings.queue_timeout, False
        else:
            limit, client_bound = policy.queue_wait_limit(self._settings.queue_timeout, client_wait)
        pattern = policy.model_pattern(model, self._patterns) if self._patterns else None
        waiter = Waiter(
            priority=priority,
            seq=self.next_arrival() if seq is None else seq,
            enqueued_at=now,
            on_grant=on_grant,
            on_reject=on_reject,
            starred=priority.starred or priority.workspace in self._starred,
            client_bound=client_bound,
            pattern=pattern,
            key=key if self._pool else None,
            model=model,
            cost=cost or None,
            group=(group or OTHER_GROUP) if cost else None,
        )
        self._push(waiter)
        if limit is not None and limit > 0:
            self._deadlines.add(waiter, now + limit)
        self._dispatch()
        if waiter.queued:
            waiter.holder = what_holds(self, waiter)
            if limit is not None and limit <= 0:
                self._expire(waiter)
            elif self.gate is not None:
                self.gate.request_poll()
        return waiter

    def _class_of(self, waiter: Waiter) -> WaiterClass:
        group = waiter.group if waiter.cost is not None and self._windows is not None else None
        if not self._settings.classed() and waiter.key is None and group is None:
            return None
        return (waiter.pattern, waiter.priority.workspace if self._settings.max_share is not None else None,
                waiter.key, group)

    def _push(self, waiter: Waiter) -> None:
        self._waiting.push(waiter, self._class_of(waiter))

    def cancel(self, waiter: Waiter) -> None:
        """The waiter's client left: take it out of the queue; it is never granted."""
        if self._waiting.remove(waiter):
            waiter.forget_callbacks()
            self._deadlines.settle(self._waiting.count)

    def _expire(self, waiter: Waiter) -> None:
        if not self._waiting.remove(waiter):
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
        self._deadlines.clear()
        return reject_all(self._waiting.take_all(), error)

    def reject_waiters(self, workspace: str, error: ProxyError) -> int:
        """Reject every waiter of ``workspace`` at once (its spend cap reached); returns how many there were."""
        rejected = reject_all(self._waiting.take_workspace(workspace), error)
        self._dispatch()  # a head it held (a window, a share) may have kept one that can go now behind it
        return rejected

    def _retry_after_hint(self) -> float:
        return policy.retry_after_hint(self._clock.time(), self._paused_until())

    # ----- granting --------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self.level.in_flight

    @property
    def limit(self) -> int | None:
        return self.level.limit

    @property
    def queued(self) -> int:
        return self._waiting.count

    def paused(self) -> bool:
        return self._paused_until() is not None

    def _paused_until(self) -> float | None:
        """The provider's pause; with a pool, also the earliest end while every key is paused or held."""
        return policy.pool_paused_until(self.level.paused_until, [level.available_at() for level in self._pool])

    def _provider_room(self) -> bool:
        return self.level.has_room() and (self.gate is None or self.gate.admits())

    def _choose_key(self, conversation: str | None) -> str | None:
        candidates = [(level.key.key or "", level.free_slots()) for level in self._pool if level.has_room()]
        return policy.choose_key(candidates, self._sticky.get(conversation))

    def _capacity(self) -> int | None:
        """The slots a share is taken of: the provider's limit, else its keys' together."""
        if self.level.limit is not None or not self._pool:
            return self.level.limit
        total = 0
        for level in self._pool:
            if level.limit is None:
                return None
            total += level.limit
        return total

    def _next_grant(self) -> tuple[Waiter, str | None] | None:
        """The first waiter, in queue order over the class heads, that every level and window it needs has
        room for.

        With ``max_share``, a waiter whose workspace holds its share is passed over while one of another
        workspace can go; when none can, it goes (the limit is never left idle).
        """
        windows = self._windows
        if windows is not None:
            windows.wake = None
            windows.blocked.clear()
        if not self._provider_room():
            return None
        if self._pool and not any(level.has_room() for level in self._pool):
            return None
        heads = self._waiting.heads()
        cap = policy.share_cap(self._settings.max_share, self._capacity())
        over_share: tuple[Waiter, str | None] | None = None
        for _, waiter in heads:
            pattern = waiter.pattern
            if pattern is not None:
                model = self._models.get(pattern)
                if model is not None and not model.has_room():
                    continue
            if waiter.key is not None and not self._pinned_room(waiter.key):
                continue
            key = waiter.key
            if windows is not None and waiter.cost is not None:
                now = self._clock.time()
                key, wait = windows.fit(self._pool, waiter.key, self._sticky.get(waiter.priority.conversation),
                                        waiter.group or OTHER_GROUP, waiter.cost, now)
                if not windows.admits(waiter, self._pool, key, wait, now):
                    continue
            if cap is not None and self._by_workspace.get(waiter.priority.workspace, 0) >= cap:
                if over_share is None:
                    over_share = waiter, key
                continue
            break
        else:
            if over_share is None:
                return None
            waiter, key = over_share
        if not self._pool:
            return waiter, None
        return waiter, key or self._choose_key(waiter.priority.conversation)

    def _grant(self, priority: Priority, seq: int, queue_wait: float, pattern: str | None,
               key: str | None, cost: Mapping[str, float] | None = None, group: str | None = None) -> Lease:
        now = self._clock.time()
        lease = Lease(self, priority, seq, granted_at=now, queue_wait=queue_wait)
        if cost and self._windows is not None:
            self._windows.take(lease, key, group, cost)
        self.level.take()
        levels: tuple[LimitLevel, ...] = ()
        if key is not None:
            lease.key = key
            levels = (self._keys[key],)
            self._sticky.remember(priority.conversation, key)
        if pattern is not None and (model := self._models.get(pattern)) is not None:
            levels += (model,)
        for level in levels:
            level.take()
        lease._levels = levels
        workspace = priority.workspace
        self._by_workspace[workspace] = self._by_workspace.get(workspace, 0) + 1
        self._active.hold(lease)
        self.counters["granted"] += 1
        if self.gate is not None:
            self.gate.admitted()
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
            while self._waiting.count:
                chosen = self._next_grant()
                if chosen is None:
                    break
                waiter, key = chosen
                self._waiting.pop_head(waiter)
                on_grant = waiter.on_grant
                waiter.forget_callbacks()
                lease = self._grant(waiter.priority, waiter.seq, self._clock.time() - waiter.enqueued_at,
                                    waiter.pattern, key, waiter.cost, waiter.group)
                lease.model, lease.starred, lease.holder = waiter.model, waiter.starred, holder_words(waiter)
                if on_grant is not None:
                    on_grant(lease)
        finally:
            self._dispatching = False
            self._deadlines.settle(self._waiting.count)
            if self._windows is not None and self._waiting.count:
                self._windows.arm()

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
        self._active.drop(lease)
        workspace = lease.priority.workspace
        held = self._by_workspace[workspace] - 1
        if held:
            self._by_workspace[workspace] = held
        else:
            del self._by_workspace[workspace]
        if self.gate is not None:
            self.gate.request_poll()
        if lease.cost is not None and self._windows is not None:
            self._windows.ended(lease)
        free_now = self.level.give_back()
        for level in lease._levels:
            level.give_back()
        if free_now and self._waiting.count:
            self._dispatch()

    # ----- backoff and budgets ---------------------------------------------------------

    def report_backoff(self, cause: str, wait: float | None = None, *, sent_at: float | None = None,
                       reduce: bool = True, key: str | None = None) -> None:
        """Upstream said "slow down": the level that answered (the key it was sent with, else the provider)
        pauses, and lowers its limit once per burst when ``reduce`` (a status in ``reduce_statuses``; an
        overload only pauses).

        ``sent_at`` is when the reporting request was granted. A request granted
        before the latest reduction belongs to the burst that caused it, so its
        429 extends the pause but does not lower the limit again.
        """
        level = self._level_for_key(key)
        if level is not None:
            level.report_backoff(cause, wait, sent_at=sent_at, reduce=reduce)

    def report_budget(self, budget: Budget, key: str | None = None) -> None:
        """The provider's rate-limit headers on an answer sent with ``key`` (None: the provider's own)."""
        level = self._level_for_key(key)
        if level is not None:
            level.report_budget(budget)

    @property
    def windows(self) -> ProviderWindows | None:
        """Its token windows, which answers report to (None: it holds none)."""
        return self._windows

    def _level_for_key(self, key: str | None) -> LimitLevel | None:
        """A key's level; a key the config has dropped since the request was sent has none."""
        return self.level if key is None else self._keys.get(key)

    # ----- control ---------------------------------------------------------------

    def set_limit(self, limit: int | None) -> None:
        """A manual limit (admin API or a YAML edit): applies at once and clears any auto-reduction."""
        self.level.set_limit(limit)

    def set_key_limit(self, key: str, limit: int | None) -> None:
        self._named(self._keys, key, "key").set_limit(limit)

    def set_model_limit(self, pattern: str, limit: int | None) -> None:
        self._named(self._models, pattern, "model cap").set_limit(limit)

    def _named(self, levels: dict[str, LimitLevel], name: str, what: str) -> LimitLevel:
        level = levels.get(name)
        if level is None:
            raise UnknownLimit(f"provider '{self.name}' has no {what} '{name}' (configured: "
                               f"{', '.join(levels) or 'none'})")
        return level

    def set_cooldown(self, seconds: float) -> None:
        self.level.set_cooldown(seconds)

    def set_starred(self, workspaces: frozenset[str]) -> None:
        """Change the starred set; waiters already queued move to their new place."""
        if workspaces == self._starred:
            return
        self._starred = frozenset(workspaces)
        self._waiting.restar(self._starred)

    def apply_settings(self, settings: LimiterSettings) -> None:
        """A config reload. A changed YAML limit or cooldown counts as a manual change.

        A changed queue_timeout applies to requests queued from now on. A waiter keeps the
        model cap it matched when it came; a cap the reload removed no longer holds it.
        """
        old, self._settings = self._settings, settings
        self._build_levels(settings)
        self._windows = ProviderWindows.reloaded(self._windows, settings.windows, self._clock, self._dispatch, self._waiting)
        if (old.windows is None) != (settings.windows is None) or (old.classed(), old.max_share is None) != (settings.classed(),
                                                                         settings.max_share is None):
            self._reclassify()
        self.level.apply_settings(settings)
        self._active.set_timeout(settings.slot_timeout)

    def _reclassify(self) -> None:
        for waiter in self._waiting.take_all():
            waiter.queued = True
            self._push(waiter)

    def export_state(self) -> dict[str, Any]:
        state = self.level.export_state()
        if self._keys:
            state["keys"] = {name: level.export_state() for name, level in self._keys.items()}
        if self._models:
            state["models"] = {name: level.export_state() for name, level in self._models.items()}
        return state

    def restore_state(self, state: dict[str, Any]) -> None:
        """Apply persisted runtime state over the config (see ``LimitLevel.restore_state``)."""
        self.level.restore_state(state)
        for field_name, levels in (("keys", self._keys), ("models", self._models)):
            saved = state.get(field_name)
            if isinstance(saved, dict):
                for name, entry in saved.items():
                    if name in levels and isinstance(entry, dict):
                        levels[name].restore_state(entry)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ----- observing -------------------------------------------------------------

    def statistics(self, *, queue_detail: bool = True) -> ProviderStatus:
        """The status snapshot; the queue listing holds the next ``QUEUE_LISTED`` waiters at most."""
        now = self._clock.time()
        queue: tuple[WaiterStatus, ...] = waiter_statuses(self._waiting.in_order(QUEUE_LISTED), now) if queue_detail else ()
        level = self.level
        paused_until = self._paused_until()
        counters = {**self.counters, **level.counters}
        for sub in (*self._keys.values(), *self._models.values()):
            for name, count in sub.counters.items():
                counters[name] += count
        budgets = self._settings.budgets
        pool = set(self._pool)
        windows = None if self._windows is None else self._windows.status(self._waiting, now)
        return ProviderStatus(
            provider=self.name,
            limit=level.limit,
            configured_limit=level.configured_limit,
            in_flight=level.in_flight,
            queued=self._waiting.count,
            paused=paused_until is not None,
            paused_until=None if paused_until is None else ms(paused_until),
            cooldown_ms=ms(level.cooldown),
            auto_reduced=level.auto_reduced_from is not None,
            auto_reduced_from=level.auto_reduced_from,
            notice=level.notice,
            queue=queue,
            counters=counters,
            usage=self.gate.status() if self.gate is not None else None,
            keys=tuple(key_status(name, key, key in pool, budgets, None if windows is None else windows(name))
                       for name, key in self._keys.items()),
            models=tuple(ModelStatus(pattern, cap.limit, cap.configured_limit, cap.in_flight)
                         for pattern, cap in self._models.items()),
            budget=budget_of(level) if budgets and not self._pool else None,
            holders=holder_statuses(itertools.islice(self._active, QUEUE_LISTED), now) if queue_detail else (),
            windows=windows(None) if windows is not None and not self._pool else None,
        )
