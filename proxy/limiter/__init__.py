"""The pure limiter core: no aiohttp, no I/O; time and timers come from an injected Clock."""

from .clock import Clock, FakeClock, LoopClock, Timer
from .lease import (
    AdmissionGate,
    KeySettings,
    Lease,
    LimiterSettings,
    ModelCap,
    SlotLease,
)
from .level import Budget
from .policy import (
    MAX_LIMIT,
    QUEUE_LISTED,
    LimitKey,
    auto_reduce_notice,
    recovering_notice,
    validate_limit,
)
from .provider import ProviderLimiter
from .queue import Priority, Recost, Waiter, WaiterQueue
from .status import HolderStatus, KeyStatus, ModelStatus, ProviderStatus, WaiterStatus
from .window import WINDOW_NAMES, Bucket, WindowBook, WindowSettings
from .windowed import ProviderWindows

__all__ = [
    "MAX_LIMIT",
    "QUEUE_LISTED",
    "WINDOW_NAMES",
    "AdmissionGate",
    "Bucket",
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
    "ProviderWindows",
    "Recost",
    "SlotLease",
    "Timer",
    "Waiter",
    "WaiterQueue",
    "WaiterStatus",
    "WindowBook",
    "WindowSettings",
    "auto_reduce_notice",
    "recovering_notice",
    "validate_limit",
]
