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
    (10.0, 10.0, None, -1.0, True),     # a pause ending this instant: nothing was granted since
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


def test_key_choice_sticks_then_takes_the_freest_ties_in_config_order() -> None:
    assert policy.choose_key([("a", 1), ("b", 2)], None) == "b"
    assert policy.choose_key([("a", 2), ("b", 2)], None) == "a"
    assert policy.choose_key([("a", 1), ("b", 2)], "a") == "a"
    assert policy.choose_key([("b", 2)], "a") == "b", "the previous key has no room: the freest takes it"
    assert policy.choose_key([("a", 5), ("b", None)], None) == "b", "no limit is the most room"
    assert policy.choose_key([], "a") is None


def test_share_cap_and_the_pool_pause() -> None:
    assert policy.share_cap(0.5, 4) == 2
    assert policy.share_cap(0.3, 10) == 3
    assert policy.share_cap(0.1, 4) == 1
    assert policy.share_cap(None, 4) is None and policy.share_cap(0.5, None) is None
    assert policy.pool_paused_until(None, [10.0, 12.0]) == 10.0
    assert policy.pool_paused_until(None, [10.0, None]) is None
    assert policy.pool_paused_until(5.0, [None]) == 5.0
    assert policy.pool_paused_until(None, []) is None


def test_model_patterns_match_first_in_config_order() -> None:
    patterns = ["claude-opus-*", "claude-*"]
    assert policy.model_pattern("claude-opus-4", patterns) == "claude-opus-*"
    assert policy.model_pattern("claude-sonnet-4", patterns) == "claude-*"
    assert policy.model_pattern("gpt-5", patterns) is None
    assert policy.model_pattern(None, patterns) is None
    assert policy.model_pattern("Claude-opus-4", patterns) is None, "case-sensitive, like the model ids"


def test_sticky_keys_forget_the_least_recent_conversation() -> None:
    sticky = policy.StickyKeys(size=2)
    sticky.remember("c1", "a")
    sticky.remember("c2", "b")
    assert sticky.get("c1") == "a"
    sticky.remember("c3", "a")
    assert (sticky.get("c1"), sticky.get("c2"), sticky.get("c3")) == ("a", None, "a")
    sticky.remember(None, "a")
    assert sticky.get(None) is None
