"""What held a queued request, as its queue span names it, on fake time: the provider's limit or pause, a model
cap, a key, a token window."""

from __future__ import annotations

from typing import Any

from proxy.limiter import (
    FakeClock,
    KeySettings,
    Lease,
    LimiterSettings,
    ModelCap,
    Priority,
    ProviderLimiter,
    WindowSettings,
)

T0 = 1_700_000_000.0
PRIO = Priority(prompt_started_at=T0)


def make(**settings: Any) -> ProviderLimiter:
    return ProviderLimiter("p", LimiterSettings(**{"queue_timeout": None, "slot_timeout": None, **settings}),
                           FakeClock(T0))


def queue_then_grant(limiter: ProviderLimiter, holding: Lease, **request: Any) -> Lease:
    granted: list[Lease] = []
    waiter = limiter.enqueue(PRIO, granted.append, **request)
    assert waiter.queued and not granted
    holding.release()
    assert granted, "granted once the holder let go"
    return granted[0]


def held(limiter: ProviderLimiter, **request: Any) -> Lease:
    lease = limiter.try_acquire(PRIO, **request)
    assert lease is not None
    return lease


def test_a_lease_that_went_straight_through_names_no_holder() -> None:
    assert held(make(limit=1)).holder is None


def test_the_provider_limit_a_model_cap_and_a_key_each_name_themselves() -> None:
    limiter = make(limit=1)
    assert queue_then_grant(limiter, held(limiter)).holder == "provider limit"
    capped = make(limit=5, models=(ModelCap("opus-*", 1),))
    first = held(capped, model="opus-4")
    assert queue_then_grant(capped, first, model="opus-4").holder == "model opus-*"
    pooled = make(limit=5, keys=(KeySettings("a", 1), KeySettings("b", 1)))
    on_a = held(pooled, key="a")
    held(pooled, key="b")
    assert queue_then_grant(pooled, on_a).holder == "keys"


def test_a_token_window_names_its_window() -> None:
    limiter = make(limit=5, windows=WindowSettings(provider={"input_tokens_per_minute": 600}))
    clock = limiter._clock
    assert isinstance(clock, FakeClock)
    cost = {"input_tokens_per_minute": 600.0}
    held(limiter, cost=cost, group="opus").release()
    granted: list[Lease] = []
    limiter.enqueue(PRIO, granted.append, cost=cost, group="opus")
    assert not granted
    clock.advance(61)
    assert granted and granted[0].holder == "window input_tokens_per_minute"
