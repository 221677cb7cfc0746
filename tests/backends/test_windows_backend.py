"""Token windows through the backends: the same tests on memory and on Redis (one server, Sentinel, Cluster):
an acquire held until its window has room, another model group or a sibling key not held back, a client
that leaves while held takes nothing, what answers say (usage, window hits, limits, room) reaches the
windows; and two Redis replicas sharing one window.

Real time on both sides, with windows that refill fast (60,000 a minute: 1,000 a second) so a wait is a
fraction of a second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend
from proxy.limiter import (
    FakeClock,
    KeySettings,
    LimiterSettings,
    Priority,
    WindowSettings,
)

from .conftest import REDIS_URL, require_redis

T = TypeVar("T")

pytestmark = pytest.mark.asyncio

ITPM = "input_tokens_per_minute"
OTPM = "output_tokens_per_minute"
RPM = "requests_per_minute"
FAST = 60_000
"""A window of 60,000 a minute refills 1,000 a second."""


def prio(age: float = 0.0, starred: bool = False, conversation: str | None = None) -> Priority:
    return Priority(prompt_started_at=time.time() - age, starred=starred, conversation=conversation)


async def setup(backend: Any, windows: WindowSettings | None, limit: int | None = 8, **settings: Any) -> None:
    backend.configure({"p": LimiterSettings(limit=limit, windows=windows, queue_timeout=None, slot_timeout=None,
                                            **settings)}, frozenset())
    await backend.flush()


async def rows(backend: Any, key: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    await backend.flush()
    await backend.refresh()
    status = backend.provider_status("p").to_dict()
    owner = status if key is None else next(k for k in status["keys"] if k["name"] == key)
    return {(row["group"], row["window"]): row for row in owner["windows"]}


async def held(backend: Any, count: int, group: str = "opus", window: str = ITPM, key: str | None = None) -> None:
    for _ in range(100):
        row = (await rows(backend, key)).get((group, window))
        if row is not None and row["held"] == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} held by {group}/{window}, status says {await rows(backend, key)}")


async def test_an_acquire_held_by_its_window_is_granted_when_the_window_refills(backend) -> None:
    await setup(backend, WindowSettings(provider={ITPM: FAST}))
    first = await backend.acquire("p", prio(), cost={ITPM: FAST}, group="opus")
    assert (first.cost, first.group) == ({ITPM: FAST}, "opus")
    started = time.monotonic()
    waiting = asyncio.create_task(backend.acquire("p", prio(), cost={ITPM: 400}, group="opus"))
    await held(backend, 1)
    other = await asyncio.wait_for(backend.acquire("p", prio(), cost={ITPM: 400}, group="sonnet"), 2)
    assert other.group == "sonnet" and not waiting.done()
    lease = await asyncio.wait_for(waiting, 5)
    waited = time.monotonic() - started
    assert 0.3 < waited < 2.5, waited  # 400 at 1,000 a second; woken by its timer, not a poll a while later
    assert lease.group == "opus" and lease.cost == {ITPM: 400}
    row = (await rows(backend))[("opus", ITPM)]
    assert list(row) == ["group", "window", "limit", "source", "available", "reserved", "held", "held_total", "hits",
                         "ratio", "estimate_error_p50", "estimate_error_p90"]
    assert (row["held"], row["held_total"], row["reserved"], row["limit"], row["source"]) == (
        0, 1, FAST + 400, FAST, "config")
    backend.settle_windows("p", lease, {ITPM: 100}, {ITPM: "give_back"})
    backend.settle_windows("p", lease, {ITPM: 100}, {ITPM: "give_back"})  # once per lease
    assert (await rows(backend))[("opus", ITPM)]["available"] >= 290  # 300 given back
    for each in (first, other, lease):
        each.release()
    row = (await rows(backend))[("opus", ITPM)]
    assert row["reserved"] == 0 and row["available"] < FAST  # ended: no longer reserved, nothing given back


async def test_a_client_leaving_while_held_takes_nothing(backend) -> None:
    await setup(backend, WindowSettings(provider={ITPM: 600}))
    await backend.acquire("p", prio(), cost={ITPM: 600}, group="opus")
    waiting = asyncio.create_task(backend.acquire("p", prio(), cost={ITPM: 300}, group="opus"))
    await held(backend, 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await held(backend, 0)
    status = backend.provider_status("p")
    assert (status.queued, status.in_flight) == (0, 1)
    row = (await rows(backend))[("opus", ITPM)]
    assert (row["reserved"], row["held_total"]) == (600, 1)
    assert row["available"] <= 10  # 10 a second refilled since: the waiter that left took nothing


async def test_without_windows_a_cost_changes_nothing(backend) -> None:
    await setup(backend, None, limit=4)
    leases = [await asyncio.wait_for(backend.acquire("p", prio(), cost={ITPM: 10**9}, group="opus"), 2)
              for _ in range(4)]
    assert all(lease.cost is None for lease in leases)
    assert "windows" not in backend.provider_status("p").to_dict()
    assert backend.window_limits("p", None, "opus") == {}


async def test_a_sibling_key_with_room_takes_the_waiter_and_a_pinned_one_waits_for_its_key(backend) -> None:
    keys = (KeySettings("a", limit=4), KeySettings("b", limit=4))
    await setup(backend, WindowSettings(provider={ITPM: FAST}), limit=None, keys=keys)
    first = await backend.acquire("p", prio(conversation="c1"), cost={ITPM: FAST}, group="opus")
    assert first.key == "a"
    second = await asyncio.wait_for(backend.acquire("p", prio(conversation="c1"), cost={ITPM: 500}, group="opus"), 2)
    assert second.key == "b"  # the conversation's own key has no room in its window
    pinned = asyncio.create_task(backend.acquire("p", prio(), cost={ITPM: 300}, group="opus", key="a"))
    await held(backend, 1, key="a")
    free = await asyncio.wait_for(backend.acquire("p", prio(), cost={ITPM: 300}, group="opus"), 2)
    assert free.key == "b" and not pinned.done()
    assert (await asyncio.wait_for(pinned, 5)).key == "a"
    status = backend.provider_status("p").to_dict()
    assert "windows" not in status and [len(key["windows"]) for key in status["keys"]] == [1, 1]


async def test_a_request_larger_than_its_window_is_sent_once_the_window_is_full(backend) -> None:
    await setup(backend, WindowSettings(provider={ITPM: FAST}))
    await backend.acquire("p", prio(), cost={ITPM: 500}, group="opus")
    huge = await asyncio.wait_for(backend.acquire("p", prio(), cost={ITPM: 3 * FAST}, group="opus"), 5)
    assert huge.cost == {ITPM: 3 * FAST}
    assert (await rows(backend))[("opus", ITPM)]["available"] < -FAST


async def test_what_answers_say_reaches_the_windows(backend) -> None:
    await setup(backend, WindowSettings(provider={ITPM: 600}, models={"opus": {OTPM: 900}}))
    assert backend.window_limits("p", None, "opus") == {ITPM: 600, OTPM: 900}
    lease = await backend.acquire("p", prio(), cost={ITPM: 100, OTPM: 50}, group="opus")
    backend.report_window_limits("p", None, "opus", {ITPM: 400, RPM: 50})
    assert backend.window_limits("p", None, "opus") == {ITPM: 400, OTPM: 900, RPM: 50}
    opus = await rows(backend)
    assert [(w, r["limit"], r["source"]) for (_, w), r in opus.items()] == [
        (ITPM, 400, "both"), (OTPM, 900, "config"), (RPM, 50, "headers")]
    assert opus[("opus", ITPM)]["available"] in range(300, 305)  # 100 spent: 500 of 600, then 200 less capacity
    backend.report_window_remaining("p", None, "opus", {OTPM: 1000.0}, time.time())
    assert (await rows(backend))[("opus", OTPM)]["available"] in range(850, 853), "within the rounding"
    backend.report_window_remaining("p", None, "opus", {OTPM: 0.0}, time.time())
    assert (await rows(backend))[("opus", OTPM)]["available"] in range(3), "beyond it: the least it stands for"
    backend.report_window_remaining("p", None, "opus", {RPM: 20.0}, time.time())
    assert (await rows(backend))[("opus", RPM)]["available"] in range(20, 22), "requests are counted exactly"
    backend.report_window_hit("p", None, "opus", ITPM, time.time() + 60)
    row = (await rows(backend))[("opus", ITPM)]
    assert (row["available"], row["hits"]) == (0, 1)
    waiting = asyncio.create_task(backend.acquire("p", prio(), cost={ITPM: 1, OTPM: 1}, group="opus"))
    await held(backend, 1)
    assert not waiting.done() and backend.provider_status("p").limit == 8  # a window hit is no backoff
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    lease.release()


async def test_a_request_granted_before_the_provider_lowered_its_window_settles_as_the_provider_charged_it(
        backend) -> None:
    """The provider's -remaining counted a request in flight as it charges one it admits (its input; no output
    yet), not as the proxy estimated it: once that lowered the window, the request's answer gives back no
    over-estimate of its input, and its output is taken whole."""
    await setup(backend, WindowSettings(provider={ITPM: 6000, OTPM: 6000}))
    lease = await backend.acquire("p", prio(), cost={ITPM: 1000, OTPM: 500}, group="opus")
    backend.report_window_remaining("p", None, "opus", {ITPM: 3000.0, OTPM: 3000.0}, lease.granted_at)
    before = await rows(backend)  # 3000 announced, rounded to the thousand: 2500 and up
    assert before[("opus", ITPM)]["available"] in range(2500, 2510) and before[("opus", OTPM)]["available"] in \
        range(2500, 2510)
    backend.settle_windows("p", lease, {ITPM: 600.0, OTPM: 300.0}, {ITPM: "give_back", OTPM: "give_back"},
                           {ITPM: 600.0, OTPM: 0.0})
    after = await rows(backend)
    assert after[("opus", ITPM)]["available"] in range(2500, 2515), "no 400 given back: the provider counted 600"
    assert after[("opus", OTPM)]["available"] in range(2200, 2215), "its 300 output taken, not 200 given back"
    await asyncio.sleep(0.01)
    later = await backend.acquire("p", prio(), cost={ITPM: 1000, OTPM: 500}, group="opus")
    backend.settle_windows("p", later, {ITPM: 600.0, OTPM: 300.0}, {ITPM: "give_back", OTPM: "give_back"},
                           {ITPM: 600.0, OTPM: 0.0})
    settled = await rows(backend)
    assert settled[("opus", ITPM)]["available"] in range(1900, 1920), "granted after: its estimate settles as before"
    assert settled[("opus", OTPM)]["available"] in range(1900, 1920)
    lease.release()
    later.release()


# --- two replicas sharing one window -----------------------------------------------------------------


async def test_two_replicas_share_one_window(key_prefix: str) -> None:
    require_redis()
    replicas = [RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=2.0) for _ in range(2)]
    one, two = replicas
    for replica in replicas:
        await replica.start()
    try:
        for replica in replicas:
            await setup(replica, WindowSettings(provider={ITPM: FAST}))
        first = await one.acquire("p", prio(), cost={ITPM: FAST - 100}, group="opus")
        started = time.monotonic()
        waiting = asyncio.create_task(two.acquire("p", prio(), cost={ITPM: 500}, group="opus"))
        await held(one, 1)
        lease = await asyncio.wait_for(waiting, 5)
        assert 0.3 < time.monotonic() - started < 2.5  # the window one replica spent holds the other's request
        two.settle_windows("p", lease, {ITPM: 0}, {ITPM: "give_back"})
        await two.flush()  # given back before the hit below: a give-back after it would refill the emptied window
        one.report_window_hit("p", None, "opus", ITPM, time.time() + 60)
        await one.flush()
        row = (await rows(two))[("opus", ITPM)]
        assert (row["available"], row["hits"], row["reserved"]) == (0, 1, FAST - 100 + 500)
        two.report_window_limits("p", None, "opus", {ITPM: 2 * FAST, RPM: 50})
        await two.flush()
        assert one.window_limits("p", None, "opus") == {ITPM: FAST}
        await one.refresh()  # what another replica learned, from the fleet's status; the config's smaller limit holds
        assert one.window_limits("p", None, "opus") == {ITPM: FAST, RPM: 50}
        first.release()
        lease.release()
    finally:
        for replica in replicas:
            await replica.close()


async def test_a_replica_sets_one_timer_for_the_time_its_held_waiter_s_window_refills(key_prefix: str) -> None:
    """Not a poll: the grant script says when the earliest held head's room will exist, and the replica
    waiting there sets its dispatch timer for then (a renew round, up to a second later, would be late)."""
    require_redis()
    backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=6.0)
    await backend.start()
    try:
        await setup(backend, WindowSettings(provider={ITPM: FAST}))
        await backend.acquire("p", prio(), cost={ITPM: FAST}, group="opus")
        loop = asyncio.get_running_loop()
        asked = loop.time()
        waiting = asyncio.create_task(backend.acquire("p", prio(), cost={ITPM: 600}, group="opus"))
        await held(backend, 1)
        when, _ = backend._dispatch_timers["p"]
        assert when - asked == pytest.approx(0.6, abs=0.15)
        await asyncio.wait_for(waiting, 2)
        assert loop.time() - asked < 0.9
    finally:
        await backend.close()


# --- the same answers: the admission rules in Python and in Lua ---------------------------------------------


async def _admission_rows(backend: Any) -> tuple[list[str], dict[str, Any]]:
    """Who got a slot (by the order the requests were made), and each window's counts (not its level, which
    refills by the clock: fake on one side, real on the other)."""
    keys = (KeySettings("a", limit=3), KeySettings("b", limit=3))
    await setup(backend, WindowSettings(provider={ITPM: 600}, models={"sonnet": {ITPM: 6000}}), limit=None,
                keys=keys)
    granted: list[str] = []
    tasks = []

    async def ask(name: str, cost: float, group: str, **options: Any) -> None:
        lease = await backend.acquire("p", prio(**options), cost={ITPM: cost}, group=group)
        granted.append(f"{name}@{lease.key}")

    for name, cost, group, options in [
        ("big", 590, "opus", {"conversation": "c"}), ("next", 400, "opus", {"conversation": "c"}),
        ("held", 300, "opus", {"age": 100}), ("sonnet", 300, "sonnet", {}), ("small", 10, "opus", {}),
        ("starred", 100, "opus", {"starred": True}),
    ]:
        tasks.append(asyncio.create_task(ask(name, cost, group, **options)))
        for _ in range(50):
            await backend.flush()
            await asyncio.sleep(0.005)
            if len(granted) + (await rows_count(backend)) >= len(tasks):
                break
    counts = {}
    for key in ("a", "b"):
        for (group, window), row in (await rows(backend, key)).items():
            counts[f"{key}/{group}/{window}"] = {field: row[field] for field in
                                                 ("limit", "source", "reserved", "held", "held_total", "hits")}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return granted, counts


async def rows_count(backend: Any) -> int:
    await backend.flush()
    await backend.refresh()
    return int(backend.provider_status("p").queued)


async def on_memory_and_redis(sequence: Callable[[Any], Awaitable[T]], key_prefix: str) -> tuple[T, T]:
    """What ``sequence`` gives on the memory backend (on fake time) and on Redis: a test holds the Lua to the
    Python by comparing them."""
    require_redis()
    memory = MemoryBackend(FakeClock(time.time()))
    redis_backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=2.0)
    await redis_backend.start()
    try:
        return await sequence(memory), await sequence(redis_backend)
    finally:
        await redis_backend.close()


async def test_memory_and_redis_admit_the_same_requests_and_count_the_same(key_prefix: str) -> None:
    """A pool of two keys under one 600-token window each: the conversation's key, then its sibling with room;
    a held head holding back its own group (queue order) and not another group; a starred waiter put first."""
    expected, got = await on_memory_and_redis(_admission_rows, key_prefix)
    assert expected[0] == ["big@a", "next@b", "sonnet@a", "starred@b"]
    assert got == expected


async def test_a_head_held_by_its_window_is_not_passed_by_a_smaller_request_needing_the_same_window(backend) -> None:
    """Two workspaces in classes of their own (max_share): the older one's large request waits for its window;
    a later small one that would fit now waits behind it, or small requests would pass a large one for ever."""
    await setup(backend, WindowSettings(provider={ITPM: FAST}), max_share=0.5)
    first = await backend.acquire("p", prio(), cost={ITPM: FAST - 500}, group="opus")
    large = asyncio.create_task(backend.acquire(
        "p", Priority(prompt_started_at=time.time() - 10, workspace="a"), cost={ITPM: 1_500}, group="opus"))
    await held(backend, 1)
    small = asyncio.create_task(backend.acquire(
        "p", Priority(prompt_started_at=time.time(), workspace="b"), cost={ITPM: 300}, group="opus"))
    other = await asyncio.wait_for(backend.acquire(
        "p", Priority(prompt_started_at=time.time(), workspace="b"), cost={ITPM: 300}, group="sonnet"), 2)
    done, _ = await asyncio.wait({large, small}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert done == {large}, "the large request, first in the queue, goes first"
    (await asyncio.wait_for(small, 5)).release()
    for lease in (first, large.result(), other):
        lease.release()
