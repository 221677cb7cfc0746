"""One request's ledger row in the making: the relay fills it in as the request goes, and records it at its end.

Outcomes (the SPEC's): ``ok`` (an upstream answer, whatever its status, reached
the client whole), ``client_gone`` (the client left first), ``upstream_error``
(the upstream could not be reached or broke off), ``timeout`` (``idle_timeout``
or ``slot_timeout`` fired) and ``rejected`` (the proxy answered without an
upstream answer: queue full, queue timeout, shutting down, a bad request, …).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..ledger.prices import PriceTable
from ..ledger.store import LedgerRow
from ..limiter import Priority
from ..providers.decoders import StreamDecoder, decoder_for
from ..providers.tokens import UsageReader

if TYPE_CHECKING:
    from ..telemetry.spans import RequestTrace

__all__ = ["Account", "BodyTail"]

_UNKNOWN = (None, None, None, None, None)
"""The five token counts of an answer that stated none."""

_new_row = tuple.__new__
"""A ledger row made without the named tuple's own constructor (a Python frame per request)."""

_TAIL = 16 * 1024
"""How much of a streamed (not event-stream) answer is kept to read its usage from: every provider writes the
usage object at the end of a JSON answer."""


class Account:
    """What the ledger will say of one request."""

    __slots__ = ("arrived", "key", "model", "outcome", "priority", "provider", "queue_ms", "retries", "status",
                 "trace", "transport", "ttfb_ms", "usage")

    def __init__(self, provider: str, transport: str = "http", arrived: float | None = None) -> None:
        self.arrived = time.monotonic() if arrived is None else arrived
        self.provider = provider
        self.transport = transport
        self.priority: Priority | None = None
        self.model: str | None = None
        self.key: str | None = None
        self.status = 0
        self.outcome = "rejected"
        self.queue_ms = 0
        self.ttfb_ms: int | None = None
        self.retries = 0
        self.usage: UsageReader | None = None
        self.trace: RequestTrace | None = None
        """Its spans, while telemetry is on."""

    def first_byte(self) -> None:
        """The upstream's answer began to reach the client."""
        if self.ttfb_ms is None:
            self.ttfb_ms = round((time.monotonic() - self.arrived) * 1000)

    def row(self, prices: PriceTable | None = None) -> LedgerRow:
        """The ledger's row; ``prices`` prices its tokens (``cost_usd``)."""
        priority = self.priority
        counts = self.usage.totals() if self.usage is not None else None
        if priority is None:
            workspace, starred, conversation = "default", False, None
        else:
            workspace, starred, conversation = priority.workspace, priority.starred, priority.conversation
        ended_at = int(time.time() * 1000)
        tokens: tuple[int | None, ...]
        if counts is None:
            tokens, cost = _UNKNOWN, None
        else:
            tokens = counts
            cost = None if prices is None else prices.cost(self.provider, self.model, counts, ended_at)
        return _new_row(LedgerRow, (
            ended_at, self.provider, self.key, self.model, workspace, starred, conversation,
            self.transport, self.status, self.outcome, self.queue_ms, self.ttfb_ms,
            round((time.monotonic() - self.arrived) * 1000), *tokens, self.retries, cost))


class BodyTail:
    """The last bytes of a streamed JSON answer (decoded when it is compressed), read for usage at its end."""

    __slots__ = ("_decoder", "_tail")

    def __init__(self, content_encoding: str | None) -> None:
        encoding = (content_encoding or "").strip().lower()
        self._decoder: StreamDecoder | None = decoder_for(encoding) if encoding not in ("", "identity") else None
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if self._decoder is None:
            self._keep(chunk)
            return
        try:
            for piece in self._decoder.decode(chunk):
                self._keep(piece)
        except ValueError:
            self._tail = b""

    def _keep(self, piece: bytes) -> None:
        self._tail = (self._tail + piece)[-_TAIL:] if len(piece) < _TAIL else piece[-_TAIL:]

    def read_into(self, usage: UsageReader) -> None:
        usage.read(self._tail)
