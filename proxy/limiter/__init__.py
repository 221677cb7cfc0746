"""The pure limiter core: no aiohttp, no I/O; time and timers come from an injected Clock."""

from .clock import Clock, FakeClock, LoopClock, Timer
from .level import Budget
from .policy import (
    MAX_LIMIT,
    QUEUE_LISTED,
    LimitKey,
    auto_reduce_notice,
    recovering_notice,
    validate_limit,
)
from .provider import (
    AdmissionGate,
    HolderStatus,
    KeySettings,
    KeyStatus,
    Lease,
    LimiterSettings,
    ModelCap,
    ModelStatus,
    ProviderLimiter,
    ProviderStatus,
    SlotLease,
    WaiterStatus,
)
from .queue import Priority, Waiter, WaiterQueue

__all__ = [
    "MAX_LIMIT",
    "QUEUE_LISTED",
    "AdmissionGate",
    "Budget",
    "Clock",
    "FakeClock",
    "HolderStatus",
    "KeySettings",
    "KeyStatus",
    "Lease",
    "LimitKey",
    "LimiterSettings",
    "LoopClock",
    "ModelCap",
    "ModelStatus",
    "Priority",
    "ProviderLimiter",
    "ProviderStatus",
    "SlotLease",
    "Timer",
    "Waiter",
    "WaiterQueue",
    "WaiterStatus",
    "auto_reduce_notice",
    "recovering_notice",
    "validate_limit",
]
