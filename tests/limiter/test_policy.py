"""The policy's rules, one call each: the same functions both backends apply (Lua gets their answers)."""

from __future__ import annotations

import pytest

from proxy.limiter import policy


@pytest.mark.parametrize("value", [None, 1, 7, policy.MAX_LIMIT])
def test_valid_limits(value: int | None) -> None:
    assert policy.validate_limit(value) == value


@pytest.mark.parametrize("value", [0, -1, policy.MAX_LIMIT + 1, 1.5, 2.0, True, "3", [3]])
def test_invalid_limits_state_the_rule(value: object) -> None:
    with pytest.raises(ValueError, match=r"limit must be a positive integer or null \(at most 100000\), got"):
        policy.validate_limit(value)


def test_notices_are_literal() -> None:
    assert policy.auto_reduce_notice(3, "429") == (
        "Concurrency limit auto-reduced to 3 after a 429 — restore manually when ready.")
    assert policy.recovering_notice(3, 4, 600.0) == (
        "Concurrency limit auto-reduced, recovering: now 3 of 4 after 600s without a backoff.")
    assert policy.recovering_notice("{N}", "{TARGET}", 0.4) == (
        "Concurrency limit auto-reduced, recovering: now {N} of {TARGET} after 0.4s without a backoff.")


@pytest.mark.parametrize(("now", "paused_until", "sent_at", "last_reduction", "same"), [
    (10.0, None, None, -1.0, False),    # nothing known: a new burst
    (10.0, 12.0, 9.0, -1.0, True),      # still paused
    (10.0, 9.0, 9.0, 8.0, False),       # pause over, granted after the reduction
    (10.0, None, 7.5, 8.0, True),       # granted before the reduction: the same burst
    (10.0, None, 8.0, 8.0, True),       # granted in the same instant
])
def test_same_burst(now: float, paused_until: float | None, sent_at: float | None, last_reduction: float,
                    same: bool) -> None:
    assert policy.same_burst(now, paused_until, sent_at, last_reduction) is same


def test_reduction_and_recovery_steps() -> None:
    assert policy.reduced_limit(3) == 2
    assert policy.reduced_limit(1) is None
    assert policy.reduced_limit(None) is None
    assert policy.recovery_step(2, 4) == (3, False)
    assert policy.recovery_step(3, 4) == (4, True)
    assert policy.recovery_step(4, 4) == (4, True)


def test_pause_length_and_retry_after() -> None:
    assert policy.pause_length(None, 30.0) == 30.0
    assert policy.pause_length(2.5, 30.0) == 2.5
    assert policy.pause_length(-1.0, 30.0) == 0.0
    assert policy.retry_after_hint(100.0, None) == 1.0
    assert policy.retry_after_hint(100.0, 104.5) == 4.5
    assert policy.retry_after_hint(100.0, 100.2) == 1.0
    assert policy.retry_after_hint(100.0, 99.0) == 1.0


def test_queue_key_orders_starred_then_whole_ms_then_arrival() -> None:
    t = 1_800_000_000.0
    keys = {
        "starred-young": policy.queue_key(True, t, 9),
        "old": policy.queue_key(False, t - 60, 5),
        "young-first": policy.queue_key(False, t + 0.0004, 1),
        "young-second-older-by-us": policy.queue_key(False, t + 0.0001, 2),
    }
    assert sorted(keys, key=keys.__getitem__) == ["starred-young", "old", "young-first", "young-second-older-by-us"]
    assert policy.prompt_ms(t + 0.0009) == 1_800_000_000_000
