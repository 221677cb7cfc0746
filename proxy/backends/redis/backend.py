"""The Redis backend: several replicas share each provider's limit, queue order, pause and auto-reduction.

Slots are leases with a TTL that the holder renews while its stream runs, so the
slots of a replica that dies expire within ``lease_ttl``. Waiters live in one
sorted set per provider, ordered (starred, prompt start, arrival) across every
replica, with their own heartbeat. Each state change is one Lua script (see
:mod:`proxy.backends.redis.lua`); grants reach the waiting replica by pub/sub, and the
renew loop doubles as the bounded fallback poll when a message is missed.

When Redis cannot be reached, ``on_backend_error`` decides: ``fail_closed``
(new requests wait, then 503 when their queue_timeout passes; a slot whose lease
could not be renewed for 90% of ``lease_ttl`` is given up before Redis can grant
it elsewhere, unless the sentinels show the primary away for every replica: a
failover, which the scripts bridge) or ``local`` (each replica serves from its own memory limiter with
``local_limit`` and keeps the streams it has). Either way ``ready()`` is False
until Redis answers again, and the replica rejoins.

The parts: ``client`` (the connection, batching, health), ``leases`` (this replica's waiters and
held slots), ``status`` (STATS decoded), ``fleet`` (the fleet's usage aggregates), ``lua`` (the
scripts); ``RedisBackend`` puts them behind the ``Backend`` interface.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError

from ...errors import ProxyError, UnknownLimit, UnknownProvider
from ...ledger.report import UsageQuery
from ...ledger.spend import SpendUnread
from ...ledger.store import LedgerRow
from ...limiter import Budget, Clock, LimiterSettings, ProviderStatus, policy
from ...limiter.watchdog import SlotWatchdog
from ...logs import BackoffLog
from .client import SCRIPTS, in_words, text
from .fleet import RedisFleetUsage
from .link import RedisTarget, open_link
from .status import limit_arg, status_from, unread_status
from .windows import WindowKeeper

__all__ = ["RedisBackend"]

log = logging.getLogger("slotproxy.redis")

_HEALTH_EVERY = 0.5
_HEALTH_TIMEOUT = 1.0


class RedisBackend(WindowKeeper):
    """The ``Backend`` on Redis: ``SlotKeeper``'s waiting and holding and ``WindowKeeper``'s token windows,
    with the config, the limits and reports every replica shares, the status snapshot and the fleet's usage."""

    def __init__(
        self,
        target: RedisTarget | str,
        *,
        key_prefix: str = "slotproxy",
        lease_ttl: float = 30.0,
        on_backend_error: str = "fail_closed",
        local_limit: int | None = None,
        clock: Clock | None = None,
        usage_retention: float = 30 * 86400.0,
    ) -> None:
        replica = uuid.uuid4().hex[:12]
        super().__init__(open_link(target, replica, SCRIPTS), replica, key_prefix=key_prefix, lease_ttl=lease_ttl,
                         mode=on_backend_error, clock=clock)
        self.on_change: Callable[[], None] | None = None
        self._local_limit = local_limit
        self._snapshot: dict[str, ProviderStatus] = {}
        self._topology = "single" if isinstance(target, str) else target.topology
        self.failovers = 0
        self.last_failover_at: int | None = None
        self._fleet_usage = RedisFleetUsage(self._link, self._pending, key_prefix, usage_retention)
        self._link.watch_primary(self._primary_reached)

    @property
    def backoffs(self) -> BackoffLog:
        """The replica's log of upstream backoffs (its memory fallback's: one log whichever backs a request)."""
        return self._local.backoffs

    # ----- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Connect, push the config, and start the grant listener and the renew loop."""
        self._spawn(self._listen(), keep=True)
        self._spawn(self._renew_loop(), keep=True)
        self._spawn(self._usage_loop(), keep=True)
        self._spawn(self._watch_health(), keep=True)
        if self._mode == "fail_closed":
            self._spawn(self._expiry_loop(), keep=True)
        try:
            await self._link.start()
            await self._link.ping()
            self._primary_reached(await self._link.primary())
            await self.flush()
            await self.refresh()
        except RedisError as exc:
            self._mark_unhealthy(exc)

    async def close(self) -> None:
        self._closed = True
        for lease in list(self._leases.values()):
            lease.release()
        self._fleet_usage.send()
        await self.flush()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._link.close()

    # ----- config ----------------------------------------------------------------

    def configure(self, providers: Mapping[str, LimiterSettings], starred: frozenset[str]) -> None:
        self._settings = dict(providers)
        for name, settings in providers.items():
            watchdog = self._watchdogs.get(name)
            if watchdog is None:
                self._watchdogs[name] = SlotWatchdog(self.clock, self._slot_timed_out, settings.slot_timeout)
            else:
                watchdog.set_timeout(settings.slot_timeout)
        local = {name: replace(s, limit=self._local_limit or s.limit) for name, s in providers.items()}
        self._local.configure(local, starred)
        for provider in providers:
            self._spawn(self._configure_one(provider))
        self.set_starred(starred)

    def has_provider(self, name: str) -> bool:
        return name in self._settings

    def usage_limiter(self, provider: str) -> None:
        """The usage gate counts this process's slots only: with several replicas it has nothing to attach to."""
        return

    # ----- the fleet's usage -----------------------------------------------------------

    def record_usage(self, row: LedgerRow) -> None:
        self._fleet_usage.record(row)

    async def _usage_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(1.0)
            self._fleet_usage.send()

    async def fleet_usage(self, query: UsageQuery) -> dict[str, object] | None:
        if query.per_replica:
            return None
        self._fleet_usage.send()
        await self.flush()
        return await self._fleet_usage.read(query, self._settings)

    async def fleet_spend(self, day_start_ms: int) -> dict[str, float] | None:
        self._fleet_usage.send()
        try:
            await self.flush()
            return await self._fleet_usage.day_spend(day_start_ms, self._settings)
        except RedisError as exc:
            raise SpendUnread(f"the fleet's spend could not be read from redis ({in_words(exc)})") from None

    # ----- control ---------------------------------------------------------------

    def report_backoff(self, provider: str, cause: str, wait: float | None, sent_at: float, *,
                       reduce: bool = True, key: str | None = None) -> None:
        settings = self._settings.get(provider)
        level = self._key_level(settings, key)
        if settings is None or level is None:
            return
        default = policy.default_pause(reduce, settings.default_pause, settings.overload_pause)
        wait_ms = int(policy.pause_length(wait, default) * 1000)
        template = policy.auto_reduce_notice("{N}", cause)

        def logged(answer: Any) -> None:
            """Logged as the memory backend logs it, through the same summary: the level's limit before and
            after, and when its (cluster-wide) pause ends."""
            reduced, limit, paused_until_ms = int(answer[0]), text(answer[1]), float(text(answer[2]))
            after = None if limit == "none" else int(limit)
            before = after + 1 if reduced and after is not None else after
            self._local.backoffs.event(provider, cause, key=key, limit_before=before, limit_after=after,
                                       paused_until=paused_until_ms / 1000)

        self._send("BACKOFF", provider, (cause, wait_ms, int(sent_at * 1000), template, "1" if reduce else "0", level),
                   logged)
        if not self.healthy:
            self._local.report_backoff(provider, cause, wait, sent_at, reduce=reduce, key=key)

    def report_budget(self, provider: str, budget: Budget, key: str | None = None) -> None:
        settings = self._settings.get(provider)
        level = self._key_level(settings, key)
        if settings is None or level is None:
            return
        now = time.time()
        hold_ms = 0 if budget.held_until is None else max(0, int((budget.held_until - now) * 1000))
        reset_in = None if budget.reset_at is None else max(0, int((budget.reset_at - now) * 1000))
        requests_reset_in = None if budget.requests_reset is None else int((budget.requests_reset - now) * 1000)
        summary = json.dumps({"remaining_requests": budget.remaining_requests,
                              "remaining_tokens": budget.remaining_tokens, "reset_in_ms": reset_in,
                              "requests_reset_in_ms": requests_reset_in})
        self._send("BUDGET", provider, (level, hold_ms, summary),
                   lambda next_at: self._schedule_dispatch(provider, int(text(next_at))))
        if not self.healthy:
            self._local.report_budget(provider, budget, key)

    @staticmethod
    def _key_level(settings: LimiterSettings | None, key: str | None) -> str | None:
        """The level a key's answer reports to ('' for the provider's own); None for a key the config
        has dropped since the request was sent."""
        if key is None:
            return ""
        if settings is None or all(k.name != key for k in settings.keys):
            return None
        return f"k:{key}"

    def set_limit(self, provider: str, limit: int | None) -> None:
        self._require(provider)
        policy.validate_limit(limit)
        self._spawn(self._guarded("SET_LIMIT", provider, limit_arg(limit), self._lease_ttl_ms, self._channel, ""))

    def set_key_limit(self, provider: str, key: str, limit: int | None) -> None:
        self._require(provider)
        names = [k.name for k in self._settings[provider].keys]
        if key not in names:
            raise UnknownLimit(f"provider '{provider}' has no key '{key}' (configured: {', '.join(names) or 'none'})")
        policy.validate_limit(limit)
        self._spawn(self._guarded("SET_LIMIT", provider, limit_arg(limit), self._lease_ttl_ms, self._channel,
                                  f"k:{key}"))

    def set_model_limit(self, provider: str, pattern: str, limit: int | None) -> None:
        self._require(provider)
        patterns = [cap.pattern for cap in self._settings[provider].models]
        if pattern not in patterns:
            raise UnknownLimit(f"provider '{provider}' has no model cap '{pattern}' (configured: "
                               f"{', '.join(patterns) or 'none'})")
        policy.validate_limit(limit)
        self._spawn(self._guarded("SET_LIMIT", provider, limit_arg(limit), self._lease_ttl_ms, self._channel,
                                  f"m:{pattern}"))

    def set_cooldown(self, provider: str, seconds: float) -> None:
        self._require(provider)
        self._spawn(self._guarded("SET_COOLDOWN", provider, int(seconds * 1000)))

    def set_starred(self, starred: frozenset[str]) -> None:
        self._starred = frozenset(starred)
        self._local.set_starred(self._starred)
        self._spawn(self._push_stars(self._starred))

    async def _push_stars(self, starred: frozenset[str]) -> None:
        """Each provider keeps its own copy of the starred set, under its hash tag (a script reads only its own
        provider's keys: in a Redis Cluster they are on one node)."""
        for provider in list(self._settings):
            await self._guarded("RESTAR", provider, self._lease_ttl_ms, self._channel, *sorted(starred))

    def starred(self) -> frozenset[str]:
        return self._starred

    def _require(self, provider: str) -> None:
        if provider not in self._settings:
            raise UnknownProvider.named(provider)

    # ----- observing -------------------------------------------------------------

    async def refresh(self, *, queue_detail: bool = True) -> None:
        """Read every provider's shared state from Redis into the snapshot that status and metrics read.

        A provider whose state cannot be read loses its snapshot rather than showing an old one as
        current: status then shows this replica's own view (its local limiter in ``local`` mode).
        One that Redis has no settings for (it lost its data) is configured again first."""
        for provider in list(self._settings):
            try:
                listed = policy.QUEUE_LISTED if queue_detail else 0
                result = await self._run("STATS", provider, listed)
                if b"configured_limit" not in result[0][::2]:
                    await self._configure_one(provider)
                    result = await self._run("STATS", provider, listed)
            except RedisError:
                self._snapshot.pop(provider, None)
                continue
            self._snapshot[provider] = status_from(provider, result, self._settings[provider],
                                                   self._reclaims.get(provider, 0))
            self._learned_from(self._snapshot[provider])

    def statistics(self, *, queue_detail: bool = True) -> list[ProviderStatus]:
        statuses = [self.provider_status(name) for name in self._settings]
        return statuses if queue_detail else [replace(status, queue=()) for status in statuses]

    def provider_status(self, provider: str) -> ProviderStatus:
        self._require(provider)
        if not self.healthy and self._mode == "local":
            status = self._local.provider_status(provider)
        else:
            status = self._snapshot.get(provider) or unread_status(provider, self._settings[provider],
                                                                    self.local_in_flight(provider))
        return replace(status, local_in_flight=self.local_in_flight(provider))

    def local_in_flight(self, provider: str) -> int:
        return sum(1 for lease in self._leases.values() if lease.provider == provider)

    def backend_status(self) -> dict[str, Any]:
        return {"kind": "redis", "topology": self._topology, "healthy": self.healthy, "mode": self._mode,
                "error": self.error, "primary": self._primary, "failovers": self.failovers,
                "last_failover_at": self.last_failover_at, "replica": self.replica,
                "degraded": None if self.healthy else ("local" if self._mode == "local" else "fail_closed")}

    # ----- health and failovers ----------------------------------------------------

    async def _watch_health(self) -> None:
        """Ping Redis twice a second whether or not a request touches it, so ``healthy`` and ``/readyz`` follow
        it within a second or so; and notice when the primary changed (a failover). A ping that takes too long
        marks Redis unhealthy but is left to end by its socket timeout, not cancelled: a redis-py command
        cancelled mid-way can leave its connection behind."""
        ping: asyncio.Task[Any] | None = None
        while not self._closed:
            await asyncio.sleep(_HEALTH_EVERY)
            if ping is None or ping.done():
                ping = self._spawn(self._link.ping(), keep=True)
                ping.add_done_callback(_seen)  # a late failure is read here, not reported as never retrieved
            await asyncio.wait({ping}, timeout=_HEALTH_TIMEOUT)
            if not ping.done():
                self._mark_unhealthy(RedisError(f"no answer to a ping within {_HEALTH_TIMEOUT:g}s"))
                continue
            if ping.cancelled():
                continue
            failure = ping.exception()
            if failure is not None:
                self._mark_unhealthy(failure)
                continue
            self._mark_healthy()
            self._primary_reached(self._link.reached() or await self._link.primary())

    def _primary_reached(self, primary: str | None) -> None:
        """The primary as reached now: by the health check, or by any connection the moment it reconnected
        (a script batch's, the grant listener's, a ping's), whichever comes first. One failover, one count
        and one line, however many of them see it."""
        if primary is None or primary == self._primary:
            return
        old, self._primary = self._primary, primary
        if old is not None and not self._closed:
            self._failed_over(old, primary)

    def _failed_over(self, old: str, new: str) -> None:
        """One line per failover; what Redis may have lost with the old primary is put back by the next
        renew round (leases this replica still holds, waiters it still has) and the settings by CONFIGURE."""
        self.failovers += 1
        self.last_failover_at = int(time.time() * 1000)
        log.warning("redis primary changed from %s to %s (failover %d): putting back %d held slot(s) and %d "
                    "waiter(s)", old, new, self.failovers, len(self._leases), len(self._waiters))
        self._rejoin()
        self._spawn(self._renew_once())

    def export_state(self) -> dict[str, dict[str, object]]:
        return {}

    def restore_state(self, provider: str, state: dict[str, object]) -> None:
        """Shared state lives in Redis itself; the state file only matters for the memory backend."""

    def shed_queues(self, error: ProxyError) -> int:
        count = 0
        for waiter in list(self._waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(error)
                count += 1
        return count + self._local.shed_queues(error)

    def reject_waiters(self, provider: str, workspace: str, error: ProxyError) -> int:
        """Answered at once; each leaves Redis's queue by its CANCEL, which hands back a grant that lands
        meanwhile (as a queue timeout's does)."""
        count = 0
        for waiter in list(self._waiters.values()):
            if waiter.provider == provider and waiter.priority.workspace == workspace and waiter.queued:
                waiter.expiring = True
                self._spawn(self._guarded("CANCEL", provider, waiter.waiter_id, self._lease_ttl_ms, self._channel,
                                          "0", "0"))
                waiter.future.set_exception(error)
                count += 1
        return count + self._local.reject_waiters(provider, workspace, error)

    def in_flight(self) -> int:
        return len(self._leases) + self._local.in_flight()

    def ready(self) -> bool:
        return self.healthy


def _seen(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
