"""The last hour of every provider and pool key, for the dashboard's charts.

A sampler started with the app reads the backend's statistics every
``SAMPLE_INTERVAL`` seconds (5) and keeps the last ``SAMPLES`` (720) samples of
each series: one hour, which the dashboard shows as 5 minutes, 15 minutes or the
whole hour (a 30-second storm is 6 samples, clearly visible at 5 minutes).
Series are keyed by the provider and key names the status shows, which come
from the config only, and a series whose provider or key has left the config is
dropped: memory stays flat whatever the traffic. A full series is about 65 KB
in memory and 19 KB in the JSON answer (a provider with four pool keys: five
series, ~320 KB and ~95 KB), whatever the traffic; it is read by whoever has the
dashboard open, once per sample.

``GET /_slotproxy/history`` answers (samples oldest first)::

    {"interval_ms": 5000, "window_ms": 3600000,
     "providers": [{"provider": "openai",
                    "samples": [[t_ms, in_flight, queued, limit, flags], ...],
                    "keys": [{"name": "team-a", "samples": [[t_ms, in_flight, limit, flags], ...]}]}]}

``t_ms`` is epoch milliseconds, ``limit`` null when there is none, and
``flags`` a bitmask:

- ``PAUSED`` (1): taking no new request after a backoff;
- ``REDUCED`` (2): its limit was auto-reduced since the previous sample (a
  provider's counts the reductions of its keys and model caps too);
- ``HELD`` (4): a budget hold (the provider announced the request window is
  spent). A provider is held by its own budget, or when every key of its pool is
  held or paused and one is held. A hold is not a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from ..backends import Backend
from ..limiter import KeyStatus, ProviderStatus
from ..logs import ThrottledLog

__all__ = ["HELD", "PAUSED", "REDUCED", "SAMPLES", "SAMPLE_INTERVAL", "History", "HistorySampler"]

log = logging.getLogger("slotproxy.admin")

SAMPLE_INTERVAL = 5.0
"""Seconds between samples; the app reads it when it is built (tests set it shorter)."""
SAMPLES = 720
"""Samples kept per series: one hour at the default interval."""

PAUSED = 1
REDUCED = 2
HELD = 4

ProviderSample = tuple[int, int, int, int | None, int]
KeySample = tuple[int, int, int | None, int]


def _held(budget: dict[str, int | None] | None) -> bool:
    return budget is not None and budget.get("held_until") is not None


def _key_flags(key: KeyStatus, previous: KeyStatus | None) -> int:
    flags = (PAUSED if key.paused_until is not None else 0) | (HELD if _held(key.budget) else 0)
    if previous is not None and key.auto_reduced_from is not None and (
            previous.auto_reduced_from is None or _lower(key.limit, previous.limit)):
        flags |= REDUCED
    return flags


def _lower(limit: int | None, before: int | None) -> bool:
    return limit is not None and (before is None or limit < before)


def _pool_block(status: ProviderStatus) -> int | None:
    """PAUSED and HELD as the pool's keys give them, when the provider's pause is only its keys' (each of
    its available keys paused or held, and the pause ends with the first of them); None otherwise."""
    ends: list[int] = []
    flags = 0
    for key in status.keys:
        if not key.available:
            continue
        held_until = key.budget.get("held_until") if key.budget is not None else None
        if key.paused_until is None and held_until is None:
            return None
        ends.append(max(t for t in (key.paused_until, held_until) if t is not None))
        flags |= (PAUSED if key.paused_until is not None else 0) | (HELD if held_until is not None else 0)
    if not ends or status.paused_until != min(ends):
        return None
    return flags


def _provider_flags(status: ProviderStatus, previous: ProviderStatus | None) -> int:
    flags = HELD if _held(status.budget) else 0
    if status.paused:
        from_keys = _pool_block(status)
        flags |= PAUSED if from_keys is None else from_keys
    if previous is not None and (
            status.counters.get("auto_reductions", 0) > previous.counters.get("auto_reductions", 0)
            or (status.auto_reduced_from is not None and _lower(status.limit, previous.limit))):
        flags |= REDUCED
    return flags


class _KeySeries:
    __slots__ = ("last", "samples")

    def __init__(self, size: int) -> None:
        self.samples: deque[KeySample] = deque(maxlen=size)
        self.last: KeyStatus | None = None

    def add(self, t_ms: int, key: KeyStatus) -> None:
        self.samples.append((t_ms, key.in_flight, key.limit, _key_flags(key, self.last)))
        self.last = key


class _ProviderSeries:
    __slots__ = ("keys", "last", "samples", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.samples: deque[ProviderSample] = deque(maxlen=size)
        self.last: ProviderStatus | None = None
        self.keys: dict[str, _KeySeries] = {}

    def add(self, t_ms: int, status: ProviderStatus) -> None:
        """One sample of the provider and of each of its keys; a key the status no longer lists is dropped."""
        self.samples.append((t_ms, status.in_flight, status.queued, status.limit,
                             _provider_flags(status, self.last)))
        self.last = status
        keys = {}
        for key in status.keys:
            series = self.keys.get(key.name) or _KeySeries(self.size)
            series.add(t_ms, key)
            keys[key.name] = series
        self.keys = keys


class History:
    """The sampled series, bounded; pure (``clock`` gives epoch seconds)."""

    def __init__(self, interval: float = SAMPLE_INTERVAL, *, samples: int = SAMPLES,
                 clock: Callable[[], float] = time.time) -> None:
        self.interval = interval
        self._size = samples
        self._clock = clock
        self._providers: dict[str, _ProviderSeries] = {}

    def record(self, statuses: Iterable[ProviderStatus]) -> None:
        """One sample of every provider in ``statuses``; the series of any other provider are dropped."""
        t_ms = round(self._clock() * 1000)
        providers = {}
        for status in statuses:
            series = self._providers.get(status.provider) or _ProviderSeries(self._size)
            series.add(t_ms, status)
            providers[status.provider] = series
        self._providers = providers

    def to_dict(self) -> dict[str, Any]:
        interval_ms = round(self.interval * 1000)
        return {
            "interval_ms": interval_ms,
            "window_ms": interval_ms * self._size,
            "providers": [
                {"provider": name, "samples": list(series.samples),
                 "keys": [{"name": key, "samples": list(k.samples)} for key, k in series.keys.items()]}
                for name, series in self._providers.items()
            ],
        }


class HistorySampler:
    """Feeds a ``History`` from the backend while the app runs (``running`` is an aiohttp cleanup context)."""

    def __init__(self, backend: Backend, history: History) -> None:
        self.history = history
        self._backend = backend
        self._failures = ThrottledLog(log, logging.WARNING, "history sample failed: %s", interval=60.0)

    async def sample(self) -> None:
        """One sample; ``refresh`` first, so that with Redis it is the cluster's state, not an old snapshot."""
        await self._backend.refresh(queue_detail=False)
        self.history.record(self._backend.statistics(queue_detail=False))

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as exc:  # noqa: BLE001 - one failed sample leaves a gap, it does not end the history
                self._failures.event(exc)
            await asyncio.sleep(self.history.interval)

    async def running(self, _app: object) -> AsyncIterator[None]:
        task = asyncio.create_task(self._run(), name="slotproxy-history")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
