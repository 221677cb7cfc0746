"""One line per event worth knowing: a repeated event is logged at most once an interval, with its count."""

from __future__ import annotations

import logging

import pytest

from proxy.logs import ThrottledLog


def test_a_repeated_event_is_one_line_an_interval_and_a_single_one_carries_no_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttled = ThrottledLog(logging.getLogger("slotproxy.test"), logging.WARNING, "could not write (%s)",
                             interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="slotproxy.test"):
        assert throttled.event("disk full")
        for _ in range(4):
            now[0] += 1
            assert not throttled.event("disk full")
        now[0] += 60
        assert throttled.event("disk full")
    assert [r.getMessage() for r in caplog.records] == [
        "could not write (disk full)",
        "could not write (disk full) (5 since the last report)",
    ]
