"""The heap keeper: freeze after a slow full collection, collect what it held once load is down to a quarter."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest

from proxy.http.heap import (
    FULL_PASS_AFTER,
    YOUNG_PASS_AFTER,
    HeapKeeper,
    PauseHook,
    settle_heap,
)
from proxy.limiter import FakeClock


class FakeCollector:
    """Records what the keeper asks of the collector; ``full_pass`` plays a generation-2 pass."""

    def __init__(self, timer: FakeTimer) -> None:
        self.callbacks: list[Any] = []
        self.calls: list[str] = []
        self._timer = timer
        self.collect_takes = 0.3

    def full_pass(self, takes: float) -> None:
        for callback in list(self.callbacks):
            callback("start", {"generation": 2})
        self._timer.now += takes
        for callback in list(self.callbacks):
            callback("stop", {"generation": 2, "collected": 0})

    def freeze(self) -> None:
        self.calls.append("freeze")

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")

    def collect(self) -> int:
        self.calls.append("collect")
        self.full_pass(self.collect_takes)
        return 7


class FakeTimer:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keeper() -> tuple[HeapKeeper, FakeCollector, FakeClock, list[int]]:
    timer = FakeTimer()
    collector = FakeCollector(timer)
    clock = FakeClock()
    load = [0]
    instance = HeapKeeper(lambda: load[0], clock, collector=collector, pauses=PauseHook(collector, timer),
                          timer=timer)
    instance.start()
    return instance, collector, clock, load


def test_a_slow_full_pass_freezes_the_heap_at_the_next_check(keeper, caplog) -> None:
    _, collector, clock, load = keeper
    load[0] = 9000
    collector.full_pass(0.4)
    assert collector.calls == [], "nothing is done inside the collector"
    with caplog.at_level(logging.INFO, logger="slotproxy"):
        clock.advance(1.0)
    assert collector.calls == ["freeze"]
    assert "took 400 ms with 9000 request(s) held; heap frozen" in caplog.text


def test_fast_passes_and_young_generations_change_nothing(keeper) -> None:
    _, collector, clock, load = keeper
    load[0] = 9000
    collector.full_pass(0.01)
    for callback in collector.callbacks:
        callback("start", {"generation": 0})
        callback("stop", {"generation": 0, "collected": 0})
    clock.advance(5.0)
    assert collector.calls == []


def test_what_a_freeze_held_is_collected_once_the_load_is_down_to_a_quarter(keeper, caplog) -> None:
    _, collector, clock, load = keeper
    load[0] = 10000
    collector.full_pass(0.4)
    clock.advance(1.0)
    load[0] = 2501
    clock.advance(3.0)
    assert collector.calls == ["freeze"], "still more than a quarter of the load that led to the freeze"
    load[0] = 2500
    with caplog.at_level(logging.INFO, logger="slotproxy"):
        clock.advance(1.0)
    assert collector.calls == ["freeze", "unfreeze", "collect", "freeze"]
    assert "load fell from 10000 to 2500 request(s): heap collected once (7 freed, 300 ms)" in caplog.text
    clock.advance(10.0)
    assert collector.calls == ["freeze", "unfreeze", "collect", "freeze"], \
        "its own slow collection is not taken for a reason to freeze again"


def test_the_load_remembered_is_the_highest_of_several_freezes(keeper) -> None:
    _, collector, clock, load = keeper
    load[0] = 4000
    collector.full_pass(0.2)
    clock.advance(1.0)
    load[0] = 12000
    collector.full_pass(0.2)
    clock.advance(1.0)
    load[0] = 3001
    clock.advance(1.0)
    assert collector.calls == ["freeze", "freeze"], "3001 is more than a quarter of 12000"
    load[0] = 3000
    clock.advance(1.0)
    assert collector.calls[-3:] == ["unfreeze", "collect", "freeze"]


def test_a_slow_pass_with_nothing_held_is_collected_when_idle_only_once(keeper) -> None:
    _, collector, clock, _ = keeper
    collector.full_pass(0.2)
    clock.advance(1.0)
    clock.advance(1.0)
    clock.advance(1.0)
    assert collector.calls == ["freeze", "unfreeze", "collect", "freeze"]


def test_stop_detaches_from_the_collector_and_the_clock(keeper) -> None:
    instance, collector, clock, _ = keeper
    instance.stop()
    assert collector.callbacks == []
    assert clock.pending == 0


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_with_the_real_collector_a_frozen_cycle_is_freed_once_load_falls() -> None:
    """Frozen reference cycles are not lost: the collection after the load halves frees them."""
    clock = FakeClock()
    load = [100]
    keeper = HeapKeeper(lambda: load[0], clock, slow_pass=0.0)
    keeper.start()
    try:
        cycle = Cycle()
        gone = weakref.ref(cycle)
        gc.collect()
        clock.advance(1.0)
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert gone() is not None, "a frozen cycle waits"
        load[0] = 25
        clock.advance(1.0)
        assert gone() is None
    finally:
        keeper.stop()
        gc.unfreeze()


def test_start_up_freezes_what_it_allocated_and_spaces_young_and_full_passes() -> None:
    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_PASS_AFTER, before[1], FULL_PASS_AFTER)
        assert YOUNG_PASS_AFTER > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
