"""One behaviour suite, run on every backend: the same tests, parametrised over memory and Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.errors import QueueFull, QueueTimeout, SpendLimitReached
from proxy.limiter import LimiterSettings, Priority, ProviderStatus, auto_reduce_notice

pytestmark = pytest.mark.asyncio


def prio(age: float = 0.0, workspace: str = "default", starred: bool = False) -> Priority:
    return Priority(prompt_started_at=time.time() - age, workspace=workspace, starred=starred)


async def setup(backend, **settings) -> None:
    backend.configure({"p": LimiterSettings(**settings)}, frozenset())
    await backend.flush()


async def status(backend) -> ProviderStatus:
    await backend.flush()
    await backend.refresh()
    return backend.provider_status("p")


async def queued(backend, count: int) -> None:
    for _ in range(200):
        if (await status(backend)).queued == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} queued, status says {(await status(backend)).queued}")


async def test_under_the_limit_granted_at_the_limit_queued(backend) -> None:
    await setup(backend, limit=2)
    first = await backend.acquire("p", prio())
    second = await backend.acquire("p", prio())
    third = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 1)
    assert not third.done()
    s = await status(backend)
    assert (s.in_flight, s.queued, s.limit) == (2, 1, 2)
    first.release()
    lease = await asyncio.wait_for(third, 5)
    for held in (second, lease):
        held.release()
    s = await status(backend)
    assert (s.in_flight, s.queued) == (0, 0)


async def test_no_limit_never_waits(backend) -> None:
    await setup(backend, limit=None)
    leases = [await asyncio.wait_for(backend.acquire("p", prio()), 5) for _ in range(20)]
    assert (await status(backend)).in_flight == 20
    for lease in leases:
        lease.release()
    assert (await status(backend)).in_flight == 0


async def test_queue_order_starred_then_oldest_prompt_then_arrival(backend) -> None:
    await setup(backend, limit=1)
    holder = await backend.acquire("p", prio())
    order: list[str] = []

    async def wait(name: str, priority: Priority) -> None:
        lease = await backend.acquire("p", priority)
        order.append(name)
        await asyncio.sleep(0.01)
        lease.release()

    tasks = []
    for name, priority in (("new-1", prio(age=1)), ("old", prio(age=100)), ("new-2", prio(age=1)),
                           ("starred", prio(starred=True))):
        tasks.append(asyncio.create_task(wait(name, priority)))
        await queued(backend, len(tasks))
    assert [w.starred for w in (await status(backend)).queue] == [True, False, False, False]
    holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == ["starred", "old", "new-1", "new-2"]


async def test_starring_a_workspace_moves_waiters_ahead(backend) -> None:
    await setup(backend, limit=1)
    holder = await backend.acquire("p", prio())
    old = asyncio.create_task(backend.acquire("p", prio(age=50, workspace="a")))
    await queued(backend, 1)
    new = asyncio.create_task(backend.acquire("p", prio(age=1, workspace="b")))
    await queued(backend, 2)
    backend.set_starred(frozenset({"b"}))
    await backend.flush()
    assert [w.workspace for w in (await status(backend)).queue] == ["b", "a"]
    holder.release()
    first = await asyncio.wait_for(new, 5)
    assert not old.done()
    first.release()
    (await asyncio.wait_for(old, 5)).release()


async def test_release_is_idempotent_and_hands_the_slot_on(backend) -> None:
    await setup(backend, limit=1)
    first = await backend.acquire("p", prio())
    w1 = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 1)
    w2 = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 2)
    first.release()
    first.release()
    lease = await asyncio.wait_for(w1, 5)
    await asyncio.sleep(0.1)
    assert not w2.done()
    assert (await status(backend)).in_flight == 1
    lease.release()
    (await asyncio.wait_for(w2, 5)).release()


async def test_backoff_pauses_lowers_once_and_manual_limit_clears(backend) -> None:
    await setup(backend, limit=3, default_pause=30.0)
    leases = [await backend.acquire("p", prio()) for _ in range(3)]
    for lease in leases:
        backend.report_backoff("p", "429", 0.4, lease.granted_at)
    s = await status(backend)
    assert s.paused and s.paused_until is not None
    assert (s.limit, s.configured_limit, s.auto_reduced, s.auto_reduced_from) == (2, 3, True, 3)
    assert s.notice == auto_reduce_notice(2, "429")
    for lease in leases:
        lease.release()
    started = time.monotonic()
    late = await asyncio.wait_for(backend.acquire("p", prio()), 5)
    assert time.monotonic() - started >= 0.2, "nothing is granted during the pause"
    late.release()
    backend.set_limit("p", 3)
    s = await status(backend)
    assert (s.limit, s.auto_reduced, s.auto_reduced_from, s.notice) == (3, False, None, None)


async def test_default_pause_when_no_wait_is_stated(backend) -> None:
    await setup(backend, limit=2, default_pause=0.3)
    backend.report_backoff("p", "529", None, time.time())
    s = await status(backend)
    assert s.paused and s.notice == auto_reduce_notice(1, "529")
    await asyncio.sleep(0.4)
    assert not (await status(backend)).paused


async def test_a_cancelled_waiter_leaves_and_is_never_granted(backend) -> None:
    await setup(backend, limit=1)
    holder = await backend.acquire("p", prio())
    gone = asyncio.create_task(backend.acquire("p", prio(age=100)))
    await queued(backend, 1)
    stays = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await queued(backend, 1)
    holder.release()
    (await asyncio.wait_for(stays, 5)).release()
    s = await status(backend)
    assert (s.in_flight, s.queued) == (0, 0)


async def test_queue_timeout(backend) -> None:
    await setup(backend, limit=1, queue_timeout=0.3)
    holder = await backend.acquire("p", prio())
    with pytest.raises(QueueTimeout):
        await backend.acquire("p", prio())
    await queued(backend, 0)
    holder.release()


async def test_max_queue(backend) -> None:
    await setup(backend, limit=1, max_queue=1)
    holder = await backend.acquire("p", prio())
    waiting = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 1)
    with pytest.raises(QueueFull):
        await backend.acquire("p", prio())
    holder.release()
    (await asyncio.wait_for(waiting, 5)).release()


async def test_release_cooldown_keeps_the_slot_counted(backend) -> None:
    await setup(backend, limit=1, release_cooldown=0.4)
    lease = await backend.acquire("p", prio())
    lease.release()
    started = time.monotonic()
    assert (await status(backend)).in_flight == 1
    (await asyncio.wait_for(backend.acquire("p", prio()), 5)).release()
    assert time.monotonic() - started >= 0.3


async def test_watchdog_reclaims_and_tells_the_holder(backend) -> None:
    await setup(backend, limit=1, slot_timeout=0.3)
    stuck = await backend.acquire("p", prio())
    aborted = asyncio.Event()
    stuck.on_reclaim = aborted.set
    nxt = asyncio.create_task(backend.acquire("p", prio()))
    await asyncio.wait_for(aborted.wait(), 5)
    assert stuck.reclaimed
    lease = await asyncio.wait_for(nxt, 5)
    stuck.release()
    assert (await status(backend)).in_flight == 1
    lease.release()


async def test_watchdog_reclaims_each_slot_at_its_own_time(backend) -> None:
    await setup(backend, limit=3, slot_timeout=0.5)
    first = await backend.acquire("p", prio())
    await asyncio.sleep(0.3)
    second, returned = await backend.acquire("p", prio()), await backend.acquire("p", prio())
    returned.release()
    aborted = {name: asyncio.Event() for name in ("first", "second")}
    first.on_reclaim, second.on_reclaim = aborted["first"].set, aborted["second"].set
    await asyncio.wait_for(aborted["first"].wait(), 5)
    assert not second.reclaimed, "granted 0.3 s later, so due 0.3 s later"
    await asyncio.wait_for(aborted["second"].wait(), 5)
    assert not returned.reclaimed
    assert (await status(backend)).in_flight == 0


async def test_a_reload_that_shortens_slot_timeout_applies_to_slots_held_now(backend) -> None:
    await setup(backend, limit=2, slot_timeout=60.0)
    held = await backend.acquire("p", prio())
    aborted = asyncio.Event()
    held.on_reclaim = aborted.set
    await asyncio.sleep(0.2)
    await setup(backend, limit=2, slot_timeout=0.1)
    await asyncio.wait_for(aborted.wait(), 5)
    assert held.reclaimed
    assert (await status(backend)).in_flight == 0


async def test_config_change_of_the_limit_applies_and_clears_the_mark(backend) -> None:
    await setup(backend, limit=3)
    backend.report_backoff("p", "429", 0.05, time.time())
    assert (await status(backend)).auto_reduced
    await setup(backend, limit=5)
    s = await status(backend)
    assert (s.limit, s.configured_limit, s.auto_reduced) == (5, 5, False)


async def test_reject_waiters_refuses_one_workspace_s_queued_requests_at_once(backend) -> None:
    await setup(backend, limit=1)
    holder = await backend.acquire("p", prio(workspace="docs"))
    capped = [asyncio.create_task(backend.acquire("p", prio(age=100 - i, workspace="web"))) for i in range(2)]
    other = asyncio.create_task(backend.acquire("p", prio(workspace="docs")))
    await queued(backend, 3)
    refusal = SpendLimitReached("workspace 'web' reached its cap", retry_after=3600.0)
    assert backend.reject_waiters("p", "web", refusal) == 2
    for task in capped:
        with pytest.raises(SpendLimitReached):
            await asyncio.wait_for(task, 1)
    await queued(backend, 1)  # they left the shared queue too
    assert [w.workspace for w in (await status(backend)).queue] == ["docs"]
    assert backend.reject_waiters("p", "web", refusal) == 0
    assert not other.done()
    holder.release()
    (await asyncio.wait_for(other, 5)).release()
    s = await status(backend)
    assert (s.in_flight, s.queued) == (0, 0)
