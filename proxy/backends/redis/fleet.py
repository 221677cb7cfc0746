"""The fleet's usage on Redis: this replica's requests summed per provider and hour, added to the fleet's
aggregates every second (``USAGE_ADD``), and read back for ``GET /_slotproxy/usage``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from ...ledger.fleet import FleetUsage, spend_key
from ...ledger.report import UsageQuery
from ...ledger.store import LedgerRow
from ...logs import ThrottledLog
from .client import Wire, in_words, text

__all__ = ["RedisFleetUsage"]

log = logging.getLogger("slotproxy.redis")


class RedisFleetUsage:
    """The fleet's aggregates as one replica adds to them and reads them: its writes join the script
    batch and ``pending`` (what the backend's ``flush()`` waits for)."""

    def __init__(self, link: Wire, pending: set[asyncio.Future[Any]], key_prefix: str, retention: float) -> None:
        self._link = link
        self._pending = pending
        self._sums = FleetUsage(key_prefix, retention)
        self._lost = ThrottledLog(log, logging.WARNING, "the fleet's usage aggregates could not be written to "
                                  "redis (%s); this replica's own ledger still has the rows", interval=60.0)

    def record(self, row: LedgerRow) -> None:
        self._sums.add(row)

    def send(self) -> None:
        """This replica's requests since the last write, added to the fleet's hourly aggregates."""
        for key, args in self._sums.take():
            answer = self._link.batch_for(key).call("USAGE_ADD", keys=[key], args=tuple(args))
            self._pending.add(answer)
            answer.add_done_callback(self._written)

    def _written(self, answer: asyncio.Future[Any]) -> None:
        self._pending.discard(answer)
        error = None if answer.cancelled() else answer.exception()
        if error is not None:
            self._lost.event(in_words(error))

    async def day_spend(self, day_start_ms: int, providers: Iterable[str]) -> dict[str, float]:
        """The fleet's spend per workspace on the UTC day starting at ``day_start_ms`` (sent up to the last
        ``send``)."""
        keys = [spend_key(self._sums.prefix, provider, day_start_ms) for provider in providers]
        pipeline = self._link.redis.pipeline(transaction=False)
        for key in keys:
            pipeline.hgetall(key)
        hashes = await pipeline.execute() if keys else []
        return FleetUsage.day_spend({text(k): text(v) for k, v in fields.items()} for fields in hashes)

    async def read(self, query: UsageQuery, providers: Iterable[str]) -> dict[str, object]:
        """The fleet's answer to ``query``, from the hours' aggregates (written up to the last ``send``)."""
        wanted = self._sums.keys(query, providers)
        pipeline = self._link.redis.pipeline(transaction=False)
        for key, _, _ in wanted:
            pipeline.hgetall(key)
        hashes = await pipeline.execute() if wanted else []
        return FleetUsage.answer(query, ((provider, hour, {text(k): text(v) for k, v in fields.items()})
                                         for (_, provider, hour), fields in zip(wanted, hashes, strict=True)))
