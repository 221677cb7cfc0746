"""The fleet's hourly usage aggregates, as the Redis backend keeps them: encoded here, decoded here.

Each replica writes its own ledger; to answer ``/usage`` for the whole fleet,
every replica also adds its requests to one hash per provider and hour, under
the provider's hash tag (``{prefix:provider}:usage:<hour ms>``), grouped by
key, model and workspace, kept for the ledger's retention. Conversations are
left out (they stay in each replica's own ledger). A queue wait's median is
read from a histogram, so in fleet scope ``queue_ms_p50`` is the upper bound
of the bucket that holds the median.

Costs are kept as integer nano-dollars (``cost_nusd``), so they add exactly in
Redis; each provider's day also keeps a hash of its spend per workspace
(``{prefix:provider}:spend:<day ms>``), read for the daily spend caps.

Pure: rows go in, ``(redis key, script arguments)`` come out, and the hashes
read back become the answer's rows; the backend does the I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from .prices import DAY_MS
from .report import HOUR_MS, UsageQuery, answer
from .store import TOKEN_COLUMNS, LedgerRow

__all__ = ["NANO", "QUEUE_BUCKETS_MS", "FleetUsage", "spend_key", "usage_key"]

NANO = 1_000_000_000
"""Nano-dollars in a dollar: the unit costs are added up in, in Redis."""

QUEUE_BUCKETS_MS = (0, 10, 100, 1_000, 5_000, 30_000, 120_000, 600_000)
"""Upper bounds of the queue-wait histogram (a last bucket holds the longer waits)."""
_SEP = "\x1f"
_COUNTS = ("requests", "errors", *TOKEN_COLUMNS, "unknown_usage", "cost_nusd", "unpriced")
_MAX_QUEUE = "max:queue_ms"
_MAX_HOURS = 24 * 400


def usage_key(prefix: str, provider: str, hour_ms: int) -> str:
    """One provider's hour, under the provider's hash tag (a Redis Cluster keeps it on that provider's node)."""
    return f"{{{prefix}:{provider}}}:usage:{hour_ms}"


def spend_key(prefix: str, provider: str, day_ms: int) -> str:
    """One provider's spend per workspace on one UTC day (its start, epoch ms), in nano-dollars."""
    return f"{{{prefix}:{provider}}}:spend:{day_ms}"


class FleetUsage:
    """What this replica has added since its last write, by provider and hour (and its spend, by day)."""

    def __init__(self, prefix: str, retention: float) -> None:
        self.prefix = prefix
        self.retention_ms = int(retention * 1000)
        self._pending: dict[tuple[str, int], dict[str, int]] = {}
        self._spent: dict[tuple[str, int], dict[str, int]] = {}

    def add(self, row: LedgerRow) -> None:
        hour = row.ended_at // HOUR_MS * HOUR_MS
        fields = self._pending.get((row.provider, hour))
        if fields is None:
            fields = self._pending[(row.provider, hour)] = defaultdict(int)
        group = _SEP.join((row.key or "", row.model or "", row.workspace))
        fields["requests" + _SEP + group] += 1
        if row.status >= 400 or row.outcome != "ok":
            fields["errors" + _SEP + group] += 1
        if row.input_tokens is None:
            if row.outcome == "ok" and 200 <= row.status <= 299:
                fields["unknown_usage" + _SEP + group] += 1
        else:
            for name in TOKEN_COLUMNS:
                value = getattr(row, name)
                if value:
                    fields[name + _SEP + group] += value
            cost = row.cost_usd
            if cost is None:
                fields["unpriced" + _SEP + group] += 1
            elif cost > 0:
                nano = round(cost * NANO)
                fields["cost_nusd" + _SEP + group] += nano
                day = row.ended_at // DAY_MS * DAY_MS
                spent = self._spent.get((row.provider, day))
                if spent is None:
                    spent = self._spent[(row.provider, day)] = defaultdict(int)
                spent[row.workspace] += nano
        fields[f"q{_bucket(row.queue_ms)}{_SEP}{group}"] += 1
        queue_max = _MAX_QUEUE + _SEP + group
        fields[queue_max] = max(fields.get(queue_max, 0), row.queue_ms)

    def take(self) -> list[tuple[str, list[Any]]]:
        """The writes to send now (``USAGE_ADD``'s key and arguments), forgetting them here."""
        pending, self._pending = self._pending, {}
        writes = []
        for (provider, hour), fields in pending.items():
            args: list[Any] = [hour + HOUR_MS + self.retention_ms]
            for name, amount in fields.items():
                args += [name, amount]
            writes.append((usage_key(self.prefix, provider, hour), args))
        spent, self._spent = self._spent, {}
        for (provider, day), workspaces in spent.items():
            args = [day + 2 * DAY_MS]
            for workspace, nano in workspaces.items():
                args += [workspace, nano]
            writes.append((spend_key(self.prefix, provider, day), args))
        return writes

    @staticmethod
    def day_spend(hashes: Iterable[Mapping[str, str]]) -> dict[str, float]:
        """The day's spend per workspace in dollars, from each provider's day hash."""
        totals: dict[str, int] = defaultdict(int)
        for fields in hashes:
            for workspace, nano in fields.items():
                totals[workspace] += int(nano)
        return {workspace: nano / NANO for workspace, nano in totals.items()}

    def keys(self, query: UsageQuery, providers: Iterable[str]) -> list[tuple[str, str, int]]:
        """The hashes a query reads: (key, provider, hour) for each provider and hour it spans."""
        wanted = [query.filters["provider"]] if "provider" in query.filters else list(providers)
        first = query.since // HOUR_MS * HOUR_MS
        hours = range(first, query.until + 1, HOUR_MS)
        if len(hours) > _MAX_HOURS:
            hours = hours[-_MAX_HOURS:]
        return [(usage_key(self.prefix, provider, hour), provider, hour) for provider in wanted for hour in hours]

    @staticmethod
    def answer(query: UsageQuery, hashes: Iterable[tuple[str, int, Mapping[str, str]]]) -> dict[str, Any]:
        """The answer, from each (provider, hour, hash) read: whole hours overlapping the query's span."""
        groups: dict[tuple[Any, ...], dict[str, int]] = {}
        for provider, hour, fields in hashes:
            for raw_name, raw_value in fields.items():
                metric, key, model, workspace = _fields(raw_name)
                if metric is None or not _matches(query, provider, model, workspace):
                    continue
                values = {"provider": provider, "key": key or None, "model": model or None,
                          "workspace": workspace, "hour": hour}
                group = tuple(values[name] for name in query.by)
                totals = groups.setdefault(group, defaultdict(int))
                amount = int(raw_value)
                if metric == _MAX_QUEUE:
                    totals[metric] = max(totals[metric], amount)
                else:
                    totals[metric] += amount
        totals_rows, medians = [], []
        for group, totals in groups.items():
            totals_rows.append((*group, totals["requests"], totals["errors"],
                                *(totals[name] for name in TOKEN_COLUMNS), totals["unknown_usage"],
                                totals[_MAX_QUEUE], totals["cost_nusd"] / NANO, totals["unpriced"]))
            medians.append((*group, _median(totals)))
        return answer(query, totals_rows, medians, "fleet")


def _bucket(queue_ms: int) -> int:
    for index, bound in enumerate(QUEUE_BUCKETS_MS):
        if queue_ms <= bound:
            return index
    return len(QUEUE_BUCKETS_MS)


def _median(totals: Mapping[str, int]) -> int:
    """The upper bound of the bucket holding the median wait (the longest wait for the last bucket)."""
    half = (totals.get("requests", 0) + 1) // 2
    seen = 0
    for index in range(len(QUEUE_BUCKETS_MS) + 1):
        seen += totals.get(f"q{index}", 0)
        if seen >= half > 0:
            return QUEUE_BUCKETS_MS[index] if index < len(QUEUE_BUCKETS_MS) else totals.get(_MAX_QUEUE, 0)
    return 0


def _fields(raw: str) -> tuple[str | None, str, str, str]:
    parts = raw.split(_SEP)
    if len(parts) != 4:
        return None, "", "", ""
    return parts[0], parts[1], parts[2], parts[3]


def _matches(query: UsageQuery, provider: str, model: str, workspace: str) -> bool:
    filters = query.filters
    return (filters.get("provider", provider) == provider and filters.get("model", model) == model
            and filters.get("workspace", workspace) == workspace)
