"""A deep queue on the Redis backend: 10 000 waiters on two replicas, served in order, on a bounded pool.

Each replica's connections are capped (callers wait for one instead of failing with
``Too many connections``), and the count does not grow with the queue: it is read
from Redis's own ``CLIENT LIST``, by the replica's client name.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio as aioredis

from proxy.backends.redis import RedisBackend
from proxy.backends.redis.client import POOL_SIZE
from proxy.limiter import LimiterSettings, Priority

from .conftest import REDIS_URL, require_redis

pytestmark = pytest.mark.asyncio

WAITERS = 10_000
T0 = 1_800_000_000.0


async def connections_of(probe: aioredis.Redis, backend: RedisBackend) -> int:
    clients = await probe.client_list()
    return sum(1 for client in clients if client.get("name") == f"slotproxy-{backend.replica}")


async def test_ten_thousand_waiters_on_two_replicas_are_served_in_order(key_prefix: str) -> None:
    require_redis()
    replicas = [RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=6.0) for _ in range(2)]
    probe = aioredis.Redis.from_url(REDIS_URL)
    settings = {"p": LimiterSettings(limit=1, slot_timeout=None, queue_timeout=None, max_queue=WAITERS)}
    for replica in replicas:
        await replica.start()
        replica.configure(settings, frozenset())
        await replica.flush()
    served: list[int] = []
    try:
        holder = await replicas[0].acquire("p", Priority(prompt_started_at=T0 - 10 * WAITERS))
        ranks = list(range(WAITERS))
        random.Random(7).shuffle(ranks)

        async def wait(rank: int, replica: RedisBackend) -> None:
            lease = await replica.acquire("p", Priority(prompt_started_at=T0 - WAITERS + rank))
            served.append(rank)
            lease.release()

        tasks = [asyncio.create_task(wait(rank, replicas[i % 2])) for i, rank in enumerate(ranks)]
        most = 0
        for _ in range(1200):
            await asyncio.sleep(0.05)
            most = max(most, *[await connections_of(probe, replica) for replica in replicas])
            await replicas[0].refresh(queue_detail=False)
            if replicas[0].provider_status("p").queued == WAITERS:
                break
        assert replicas[0].provider_status("p").queued == WAITERS
        assert all(replica.healthy for replica in replicas), [r.error for r in replicas]
        assert 0 < most <= POOL_SIZE
        holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert served == sorted(ranks), "granted out of priority order"
        assert all(replica.healthy for replica in replicas), [r.error for r in replicas]
        assert max([await connections_of(probe, replica) for replica in replicas]) <= POOL_SIZE
    finally:
        for replica in replicas:
            await replica.close()
        await probe.aclose()


async def test_requests_granted_at_once_leave_no_queue_deadline_behind(key_prefix: str) -> None:
    """Found by bench/redis_backend.py: a waiter granted in ENQUEUE's own answer stayed in the deadline
    heap until its queue_timeout, and every acquire re-heaped them all (cost growing with traffic)."""
    require_redis()
    backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=6.0)
    await backend.start()
    try:
        backend.configure({"p": LimiterSettings(limit=100, slot_timeout=None)}, frozenset())
        await backend.flush()
        for _ in range(300):
            lease = await backend.acquire("p", Priority(prompt_started_at=T0))
            lease.release()
        await backend.flush()
        assert len(backend._deadlines) == 0
    finally:
        await backend.close()
