"""The watchdog on fake time: one timer for every held slot, left to run out when idle, a changed timeout applies at once."""

from __future__ import annotations

from proxy.limiter import FakeClock
from proxy.limiter.watchdog import SlotWatchdog


def test_each_slot_is_taken_back_at_its_own_time_with_one_timer() -> None:
    clock = FakeClock()
    due: list[str] = []
    watchdog: SlotWatchdog[str] = SlotWatchdog(clock, due.append, timeout=10.0)
    watchdog.hold("a")
    clock.advance(4.0)
    watchdog.hold("b")
    watchdog.hold("returned")
    watchdog.drop("returned")
    assert clock.pending == 1
    clock.advance(6.0)
    assert due == ["a"]
    clock.advance(3.9)
    assert due == ["a"]
    clock.advance(0.1)
    assert due == ["a", "b"]
    assert len(watchdog) == 0 and clock.pending == 0, "an idle watchdog keeps no timer"


def test_a_slot_taken_after_the_last_was_returned_sets_no_timer_of_its_own() -> None:
    clock = FakeClock()
    due: list[str] = []
    watchdog: SlotWatchdog[str] = SlotWatchdog(clock, due.append, timeout=10.0)
    watchdog.hold("returned")
    watchdog.drop("returned")
    clock.advance(4.0)
    watchdog.hold("next")
    assert clock.timers_set == 1
    clock.advance(6.0)
    assert due == [] and clock.pending == 1
    clock.advance(4.0)
    assert due == ["next"] and clock.pending == 0


def test_a_changed_timeout_counts_from_when_each_slot_was_taken() -> None:
    clock = FakeClock()
    due: list[str] = []
    watchdog: SlotWatchdog[str] = SlotWatchdog(clock, due.append, timeout=None)
    watchdog.hold("old")
    assert clock.pending == 0
    clock.advance(5.0)
    watchdog.hold("new")
    watchdog.set_timeout(3.0)
    clock.advance(0.0)
    assert due == ["old"]
    clock.advance(3.0)
    assert due == ["old", "new"]


def test_a_slot_taken_while_sweeping_waits_its_own_full_time() -> None:
    clock = FakeClock()
    due: list[str] = []
    watchdog: SlotWatchdog[str] = SlotWatchdog(clock, lambda slot: (due.append(slot), watchdog.hold("next")),
                                               timeout=2.0)
    watchdog.hold("first")
    clock.advance(2.0)
    assert due == ["first"] and list(watchdog) == ["next"]
    clock.advance(1.9)
    assert due == ["first"]
    clock.advance(0.1)
    assert due[:2] == ["first", "next"]
