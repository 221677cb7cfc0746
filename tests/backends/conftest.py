"""Backends under test: the memory backend, and the Redis backend against a real Redis server."""

from __future__ import annotations

import gc
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend, RedisTarget

from ..ports import free_port
from .topology import SERVICE, ClusterTopology, SentinelTopology

REDIS_URL = "redis://127.0.0.1:6379/0"


def require_redis(url: str = REDIS_URL) -> None:
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(f"the Redis backend tests need a Redis server at {url} (scripts/test-setup starts one): {exc}")


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(f"{prefix}:*")) + list(client.scan_iter(f"{{{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(autouse=True)
def _connections_left_are_charged_here() -> Iterator[None]:
    """Collect garbage after each test here, once its event loop is closed: a Redis connection a test left
    open then warns (an error in this suite) in the test that left it, not in whichever later test happens
    to trigger a collection."""
    yield
    gc.collect()


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"slotproxy-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    delete_prefix(REDIS_URL, prefix)


@pytest.fixture(scope="session")
def sentinel_topology() -> Iterator[SentinelTopology]:
    """A primary, a replica and three sentinels, for the whole session (a test that fails it over starts one
    of its own)."""
    topology = SentinelTopology.start()
    yield topology
    topology.stop()


@pytest.fixture(scope="session")
def cluster_topology() -> Iterator[ClusterTopology]:
    topology = ClusterTopology.start()
    yield topology
    topology.stop()


def sentinel_target(topology: SentinelTopology) -> RedisTarget:
    return RedisTarget(sentinels=tuple(("127.0.0.1", s.port) for s in topology.sentinels), service=SERVICE)


def cluster_target(topology: ClusterTopology) -> RedisTarget:
    return RedisTarget(cluster=tuple(("127.0.0.1", node.port) for node in topology.nodes))


@pytest.fixture(params=["memory", "redis", "sentinel", "cluster"])
async def backend(request, key_prefix) -> AsyncIterator[MemoryBackend | RedisBackend]:
    """Every backend the behaviour suite holds to the same answers: memory, one Redis server, Redis behind
    Sentinel, a Redis Cluster."""
    if request.param == "memory":
        yield MemoryBackend()
        return
    if request.param == "redis":
        require_redis()
        target: RedisTarget | str = REDIS_URL
    elif request.param == "sentinel":
        target = sentinel_target(request.getfixturevalue("sentinel_topology"))
    else:
        target = cluster_target(request.getfixturevalue("cluster_topology"))
    instance = RedisBackend(target, key_prefix=key_prefix, lease_ttl=2.0)
    await instance.start()
    yield instance
    await instance.close()


class PrivateRedis:
    """A redis-server of the test's own, on a free port, that the test may stop and start."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (scripts/test-setup installs it)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        probe = redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            while True:
                try:
                    probe.ping()
                    return
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            probe.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()
