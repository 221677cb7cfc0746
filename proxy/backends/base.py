"""The backend interface the relay and the admin API talk to."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from ..errors import ProxyError
from ..ledger.report import UsageQuery
from ..ledger.store import LedgerRow
from ..limiter import (
    Budget,
    Clock,
    LimiterSettings,
    Priority,
    ProviderLimiter,
    ProviderStatus,
    Recost,
    SlotLease,
)
from ..logs import BackoffLog

__all__ = ["Backend"]


class Backend(Protocol):
    clock: Clock
    on_change: Callable[[], None] | None

    @property
    def backoffs(self) -> BackoffLog:
        """The upstream backoffs summarised per provider for the log, and the 429s relayed to clients."""

    def configure(self, providers: Mapping[str, LimiterSettings], starred: frozenset[str]) -> None:
        """Apply a (re)loaded config: add, update and retire providers; nothing in flight is dropped."""

    def has_provider(self, name: str) -> bool: ...

    def usage_limiter(self, provider: str) -> ProviderLimiter | None:
        """The in-process limiter a usage gate attaches to, or None where the backend cannot host one."""

    async def acquire(self, provider: str, priority: Priority, *, seq: int | None = None,
                      client_wait: float | None = None, model: str | None = None,
                      key: str | None = None, cost: Mapping[str, float] | None = None,
                      group: str | None = None, recost: Recost | None = None) -> SlotLease:
        """Wait for a slot at every level that applies (the provider, the cap ``model`` matches, a key of
        the pool: ``key`` when given) and, where token windows are held, for ``cost`` (window name to
        amount) from every window of the key and model ``group``, all taken at once; at most queue_timeout
        (or ``client_wait``, the client's own deadline, when shorter). Raises QueueFull or QueueTimeout;
        cancelling the caller leaves the queue. ``recost`` is asked for its cost again while it waits, when
        ``recost_windows`` names its group; the lease's ``cost`` is the one its grant took."""

    async def socket_key(self, provider: str, conversation: str | None) -> str | None:
        """The pool key a new WebSocket opens its upstream socket with (``policy.socket_key``); None
        without a pool. It takes no slot: the socket's responses then ``acquire`` with this key."""

    def report_backoff(self, provider: str, cause: str, wait: float | None, sent_at: float, *,
                       reduce: bool = True, key: str | None = None) -> None:
        """Pause the key the answer came on (None: the provider) for ``wait`` (else its default or overload
        pause); ``reduce`` also lowers its limit once per burst."""

    def report_budget(self, provider: str, budget: Budget, key: str | None = None) -> None:
        """The provider's rate-limit headers on an answer sent with ``key``: a spent window holds the key."""

    def settle_windows(self, provider: str, lease: SlotLease, actual: Mapping[str, float],
                       rules: Mapping[str, str], admitted: Mapping[str, float] | None = None) -> None:
        """Reconcile the windows ``lease`` took from with its answer's usage (``window.SETTLE_RULES``);
        ``admitted``: what the provider charged each when it admitted the request (``WindowBook.settle``)."""

    def recost_windows(self, provider: str, group: str) -> None:
        """The estimates of model ``group`` moved (``providers.recost``): each of its waiters queued in this
        process that gave ``acquire`` a ``recost`` takes the cost that returns, its place in the queue kept,
        and admission is looked at again at once (with Redis: one script for them all)."""

    def report_window_hit(self, provider: str, key: str | None, group: str | None, window: str,
                          until: float, then: float = 0.0) -> None:
        """A 429 named this window of (key, group): empty it until ``until``, when it holds ``then`` (what the
        provider said it will have, ``limiter.window.FULL`` for all of it); no backoff, no reduction."""

    def report_window_limits(self, provider: str, key: str | None, group: str | None,
                             limits: Mapping[str, int]) -> None:
        """Window limits an answer's ``*-limit`` headers announced (used with ``learn``)."""

    def report_window_remaining(self, provider: str, key: str | None, group: str | None,
                                remaining: Mapping[str, float], answered_at: float) -> None:
        """What an answer said was left of each window: the room believed only ever goes down to it."""

    def window_limits(self, provider: str, key: str | None, group: str | None) -> dict[str, int]:
        """The window limits in force for (key, group), by window name (empty: no window applies)."""

    def set_limit(self, provider: str, limit: int | None) -> None: ...

    def set_key_limit(self, provider: str, key: str, limit: int | None) -> None:
        """Raises UnknownLimit for a key the provider's pool does not have."""

    def set_model_limit(self, provider: str, pattern: str, limit: int | None) -> None:
        """Raises UnknownLimit for a pattern the provider's models do not have."""

    def set_cooldown(self, provider: str, seconds: float) -> None: ...

    def set_starred(self, starred: frozenset[str]) -> None: ...

    def starred(self) -> frozenset[str]: ...

    def statistics(self, *, queue_detail: bool = True) -> list[ProviderStatus]: ...

    def provider_status(self, provider: str) -> ProviderStatus: ...

    def export_state(self) -> dict[str, dict[str, object]]:
        """Each provider's runtime state, for the state file."""

    def restore_state(self, provider: str, state: dict[str, object]) -> None: ...

    def record_usage(self, row: LedgerRow) -> None:
        """A request that ended, for the fleet's usage aggregates (a no-op where one ledger is the fleet)."""

    async def fleet_usage(self, query: UsageQuery) -> dict[str, object] | None:
        """``/usage``'s answer for the whole fleet, or None where this replica's ledger answers it (memory, or
        a query naming conversations)."""

    async def fleet_spend(self, day_start_ms: int) -> dict[str, float] | None:
        """The whole fleet's spend per workspace since ``day_start_ms`` (a UTC day's start), or None where this
        replica's ledger holds it (memory). Raises ``SpendUnread`` when it cannot be read."""

    def shed_queues(self, error: ProxyError) -> int:
        """Reject every waiter with ``error`` (graceful shutdown)."""

    def reject_waiters(self, provider: str, workspace: str, error: ProxyError) -> int:
        """Reject at once, with ``error``, every request of ``workspace`` this process has queued for
        ``provider`` (its spend cap reached); they leave the shared queue too. Returns how many."""

    def in_flight(self) -> int: ...

    def ready(self) -> bool: ...

    def backend_status(self) -> dict[str, object]:
        """Kind, health and degraded mode, for status and /readyz."""

    def local_in_flight(self, provider: str) -> int:
        """Slots held by this process (cluster-wide counts are in statistics())."""

    async def start(self) -> None:
        """Connect before the first request."""

    async def refresh(self, *, queue_detail: bool = True) -> None:
        """Bring the snapshot statistics() reads up to date (a no-op in memory); ``queue_detail=False``
        leaves the queue listing out (metrics need only the counts)."""

    async def flush(self) -> None:
        """Wait for background writes issued so far (a no-op in memory)."""

    async def close(self) -> None: ...
