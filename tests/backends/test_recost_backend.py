"""Waiters costed again through the backends (``Backend.recost_windows``), the same tests on memory and on
Redis (one server, Sentinel, Cluster): a request queued behind a held output window on its prior estimate
(max_tokens 64,000) is granted as soon as its group is costed again; the queue keeps its order; a waiter that
leaves while it is costed again releases everything once; and Redis's script against the memory core.

Real time, with an output window that refills slowly (100,000 a minute: a 64,000 prior would take half a
minute to come back), so a grant within a second or two can only come from the re-costing."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend
from proxy.errors import QueueTimeout
from proxy.limiter import FakeClock, Priority, SlotLease, WindowSettings

from .conftest import REDIS_URL, require_redis
from .test_windows_backend import held, on_memory_and_redis, rows, setup

pytestmark = pytest.mark.asyncio

OTPM = "output_tokens_per_minute"
OTPM_LIMIT = 100_000
PRIOR = 64_000.0
LEARNED = 500.0


def prio(age: float = 0.0, starred: bool = False) -> Priority:
    return Priority(prompt_started_at=time.time() - age, starred=starred)


class Costs:
    """Each waiter's own estimate, as the relay's ``Costing`` gives it."""

    def __init__(self) -> None:
        self.now: dict[str, dict[str, float] | None] = {}

    def of(self, name: str, cost: dict[str, float]) -> Any:
        self.now[name] = cost
        return lambda: self.now[name]


async def cold_start(backend: Any) -> SlotLease:
    """The output window after a cold start: the first request took its whole max_tokens."""
    await setup(backend, WindowSettings(provider={OTPM: OTPM_LIMIT}))
    return await backend.acquire("p", prio(), cost={OTPM: PRIOR}, group="opus")


async def test_a_waiter_held_by_its_prior_output_estimate_is_granted_once_its_group_is_costed_again(backend) -> None:
    first = await cold_start(backend)
    costs = Costs()
    waiting = [asyncio.create_task(backend.acquire("p", prio(age=3 - n), cost={OTPM: PRIOR}, group="opus",
                                                   recost=costs.of(f"w{n}", {OTPM: PRIOR}))) for n in range(3)]
    await held(backend, 3, window=OTPM)
    backend.recost_windows("p", "opus")  # the same costs again: nothing changes
    await backend.flush()
    await asyncio.sleep(0.1)
    assert not any(task.done() for task in waiting)
    started = time.monotonic()
    for name in costs.now:
        costs.now[name] = {OTPM: LEARNED}  # the first answer of the group taught a small output p90
    backend.recost_windows("p", "opus")
    leases = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert time.monotonic() - started < 2, "granted by the re-costing, not by a refill half a minute away"
    assert [lease.cost for lease in leases] == [{OTPM: LEARNED}] * 3, "each lease took the cost it was granted on"
    row = (await rows(backend))[("opus", OTPM)]
    assert (row["held"], row["reserved"]) == (0, PRIOR + 3 * LEARNED)
    for lease in (first, *leases):
        lease.release()
    row = (await rows(backend))[("opus", OTPM)]
    assert row["reserved"] == 0 and row["available"] < OTPM_LIMIT - PRIOR


async def test_re_costing_keeps_the_queue_order(backend) -> None:
    """The starred head still needs more than the window holds: the cheaper ones behind it in its group wait
    (the listing unchanged); once it fits, the three go in queue order."""
    first = await cold_start(backend)
    costs = Costs()
    order: list[str] = []

    async def ask(name: str, priority: Priority) -> SlotLease:
        lease = await backend.acquire("p", priority, cost={OTPM: PRIOR}, group="opus",
                                      recost=costs.of(name, {OTPM: PRIOR}))
        order.append(name)
        return lease

    tasks = [asyncio.create_task(ask("old", prio(age=60)))]
    await held(backend, 1, window=OTPM)
    tasks += [asyncio.create_task(ask("starred", prio(starred=True))), asyncio.create_task(ask("new", prio()))]
    for _ in range(100):
        await backend.flush()
        await backend.refresh()
        if backend.provider_status("p").queued == 3:
            break
        await asyncio.sleep(0.01)
    listing = [(w.starred, w.prompt_started_at) for w in backend.provider_status("p").queue]
    assert [starred for starred, _ in listing] == [True, False, False]
    costs.now.update(starred={OTPM: 50_000.0}, old={OTPM: LEARNED}, new={OTPM: LEARNED})
    backend.recost_windows("p", "opus")
    await backend.flush()
    await asyncio.sleep(0.3)
    await backend.refresh()
    assert order == [] and [(w.starred, w.prompt_started_at) for w in backend.provider_status("p").queue] == listing
    costs.now["starred"] = {OTPM: 2_000.0}
    backend.recost_windows("p", "opus")
    leases = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["starred", "old", "new"]
    for lease in (first, *leases):
        lease.release()


async def test_a_waiter_that_leaves_as_it_is_costed_again_releases_everything_once(backend) -> None:
    """Its client leaves in the loop turn its group is costed again: with Redis the script may grant it before
    the CANCEL arrives, which then hands the grant back. Either way nothing stays queued, held or reserved."""
    first = await cold_start(backend)
    costs = Costs()
    leaving = asyncio.create_task(backend.acquire("p", prio(age=1), cost={OTPM: PRIOR}, group="opus",
                                                  recost=costs.of("leaving", {OTPM: PRIOR})))
    staying = asyncio.create_task(backend.acquire("p", prio(), cost={OTPM: PRIOR}, group="opus",
                                                  recost=costs.of("staying", {OTPM: PRIOR})))
    await held(backend, 2, window=OTPM)
    costs.now.update(leaving={OTPM: LEARNED}, staying={OTPM: LEARNED})
    backend.recost_windows("p", "opus")
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    lease = await asyncio.wait_for(staying, 5)
    assert lease.cost == {OTPM: LEARNED}
    await backend.flush()
    await asyncio.sleep(0.2)  # a grant handed back by CANCEL, in the background
    await backend.flush()
    await backend.refresh()
    status = backend.provider_status("p")
    assert (status.queued, status.in_flight) == (0, 2)
    row = (await rows(backend))[("opus", OTPM)]
    assert (row["held"], row["reserved"]) == (0, PRIOR + LEARNED), "the one that left holds nothing"
    for each in (first, lease):
        each.release()
    await backend.flush()
    await backend.refresh()
    assert backend.provider_status("p").in_flight == 0
    assert (await rows(backend))[("opus", OTPM)]["reserved"] == 0


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_waiter_that_times_out_as_it_is_costed_again_releases_everything_once(kind: str,
                                                                                      key_prefix: str) -> None:
    """Its queue deadline falls in the loop turn its group is costed again (a fake clock fires it there): the
    memory core grants it first, so its deadline finds nothing; Redis's script may grant it while the timeout's
    CANCEL is on its way, which hands the grant back and answers QueueTimeout. Nothing is left either way."""
    clock = FakeClock(time.time())
    if kind == "memory":
        backend: Any = MemoryBackend(clock)
    else:
        require_redis()
        backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=2.0, clock=clock)
        await backend.start()
    try:
        first = await cold_start(backend)
        costs = Costs()
        waiting = asyncio.create_task(backend.acquire("p", prio(), cost={OTPM: PRIOR}, group="opus", client_wait=5,
                                                      recost=costs.of("w", {OTPM: PRIOR})))
        await held(backend, 1, window=OTPM)
        costs.now["w"] = {OTPM: LEARNED}
        backend.recost_windows("p", "opus")
        clock.advance(6)
        try:
            lease: SlotLease | None = await asyncio.wait_for(waiting, 5)
        except QueueTimeout:
            lease = None
        assert (lease is not None) == (kind == "memory")
        if lease is not None:
            lease.release()
            lease.release()
        await backend.flush()
        await asyncio.sleep(0.2)
        await backend.flush()
        await backend.refresh()
        status = backend.provider_status("p")
        assert (status.queued, status.in_flight) == (0, 1)
        assert (await rows(backend))[("opus", OTPM)]["reserved"] == PRIOR
        first.release()
    finally:
        if kind == "redis":
            await backend.close()


# --- the same answers: the re-costing in Python and in Lua ---------------------------------------------------


async def _recost_sequence(backend: Any) -> tuple[list[str], dict[str, Any]]:
    """Two groups held by their output windows; opus costed again twice (its head first too large, then not),
    sonnet never: who is granted, in which order, and each window's counts."""
    await setup(backend, WindowSettings(provider={OTPM: OTPM_LIMIT}))
    firsts = [await backend.acquire("p", prio(), cost={OTPM: PRIOR}, group=group) for group in ("opus", "sonnet")]
    costs = Costs()
    granted: list[str] = []
    tasks = []

    async def ask(name: str, group: str, priority: Priority, recost: bool = True) -> SlotLease:
        lease = await backend.acquire("p", priority, cost={OTPM: PRIOR}, group=group,
                                      recost=costs.of(name, {OTPM: PRIOR}) if recost else None)
        granted.append(f"{name}:{lease.cost[OTPM] if lease.cost else None}")
        return lease

    for name, group, priority, recost in [
        ("old", "opus", prio(age=100), True), ("starred", "opus", prio(starred=True), True),
        ("sonnet", "sonnet", prio(age=200), True), ("fixed", "opus", prio(age=50), False),
        ("new", "opus", prio(), True),
    ]:
        tasks.append(asyncio.create_task(ask(name, group, priority, recost)))
        await backend.flush()
        await asyncio.sleep(0.02)
    for _ in range(100):
        await backend.flush()
        await backend.refresh()
        if backend.provider_status("p").queued == 5:
            break
        await asyncio.sleep(0.01)
    costs.now.update(starred={OTPM: 40_000.0}, old={OTPM: 300.0}, new={OTPM: 200.0}, sonnet={OTPM: 100.0})
    backend.recost_windows("p", "opus")
    await backend.flush()
    await asyncio.sleep(0.3)
    costs.now["starred"] = {OTPM: 1_000.0}
    backend.recost_windows("p", "opus")
    for _ in range(200):
        await backend.flush()
        if len(granted) >= 3:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    counts = {f"{group}/{window}": {field: row[field] for field in ("reserved", "held", "held_total")}
              for (group, window), row in (await rows(backend)).items()}
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for lease in (*firsts, *(result for result in results if not isinstance(result, BaseException))):
        lease.release()
    return granted, counts


async def test_memory_and_redis_recost_the_same_waiters_and_grant_them_in_the_same_order(key_prefix: str) -> None:
    """WINDOW_RECOST against ``ProviderWindows.recost``: only the group named, only waiters that can be costed
    again, the held head holding its group until its own cost fits, then queue order (starred first); the
    waiter without a way to be costed again keeps its prior and its place, behind which nobody of its group
    passes."""
    expected, got = await on_memory_and_redis(_recost_sequence, key_prefix)
    assert expected[0] == ["starred:1000.0", "old:300.0"]
    assert got == expected


async def test_a_stale_cost_never_replaces_a_newer_one_in_redis(key_prefix: str) -> None:
    """Each re-costing is a new version of the waiter's cost; a script carrying an older version than the one
    Redis holds (it arrived late) changes nothing, and a grant names the version it took."""
    require_redis()
    backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=2.0)
    await backend.start()
    try:
        first = await cold_start(backend)
        waiting = asyncio.create_task(backend.acquire("p", prio(), cost={OTPM: PRIOR}, group="opus"))
        await held(backend, 1, window=OTPM)
        (waiter_id, waiter), = backend._waiters.items()
        waiter.costs += [{OTPM: LEARNED}, {OTPM: 50_000.0}, {OTPM: 2_000.0}]

        async def recost(version: int) -> None:
            await backend._run("WINDOW_RECOST", "p", backend._lease_ttl_ms, backend._channel, waiter_id, version,
                               json.dumps(waiter.costs[version]))
        await recost(2)
        await recost(1)  # older, and small enough to fit: it must not
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await recost(3)
        lease = await asyncio.wait_for(waiting, 5)
        assert lease.cost == {OTPM: 2_000.0}
        for each in (first, lease):
            each.release()
    finally:
        await backend.close()
