"""Nested limits and fair shares, one suite on every backend: key pools, model caps, budgets, max_share."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from proxy.errors import UnknownLimit
from proxy.limiter import (
    Budget,
    KeySettings,
    LimiterSettings,
    ModelCap,
    Priority,
    auto_reduce_notice,
)

from .test_behaviour import queued, status

pytestmark = pytest.mark.asyncio

POOL = (KeySettings("a", 2), KeySettings("b", 2))


def prio(age: float = 0.0, workspace: str = "default", conversation: str | None = None) -> Priority:
    return Priority(prompt_started_at=time.time() - age, workspace=workspace, conversation=conversation)


async def setup(backend, **settings) -> None:
    backend.configure({"p": LimiterSettings(**settings)}, frozenset())
    await backend.flush()


async def take(backend, priority=None, model=None):
    return await asyncio.wait_for(backend.acquire("p", priority or prio(), model=model), 5)


def keys_of(s) -> dict[str, tuple[int, int | None, bool]]:
    return {key.name: (key.in_flight, key.limit, key.paused_until is not None) for key in s.keys}


async def test_a_pool_spreads_slots_by_free_slots_and_caps_each_key(backend) -> None:
    await setup(backend, keys=POOL)
    leases = [await take(backend) for _ in range(4)]
    assert [lease.key for lease in leases] == ["a", "b", "a", "b"], "most free slots first, ties in config order"
    fifth = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 1)
    s = await status(backend)
    assert keys_of(s) == {"a": (2, 2, False), "b": (2, 2, False)}
    assert s.in_flight == 4
    leases[1].release()
    assert (await asyncio.wait_for(fifth, 5)).key == "b"


async def test_a_conversation_keeps_its_key_while_it_has_room(backend) -> None:
    await setup(backend, keys=POOL)
    first = await take(backend, prio(conversation="c1"))
    assert first.key == "a"
    first.release()
    other = await take(backend, prio(conversation="c2"))
    assert other.key == "a"
    again = await take(backend, prio(conversation="c1"))
    assert again.key == "a", "c1's key has a slot free: it stays there though b has more"
    fresh = await take(backend, prio(conversation="c3"))
    assert fresh.key == "b"
    full = await take(backend, prio(conversation="c1"))
    assert full.key == "b", "c1's key is full: it takes the other"
    for lease in (other, again, fresh, full):
        lease.release()


async def test_a_backoff_pauses_and_reduces_the_key_that_got_it_only(backend) -> None:
    await setup(backend, keys=POOL, default_pause=30.0)
    lease = await take(backend)
    backend.report_backoff("p", "429", 5.0, lease.granted_at, key=lease.key)
    lease.release()
    s = await status(backend)
    a, b = s.keys
    assert (a.name, a.limit, a.auto_reduced_from, a.notice) == ("a", 1, 2, auto_reduce_notice(1, "429"))
    assert a.paused_until is not None
    assert (b.limit, b.paused_until, b.notice) == (2, None, None)
    assert (s.paused, s.limit, s.notice) == (False, None, None), "a sibling can still serve"
    assert s.counters["backoffs"] == 1 and s.counters["auto_reductions"] == 1
    while_paused = [await take(backend), await take(backend)]
    assert [held.key for held in while_paused] == ["b", "b"]
    backend.report_backoff("p", "429", 5.0, while_paused[0].granted_at, key="b")
    s = await status(backend)
    assert s.paused and s.paused_until is not None, "every key paused: the provider is paused"
    backend.set_key_limit("p", "a", 2)
    s = await status(backend)
    assert (s.keys[0].limit, s.keys[0].auto_reduced_from, s.keys[0].notice) == (2, None, None)
    for held in while_paused:
        held.release()


async def test_an_unavailable_key_is_listed_and_never_chosen(backend) -> None:
    await setup(backend, keys=(KeySettings("a", 1), KeySettings("b", 5, available=False)))
    first = await take(backend)
    second = asyncio.create_task(backend.acquire("p", prio()))
    await queued(backend, 1)
    s = await status(backend)
    assert [(k.name, k.available, k.in_flight) for k in s.keys] == [("a", True, 1), ("b", False, 0)]
    assert first.key == "a"
    first.release()
    assert (await asyncio.wait_for(second, 5)).key == "a"


async def test_a_model_cap_serialises_its_model_while_another_runs(backend) -> None:
    await setup(backend, limit=4, models=(ModelCap("opus-*", 1),))
    opus = await take(backend, model="opus-4")
    assert opus.key is None
    second_opus = asyncio.create_task(backend.acquire("p", prio(age=100), model="opus-4"))
    await queued(backend, 1)
    other = await take(backend, model="sonnet-4")
    unmatched = await take(backend)
    s = await status(backend)
    assert [(m.pattern, m.limit, m.in_flight) for m in s.models] == [("opus-*", 1, 1)]
    assert (s.in_flight, s.queued) == (3, 1)
    assert not second_opus.done()
    opus.release()
    (await asyncio.wait_for(second_opus, 5)).release()
    other.release()
    unmatched.release()
    backend.set_model_limit("p", "opus-*", 2)
    assert (await status(backend)).models[0].limit == 2


async def test_unknown_key_or_model_is_refused(backend) -> None:
    await setup(backend, keys=POOL, models=(ModelCap("opus-*", 1),))
    with pytest.raises(UnknownLimit):
        backend.set_key_limit("p", "nope", 1)
    with pytest.raises(UnknownLimit):
        backend.set_model_limit("p", "gpt-*", 1)


async def test_a_spent_budget_holds_the_key_until_its_reset_and_is_no_backoff(backend) -> None:
    await setup(backend, keys=POOL, budgets=True)
    lease = await take(backend)
    reset = time.time() + 0.6
    backend.report_budget("p", Budget(remaining_requests=0, remaining_tokens=900, reset_at=reset,
                                      held_until=reset), key="a")
    lease.release()
    s = await status(backend)
    a = s.keys[0]
    assert a.budget is not None and a.budget["held_until"] is not None
    assert (a.budget["remaining_requests"], a.budget["remaining_tokens"]) == (0, 900)
    assert abs(a.budget["reset_at"] - reset * 1000) < 1500
    assert (a.paused_until, a.limit, a.notice) == (None, 2, None), "a hold is not a pause"
    assert s.counters["backoffs"] == 0
    held = [await take(backend), await take(backend)]
    assert [x.key for x in held] == ["b", "b"], "the held key takes nothing; its sibling does"
    started = time.monotonic()
    after = await take(backend)
    assert after.key == "a" and time.monotonic() - started >= 0.3
    for x in (*held, after):
        x.release()


async def test_a_provider_without_a_pool_is_its_one_key_for_budgets(backend) -> None:
    await setup(backend, limit=2, budgets=True)
    reset = time.time() + 0.5
    backend.report_budget("p", Budget(remaining_requests=0, reset_at=reset, held_until=reset))
    s = await status(backend)
    assert s.budget is not None and s.budget["held_until"] is not None and not s.paused
    started = time.monotonic()
    (await take(backend)).release()
    assert time.monotonic() - started >= 0.3


async def test_max_share_passes_over_a_workspace_at_its_share_while_another_waits(backend) -> None:
    await setup(backend, limit=4, max_share=0.5)
    hog = [await take(backend, prio(workspace="a")) for _ in range(4)]
    assert (await status(backend)).in_flight == 4, "alone, a workspace uses every slot"
    a_waits = asyncio.create_task(backend.acquire("p", prio(age=100, workspace="a")))
    await queued(backend, 1)
    b_waits = [asyncio.create_task(backend.acquire("p", prio(age=1, workspace="b"))) for _ in range(2)]
    await queued(backend, 3)
    hog[0].release()
    b_first = await asyncio.wait_for(b_waits[0], 5)
    assert not a_waits.done(), "a holds 3 of 4 (over its share of 2) while b waits: b goes first"
    hog[1].release()
    b_second = await asyncio.wait_for(b_waits[1], 5)
    hog[2].release()
    a_lease = await asyncio.wait_for(a_waits, 5)  # no one else waits: a is admitted
    for lease in (hog[3], b_first, b_second, a_lease):
        lease.release()
    assert (await status(backend)).in_flight == 0


async def test_max_share_is_work_conserving_when_the_other_workspace_cannot_go(backend) -> None:
    await setup(backend, limit=2, max_share=0.5, models=(ModelCap("big", 1),))
    a1 = await take(backend, prio(workspace="a"), model="big")
    b_blocked = asyncio.create_task(backend.acquire("p", prio(age=100, workspace="b"), model="big"))
    await queued(backend, 1)
    a2 = await take(backend, prio(workspace="a"))
    assert not b_blocked.done(), "b's model cap is full: a takes the idle slot though it holds its share"
    a1.release()
    (await asyncio.wait_for(b_blocked, 5)).release()
    a2.release()


async def test_grants_after_an_answer_count_against_the_requests_it_said_were_left(backend) -> None:
    await setup(backend, limit=10, budgets=True)
    reset = time.time() + 0.8
    backend.report_budget("p", Budget(remaining_requests=2, reset_at=reset, requests_reset=reset))
    await backend.flush()
    two = [await take(backend), await take(backend)]
    started = time.monotonic()
    third = await take(backend)
    assert time.monotonic() - started >= 0.4, "the window's last request was granted: the next waits for its reset"
    for lease in (*two, third):
        lease.release()


async def test_a_late_answer_in_the_same_window_does_not_give_back_grants_made_since(backend) -> None:
    await setup(backend, limit=10, budgets=True)
    reset = time.time() + 0.8
    backend.report_budget("p", Budget(remaining_requests=3, reset_at=reset, requests_reset=reset))
    await backend.flush()
    leases = [await take(backend) for _ in range(2)]
    backend.report_budget("p", Budget(remaining_requests=2, reset_at=reset, requests_reset=reset))  # an older answer
    await backend.flush()
    leases.append(await take(backend))
    started = time.monotonic()
    leases.append(await take(backend))
    assert time.monotonic() - started >= 0.3, "three were left, three were granted: the fourth waits for the reset"
    for lease in leases:
        lease.release()


async def test_a_key_backoff_is_logged_with_its_reduction_and_pause(backend, caplog) -> None:
    await setup(backend, keys=POOL)
    lease = await take(backend)
    with caplog.at_level("WARNING"):
        backend.report_backoff("p", "429", 1.0, lease.granted_at, key=lease.key)
        await status(backend)
    lease.release()
    lines = [record.getMessage() for record in caplog.records if record.name == "slotproxy.backoff"]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"p: upstream 429; key a: limit 2 → 1, paused until \d\d:\d\d:\d\d \(in (0\.9|1) s\)",
                        lines[0]), lines
