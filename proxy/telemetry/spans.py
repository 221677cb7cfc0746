"""One request's spans, made from what the relay already records (its ``Account``): a SERVER span for the
proxy's whole handling, an INTERNAL ``slotproxy.queue`` span for each wait for a slot, and a CLIENT span
``{gen_ai.operation.name} {gen_ai.request.model}`` for each upstream attempt, ended when the last byte has
reached the client. No prompt or answer text is ever put in an attribute: only the names, counts and
timings the ledger keeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from . import names

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from ..limiter import Priority, SlotLease
    from ..providers.tokens import UsageReader
    from .instruments import Instruments

__all__ = ["ProviderFacts", "RequestTrace", "SocketTrace"]

_ERROR = Status(StatusCode.ERROR)


class Telemetry(Protocol):
    """What spans are made with (``sdk.Telemetry``)."""

    @property
    def tracer(self) -> Tracer: ...

    @property
    def instruments(self) -> Instruments: ...

    def server_ended(self) -> None:
        """A SERVER span it began has ended (a request's, or a socket's)."""


class Account(Protocol):
    """What the relay recorded of a request (``http.accounting.Account``)."""

    arrived: float
    model: str | None
    priority: Priority | None
    status: int
    outcome: str
    retries: int
    ttfb_ms: int | None
    usage: UsageReader | None


@dataclass(frozen=True, slots=True)
class ProviderFacts:
    """What every span of one provider says of it (worked out once per provider)."""

    provider: str
    gen_ai_provider: str
    address: str
    port: int

    @classmethod
    def of(cls, provider: str, upstream: str, dialect: str) -> ProviderFacts:
        parts = urlsplit(upstream)
        port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
        return cls(provider, names.provider_name(provider, upstream, dialect), parts.hostname or "", port)


def _error_type(status: int, outcome: str) -> str | None:
    """``error.type``: the status of an upstream answer that failed, else what went wrong in the ledger's word."""
    if outcome == "ok":
        return str(status) if status >= 400 else None
    if outcome == "rejected":
        return str(status) if status >= 400 else "rejected"
    return outcome


class RequestTrace:
    """The spans of one HTTP request, or of one response on a WebSocket (whose SERVER span is the socket's)."""

    __slots__ = ("_client", "_client_at", "_context", "_facts", "_method", "_operation", "_server", "_telemetry",
                 "recording")

    def __init__(self, telemetry: Telemetry, context: Context, server: Span | None, facts: ProviderFacts,
                 method: str, path: str, recording: bool) -> None:
        self._telemetry = telemetry
        self._context = context
        self._server = server
        self._facts = facts
        self._method = method
        self._operation = names.operation_name(path)
        self._client: Span | None = None
        self._client_at = 0.0
        self.recording = recording

    @classmethod
    def serving(cls, telemetry: Telemetry, parent: Context, facts: ProviderFacts, method: str,
                path: str) -> RequestTrace:
        server = telemetry.tracer.start_span(f"{method} /{facts.provider}", context=parent, kind=SpanKind.SERVER)
        recording = server.is_recording()
        if recording:
            server.set_attributes({names.HTTP_METHOD: method, names.URL_PATH: f"/{facts.provider}/{path}",
                                   names.SLOT_PROVIDER: facts.provider})
        return cls(telemetry, set_span_in_context(server, parent), server, facts, method, path, recording)

    # ----- the queue ---------------------------------------------------------------------

    def waited(self, seconds: float, priority: Priority, lease: SlotLease | None = None,
               refused: int | None = None) -> None:
        """A wait for a slot ended: granted (``lease``) or refused with the status ``refused``."""
        self._telemetry.instruments.queue_time.record(seconds, {names.SLOT_PROVIDER: self._facts.provider})
        if not self.recording:
            return
        now = time.time_ns()
        starred = priority.starred if lease is None else getattr(lease, "starred", priority.starred)
        attributes: dict[str, Any] = {names.SLOT_PROVIDER: self._facts.provider, names.WORKSPACE: priority.workspace,
                                      names.STARRED: starred}
        holder = None if lease is None else getattr(lease, "holder", None)
        if holder is not None:
            attributes[names.HELD_BY] = holder
        if refused is not None:
            attributes[names.ERROR_TYPE] = str(refused)
        span = self._telemetry.tracer.start_span(names.QUEUE_SPAN, context=self._context, kind=SpanKind.INTERNAL,
                                                 attributes=attributes, start_time=now - int(seconds * 1e9))
        if refused is not None:
            span.set_status(_ERROR)
        span.end(end_time=now)

    # ----- the upstream call -------------------------------------------------------------

    def sending(self, model: str | None, key: str | None = None) -> str:
        """An upstream attempt begins: its CLIENT span; returns the ``traceparent`` to send upstream."""
        operation = self._operation
        name = (f"{operation} {model}" if model else operation) if operation is not None else self._method
        facts = self._facts
        attributes: dict[str, Any] = {names.SERVER_ADDRESS: facts.address, names.SERVER_PORT: facts.port}
        if operation is not None:
            attributes[names.OPERATION] = operation
            attributes[names.PROVIDER] = facts.gen_ai_provider
            if model:
                attributes[names.REQUEST_MODEL] = model
        if key is not None:
            attributes[names.KEY] = key
        span = self._client = self._telemetry.tracer.start_span(name, context=self._context, kind=SpanKind.CLIENT,
                                                                attributes=attributes)
        self._client_at = time.monotonic()
        context = span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"

    def retried(self, status: int, model: str | None) -> None:
        """The attempt's answer (a backoff status) is not relayed: the proxy tries again."""
        span = self._client
        if span is None:
            return
        self._client = None
        error = str(status)
        if self.recording:
            span.set_attributes({names.HTTP_STATUS: status, names.ERROR_TYPE: error})
            span.set_status(_ERROR)
        span.end()
        self._record_duration(model, None, error)

    def end(self, account: Account) -> None:
        """The request ended (its last byte reached the client, or it failed): the open spans end."""
        span = self._client
        if span is not None:
            self._client = None
            self._end_client(span, account)
        server = self._server
        if server is not None:
            if self.recording:
                priority = account.priority
                attributes: dict[str, Any] = {names.HTTP_STATUS: account.status, names.OUTCOME: account.outcome,
                                              names.RETRIES: account.retries}
                if priority is not None:
                    attributes[names.WORKSPACE] = priority.workspace
                    attributes[names.STARRED] = priority.starred
                server.set_attributes(attributes)
                if account.status >= 500:
                    server.set_status(_ERROR)
            server.end()
            self._telemetry.server_ended()

    def _end_client(self, span: Span, account: Account) -> None:
        usage = account.usage
        counts = usage.totals() if usage is not None else None
        response_model = usage.model if usage is not None else None
        error = _error_type(account.status, account.outcome)
        if self.recording:
            attributes: dict[str, Any] = {names.HTTP_STATUS: account.status}
            if response_model is not None:
                attributes[names.RESPONSE_MODEL] = response_model
            if counts is not None:
                attributes[names.INPUT_TOKENS] = counts[0]
                attributes[names.OUTPUT_TOKENS] = counts[3]
                attributes[names.CACHE_READ] = counts[1]
                attributes[names.CACHE_CREATION] = counts[2]
                attributes[names.REASONING] = counts[4]
            priority = account.priority
            if priority is not None and priority.conversation:
                attributes[names.CONVERSATION] = priority.conversation
            if account.ttfb_ms is not None:
                first_byte = account.arrived + account.ttfb_ms / 1000
                attributes[names.TIME_TO_FIRST_CHUNK] = max(0.0, first_byte - self._client_at)
            if error is not None:
                attributes[names.ERROR_TYPE] = error
                span.set_status(_ERROR)
            span.set_attributes(attributes)
        span.end()
        self._record_duration(account.model, response_model, error, counts)

    def _record_duration(self, model: str | None, response_model: str | None, error: str | None,
                         counts: tuple[int, int, int, int, int] | None = None) -> None:
        operation = self._operation
        if operation is None:
            return
        facts = self._facts
        attributes: dict[str, Any] = {names.OPERATION: operation, names.PROVIDER: facts.gen_ai_provider,
                                      names.SERVER_ADDRESS: facts.address, names.SERVER_PORT: facts.port}
        if model:
            attributes[names.REQUEST_MODEL] = model
        if response_model:
            attributes[names.RESPONSE_MODEL] = response_model
        instruments = self._telemetry.instruments
        if counts is not None:
            instruments.record_tokens(counts, attributes)
        if error is not None:
            attributes[names.ERROR_TYPE] = error
        instruments.duration.record(time.monotonic() - self._client_at, attributes)


class SocketTrace:
    """A relayed WebSocket: its SERVER span lasts as long as the socket; each response has its spans under it."""

    __slots__ = ("_context", "_facts", "_server", "_telemetry", "recording", "traceparent")

    def __init__(self, telemetry: Telemetry, parent: Context, facts: ProviderFacts, path: str) -> None:
        self._telemetry = telemetry
        self._facts = facts
        server = self._server = telemetry.tracer.start_span(f"GET /{facts.provider}", context=parent,
                                                            kind=SpanKind.SERVER)
        self.recording = server.is_recording()
        if self.recording:
            server.set_attributes({names.HTTP_METHOD: "GET", names.URL_PATH: path,
                                   names.SLOT_PROVIDER: facts.provider, names.TRANSPORT: "websocket"})
        self._context = set_span_in_context(server, parent)
        context = server.get_span_context()
        self.traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        """Sent upstream with the handshake (a response's own frames carry no headers)."""

    def response(self) -> RequestTrace:
        return RequestTrace(self._telemetry, self._context, None, self._facts, "GET", "responses", self.recording)

    def end(self, status: int) -> None:
        if self.recording:
            self._server.set_attribute(names.HTTP_STATUS, status)
        self._server.end()
        self._telemetry.server_ended()
