"""Redis as platforms give it: a primary failed over by Sentinel under load, a Cluster's slots, health that
follows Redis with no request touching it, and the status fields that show it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import aiohttp
import pytest
import redis
from redis.cluster import key_slot

from proxy.backends.redis import RedisBackend
from proxy.ledger.store import LedgerRow
from proxy.limiter import LimiterSettings, Priority

from ..conftest import Proxy, chat
from .conftest import cluster_target, sentinel_target
from .topology import SERVICE, ClusterTopology, SentinelTopology

LIMIT = 3
STREAMS = 40


def sentinel_yaml(topology: SentinelTopology, prefix: str, upstream: str, **extra: Any) -> str:
    sentinels = ", ".join(f"'127.0.0.1:{s.port}'" for s in topology.sentinels)
    more = "".join(f", {key}: {value}" for key, value in extra.items())
    return (f"state: {{path: null}}\nbackend: {{kind: redis, sentinels: [{sentinels}], service: {SERVICE}, "
            f"key_prefix: {prefix}, lease_ttl: 3s{more}}}\n"
            f"providers:\n  openai:\n    upstream: {upstream}/v1\n    limit: {LIMIT}\n    queue_timeout: 25s\n")


async def stream(client: aiohttp.ClientSession, proxy: Proxy, tag: str) -> tuple[int, str]:
    """A streamed request read to its end: the status, and the error code of a proxy-made answer."""
    try:
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                               headers={"x-fake-tag": tag, "x-fake-chunks": "10", "x-fake-delay-ms": "60"},
                               timeout=aiohttp.ClientTimeout(total=60)) as resp:
            body = await resp.read()
            code = json.loads(body).get("error", {}).get("code", "") if resp.status != 200 else ""
            return resp.status, code
    except aiohttp.ClientError as exc:  # a stream the proxy had to cut: not an answer
        return 0, type(exc).__name__


async def backend_status(proxy: Proxy) -> dict[str, Any]:
    return proxy.state.backend.backend_status()


CUT_OFF = ("A Redis process killed or stopped in the middle of a command leaves redis-py's connection to it "
           "unclosed, collected as a ResourceWarning after the test's loop is gone (1 run in 3 here); these three "
           "tests kill or stop Redis processes on purpose, so that warning is not charged to them.")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see CUT_OFF
async def test_a_primary_killed_under_load_loses_no_request_and_leaks_no_slot(start_upstream, start_proxy,
                                                                              client, caplog) -> None:
    """Two replicas, 40 streams through limit 3; the primary is SIGKILLed mid-run and Sentinel fails over."""
    topology = SentinelTopology.start()
    try:
        up = await start_upstream()
        prefix = f"failover-{os.urandom(4).hex()}"
        replicas = [await start_proxy(sentinel_yaml(topology, prefix, up.url)) for _ in range(2)]
        old_primary = topology.current_primary()
        runs = [asyncio.create_task(stream(client, replicas[n % 2], f"s{n}")) for n in range(STREAMS)]
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        topology.primary.kill()
        new_primary = topology.wait_failover(old_primary)
        failed_over_in = time.monotonic() - killed_at
        results = await asyncio.gather(*runs)
        statuses = sorted({(status, code) for status, code in results})
        assert all(status == 200 or (status == 503 and code in ("queue_timeout", "backend_unavailable"))
                   for status, code in results), statuses
        print(f"\nfailover {old_primary} -> {new_primary} in {failed_over_in:.1f}s; answers {statuses}; "
              f"upstream max concurrency {up.fake.max_concurrency} (limit {LIMIT}, bound {2 * LIMIT})")
        assert up.fake.max_concurrency <= 2 * LIMIT
        for replica in replicas:
            assert replica.state.backend.local_in_flight("openai") == 0
        primary = redis.Redis(host="127.0.0.1", port=int(new_primary.rpartition(":")[2]))
        try:
            assert primary.zcard(f"{{{prefix}:openai}}:leases") == 0
            assert primary.zcard(f"{{{prefix}:openai}}:waiters") == 0
        finally:
            primary.close()
        for replica in replicas:
            deadline = time.monotonic() + 5
            while (await backend_status(replica))["failovers"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            status = await backend_status(replica)
            assert (status["failovers"], status["primary"], status["healthy"]) == (1, new_primary, True)
            assert isinstance(status["last_failover_at"], int)
        changed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("redis primary changed")]
        assert len(changed) == 2, changed  # one line per replica
        assert all(line.startswith(f"redis primary changed from {old_primary} to {new_primary} (failover 1)")
                   for line in changed), changed
    finally:
        topology.stop()



@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see CUT_OFF
async def test_a_primary_away_longer_than_lease_ttl_keeps_the_slots_held_through_it() -> None:
    """The primary and its replica hang for longer than lease_ttl (SIGSTOP; with no replica to promote, no
    failover ends it early). The sentinels see the primary away, so the held slot is kept (its stream would
    carry on); when the primary is back the scripts bridge the gap, and the slot still counts: a second
    request waits for its release."""
    topology = SentinelTopology.start()
    backend = RedisBackend(sentinel_target(topology), key_prefix=f"away-{os.urandom(4).hex()}", lease_ttl=3)
    try:
        await backend.start()
        backend.configure({"openai": LimiterSettings(limit=1)}, frozenset())
        await backend.flush()
        held = await backend.acquire("openai", Priority(prompt_started_at=time.time()))
        topology.replica.pause()
        topology.primary.pause()
        try:
            await asyncio.sleep(5.0)
            assert not held.reclaimed, "the slot was given up while the primary was away for every replica"
        finally:
            topology.primary.resume()
            topology.replica.resume()
        waiting = asyncio.create_task(backend.acquire("openai", Priority(prompt_started_at=time.time())))
        await asyncio.sleep(2.5)  # two renew rounds on the primary back
        assert not held.reclaimed, "the slot was lost when the primary came back"
        assert not waiting.done(), "the slot held through the gap was granted again"
        held.release()
        (await asyncio.wait_for(waiting, 5)).release()
    finally:
        await backend.close()
        topology.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see CUT_OFF
async def test_a_dead_sentinel_costs_no_time_and_closing_without_redis_is_quick() -> None:
    """redis-py's default retry spends seconds on each dead sentinel (ten tries, backing off to a second):
    the first sentinel dead, the primary is still found at once; with every Redis process gone, closing
    the backend does not wait for a batch that cannot reach one."""
    topology = SentinelTopology.start()
    try:
        topology.sentinels[0].kill()
        backend = RedisBackend(sentinel_target(topology), key_prefix=f"ds-{os.urandom(4).hex()}", lease_ttl=3)
        started = time.monotonic()
        await backend.start()
        backend.configure({"openai": LimiterSettings(limit=1)}, frozenset())
        lease = await asyncio.wait_for(backend.acquire("openai", Priority(prompt_started_at=time.time())), 5)
        assert time.monotonic() - started < 1.5, "the dead first sentinel delayed the start"
        topology.stop()
        lease.release()  # a write that can no longer reach Redis, in flight when the backend closes
        closing = time.monotonic()
        await backend.close()
        assert time.monotonic() - closing < 2.5
    finally:
        topology.stop()

async def test_health_follows_redis_within_two_seconds_with_no_request(start_proxy, client, private_redis) -> None:
    proxy = await start_proxy(f"state: {{path: null}}\nbackend: {{kind: redis, url: '{private_redis.url}', "
                              "key_prefix: health, lease_ttl: 3s}\nproviders:\n"
                              "  openai: {upstream: 'http://127.0.0.1:9/v1'}\n")

    async def ready() -> int:
        async with client.get(f"{proxy.url}/readyz") as resp:
            return resp.status

    assert await ready() == 200
    private_redis.stop()
    stopped = time.monotonic()
    while await ready() != 503:
        assert time.monotonic() - stopped < 2, "still ready 2 s after Redis died"
        await asyncio.sleep(0.05)
    status = await backend_status(proxy)
    assert status["healthy"] is False and status["error"]
    assert "Error" not in status["error"].split(" ")[0], status["error"]  # words, not a class name first
    private_redis.start()
    started = time.monotonic()
    while await ready() != 200:
        assert time.monotonic() - started < 2, "not ready 2 s after Redis came back"
        await asyncio.sleep(0.05)


async def test_status_names_the_primary_without_credentials(sentinel_topology) -> None:
    backend = RedisBackend(sentinel_target(sentinel_topology), key_prefix=f"st-{os.urandom(4).hex()}", lease_ttl=2)
    await backend.start()
    try:
        deadline = time.monotonic() + 3
        while backend.backend_status()["primary"] is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        status = backend.backend_status()
        assert status["topology"] == "sentinel"
        assert status["primary"] == sentinel_topology.current_primary()
        assert (status["failovers"], status["last_failover_at"]) == (0, None)
    finally:
        await backend.close()


async def test_a_failover_counts_once_when_a_connection_reaches_the_new_primary_before_the_health_check(
        sentinel_topology, caplog) -> None:
    """Requests reconnect through redis-py's Sentinel pool as soon as the sentinels name another primary; the
    health check asks the sentinels only every half second, and a replica whose pool got there first was left
    showing the dead primary with no failover counted. The primary shown is the one a connection reached, at
    the moment it reached it, and the health check that follows counts nothing more."""
    backend = RedisBackend(sentinel_target(sentinel_topology), key_prefix=f"fo-{os.urandom(4).hex()}", lease_ttl=2)
    await backend.start()
    try:
        old = sentinel_topology.current_primary()
        assert backend.backend_status()["primary"] == old
        moved_to = sentinel_topology.replica.address
        # What the pool does when a connection finds the sentinels naming another primary: connect there.
        connection = backend._link.redis.connection_pool.make_connection()
        await connection.connect_to(("127.0.0.1", sentinel_topology.replica.port))
        await connection.disconnect()
        status = backend.backend_status()
        assert (status["primary"], status["failovers"]) == (moved_to, 1)
        assert isinstance(status["last_failover_at"], int)
        await asyncio.sleep(1.2)  # two health checks, each with a ping through the pool
        status = backend.backend_status()
        assert (status["primary"], status["failovers"], status["healthy"]) == (moved_to, 1, True)
    finally:
        await backend.close()
    changed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("redis primary changed")]
    line = f"redis primary changed from {old} to {moved_to} (failover 1): putting back 0 held slot(s) and 0 waiter(s)"
    assert changed == [line]


async def test_each_providers_keys_share_one_slot_and_providers_spread_over_the_nodes(cluster_topology) -> None:
    prefix = "spread"
    providers = ["openai", "anthropic"]
    nodes = {cluster_topology.node_for_slot(key_slot(f"{{{prefix}:{name}}}".encode())).port for name in providers}
    assert len(nodes) == 2, "this prefix puts the two providers on two nodes (the test relies on it)"
    backend = RedisBackend(cluster_target(cluster_topology), key_prefix=prefix, lease_ttl=2)
    await backend.start()
    try:
        backend.configure({name: LimiterSettings(limit=1) for name in providers}, frozenset({"web"}))
        await backend.flush()
        leases = [await asyncio.wait_for(backend.acquire(name, Priority(time.time())), 5) for name in providers]
        for name in providers:
            keys = backend._keys_of(name)
            assert len({key_slot(key.encode()) for key in keys}) == 1, keys
            node = cluster_topology.node_for_slot(key_slot(keys[0].encode()))
            client = redis.Redis(port=node.port)
            try:
                assert client.zcard(f"{{{prefix}:{name}}}:leases") == 1
                assert client.smembers(f"{{{prefix}:{name}}}:stars") == {b"web"}
            finally:
                client.close()
        for lease in leases:
            lease.release()
        await backend.flush()
    finally:
        await backend.close()



async def test_on_a_cluster_a_grant_listener_outlives_a_slot_map_without_its_channel(cluster_topology) -> None:
    """The grant listener subscribes on the node its channel hashes to, as the Cluster client's slot map says;
    a map that lacks that slot (a cluster still forming: redis-py raises KeyError) once killed the listener
    for good, and the replica's waiters were granted only by the renew round, every lease_ttl / 3."""
    prefix = f"grant-{os.urandom(4).hex()}"
    holder, waiter = (RedisBackend(cluster_target(cluster_topology), key_prefix=prefix, lease_ttl=30)
                      for _ in range(2))
    make_pubsub = waiter._redis.pubsub
    made = 0

    def pubsub_missing_the_slot_once(**options: Any) -> Any:
        nonlocal made
        made += 1
        pubsub = make_pubsub(**options)
        if made == 1:
            async def subscribe(*channels: str) -> None:
                raise KeyError(1243)  # what redis-py's slot lookup raises for a slot it does not know
            pubsub.subscribe = subscribe
        return pubsub

    waiter._redis.pubsub = pubsub_missing_the_slot_once
    for backend in (holder, waiter):
        await backend.start()
        backend.configure({"openai": LimiterSettings(limit=1)}, frozenset())
        await backend.flush()
    try:
        held = await asyncio.wait_for(holder.acquire("openai", Priority(time.time())), 5)
        queued = asyncio.create_task(waiter.acquire("openai", Priority(time.time())))
        await asyncio.sleep(1.0)  # the listener has subscribed again
        assert not queued.done() and made >= 2
        held.release()
        released = time.monotonic()
        lease = await asyncio.wait_for(queued, 5)
        assert time.monotonic() - released < 1.0, "granted by the renew round, not by its message"
        lease.release()
    finally:
        for backend in (holder, waiter):
            await backend.close()


async def test_a_cluster_node_restarted_empty_is_survived() -> None:
    topology = ClusterTopology.start()
    backend = RedisBackend(cluster_target(topology), key_prefix="restart", lease_ttl=2)
    try:
        await backend.start()
        backend.configure({"openai": LimiterSettings(limit=1)}, frozenset())
        await backend.flush()
        node = topology.node_for_slot(key_slot(b"{restart:openai}"))
        held = await asyncio.wait_for(backend.acquire("openai", Priority(time.time())), 5)
        node.kill()
        node.start()  # empty: no persistence; it keeps its slots (nodes.conf) and rejoins
        deadline = time.monotonic() + 15
        while not backend.healthy or backend.backend_status()["error"]:
            assert time.monotonic() < deadline, backend.backend_status()
            await asyncio.sleep(0.1)
        assert not held.reclaimed, "the slot held across the restart is put back, not taken from its holder"
        held.release()
        again = await asyncio.wait_for(backend.acquire("openai", Priority(time.time())), 10)
        again.release()
        await backend.flush()
    finally:
        await backend.close()
        topology.stop()


def test_the_config_becomes_a_target_with_the_passwords_from_their_variables() -> None:
    from proxy.config import parse_config
    from proxy.http.runtime import redis_target

    backend = parse_config(
        "backend: {kind: redis, sentinels: ['s1:26379', '[::1]:26380'], service: mymaster,\n"
        "          password_env: SP_REDIS_PW, sentinel_password_env: SP_SENTINEL_PW, tls: {ca_file: ca.pem}}\n"
        "providers: {p: {upstream: 'http://127.0.0.1:9'}}\n").backend
    target = redis_target(backend, {"SP_REDIS_PW": "data-secret", "SP_SENTINEL_PW": "sentinel-secret"})
    assert target.sentinels == (("s1", 26379), ("::1", 26380)) and target.service == "mymaster"
    assert (target.password, target.sentinel_password) == ("data-secret", "sentinel-secret")
    assert target.tls_options()["ssl_ca_certs"] == "ca.pem"
    assert "secret" not in repr(target)
    unset = redis_target(backend, {})
    assert (unset.password, unset.sentinel_password) == (None, None)


async def test_usage_aggregates_that_cannot_be_written_are_logged_in_words(private_redis, caplog) -> None:
    """The fleet's usage aggregates are written every second; with Redis gone the warning names the address
    and the cause in words, not redis-py's 'Error 111 connecting to …'."""
    backend = RedisBackend(private_redis.url, key_prefix=f"aggr-{os.urandom(4).hex()}", lease_ttl=3)
    await backend.start()
    try:
        backend.configure({"openai": LimiterSettings(limit=1)}, frozenset())
        await backend.flush()
        private_redis.stop()
        backend.record_usage(LedgerRow(ended_at=int(time.time() * 1000), provider="openai", key=None, model="gpt-x",
                                       workspace="default", starred=False, conversation=None, transport="http",
                                       status=200, outcome="ok", queue_ms=0, ttfb_ms=1, duration_ms=2,
                                       input_tokens=10, output_tokens=5))
        deadline = time.monotonic() + 5
        while "usage aggregates" not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        line = next(r.getMessage() for r in caplog.records if "usage aggregates" in r.getMessage())
        port = private_redis.url.rsplit(":", 1)[1].split("/")[0]
        assert f"could not connect to 127.0.0.1:{port} (connection refused)" in line, line
        assert "Error 111" not in line
    finally:
        await backend.close()
