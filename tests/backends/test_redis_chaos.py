"""Chaos for the Redis backend: two replicas, holders, cancels and Redis restarts that lose every key.

Seeded (``REDIS_CHAOS_SEED``) and bounded (``REDIS_CHAOS_SECONDS``, default 8 s)::

    REDIS_CHAOS_SEED=3 REDIS_CHAOS_SECONDS=120 python -m pytest tests/backends/test_redis_chaos.py -s -q

Two ``RedisBackend`` instances (two replicas) share one private Redis with ``limit: 2``
(``fail_closed``). Workers on both take a slot, hold it 0-40 ms as a stream would, and
release it; some give up while queued (a client that left), some while holding. Every
1-2 s Redis is killed and started again empty (no persistence), sometimes while it is
down long enough for the replicas to notice, sometimes so briefly that they do not.

Invariants:

R1  never more than ``limit`` slots held across both replicas, counted by the holders
    themselves at every grant (the upstream's view);
R2  progress: within 3 s of every restart that is not followed by another one in that time,
    slots are granted again (no replica stuck, no slot lost);
R3  at the end, with every worker stopped: nothing in flight on either replica, and
    no lease, cooling slot or waiter left in Redis.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
import redis

from proxy.backends.redis import RedisBackend
from proxy.errors import QueueTimeout
from proxy.limiter import LimiterSettings, Priority

pytestmark = pytest.mark.asyncio

SEED = int(os.environ.get("REDIS_CHAOS_SEED", "11"))
SECONDS = float(os.environ.get("REDIS_CHAOS_SECONDS", "8"))
LIMIT = 2
WORKERS = 6
PREFIX = "chaos"


class Ledger:
    def __init__(self) -> None:
        self.held = 0
        self.max_held = 0
        self.grants = 0
        self.grants_at: list[float] = []
        self.gave_up = 0
        self.timeouts = 0
        self.reclaimed = 0


async def _worker(backend: RedisBackend, rng: random.Random, ledger: Ledger, stop: asyncio.Event) -> None:
    while not stop.is_set():
        priority = Priority(prompt_started_at=time.time() - rng.random() * 60, starred=rng.random() < 0.2)
        acquire = asyncio.ensure_future(backend.acquire("p", priority))
        if rng.random() < 0.15:
            await asyncio.sleep(rng.random() * 0.02)
            acquire.cancel()
        try:
            lease = await acquire
        except asyncio.CancelledError:
            ledger.gave_up += 1
            continue
        except QueueTimeout:
            ledger.timeouts += 1
            continue
        ledger.held += 1
        ledger.grants += 1
        ledger.grants_at.append(time.monotonic())
        ledger.max_held = max(ledger.max_held, ledger.held)
        holding = asyncio.current_task()
        lease.on_reclaim = holding.cancel if holding is not None else None
        try:
            await asyncio.sleep(rng.random() * 0.04)
        except asyncio.CancelledError:
            ledger.reclaimed += 1
            if stop.is_set() or not lease.reclaimed:
                raise
        finally:
            ledger.held -= 1
            lease.release()


async def _restarts(private_redis, rng: random.Random, stop: asyncio.Event, log: list[float]) -> None:
    while not stop.is_set():
        await asyncio.sleep(1.0 + rng.random())
        if stop.is_set():
            return
        private_redis.stop()
        await asyncio.sleep(rng.choice([0.0, 0.0, 0.3, 0.8]))
        await asyncio.to_thread(private_redis.start)
        log.append(time.monotonic())


def _left_in_redis(url: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        return {part: client.zcard(f"{{{PREFIX}:p}}:{part}") for part in ("leases", "cooling", "waiters")}
    finally:
        client.close()


async def test_redis_restarts_never_over_admit_or_leak(private_redis) -> None:
    rng = random.Random(SEED)
    settings = LimiterSettings(limit=LIMIT, queue_timeout=5.0)
    replicas = [RedisBackend(private_redis.url, key_prefix=PREFIX, lease_ttl=1.5) for _ in range(2)]
    for replica in replicas:
        await replica.start()
        replica.configure({"p": settings}, frozenset())
        await replica.flush()
    ledger = Ledger()
    restarts: list[float] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_worker(replicas[i % 2], random.Random(rng.random()), ledger, stop))
             for i in range(WORKERS)]
    started = time.monotonic()
    chaos = asyncio.create_task(_restarts(private_redis, random.Random(rng.random()), stop, restarts))
    try:
        await asyncio.sleep(SECONDS)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, chaos), 15)
    try:
        print(f"\nredis chaos seed={SEED}: {ledger.grants} grants, {len(restarts)} restarts, "
              f"{ledger.gave_up} gave up while queued, {ledger.timeouts} queue timeouts, {ledger.reclaimed} reclaimed, "
              f"max held {ledger.max_held}")
        assert ledger.max_held <= LIMIT, "R1: more slots held than the limit"
        assert restarts, "the run was too short to restart redis"
        quiet = [at for at, following in zip(restarts, [*restarts[1:], time.monotonic()]) if following - at >= 3.0]
        for at in quiet:
            assert any(at < granted < at + 3.0 for granted in ledger.grants_at), \
                f"R2: no grant within 3 s of a restart at +{at - started:.1f}s (restarts at " \
                f"{[round(r - started, 1) for r in restarts]})"
        for replica in replicas:
            await replica.flush()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for replica in replicas:
                await replica.refresh()
            if all(r.in_flight() == 0 for r in replicas) and not any(_left_in_redis(private_redis.url).values()):
                break
            await asyncio.sleep(0.1)
        assert [r.in_flight() for r in replicas] == [0, 0], "R3: a replica still holds a slot"
        assert _left_in_redis(private_redis.url) == {"leases": 0, "cooling": 0, "waiters": 0}, "R3: left in Redis"
    finally:
        for replica in replicas:
            await replica.close()
