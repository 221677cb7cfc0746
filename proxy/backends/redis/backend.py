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
it elsewhere) or ``local`` (each replica serves from its own memory limiter with
``local_limit`` and keeps the streams it has). Either way ``ready()`` is False
until Redis answers again, and the replica rejoins.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ...aio import result_if_any
from ...errors import ProxyError, QueueFull, QueueTimeout, UnknownLimit, UnknownProvider
from ...ledger.fleet import FleetUsage
from ...ledger.report import UsageQuery
from ...ledger.store import LedgerRow
from ...limiter import (
    Budget,
    Clock,
    HolderStatus,
    KeyStatus,
    LimiterSettings,
    LoopClock,
    ModelStatus,
    Priority,
    ProviderStatus,
    SlotLease,
    WaiterStatus,
    policy,
)
from ...limiter.deadlines import Deadlines
from ...limiter.watchdog import SlotWatchdog
from ...logs import ThrottledLog
from ..memory import MemoryBackend
from . import lua

__all__ = ["RedisBackend", "RedisLease", "ScriptBatch"]

log = logging.getLogger("slotproxy.redis")

_UNCONFIGURED = -2
_POOL_SIZE = 32
_TRANSPORT_ARGS = {"websocket": "ws"}
_TRANSPORTS = {"ws": "websocket"}
"""A waiter's transport as the scripts keep it: absent for HTTP (most waiters), ``ws`` for a WebSocket."""
"""Redis connections one replica opens at most: the script batches' own, and a pool of the rest (one of them
the grant listener's) where callers beyond it wait their turn, so a deep queue never turns into connection
errors."""


class _PackedByHiredis:
    """redis-py's asyncio connections pack each command argument by argument in Python (an ENQUEUE and a
    RELEASE are some forty encodes, a fifth of a request's CPU here); its sync connections hand the
    command to hiredis's C packer instead, through this serializer, which the asyncio ones can use too."""

    _serializer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._serializer.pack(*args)


def _hiredis_packs() -> bool:
    """Whether hiredis is there with its packer (redis-py 5 accepts a hiredis without one)."""
    try:
        import hiredis
    except ImportError:
        return False
    return hasattr(hiredis, "pack_command")


_HIREDIS_PACKS = _hiredis_packs()
_packing_classes: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def packing_in_c(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (the connection class the URL chose: TCP, TLS or a Unix socket) packing commands with
    hiredis (installed with slotproxy, as ``redis[hiredis]``); where it is missing, ``base`` as it is."""
    if not _HIREDIS_PACKS:
        return base
    packing = _packing_classes.get(base)
    if packing is None:
        packing = _packing_classes[base] = type(f"{base.__name__}PackedByHiredis", (_PackedByHiredis, base), {})
    return packing


class ScriptBatch:
    """Script calls made in one event-loop turn go to Redis as one pipeline: one round trip for all of
    them, instead of one each. One batch is in flight at a time, and the calls made meanwhile form the
    next, so they reach Redis in the order they were made.

    With one batch in flight at a time, the batches have a connection of their own, and a batch is
    packed, sent and read on it directly: redis-py's pipeline and pool around each batch (checkout,
    command stack, retry wrapper, response callbacks) cost more than the commands themselves. A
    connection that fails is dropped by redis-py and opened again by the next batch; a first send on a
    connection a Redis restart broke is tried once more (the pool's ``retry``).

    Scripts run by their SHA; a Redis that does not know one (it restarted, or was flushed) is sent the
    script and the calls that missed it are sent again."""

    def __init__(self, redis: aioredis.Redis, scripts: Mapping[str, str]) -> None:
        self._redis = redis
        pool = redis.connection_pool
        # Built as the pool builds its own, but outside it: the pool's make_connection counts what it
        # makes in some redis-py versions, and this one is never checked out or returned.
        self._connection: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
        self._texts = dict(scripts)
        self._shas = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in scripts.items()}
        self._queued: list[tuple[str, list[str], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._sender: asyncio.Task[None] | None = None

    def call(self, name: str, *, keys: list[str], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.append((name, keys, args, future))
        if self._sender is None:
            self._sender = loop.create_task(self._send_all())
        return future

    async def _send_all(self) -> None:
        batch: list[tuple[str, list[str], tuple[Any, ...], asyncio.Future[Any]]] = []
        try:
            await asyncio.sleep(0)  # the rest of this loop turn joins the batch
            while self._queued:
                batch, self._queued = self._queued, []
                await self._send(batch)
                batch = []
        except BaseException:  # cancelled (the backend is closing): nobody may be left waiting
            for *_, future in (*batch, *self._queued):
                if not future.done():
                    future.set_exception(RedisError("the redis backend is closing"))
            self._queued = []
            raise
        finally:
            self._sender = None

    async def _send(self, batch: list[tuple[str, list[str], tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            results = await self._pipeline(batch)
            missed = [index for index, result in enumerate(results) if isinstance(result, NoScriptError)]
            if missed:
                for name in {batch[index][0] for index in missed}:
                    await self._redis.script_load(self._texts[name])
                for index, result in zip(missed, await self._pipeline([batch[i] for i in missed]), strict=True):
                    results[index] = result
        except (RedisError, OSError) as exc:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue  # its caller left
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _pipeline(self, batch: list[tuple[str, list[str], tuple[Any, ...], asyncio.Future[Any]]]) -> list[Any]:
        commands = [("EVALSHA", self._shas[name], len(keys), *keys, *args) for name, keys, args, _ in batch]
        connection = self._connection
        return await connection.retry.call_with_retry(  # type: ignore[no-any-return]
            lambda: _round_trip(connection, commands), lambda _error: connection.disconnect())

    async def close(self) -> None:
        await self._connection.disconnect()


async def _round_trip(connection: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send the commands in one write and read their replies in order; an error reply is its command's
    result. Any other failure leaves the connection closed by redis-py, with nothing left unread."""
    await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
    results: list[Any] = []
    for _ in commands:
        try:
            results.append(await connection.read_response())
        except ResponseError as exc:
            results.append(exc)
    return results


class RedisLease:
    """A slot held in Redis. ``release()`` is sync like the memory lease; the script runs in the background."""

    __slots__ = (
        "_backend",
        "granted_at",
        "granted_at_ms",
        "key",
        "lease_id",
        "on_reclaim",
        "priority",
        "provider",
        "queue_wait",
        "reclaimed",
        "released",
        "renewed_at",
        "seq",
        "waiter_id",
    )

    def __init__(self, backend: RedisBackend, provider: str, waiter_id: str, lease_id: str, granted_at_ms: int,
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

    __slots__ = ("asked_at", "client_bound", "client_wait", "deadline", "deadline_armed", "expiring", "future", "gone",
                 "in_redis", "key", "local", "model", "pattern", "priority", "provider", "seq", "wait_limit",
                 "waiter_id")

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

    @property
    def queued(self) -> bool:
        """Still waiting for Redis (for the queue deadlines): not granted, gone, expiring or served locally."""
        return not (self.gone or self.future.done() or self.expiring or self.local)


class RedisBackend:
    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "slotproxy",
        lease_ttl: float = 30.0,
        on_backend_error: str = "fail_closed",
        local_limit: int | None = None,
        clock: Clock | None = None,
        usage_retention: float = 30 * 86400.0,
    ) -> None:
        self.clock: Clock = clock or LoopClock()
        self.on_change: Callable[[], None] | None = None
        self.replica = uuid.uuid4().hex[:12]
        self._prefix = key_prefix
        self._lease_ttl_ms = int(lease_ttl * 1000)
        self._waiter_ttl_ms = max(3000, self._lease_ttl_ms)
        self._renew_every = max(0.05, min(lease_ttl / 3, 1.0))
        self._mode = on_backend_error
        self._local_limit = local_limit
        self._channel = f"{key_prefix}:grant:"
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=_POOL_SIZE - 1, timeout=None, socket_timeout=2, socket_connect_timeout=2,
            retry=_reconnect_once(), client_name=f"slotproxy-{self.replica}")
        pool.connection_class = packing_in_c(pool.connection_class)
        self._redis: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        self._batch = ScriptBatch(self._redis, {name: getattr(lua, name) for name in lua.__all__})
        self._scripts: dict[str, Callable[..., Awaitable[Any]]] = {
            name: functools.partial(self._batch.call, name) for name in lua.__all__}
        self._settings: dict[str, LimiterSettings] = {}
        self._configured: set[str] = set()
        self._starred: frozenset[str] = frozenset()
        self._waiters: dict[str, _Waiter] = {}
        self._key_cache: dict[str, list[str]] = {}
        self._leases: dict[str, RedisLease] = {}
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: set[asyncio.Future[Any]] = set()
        self._snapshot: dict[str, ProviderStatus] = {}
        self._reclaims: dict[str, int] = {}
        self._local = MemoryBackend(self.clock)
        self._sticky = policy.StickyKeys()
        self._deadlines: Deadlines[_Waiter] = Deadlines(self.clock, self._expire)
        self._watchdogs: dict[str, SlotWatchdog[RedisLease]] = {}
        """This replica's held slots per provider, under slot_timeout (a provider dropped by a reload keeps
        its watchdog for the slots still held)."""
        self.healthy = True
        self.error: str | None = None
        self._closed = False
        self._fleet_usage = FleetUsage(key_prefix, usage_retention)
        self._usage_lost = ThrottledLog(log, logging.WARNING, "the fleet's usage aggregates could not be written to "
                                        "redis (%s); this replica's own ledger still has the rows",
                                        interval=60.0)

    # ----- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Connect, push the config, and start the grant listener and the renew loop."""
        self._spawn(self._listen(), keep=True)
        self._spawn(self._renew_loop(), keep=True)
        self._spawn(self._usage_loop(), keep=True)
        if self._mode == "fail_closed":
            self._spawn(self._expiry_loop(), keep=True)
        try:
            await self._redis.ping()
            await self.flush()
            await self.refresh()
        except RedisError as exc:
            self._mark_unhealthy(exc)

    async def close(self) -> None:
        self._closed = True
        for lease in list(self._leases.values()):
            lease.release()
        self._send_usage()
        await self.flush()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._batch.close()
        await self._redis.aclose(close_connection_pool=True)

    def _spawn(self, coro: Any, *, keep: bool = False) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        bucket = self._tasks if keep else self._pending
        bucket.add(task)
        task.add_done_callback(bucket.discard)
        return task

    async def flush(self) -> None:
        """Wait for the background writes issued so far (releases, limits, backoffs)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    def _keys(self, provider: str) -> list[str]:
        base = f"{self._prefix}:{provider}:"
        return [base + part for part in ("cfg", "leases", "cooling", "waiters", "winfo", "whb", "granted", "seq")] + [
            f"{self._prefix}:stars"]

    def _keys_of(self, provider: str) -> list[str]:
        keys = self._key_cache.get(provider)
        if keys is None:
            keys = self._key_cache[provider] = self._keys(provider)
        return keys

    async def _run(self, name: str, provider: str, *args: Any) -> Any:
        try:
            result = await self._scripts[name](keys=self._keys_of(provider), args=args)
        except ResponseError:
            log.exception("redis script %s failed for provider=%s", name, provider)
            raise
        except RedisError as exc:
            self._mark_unhealthy(exc)
            raise
        self._mark_healthy()
        return result

    def _mark_unhealthy(self, exc: BaseException) -> None:
        if self.healthy:
            log.error("redis backend unreachable (%s: %s); mode %s", type(exc).__name__, exc, self._mode)
        self.healthy = False
        self.error = f"{type(exc).__name__}: {exc}"

    def _mark_healthy(self) -> None:
        if not self.healthy:
            log.info("redis backend reachable again; rejoining the shared limits")
            for provider in self._settings:
                self._spawn(self._configure_one(provider))
        self.healthy = True
        self.error = None

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

    async def _configure_one(self, provider: str) -> None:
        """Push one provider's settings. A Redis found without them has lost its data if this replica
        configured it before, or if other replicas are listening for grants: then grants wait two renew
        rounds, long enough for every replica to put back the leases it holds. A new deployment does not."""
        settings = self._settings[provider]
        recovery_ms = int((settings.recovery_after or 0) * 1000)
        others = provider in self._configured or await self._other_replicas_listening()
        settle_ms = int(2 * self._renew_every * 1000) if others else 0
        recovering = policy.recovering_notice("{N}", "{TARGET}", settings.recovery_after or 0.0)
        done = await self._guarded("CONFIGURE", provider, _limit_arg(settings.limit),
                                   int(settings.release_cooldown * 1000), recovering,
                                   recovery_ms, self._lease_ttl_ms, self._channel, settle_ms, _layout(settings))
        if done is not None:
            self._configured.add(provider)

    async def _other_replicas_listening(self) -> bool:
        try:
            channels = await self._redis.pubsub_channels(f"{self._channel}*")
        except RedisError:
            return True
        own = (self._channel + self.replica).encode()
        return any(channel != own for channel in channels)

    async def _guarded(self, name: str, provider: str, *args: Any) -> Any:
        try:
            return await self._run(name, provider, *args)
        except RedisError:
            return None

    def has_provider(self, name: str) -> bool:
        return name in self._settings

    def usage_limiter(self, provider: str) -> None:
        """The usage gate counts this process's slots only: with several replicas it has nothing to attach to."""
        return

    # ----- acquire ---------------------------------------------------------------

    async def acquire(self, provider: str, priority: Priority, *, seq: int | None = None,
                      client_wait: float | None = None, model: str | None = None,
                      key: str | None = None) -> SlotLease:
        settings = self._settings.get(provider)
        if settings is None:
            raise UnknownProvider.named(provider)
        if not self.healthy and self._mode == "local":
            return await self._local.acquire(provider, priority, seq=seq, client_wait=client_wait, model=model,
                                             key=key)
        loop = asyncio.get_running_loop()
        waiter_id = f"{self.replica}-{next(self._ids)}"
        waiter = _Waiter(waiter_id, loop.create_future(), provider, priority, loop.time())
        waiter.wait_limit, waiter.client_bound = policy.queue_wait_limit(settings.queue_timeout, client_wait)
        waiter.client_wait = client_wait
        waiter.model = model
        waiter.key = key if settings.pool() else None
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
            chosen = _text(await self._run("PICK_KEY", provider, preferred))
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
            hint = _hint_from(answer)
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
                                                     key=waiter.key)
                self._arm_deadline(waiter)
                await self._wait_or_expire(waiter)
        status, detail, waiter.seq = int(result[0]), _text(result[1]), int(result[2])
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
                            "waiting); retry later", retry_after=_hint_from(detail))
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
                waiter.key or "", _TRANSPORT_ARGS.get(priority.transport, ""), (waiter.model or "")[:256])
        result = await self._run("ENQUEUE", waiter.provider, *args)
        if int(result[0]) == _UNCONFIGURED:
            await self._configure_one(waiter.provider)
            result = await self._run("ENQUEUE", waiter.provider, *args)
            if int(result[0]) == _UNCONFIGURED:
                raise RedisError(f"redis has no settings for provider '{waiter.provider}' and CONFIGURE failed")
        return result

    def _adopt(self, waiter_id: str, waiter: _Waiter, grant: str) -> RedisLease:
        lease_id, granted_at, key = _grant_parts(grant)
        queue_wait = asyncio.get_running_loop().time() - waiter.asked_at
        lease = RedisLease(self, waiter.provider, waiter_id, lease_id, int(granted_at), queue_wait, waiter.priority,
                           waiter.seq or 0, key)
        self._sticky.remember(waiter.priority.conversation, key)
        self._leases[lease_id] = lease
        self._watchdogs[waiter.provider].hold(lease)
        return lease

    @staticmethod
    def _slot_timed_out(lease: RedisLease) -> None:
        lease.reclaim("slot_timeout")

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
                   lambda answer: self._schedule_dispatch(provider, int(_text(answer[1]))))

    def _send(self, name: str, provider: str, args: tuple[Any, ...],
              on_answer: Callable[[Any], None] | None = None) -> None:
        """A write nobody waits for (a release, a backoff, a budget): it joins this loop turn's batch at
        once, with no task of its own, so it reaches Redis before any call made after it (a retry's
        ENQUEUE never overtakes the BACKOFF its 429 caused). ``flush()`` waits for it."""
        answer = self._batch.call(name, keys=self._keys_of(provider), args=args)
        self._pending.add(answer)
        answer.add_done_callback(functools.partial(self._answered, name, provider, on_answer))

    def _answered(self, name: str, provider: str, on_answer: Callable[[Any], None] | None,
                  answer: asyncio.Future[Any]) -> None:
        """One done callback (each costs the loop a turn's handle): no longer pending, then the answer."""
        self._pending.discard(answer)
        if answer.cancelled():
            return
        error = answer.exception()
        if isinstance(error, ResponseError):
            log.error("redis script %s failed for provider=%s: %s", name, provider, error)
        elif isinstance(error, RedisError):
            self._mark_unhealthy(error)
        elif error is None:
            self._mark_healthy()
            if on_answer is not None:
                on_answer(answer.result())

    def _schedule_dispatch(self, provider: str, at_ms: int) -> None:
        """Run a dispatch when a pause or cooldown ends, if this replica has waiters then."""
        if at_ms <= 0 or not self._waiters:
            return
        delay = max(0.0, at_ms / 1000.0 - time.time()) + 0.005
        if delay > self._renew_every:
            return
        loop = asyncio.get_running_loop()
        loop.call_later(delay, lambda: self._spawn(self._guarded("DISPATCH", provider, self._lease_ttl_ms, self._channel)))

    async def _listen(self) -> None:
        while not self._closed:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel + self.replica)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        waiter_id, grant = _text(message["data"]).split(" ", 1)
                        self._resolve(waiter_id, grant)
            except (RedisError, OSError) as exc:
                self._mark_unhealthy(exc)
                await asyncio.sleep(self._renew_every)
            finally:
                await pubsub.aclose()

    # ----- the fleet's usage -----------------------------------------------------------

    def record_usage(self, row: LedgerRow) -> None:
        self._fleet_usage.add(row)

    async def _usage_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(1.0)
            self._send_usage()

    def _send_usage(self) -> None:
        """This replica's requests since the last write, added to the fleet's hourly aggregates."""
        for key, args in self._fleet_usage.take():
            answer = self._batch.call("USAGE_ADD", keys=[key], args=tuple(args))
            self._pending.add(answer)
            answer.add_done_callback(self._usage_written)

    def _usage_written(self, answer: asyncio.Future[Any]) -> None:
        self._pending.discard(answer)
        error = None if answer.cancelled() else answer.exception()
        if error is not None:
            self._usage_lost.event(str(error) or type(error).__name__)

    async def fleet_usage(self, query: UsageQuery) -> dict[str, object] | None:
        if query.per_replica:
            return None
        self._send_usage()
        await self.flush()
        wanted = self._fleet_usage.keys(query, self._settings)
        pipeline = self._redis.pipeline(transaction=False)
        for key, _, _ in wanted:
            pipeline.hgetall(key)
        hashes = await pipeline.execute() if wanted else []
        return FleetUsage.answer(query, ((provider, hour, {_text(k): _text(v) for k, v in fields.items()})
                                         for (_, provider, hour), fields in zip(wanted, hashes, strict=True)))

    async def _renew_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._renew_every)
            try:
                await self._renew_once()
            except RedisError:
                continue

    async def _expiry_loop(self) -> None:
        """fail_closed: a slot whose lease could not be renewed for 90% of ``lease_ttl`` is given up
        (its stream aborted) before Redis lets it expire and grants it elsewhere."""
        while not self._closed:
            await asyncio.sleep(self._renew_every / 2)
            deadline = asyncio.get_running_loop().time() - 0.9 * self._lease_ttl_ms / 1000
            for lease in [lease for lease in self._leases.values() if lease.renewed_at < deadline]:
                lease.reclaim("its lease could not be renewed in redis before it expired")

    async def _renew_once(self) -> None:
        if not self.healthy:
            await self._redis.ping()
            self._mark_healthy()
        for provider in list(self._settings):
            leases = [lease for lease in self._leases.values() if lease.provider == provider]
            waiters = [wid for wid, w in self._waiters.items()
                       if w.provider == provider and w.in_redis and w.queued]
            sent_at = asyncio.get_running_loop().time()
            result = await self._run("RENEW", provider, self._lease_ttl_ms, self._waiter_ttl_ms, self._channel,
                                     len(leases), *(lease.lease_id for lease in leases),
                                     *(lease.granted_at_ms for lease in leases), *waiters)
            missing, grants, lost, next_at, configured = result
            for lease in leases:
                lease.renewed_at = sent_at
            if not int(configured):
                log.warning("provider=%s has no settings in redis (it lost its data); configuring it again",
                            provider)
                self._spawn(self._configure_one(provider))
            for lease_id in map(_text, missing):
                gone = self._leases.get(lease_id)
                if gone is not None:
                    gone.reclaim("its lease expired in redis")
            for grant in map(_text, grants):
                waiter_id, rest = grant.split(" ", 1)
                self._resolve(waiter_id, rest, picked_up_for=provider)
            for waiter_id in map(_text, lost):
                self._requeue_lost(waiter_id)
            self._schedule_dispatch(provider, int(_text(next_at)))

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
            self._resolve(waiter_id, _text(result[1]), picked_up_for=waiter.provider)
        elif waiter.future.done():
            # Served or gone while this ENQUEUE was in flight: take the new queue entry out again,
            # but never the slot the waiter holds under the same id.
            keep = "1" if waiter_id in self._leases else "0"
            self._spawn(self._guarded("CANCEL", waiter.provider, waiter_id, self._lease_ttl_ms, self._channel, keep,
                                      "0"))

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
            reduced, limit, paused_until_ms = int(answer[0]), _text(answer[1]), float(_text(answer[2]))
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
                   lambda next_at: self._schedule_dispatch(provider, int(_text(next_at))))
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
        self._spawn(self._guarded("SET_LIMIT", provider, _limit_arg(limit), self._lease_ttl_ms, self._channel, ""))

    def set_key_limit(self, provider: str, key: str, limit: int | None) -> None:
        self._require(provider)
        names = [k.name for k in self._settings[provider].keys]
        if key not in names:
            raise UnknownLimit(f"provider '{provider}' has no key '{key}' (configured: {', '.join(names) or 'none'})")
        policy.validate_limit(limit)
        self._spawn(self._guarded("SET_LIMIT", provider, _limit_arg(limit), self._lease_ttl_ms, self._channel,
                                  f"k:{key}"))

    def set_model_limit(self, provider: str, pattern: str, limit: int | None) -> None:
        self._require(provider)
        patterns = [cap.pattern for cap in self._settings[provider].models]
        if pattern not in patterns:
            raise UnknownLimit(f"provider '{provider}' has no model cap '{pattern}' (configured: "
                               f"{', '.join(patterns) or 'none'})")
        policy.validate_limit(limit)
        self._spawn(self._guarded("SET_LIMIT", provider, _limit_arg(limit), self._lease_ttl_ms, self._channel,
                                  f"m:{pattern}"))

    def set_cooldown(self, provider: str, seconds: float) -> None:
        self._require(provider)
        self._spawn(self._guarded("SET_COOLDOWN", provider, int(seconds * 1000)))

    def set_starred(self, starred: frozenset[str]) -> None:
        self._starred = frozenset(starred)
        self._local.set_starred(self._starred)
        self._spawn(self._push_stars(self._starred))

    async def _push_stars(self, starred: frozenset[str]) -> None:
        key = f"{self._prefix}:stars"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                if starred:
                    pipe.sadd(key, *sorted(starred))
                await pipe.execute()
        except RedisError as exc:
            self._mark_unhealthy(exc)
            return
        for provider in list(self._settings):
            await self._guarded("RESTAR", provider, self._lease_ttl_ms, self._channel)

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
            self._snapshot[provider] = self._status_from(provider, result)

    def _status_from(self, provider: str, result: list[Any]) -> ProviderStatus:
        raw, leases, cooling, queued, now_ms, infos, levels, pause_end, held = result
        cfg = _pairs(raw)
        now = int(_text(now_ms))
        paused_until = int(_text(pause_end))
        auto_from = cfg.get("auto_reduced_from")
        queue = []
        for item in infos:
            info = _json(item)
            queue.append(WaiterStatus(workspace=info["w"], starred=bool(info["starred"]),
                                      prompt_started_at=int(info["p"]), waited_ms=now - int(info["t"]),
                                      conversation=info["c"] or None,
                                      transport=_TRANSPORTS.get(info.get("tr", ""), "http")))
        counters = {name: int(cfg.get(name, "0") or 0) for name in policy.COUNTERS}
        counters["reclaims"] = self._reclaims.get(provider, 0)
        settings = self._settings[provider]
        by_level = {_text(lid): (_pairs(pairs), int(count)) for lid, pairs, count in levels}
        for fields, _ in by_level.values():
            for name in ("backoffs", "auto_reductions"):
                counters[name] += int(fields.get(name, "0") or 0)
        keys = tuple(_key_status(key.name, key.name in {k.name for k in settings.pool()},
                                 *by_level.get(f"k:{key.name}", ({}, 0)), now, settings.budgets)
                     for key in settings.keys)
        models = []
        for cap in settings.models:
            fields, count = by_level.get(f"m:{cap.pattern}", ({}, 0))
            models.append(ModelStatus(cap.pattern, _limit_value(fields.get("limit")),
                                      _limit_value(fields.get("configured_limit")), count))
        return ProviderStatus(
            provider=provider,
            limit=_limit_value(cfg.get("limit")),
            configured_limit=_limit_value(cfg.get("configured_limit")),
            in_flight=int(leases) + int(cooling),
            queued=int(queued),
            paused=paused_until > now,
            paused_until=paused_until if paused_until > now else None,
            cooldown_ms=int(cfg.get("cooldown_ms", "0") or 0),
            auto_reduced=auto_from is not None,
            auto_reduced_from=int(auto_from) if auto_from is not None else None,
            notice=cfg.get("notice"),
            queue=tuple(queue),
            counters=counters,
            keys=keys,
            models=tuple(models),
            budget=_budget_status(cfg, now) if settings.budgets and not settings.pool() else None,
            holders=tuple(_holder(_json(item), now) for item in held),
        )

    def statistics(self, *, queue_detail: bool = True) -> list[ProviderStatus]:
        statuses = [self.provider_status(name) for name in self._settings]
        return statuses if queue_detail else [replace(status, queue=()) for status in statuses]

    def provider_status(self, provider: str) -> ProviderStatus:
        self._require(provider)
        if not self.healthy and self._mode == "local":
            status = self._local.provider_status(provider)
        else:
            status = self._snapshot.get(provider) or self._unread_status(provider)
        return replace(status, local_in_flight=self.local_in_flight(provider))

    def _unread_status(self, provider: str) -> ProviderStatus:
        """Before Redis answered (or while it does not): the settings, and this replica's own slots."""
        settings = self._settings[provider]
        keys = tuple(_key_status(key.name, key.available, {"limit": _limit_arg(key.limit),
                                                           "configured_limit": _limit_arg(key.limit)},
                                 0, 0, settings.budgets) for key in settings.keys)
        models = tuple(ModelStatus(cap.pattern, cap.limit, cap.limit, 0) for cap in settings.models)
        return ProviderStatus(provider=provider, limit=settings.limit, configured_limit=settings.limit,
                              in_flight=self.local_in_flight(provider), queued=0, paused=False,
                              paused_until=None, cooldown_ms=int(settings.release_cooldown * 1000),
                              auto_reduced=False, auto_reduced_from=None, notice=None, keys=keys, models=models)

    def local_in_flight(self, provider: str) -> int:
        return sum(1 for lease in self._leases.values() if lease.provider == provider)

    def backend_status(self) -> dict[str, Any]:
        return {"kind": "redis", "healthy": self.healthy, "mode": self._mode, "error": self.error,
                "replica": self.replica,
                "degraded": None if self.healthy else ("local" if self._mode == "local" else "fail_closed")}

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

    def in_flight(self) -> int:
        return len(self._leases) + self._local.in_flight()

    def ready(self) -> bool:
        return self.healthy


def _reconnect_once() -> Retry:
    """After Redis restarts, every pooled connection is dead: each one's first command fails
    with a ConnectionError before the new server ever saw it. One immediate retry on a fresh
    connection makes that invisible. Should a reply be lost after the script ran, running it again
    is safe: ENQUEUE is idempotent per waiter id, RELEASE and CANCEL per lease, and a repeated
    BACKOFF falls in the same pause (no second reduction); at worst a counter counts it twice."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def _hint_from(answer: Any) -> float:
    """Retry-After from a script's "paused_until now" (ms), by the policy's rule."""
    paused_until, now = (int(part) for part in _text(answer).split(" "))
    return policy.retry_after_hint(now / 1000, paused_until / 1000 if paused_until else None)


def _layout(settings: LimiterSettings) -> str:
    """The provider's keys, model caps and share, as CONFIGURE stores them for the scripts."""
    layout: dict[str, Any] = {
        "keys": [{"n": key.name, "l": _limit_arg(key.limit), "a": 1 if key.available else 0} for key in settings.keys],
        "models": [{"p": cap.pattern, "l": _limit_arg(cap.limit)} for cap in settings.models],
    }
    if settings.max_share is not None:
        layout["share"] = settings.max_share
    return json.dumps(layout)


def _grant_parts(grant: str) -> tuple[str, str, str | None]:
    """A grant as the scripts write it: "lease granted_at key" (key empty without a pool)."""
    lease_id, granted_at, *rest = grant.split(" ")
    return lease_id, granted_at, (rest[0] or None) if rest else None


def _pairs(raw: list[Any]) -> dict[str, str]:
    return {_text(raw[i]): _text(raw[i + 1]) for i in range(0, len(raw), 2)}


def _blocked(fields: dict[str, str], name: str, now: int) -> int | None:
    value = int(fields.get(name, "0") or 0)
    return value if value > now else None


def _budget_status(fields: dict[str, str], now: int) -> dict[str, int | None]:
    """A level's budget as status shows it (``Budget.to_dict``, as the memory backend gives it)."""
    budget = Budget()
    raw = fields.get("budget")
    if raw:
        remaining_requests, remaining_tokens, reset = json.loads(raw)
        budget = Budget(remaining_requests=remaining_requests, remaining_tokens=remaining_tokens,
                        reset_at=int(reset) / 1000 if reset not in ("", None) else None)
    held = _blocked(fields, "held_until", now)
    return budget.to_dict(None if held is None else held / 1000)


def _key_status(name: str, available: bool, fields: dict[str, str], count: int, now: int,
                budgets: bool) -> KeyStatus:
    auto_from = fields.get("auto_reduced_from")
    return KeyStatus(
        name=name,
        available=available,
        limit=_limit_value(fields.get("limit")),
        configured_limit=_limit_value(fields.get("configured_limit")),
        in_flight=count,
        paused_until=_blocked(fields, "paused_until", now),
        auto_reduced_from=int(auto_from) if auto_from is not None else None,
        notice=fields.get("notice"),
        budget=_budget_status(fields, now) if budgets else None,
    )


def _holder(info: dict[str, Any], now: int) -> HolderStatus:
    """A lease's ``lmap`` entry as a status row (a lease put back after Redis lost its data has no entry)."""
    granted_at = int(info.get("t") or now)
    return HolderStatus(workspace=info.get("w") or "default", starred=bool(info.get("s")),
                        conversation=info.get("c") or None, model=info.get("md") or None, key=info.get("k") or None,
                        transport=_TRANSPORTS.get(info.get("tr") or "", "http"), granted_at=granted_at,
                        held_ms=max(0, now - granted_at))


def _limit_arg(limit: int | None) -> str:
    return "none" if limit is None else str(limit)


def _limit_value(raw: str | None) -> int | None:
    if raw is None or raw in ("", "none"):
        return None
    return int(raw)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _json(value: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_text(value))
    return data
