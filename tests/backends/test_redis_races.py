"""Redis-specific races and failures: in-flight scripts, restarts that lose every key, a hung server."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from proxy.backends.redis import RedisBackend
from proxy.backends.redis.leases import _Waiter
from proxy.limiter import LimiterSettings, Priority

from .conftest import REDIS_URL, delete_prefix, require_redis

pytestmark = pytest.mark.asyncio


def prio() -> Priority:
    return Priority(prompt_started_at=time.time())


@contextlib.asynccontextmanager
async def serving(url: str, prefix: str, limit: int, **options: Any) -> AsyncIterator[RedisBackend]:
    """A started Redis backend with one provider ``p`` of ``limit``, closed on exit."""
    backend = RedisBackend(url, key_prefix=prefix, **options)
    await backend.start()
    try:
        backend.configure({"p": LimiterSettings(limit=limit)}, frozenset())
        await backend.flush()
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def one_slot(key_prefix):
    """A Redis backend with one provider ``p`` of limit 1, and a plain client to look inside."""
    require_redis()
    backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=30)
    await backend.start()
    client = redis.Redis.from_url(REDIS_URL)
    try:
        backend.configure({"p": LimiterSettings(limit=1)}, frozenset())
        await backend.flush()
        yield backend, client
    finally:
        client.close()
        await backend.close()


@pytest.mark.parametrize("slot_busy", [False, True])
async def test_renew_during_an_enqueue_in_flight_neither_duplicates_nor_leaks(one_slot, key_prefix, slot_busy) -> None:
    backend, client = one_slot
    held = await backend.acquire("p", prio()) if slot_busy else None
    real = backend._scripts["ENQUEUE"]

    async def slow_enqueue(*args, **kwargs):
        await asyncio.sleep(0.05)
        return await real(*args, **kwargs)

    backend._scripts["ENQUEUE"] = slow_enqueue
    waiting = asyncio.create_task(backend.acquire("p", prio()))
    await asyncio.sleep(0.01)
    await backend._renew_once()
    await asyncio.sleep(0.2)
    backend._scripts["ENQUEUE"] = real
    if held is not None:
        assert client.zcard(f"{{{key_prefix}:p}}:waiters") == 1
        held.release()
    lease = await asyncio.wait_for(waiting, 5)
    await backend.flush()
    assert client.zcard(f"{{{key_prefix}:p}}:leases") == 1, "exactly one lease: the waiter's own"
    assert client.zcard(f"{{{key_prefix}:p}}:waiters") == 0
    lease.release()
    await backend.flush()
    third = await asyncio.wait_for(backend.acquire("p", prio()), 5)
    third.release()
    await backend.flush()
    assert client.zcard(f"{{{key_prefix}:p}}:leases") == 0
    assert backend.healthy


async def test_an_orphan_queue_entry_is_dropped_not_fatal(one_slot, key_prefix) -> None:
    backend, client = one_slot
    held = await backend.acquire("p", prio())
    client.zadd(f"{{{key_prefix}:p}}:waiters", {"000000000000000000000000001:ghost": 0})
    waiting = asyncio.create_task(backend.acquire("p", prio()))
    await asyncio.sleep(0.1)
    held.release()
    (await asyncio.wait_for(waiting, 5)).release()
    await backend.flush()
    assert backend.healthy
    assert client.zcard(f"{{{key_prefix}:p}}:waiters") == 0



async def test_a_grant_picked_up_for_a_waiter_that_left_is_handed_back(one_slot, key_prefix) -> None:
    """RENEW and a repeated ENQUEUE take a grant out of Redis; if its waiter already left, no CANCEL
    script can find it any more, so the replica releases the lease itself."""
    backend, client = one_slot
    gone = _Waiter(f"{backend.replica}-gone", asyncio.get_running_loop().create_future(), "p", prio(), 0.0)
    result = await backend._enqueue(f"{backend.replica}-gone", gone, LimiterSettings(limit=1))
    assert int(result[0]) == 1, "granted at once: the slot was free"
    assert client.zcard(f"{{{key_prefix}:p}}:leases") == 1
    backend._resolve(f"{backend.replica}-gone", result[1].decode(), picked_up_for="p")
    await backend.flush()
    assert client.zcard(f"{{{key_prefix}:p}}:leases") == 0


async def test_the_slot_a_waiter_holds_is_not_released_when_its_grant_is_picked_up_again(one_slot,
                                                                                        key_prefix) -> None:
    """After Redis lost its data a waiter may be granted again under the same id: that is the slot it
    already holds, and handing it back would free a slot still in use."""
    backend, client = one_slot
    lease = await backend.acquire("p", prio())
    backend._resolve(lease.waiter_id, f"{lease.lease_id} 0", picked_up_for="p")
    await backend.flush()
    assert client.zcard(f"{{{key_prefix}:p}}:leases") == 1
    lease.release()
    await backend.flush()
    assert client.zcard(f"{{{key_prefix}:p}}:leases") == 0


async def test_pooled_connections_survive_a_redis_restart(private_redis) -> None:
    """Every pooled connection is dead after a restart; the first command on each must still succeed."""
    async with serving(private_redis.url, "restart", 4, lease_ttl=30, on_backend_error="local",
                       local_limit=1) as backend:
        leases = await asyncio.gather(*(backend.acquire("p", prio()) for _ in range(4)))
        await asyncio.gather(*(backend._redis.ping() for _ in range(4)))  # plain commands at once: several pooled
        pooled = len(backend._redis.connection_pool._available_connections)
        assert pooled >= 2, "several pooled connections, all of them about to go stale"
        for lease in leases:
            lease.release()
        await backend.flush()
        private_redis.stop()
        private_redis.start()
        stats = await asyncio.gather(*(backend.refresh() for _ in range(pooled)))
        assert len(stats) == pooled
        assert backend.healthy, backend.error
        status = backend.provider_status("p")
        assert (status.limit, status.in_flight) == (4, 0)
        lease = await backend.acquire("p", prio())
        await backend.refresh()
        assert backend.provider_status("p").in_flight == 1
        lease.release()


async def test_status_in_local_mode_shows_the_local_limiter(private_redis) -> None:
    async with serving(private_redis.url, "outage", 4, lease_ttl=30, on_backend_error="local",
                       local_limit=1) as backend:
        await backend.refresh()
        assert backend.provider_status("p").limit == 4
        private_redis.stop()
        await backend.refresh()
        assert not backend.healthy
        lease = await backend.acquire("p", prio())
        status = backend.provider_status("p")
        assert (status.limit, status.in_flight) == (1, 1), "this replica's own limiter while Redis is away"
        lease.release()
        assert backend.provider_status("p").in_flight == 0


async def _granted_within(backend: RedisBackend, count: int, wait: float) -> int:
    tasks = [asyncio.create_task(backend.acquire("p", prio())) for _ in range(count)]
    await asyncio.sleep(wait)
    granted = sum(1 for task in tasks if task.done() and not task.cancelled() and task.exception() is None)
    for task in tasks:
        if task.done() and task.exception() is None:
            task.result().release()
        else:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return granted


@pytest.mark.parametrize("held", [False, True], ids=["idle", "one-slot-held"])
async def test_a_redis_that_restarts_empty_keeps_the_limit(private_redis, held) -> None:
    """Redis restarted without its data (no persistence, a flush, a failover): the replicas put the
    limit and the slots they hold back, instead of granting without a limit."""
    async with serving(private_redis.url, "wipe", 1, lease_ttl=1.5) as backend:
        first = await backend.acquire("p", prio())
        if not held:
            first.release()
            await backend.flush()
        private_redis.stop()
        private_redis.start()
        granted = await _granted_within(backend, 3, wait=2.0)
        assert granted == (0 if held else 1), "limit 1 holds across the restart"
        assert not first.reclaimed, "a slot held across the restart is put back, not taken from its holder"
        status = (await _stats(backend))
        assert status.limit == 1
        if held:
            assert status.in_flight == 1
            first.release()
            await backend.flush()
            lease = await asyncio.wait_for(backend.acquire("p", prio()), 5)
            lease.release()


async def _stats(backend: RedisBackend):
    await backend.refresh()
    return backend.provider_status("p")


async def test_lease_ids_never_collide_after_redis_lost_its_data(private_redis) -> None:
    async with serving(private_redis.url, "ids", 3, lease_ttl=1.5) as backend:
        before = [await backend.acquire("p", prio()) for _ in range(2)]
        private_redis.stop()
        private_redis.start()
        await backend._renew_once()
        await backend.flush()
        await asyncio.sleep(backend._renew_every * 2.2)
        after = await asyncio.wait_for(backend.acquire("p", prio()), 5)
        assert after.lease_id not in {lease.lease_id for lease in before}
        assert (await _stats(backend)).in_flight == 3
        for lease in (*before, after):
            lease.release()
        await backend.flush()
        assert (await _stats(backend)).in_flight == 0


async def test_after_redis_lost_its_data_another_replica_waits_for_the_slot_still_held(private_redis) -> None:
    """Replica A holds the only slot when Redis restarts empty; replica B asks right after. B must
    not be granted until A releases: A's next renewal puts its lease back within the settle time."""
    async with serving(private_redis.url, "two", 1, lease_ttl=1.5) as a, \
            serving(private_redis.url, "two", 1, lease_ttl=1.5) as b:
        held = await a.acquire("p", prio())
        private_redis.stop()
        private_redis.start()
        waiting = asyncio.create_task(b.acquire("p", prio()))
        await asyncio.sleep(2.0)
        assert not waiting.done(), "B was granted a slot A still holds"
        assert not held.reclaimed
        held.release()
        lease = await asyncio.wait_for(waiting, 5)
        lease.release()


@pytest.mark.parametrize("mode", ["fail_closed", "local"])
async def test_a_slot_that_cannot_be_renewed_is_given_up_before_it_expires_in_fail_closed(private_redis,
                                                                                           mode) -> None:
    """Redis hangs (here: SIGSTOP) longer than lease_ttl. With fail_closed the holder is told to stop
    before Redis would hand its slot to another replica; with local it keeps its stream."""
    async with serving(private_redis.url, "hang", 1, lease_ttl=1.0, on_backend_error=mode,
                       local_limit=1) as backend:
        lease = await backend.acquire("p", prio())
        told = asyncio.Event()
        lease.on_reclaim = told.set
        assert private_redis.process is not None
        private_redis.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.3)
            if mode == "fail_closed":
                assert told.is_set() and lease.reclaimed
                assert backend.in_flight() == 0
            else:
                assert not told.is_set() and not lease.reclaimed
        finally:
            private_redis.process.send_signal(signal.SIGCONT)
        lease.release()


async def test_a_gap_no_replica_reached_redis_through_does_not_expire_the_slots_held_then(one_slot) -> None:
    """No replica reached Redis for longer than lease_ttl (a primary failing over, a hung host): the first
    script after the gap pushes the leases alive when it began on by its length instead of reaping them, so
    the slot still counts; a lease already expired before the gap is reaped as ever."""
    backend, client = one_slot
    cfg, leases = backend._keys("p")[:2]
    held = await backend.acquire("p", prio())
    now_ms = int(time.time() * 1000)
    with client.pipeline(transaction=True) as gap:  # one step: the backend's own RENEW must not come between
        gap.hset(cfg, mapping={"seen": now_ms - 20_000, "seen_ttl": 30_000})
        gap.zadd(leases, {held.lease_id: now_ms - 500, "expired-before-the-gap": now_ms - 21_000})
        gap.execute()
    waiting = asyncio.create_task(backend.acquire("p", prio()))
    await asyncio.sleep(0.3)
    assert not waiting.done(), "the held slot was reaped after the gap and granted again"
    score = client.zscore(leases, held.lease_id)
    assert score is not None and score > now_ms + 18_000
    assert client.zscore(leases, "expired-before-the-gap") is None
    assert int(client.hget(cfg, "gaps_bridged")) == 1
    assert int(client.hget(cfg, "created_at")) >= now_ms
    held.release()
    (await asyncio.wait_for(waiting, 5)).release()


async def test_a_replica_starting_just_after_redis_lost_its_data_waits_for_the_slots_others_hold(
        private_redis) -> None:
    """Redis loses its data and a new replica starts before the running one noticed: the newcomer finds
    no settings, but another replica is listening for grants, so it settles too instead of granting
    past the slot that replica still holds."""
    async with serving(private_redis.url, "fresh", 1, lease_ttl=30) as running:
        held = await running.acquire("p", prio())
        delete_prefix(private_redis.url, "fresh")
        async with serving(private_redis.url, "fresh", 1, lease_ttl=30) as newcomer:
            waiting = asyncio.create_task(newcomer.acquire("p", prio()))
            await asyncio.sleep(1.5)
            assert not waiting.done(), "the new replica was granted a slot another replica still holds"
            held.release()
            lease = await asyncio.wait_for(waiting, 5)
            lease.release()


async def test_a_new_deployment_grants_at_once(private_redis) -> None:
    async with serving(private_redis.url, "new", 1, lease_ttl=30) as backend:
        lease = await asyncio.wait_for(backend.acquire("p", prio()), 0.5)
        lease.release()


async def test_a_grant_in_enqueues_own_answer_sends_no_message_and_a_queued_one_does(one_slot) -> None:
    """ENQUEUE answers its own grant; only a waiter granted later (by a release) is told on the channel."""
    backend, client = one_slot
    subscriber = client.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(backend._channel + backend.replica)
    subscriber.get_message(timeout=1.0)
    first = await backend.acquire("p", prio())
    assert subscriber.get_message(timeout=0.3) is None
    queued = asyncio.ensure_future(backend.acquire("p", prio()))
    await asyncio.sleep(0.2)
    first.release()
    second = await asyncio.wait_for(queued, 5)
    message = subscriber.get_message(timeout=1.0)
    assert message is not None and message["type"] == "message"
    assert message["data"].decode().split(" ")[0] == second.waiter_id
    second.release()
    await backend.flush()
    subscriber.close()
