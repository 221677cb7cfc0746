"""The concurrency gate's poller: a provider's usage endpoint (the config's ``usage:`` block), which states
how many requests the provider itself counts in flight, polled for the gate (``limiter.gate``: the
decisions; this is its I/O half). Not token usage: that is read from the answers (``tokens``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from ..aio import cancel_and_wait
from ..config.model import ProviderSettings, Usage
from ..limiter import Clock, ProviderLimiter
from ..limiter.gate import UsageGate

__all__ = ["GatePoller", "GatePollers", "read_field"]

log = logging.getLogger("slotproxy.usage")


class GatePollError(Exception):
    """A usage poll that answered, but not with a usable count."""


def read_field(document: Any, dotted: str) -> float:
    """The number at a dotted path (``data.active_sessions``; list items by index)."""
    value = document
    for part in dotted.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise GatePollError(f"field '{dotted}' not found (stopped at '{part}')")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise GatePollError(f"field '{dotted}' is {value!r}, not a non-negative number")
    return float(value)


class GatePoller:
    """One provider's poll loop: on demand (release, admission, new waiter) and every interval while waiters wait.

    Polls never overlap: a request for a poll while one is running is kept in an
    Event and causes exactly one more poll after it.
    """

    def __init__(self, name: str, usage: Usage, limiter: ProviderLimiter, session: aiohttp.ClientSession,
                 clock: Clock) -> None:
        self.usage = usage
        self._limiter = limiter
        self._session = session
        self._clock = clock
        self._wanted = asyncio.Event()
        self._timeout = aiohttp.ClientTimeout(total=usage.interval)
        self.gate = UsageGate(
            name, clock,
            limit=lambda: limiter.limit,
            unseen_since=limiter.unseen_since,
            request_poll=self._wanted.set,
            permit_ttl=usage.interval,
        )
        limiter.gate = self.gate
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._limiter.gate is self.gate:
            self._limiter.gate = None
        await cancel_and_wait(self._task)

    def _next_poll_in(self) -> float | None:
        """Nobody waits: only on demand. Waiters and the last poll said full: busy_interval. Else interval."""
        if not self._limiter.queued:
            return None
        if self.gate.failing or self.gate.admits():
            return self.usage.interval
        return min(self.usage.busy_interval, self.usage.interval)

    async def _run(self) -> None:
        while True:
            interval = self._next_poll_in()
            try:
                await asyncio.wait_for(self._wanted.wait(), interval)
            except TimeoutError:
                pass
            self._wanted.clear()
            await self.poll_once()
            self._limiter.dispatch()

    async def poll_once(self) -> None:
        sent_at = self._clock.time()
        try:
            async with self._session.get(self.usage.url, headers=dict(self.usage.headers),
                                         timeout=self._timeout, allow_redirects=False) as response:
                if response.status != 200:
                    raise GatePollError(f"HTTP {response.status}")
                document = await response.json(content_type=None)
            count = read_field(document, self.usage.field)
        except (aiohttp.ClientError, TimeoutError, ValueError, GatePollError) as exc:
            self.gate.poll_failed(_describe(exc))
            return
        self.gate.poll_succeeded(count, sent_at)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, GatePollError):
        return str(exc)
    if isinstance(exc, ValueError):
        return "invalid JSON"
    return type(exc).__name__


class GateHost(Protocol):
    """What the pollers need of the backend: the limiter a gate can attach to, and its clock."""

    clock: Clock

    def usage_limiter(self, provider: str) -> ProviderLimiter | None: ...


class GatePollers:
    """One poller per provider with a ``usage:`` block, on backends that can host its gate;
    a changed block restarts that provider's poller."""

    def __init__(self) -> None:
        self._pollers: dict[str, GatePoller] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def sync(self, providers: Mapping[str, ProviderSettings], backend: GateHost,
             session_for: Callable[[ProviderSettings], aiohttp.ClientSession]) -> None:
        for name, poller in list(self._pollers.items()):
            settings = providers.get(name)
            if settings is None or settings.usage != poller.usage:
                del self._pollers[name]
                task = asyncio.get_running_loop().create_task(poller.stop())
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
        for name, settings in providers.items():
            if settings.usage is None or name in self._pollers:
                continue
            limiter = backend.usage_limiter(name)
            if limiter is None:
                continue
            poller = GatePoller(name, settings.usage, limiter, session_for(settings), backend.clock)
            poller.start()
            self._pollers[name] = poller

    async def close(self) -> None:
        for poller in self._pollers.values():
            await poller.stop()
        self._pollers.clear()
