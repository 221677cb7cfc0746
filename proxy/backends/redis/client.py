"""One replica's connection to Redis: the pool, commands packed by hiredis, script calls batched into one
pipeline per event-loop turn, and ``ScriptClient``, which runs the scripts, keeps the background writes
and tasks, and says whether Redis answers.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import (
    AskError,
    ClusterError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from . import lua

SCRIPTS: dict[str, str] = {name: getattr(lua, name) for name in lua.__all__}


class Wire(Protocol):
    """What the scripts need of the way to Redis (``link.Link``: one server, Sentinel or a Cluster)."""

    redis: Any

    def batch_for(self, key: str) -> ScriptBatch: ...

    def watch_primary(self, reached: Callable[[str], None]) -> None: ...

    async def start(self) -> None: ...

    async def refresh(self) -> None: ...

    async def ping(self) -> None: ...

    async def primary(self) -> str | None: ...

    def reached(self) -> str | None: ...

    async def away_for_all(self, reached: str | None) -> bool: ...

    async def close(self) -> None: ...

__all__ = ["POOL_SIZE", "SCRIPTS", "ScriptBatch", "ScriptClient", "Wire", "connect", "packing_in_c", "reconnect_once",
           "text"]

log = logging.getLogger("slotproxy.redis")

POOL_SIZE = 32
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


def reconnect_once() -> Retry:
    """After Redis restarts, every pooled connection is dead: each one's first command fails
    with a ConnectionError before the new server ever saw it. One immediate retry on a fresh
    connection makes that invisible. Should a reply be lost after the script ran, running it again
    is safe: ENQUEUE is idempotent per waiter id, RELEASE and CANCEL per lease, and a repeated
    BACKOFF falls in the same pause (no second reduction); at worst a counter counts it twice."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def connect(url: str, replica: str, **options: Any) -> aioredis.Redis:
    """A client on a pool of at most ``POOL_SIZE`` - 1 connections (the script batches have their own), which
    callers beyond it wait for; each connection named ``slotproxy-<replica>`` and packing with hiredis."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=POOL_SIZE - 1, timeout=None, socket_timeout=2, socket_connect_timeout=2,
        retry=reconnect_once(), client_name=f"slotproxy-{replica}", **options)
    pool.connection_class = packing_in_c(pool.connection_class)
    return aioredis.Redis(connection_pool=pool)


_CLOSE_WAIT = 1.0
"""How long closing waits for a batch in flight to give up."""


class ScriptBatch:
    """Script calls made in one event-loop turn go to Redis as one pipeline: one round trip for all of
    them, instead of one each. One batch is in flight at a time, and the calls made meanwhile form the
    next, so they reach Redis in the order they were made.

    With one batch in flight at a time, the batches have a connection of their own, and a batch is
    packed, sent and read on it directly: redis-py's pipeline and pool around each batch (checkout,
    command stack, retry wrapper, response callbacks) cost more than the commands themselves. A
    connection that fails is dropped by redis-py and opened again by the next batch; a first send on a
    connection a Redis restart broke is tried once more (the pool's ``retry``).

    Scripts run by their SHA. Each is loaded ahead of its first call on a connection, in the same round
    trip, so that call keeps its turn (sent again after the batch, it would run after the calls made after
    it: a replica's first RELEASE after its next ENQUEUE). A Redis that forgot one meanwhile (flushed) is
    sent the script and the calls that missed it are sent again."""

    def __init__(self, redis: aioredis.Redis, scripts: Mapping[str, str]) -> None:
        self._redis = redis
        pool = redis.connection_pool
        # Built as the pool builds its own, but outside it: the pool's make_connection counts what it
        # makes in some redis-py versions, and this one is never checked out or returned.
        self._connection: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
        self._texts = dict(scripts)
        self._shas = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in scripts.items()}
        self._loaded: set[str] = set()
        """The scripts loaded on this connection's server since it was opened."""
        self._queued: list[tuple[str, list[str], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._closed = False

    def call(self, name: str, *, keys: list[str], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._closed:  # a late write must not open the connection again after close
            future.set_exception(RedisError("the redis backend is closed"))
            return future
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
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", self._shas[name], len(keys), *keys, *args) for name, keys, args, _ in batch]
        connection = self._connection
        if not connection.is_connected:
            self._loaded.clear()  # it may reach a Redis that restarted
        loads: list[str] = []
        if len(self._loaded) < len(self._texts):
            loads = [name for name in dict.fromkeys(name for name, *_ in batch) if name not in self._loaded]
            commands[:0] = [("SCRIPT", "LOAD", self._texts[name]) for name in loads]
        results: list[Any] = await connection.retry.call_with_retry(
            lambda: _round_trip(connection, commands), lambda _error: connection.disconnect())
        if not loads:
            return results
        self._loaded.update(name for name, loaded in zip(loads, results, strict=False)
                            if not isinstance(loaded, Exception))
        return results[len(loads):]

    async def close(self) -> None:
        """End the batch in flight (its callers get an error) and close the connection; later calls fail
        at once, so nothing opens it again. A batch still trying to reach an unreachable Redis is not waited
        for past ``_CLOSE_WAIT``: its connection is closed when it ends."""
        self._closed = True
        sender = self._sender
        if sender is not None:
            sender.cancel()
            await asyncio.wait({sender}, timeout=_CLOSE_WAIT)
            if not sender.done():
                sender.add_done_callback(lambda _: asyncio.ensure_future(self._connection.disconnect()))
        await self._connection.disconnect()


async def _round_trip(connection: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send the commands in one write and read their replies in order; an error reply is its command's
    result. Any other failure leaves the connection closed by redis-py, with nothing left unread. A closed
    connection is opened by its own ``connect`` first: a Sentinel-managed one asks the sentinels for the
    primary there (the send's own reconnect would go to the address it was built with)."""
    if not connection.is_connected:
        await connection.connect()
    await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
    results: list[Any] = []
    for _ in commands:
        try:
            results.append(await connection.read_response())
        except ResponseError as exc:
            results.append(exc)
    return results


class ScriptClient(ABC):
    """The scripts as one replica runs them: awaited (``_run``), or sent and left to finish (``_send``,
    ``_spawn``; ``flush`` waits for them), each keeping ``healthy`` up to date. A Redis that answers again
    after failing is handed to ``_rejoin``."""

    def __init__(self, link: Wire, replica: str, *, key_prefix: str, mode: str) -> None:
        self.replica = replica
        self._prefix = key_prefix
        self._mode = mode
        self._channel = f"{key_prefix}:grant:"
        self._link = link
        self._redis: Any = link.redis
        self._scripts: dict[str, Callable[..., Awaitable[Any]]] = {
            name: functools.partial(self._call, name) for name in SCRIPTS}
        """Each script as awaited: through the batch of the node its keys are on."""
        self._key_cache: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: set[asyncio.Future[Any]] = set()
        self.healthy = True
        self.error: str | None = None
        self._closed = False

    @abstractmethod
    def _rejoin(self) -> None:
        """Redis answers again after failing: put back what it may have lost."""

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
        """Every key of one provider under one hash tag (``{prefix:provider}``): in a Redis Cluster its
        scripts run on the one node that holds that slot, and different providers spread over the nodes."""
        base = f"{{{self._prefix}:{provider}}}:"
        return [base + part for part in ("cfg", "leases", "cooling", "waiters", "winfo", "whb", "granted", "seq",
                                         "stars")]

    def _keys_of(self, provider: str) -> list[str]:
        keys = self._key_cache.get(provider)
        if keys is None:
            keys = self._key_cache[provider] = self._keys(provider)
        return keys

    async def _run(self, name: str, provider: str, *args: Any) -> Any:
        keys = self._keys_of(provider)
        try:
            try:
                result = await self._scripts[name](keys=keys, args=args)
            except ResponseError as exc:
                if not moved(exc):
                    raise
                await self._link.refresh()  # a Cluster's slots moved (a failover): ask again, once
                result = await self._scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            if moved(exc):
                self._mark_unhealthy(exc)
                raise RedisError(str(exc)) from exc
            log.exception("redis script %s failed for provider=%s", name, provider)
            raise
        except RedisError as exc:
            self._mark_unhealthy(exc)
            raise
        self._mark_healthy()
        return result

    def _call(self, name: str, *, keys: list[str], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        return self._link.batch_for(keys[0]).call(name, keys=keys, args=args)

    def _mark_unhealthy(self, exc: BaseException) -> None:
        words = in_words(exc)
        if self.healthy:
            log.error("redis backend unreachable (%s); on_backend_error: %s", words, self._mode)
        self.healthy = False
        self.error = words

    def _mark_healthy(self) -> None:
        if not self.healthy:
            log.info("redis backend reachable again; rejoining the shared limits")
            self._rejoin()
        self.healthy = True
        self.error = None

    async def _guarded(self, name: str, provider: str, *args: Any) -> Any:
        try:
            return await self._run(name, provider, *args)
        except RedisError:
            return None

    def _send(self, name: str, provider: str, args: tuple[Any, ...],
              on_answer: Callable[[Any], None] | None = None) -> None:
        """A write nobody waits for (a release, a backoff, a budget): it joins this loop turn's batch at
        once, with no task of its own, so it reaches Redis before any call made after it (a retry's
        ENQUEUE never overtakes the BACKOFF its 429 caused). ``flush()`` waits for it."""
        keys = self._keys_of(provider)
        answer = self._link.batch_for(keys[0]).call(name, keys=keys, args=args)
        self._pending.add(answer)
        answer.add_done_callback(functools.partial(self._answered, name, provider, on_answer))

    def _answered(self, name: str, provider: str, on_answer: Callable[[Any], None] | None,
                  answer: asyncio.Future[Any]) -> None:
        """One done callback (each costs the loop a turn's handle): no longer pending, then the answer."""
        self._pending.discard(answer)
        if answer.cancelled():
            return
        error = answer.exception()
        if isinstance(error, ResponseError) and moved(error):
            self._mark_unhealthy(error)
            self._spawn(self._link.refresh())
        elif isinstance(error, ResponseError):
            log.error("redis script %s failed for provider=%s: %s", name, provider, error)
        elif isinstance(error, RedisError):
            self._mark_unhealthy(error)
        elif error is None:
            self._mark_healthy()
            if on_answer is not None:
                on_answer(answer.result())


_MOVED = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


def moved(error: ResponseError) -> bool:
    """A Cluster's answer that the slot is elsewhere or its node is down: not a script's error."""
    return isinstance(error, (ClusterError, AskError, TryAgainError)) or str(error).startswith(_MOVED)


_CONNECTING = re.compile(r"Error (-?\d+) connecting to ([^ ]+?)\.? ")
_NO_PRIMARY = re.compile(r"No master found for '([^']*)'")
_ERRNO_WORDS = {"111": "connection refused", "-2": "name not known", "-3": "name not resolved now",
                "113": "no route to host", "110": "timed out"}


def in_words(error: BaseException) -> str:
    """A Redis client error as a sentence with the address, not redis-py's wording or a class name."""
    message = str(error)
    connecting = _CONNECTING.match(message + " ")
    if connecting is not None:
        errno, address = connecting.groups()
        return f"could not connect to {address} ({_ERRNO_WORDS.get(errno, 'error ' + errno)})"
    if isinstance(error, MasterNotFoundError):
        service = _NO_PRIMARY.match(message)
        name = f"service '{service.group(1)}'" if service else "the service"
        return f"no sentinel names a primary for {name} that answers (a failover may be under way)"
    if isinstance(error, ClusterError):
        return f"the Redis Cluster answered that it is down ({message})"
    if isinstance(error, TimeoutError) or "Timeout" in type(error).__name__:
        return f"Redis did not answer in time ({message})" if message else "Redis did not answer in time"
    if "Connection closed by server" in message:
        return "the Redis server closed the connection"
    return message or type(error).__name__


def text(value: Any) -> str:
    """A reply as text (redis-py gives bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)
