"""Where Redis is: one server at a URL, a primary that Sentinel names (and follows through a failover), or a
Redis Cluster. Each gives the backend the same two things: a client for plain commands, and the script
batch for a provider's keys (every key of one provider shares a hash tag, so in a Cluster its scripts run on
the one node that holds that tag's slot).
"""

from __future__ import annotations

import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.cluster import key_slot
from redis.exceptions import RedisError

from .client import POOL_SIZE, ScriptBatch, connect, packing_in_c, reconnect_once

__all__ = ["ClusterLink", "Link", "RedisTarget", "SentinelLink", "SingleLink", "open_link"]

_TIMEOUT = 2.0
_SENTINEL_PING_LATE_MS = 1500
"""A sentinel pings the primary every second; a last good reply older than this means the primary is away."""


@dataclass(frozen=True)
class RedisTarget:
    """How to reach Redis, as the config's ``backend`` says (secrets kept out of ``repr``)."""

    url: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    cluster: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    tls: bool = False

    @property
    def topology(self) -> str:
        return "sentinel" if self.sentinels else "cluster" if self.cluster else "single"

    def tls_options(self) -> dict[str, Any]:
        """redis-py's TLS keywords: the system's CAs unless ``ca_file``; a client certificate if given."""
        if not self.tls:
            return {}
        options: dict[str, Any] = {"ssl": True, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        if self.ca_file:
            options["ssl_ca_certs"] = self.ca_file
        if self.cert_file:
            options["ssl_certfile"] = self.cert_file
            options["ssl_keyfile"] = self.key_file
        return options


def address_of(url: str) -> str:
    """host:port of a redis URL, never its credentials."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}"


class Link(ABC):
    """One replica's way to Redis."""

    redis: Any
    """The client for plain commands (ping, pub/sub, pipelines of reads)."""

    def __init__(self, scripts: Mapping[str, str]) -> None:
        self._scripts = dict(scripts)

    @abstractmethod
    def batch_for(self, key: str) -> ScriptBatch:
        """The batch that runs scripts on ``key`` (and the other keys of its hash tag)."""

    @abstractmethod
    async def primary(self) -> str | None:
        """The address written to now (host:port), as far as this link knows."""

    def reached(self) -> str | None:
        """The primary this link's connections last reached, where it can move (Sentinel); else None."""
        return None

    def watch_primary(self, reached: Callable[[str], None]) -> None:
        """Have ``reached`` called with the primary's address (host:port) each time one of this link's
        connections reaches one, whichever task made it reconnect. Only Sentinel moves the primary under
        the link's feet; the others never call it."""

    async def start(self) -> None:
        """Learn the topology before the first script (a Cluster's slots)."""

    async def refresh(self) -> None:
        """The topology changed under us: look again."""

    async def ping(self) -> None:
        await self.redis.ping()

    async def away_for_all(self, reached: str | None) -> bool:
        """Whether Redis is away for every replica, not only for this one: its primary down (failing over)
        as a third party sees it, or replaced by a primary other than ``reached`` (the one last reached).
        Without such a party (one server, a Cluster) this replica cannot tell, and says no."""
        return False

    @abstractmethod
    async def close(self) -> None: ...


class SingleLink(Link):
    """One server (or a primary behind a fixed address) at ``url``."""

    def __init__(self, url: str, replica: str, scripts: Mapping[str, str], **options: Any) -> None:
        super().__init__(scripts)
        self.redis = connect(url, replica, **options)
        self._batch = ScriptBatch(self.redis, scripts)
        self._address = address_of(url)

    def batch_for(self, key: str) -> ScriptBatch:
        return self._batch

    async def primary(self) -> str | None:
        return self._address

    async def close(self) -> None:
        await self._batch.close()
        await self.redis.aclose(close_connection_pool=True)


class _SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):
    """The primary Sentinel names, reached through a pool whose callers wait for a free connection (at most
    ``POOL_SIZE`` - 1), as the single server's pool does. It keeps the primary its connections last reached:
    the one actually served, which after a failover is known as soon as any connection (a script batch's,
    the grant listener's, a ping's) has reconnected, and not only when the health check asks the sentinels."""

    reached: str | None = None
    on_reached: Callable[[str], None] | None = None

    def connected_to(self, host: str, port: int | str) -> None:
        self.reached = f"{host}:{port}"
        if self.on_reached is not None:
            self.on_reached(self.reached)


class _ReportingConnection(SentinelManagedConnection):
    """A connection to the primary Sentinel named that tells its pool where it got to."""

    async def connect_to(self, address: tuple[str, int | str]) -> None:
        await super().connect_to(address)
        self.connection_pool.connected_to(*address)


class _ReportingSSLConnection(_ReportingConnection, SentinelManagedSSLConnection):
    pass


def _reporting(base: type[SentinelManagedConnection]) -> type[SentinelManagedConnection]:
    return _ReportingSSLConnection if issubclass(base, SentinelManagedSSLConnection) else _ReportingConnection


class SentinelLink(Link):
    """The primary of ``service`` as the sentinels name it; after a failover, connections open to the new one
    (the script batch's too: its connection asks the sentinels when it reconnects)."""

    def __init__(self, target: RedisTarget, replica: str, scripts: Mapping[str, str]) -> None:
        super().__init__(scripts)
        assert target.service is not None
        # One immediate retry, as for the data nodes: redis-py's default (ten, backing off up to a second)
        # spends seconds on each dead sentinel before asking the next one.
        sentinel_kwargs: dict[str, Any] = {"socket_timeout": _TIMEOUT, "socket_connect_timeout": _TIMEOUT,
                                           "retry": reconnect_once()}
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
        tls = target.tls_options()
        sentinel_kwargs.update(tls)
        self._sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs,
                                  socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT,
                                  username=target.username, password=target.password,
                                  client_name=f"slotproxy-{replica}", retry=reconnect_once(), **tls)
        self._service = target.service
        self.redis = self._sentinel.master_for(target.service, connection_pool_class=_SentinelBlockingPool,
                                               max_connections=POOL_SIZE - 1, timeout=None)
        self._pool: _SentinelBlockingPool = self.redis.connection_pool
        self._pool.connection_class = packing_in_c(_reporting(self._pool.connection_class))
        self._batch = ScriptBatch(self.redis, scripts)

    def batch_for(self, key: str) -> ScriptBatch:
        return self._batch

    def watch_primary(self, reached: Callable[[str], None]) -> None:
        self._pool.on_reached = reached

    def reached(self) -> str | None:
        return self._pool.reached

    async def primary(self) -> str | None:
        try:
            host, port = await self._sentinel.discover_master(self._service)
        except RedisError:
            return None
        return f"{host}:{port}"

    async def away_for_all(self, reached: str | None) -> bool:
        """The first sentinel that answers decides: it has not heard the primary for over a ping period and a
        half (or calls it down), or it names another primary now."""
        for sentinel in self._sentinel.sentinels:  # each bounded by its socket timeouts, never cancelled mid-way
            try:
                masters = await sentinel.sentinel_masters()
            except (RedisError, OSError):
                continue
            state = masters.get(self._service) if isinstance(masters, dict) else None
            if not isinstance(state, dict):
                continue
            named = f"{state.get('ip')}:{state.get('port')}"
            return bool(state.get("is_sdown") or state.get("is_odown")
                        or int(state.get("last-ok-ping-reply", 0)) > _SENTINEL_PING_LATE_MS
                        or (reached is not None and named != reached))
        return False

    async def close(self) -> None:
        await self._batch.close()
        await self.redis.aclose(close_connection_pool=True)
        for sentinel in self._sentinel.sentinels:
            await sentinel.aclose()


class ClusterLink(Link):
    """A Redis Cluster: plain commands through redis-py's cluster client (it follows the slots), scripts in
    one batch per node, each provider's on the node that holds its hash tag's slot."""

    def __init__(self, target: RedisTarget, replica: str, scripts: Mapping[str, str]) -> None:
        super().__init__(scripts)
        self._options: dict[str, Any] = {"username": target.username, "password": target.password,
                                         **target.tls_options()}
        self._replica = replica
        self.redis = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.cluster],
                                  socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT,
                                  client_name=f"slotproxy-{replica}", **self._options)
        self._batches: dict[str, ScriptBatch] = {}
        self._clients: list[aioredis.Redis] = []

    def batch_for(self, key: str) -> ScriptBatch:
        node = self.redis.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        batch = self._batches.get(node.name)
        if batch is None:
            client = aioredis.Redis(connection_pool=BlockingConnectionPool(
                host=node.host, port=node.port, max_connections=4, timeout=None, socket_timeout=_TIMEOUT,
                socket_connect_timeout=_TIMEOUT, retry=reconnect_once(), client_name=f"slotproxy-{self._replica}",
                connection_class=packing_in_c(aioredis.SSLConnection if self._options.get("ssl")
                                              else aioredis.Connection),
                **{k: v for k, v in self._options.items() if k != "ssl"}))
            self._clients.append(client)
            batch = self._batches[node.name] = ScriptBatch(client, self._scripts)
        return batch

    async def start(self) -> None:
        await self.redis.initialize()

    async def refresh(self) -> None:
        """The slots moved (a failover, a resharding): ask the cluster again before the next batch."""
        await self.redis.nodes_manager.initialize()

    async def primary(self) -> str | None:
        nodes = self.redis.get_primaries()
        return ",".join(sorted(node.name for node in nodes)) or None

    async def ping(self) -> None:
        await self.redis.ping(target_nodes=RedisCluster.PRIMARIES)

    async def close(self) -> None:
        for batch in self._batches.values():
            await batch.close()
        for client in self._clients:
            await client.aclose(close_connection_pool=True)
        await self.redis.aclose()


def open_link(target: RedisTarget | str, replica: str, scripts: Mapping[str, str]) -> Link:
    if isinstance(target, str):
        return SingleLink(target, replica, scripts)
    if target.topology == "sentinel":
        return SentinelLink(target, replica, scripts)
    if target.topology == "cluster":
        return ClusterLink(target, replica, scripts)
    assert target.url is not None
    tls = {name: value for name, value in target.tls_options().items() if name != "ssl"} \
        if target.url.startswith("rediss://") else {}
    return SingleLink(target.url, replica, scripts, **tls)
