"""Token windows on fake time: the bucket's math, and admission that holds a request until its window has room."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.limiter import (
    Bucket,
    FakeClock,
    KeySettings,
    Lease,
    LimiterSettings,
    Priority,
    ProviderLimiter,
    ProviderWindows,
    WindowBook,
    WindowSettings,
)
from proxy.limiter.window import FULL

T0 = 1_700_000_000.0
ITPM = "input_tokens_per_minute"
OTPM = "output_tokens_per_minute"
TPM = "tokens_per_minute"
RPM = "requests_per_minute"


def make(windows: WindowSettings | None, limit: int | None = 10, **settings: Any) -> tuple[ProviderLimiter, FakeClock]:
    """A limiter whose only timers are its windows' unless asked (no queue or slot timeout)."""
    clock = FakeClock(T0)
    settings = {"queue_timeout": None, "slot_timeout": None, **settings}
    return ProviderLimiter("p", LimiterSettings(limit=limit, windows=windows, **settings), clock), clock


def prio(age: float = 0.0, workspace: str = "default", starred: bool = False,
         conversation: str | None = None) -> Priority:
    return Priority(prompt_started_at=T0 - age, workspace=workspace, starred=starred, conversation=conversation)


class Recorder:
    def __init__(self, limiter: ProviderLimiter) -> None:
        self.limiter = limiter
        self.granted: dict[str, Lease] = {}
        self.order: list[str] = []
        self.rejected: list[str] = []

    def enqueue(self, name: str, cost: dict[str, float], group: str = "opus", priority: Priority | None = None,
                **kwargs: Any):
        def grant(lease: Lease) -> None:
            self.granted[name] = lease
            self.order.append(name)
        return self.limiter.enqueue(priority or prio(), grant, lambda error: self.rejected.append(name),
                                    cost=cost, group=group, **kwargs)


def windows(limiter: ProviderLimiter) -> ProviderWindows:
    assert limiter.windows is not None
    return limiter.windows


def window_row(limiter: ProviderLimiter, window: str, group: str = "opus", key: str | None = None) -> dict[str, Any]:
    status = limiter.statistics()
    rows = status.windows if key is None else next(k.windows for k in status.keys if k.name == key)
    assert rows is not None
    return next(row for row in rows if row["window"] == window and row["group"] == group)


# ----- the bucket ----------------------------------------------------------------------------------------------


def test_bucket_starts_full_refills_at_capacity_per_minute_and_never_overfills() -> None:
    bucket = Bucket(600, T0)
    assert bucket.level(T0) == 600
    bucket.take(600, T0)
    assert bucket.level(T0) == 0
    assert bucket.level(T0 + 1) == pytest.approx(10)
    assert bucket.level(T0 + 30) == pytest.approx(300)
    assert bucket.level(T0 + 600) == 600
    bucket.give(10_000, T0 + 30)
    assert bucket.level(T0 + 30) == 600


def test_headroom_lowers_the_capacity_and_the_refill() -> None:
    bucket = Bucket(1000, T0, headroom=0.1)
    assert bucket.capacity == pytest.approx(900)
    assert bucket.rate == pytest.approx(15)


def test_wait_for_is_the_refill_time_of_what_is_missing() -> None:
    bucket = Bucket(600, T0)
    assert bucket.wait_for(600, T0) == 0.0
    bucket.take(500, T0)
    assert bucket.wait_for(100, T0) == 0.0
    assert bucket.wait_for(200, T0) == pytest.approx(10, abs=0.01)


def test_a_request_larger_than_the_window_waits_for_a_full_bucket_then_goes_into_debt() -> None:
    bucket = Bucket(600, T0)
    bucket.take(300, T0)
    assert bucket.wait_for(1000, T0) == pytest.approx(30, abs=0.01)
    assert bucket.wait_for(1000, T0 + 30) == 0.0
    bucket.take(1000, T0 + 30)
    assert bucket.level(T0 + 30) == pytest.approx(-400)
    assert bucket.wait_for(1000, T0 + 30) == pytest.approx(100, abs=0.01)


def test_empty_until_leaves_nothing_and_no_refill_before_the_time() -> None:
    bucket = Bucket(600, T0)
    bucket.empty_until(T0 + 20, T0)
    assert bucket.level(T0 + 19) == 0
    assert bucket.level(T0 + 21) == pytest.approx(10)
    assert bucket.wait_for(10, T0) == pytest.approx(21, abs=0.01)


def test_a_hit_with_what_the_provider_will_have_is_empty_until_then_and_holds_it_then() -> None:
    """After a 429's Retry-After the provider has room for the refused request: the window is empty before,
    holds that much at the time, and refills from there (not from empty, a refill's minute later)."""
    bucket = Bucket(600, T0)
    bucket.take(550, T0)
    bucket.empty_until(T0 + 20, T0, then=300)
    assert bucket.level(T0 + 19.9) == 0
    assert bucket.wait_for(1, T0) == pytest.approx(20, abs=0.01)
    assert bucket.wait_for(300, T0 + 5) == pytest.approx(15, abs=0.01)
    assert bucket.level(T0 + 20) == 300
    assert bucket.level(T0 + 25) == pytest.approx(350)
    bucket.empty_until(T0 + 30, T0 + 25, then=10_000)
    assert bucket.level(T0 + 30) == 600, "at most the capacity"


def test_a_later_hit_time_is_kept_and_an_answer_during_it_lowers_what_it_holds_then() -> None:
    bucket = Bucket(600, T0)
    bucket.empty_until(T0 + 30, T0, then=500)
    bucket.empty_until(T0 + 10, T0 + 1, then=200)
    assert bucket.level(T0 + 29) == 0 and bucket.level(T0 + 30) == 200
    bucket.correct(50, T0 + 20)
    assert bucket.level(T0 + 30) == pytest.approx(150), "50 left at 20 s, and ten seconds' refill by 30 s"
    bucket.correct(500, T0 + 20)
    assert bucket.level(T0 + 30) == pytest.approx(150), "only lowers"


def test_correct_only_lowers() -> None:
    bucket = Bucket(600, T0)
    bucket.take(100, T0)
    bucket.correct(550, T0)
    assert bucket.level(T0) == 500
    bucket.correct(200, T0)
    assert bucket.level(T0) == 200


def test_the_provider_s_count_is_of_its_whole_limit_so_the_headroom_comes_off_it() -> None:
    """With 10 % headroom the bucket holds 900 of a 1 000 limit; an announced 500 left means 400 for this proxy,
    else a window run low would be corrected into the share left to others."""
    bucket = Bucket(1000, T0, headroom=0.1)
    assert bucket.level(T0) == 900
    bucket.correct(500, T0)
    assert bucket.level(T0) == pytest.approx(400)
    bucket.set_limit(2000, 0.1, T0)
    bucket.correct(500, T0)
    assert bucket.level(T0) == pytest.approx(300), "the headroom of the limit in force"


def test_a_rounded_count_corrects_only_beyond_its_rounding_and_then_to_the_least_it_stands_for() -> None:
    bucket = Bucket(30_000, T0)
    bucket.correct(11_000, T0, slack=500)  # a window first learned: full, far above what was announced
    assert bucket.level(T0) == 10_500, "the least an announced 11 000 can stand for: never more than is left"
    bucket.correct(10_000, T0, slack=500)
    assert bucket.level(T0) == 10_500, "within the rounding: no correction"
    bucket.correct(9_000, T0, slack=500)
    assert bucket.level(T0) == 8_500


def test_set_limit_keeps_what_was_spent_and_never_overfills() -> None:
    bucket = Bucket(600, T0)
    bucket.take(200, T0)
    bucket.set_limit(300, 0.0, T0)
    assert bucket.level(T0) == pytest.approx(100)
    bucket.set_limit(100, 0.0, T0)
    assert bucket.level(T0) == 0
    bucket.set_limit(1200, 0.0, T0)
    assert bucket.level(T0) == pytest.approx(1100)
    assert bucket.level(T0 + 3600) == 1200


# ----- the book's limits -----------------------------------------------------------------------------------------


def test_limits_come_from_provider_then_model_pattern_then_key_and_the_smaller_learned_holds() -> None:
    book = WindowBook(WindowSettings(provider={ITPM: 1000, OTPM: 500},
                                     models={"claude-opus-*": {ITPM: 400}},
                                     keys={"team-a": {OTPM: 100}}))
    assert book.limits_for(None, "sonnet") == {ITPM: 1000, OTPM: 500}
    assert book.limits_for(None, "claude-opus-*") == {ITPM: 400, OTPM: 500}
    assert book.limits_for("team-a", "claude-opus-*") == {ITPM: 400, OTPM: 100}
    book.learn("team-a", "claude-opus-*", ITPM, 300)
    book.learn("team-a", "claude-opus-*", RPM, 50)
    book.learn("team-a", "claude-opus-*", OTPM, 900)
    assert book.limits_for("team-a", "claude-opus-*") == {ITPM: 300, OTPM: 100, RPM: 50}
    assert book.source("team-a", "claude-opus-*", ITPM) == "both"
    assert book.source("team-a", "claude-opus-*", RPM) == "headers"
    assert book.source("team-a", "claude-opus-*", OTPM) == "both"
    assert book.source(None, "sonnet", ITPM) == "config"


def test_learning_off_ignores_the_headers() -> None:
    book = WindowBook(WindowSettings(provider={ITPM: 1000}, learn=False))
    assert not book.learn(None, "g", ITPM, 10)
    assert book.limits_for(None, "g") == {ITPM: 1000}


def test_the_first_hit_on_a_window_not_made_yet_counts_once() -> None:
    book = WindowBook(WindowSettings(provider={ITPM: 1000}))
    book.hit(None, "g", ITPM, T0 + 30, T0)
    book.hit(None, "g", ITPM, T0 + 30, T0)
    (row,) = [row for row in book.status(None, now=T0) if row["window"] == ITPM]
    assert row["hits"] == 2


# ----- admission -------------------------------------------------------------------------------------------------


def test_no_windows_configured_sets_no_timer_and_status_has_no_windows() -> None:
    limiter, clock = make(None, limit=1)
    lease = limiter.try_acquire(prio(), cost={ITPM: 10**9}, group="opus")
    assert lease is not None and lease.cost is None
    limiter.enqueue(prio(), lambda lease: None, cost={ITPM: 5}, group="opus")
    lease.release()
    assert clock.timers_set == 0
    assert "windows" not in limiter.statistics().to_dict()


def test_a_request_takes_its_cost_when_sent_and_release_gives_nothing_back() -> None:
    limiter, _ = make(WindowSettings(provider={ITPM: 600, RPM: 10}))
    lease = limiter.try_acquire(prio(), cost={ITPM: 200, RPM: 1}, group="opus")
    assert lease is not None and lease.cost == {ITPM: 200, RPM: 1} and lease.group == "opus"
    row = window_row(limiter, ITPM)
    assert (row["available"], row["reserved"], row["limit"], row["source"]) == (400, 200, 600, "config")
    lease.release()
    row = window_row(limiter, ITPM)
    assert (row["available"], row["reserved"]) == (400, 0)
    assert window_row(limiter, RPM)["available"] == 9


def test_a_held_waiter_is_woken_by_one_timer_at_the_time_its_room_exists() -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}))
    first = limiter.try_acquire(prio(), cost={ITPM: 500}, group="opus")
    assert first is not None
    assert limiter.try_acquire(prio(), cost={ITPM: 300}, group="opus") is None
    rec = Recorder(limiter)
    rec.enqueue("b", {ITPM: 300})
    assert rec.order == [] and clock.timers_set == 1  # 200 missing at 10 tokens/s: 20 s
    assert window_row(limiter, ITPM)["held"] == 1
    clock.advance(19.9)
    assert rec.order == []
    clock.advance(0.2)
    assert rec.order == ["b"]
    assert clock.timers_set == 1
    row = window_row(limiter, ITPM)
    assert (row["held"], row["held_total"]) == (0, 1)


def test_a_release_with_the_window_still_short_sets_no_second_timer() -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}), limit=1)
    first = limiter.try_acquire(prio(), cost={ITPM: 600}, group="opus")
    assert first is not None
    rec = Recorder(limiter)
    rec.enqueue("b", {ITPM: 60})
    assert clock.timers_set == 0  # the slot is the limit: its release wakes the queue
    first.release()
    assert clock.timers_set == 1 and rec.order == []
    clock.advance(6.1)
    assert rec.order == ["b"]


def test_a_head_held_by_its_window_does_not_hold_another_model_group() -> None:
    limiter, _ = make(WindowSettings(provider={ITPM: 600}))
    assert limiter.try_acquire(prio(), cost={ITPM: 550}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("opus-big", {ITPM: 300}, group="opus", priority=prio(age=100))
    rec.enqueue("sonnet", {ITPM: 300}, group="sonnet")
    rec.enqueue("opus-small", {ITPM: 10}, group="opus")
    assert rec.order == ["sonnet"]  # queue order holds within opus: the small one waits behind the big one


def test_a_sibling_key_with_room_takes_the_waiter() -> None:
    keys = (KeySettings("a", limit=5), KeySettings("b", limit=5))
    limiter, _ = make(WindowSettings(provider={ITPM: 600}), limit=None, keys=keys)
    first = limiter.try_acquire(prio(conversation="c1"), cost={ITPM: 550}, group="opus")
    assert first is not None and first.key == "a"
    second = limiter.try_acquire(prio(conversation="c1"), cost={ITPM: 300}, group="opus")
    assert second is not None and second.key == "b"  # the conversation's own key has no room in its window
    rec = Recorder(limiter)
    rec.enqueue("third", {ITPM: 400})
    assert rec.order == []
    assert window_row(limiter, ITPM, key="a")["held"] == 1
    assert window_row(limiter, ITPM, key="b")["held"] == 1


def test_a_waiter_pinned_to_a_key_waits_for_that_key_s_window() -> None:
    keys = (KeySettings("a"), KeySettings("b"))
    limiter, clock = make(WindowSettings(provider={ITPM: 600}), limit=None, keys=keys)
    assert limiter.try_acquire(prio(), cost={ITPM: 600}, group="opus", key="a") is not None
    assert limiter.try_acquire(prio(), cost={ITPM: 60}, group="opus", key="a") is None
    rec = Recorder(limiter)
    rec.enqueue("pinned", {ITPM: 60}, key="a")
    rec.enqueue("free", {ITPM: 60})
    assert rec.order == ["free"] and rec.granted["free"].key == "b"
    clock.advance(6.1)
    assert rec.order == ["free", "pinned"] and rec.granted["pinned"].key == "a"


def test_starred_goes_first_when_the_window_refills() -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}))
    assert limiter.try_acquire(prio(), cost={ITPM: 600}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("old", {ITPM: 60}, priority=prio(age=500))
    rec.enqueue("starred", {ITPM: 60}, priority=prio(starred=True))
    clock.advance(6.1)
    assert rec.order == ["starred"]
    clock.advance(6.1)
    assert rec.order == ["starred", "old"]


def test_a_request_larger_than_the_window_is_sent_once_it_is_full() -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}))
    assert limiter.try_acquire(prio(), cost={ITPM: 300}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("huge", {ITPM: 5000})
    clock.advance(29.9)
    assert rec.order == []
    clock.advance(0.2)
    assert rec.order == ["huge"]
    assert window_row(limiter, ITPM)["available"] < -4000
    assert windows(limiter).beyond_windows(rec.granted["huge"]) == [ITPM]


@pytest.mark.parametrize("leaves", ["timeout", "cancel"])
def test_a_held_waiter_that_leaves_took_nothing_and_is_told_once(leaves: str) -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}), queue_timeout=5.0)
    assert limiter.try_acquire(prio(), cost={ITPM: 600}, group="opus") is not None
    rec = Recorder(limiter)
    waiter = rec.enqueue("b", {ITPM: 300})
    if leaves == "cancel":
        limiter.cancel(waiter)
    clock.advance(60)
    assert rec.order == []
    assert rec.rejected == (["b"] if leaves == "timeout" else [])
    status = limiter.statistics()
    assert status.queued == 0 and status.in_flight == 1
    assert window_row(limiter, ITPM)["available"] == 600
    assert status.counters["queue_timeouts"] == (1 if leaves == "timeout" else 0)


def test_a_window_hit_empties_it_until_the_announced_time_and_leaves_the_limit_alone() -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}))
    lease = limiter.try_acquire(prio(), cost={ITPM: 10}, group="opus")
    assert lease is not None
    windows(limiter).report_window_hit(None, "opus", ITPM, T0 + 30)
    lease.release()
    rec = Recorder(limiter)
    rec.enqueue("b", {ITPM: 60})
    clock.advance(35)
    assert rec.order == []
    clock.advance(1.2)
    assert rec.order == ["b"]
    status = limiter.statistics()
    assert window_row(limiter, ITPM)["hits"] == 1
    assert (status.limit, status.auto_reduced, status.paused, status.notice) == (10, False, False, None)


@pytest.mark.parametrize(("then", "cost", "why"), [
    (500, 500, "room for the refused request at its Retry-After, not a refill of 500 tokens (50 s) after it"),
    (FULL, 600, "the whole window at its reset"),
])
def test_after_a_hit_the_window_holds_at_the_stated_time_what_the_provider_said(then: float, cost: float,
                                                                                why: str) -> None:
    limiter, clock = make(WindowSettings(provider={ITPM: 600}))
    windows(limiter).report_window_hit(None, "opus", ITPM, T0 + 30, then=then)
    rec = Recorder(limiter)
    rec.enqueue("next", {ITPM: cost})
    clock.advance(29.9)
    assert rec.order == []
    clock.advance(0.2)
    assert rec.order == ["next"], why


def test_a_request_granted_before_a_hit_settles_against_what_the_provider_charged_it() -> None:
    """The 429's wait already counts the request the provider took before it (its whole input, not the
    proxy's small estimate): its answer settling after the hit takes nothing more from the window."""
    limiter, clock = make(WindowSettings(provider={ITPM: 6000}))
    taken = limiter.try_acquire(prio(), cost={ITPM: 100}, group="opus")
    assert taken is not None
    clock.advance(0.1)
    windows(limiter).report_window_hit(None, "opus", ITPM, T0 + 20, then=500)
    windows(limiter).settle_windows(taken, {ITPM: 4000.0}, {ITPM: "give_back"}, {ITPM: 4000.0})
    clock.advance(20)
    assert window_row(limiter, ITPM)["available"] in range(500, 511), "not 500 less the 3 900 the estimate missed"


def test_the_provider_s_remaining_corrects_downward_less_what_was_sent_since() -> None:
    limiter, clock = make(WindowSettings(provider={TPM: 600}))
    answered_at = T0
    clock.advance(1)
    assert limiter.try_acquire(prio(), cost={TPM: 100}, group="opus") is not None
    windows(limiter).report_window_remaining(None, "opus", {TPM: 300}, answered_at)
    assert window_row(limiter, TPM)["available"] == 200
    windows(limiter).report_window_remaining(None, "opus", {TPM: 590}, clock.time())
    assert window_row(limiter, TPM)["available"] == 200


def test_learned_limits_hold_when_smaller_and_make_room_when_they_grow() -> None:
    limiter, _ = make(WindowSettings(provider={ITPM: 6000}))
    windows(limiter).report_window_limits(None, "opus", {ITPM: 600, RPM: 1})
    assert windows(limiter).window_limits(None, "opus") == {ITPM: 600, RPM: 1}
    assert limiter.try_acquire(prio(), cost={ITPM: 10, RPM: 1}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("b", {ITPM: 10, RPM: 1})
    assert rec.order == []
    windows(limiter).report_window_limits(None, "opus", {RPM: 100})
    assert rec.order == ["b"]
    assert window_row(limiter, RPM)["source"] == "headers"


def test_settle_gives_back_an_over_estimate_and_charges_an_under_estimate() -> None:
    limiter, _ = make(WindowSettings(provider={ITPM: 600, OTPM: 600}))
    lease = limiter.try_acquire(prio(), cost={ITPM: 300, OTPM: 100}, group="opus")
    assert lease is not None
    rec = Recorder(limiter)
    rec.enqueue("b", {ITPM: 400})
    assert rec.order == []
    windows(limiter).settle_windows(lease, {ITPM: 100, OTPM: 250}, {ITPM: "give_back", OTPM: "give_back"})
    assert rec.order == ["b"]  # the 200 given back made room at once
    assert window_row(limiter, OTPM)["available"] == 350
    windows(limiter).settle_windows(lease, {ITPM: 0, OTPM: 0}, {ITPM: "give_back", OTPM: "give_back"})
    assert window_row(limiter, OTPM)["available"] == 350  # once per lease


def test_settle_charge_beyond_gives_nothing_back() -> None:
    limiter, _ = make(WindowSettings(provider={TPM: 6000}))
    big = limiter.try_acquire(prio(), cost={TPM: 1000}, group="gpt")
    small = limiter.try_acquire(prio(), cost={TPM: 1000}, group="gpt")
    assert big is not None and small is not None
    windows(limiter).settle_windows(small, {TPM: 200}, {TPM: "charge_beyond"})
    assert window_row(limiter, TPM, group="gpt")["available"] == 4000
    windows(limiter).settle_windows(big, {TPM: 1500}, {TPM: "charge_beyond"})
    assert window_row(limiter, TPM, group="gpt")["available"] == 3500


def test_a_reload_that_raises_a_window_keeps_what_was_spent_and_one_that_removes_windows_frees_the_held() -> None:
    limiter, _ = make(WindowSettings(provider={ITPM: 600}))
    assert limiter.try_acquire(prio(), cost={ITPM: 600}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("b", {ITPM: 300})
    limiter.apply_settings(LimiterSettings(limit=10, windows=WindowSettings(provider={ITPM: 700})))
    assert rec.order == []  # what was spent stays spent: 100 more, and 300 asked
    assert window_row(limiter, ITPM)["limit"] == 700
    limiter.apply_settings(LimiterSettings(limit=10))
    assert rec.order == ["b"]
    assert "windows" not in limiter.statistics().to_dict()


def test_a_refill_timer_grants_when_it_fires_where_the_clock_s_floats_are_coarse() -> None:
    """Far from zero a float second has few bits after the point: the timer is set for when the whole amount
    is there and the room counts a millisecond's refill as there, so it grants at once, never re-arming itself
    for the same instant (it once spun for ever here)."""
    limiter, clock = make(WindowSettings(provider={OTPM: 100_000}))
    assert limiter.try_acquire(prio(), cost={OTPM: 64_000}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("a", {OTPM: 41_000}, priority=prio(age=2))
    rec.enqueue("b", {OTPM: 41_000}, priority=prio(age=1))
    clock.advance(60)
    assert rec.order == ["a", "b"]
    assert clock.timers_set == 2


def test_a_request_s_windows_are_looked_up_once_and_the_least_recently_used_idle_pair_is_still_forgotten_first(
        ) -> None:
    """Its take, end, settling and answer find the windows of the (key, group) it was admitted on without
    another lookup; a pair reloaded or forgotten in between is looked up again, and the order of use kept."""
    from collections import OrderedDict

    from proxy.limiter import window

    class Counted(OrderedDict[Any, Any]):
        gets = 0

        def get(self, *args: Any) -> Any:
            Counted.gets += 1
            return super().get(*args)

    book = WindowBook(WindowSettings(provider={TPM: 10_000, RPM: 100}))
    book._sets = Counted(book._sets)
    cost = {TPM: 300.0, RPM: 1.0}
    assert book.wait_for(None, "gpt", cost, T0) == 0.0
    looked_up = Counted.gets
    book.take(None, "gpt", cost, T0)
    book.correct_all(None, "gpt", {TPM: 9_000}, T0 + 1, T0)
    assert not book.settle(None, "gpt", TPM, 300.0, 400.0, "charge_beyond", T0 + 2)
    book.ended(None, "gpt", cost)
    assert Counted.gets == looked_up, "one lookup for the request"
    assert [(row["available"], row["reserved"]) for row in book.status(None, now=T0 + 2)] == [(9_066, 0), (100, 0)]
    book.wait_for(None, "o3", cost, T0 + 2)
    book.ended(None, "gpt", cost)
    assert Counted.gets > looked_up, "another pair used since: looked up again"
    book.apply(WindowSettings(provider={TPM: 20_000, RPM: 100}), T0 + 3)
    book.take(None, "o3", cost, T0 + 3)
    assert book.limits_for(None, "o3") == {TPM: 20_000, RPM: 100}
    assert [row["reserved"] for row in book.status(None, "o3", now=T0 + 3)] == [300, 1], "the reloaded windows"
    book.ended(None, "o3", cost)
    saved, window.MAX_GROUPS = window.MAX_GROUPS, 2
    try:
        book.wait_for(None, "gpt", cost, T0 + 4)  # now used after o3: o3 is the least recently used
        book.wait_for(None, "claude", cost, T0 + 4)
    finally:
        window.MAX_GROUPS = saved
    assert [group for _, group in book._sets] == ["gpt", "claude"]
