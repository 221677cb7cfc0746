"""An OTLP/HTTP collector that takes everything and keeps nothing: where the benches' ``telemetry`` variant
exports its spans and metrics (not a benchmark itself).

It runs as a process of its own, so its CPU is never counted with slotproxy's (and never under valgrind);
what telemetry costs slotproxy (the spans, the metrics, the SDK's batch processor and its exporter, which run
in slotproxy's process) is all that is measured. It answers every export at once with an empty success, and
counts what came: ``GET /stats`` says how many exports, bytes and spans (the spans are counted when
opentelemetry-proto is installed, as it is with slotproxy's ``otel`` extra).

    python bench/otlp_sink.py PORT
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web
from common import HOST, Processes, free_port, run_loop, serve_forever, wait_http

try:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
except ImportError:  # the sink still discards; it only cannot count spans
    trace_service_pb2 = None

_STATS = web.AppKey("stats", dict)


async def _traces(request: web.Request) -> web.Response:
    body = await request.read()
    stats = request.app[_STATS]
    stats["trace_exports"] += 1
    stats["trace_bytes"] += len(body)
    if trace_service_pb2 is not None:
        decoded = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        stats["spans"] += sum(len(scope.spans) for resource in decoded.resource_spans for scope in resource.scope_spans)
    return web.Response(body=b"", content_type="application/x-protobuf")


async def _metrics(request: web.Request) -> web.Response:
    body = await request.read()
    stats = request.app[_STATS]
    stats["metric_exports"] += 1
    stats["metric_bytes"] += len(body)
    return web.Response(body=b"", content_type="application/x-protobuf")


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATS])


async def _serve(port: int) -> None:
    app = web.Application(client_max_size=64 << 20)
    app[_STATS] = {"trace_exports": 0, "trace_bytes": 0, "spans": 0 if trace_service_pb2 else None,
                   "metric_exports": 0, "metric_bytes": 0}
    app.router.add_post("/v1/traces", _traces)
    app.router.add_post("/v1/metrics", _metrics)
    app.router.add_get("/stats", _stats)
    await serve_forever(app, port)


class Sink:
    """The sink, started as a process of ``procs``; ``endpoint`` is what ``telemetry.otlp_endpoint`` names."""

    def __init__(self, procs: Processes) -> None:
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        proc = procs.start("otlp-sink", [sys.executable, str(Path(__file__)), str(self.port)])
        wait_http(f"{self.endpoint}/stats", proc, "the OTLP sink", require_200=True)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.endpoint}/stats", timeout=5) as response:
            return dict(json.load(response))


    def settled_stats(self, quiet: float = 1.0, timeout: float = 15.0) -> dict[str, Any]:
        """The counts once no span has come for ``quiet`` seconds (the batch processor sends what it holds
        every 5 s), at most ``timeout`` seconds from now."""
        deadline = time.monotonic() + timeout
        stats = self.stats()
        while time.monotonic() < deadline:
            time.sleep(quiet)
            latest = self.stats()
            if latest == stats:
                break
            stats = latest
        return stats


def dropped_spans(port: int) -> int | None:
    """``slotproxy_telemetry_dropped_total`` on the /metrics of the slotproxy on ``port`` (None: unread)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("slotproxy_telemetry_dropped_total"):
            return int(float(line.split()[-1]))
    return None


def exported_note(stats: dict[str, Any], requests: int, dropped: int | None) -> str:
    """What reached the sink, against the spans the telemetry variant's requests made (three each: SERVER, the
    queue's INTERNAL, CLIENT)."""
    spans = stats.get("spans")
    got = "an unknown number of spans" if spans is None else f"{spans} spans ({spans / max(requests, 1):.2f} a request)"
    lost = "" if dropped is None else f"; slotproxy counted {dropped} dropped"
    return (f"The OTLP sink received {got} in {stats['trace_exports']} trace exports ({stats['trace_bytes']} bytes) "
            f"and {stats['metric_exports']} metric exports, for the {requests} requests the telemetry variant was "
            f"sent, warm-up included{lost}.")


def telemetry_yaml(endpoint: str) -> str:
    """The ``telemetry:`` section the ``telemetry`` variant runs with: every request traced."""
    return f"telemetry: {{otlp_endpoint: '{endpoint}', sample: 1.0}}\n"


if __name__ == "__main__":
    run_loop(_serve(int(sys.argv[1])))
