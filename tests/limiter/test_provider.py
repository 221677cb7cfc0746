"""The limiter core on fake time: every decision, no sleeps."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import QueueFull
from proxy.limiter import (
    FakeClock,
    Lease,
    LimiterSettings,
    Priority,
    ProviderLimiter,
    auto_reduce_notice,
)

T0 = 1_700_000_000.0


def make(limit: int | None = 2, **settings: object) -> tuple[ProviderLimiter, FakeClock]:
    clock = FakeClock(T0)
    return ProviderLimiter("p", LimiterSettings(limit=limit, **settings), clock), clock  # type: ignore[arg-type]


def prio(age: float = 0.0, workspace: str = "default", starred: bool = False) -> Priority:
    return Priority(prompt_started_at=T0 - age, workspace=workspace, starred=starred)


class Recorder:
    """Collects grants in the order the limiter makes them."""

    def __init__(self) -> None:
        self.granted: list[tuple[str, Lease]] = []
        self.timed_out: list[str] = []

    def enqueue(self, limiter: ProviderLimiter, name: str, priority: Priority | None = None):
        return limiter.enqueue(
            priority or prio(),
            lambda lease: self.granted.append((name, lease)),
            lambda error: self.timed_out.append(name),
        )

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.granted]

    def lease(self, name: str) -> Lease:
        return dict(self.granted)[name]


def test_no_limit_grants_at_once_and_release_leaves_nothing() -> None:
    limiter, _ = make(limit=None)
    leases = [limiter.try_acquire(prio()) for _ in range(1000)]
    assert all(lease is not None for lease in leases)
    for lease in leases:
        assert lease is not None
        lease.release()
    status = limiter.statistics()
    assert (status.in_flight, status.queued, status.limit) == (0, 0, None)


def test_under_limit_granted_at_limit_queued() -> None:
    limiter, _ = make(limit=2)
    assert limiter.try_acquire(prio()) is not None
    assert limiter.try_acquire(prio()) is not None
    assert limiter.try_acquire(prio()) is None
    rec = Recorder()
    rec.enqueue(limiter, "third")
    assert rec.names == []
    assert limiter.statistics().queued == 1


def test_queue_order_starred_then_oldest_prompt_then_arrival() -> None:
    limiter, _ = make(limit=1)
    holder = limiter.try_acquire(prio())
    assert holder is not None
    rec = Recorder()
    rec.enqueue(limiter, "new-1", prio(age=1))
    rec.enqueue(limiter, "old", prio(age=100))
    rec.enqueue(limiter, "new-2", prio(age=1))
    rec.enqueue(limiter, "starred-new", prio(age=0, starred=True))
    assert [w.workspace for w in limiter.statistics().queue] == ["default"] * 4
    assert [w.starred for w in limiter.statistics().queue] == [True, False, False, False]
    holder.release()
    for _ in range(3):
        rec.granted[-1][1].release()
    assert rec.names == ["starred-new", "old", "new-1", "new-2"]


def test_starring_a_workspace_moves_its_waiting_requests_ahead() -> None:
    limiter, _ = make(limit=1)
    holder = limiter.try_acquire(prio())
    assert holder is not None
    rec = Recorder()
    rec.enqueue(limiter, "a-old", prio(age=50, workspace="a"))
    rec.enqueue(limiter, "b-new", prio(age=1, workspace="b"))
    limiter.set_starred(frozenset({"b"}))
    assert [w.workspace for w in limiter.statistics().queue] == ["b", "a"]
    holder.release()
    assert rec.names == ["b-new"]
    limiter.set_starred(frozenset())
    rec.lease("b-new").release()
    assert rec.names == ["b-new", "a-old"]


def test_release_is_idempotent_and_hands_the_slot_on() -> None:
    limiter, _ = make(limit=1)
    first = limiter.try_acquire(prio())
    assert first is not None
    rec = Recorder()
    rec.enqueue(limiter, "w1")
    rec.enqueue(limiter, "w2")
    first.release()
    first.release()
    assert rec.names == ["w1"]
    assert limiter.in_flight == 1
    rec.lease("w1").release()
    rec.lease("w1").release()
    assert rec.names == ["w1", "w2"]
    assert limiter.in_flight == 1


def test_backoff_pauses_even_under_the_limit_then_grants_in_order() -> None:
    limiter, clock = make(limit=5, default_pause=30.0)
    sent = limiter.try_acquire(prio())
    assert sent is not None
    limiter.report_backoff("429", 10.0, sent_at=sent.granted_at)
    sent.release()
    assert limiter.try_acquire(prio()) is None
    rec = Recorder()
    rec.enqueue(limiter, "new", prio(age=1))
    rec.enqueue(limiter, "old", prio(age=9))
    status = limiter.statistics()
    assert status.paused and status.paused_until == int((T0 + 10) * 1000)
    clock.advance(9.9)
    assert rec.names == []
    clock.advance(0.2)
    assert rec.names == ["old", "new"]
    assert limiter.statistics().paused_until is None


def test_backoff_without_stated_wait_uses_default_pause() -> None:
    limiter, clock = make(limit=3, default_pause=30.0)
    limiter.report_backoff("429", None)
    assert limiter.statistics().paused_until == int((T0 + 30) * 1000)
    clock.advance(30)
    assert not limiter.paused()


def test_backoff_lowers_limit_once_per_pause_and_marks_it() -> None:
    limiter, clock = make(limit=3)
    leases = [limiter.try_acquire(prio()) for _ in range(3)]
    for lease in leases:
        assert lease is not None
        limiter.report_backoff("429", 5.0, sent_at=lease.granted_at)
    status = limiter.statistics()
    assert (status.limit, status.configured_limit) == (2, 3)
    assert status.auto_reduced and status.auto_reduced_from == 3
    assert status.notice == "Concurrency limit auto-reduced to 2 after a 429 — restore manually when ready."
    clock.advance(6)
    # A late 429 from a request sent before the reduction is the same burst.
    limiter.report_backoff("429", 5.0, sent_at=leases[0].granted_at)
    assert limiter.limit == 2
    for lease in leases:
        lease.release()
    clock.advance(6)
    later = limiter.try_acquire(prio())
    assert later is not None
    limiter.report_backoff("529", 5.0, sent_at=later.granted_at)
    status = limiter.statistics()
    assert (status.limit, status.auto_reduced_from) == (1, 3)
    assert status.notice == auto_reduce_notice(1, "529")


def test_auto_reduction_never_goes_below_one() -> None:
    limiter, clock = make(limit=1)
    for _ in range(3):
        limiter.report_backoff("429", 1.0)
        clock.advance(2)
    assert limiter.limit == 1
    assert not limiter.statistics().auto_reduced


def test_manual_limit_clears_the_auto_reduction() -> None:
    limiter, _ = make(limit=4)
    limiter.report_backoff("overloaded_error", 1.0)
    assert limiter.statistics().notice == auto_reduce_notice(3, "overloaded_error")
    limiter.set_limit(4)
    status = limiter.statistics()
    assert (status.limit, status.auto_reduced, status.auto_reduced_from, status.notice) == (4, False, None, None)


def test_restoring_persisted_state_keeps_mark_and_notice() -> None:
    limiter, _ = make(limit=4)
    limiter.report_backoff("429", 1.0)
    saved = limiter.export_state()
    fresh, _ = make(limit=4)
    fresh.restore_state(saved)
    status = fresh.statistics()
    assert (status.limit, status.auto_reduced, status.auto_reduced_from) == (3, True, 4)
    assert status.notice == auto_reduce_notice(3, "429")


def test_raising_the_limit_grants_waiters_at_once_and_null_grants_all() -> None:
    limiter, _ = make(limit=1)
    assert limiter.try_acquire(prio()) is not None
    rec = Recorder()
    for i in range(5):
        rec.enqueue(limiter, f"w{i}")
    limiter.set_limit(3)
    assert rec.names == ["w0", "w1"]
    limiter.set_limit(None)
    assert rec.names == ["w0", "w1", "w2", "w3", "w4"]
    assert limiter.in_flight == 6


def test_lowering_the_limit_only_stops_new_grants() -> None:
    limiter, _ = make(limit=3)
    leases = [limiter.try_acquire(prio()) for _ in range(3)]
    limiter.set_limit(1)
    assert limiter.in_flight == 3
    rec = Recorder()
    rec.enqueue(limiter, "w")
    for lease in leases[:2]:
        assert lease is not None
        lease.release()
    assert rec.names == []
    assert leases[2] is not None
    leases[2].release()
    assert rec.names == ["w"]


def test_release_cooldown_keeps_the_slot_counted() -> None:
    limiter, clock = make(limit=1, release_cooldown=0.5)
    lease = limiter.try_acquire(prio())
    assert lease is not None
    rec = Recorder()
    rec.enqueue(limiter, "next")
    lease.release()
    assert limiter.in_flight == 1 and rec.names == []
    clock.advance(0.49)
    assert rec.names == []
    clock.advance(0.02)
    assert rec.names == ["next"]


def test_cooldown_change_applies_to_later_releases() -> None:
    limiter, clock = make(limit=1)
    limiter.set_cooldown(1.0)
    lease = limiter.try_acquire(prio())
    assert lease is not None
    lease.release()
    assert limiter.in_flight == 1
    clock.advance(1.0)
    assert limiter.in_flight == 0
    assert limiter.statistics().cooldown_ms == 1000
    with pytest.raises(ValueError, match="non-negative"):
        limiter.set_cooldown(-1)


def test_watchdog_reclaims_tells_holder_and_grants_next() -> None:
    limiter, clock = make(limit=1, slot_timeout=60.0)
    stuck = limiter.try_acquire(prio())
    assert stuck is not None
    aborted: list[bool] = []
    stuck.on_reclaim = lambda: aborted.append(True)
    rec = Recorder()
    rec.enqueue(limiter, "next")
    clock.advance(59)
    assert rec.names == [] and aborted == []
    clock.advance(2)
    assert aborted == [True] and stuck.reclaimed
    assert rec.names == ["next"]
    stuck.release()
    assert limiter.in_flight == 1
    assert limiter.statistics().counters["reclaims"] == 1


def test_released_lease_is_not_reclaimed() -> None:
    limiter, clock = make(limit=1, slot_timeout=5.0)
    lease = limiter.try_acquire(prio())
    assert lease is not None
    lease.release()
    clock.advance(10)
    assert limiter.statistics().counters["reclaims"] == 0
    assert clock.pending == 0


def test_watchdog_reclaims_each_lease_at_its_own_deadline_with_one_timer() -> None:
    limiter, clock = make(limit=None, slot_timeout=10.0)
    leases = []
    for _ in range(3):
        lease = limiter.try_acquire(prio())
        assert lease is not None
        leases.append(lease)
        clock.advance(1)
    assert clock.pending == 1
    leases[1].release()
    clock.advance(7)  # t = 10: the first is due
    assert [lease.reclaimed for lease in leases] == [True, False, False]
    clock.advance(1.5)  # the second was released; the third is due at t = 12
    assert not leases[2].reclaimed and clock.pending == 1
    clock.advance(1)
    assert leases[2].reclaimed and clock.pending == 0
    assert limiter.statistics().counters["reclaims"] == 2


def test_a_reload_that_shortens_slot_timeout_applies_to_held_slots() -> None:
    limiter, clock = make(limit=None, slot_timeout=100.0)
    lease = limiter.try_acquire(prio())
    assert lease is not None
    clock.advance(30)
    limiter.apply_settings(LimiterSettings(limit=None, slot_timeout=20.0))
    clock.advance(0)
    assert lease.reclaimed
    fresh = limiter.try_acquire(prio())
    assert fresh is not None
    limiter.apply_settings(LimiterSettings(limit=None, slot_timeout=None))
    clock.advance(200)
    assert not fresh.reclaimed and clock.pending == 0


def test_cancelled_waiter_is_removed_and_never_granted() -> None:
    limiter, clock = make(limit=1, queue_timeout=10.0)
    holder = limiter.try_acquire(prio())
    assert holder is not None
    rec = Recorder()
    gone = rec.enqueue(limiter, "gone")
    rec.enqueue(limiter, "stays")
    limiter.cancel(gone)
    limiter.cancel(gone)
    assert limiter.statistics().queued == 1
    holder.release()
    assert rec.names == ["stays"]
    clock.advance(20)
    assert rec.timed_out == []


def test_queue_timeout_expires_the_waiter() -> None:
    limiter, clock = make(limit=1, queue_timeout=10.0)
    assert limiter.try_acquire(prio()) is not None
    rec = Recorder()
    rec.enqueue(limiter, "slow")
    clock.advance(10.5)
    assert rec.timed_out == ["slow"]
    assert limiter.statistics().queued == 0
    assert limiter.statistics().counters["queue_timeouts"] == 1


def test_max_queue_refuses_the_next_waiter() -> None:
    limiter, _ = make(limit=1, max_queue=2)
    assert limiter.try_acquire(prio()) is not None
    rec = Recorder()
    rec.enqueue(limiter, "1")
    rec.enqueue(limiter, "2")
    with pytest.raises(QueueFull, match="full"):
        rec.enqueue(limiter, "3")
    assert limiter.statistics().counters["queue_full"] == 1


def test_fast_path_never_overtakes_a_waiter() -> None:
    limiter, clock = make(limit=1, release_cooldown=1.0)
    lease = limiter.try_acquire(prio())
    assert lease is not None
    rec = Recorder()
    rec.enqueue(limiter, "waiting")
    lease.release()
    assert limiter.try_acquire(prio()) is None
    clock.advance(1.0)
    assert rec.names == ["waiting"]


def test_grant_callback_that_releases_at_once_passes_the_slot_on() -> None:
    limiter, _ = make(limit=1)
    holder = limiter.try_acquire(prio())
    assert holder is not None
    granted: list[str] = []
    limiter.enqueue(prio(), lambda lease: (granted.append("left"), lease.release()))
    limiter.enqueue(prio(), lambda lease: granted.append("stays"))
    holder.release()
    assert granted == ["left", "stays"]
    assert limiter.in_flight == 1


def test_recovery_raises_one_step_per_quiet_period_up_to_the_old_limit() -> None:
    limiter, clock = make(limit=4, recovery_after=600.0)
    limiter.report_backoff("429", 1.0)
    clock.advance(2)
    first = limiter.try_acquire(prio())
    assert first is not None
    limiter.report_backoff("429", 1.0, sent_at=first.granted_at)
    assert limiter.limit == 2
    clock.advance(599)
    assert limiter.limit == 2
    clock.advance(2)
    assert limiter.limit == 3 and limiter.statistics().auto_reduced
    clock.advance(600)
    status = limiter.statistics()
    assert (status.limit, status.auto_reduced, status.notice) == (4, False, None)
    clock.advance(6000)
    assert limiter.limit == 4


def test_without_recovery_the_reduction_stays() -> None:
    limiter, clock = make(limit=4)
    limiter.report_backoff("429", 1.0)
    clock.advance(86_400)
    assert limiter.limit == 3 and limiter.statistics().auto_reduced


def test_statistics_has_every_status_field() -> None:
    limiter, clock = make(limit=1, release_cooldown=0.25)
    assert limiter.try_acquire(Priority(prompt_started_at=T0, workspace="holder", conversation="h1",
                                        transport="websocket"), model="gpt-5") is not None
    limiter.enqueue(Priority(prompt_started_at=T0 - 5, workspace="ws", conversation="c1"), lambda lease: None)
    clock.advance(1.5)
    data = limiter.statistics().to_dict()
    assert set(data) == {
        "provider", "limit", "configured_limit", "in_flight", "queued", "paused", "paused_until",
        "cooldown_ms", "auto_reduced", "auto_reduced_from", "notice", "queue", "holders", "usage", "rejected", "keys",
        "models",
    }
    assert data["holders"] == [{
        "workspace": "holder", "starred": False, "conversation": "h1", "model": "gpt-5", "key": None,
        "transport": "websocket", "granted_at": int(T0 * 1000), "held_ms": 1500,
    }]
    assert data["cooldown_ms"] == 250
    assert data["queue"] == [{
        "workspace": "ws", "starred": False, "prompt_started_at": int((T0 - 5) * 1000),
        "waited_ms": 1500, "conversation": "c1", "transport": "http",
    }]


def test_a_retry_keeps_its_arrival_place() -> None:
    limiter, _ = make(limit=1)
    holder = limiter.try_acquire(prio())
    assert holder is not None
    rec = Recorder()
    first_seq = limiter.next_arrival()
    rec.enqueue(limiter, "later")
    limiter.enqueue(prio(), lambda lease: rec.granted.append(("retry", lease)), seq=first_seq)
    holder.release()
    assert rec.names == ["retry"]


def test_a_retry_requeued_during_a_pause_keeps_its_place_and_loses_no_one() -> None:
    """A granted waiter leaves its heap at once: its 429 retry (same place, same key) never meets its old entry."""
    clock = FakeClock(T0)
    limiter = ProviderLimiter("p", LimiterSettings(limit=1, queue_timeout=600), clock)
    granted: list[Any] = []
    holder = limiter.try_acquire(Priority(prompt_started_at=T0))
    older, newer = Priority(prompt_started_at=T0 - 10), Priority(prompt_started_at=T0 - 5)
    limiter.enqueue(older, granted.append)
    limiter.enqueue(newer, lambda lease: granted.append(("newer", lease)))
    holder.release()
    first = granted.pop()
    limiter.report_backoff("429", 1.0, sent_at=first.granted_at)
    first.release()
    limiter.enqueue(older, granted.append, seq=first.seq)
    assert limiter.queued == 2
    clock.advance(1.5)
    assert len(granted) == 1 and not isinstance(granted[0], tuple), "the retry goes first, in its old place"
    granted.pop().release()
    assert granted and granted[0][0] == "newer"
    granted[0][1].release()
    assert (limiter.queued, limiter.in_flight) == (0, 0)
