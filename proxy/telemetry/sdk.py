"""The OpenTelemetry SDK as slotproxy runs it: one tracer and one meter provider of its own (the process's
global ones are left alone), spans exported by the SDK's batch processor and metrics by its periodic reader,
both over OTLP/HTTP in their own threads, off the event loop.

A collector that is down or slow costs a request nothing: the batch processor's queue is bounded, and a span
it cannot hold or send is dropped, counted (``slotproxy_telemetry_dropped`` on /metrics) and said in one log
line a minute. The exporters' own log lines, one per failed batch, are kept quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import __version__
from ..limiter import ProviderStatus
from . import names
from .instruments import Instruments
from .settings import TelemetrySettings
from .spans import ProviderFacts, RequestTrace, SocketTrace

if TYPE_CHECKING:
    from ..config import ProviderSettings

__all__ = ["Drops", "Telemetry"]

log = logging.getLogger("slotproxy.telemetry")

_LOG_EVERY = 60.0
_CLOSE_WAIT = 3.0
_QUIET_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
)
_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()


class _Quiet(logging.Filter):
    """The SDK logs each failed batch (with retries and tracebacks); ``Drops`` says it once a minute instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL


class Drops:
    """Spans that never reached the collector, and metric exports that failed; one log line a minute."""

    def __init__(self, endpoint: str, on_dropped: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.spans = 0
        self.metric_exports = 0
        self._on_dropped = on_dropped
        self._clock = clock
        self._lock = threading.Lock()
        self._unsaid_spans = 0
        self._unsaid_metrics = 0
        self._said_at = -math.inf

    def spans_dropped(self, count: int, why: str) -> None:
        with self._lock:
            self.spans += count
            self._unsaid_spans += count
        if self._on_dropped is not None:
            self._on_dropped(count)
        self._say(why)

    def metrics_failed(self) -> None:
        with self._lock:
            self.metric_exports += 1
            self._unsaid_metrics += 1
        self._say("the collector did not take them")

    def _say(self, why: str) -> None:
        with self._lock:
            now = self._clock()
            if now - self._said_at < _LOG_EVERY:
                return
            self._said_at = now
            spans, metrics = self._unsaid_spans, self._unsaid_metrics
            self._unsaid_spans = self._unsaid_metrics = 0
        log.warning("telemetry: %d span(s) dropped and %d metric export(s) failed in the last minute (%s): is the "
                    "OTLP collector at %s up and answering? Requests are served as usual", spans, metrics, why,
                    self.endpoint)


class _SpanExporter(OTLPSpanExporter):
    drops: Drops

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = super().export(spans)
        except Exception:  # noqa: BLE001 - whatever the exporter raised, the spans are lost and counted
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.drops.spans_dropped(len(spans), "the collector did not take them")
        return result


class _MetricExporter(OTLPMetricExporter):
    drops: Drops

    def export(self, metrics_data: MetricsData, timeout_millis: float | None = None,
               **kwargs: Any) -> MetricExportResult:
        try:
            result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:  # noqa: BLE001 - as for spans
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self.drops.metrics_failed()
        return result


class _CountedBatch(SpanProcessor):
    """The SDK's batch processor, with the spans its full queue pushes out counted."""

    def __init__(self, inner: BatchSpanProcessor, drops: Drops) -> None:
        self._inner = inner
        self._drops = drops
        # The SDK's bounded deque (private): a span past its length pushes the oldest out.
        self._queue = getattr(getattr(inner, "_batch_processor", None), "_queue", None)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if queue is not None and queue.maxlen is not None and len(queue) >= queue.maxlen:
            self._drops.spans_dropped(1, "the export queue is full: the collector is slower than the requests")
        self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class Telemetry:
    """The running proxy's tracer and meter, and what each request's spans are made with."""

    def __init__(self, settings: TelemetrySettings, on_dropped: Callable[[int], None] | None = None) -> None:
        for name in _QUIET_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(each, _Quiet) for each in logger.filters):
                logger.addFilter(_Quiet())
        self.settings = settings
        self.drops = Drops(settings.shown_endpoint, on_dropped)
        resource = Resource.create({"service.name": settings.service_name, "service.version": __version__})
        span_exporter = _SpanExporter(endpoint=settings.signal_endpoint("traces"))
        span_exporter.drops = self.drops
        self.tracer_provider = TracerProvider(resource=resource,
                                              sampler=ParentBased(TraceIdRatioBased(settings.sample)))
        self.tracer_provider.add_span_processor(_CountedBatch(BatchSpanProcessor(span_exporter), self.drops))
        readers = []
        if settings.metrics:
            metric_exporter = _MetricExporter(endpoint=settings.signal_endpoint("metrics"))
            metric_exporter.drops = self.drops
            readers.append(PeriodicExportingMetricReader(metric_exporter))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self.tracer = self.tracer_provider.get_tracer("slotproxy", __version__, schema_url=names.SCHEMA_URL)
        self.instruments = Instruments(self.meter_provider, settings.latest_experimental)
        self._facts: dict[tuple[str, str, str], ProviderFacts] = {}
        self._sampler: asyncio.Task[None] | None = None
        self.open_servers = 0
        """SERVER spans begun and not ended: the requests and sockets it traces now."""
        self._drained = asyncio.Event()
        """Set when a retired telemetry has no SERVER span open any more (or is asked not to wait)."""

    def facts(self, provider: str, upstream: str, dialect: str) -> ProviderFacts:
        cached = self._facts.get((provider, upstream, dialect))
        if cached is None:
            cached = self._facts[(provider, upstream, dialect)] = ProviderFacts.of(provider, upstream, dialect)
        return cached

    def request(self, headers: Mapping[str, str], provider: str, settings: ProviderSettings, method: str,
                path: str) -> RequestTrace:
        """A request has arrived: its SERVER span begins (continuing the client's ``traceparent``)."""
        self.open_servers += 1
        return RequestTrace.serving(self, self._parent(headers), self._facts_of(provider, settings), method, path)

    def socket(self, headers: Mapping[str, str], provider: str, settings: ProviderSettings, path: str) -> SocketTrace:
        """A WebSocket upgrade has arrived: its SERVER span lasts as long as the socket."""
        self.open_servers += 1
        return SocketTrace(self, self._parent(headers), self._facts_of(provider, settings), path)

    def server_ended(self) -> None:
        self.open_servers -= 1
        if self.open_servers <= 0:
            self._drained.set()

    def _facts_of(self, provider: str, settings: ProviderSettings) -> ProviderFacts:
        return self.facts(provider, settings.upstream, settings.dialect)

    @staticmethod
    def _parent(headers: Mapping[str, str]) -> Context:
        if "traceparent" not in headers:
            return _ROOT
        return _PROPAGATOR.extract(headers, context=_ROOT)

    # ----- gauges and lifetime ---------------------------------------------------------

    def start(self, snapshot: Callable[[], list[ProviderStatus]]) -> None:
        """Sample the slot, queue and window gauges on the event loop, as often as metrics are exported."""
        interval = _export_interval()
        self._sampler = asyncio.get_running_loop().create_task(self._sample_every(snapshot, interval))

    async def _sample_every(self, snapshot: Callable[[], list[ProviderStatus]], interval: float) -> None:
        while True:
            self.instruments.sample(snapshot())
            await asyncio.sleep(interval)

    async def retire(self, longest: float) -> None:
        """A reload replaced it: the requests and sockets it traced end on it, so their spans are exported
        whole, then it closes; after ``longest`` seconds it closes anyway (the spans of what still runs then
        are lost), and at once when ``hurry`` is called (the proxy is shutting down)."""
        if self.open_servers > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), longest)
        await self.close()

    def hurry(self) -> None:
        """A retiring telemetry stops waiting for the requests it traced."""
        self._drained.set()

    async def close(self) -> None:
        """Stop sampling, send what is queued (a collector that is down is waited on a few seconds at most)."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def shut_down() -> None:
            try:
                self.tracer_provider.shutdown()
                self.meter_provider.shutdown(timeout_millis=_CLOSE_WAIT * 1000)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed without waiting
                    loop.call_soon_threadsafe(_settle, done)

        threading.Thread(target=shut_down, name="slotproxy-telemetry-close", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), _CLOSE_WAIT)


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _export_interval() -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds, 60 s unless set), in seconds."""
    try:
        value = float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "") or 60000) / 1000
    except ValueError:
        return 60.0
    return value if value > 0 else 60.0
