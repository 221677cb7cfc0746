"""Prometheus metrics: counters the relay bumps, gauges read from the status snapshot.

The two updates every request makes (its answer's status, its queue wait) are plain
integers and a bucket array here, read out when ``/metrics`` is scraped: a request
pays an index and an add, not prometheus-client's locked per-sample updates."""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..ledger.store import TOKEN_COLUMNS, LedgerRow
from ..limiter import ProviderStatus
from .heap import process_pauses

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))


class _Histogram:
    """Observations as a count per bucket (the last bound is +Inf) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = _WAIT_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        running = 0
        out: list[tuple[str, float]] = []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


_TOKEN_KINDS = tuple(column.removesuffix("_tokens") for column in TOKEN_COLUMNS)
"""The ``type`` label of ``slotproxy_tokens_total``: the ledger's token columns, in their order."""
_GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, float("inf"))


class _GcPauses(Collector):
    """How long the garbage collector stopped the event loop, by generation.

    Every stream the process relays waits while it runs: with a thousand streams open, a full
    collection takes tens of milliseconds (``bench/RESULTS.md``, "Lean, third pass"). The collector is the
    process's, so there is one of these per process, shared by every registry."""

    def __init__(self) -> None:
        self._pauses = [_Histogram(_GC_BUCKETS) for _ in range(3)]
        process_pauses().listen(self._observe)

    def _observe(self, generation: int, took: float) -> None:
        self._pauses[generation].observe(took)

    def collect(self) -> Iterable[Metric]:
        pauses = HistogramMetricFamily("slotproxy_gc_pause_seconds",
                                       "Event-loop stops for garbage collection, by generation", labels=["generation"])
        for generation, histogram in enumerate(self._pauses):
            pauses.add_metric([str(generation)], histogram.buckets(), histogram.total)
        yield pauses


@functools.cache
def _process_gc_pauses() -> _GcPauses:
    return _GcPauses()


class _PerRequestCollector(Collector):
    """Requests answered (by status) and queue waits, from the plain counts ``Metrics`` keeps."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily("slotproxy_requests", "Requests answered, by the status the client received",
                                       labels=["provider", "status"])
        for (provider, status), count in list(self._metrics.request_counts.items()):
            requests.add_metric([provider, status], count)
        yield requests
        waits = HistogramMetricFamily("slotproxy_queue_wait_seconds", "Time requests waited for a slot",
                                      labels=["provider"])
        for provider, histogram in list(self._metrics.waits.items()):
            waits.add_metric([provider], histogram.buckets(), histogram.total)
        yield waits
        tokens = CounterMetricFamily("slotproxy_tokens", "Tokens the answers stated, by type (input includes "
                                     "cached input; output includes reasoning)",
                                     labels=["provider", "key", "model", "type"])
        for (provider, key, model), totals in list(self._metrics.tokens.items()):
            for kind, count in zip(_TOKEN_KINDS, totals):
                if count:
                    tokens.add_metric([provider, key, model, kind], count)
        yield tokens


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], list[ProviderStatus]],
                 backend: Callable[[], dict[str, object]] | None,
                 sockets: Callable[[str], int] | None = None) -> None:
        self._snapshot = snapshot
        self._backend = backend
        self._sockets = sockets

    def collect(self) -> Iterable[Metric]:
        gauges = {
            "in_flight": GaugeMetricFamily("slotproxy_in_flight", "Slots held, including those in release cooldown", labels=["provider"]),
            "queued": GaugeMetricFamily("slotproxy_queued", "Requests waiting for a slot", labels=["provider"]),
            "limit": GaugeMetricFamily("slotproxy_limit", "Effective concurrency limit (NaN when unlimited)", labels=["provider"]),
            "paused": GaugeMetricFamily("slotproxy_paused", "1 while the provider's queue is paused after a backoff", labels=["provider"]),
        }
        per_key = {
            "in_flight": GaugeMetricFamily("slotproxy_key_in_flight", "Slots held on one key of a pool", labels=["provider", "key"]),
            "limit": GaugeMetricFamily("slotproxy_key_limit", "Effective limit of one key of a pool (NaN when unlimited)", labels=["provider", "key"]),
            "paused": GaugeMetricFamily("slotproxy_key_paused", "1 while a key is paused after a backoff", labels=["provider", "key"]),
            "held": GaugeMetricFamily("slotproxy_key_budget_held", "1 while a key is held until its announced budget resets", labels=["provider", "key"]),
        }
        per_model = {
            "in_flight": GaugeMetricFamily("slotproxy_model_in_flight", "Slots held under one model cap", labels=["provider", "model"]),
            "limit": GaugeMetricFamily("slotproxy_model_limit", "Limit of one model cap (NaN when unlimited)", labels=["provider", "model"]),
        }
        reductions = CounterMetricFamily("slotproxy_auto_reductions", "Limit reductions after upstream backoffs", labels=["provider"])
        reclaims = CounterMetricFamily("slotproxy_watchdog_reclaims", "Slots reclaimed after slot_timeout", labels=["provider"])
        websockets = GaugeMetricFamily("slotproxy_websockets", "Relayed WebSockets open on this replica",
                                       labels=["provider"])
        for status in self._snapshot():
            labels = [status.provider]
            gauges["in_flight"].add_metric(labels, status.in_flight)
            gauges["queued"].add_metric(labels, status.queued)
            gauges["limit"].add_metric(labels, float("nan") if status.limit is None else status.limit)
            gauges["paused"].add_metric(labels, 1 if status.paused else 0)
            reductions.add_metric(labels, status.counters.get("auto_reductions", 0))
            reclaims.add_metric(labels, status.counters.get("reclaims", 0))
            if self._sockets is not None:
                websockets.add_metric(labels, self._sockets(status.provider))
            for key in status.keys:
                key_labels = [status.provider, key.name]
                per_key["in_flight"].add_metric(key_labels, key.in_flight)
                per_key["limit"].add_metric(key_labels, float("nan") if key.limit is None else key.limit)
                per_key["paused"].add_metric(key_labels, 1 if key.paused_until is not None else 0)
                held = key.budget is not None and key.budget.get("held_until") is not None
                per_key["held"].add_metric(key_labels, 1 if held else 0)
            for model in status.models:
                model_labels = [status.provider, model.pattern]
                per_model["in_flight"].add_metric(model_labels, model.in_flight)
                per_model["limit"].add_metric(model_labels, float("nan") if model.limit is None else model.limit)
        yield from gauges.values()
        yield from per_key.values()
        yield from per_model.values()
        yield reductions
        yield reclaims
        yield websockets
        if self._backend is not None:
            info = self._backend()
            degraded = GaugeMetricFamily("slotproxy_backend_degraded",
                                         "1 while the shared backend is unreachable (fail_closed or local mode)",
                                         labels=["kind", "mode"])
            degraded.add_metric([str(info.get("kind")), str(info.get("mode") or "-")], 0 if info.get("healthy") else 1)
            yield degraded


class Metrics:
    """One registry per proxy instance, so several proxies in one process never collide."""

    def __init__(self, snapshot: Callable[[], list[ProviderStatus]],
                 backend: Callable[[], dict[str, object]] | None = None,
                 sockets: Callable[[str], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.backoffs = Counter(
            "slotproxy_upstream_backoff", "Upstream backoff answers (429, 529, in-stream rate-limit errors)",
            ["provider", "status"], registry=self.registry,
        )
        self.invalid_headers = Counter(
            "slotproxy_invalid_priority_headers", "Priority headers with an invalid value (default used)",
            ["header"], registry=self.registry,
        )
        self.ledger_dropped = Counter(
            "slotproxy_ledger_dropped", "Ledger rows that could not be written (the requests were served)",
            registry=self.registry,
        )
        self.tokens: dict[tuple[str, str, str], list[int]] = {}
        """Tokens by (provider, key, model label) as the answers stated them: one total per type, in the
        ledger's column order (a type still at 0 is not shown)."""
        self.request_counts: dict[tuple[str, str], int] = {}
        self.waits: dict[str, _Histogram] = {}
        self.registry.register(_PerRequestCollector(self))
        self.registry.register(_SnapshotCollector(snapshot, backend, sockets))
        self.registry.register(_process_gc_pauses())

    def count_request(self, provider: str, status: str) -> None:
        key = (provider, status)
        counts = self.request_counts
        counts[key] = counts.get(key, 0) + 1

    def count_tokens(self, row: LedgerRow, model: str) -> None:
        """A row's known token counts; ``model`` is the label (the matching ``models`` pattern, else other)."""
        group = (row.provider, row.key or "", model)
        totals = self.tokens.get(group)
        if totals is None:
            totals = self.tokens[group] = [0] * len(_TOKEN_KINDS)
        totals[0] += row.input_tokens or 0
        totals[1] += row.cached_input_tokens or 0
        totals[2] += row.cache_write_tokens or 0
        totals[3] += row.output_tokens or 0
        totals[4] += row.reasoning_tokens or 0

    def observe_wait(self, provider: str, seconds: float) -> None:
        histogram = self.waits.get(provider)
        if histogram is None:
            histogram = self.waits[provider] = _Histogram()
        histogram.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
