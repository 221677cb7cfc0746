"""What a replica writes for the scripts and reads back from them, beside the plain numbers: a provider's
layout and windows for CONFIGURE, a waiter's window cost for ENQUEUE and WINDOW_RECOST, the parts of a grant,
and the Retry-After hint a script's answer carries."""

from __future__ import annotations

import json
from typing import Any

from ...limiter import LimiterSettings, policy
from .client import text
from .status import limit_arg

__all__ = ["cost_args", "hint_from", "layout_arg", "windows_arg"]


def hint_from(answer: Any) -> float:
    """Retry-After from a script's "paused_until now" (ms), by the policy's rule."""
    paused_until, now = (int(part) for part in text(answer).split(" "))
    return policy.retry_after_hint(now / 1000, paused_until / 1000 if paused_until else None)


def layout_arg(settings: LimiterSettings) -> str:
    """The provider's keys, model caps and share, as CONFIGURE stores them for the scripts."""
    layout: dict[str, Any] = {
        "keys": [{"n": key.name, "l": limit_arg(key.limit), "a": 1 if key.available else 0} for key in settings.keys],
        "models": [{"p": cap.pattern, "l": limit_arg(cap.limit)} for cap in settings.models],
    }
    if settings.max_share is not None:
        layout["share"] = settings.max_share
    return json.dumps(layout)


def windows_arg(settings: LimiterSettings) -> str:
    """The provider's window settings as CONFIGURE stores them for the scripts ('' : no window is held)."""
    windows = settings.windows
    if windows is None:
        return ""
    return json.dumps({"p": dict(windows.provider), "m": {p: dict(m) for p, m in windows.models.items()},
                       "k": {k: dict(m) for k, m in windows.keys.items()}, "learn": windows.learn,
                       "h": windows.headroom}, sort_keys=True)


def cost_args(costs: list[dict[str, float]] | None, group: str | None) -> tuple[str, str, str]:
    """A waiter's window cost as ENQUEUE takes it: its latest cost (JSON, '' without one), its model group,
    and that cost's version (its index in ``costs``: '' for the first, which most waiters keep)."""
    if not costs:
        return "", group or "", ""
    return json.dumps(costs[-1]), group or "", str(len(costs) - 1) if len(costs) > 1 else ""
