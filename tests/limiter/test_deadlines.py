"""Queue timeouts share one timer per provider; waiters that left early cost nothing later."""

from __future__ import annotations

from proxy.limiter import FakeClock, Lease, LimiterSettings, Priority, ProviderLimiter
from proxy.limiter.deadlines import Deadlines

T0 = 1_700_000_000.0


def test_one_timer_serves_every_waiting_request() -> None:
    clock = FakeClock(T0)
    limiter = ProviderLimiter("p", LimiterSettings(limit=1, queue_timeout=10.0, slot_timeout=None), clock)
    assert limiter.try_acquire(Priority(prompt_started_at=T0)) is not None
    expired: list[int] = []
    for i in range(100):
        limiter.enqueue(Priority(prompt_started_at=T0), lambda lease: None, lambda error, i=i: expired.append(i))
        clock.advance(0.01)
    assert clock.pending == 1
    clock.advance(10.0 - 0.5)
    assert expired == list(range(50))
    clock.advance(1.0)
    assert expired == list(range(100))
    assert clock.pending == 0


def test_granted_and_cancelled_waiters_release_their_callbacks_and_the_timer_runs_out_idle() -> None:
    clock = FakeClock(T0)
    limiter = ProviderLimiter("p", LimiterSettings(limit=1, queue_timeout=10.0, slot_timeout=None), clock)
    holder = limiter.try_acquire(Priority(prompt_started_at=T0))
    assert holder is not None
    granted: list[Lease] = []
    rejected: list[object] = []
    first = limiter.enqueue(Priority(prompt_started_at=T0), granted.append, rejected.append)
    second = limiter.enqueue(Priority(prompt_started_at=T0), granted.append, rejected.append)
    limiter.cancel(second)
    holder.release()
    assert len(granted) == 1
    assert first.on_grant is None and second.on_grant is None
    clock.advance(10.0)
    assert clock.pending == 0 and not rejected and len(granted) == 1


def test_a_waiter_after_the_last_one_left_sets_no_timer_of_its_own() -> None:
    """A lone request at a time: the timer the first one set serves the next, and is armed again for it
    when it fires early."""
    clock = FakeClock()
    due: list[str] = []
    deadlines: Deadlines[_Entry] = Deadlines(clock, lambda entry: due.append(entry.name))
    first = _Entry("first")
    deadlines.add(first, clock.time() + 10)
    first.queued = False
    deadlines.settle(0)
    clock.advance(1)
    deadlines.add(_Entry("second"), clock.time() + 10)
    assert clock.timers_set == 1
    clock.advance(9)
    assert due == [] and clock.pending == 1
    clock.advance(1)
    assert due == ["second"] and clock.pending == 0


def test_a_shorter_queue_timeout_after_a_reload_is_honoured() -> None:
    clock = FakeClock(T0)
    limiter = ProviderLimiter("p", LimiterSettings(limit=1, queue_timeout=60.0, slot_timeout=None), clock)
    assert limiter.try_acquire(Priority(prompt_started_at=T0)) is not None
    expired: list[str] = []
    limiter.enqueue(Priority(prompt_started_at=T0), lambda lease: None, lambda error: expired.append("old"))
    limiter.apply_settings(LimiterSettings(limit=1, queue_timeout=5.0, slot_timeout=None))
    limiter.enqueue(Priority(prompt_started_at=T0), lambda lease: None, lambda error: expired.append("new"))
    clock.advance(5.5)
    assert expired == ["new"]
    clock.advance(60)
    assert expired == ["new", "old"]


class _Entry:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queued = True


def test_an_entry_added_while_due_ones_are_handled_does_not_delay_an_earlier_one() -> None:
    """on_due may add() (a watch that moved on is put back): the timer still wakes for the earliest left."""
    clock = FakeClock()
    due: list[tuple[str, float]] = []
    start = clock.time()

    def on_due(entry: _Entry) -> None:
        due.append((entry.name, clock.time() - start))
        entry.queued = False
        if entry.name == "first":
            later = _Entry("put back")
            deadlines.add(later, clock.time() + 10)

    deadlines: Deadlines[_Entry] = Deadlines(clock, on_due)
    deadlines.add(_Entry("first"), start + 1)
    deadlines.add(_Entry("second"), start + 2)
    clock.advance(1)
    clock.advance(1)
    assert due == [("first", 1), ("second", 2)]
    clock.advance(10)
    assert due[-1] == ("put back", 11)
