"""Refusing one workspace's waiters at once (its spend cap reached), on fake time: the others keep their place."""

from __future__ import annotations

from typing import Any

from proxy.errors import ProxyError, SpendLimitReached
from proxy.limiter import (
    FakeClock,
    Lease,
    LimiterSettings,
    ModelCap,
    Priority,
    ProviderLimiter,
    WindowSettings,
)
from proxy.limiter.queue import ClassedQueue, Waiter

T0 = 1_700_000_000.0
ITPM = "input_tokens_per_minute"
CAPPED = SpendLimitReached("workspace 'web' reached its cap", retry_after=3600.0)


def make(limit: int | None = 1, **settings: Any) -> tuple[ProviderLimiter, FakeClock]:
    clock = FakeClock(T0)
    return ProviderLimiter("p", LimiterSettings(limit=limit, **settings), clock), clock


def prio(workspace: str, age: float = 0.0) -> Priority:
    return Priority(prompt_started_at=T0 - age, workspace=workspace)


class Recorder:
    def __init__(self, limiter: ProviderLimiter) -> None:
        self.limiter = limiter
        self.order: list[str] = []
        self.leases: dict[str, Lease] = {}
        self.refused: list[tuple[str, ProxyError]] = []

    def enqueue(self, name: str, workspace: str, age: float = 0.0, **kwargs: Any) -> Waiter:
        def grant(lease: Lease) -> None:
            self.order.append(name)
            self.leases[name] = lease

        return self.limiter.enqueue(prio(workspace, age), grant, lambda error: self.refused.append((name, error)),
                                    **kwargs)


def test_only_the_capped_workspace_s_waiters_are_refused_at_once_and_the_others_keep_their_order() -> None:
    limiter, clock = make(limit=1, queue_timeout=60.0)
    holder = limiter.try_acquire(prio("docs"))
    assert holder is not None
    rec = Recorder(limiter)
    for name, workspace, age in (("web-1", "web", 50), ("docs-1", "docs", 40), ("web-2", "web", 30),
                                 ("docs-2", "docs", 20)):
        rec.enqueue(name, workspace, age)
    assert limiter.reject_waiters("web", CAPPED) == 2
    assert rec.refused == [("web-1", CAPPED), ("web-2", CAPPED)]
    assert rec.order == [] and limiter.in_flight == 1, "the slot held is not touched"
    status = limiter.statistics()
    assert status.queued == 2 and [w.workspace for w in status.queue] == ["docs", "docs"]
    assert limiter.reject_waiters("web", CAPPED) == 0
    holder.release()
    assert rec.order == ["docs-1"]
    rec.leases["docs-1"].release()
    assert rec.order == ["docs-1", "docs-2"]
    clock.advance(120)
    assert [name for name, _ in rec.refused] == ["web-1", "web-2"], "a refused waiter never times out later"


def test_waiters_in_every_class_are_refused_and_emptied_classes_go() -> None:
    caps = (ModelCap("opus-*", 1), ModelCap("sonnet-*", 1))
    limiter, _ = make(limit=10, models=caps, max_share=0.5)
    rec = Recorder(limiter)
    for model in ("opus-4", "sonnet-4"):
        assert limiter.try_acquire(prio("docs"), model=model) is not None
    rec.enqueue("web-opus", "web", model="opus-4")
    rec.enqueue("web-sonnet", "web", model="sonnet-4")
    rec.enqueue("docs-opus", "docs", model="opus-4")
    assert limiter.reject_waiters("web", CAPPED) == 2
    assert sorted(name for name, _ in rec.refused) == ["web-opus", "web-sonnet"]
    assert limiter.queued == 1 and [w.workspace for w in limiter.statistics().queue] == ["docs"]


def test_a_refused_head_held_by_its_window_lets_the_waiter_behind_it_go_at_once() -> None:
    limiter, _ = make(limit=10, windows=WindowSettings(provider={ITPM: 600}), queue_timeout=None,
                      slot_timeout=None)
    assert limiter.try_acquire(prio("docs"), cost={ITPM: 550}, group="opus") is not None
    rec = Recorder(limiter)
    rec.enqueue("web-big", "web", age=100, cost={ITPM: 300}, group="opus")
    rec.enqueue("docs-small", "docs", cost={ITPM: 10}, group="opus")
    assert rec.order == [], "queue order holds within the group: the small one waits behind the big one"
    limiter.reject_waiters("web", CAPPED)
    assert rec.order == ["docs-small"]


def test_the_classed_queue_takes_one_workspace_out_and_keeps_count() -> None:
    queue = ClassedQueue()
    waiters = [Waiter(prio(workspace, age=10 - seq), seq, T0, None) for seq, workspace in
               enumerate(("web", "docs", "web", "docs", "web"))]
    for waiter in waiters:
        queue.push(waiter, (None, waiter.priority.workspace, None, None))
    taken = queue.take_workspace("web")
    assert [w.seq for w in taken] == [0, 2, 4] and not any(w.queued for w in taken)
    assert queue.count == 2 and [w.seq for w in queue.in_order(10)] == [1, 3]
    assert queue.take_workspace("web") == []
    assert [w.seq for w in queue.take_workspace("docs")] == [1, 3] and queue.count == 0
    assert queue.heads() == []
