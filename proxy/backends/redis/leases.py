"""This replica's side of each provider's shared queue: the settings it pushes (CONFIGURE), its requests
waiting for a slot (ENQUEUE, grants by pub/sub or in RENEW's answer, queue deadlines, requeues after Redis
lost them) and the slots it holds (leases renewed while their streams run, reclaimed, released).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...aio import result_if_any
from ...errors import QueueFull, QueueTimeout, UnknownProvider
from ...limiter import Clock, LimiterSettings, LoopClock, Priority, SlotLease, policy
from ...limiter.deadlines import Deadlines
from ...limiter.queue import Recost
from ...limiter.watchdog import SlotWatchdog
from ...limiter.window import OTHER_GROUP
from ..memory import MemoryBackend
from .arguments import cost_args, hint_from, layout_arg, windows_arg
from .client import ScriptClient, Wire, text
from .grants import read_grant
from .status import limit_arg

__all__ = ["RedisLease", "SlotKeeper"]

log = logging.getLogger("slotproxy.redis")

_UNCONFIGURED = -2
_SLOT_TIMEOUT = "slot_timeout"
_TRANSPORT_ARGS = {"websocket": "ws"}
"""A waiter's transport as the scripts keep it: absent for HTTP (most waiters), ``ws`` for a WebSocket."""
_NO_COST = ("", "", "")
"""ENQUEUE's window cost, model group and cost version for a waiter without a window cost."""
_RELEARN_SLOTS_AFTER = 0.5
"""A grant listener whose channel's slot a Cluster client did not know asks for the slots again after this."""


class RedisLease:
    """A slot held in Redis. ``release()`` is sync like the memory lease; the script runs in the background."""

    __slots__ = (
        "_backend",
        "cost",
        "granted_at",
        "granted_at_ms",
        "group",
        "holder",
        "key",
        "lease_id",
        "lease_lost",
        "on_reclaim",
        "priority",
        "provider",
        "queue_wait",
        "reclaimed",
        "released",
        "renewed_at",
        "seq",
        "starred",
        "waiter_id",
        "windows_settled",
    )

    def __init__(self, backend: SlotKeeper, provider: str, waiter_id: str, lease_id: str, granted_at_ms: int,
                 queue_wait: float, priority: Priority, seq: int, key: str | None = None) -> None:
        self._backend = backend
        self.key = key
        self.provider = provider
        self.waiter_id = waiter_id
        self.lease_id = lease_id
        self.granted_at_ms = granted_at_ms
        self.granted_at = granted_at_ms / 1000.0
        self.queue_wait = queue_wait
        self.priority = priority
        self.seq = seq
        self.on_reclaim: Callable[[], None] | None = None
        self.renewed_at = asyncio.get_running_loop().time()
        self.released = False
        self.reclaimed = False
        self.lease_lost = False
        self.cost: Mapping[str, float] | None = None
        """What it took from its windows when granted (None: no window applied)."""
        self.group: str | None = None
        self.windows_settled = False
        self.holder: str | None = None
        """What held it while it waited (its queue span says so); None: it went straight through."""
        self.starred = priority.starred

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._backend._release(self)

    def reclaim(self, why: str) -> None:
        """The slot is gone (slot_timeout, or its lease expired in Redis): tell the holder to abort."""
        if self.released:
            return
        log.warning("provider=%s slot %s reclaimed (%s)", self.provider, self.lease_id, why)
        self.reclaimed = True
        self.lease_lost = why != _SLOT_TIMEOUT
        self.release()
        self._backend._reclaims[self.provider] = self._backend._reclaims.get(self.provider, 0) + 1
        if self.on_reclaim is not None:
            self.on_reclaim()

    def headers_received(self) -> None:
        return None


class _Waiter:
    """A local request waiting for a grant. ``in_redis`` is set once Redis has answered its ENQUEUE
    with "queued": only then do renewals heartbeat it (an ENQUEUE still in flight is not lost).
    ``expiring``: its queue_timeout passed and its CANCEL is on the way; a grant that lands now is
    handed back by that CANCEL, not taken."""

    __slots__ = ("asked_at", "client_bound", "client_wait", "costs", "deadline", "deadline_armed", "expiring",
                 "future", "gone", "group", "in_redis", "key", "local", "model", "pattern", "priority", "provider",
                 "recost", "seq", "wait_limit", "waiter_id")

    def __init__(self, waiter_id: str, future: asyncio.Future[RedisLease], provider: str, priority: Priority,
                 asked_at: float) -> None:
        self.waiter_id = waiter_id
        self.future = future
        self.provider = provider
        self.priority = priority
        self.seq: int | None = None
        self.asked_at = asked_at
        self.in_redis = False
        self.expiring = False
        self.local = False
        self.gone = False
        self.wait_limit: float | None = None
        self.client_bound = False
        self.client_wait: float | None = None
        self.model: str | None = None
        self.key: str | None = None
        """The pool key it must be granted on (a WebSocket's responses), or None for any."""
        self.pattern: str | None = None
        self.deadline: float | None = None
        self.deadline_armed = False
        self.costs: list[dict[str, float]] | None = None
        """What it takes from the windows of its model ``group`` when granted: the last of these (None: no window
        cost); each earlier one, by its version (its index), is what a grant naming that version took."""
        self.group: str | None = None
        self.recost: Recost | None = None

    @property
    def cost(self) -> dict[str, float] | None:
        return self.costs[-1] if self.costs else None

    @property
    def queued(self) -> bool:
        """Still waiting for Redis (for the queue deadlines): not granted, gone, expiring or served locally."""
        return not (self.gone or self.future.done() or self.expiring or self.local)


class SlotKeeper(ScriptClient):
    """The waiting and the holding of one replica's requests, on the settings CONFIGURE pushed for each
    provider; while Redis is down, ``on_backend_error`` decides (``fail_closed``: wait; ``local``: this
    replica's own memory limiter, ``_local``)."""

    def __init__(self, link: Wire, replica: str, *, key_prefix: str, lease_ttl: float, mode: str,
                 clock: Clock | None) -> None:
        super().__init__(link, replica, key_prefix=key_prefix, mode=mode)
        self.clock: Clock = clock or LoopClock()
        self._lease_ttl_ms = int(lease_ttl * 1000)
        self._waiter_ttl_ms = max(3000, self._lease_ttl_ms)
        self._renew_every = max(0.05, min(lease_ttl / 3, 1.0))
        self._expiry_every = min(self._renew_every / 2, 0.05 * lease_ttl)
        """How often held slots are checked for a lease that could not be renewed: a slot is given up at 90% of
        ``lease_ttl`` and this late at most, still before Redis could let its lease expire."""
        self._settings: dict[str, LimiterSettings] = {}
        self._configured: set[str] = set()
        self._starred: frozenset[str] = frozenset()
        """The workspaces starred now (each provider's keys hold a copy the scripts read)."""
        self._waiters: dict[str, _Waiter] = {}
        self._leases: dict[str, RedisLease] = {}
        self._ids = itertools.count()
        self._reclaims: dict[str, int] = {}
        self._local = MemoryBackend(self.clock)
        self._sticky = policy.StickyKeys()
        self._deadlines: Deadlines[_Waiter] = Deadlines(self.clock, self._expire)
        self._primary: str | None = None
        """The primary last reached (host:port)."""
        self._away_seen_at: float | None = None
        """When the sentinels last showed Redis away for every replica, during this outage."""
        self._watchdogs: dict[str, SlotWatchdog[RedisLease]] = {}
        """This replica's held slots per provider, under slot_timeout (a provider dropped by a reload keeps
        its watchdog for the slots still held)."""
        self._dispatch_timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        """One timer per provider for the next time-based change of its room (a pause's end, a window's
        refill), at the earliest such time known."""

    def _rejoin(self) -> None:
        for provider in self._settings:
            self._spawn(self._configure_one(provider))

    # ----- config ----------------------------------------------------------------

    async def _configure_one(self, provider: str) -> None:
        """Push one provider's settings. A Redis found without them has lost its data if this replica
        configured it before, or if other replicas are listening for grants: then grants wait two renew
        rounds, long enough for every replica to put back the leases it holds. A new deployment does not."""
        settings = self._settings[provider]
        recovery_ms = int((settings.recovery_after or 0) * 1000)
        others = provider in self._configured or await self._other_replicas_listening()
        settle_ms = int(2 * self._renew_every * 1000) if others else 0
        recovering = policy.recovering_notice("{N}", "{TARGET}", settings.recovery_after or 0.0)
        done = await self._guarded("CONFIGURE", provider, limit_arg(settings.limit),
                                   int(settings.release_cooldown * 1000), recovering,
                                   recovery_ms, self._lease_ttl_ms, self._channel, settle_ms, layout_arg(settings),
                                   windows_arg(settings))
        if done is not None:
            self._configured.add(provider)
            await self._guarded("RESTAR", provider, self._lease_ttl_ms, self._channel, *sorted(self._starred))

    async def _other_replicas_listening(self) -> bool:
        try:
            channels = await self._redis.pubsub_channels(f"{self._channel}*")
        except RedisError:
            return True
        own = (self._channel + self.replica).encode()
        return any(channel != own for channel in channels)

    # ----- acquire ---------------------------------------------------------------

    async def acquire(self, provider: str, priority: Priority, *, seq: int | None = None,
                      client_wait: float | None = None, model: str | None = None,
                      key: str | None = None, cost: Mapping[str, float] | None = None,
                      group: str | None = None, recost: Recost | None = None) -> SlotLease:
        settings = self._settings.get(provider)
        if settings is None:
            raise UnknownProvider.named(provider)
        if not self.healthy and self._mode == "local":
            return await self._local.acquire(provider, priority, seq=seq, client_wait=client_wait, model=model,
                                             key=key, cost=cost, group=group, recost=recost)
        loop = asyncio.get_running_loop()
        waiter_id = f"{self.replica}-{next(self._ids)}"
        waiter = _Waiter(waiter_id, loop.create_future(), provider, priority, loop.time())
        waiter.wait_limit, waiter.client_bound = policy.queue_wait_limit(settings.queue_timeout, client_wait)
        waiter.client_wait = client_wait
        waiter.model = model
        waiter.key = key if settings.pool() else None
        if cost:
            waiter.costs, waiter.group, waiter.recost = [dict(cost)], group or OTHER_GROUP, recost
        if settings.models:
            waiter.pattern = policy.model_pattern(model, [cap.pattern for cap in settings.models])
        waiter.deadline = None if waiter.wait_limit is None else self.clock.time() + waiter.wait_limit
        self._waiters[waiter_id] = waiter
        granted: SlotLease | None = None
        try:
            granted = await self._wait_for_grant(waiter_id, waiter, settings, seq)
            return granted
        finally:
            waiter.gone = True  # a grant straight from ENQUEUE's answer never sets the future
            del self._waiters[waiter_id]
            if waiter.deadline_armed:
                self._deadlines.settle(len(self._waiters))
            if granted is None:
                self._abandon(waiter_id, waiter)

    async def socket_key(self, provider: str, conversation: str | None) -> str | None:
        settings = self._settings.get(provider)
        if settings is None:
            raise UnknownProvider.named(provider)
        if not settings.pool():
            return None
        preferred = self._sticky.get(conversation) or ""
        if not self.healthy and self._mode == "local":
            return await self._local.socket_key(provider, conversation)
        try:
            chosen = text(await self._run("PICK_KEY", provider, preferred))
        except RedisError:
            return preferred or settings.pool()[0].name
        return chosen or None

    def _arm_deadline(self, waiter: _Waiter) -> None:
        """The queue deadline, once the waiter is known to wait (a grant straight from ENQUEUE's answer,
        the common case, needs none): it keeps the time it asked at, so nothing is lost by arming it late."""
        if waiter.deadline_armed or waiter.deadline is None or waiter.wait_limit is None or waiter.wait_limit <= 0:
            return
        waiter.deadline_armed = True
        self._deadlines.add(waiter, waiter.deadline)

    def _abandon(self, waiter_id: str, waiter: _Waiter) -> None:
        """The caller left (cancel, timeout, shutdown): leave the queue, or hand back a grant it never took."""
        granted = result_if_any(waiter.future)
        if granted is not None:
            granted.release()
            return
        if not waiter.future.done():
            waiter.future.cancel()
        if not waiter.expiring:  # an expired waiter's CANCEL is already on its way
            self._spawn(self._guarded("CANCEL", waiter.provider, waiter_id, self._lease_ttl_ms, self._channel,
                                      "0", "0"))

    def _expire(self, waiter: _Waiter) -> None:
        """queue_timeout passed: leave the queue in Redis (counted there), then answer with the pause-aware hint."""
        if waiter.gone:
            return
        waiter.expiring = True
        self._spawn(self._time_out(waiter))

    async def _time_out(self, waiter: _Waiter) -> None:
        settings = self._settings.get(waiter.provider)
        hint = 1.0
        answer = await self._guarded("CANCEL", waiter.provider, waiter.waiter_id, self._lease_ttl_ms,
                                     self._channel, "0", "1")
        if answer is not None:
            hint = hint_from(answer)
        log.warning("provider=%s request from workspace=%s timed out after %.1fs in the queue", waiter.provider,
                    waiter.priority.workspace, asyncio.get_running_loop().time() - waiter.asked_at)
        if not waiter.future.done():
            timeout = settings.queue_timeout if settings is not None else None
            waiter.future.set_exception(QueueTimeout(
                policy.queue_timeout_message(waiter.provider, timeout, waiter.client_bound), retry_after=hint))

    async def _wait_for_grant(self, waiter_id: str, waiter: _Waiter, settings: LimiterSettings,
                              seq: int | None) -> SlotLease:
        """Enqueue in Redis and wait; while Redis is down, wait (fail_closed) or fall back (local)."""
        waiter.seq = seq
        while True:
            try:
                result = await self._enqueue(waiter_id, waiter, settings)
                break
            except ResponseError:
                raise
            except RedisError:
                if self._mode == "local":
                    waiter.local = True
                    return await self._local.acquire(waiter.provider, waiter.priority, seq=seq,
                                                     client_wait=waiter.client_wait, model=waiter.model,
                                                     key=waiter.key, cost=waiter.cost, group=waiter.group,
                                                     recost=waiter.recost)
                self._arm_deadline(waiter)
                await self._wait_or_expire(waiter)
        status, detail, waiter.seq = int(result[0]), text(result[1]), int(result[2])
        if waiter.expiring:
            # Timed out while the ENQUEUE was in flight. A grant in its answer was taken out of Redis's
            # records, out of reach of the timeout's CANCEL: hand it back here.
            if status == 1:
                lease_id = detail.split(" ", 1)[0]
                self._spawn(self._guarded("RELEASE", waiter.provider, lease_id, waiter_id, self._lease_ttl_ms,
                                          self._channel))
            return await waiter.future
        if status == -1:
            raise QueueFull(f"slotproxy queue for provider '{waiter.provider}' is full ({settings.max_queue} "
                            "waiting); retry later", retry_after=hint_from(detail))
        if status == 1:
            return self._adopt(waiter_id, waiter, detail)
        waiter.in_redis = True
        self._arm_deadline(waiter)
        if waiter.wait_limit is not None and waiter.wait_limit <= 0:
            self._expire(waiter)  # no time to wait at all: answered as soon as it is known to queue
        self._schedule_dispatch(waiter.provider, int(detail))
        return await waiter.future

    async def _wait_or_expire(self, waiter: _Waiter) -> None:
        """Redis is unreachable (fail_closed): wait a renew interval, or until the queue deadline answers."""
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self._renew_every)
        except TimeoutError:
            return

    async def _enqueue(self, waiter_id: str, waiter: _Waiter, settings: LimiterSettings) -> Any:
        """ENQUEUE is idempotent per waiter id: a repeat keeps one entry, or returns the grant already made.
        A Redis that lost the provider's settings is configured again first."""
        priority = waiter.priority
        args = (waiter_id, self.replica, priority.workspace, "1" if priority.starred else "0",
                policy.prompt_ms(priority.prompt_started_at), priority.conversation or "",
                "" if waiter.seq is None else waiter.seq, self._lease_ttl_ms, self._waiter_ttl_ms,
                settings.max_queue, self._channel, waiter.pattern or "",
                (self._sticky.get(priority.conversation) or "") if settings.keys else "",
                waiter.key or "", _TRANSPORT_ARGS.get(priority.transport, ""), (waiter.model or "")[:256],
                *(_NO_COST if waiter.costs is None else cost_args(waiter.costs, waiter.group)))
        result = await self._run("ENQUEUE", waiter.provider, *args)
        if int(result[0]) == _UNCONFIGURED:
            await self._configure_one(waiter.provider)
            result = await self._run("ENQUEUE", waiter.provider, *args)
            if int(result[0]) == _UNCONFIGURED:
                raise RedisError(f"redis has no settings for provider '{waiter.provider}' and CONFIGURE failed")
        return result

    def _adopt(self, waiter_id: str, waiter: _Waiter, grant: str) -> RedisLease:
        lease_id, granted_at, key, version, holder = read_grant(grant)
        queue_wait = asyncio.get_running_loop().time() - waiter.asked_at
        lease = RedisLease(self, waiter.provider, waiter_id, lease_id, int(granted_at), queue_wait, waiter.priority,
                           waiter.seq or 0, key)
        lease.holder = holder
        lease.starred = waiter.priority.starred or waiter.priority.workspace in self._starred
        if version is not None and waiter.costs:
            lease.cost, lease.group = waiter.costs[min(version, len(waiter.costs) - 1)], waiter.group
        self._sticky.remember(waiter.priority.conversation, key)
        self._leases[lease_id] = lease
        self._watchdogs[waiter.provider].hold(lease)
        return lease

    @staticmethod
    def _slot_timed_out(lease: RedisLease) -> None:
        lease.reclaim(_SLOT_TIMEOUT)

    def _resolve(self, waiter_id: str, grant: str, *, picked_up_for: str | None = None) -> None:
        """A grant for one of our waiters.

        If the waiter already left, its CANCEL script hands the lease back, as long as
        the grant is still recorded in Redis. A grant already picked up from Redis
        (``picked_up_for`` names its provider: RENEW and ENQUEUE take it out) has no
        record left for CANCEL to find, so it is released here, unless it is the
        slot this waiter already holds (a lease id is its waiter's id), granted again
        by a Redis that lost its data: that grant is the same slot.
        """
        lease_id = grant.split(" ")[0]
        if lease_id in self._leases:
            return
        waiter = self._waiters.get(waiter_id)
        if waiter is None or waiter.future.done() or waiter.expiring:
            if picked_up_for is not None:
                self._spawn(self._guarded("RELEASE", picked_up_for, lease_id, waiter_id,
                                          self._lease_ttl_ms, self._channel))
            return
        waiter.future.set_result(self._adopt(waiter_id, waiter, grant))

    # ----- release, renew, dispatch ------------------------------------------------

    def _release(self, lease: RedisLease) -> None:
        self._leases.pop(lease.lease_id, None)
        self._watchdogs[lease.provider].drop(lease)
        provider = lease.provider
        self._send("RELEASE", provider, (lease.lease_id, lease.waiter_id, self._lease_ttl_ms, self._channel),
                   lambda answer: self._schedule_dispatch(provider, int(text(answer[1]))))

    def _schedule_dispatch(self, provider: str, at_ms: int) -> None:
        """Run a dispatch when a pause or cooldown ends or a held window has refilled, if this replica has
        waiters then: one timer per provider, at the earliest such time (its dispatch's answer sets the
        next). Times beyond a renew interval are left to the renew loop, which brings them closer."""
        if at_ms <= 0 or not self._waiters:
            return
        delay = max(0.0, at_ms / 1000.0 - time.time()) + 0.005
        if delay > self._renew_every:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        pending = self._dispatch_timers.get(provider)
        if pending is not None:
            if pending[0] <= when:
                return
            pending[1].cancel()
        self._dispatch_timers[provider] = (when, loop.call_at(when, self._dispatch_now, provider))

    def _dispatch_now(self, provider: str) -> None:
        self._dispatch_timers.pop(provider, None)
        if not self._closed:
            self._spawn(self._dispatch(provider))

    async def _dispatch(self, provider: str) -> None:
        answer = await self._guarded("DISPATCH", provider, self._lease_ttl_ms, self._channel)
        if answer is not None:
            self._schedule_dispatch(provider, int(text(answer)))

    async def _listen(self) -> None:
        while not self._closed:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await self._link.start()  # a Cluster's pubsub finds the channel's node in the slots it learnt
                await pubsub.subscribe(self._channel + self.replica)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        waiter_id, grant = text(message["data"]).split(" ", 1)
                        self._resolve(waiter_id, grant)
            except (RedisError, OSError) as exc:
                self._mark_unhealthy(exc)
                await asyncio.sleep(self._renew_every)
            except KeyError:  # a Cluster client's slot map lacks the channel's slot: a cluster still forming
                await asyncio.sleep(_RELEARN_SLOTS_AFTER)
                with contextlib.suppress(RedisError, OSError):
                    await self._link.refresh()
            finally:
                await pubsub.aclose()

    async def _renew_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._renew_every)
            try:
                await self._renew_once()
            except RedisError:
                continue

    async def _expiry_loop(self) -> None:
        """fail_closed: a slot whose lease could not be renewed for 90% of ``lease_ttl`` is given up (its
        stream aborted) before Redis lets it expire and grants it elsewhere. Unless Redis is away for every
        replica (a primary failing over): nobody can grant it then, the scripts bridge the gap, and the
        stream carries on; its time runs again from the last moment the sentinels showed Redis away. They
        are asked from half a ``lease_ttl`` without a renewal on, in the background, so their answer is
        there by the time it is needed and a slow one never delays giving a slot up."""
        loop = asyncio.get_running_loop()
        ttl = self._lease_ttl_ms / 1000
        asking: asyncio.Task[None] | None = None
        while not self._closed:
            await asyncio.sleep(self._expiry_every)
            now = loop.time()
            if not any(lease.renewed_at < now - 0.5 * ttl for lease in self._leases.values()):
                self._away_seen_at = None
                continue
            if asking is None or asking.done():
                asking = self._spawn(self._ask_the_sentinels(), keep=True)
            deadline = now - 0.9 * ttl
            if self._away_seen_at is not None and self._away_seen_at >= deadline:
                continue
            for lease in [lease for lease in self._leases.values() if lease.renewed_at < deadline]:
                lease.reclaim("its lease could not be renewed in redis before it expired")

    async def _ask_the_sentinels(self) -> None:
        if not await self._link.away_for_all(self._primary):
            return
        if self._away_seen_at is None:
            log.warning("redis primary %s is away for the sentinels too: keeping %d held slot(s) until it or a new "
                        "primary answers", self._primary or "(not reached yet)", len(self._leases))
        self._away_seen_at = asyncio.get_running_loop().time()

    async def _renew_once(self) -> None:
        if not self.healthy:
            await self._redis.ping()
            self._mark_healthy()
        for provider in list(self._settings):
            leases = [lease for lease in self._leases.values() if lease.provider == provider]
            waiters = [wid for wid, w in self._waiters.items()
                       if w.provider == provider and w.in_redis and w.queued]
            sent_at = asyncio.get_running_loop().time()
            fresh_since = sent_at - 0.9 * self._lease_ttl_ms / 1000
            result = await self._run("RENEW", provider, self._lease_ttl_ms, self._waiter_ttl_ms, self._channel,
                                     len(leases), *(lease.lease_id for lease in leases),
                                     *(lease.granted_at_ms for lease in leases),
                                     *("1" if lease.renewed_at > fresh_since else "0" for lease in leases),
                                     *waiters)
            missing, grants, lost, next_at, configured = result
            for lease in leases:
                lease.renewed_at = sent_at
            if not int(configured):
                log.warning("provider=%s has no settings in redis (it lost its data); configuring it again",
                            provider)
                self._spawn(self._configure_one(provider))
            for lease_id in map(text, missing):
                gone = self._leases.get(lease_id)
                if gone is not None:
                    gone.reclaim("its lease expired in redis")
            for grant in map(text, grants):
                waiter_id, rest = grant.split(" ", 1)
                self._resolve(waiter_id, rest, picked_up_for=provider)
            for waiter_id in map(text, lost):
                self._requeue_lost(waiter_id)
            self._schedule_dispatch(provider, int(text(next_at)))

    def _requeue_lost(self, waiter_id: str) -> None:
        """A queued waiter Redis no longer knows (its heartbeat lapsed, or Redis restarted empty)
        is put back with its original priority and arrival number."""
        waiter = self._waiters.get(waiter_id)
        if waiter is None or not waiter.queued:
            return
        self._spawn(self._requeue(waiter_id, waiter))

    async def _requeue(self, waiter_id: str, waiter: _Waiter) -> None:
        try:
            result = await self._enqueue(waiter_id, waiter, self._settings[waiter.provider])
        except RedisError:
            return
        if int(result[0]) == 1:
            self._resolve(waiter_id, text(result[1]), picked_up_for=waiter.provider)
        elif waiter.future.done():
            # Served or gone while this ENQUEUE was in flight: take the new queue entry out again,
            # but never the slot the waiter holds under the same id.
            keep = "1" if waiter_id in self._leases else "0"
            self._spawn(self._guarded("CANCEL", waiter.provider, waiter_id, self._lease_ttl_ms, self._channel, keep,
                                      "0"))
