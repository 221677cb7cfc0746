"""Prometheus metrics: counters the relay bumps, gauges read from the status snapshot.

The two updates every request makes (its answer's status, its queue wait) are plain
integers and a bucket array here, read out when ``/metrics`` is scraped: a request
pays an index and an add, not prometheus-client's locked per-sample updates.

Under ``serve --workers N`` every worker answers ``/metrics`` for the whole host, through
prometheus-client's multiprocess mode: the parent makes a private folder
(``PROMETHEUS_MULTIPROC_DIR``) before it starts the workers, each worker copies its
plain counts into its own files there once a second and before it answers a scrape,
and a scrape adds up every worker's files. A request pays no more than in one process.
The files are named by worker index, not pid, so a worker that replaces a dead one
carries on from its counts: the host's counters never go back, and the folder holds
one set of files per worker however often they were replaced. What the Redis snapshot
says (slots held, queues, limits) is the fleet's already, and is read at the scrape."""

from __future__ import annotations

import asyncio
import functools
import math
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, generate_latest, values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..ledger.store import TOKEN_COLUMNS, LedgerRow
from ..limiter import ProviderStatus
from ..limiter.window import OTHER_GROUP
from .heap import process_pauses

__all__ = ["CONTENT_TYPE", "HOST_FILES_ENV", "PUBLISH_EVERY", "Metrics", "worker_gone"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HOST_FILES_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""The folder the workers of ``serve --workers`` keep their metrics in (prometheus-client's name for it)."""
PUBLISH_EVERY = 1.0
"""Seconds between a worker's copies of its counts to the host's files (a scrape on another worker sees them
at most this late)."""
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
_COST_AT = len(_TOKEN_KINDS)
"""Where a (provider, key, model)'s cost in dollars is kept, after its token totals."""
_GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, float("inf"))


class _Family(NamedTuple):
    name: str
    help: str
    labels: tuple[str, ...]


_REQUESTS = _Family("slotproxy_requests", "Requests answered, by the status the client received",
                    ("provider", "status"))
_WAITS = _Family("slotproxy_queue_wait_seconds", "Time requests waited for a slot", ("provider",))
_TOKENS = _Family("slotproxy_tokens", "Tokens the answers stated, by type (input includes cached input; output "
                  "includes reasoning)", ("provider", "key", "model", "type"))
_COST = _Family("slotproxy_cost_usd", "What the answers cost in US dollars, their tokens priced (see prices)",
                ("provider", "key", "model"))
_GC_PAUSES = _Family("slotproxy_gc_pause_seconds", "Event-loop stops for garbage collection, by generation",
                     ("generation",))
_RECLAIMS = _Family("slotproxy_watchdog_reclaims", "Slots reclaimed after slot_timeout", ("provider",))
_WEBSOCKETS = _Family("slotproxy_websockets", "Relayed WebSockets open on this replica", ("provider",))
_DEGRADED = _Family("slotproxy_backend_degraded",
                    "1 while the shared backend is unreachable (fail_closed or local mode)", ("kind", "mode"))


class _GcPauses(Collector):
    """How long the garbage collector stopped the event loop, by generation.

    Every stream the process relays waits while it runs: with a thousand streams open, a full
    collection takes tens of milliseconds (``bench/RESULTS.md``, "Lean, third pass"). The collector is the
    process's, so there is one of these per process, shared by every registry."""

    def __init__(self) -> None:
        self.pauses = [_Histogram(_GC_BUCKETS) for _ in range(3)]
        process_pauses().listen(self._observe)

    def _observe(self, generation: int, took: float) -> None:
        self.pauses[generation].observe(took)

    def collect(self) -> Iterable[Metric]:
        pauses = HistogramMetricFamily(_GC_PAUSES.name, _GC_PAUSES.help, labels=_GC_PAUSES.labels)
        for generation, histogram in enumerate(self.pauses):
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
        requests = CounterMetricFamily(_REQUESTS.name, _REQUESTS.help, labels=_REQUESTS.labels)
        for (provider, status), count in list(self._metrics.request_counts.items()):
            requests.add_metric([provider, status], count)
        yield requests
        waits = HistogramMetricFamily(_WAITS.name, _WAITS.help, labels=_WAITS.labels)
        for provider, histogram in list(self._metrics.waits.items()):
            waits.add_metric([provider], histogram.buckets(), histogram.total)
        yield waits
        tokens = CounterMetricFamily(_TOKENS.name, _TOKENS.help, labels=_TOKENS.labels)
        cost = CounterMetricFamily(_COST.name, _COST.help, labels=_COST.labels)
        for (provider, key, model), totals in list(self._metrics.tokens.items()):
            for kind, tokens_of_kind in zip(_TOKEN_KINDS, totals):
                if tokens_of_kind:
                    tokens.add_metric([provider, key, model, kind], tokens_of_kind)
            if totals[_COST_AT]:
                cost.add_metric([provider, key, model], totals[_COST_AT])
        yield tokens
        yield cost


class _SnapshotCollector(Collector):
    """The status snapshot's gauges; with ``per_replica`` False (a worker of ``serve --workers``), only what
    the snapshot says of the whole fleet: this replica's own reclaims, WebSockets and backend health come
    from every worker's files instead."""

    def __init__(self, snapshot: Callable[[], list[ProviderStatus]],
                 backend: Callable[[], dict[str, object]] | None,
                 sockets: Callable[[str], int] | None = None, *, per_replica: bool = True) -> None:
        self._snapshot = snapshot
        self._backend = backend
        self._sockets = sockets
        self._per_replica = per_replica

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
        windows = _WindowFamilies()
        reductions = CounterMetricFamily("slotproxy_auto_reductions", "Limit reductions after upstream backoffs", labels=["provider"])
        reclaims = CounterMetricFamily(_RECLAIMS.name, _RECLAIMS.help, labels=_RECLAIMS.labels)
        websockets = GaugeMetricFamily(_WEBSOCKETS.name, _WEBSOCKETS.help, labels=_WEBSOCKETS.labels)
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
            windows.add(status)
        yield from gauges.values()
        yield from per_key.values()
        yield from per_model.values()
        yield from windows.families()
        yield reductions
        if not self._per_replica:
            return
        yield reclaims
        yield websockets
        if self._backend is not None:
            degraded = GaugeMetricFamily(_DEGRADED.name, _DEGRADED.help, labels=_DEGRADED.labels)
            labels, value = _degraded(self._backend())
            degraded.add_metric(labels, value)
            yield degraded


class _WindowFamilies:
    """The token windows of every provider and key, one series per (provider, key, group, window).

    The ``group`` label is the ``models`` pattern a window's model group is, else ``other``: a model a client
    named is never a label value. Several groups outside every pattern share ``other``: its available room
    and limit are those of the one with the least room left, and its counts add up."""

    def __init__(self) -> None:
        labels = ["provider", "key", "group", "window"]
        self.available = GaugeMetricFamily(
            "slotproxy_window_available", "Tokens (or requests) a token window holds now", labels=labels)
        self.limit = GaugeMetricFamily(
            "slotproxy_window_limit", "Per-minute limit of a token window, as configured or learned (NaN when none)",
            labels=labels)
        self.held = CounterMetricFamily(
            "slotproxy_window_held", "Requests that waited on a token window", labels=labels)
        self.hits = CounterMetricFamily(
            "slotproxy_window_hits", "Upstream 429s that named a token window", labels=labels)

    def add(self, status: ProviderStatus) -> None:
        patterns = {model.pattern for model in status.models}
        owners = [("", status.windows)] + [(key.name, key.windows) for key in status.keys]
        series: dict[tuple[str, str, str, str], list[float]] = {}
        for key, windows in owners:
            for window in windows or ():
                group = str(window.get("group"))
                labels = (status.provider, key, group if group in patterns else OTHER_GROUP, str(window.get("window")))
                reading = _reading(window)
                seen = series.setdefault(labels, reading)
                if seen is reading:
                    continue
                if _room(reading) < _room(seen):
                    seen[0], seen[1] = reading[0], reading[1]
                seen[2] += reading[2]
                seen[3] += reading[3]
        for labels, (available, limit, held, hits) in series.items():
            self.available.add_metric(labels, available)
            self.limit.add_metric(labels, limit)
            self.held.add_metric(labels, held)
            self.hits.add_metric(labels, hits)

    def families(self) -> tuple[Metric, ...]:
        return self.available, self.limit, self.held, self.hits


def _reading(window: dict[str, Any]) -> list[float]:
    """A status row's available, limit (NaN: none now), held_total and hits."""
    limit = window.get("limit")
    return [float(window.get("available") or 0), math.nan if limit is None else float(limit),
            float(window.get("held_total") or 0), float(window.get("hits") or 0)]


def _room(reading: list[float]) -> float:
    """The share of a window's limit still there (its available room when it has no limit)."""
    available, limit = reading[0], reading[1]
    return available / limit if limit > 0 else available


def _degraded(info: dict[str, object]) -> tuple[list[str], int]:
    return [str(info.get("kind")), str(info.get("mode") or "-")], 0 if info.get("healthy") else 1


class _HostFiles:
    """This worker's series in the host's folder, as prometheus-client's multiprocess values: a count goes in
    as what it grew by since it last went in (added to what a dead predecessor left), a gauge as its value."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, tuple[str, ...]], tuple[Any, list[float | None]]] = {}

    def total(self, kind: str, family: _Family, sample: str, labels: Sequence[str], count: float, *,
              names: Sequence[str] | None = None, always: bool = False) -> None:
        """``count``: what this process has counted since it started (it never goes down; a lower one is
        ignored). A series still at 0 is left out unless ``always``."""
        entry = self._series.get((sample, tuple(labels)))
        if entry is None:
            if not (count or always):
                return
            entry = self._add(kind, family, sample, labels, names, "", 0.0)
        value, published = entry
        last = published[0] or 0.0
        if count > last:
            value.inc(count - last)
            published[0] = count

    def histogram(self, family: _Family, labels: Sequence[str], histogram: _Histogram) -> None:
        names = (*family.labels, "le")
        for bound, count in zip(histogram.bounds, histogram.counts, strict=True):
            self.total("histogram", family, family.name + "_bucket", (*labels, floatToGoString(bound)), count,
                       names=names, always=True)
        self.total("histogram", family, family.name + "_sum", labels, histogram.total, always=True)

    def gauge(self, family: _Family, mode: str, labels: Sequence[str], reading: float) -> None:
        entry = self._series.get((family.name, tuple(labels)))
        if entry is None:
            entry = self._add("gauge", family, family.name, labels, None, mode, None)
        value, published = entry
        if published[0] != reading:
            value.set(reading)
            published[0] = reading

    def _add(self, kind: str, family: _Family, sample: str, labels: Sequence[str], names: Sequence[str] | None,
             mode: str, published: float | None) -> tuple[Any, list[float | None]]:
        value = values.ValueClass(kind, family.name, sample, tuple(names or family.labels), tuple(labels),
                                  family.help, multiprocess_mode=mode)
        entry = self._series[(sample, tuple(labels))] = (value, [published])
        return entry


@functools.cache
def _name_files_by_worker(index: int) -> None:
    """prometheus-client names a process's files by its pid; by worker index instead, a worker that replaces
    a dead one reads its predecessor's counts from them and adds to those (once per process: two sets of
    values on one file would overwrite each other)."""
    values.ValueClass = values.MultiProcessValue(lambda: str(index))


def worker_gone(folder: str, index: int) -> None:
    """Worker ``index`` exited: its gauges go with it (its counts stay, for the next worker ``index``)."""
    mark_process_dead(str(index), folder)


class Metrics:
    """One registry per proxy instance, so several proxies in one process never collide.

    ``worker``: this process is worker N of ``serve --workers``; where the parent made the host's folder
    (``PROMETHEUS_MULTIPROC_DIR``), what it renders is the whole host's (see the module's docstring)."""

    def __init__(self, snapshot: Callable[[], list[ProviderStatus]],
                 backend: Callable[[], dict[str, object]] | None = None,
                 sockets: Callable[[str], int] | None = None, *, worker: int | None = None) -> None:
        folder = os.environ.get(HOST_FILES_ENV) if worker is not None else None
        if folder and worker is not None:
            _name_files_by_worker(worker)  # before the first value below is made
        self._snapshot = snapshot
        self._backend = backend
        self._sockets = sockets
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
        self.telemetry_dropped = Counter(
            "slotproxy_telemetry_dropped", "Spans the OTLP collector never got (the requests were served)",
            registry=self.registry,
        )
        self.tokens: dict[tuple[str, str, str], list[float]] = {}
        """Tokens by (provider, key, model label) as the answers stated them: one total per type, in the
        ledger's column order (a type still at 0 is not shown), then their cost in dollars."""
        self.request_counts: dict[tuple[str, str], int] = {}
        self.waits: dict[str, _Histogram] = {}
        self.registry.register(_PerRequestCollector(self))
        self.registry.register(_SnapshotCollector(snapshot, backend, sockets))
        self.registry.register(_process_gc_pauses())
        self._host: _HostFiles | None = None
        if folder:
            self._host = _HostFiles()
            self._host_registry = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self._host_registry, folder)
            self._host_registry.register(_SnapshotCollector(snapshot, backend, sockets, per_replica=False))

    def count_request(self, provider: str, status: str) -> None:
        key = (provider, status)
        counts = self.request_counts
        counts[key] = counts.get(key, 0) + 1

    def count_tokens(self, row: LedgerRow, model: str) -> None:
        """A row's known token counts; ``model`` is the label (the matching ``models`` pattern, else other)."""
        group = (row.provider, row.key or "", model)
        totals = self.tokens.get(group)
        if totals is None:
            totals = self.tokens[group] = [0] * len(_TOKEN_KINDS) + [0.0]
        totals[0] += row.input_tokens or 0
        totals[1] += row.cached_input_tokens or 0
        totals[2] += row.cache_write_tokens or 0
        totals[3] += row.output_tokens or 0
        totals[4] += row.reasoning_tokens or 0
        totals[5] += row.cost_usd or 0.0

    def observe_wait(self, provider: str, seconds: float) -> None:
        histogram = self.waits.get(provider)
        if histogram is None:
            histogram = self.waits[provider] = _Histogram()
        histogram.observe(seconds)

    def render(self) -> bytes:
        if self._host is not None:
            self.publish()
            return generate_latest(self._host_registry)
        return generate_latest(self.registry)

    @property
    def host_wide(self) -> bool:
        """True in a worker of ``serve --workers``, whose counts go to the host's files."""
        return self._host is not None

    def publish(self) -> None:
        """This worker's counts and gauges to its files in the host's folder (in one process: nothing)."""
        host = self._host
        if host is None:
            return
        for (provider, status), count in list(self.request_counts.items()):
            host.total("counter", _REQUESTS, _REQUESTS.name + "_total", (provider, status), count)
        for provider, histogram in list(self.waits.items()):
            host.histogram(_WAITS, (provider,), histogram)
        for (provider, key, model), totals in list(self.tokens.items()):
            for kind, tokens_of_kind in zip(_TOKEN_KINDS, totals):
                host.total("counter", _TOKENS, _TOKENS.name + "_total", (provider, key, model, kind),
                           tokens_of_kind)
            host.total("counter", _COST, _COST.name + "_total", (provider, key, model), totals[_COST_AT])
        for generation, histogram in enumerate(_process_gc_pauses().pauses):
            host.histogram(_GC_PAUSES, (str(generation),), histogram)
        for snapshot in self._snapshot():
            provider = snapshot.provider
            host.total("counter", _RECLAIMS, _RECLAIMS.name + "_total", (provider,),
                       snapshot.counters.get("reclaims", 0), always=True)
            if self._sockets is not None:
                host.gauge(_WEBSOCKETS, "livesum", (provider,), self._sockets(provider))
        if self._backend is not None:
            labels, value = _degraded(self._backend())
            host.gauge(_DEGRADED, "livemax", labels, value)

    async def publish_every(self, seconds: float = PUBLISH_EVERY) -> None:
        """Publish until cancelled (a worker's task)."""
        while True:
            await asyncio.sleep(seconds)
            self.publish()
