"""What is observable about a provider, as status and metrics read it: the queue, the holders, each key
and model cap, the provider itself; and how a limiter's waiters, leases and levels read as these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import policy
from .lease import Lease
from .level import Budget, LimitLevel
from .queue import Waiter

__all__ = [
    "HolderStatus",
    "KeyStatus",
    "ModelStatus",
    "ProviderStatus",
    "WaiterStatus",
    "budget_of",
    "holder_statuses",
    "key_status",
    "ms",
    "waiter_statuses",
]


@dataclass(frozen=True, slots=True)
class WaiterStatus:
    workspace: str
    starred: bool
    prompt_started_at: int
    waited_ms: int
    conversation: str | None
    transport: str = "http"


@dataclass(frozen=True, slots=True)
class HolderStatus:
    """A request holding a slot: who it is, and since when."""

    workspace: str
    starred: bool
    conversation: str | None
    model: str | None
    key: str | None
    transport: str
    granted_at: int
    held_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {"workspace": self.workspace, "starred": self.starred, "conversation": self.conversation,
                "model": self.model, "key": self.key, "transport": self.transport, "granted_at": self.granted_at,
                "held_ms": self.held_ms}


@dataclass(frozen=True, slots=True)
class KeyStatus:
    name: str
    available: bool
    limit: int | None
    configured_limit: int | None
    in_flight: int
    paused_until: int | None
    auto_reduced_from: int | None
    notice: str | None
    budget: dict[str, int | None] | None = None
    windows: tuple[dict[str, Any], ...] | None = None
    """Its token windows, when the provider holds windows (see ``window.WindowBook.status``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "limit": self.limit,
            "configured_limit": self.configured_limit,
            "in_flight": self.in_flight,
            "paused": self.paused_until is not None,
            "paused_until": self.paused_until,
            "auto_reduced": self.auto_reduced_from is not None,
            "auto_reduced_from": self.auto_reduced_from,
            "notice": self.notice,
            **({} if self.budget is None else {"budget": self.budget}),
            **({} if self.windows is None else {"windows": [dict(window) for window in self.windows]}),
        }


@dataclass(frozen=True, slots=True)
class ModelStatus:
    pattern: str
    limit: int | None
    configured_limit: int | None
    in_flight: int

    def to_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "limit": self.limit, "configured_limit": self.configured_limit,
                "in_flight": self.in_flight}


@dataclass(frozen=True, slots=True)
class ProviderStatus:
    """Everything observable about one provider, read from one snapshot."""

    provider: str
    limit: int | None
    configured_limit: int | None
    in_flight: int
    queued: int
    paused: bool
    paused_until: int | None
    cooldown_ms: int
    auto_reduced: bool
    auto_reduced_from: int | None
    notice: str | None
    queue: tuple[WaiterStatus, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    usage: dict[str, object] | None = None
    local_in_flight: int | None = None
    """Slots held by this replica, where slots are shared by several (the Redis backend)."""
    keys: tuple[KeyStatus, ...] = ()
    models: tuple[ModelStatus, ...] = ()
    budget: dict[str, int | None] | None = None
    """With ``budgets`` and no pool, the provider's own budget (it is its one key)."""
    holders: tuple[HolderStatus, ...] = ()
    """The requests holding slots, longest held first (the first ``QUEUE_LISTED``)."""
    windows: tuple[dict[str, Any], ...] | None = None
    """With windows and no pool, the provider's own (it is its one key); a pool's are on its keys."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "limit": self.limit,
            "configured_limit": self.configured_limit,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "paused": self.paused,
            "paused_until": self.paused_until,
            "cooldown_ms": self.cooldown_ms,
            "auto_reduced": self.auto_reduced,
            "auto_reduced_from": self.auto_reduced_from,
            "notice": self.notice,
            "queue": [
                {
                    "workspace": w.workspace,
                    "starred": w.starred,
                    "prompt_started_at": w.prompt_started_at,
                    "waited_ms": w.waited_ms,
                    "conversation": w.conversation,
                    "transport": w.transport,
                }
                for w in self.queue
            ],
            "holders": [holder.to_dict() for holder in self.holders],
            "usage": self.usage,
            "rejected": {
                "queue_full": self.counters.get("queue_full", 0),
                "queue_timeout": self.counters.get("queue_timeouts", 0),
            },
            "keys": [key.to_dict() for key in self.keys],
            "models": [model.to_dict() for model in self.models],
            **({} if self.budget is None else {"budget": self.budget}),
            **({} if self.windows is None else {"windows": [dict(window) for window in self.windows]}),
            **({} if self.local_in_flight is None else {"local_in_flight": self.local_in_flight}),
        }


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def waiter_statuses(waiters: Iterable[Waiter], now: float) -> tuple[WaiterStatus, ...]:
    """The queue listing: each waiter as status shows it."""
    return tuple(
        WaiterStatus(
            workspace=w.priority.workspace,
            starred=w.starred,
            prompt_started_at=policy.prompt_ms(w.priority.prompt_started_at),
            waited_ms=ms(now - w.enqueued_at),
            conversation=w.priority.conversation,
            transport=w.priority.transport,
        )
        for w in waiters
    )


def holder_statuses(leases: Iterable[Lease], now: float) -> tuple[HolderStatus, ...]:
    """The requests holding slots, as status shows them."""
    return tuple(
        HolderStatus(workspace=lease.priority.workspace, starred=lease.starred,
                     conversation=lease.priority.conversation, model=lease.model, key=lease.key,
                     transport=lease.priority.transport, granted_at=ms(lease.granted_at),
                     held_ms=ms(now - lease.granted_at))
        for lease in leases)


def budget_of(level: LimitLevel) -> dict[str, int | None]:
    budget = level.budget or Budget()
    return budget.to_dict(level.held_until)


def key_status(name: str, level: LimitLevel, available: bool, budgets: bool,
               windows: tuple[dict[str, Any], ...] | None = None) -> KeyStatus:
    paused_until = level.paused_until
    return KeyStatus(
        name=name,
        available=available,
        limit=level.limit,
        configured_limit=level.configured_limit,
        in_flight=level.in_flight,
        paused_until=None if paused_until is None else ms(paused_until),
        auto_reduced_from=level.auto_reduced_from,
        notice=level.notice,
        budget=budget_of(level) if budgets else None,
        windows=windows,
    )
