"""Waiters costed again when their model group's estimates moved (``ProviderWindows.recost``), on fake time:
a request queued on its prior output estimate (its max_tokens) is granted the moment its group is costed
again, the queue keeps its order, and a waiter that leaves meanwhile is never granted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.limiter import KeySettings, Lease, Waiter, WindowSettings

from .test_windows import ITPM, OTPM, Recorder, make, prio, window_row, windows

OTPM_LIMIT = 100_000
"""Refills 1,667 tokens a second: a 64,000 prior takes 38 s to come back."""
PRIOR = 64_000.0
LEARNED = 500.0


class Costs:
    """Each waiter's own estimate, as the relay's ``Costing`` gives it: what it costs now, asked again."""

    def __init__(self) -> None:
        self.now: dict[str, dict[str, float] | None] = {}
        self.asked: list[str] = []

    def of(self, name: str, cost: dict[str, float]) -> Any:
        self.now[name] = cost

        def recost() -> Mapping[str, float] | None:
            self.asked.append(name)
            return self.now[name]
        return recost


def queued(rec: Recorder, costs: Costs, name: str, cost: dict[str, float], **kwargs: Any) -> Waiter:
    waiter = rec.enqueue(name, cost, **kwargs)
    waiter.recost = costs.of(name, cost)  # as the backend sets it on the waiter it queued
    return waiter


def held_by_a_prior(**settings: Any) -> tuple[Any, Any, Recorder, Costs, Lease]:
    """The output window after a cold start: the first request took its whole max_tokens, the next wait."""
    limiter, clock = make(WindowSettings(provider={OTPM: OTPM_LIMIT}), **settings)
    first = limiter.try_acquire(prio(), cost={OTPM: PRIOR}, group="opus")
    assert first is not None
    return limiter, clock, Recorder(limiter), Costs(), first


def test_a_waiter_held_by_its_prior_output_estimate_is_granted_as_soon_as_it_is_costed_again() -> None:
    limiter, clock, rec, costs, _ = held_by_a_prior()
    for name in ("a", "b", "c"):
        queued(rec, costs, name, {OTPM: PRIOR})
    assert rec.order == [] and window_row(limiter, OTPM)["held"] == 3
    timers = clock.timers_set
    for name in costs.now:
        costs.now[name] = {OTPM: LEARNED}  # the first answer taught the group a small p90
    assert windows(limiter).recost("opus") == 3
    assert rec.order == ["a", "b", "c"], "at once, in queue order, on the same instant of the fake clock"
    assert all(rec.granted[name].cost == {OTPM: LEARNED} for name in "abc")
    assert clock.timers_set == timers, "no timer, no poll: the re-costing itself looked at the queue again"
    row = window_row(limiter, OTPM)
    assert (row["held"], row["reserved"]) == (0, PRIOR + 3 * LEARNED)
    assert row["available"] == OTPM_LIMIT - PRIOR - 3 * LEARNED


def test_a_held_head_whose_cost_dropped_goes_and_the_waiters_of_its_group_follow_in_order() -> None:
    """The head still does not fit after one re-costing: the smaller ones behind it in its group keep waiting
    (a held head holds its group, as always); once it fits, the three go in queue order."""
    limiter, _, rec, costs, _ = held_by_a_prior()
    queued(rec, costs, "old", {OTPM: PRIOR}, priority=prio(age=60))
    queued(rec, costs, "starred", {OTPM: PRIOR}, priority=prio(starred=True))
    queued(rec, costs, "new", {OTPM: PRIOR})
    order = [waiter.prompt_started_at for waiter in limiter.statistics().queue]
    costs.now.update(starred={OTPM: 50_000.0}, old={OTPM: LEARNED}, new={OTPM: LEARNED})
    windows(limiter).recost("opus")
    assert rec.order == [], "the starred head needs 50,000 of 36,000: the cheaper ones behind it wait"
    assert [waiter.prompt_started_at for waiter in limiter.statistics().queue] == order, "never reordered"
    assert [waiter.starred for waiter in limiter.statistics().queue] == [True, False, False]
    costs.now["starred"] = {OTPM: 2_000.0}
    windows(limiter).recost("opus")
    assert rec.order == ["starred", "old", "new"]


def test_costs_that_rise_keep_the_queue_order_and_the_refill_timer_then_grants_in_order() -> None:
    limiter, clock, rec, costs, _ = held_by_a_prior()
    for name, age in (("a", 30), ("b", 20), ("c", 10)):
        queued(rec, costs, name, {OTPM: 40_000.0}, priority=prio(age=age))
    order = [(w.prompt_started_at, w.starred) for w in limiter.statistics().queue]
    for name in costs.now:
        costs.now[name] = {OTPM: 41_000.0}
    assert windows(limiter).recost("opus") == 3
    assert [(w.prompt_started_at, w.starred) for w in limiter.statistics().queue] == order
    clock.advance(2.5)
    assert rec.order == [], "40,000 would have fitted after 2.4 s; 41,000 needs 3 s"
    clock.advance(0.6)
    assert rec.order == ["a"]
    clock.advance(24.6)  # 41,000 more at 1,667 a second
    assert rec.order == ["a", "b"]
    clock.advance(24.6)
    assert rec.order == ["a", "b", "c"]
    assert rec.granted["c"].cost == {OTPM: 41_000.0}


def test_only_the_group_named_is_costed_again_and_an_unchanged_cost_wakes_nobody() -> None:
    limiter, _, rec, costs, _ = held_by_a_prior()
    sonnet = limiter.try_acquire(prio(), cost={OTPM: PRIOR}, group="sonnet")
    assert sonnet is not None
    queued(rec, costs, "opus", {OTPM: PRIOR})
    queued(rec, costs, "sonnet", {OTPM: PRIOR}, group="sonnet")
    rec.enqueue("no-recost", {OTPM: PRIOR})
    assert windows(limiter).recost("opus") == 0, "the same cost again: nothing changed"
    costs.now["opus"] = costs.now["sonnet"] = {OTPM: LEARNED}
    assert windows(limiter).recost("opus") == 1
    assert costs.asked == ["opus", "opus"]
    assert rec.order == ["opus"], "the waiter without a recost keeps its cost and its place"
    costs.now["opus"] = None
    assert windows(limiter).recost("sonnet") == 1 and rec.order == ["opus", "sonnet"]


def test_a_waiter_with_no_window_now_keeps_its_cost() -> None:
    limiter, _, rec, costs, _ = held_by_a_prior()
    queued(rec, costs, "a", {OTPM: PRIOR})
    costs.now["a"] = None
    assert windows(limiter).recost("opus") == 0 and rec.order == []


def test_a_waiter_that_leaves_while_its_group_is_costed_again_is_never_granted_and_holds_nothing() -> None:
    """Its client leaves in the middle of the re-costing (another waiter's estimate is asked first): it is not
    asked, not granted; the others are, once each."""
    limiter, _, rec, costs, first = held_by_a_prior()
    waiters = {name: queued(rec, costs, name, {OTPM: PRIOR}) for name in ("a", "b", "c")}
    for name in costs.now:
        costs.now[name] = {OTPM: LEARNED}
    leaving = waiters["b"]
    asked_first = costs.of("a", {OTPM: LEARNED})

    def a_then_b_leaves() -> Mapping[str, float] | None:
        limiter.cancel(leaving)
        return asked_first()
    waiters["a"].recost = waiters["c"].recost = a_then_b_leaves  # whichever is asked first, b leaves then
    windows(limiter).recost("opus")
    assert rec.order == ["a", "c"] and "b" not in costs.asked and rec.rejected == []
    status = limiter.statistics()
    assert (status.queued, status.in_flight) == (0, 3)
    for lease in (first, rec.granted["a"], rec.granted["c"]):
        lease.release()
        lease.release()  # once
    row = window_row(limiter, OTPM)
    assert (row["reserved"], row["held"]) == (0, 0)
    assert limiter.statistics().in_flight == 0


def test_a_waiter_that_timed_out_is_not_costed_again() -> None:
    limiter, clock, rec, costs, _ = held_by_a_prior(queue_timeout=5.0)
    queued(rec, costs, "a", {OTPM: PRIOR})
    clock.advance(6)
    assert rec.rejected == ["a"]
    costs.now["a"] = {OTPM: LEARNED}
    assert windows(limiter).recost("opus") == 0 and costs.asked == [] and rec.order == []
    assert limiter.statistics().counters["queue_timeouts"] == 1


def test_a_re_costed_waiter_takes_a_sibling_key_whose_window_has_room() -> None:
    keys = (KeySettings("a", limit=4), KeySettings("b", limit=4))
    limiter, _ = make(WindowSettings(provider={OTPM: OTPM_LIMIT, ITPM: 10_000}), limit=None, keys=keys)
    rec, costs = Recorder(limiter), Costs()
    for _ in range(2):
        assert limiter.try_acquire(prio(), cost={OTPM: PRIOR, ITPM: 100}, group="opus") is not None
    queued(rec, costs, "w", {OTPM: PRIOR, ITPM: 100})
    assert window_row(limiter, OTPM, key="a")["held"] == 1 and window_row(limiter, OTPM, key="b")["held"] == 1
    costs.now["w"] = {OTPM: LEARNED, ITPM: 100}
    windows(limiter).recost("opus")
    assert rec.order == ["w"] and rec.granted["w"].key in ("a", "b")
