"""The pure limiter core: no aiohttp, no I/O; time and timers come from an injected Clock."""

from .clock import Clock, FakeClock, LoopClock, Timer
from .provider import (
    AdmissionGate,
    Lease,
    LimiterSettings,
    ProviderLimiter,
    ProviderStatus,
    SlotLease,
    WaiterStatus,
    auto_reduce_notice,
    validate_limit,
)
from .queue import Priority, Waiter, WaiterQueue

__all__ = [
    "AdmissionGate",
    "Clock",
    "FakeClock",
    "Lease",
    "LimiterSettings",
    "LoopClock",
    "Priority",
    "ProviderLimiter",
    "ProviderStatus",
    "SlotLease",
    "Timer",
    "Waiter",
    "WaiterQueue",
    "WaiterStatus",
    "auto_reduce_notice",
    "validate_limit",
]
