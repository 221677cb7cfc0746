"""Failed admin authentication, per client address: logged sparingly, and blocked when it is guessing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..logs import ReportPacer

__all__ = ["AuthFailures"]


@dataclass(slots=True)
class _Address:
    window_start: float
    pacer: ReportPacer
    failures: int = 0


class AuthFailures:
    """Counts failed admin authentications per address in fixed windows of ``window`` seconds.

    After ``limit`` failures in one window the address is blocked (429 on admin
    writes) until the window ends; a right token does not lift it, or guessing would
    go on. ``failed`` says when a log line is due: at most one per address every
    ``log_interval``, carrying the failures since the last one. At most
    ``max_tracked`` addresses are remembered; the oldest windows go first.
    """

    def __init__(self, clock: Callable[[], float], *, limit: int = 20, window: float = 60.0,
                 log_interval: float = 1.0, max_tracked: int = 10_000) -> None:
        self._clock = clock
        self._limit = limit
        self._window = window
        self._log_interval = log_interval
        self._max_tracked = max_tracked
        self._addresses: dict[str, _Address] = {}

    def _current(self, address: str, now: float) -> _Address | None:
        entry = self._addresses.get(address)
        if entry is not None and now - entry.window_start >= self._window:
            del self._addresses[address]
            return None
        return entry

    def blocked_for(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it is not blocked."""
        now = self._clock()
        entry = self._current(address, now)
        if entry is None or entry.failures < self._limit:
            return None
        return entry.window_start + self._window - now

    def failed(self, address: str) -> int | None:
        """Count one failure; the number of failures to report when a log line is due, else None."""
        now = self._clock()
        entry = self._current(address, now)
        if entry is None:
            if len(self._addresses) >= self._max_tracked:
                del self._addresses[next(iter(self._addresses))]
            entry = self._addresses[address] = _Address(window_start=now, pacer=ReportPacer(self._log_interval))
        entry.failures += 1
        return entry.pacer.count(now)
