"""What a provider's limiter is given and gives out: its settings (the provider's limit and the levels of
its keys and model caps), an extra admission gate, and the lease a request holds its slot by."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from .clock import Clock
from .level import LimitLevel
from .queue import Priority
from .window import WindowSettings

__all__ = ["AdmissionGate", "KeySettings", "Lease", "LimiterSettings", "ModelCap", "SlotLease"]


@dataclass(frozen=True, slots=True)
class KeySettings:
    """One key of a provider's pool. ``available`` is False when its variable is unset: it is never chosen."""

    name: str
    limit: int | None = None
    available: bool = True


@dataclass(frozen=True, slots=True)
class ModelCap:
    pattern: str
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    limit: int | None = None
    release_cooldown: float = 0.0
    default_pause: float = 30.0
    overload_pause: float = 5.0
    slot_timeout: float | None = 900.0
    queue_timeout: float | None = 600.0
    max_queue: int = 10_000
    recovery_after: float | None = None
    keys: tuple[KeySettings, ...] = ()
    models: tuple[ModelCap, ...] = ()
    max_share: float | None = None
    budgets: bool = False
    windows: WindowSettings | None = None
    """The token windows held for the provider (None: none, and admission is as without them)."""

    def pool(self) -> tuple[KeySettings, ...]:
        """The keys that may be chosen; none available means no pool (the provider is its one key)."""
        return tuple(key for key in self.keys if key.available)

    def classed(self) -> bool:
        """Whether waiters are kept apart by model cap and workspace (else one heap does)."""
        return bool(self.models) or self.max_share is not None

    def level_settings(self, limit: int | None) -> LimiterSettings:
        """The settings of a key or model level: its own limit; pause and recovery as the provider's;
        no release cooldown (that is the provider's alone)."""
        return replace(self, limit=limit, release_cooldown=0.0, keys=(), models=(), windows=None)


class AdmissionGate(Protocol):
    """An extra admission condition beyond the limit (the usage gate)."""

    def admits(self) -> bool:
        """May one more request be admitted now?"""

    def admitted(self) -> None:
        """One request was just admitted."""

    def request_poll(self) -> None:
        """Something changed (a release, a new waiter): look at upstream again."""

    def status(self) -> dict[str, object]: ...


class SlotLease(Protocol):
    """What the relay needs of a held slot, whichever backend granted it."""

    priority: Priority
    seq: int
    granted_at: float
    queue_wait: float
    reclaimed: bool
    lease_lost: bool
    """Reclaimed because its lease could not be kept in a shared backend (not for slot_timeout)."""
    on_reclaim: Callable[[], None] | None
    key: str | None
    """The pool key this slot was taken on (None without a pool): the relay sends it upstream."""
    cost: Mapping[str, float] | None
    """What it took from its windows when sent (None: no window applied)."""
    group: str | None
    """The model group of the windows it took from."""

    def release(self) -> None: ...

    def headers_received(self) -> None: ...


class _Granter(Protocol):
    """What a lease needs of the limiter that granted it."""

    _clock: Clock

    def _release(self, lease: Lease) -> None: ...


class Lease:
    """A held slot. ``release()`` may be called any number of times; only the first counts."""

    __slots__ = (
        "_levels",
        "_limiter",
        "cost",
        "granted_at",
        "group",
        "headers_at",
        "holder",
        "key",
        "lease_lost",
        "model",
        "on_reclaim",
        "priority",
        "queue_wait",
        "reclaimed",
        "released",
        "seq",
        "starred",
        "windows_settled",
    )

    def __init__(
        self, limiter: _Granter, priority: Priority, seq: int, granted_at: float, queue_wait: float
    ) -> None:
        self._limiter = limiter
        self.priority = priority
        self.seq = seq
        self.granted_at = granted_at
        self.queue_wait = queue_wait
        self.on_reclaim: Callable[[], None] | None = None
        self.headers_at: float | None = None
        self.released = False
        self.reclaimed = False
        self.lease_lost = False
        self.key: str | None = None
        self.model: str | None = None
        self.starred = priority.starred
        self.cost: Mapping[str, float] | None = None
        self.group: str | None = None
        self.windows_settled = False
        self.holder: str | None = None
        """What held it in the queue (None: it did not wait)."""
        self._levels: tuple[LimitLevel, ...] = ()
        """The key and model levels it holds a slot at, beside the provider's (a reload may drop them
        from the config; the slot is still given back to them)."""

    def release(self) -> None:
        self._limiter._release(self)

    def headers_received(self) -> None:
        """Upstream answered with headers: from now on its usage count includes this request."""
        self.headers_at = self._limiter._clock.time()
