"""The usage gate on fake time: one admission per poll, never past the limit, failure → cooldown-only."""

from __future__ import annotations

from proxy.limiter import FakeClock, Lease, LimiterSettings, Priority, ProviderLimiter
from proxy.limiter.gate import UsageGate

T0 = 1_700_000_000.0


def gated(limit: int = 3, cooldown: float = 0.0) -> tuple[ProviderLimiter, UsageGate, FakeClock, list[int]]:
    clock = FakeClock(T0)
    limiter = ProviderLimiter("p", LimiterSettings(limit=limit, release_cooldown=cooldown), clock)
    polls: list[int] = []
    gate = UsageGate("p", clock, limit=lambda: limiter.limit, unseen_since=limiter.unseen_since,
                     request_poll=lambda: polls.append(1), permit_ttl=1.0)
    limiter.gate = gate
    return limiter, gate, clock, polls


def prio() -> Priority:
    return Priority(prompt_started_at=T0)


def test_nothing_is_admitted_before_the_first_poll_answers() -> None:
    limiter, gate, _, polls = gated()
    assert limiter.try_acquire(prio()) is None
    granted: list[Lease] = []
    limiter.enqueue(prio(), granted.append)
    assert granted == [] and polls
    gate.poll_succeeded(0, T0)
    limiter.dispatch()
    assert len(granted) == 1


def test_a_burst_during_a_poll_never_takes_the_fast_path_past_the_limit() -> None:
    limiter, gate, clock, polls = gated(limit=3)
    gate.poll_succeeded(0, T0)
    first = limiter.try_acquire(prio())
    assert first is not None
    # A poll is now in flight (admission asked for one). A burst arrives meanwhile.
    sent_at = clock.time()
    granted: list[Lease] = []
    for _ in range(20):
        assert limiter.try_acquire(prio()) is None
        limiter.enqueue(prio(), granted.append)
    assert granted == [] and limiter.in_flight == 1
    clock.advance(0.01)
    # Upstream has not seen the first request yet (no headers): unseen = 1.
    gate.poll_succeeded(0, sent_at)
    limiter.dispatch()
    assert len(granted) == 1 and limiter.in_flight == 2
    first.headers_received()
    for lease in granted:
        lease.headers_received()
    clock.advance(0.01)
    gate.poll_succeeded(2, clock.time())
    limiter.dispatch()
    assert limiter.in_flight == 3
    clock.advance(0.01)
    gate.poll_succeeded(2, clock.time() - 0.005)
    limiter.dispatch()
    assert limiter.in_flight == 3, "the limit holds even with a permit-worthy upstream count"
    assert len(polls) > 3


def test_a_lagging_upstream_count_holds_admissions_back() -> None:
    limiter, gate, clock, _ = gated(limit=2)
    gate.poll_succeeded(0, T0)
    lease = limiter.try_acquire(prio())
    assert lease is not None
    lease.headers_received()
    lease.release()
    granted: list[Lease] = []
    limiter.enqueue(prio(), granted.append)
    clock.advance(0.01)
    # The stream ended, but upstream still counts 2 (its own lag): no admission.
    gate.poll_succeeded(2, clock.time())
    limiter.dispatch()
    assert granted == []
    clock.advance(0.01)
    gate.poll_succeeded(1, clock.time())
    limiter.dispatch()
    assert len(granted) == 1


def test_a_permit_goes_stale_after_its_ttl() -> None:
    limiter, gate, clock, _ = gated()
    gate.poll_succeeded(0, T0)
    clock.advance(1.5)
    assert limiter.try_acquire(prio()) is None


def test_failing_polls_fall_back_to_cooldown_only_and_recover() -> None:
    limiter, gate, clock, _ = gated(limit=2, cooldown=0.5)
    gate.poll_failed("HTTP 500")
    assert gate.status()["state"] == "failing"
    first = limiter.try_acquire(prio())
    second = limiter.try_acquire(prio())
    assert first is not None and second is not None
    assert limiter.try_acquire(prio()) is None
    granted: list[Lease] = []
    limiter.enqueue(prio(), granted.append)
    first.release()
    assert granted == []
    clock.advance(0.5)
    assert len(granted) == 1
    gate.poll_succeeded(2, clock.time())
    assert gate.status()["state"] == "ok"
    assert not gate.admits()
