"""The metrics: the GenAI client metrics (the conventions' units and advised buckets), the queue time, and
the slot, queue and window gauges. None carries a workspace or conversation."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider

from .. import __version__
from ..limiter import ProviderStatus
from ..limiter.window import OTHER_GROUP
from . import names

__all__ = ["Instruments"]


class Instruments:
    def __init__(self, provider: MeterProvider, latest_experimental: bool) -> None:
        meter = provider.get_meter("slotproxy", __version__, schema_url=names.SCHEMA_URL)
        self.latest = latest_experimental
        self.duration = meter.create_histogram(
            names.OPERATION_DURATION, unit="s", description="GenAI operation duration",
            explicit_bucket_boundaries_advisory=list(names.DURATION_BUCKETS))
        if latest_experimental:
            self.tokens = meter.create_counter(names.INFERENCE_TOKENS, unit="{token}",
                                               description="Tokens used, by type")
            self.input_by_cache = meter.create_counter(names.INPUT_BY_CACHE, unit="{token}",
                                                       description="Input tokens, by cache use")
            self.output_by_phase = meter.create_counter(names.OUTPUT_BY_PHASE, unit="{token}",
                                                        description="Output tokens, by phase")
        else:
            self.token_usage = meter.create_histogram(
                names.TOKEN_USAGE, unit="{token}", description="Number of input and output tokens used",
                explicit_bucket_boundaries_advisory=list(names.TOKEN_BUCKETS))
        self.queue_time = meter.create_histogram(
            names.QUEUE_TIME, unit="s", description="Time a request waited in slotproxy's queue for its slot",
            explicit_bucket_boundaries_advisory=list(names.QUEUE_BUCKETS))
        self.in_flight = meter.create_gauge("slotproxy.slots.in_flight", unit="{slot}",
                                            description="Slots held (and cooling down)")
        self.limit = meter.create_gauge("slotproxy.slots.limit", unit="{slot}",
                                        description="Effective limit (absent when unlimited)")
        self.waiting = meter.create_gauge("slotproxy.queue.waiting", unit="{request}",
                                          description="Requests waiting for a slot")
        self.window_available = meter.create_gauge("slotproxy.window.available", unit="{token}",
                                                    description="Tokens (or requests) a token window holds now")
        self.window_limit = meter.create_gauge("slotproxy.window.limit", unit="{token}",
                                               description="Per-minute limit of a token window")

    def record_tokens(self, counts: tuple[int, int, int, int, int], attributes: dict[str, Any]) -> None:
        input_tokens, cached, cache_write, output, reasoning = counts
        if not self.latest:
            self.token_usage.record(input_tokens, {**attributes, names.TOKEN_TYPE: "input"})
            self.token_usage.record(output, {**attributes, names.TOKEN_TYPE: "output"})
            return
        self.tokens.add(input_tokens, {**attributes, names.TOKEN_TYPE: "input"})
        self.tokens.add(output, {**attributes, names.TOKEN_TYPE: "output"})
        for cache, count in (("read", cached), ("creation", cache_write),
                             ("none", max(0, input_tokens - cached - cache_write))):
            self.input_by_cache.add(count, {**attributes, names.TOKEN_CACHE: cache})
        for phase, count in (("reasoning", reasoning), ("response", max(0, output - reasoning))):
            self.output_by_phase.add(count, {**attributes, names.TOKEN_PHASE: phase})

    def sample(self, statuses: list[ProviderStatus]) -> None:
        for status in statuses:
            labels = {names.SLOT_PROVIDER: status.provider}
            self.in_flight.set(status.in_flight, labels)
            self.waiting.set(status.queued, labels)
            if status.limit is not None:
                self.limit.set(status.limit, labels)
            patterns = {model.pattern for model in status.models}
            owners = [("", status.windows)] + [(key.name, key.windows) for key in status.keys]
            for key, windows in owners:
                for window in windows or ():
                    group = str(window.get("group"))
                    attributes = {**labels, names.KEY: key, "slotproxy.window.group":
                                  group if group in patterns else OTHER_GROUP,
                                  "slotproxy.window.name": str(window.get("window"))}
                    self.window_available.set(float(window.get("available") or 0), attributes)
                    if window.get("limit") is not None:
                        self.window_limit.set(float(window["limit"]), attributes)
