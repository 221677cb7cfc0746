"""The memory backend: one process, the limiter core driven by the asyncio loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from ..aio import result_if_any
from ..errors import ProxyError, UnknownProvider
from ..ledger.report import UsageQuery
from ..ledger.store import LedgerRow
from ..limiter import (
    Budget,
    Clock,
    Lease,
    LimiterSettings,
    LoopClock,
    Priority,
    ProviderLimiter,
    ProviderStatus,
    ProviderWindows,
    Recost,
    SlotLease,
)
from ..logs import BackoffLog

__all__ = ["MemoryBackend"]


class _Parked:
    """A caller waiting for a slot: one small object whose bound methods the core calls."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Lease]) -> None:
        self.future = future

    def grant(self, lease: Lease) -> None:
        if self.future.done():
            lease.release()
        else:
            self.future.set_result(lease)

    def reject(self, error: ProxyError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class MemoryBackend:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or LoopClock()
        self._limiters: dict[str, ProviderLimiter] = {}
        self._retired: dict[str, ProviderLimiter] = {}
        self._starred: frozenset[str] = frozenset()
        self.on_change: Callable[[], None] | None = None
        self.backoffs = BackoffLog(self.clock)
        """The log of upstream backoffs, summarised per provider (the Redis backend logs through it too)."""

    def configure(self, providers: Mapping[str, LimiterSettings], starred: frozenset[str]) -> None:
        for name in list(self._limiters):
            if name not in providers:
                self._retired[name] = self._limiters.pop(name)
        for name, settings in providers.items():
            limiter = self._limiters.get(name) or self._retired.pop(name, None)
            if limiter is None:
                limiter = ProviderLimiter(name, settings, self.clock, starred=starred)
                limiter.on_change = self._changed
            else:
                limiter.apply_settings(settings)
            self._limiters[name] = limiter
        self.set_starred(starred)
        self._drop_idle_retired()

    def _drop_idle_retired(self) -> None:
        for name, limiter in list(self._retired.items()):
            if limiter.in_flight == 0 and limiter.queued == 0:
                del self._retired[name]

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def limiter(self, provider: str) -> ProviderLimiter:
        try:
            return self._limiters[provider]
        except KeyError:
            raise UnknownProvider.named(provider) from None

    def has_provider(self, name: str) -> bool:
        return name in self._limiters

    def usage_limiter(self, provider: str) -> ProviderLimiter | None:
        return self._limiters.get(provider)

    async def acquire(self, provider: str, priority: Priority, *, seq: int | None = None,
                      client_wait: float | None = None, model: str | None = None,
                      key: str | None = None, cost: Mapping[str, float] | None = None,
                      group: str | None = None, recost: Recost | None = None) -> SlotLease:
        limiter = self.limiter(provider)
        lease = limiter.try_acquire(priority, seq, model, key, cost, group)
        if lease is not None:
            return lease
        parked = _Parked(asyncio.get_running_loop().create_future())
        waiter = limiter.enqueue(priority, parked.grant, parked.reject, seq, client_wait, model, key, cost, group)
        waiter.recost = recost
        try:
            return await parked.future
        except asyncio.CancelledError:
            # Cancellation point: the client left while queued. The grant may have
            # landed in the same loop turn; then the slot is handed straight back.
            granted = result_if_any(parked.future)
            if granted is not None:
                granted.release()
            else:
                limiter.cancel(waiter)
            raise

    async def socket_key(self, provider: str, conversation: str | None) -> str | None:
        return self.limiter(provider).socket_key(conversation)

    def report_backoff(self, provider: str, cause: str, wait: float | None, sent_at: float, *,
                       reduce: bool = True, key: str | None = None) -> None:
        limiter = self._limiters.get(provider) or self._retired.get(provider)
        if limiter is not None:
            limit_before, _ = _level_now(limiter, key)
            limiter.report_backoff(cause, wait, sent_at=sent_at, reduce=reduce, key=key)
            limit_after, paused_until = _level_now(limiter, key)
            self.backoffs.event(provider, cause, key=key, limit_before=limit_before, limit_after=limit_after,
                                paused_until=paused_until)

    def report_budget(self, provider: str, budget: Budget, key: str | None = None) -> None:
        limiter = self._limiters.get(provider)
        if limiter is not None:
            limiter.report_budget(budget, key)

    def _windows(self, provider: str) -> ProviderWindows | None:
        limiter = self._limiters.get(provider) or self._retired.get(provider)
        return None if limiter is None else limiter.windows

    def settle_windows(self, provider: str, lease: SlotLease, actual: Mapping[str, float],
                       rules: Mapping[str, str], admitted: Mapping[str, float] | None = None) -> None:
        windows = self._windows(provider)
        if windows is not None and isinstance(lease, Lease):
            windows.settle_windows(lease, actual, rules, admitted)

    def recost_windows(self, provider: str, group: str) -> None:
        windows = self._windows(provider)
        if windows is not None:
            windows.recost(group)

    def report_window_hit(self, provider: str, key: str | None, group: str | None, window: str,
                          until: float, then: float = 0.0) -> None:
        windows = self._windows(provider)
        if windows is not None:
            windows.report_window_hit(key, group, window, until, then)

    def report_window_limits(self, provider: str, key: str | None, group: str | None,
                             limits: Mapping[str, int]) -> None:
        windows = self._windows(provider)
        if windows is not None:
            windows.report_window_limits(key, group, limits)

    def report_window_remaining(self, provider: str, key: str | None, group: str | None,
                                remaining: Mapping[str, float], answered_at: float) -> None:
        windows = self._windows(provider)
        if windows is not None:
            windows.report_window_remaining(key, group, remaining, answered_at)

    def window_limits(self, provider: str, key: str | None, group: str | None) -> dict[str, int]:
        windows = self._windows(provider)
        return {} if windows is None else windows.window_limits(key, group)

    def set_limit(self, provider: str, limit: int | None) -> None:
        self.limiter(provider).set_limit(limit)

    def set_key_limit(self, provider: str, key: str, limit: int | None) -> None:
        self.limiter(provider).set_key_limit(key, limit)

    def set_model_limit(self, provider: str, pattern: str, limit: int | None) -> None:
        self.limiter(provider).set_model_limit(pattern, limit)

    def set_cooldown(self, provider: str, seconds: float) -> None:
        self.limiter(provider).set_cooldown(seconds)

    def set_starred(self, starred: frozenset[str]) -> None:
        self._starred = frozenset(starred)
        for limiter in self._limiters.values():
            limiter.set_starred(self._starred)

    def starred(self) -> frozenset[str]:
        return self._starred

    def statistics(self, *, queue_detail: bool = True) -> list[ProviderStatus]:
        self._drop_idle_retired()
        return [limiter.statistics(queue_detail=queue_detail) for limiter in self._limiters.values()]

    def provider_status(self, provider: str) -> ProviderStatus:
        return self.limiter(provider).statistics()

    def export_state(self) -> dict[str, dict[str, object]]:
        return {name: limiter.export_state() for name, limiter in self._limiters.items()}

    def restore_state(self, provider: str, state: dict[str, object]) -> None:
        if provider in self._limiters:
            self._limiters[provider].restore_state(state)

    def record_usage(self, row: LedgerRow) -> None:
        return None

    async def fleet_usage(self, query: UsageQuery) -> dict[str, object] | None:
        return None

    async def fleet_spend(self, day_start_ms: int) -> dict[str, float] | None:
        return None

    def shed_queues(self, error: ProxyError) -> int:
        return sum(limiter.shed(error) for limiter in [*self._limiters.values(), *self._retired.values()])

    def reject_waiters(self, provider: str, workspace: str, error: ProxyError) -> int:
        limiters = (self._limiters.get(provider), self._retired.get(provider))
        return sum(limiter.reject_waiters(workspace, error) for limiter in limiters if limiter is not None)

    def in_flight(self) -> int:
        return sum(limiter.in_flight for limiter in [*self._limiters.values(), *self._retired.values()])

    def ready(self) -> bool:
        return True

    def backend_status(self) -> dict[str, object]:
        return {"kind": "memory", "healthy": True, "degraded": None}

    def local_in_flight(self, provider: str) -> int:
        return self.limiter(provider).in_flight

    async def start(self) -> None:
        return None

    async def refresh(self, *, queue_detail: bool = True) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _level_now(limiter: ProviderLimiter, key: str | None) -> tuple[int | None, float | None]:
    """The limit of the level a backoff on ``key`` reaches (None: the provider's own), and when its pause ends
    (epoch seconds), for the log."""
    status = limiter.statistics(queue_detail=False)
    if key is None:
        return status.limit, None if status.paused_until is None else status.paused_until / 1000
    for level in status.keys:
        if level.name == key:
            return level.limit, None if level.paused_until is None else level.paused_until / 1000
    return None, None
