"""An OTLP/HTTP collector in the test's own loop: a real aiohttp app that decodes what the proxy's exporters
send with opentelemetry-proto, and telemetry switched on for the proxies a test starts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from ..conftest import serve_app, wait_until
from ..ports import free_port

pb_trace = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pb_metrics = pytest.importorskip("opentelemetry.proto.collector.metrics.v1.metrics_service_pb2")
pytest.importorskip("opentelemetry.sdk")

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT"}


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class SpanSeen:
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    start: float
    end: float
    attributes: dict[str, Any]
    error: bool

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class PointSeen:
    metric: str
    unit: str
    attributes: dict[str, Any]
    value: float
    """A sum's or gauge's value; a histogram's count."""
    bounds: tuple[float, ...] = ()


@dataclass
class Collector:
    url: str = ""
    spans: list[SpanSeen] = field(default_factory=list)
    points: list[PointSeen] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    delay: float = 0.0
    """Seconds each export waits before it is answered (a slow collector)."""
    posts: int = 0

    async def traces(self, request: web.Request) -> web.Response:
        self.posts += 1
        body = pb_trace.ExportTraceServiceRequest.FromString(await request.read())
        await asyncio.sleep(self.delay)
        for resource_spans in body.resource_spans:
            self.resources.append(_attributes(resource_spans.resource.attributes))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(SpanSeen(
                        span.name, KINDS.get(span.kind, str(span.kind)), span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.start_time_unix_nano / 1e9, span.end_time_unix_nano / 1e9,
                        _attributes(span.attributes), span.status.code == 2))
        return web.Response(body=pb_trace.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def metrics(self, request: web.Request) -> web.Response:
        body = pb_metrics.ExportMetricsServiceRequest.FromString(await request.read())
        await asyncio.sleep(self.delay)
        for resource_metrics in body.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    kind = metric.WhichOneof("data")
                    data = getattr(metric, kind)
                    for point in data.data_points:
                        if kind == "histogram":
                            value, bounds = float(point.count), tuple(point.explicit_bounds)
                        else:
                            value = float(point.as_int if point.WhichOneof("value") == "as_int" else point.as_double)
                            bounds = ()
                        self.points.append(PointSeen(metric.name, metric.unit, _attributes(point.attributes), value,
                                                     bounds))
        return web.Response(body=pb_metrics.ExportMetricsServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def named(self, name: str) -> list[SpanSeen]:
        return [span for span in self.spans if span.name == name]

    def kind(self, kind: str) -> list[SpanSeen]:
        return [span for span in self.spans if span.kind == kind]

    def metric(self, name: str) -> list[PointSeen]:
        return [point for point in self.points if point.metric == name]

    async def wait_for_spans(self, count: int, timeout: float = 10.0) -> None:
        await wait_until(lambda: len(self.spans) >= count, timeout, f"{count} spans at the collector "
                                                                    f"(has {[s.name for s in self.spans]})")

    async def wait_for_metric(self, name: str, timeout: float = 10.0) -> None:
        await wait_until(lambda: bool(self.metric(name)), timeout, f"metric {name} at the collector")


@pytest.fixture
def fast_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches leave within 50 ms and metrics every 200 ms; an export gives up after 1 s."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SERVICE_NAME", "OTEL_SEMCONV_STABILITY_OPT_IN"):
        monkeypatch.delenv(name, raising=False)


async def start_collector() -> tuple[Collector, web.AppRunner]:
    """An OTLP/HTTP collector on loopback; the caller cleans its runner up."""
    seen = Collector()
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", seen.traces)
    app.router.add_post("/v1/metrics", seen.metrics)
    runner, port = await serve_app(app)
    seen.url = f"http://127.0.0.1:{port}"
    return seen, runner


@pytest.fixture
async def collector(fast_export: None) -> AsyncIterator[Collector]:
    seen, runner = await start_collector()
    yield seen
    await runner.cleanup()


def telemetry_yaml(endpoint: str, **settings: Any) -> str:
    extra = "".join(f", {key}: {value}" for key, value in settings.items())
    return f"telemetry: {{otlp_endpoint: '{endpoint}'{extra}}}\n"


def nowhere() -> str:
    """An OTLP endpoint nothing listens on (a collector that is down)."""
    return f"http://127.0.0.1:{free_port()}"
