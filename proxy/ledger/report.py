"""``GET /_slotproxy/usage``: what was spent, grouped and filtered, from the ledger (or, with Redis, the fleet's
hourly aggregates).

Pure: the query's parameters are validated here (a bad one raises ``AdminError``
naming it, answered 400), turned into one SQL statement for the ledger, and the
rows into the answer's shape. Nothing here touches a database.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AdminError
from .store import TOKEN_COLUMNS

__all__ = ["GROUPS", "REPLICA_ONLY", "UsageQuery", "answer", "format_usage", "parse_query", "queue_median_sql",
           "totals_sql"]

GROUPS = ("provider", "key", "model", "workspace", "conversation", "hour", "status", "outcome")
REPLICA_ONLY = frozenset({"conversation", "status", "outcome"})
"""What the fleet's hourly aggregates leave out: a query naming one is answered from each replica's own ledger."""
FILTERS = ("provider", "workspace", "model")
DEFAULT_SPAN_MS = 24 * 3600 * 1000
HOUR_MS = 3600 * 1000
_AGO = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_MAX_FILTER = 256
_MAX_EPOCH_MS = 1 << 47
_KNOWN = frozenset({"since", "until", "by", *FILTERS})
_ERROR = "(status >= 400 OR outcome != 'ok')"
_UNKNOWN = "(outcome = 'ok' AND status BETWEEN 200 AND 299 AND input_tokens IS NULL)"
_UNPRICED = "(input_tokens IS NOT NULL AND cost_usd IS NULL)"
"""A request whose usage was read but whose model has no known price."""


@dataclass(frozen=True, slots=True)
class UsageQuery:
    since: int
    until: int
    by: tuple[str, ...] = ("workspace",)
    filters: Mapping[str, str] = field(default_factory=dict)

    @property
    def per_replica(self) -> bool:
        return not REPLICA_ONLY.isdisjoint(self.by) or not REPLICA_ONLY.isdisjoint(self.filters)


def parse_query(params: Mapping[str, str], now_ms: int | None = None) -> UsageQuery:
    """The query string of ``/usage``; ``AdminError`` (400) naming the first bad parameter."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise AdminError(f"unknown parameter {unknown[0]!r}; the parameters are since, until, by, "
                         f"{', '.join(FILTERS)}")
    until = _instant(params.get("until"), "until", now_ms, now_ms)
    since = _instant(params.get("since"), "since", now_ms, until - DEFAULT_SPAN_MS)
    if since > until:
        raise AdminError(f"since ({since}) is after until ({until}): since must come first")
    by = _groups(params.get("by"))
    filters = {name: _filter(name, params[name]) for name in FILTERS if name in params}
    return UsageQuery(since=since, until=until, by=by, filters=filters)


def _instant(raw: str | None, name: str, now_ms: int, default: int) -> int:
    """Epoch ms, or a duration ago (``5h``, ``30m``, ``2d``)."""
    if raw is None or raw == "":
        return default
    value = raw.strip()
    if value.isdigit():
        number = int(value)
        if number >= _MAX_EPOCH_MS:
            raise AdminError(f"{name} must be epoch milliseconds or a duration ago such as 5h, got {raw[:40]!r}")
        return number
    match = _AGO.match(value)
    if match is None:
        raise AdminError(f"{name} must be epoch milliseconds or a duration ago such as 5h, got {raw[:40]!r}")
    return now_ms - int(float(match.group(1)) * _UNIT_MS[match.group(2)])


def _groups(raw: str | None) -> tuple[str, ...]:
    if raw is None or raw.strip() == "":
        return ("workspace",)
    names = [part.strip() for part in raw.split(",")]
    for name in names:
        if name not in GROUPS:
            raise AdminError(f"by: {name[:40]!r} is not a field to group by; choose among {', '.join(GROUPS)}")
    if len(set(names)) != len(names):
        raise AdminError("by: a field is named twice")
    return tuple(names)


def _filter(name: str, value: str) -> str:
    if not value or len(value) > _MAX_FILTER:
        raise AdminError(f"{name} must be a non-empty value of at most {_MAX_FILTER} characters")
    return value


def _where(query: UsageQuery) -> tuple[str, list[Any]]:
    clauses = ["ended_at >= ?", "ended_at <= ?"]
    parameters: list[Any] = [query.since, query.until]
    for name, value in query.filters.items():
        clauses.append(f"{name} = ?")
        parameters.append(value)
    return " AND ".join(clauses), parameters


def _selected(by: Sequence[str]) -> list[str]:
    return [f"(ended_at / {HOUR_MS}) * {HOUR_MS}" if name == "hour" else name for name in by]


def totals_sql(query: UsageQuery) -> tuple[str, list[Any]]:
    """Per group: requests, errors, the token sums, unknown usage, the longest queue wait, the cost and the
    requests left unpriced."""
    where, parameters = _where(query)
    groups = _selected(query.by)
    sums = ", ".join(f"COALESCE(SUM({name}), 0)" for name in TOKEN_COLUMNS)
    sql = (f"SELECT {', '.join(groups)}, COUNT(*), SUM(CASE WHEN {_ERROR} THEN 1 ELSE 0 END), {sums}, "
           f"SUM(CASE WHEN {_UNKNOWN} THEN 1 ELSE 0 END), MAX(queue_ms), COALESCE(SUM(cost_usd), 0), "
           f"SUM(CASE WHEN {_UNPRICED} THEN 1 ELSE 0 END) FROM requests WHERE {where} "
           f"GROUP BY {', '.join(groups)}")
    return sql, parameters


def queue_median_sql(query: UsageQuery) -> tuple[str, list[Any]]:
    """Per group: the median queue wait (the lower middle value, as a nearest-rank p50)."""
    where, parameters = _where(query)
    groups = _selected(query.by)
    keys = ", ".join(f"{expression} AS g{index}" for index, expression in enumerate(groups))
    named = ", ".join(f"g{index}" for index in range(len(groups)))
    sql = (f"SELECT {named}, queue_ms FROM (SELECT {named}, queue_ms, "
           f"ROW_NUMBER() OVER (PARTITION BY {named} ORDER BY queue_ms) AS rank, "
           f"COUNT(*) OVER (PARTITION BY {named}) AS total "
           f"FROM (SELECT {keys}, queue_ms FROM requests WHERE {where})) WHERE rank = (total + 1) / 2")
    return sql, parameters


def answer(query: UsageQuery, totals: Iterable[Sequence[Any]], medians: Iterable[Sequence[Any]],
           scope: str) -> dict[str, Any]:
    """The answer's document: rows sorted by input + output tokens, largest first."""
    width = len(query.by)
    median = {tuple(row[:width]): row[width] for row in medians}
    rows = []
    for row in totals:
        group = tuple(row[:width])
        requests, errors, *tokens, unknown, queue_max, cost, unpriced = row[width:]
        entry: dict[str, Any] = dict(zip(query.by, group, strict=True))
        entry.update({"requests": requests, "errors": errors or 0})
        entry.update(zip(TOKEN_COLUMNS, (int(value or 0) for value in tokens), strict=True))
        entry.update({"unknown_usage": unknown or 0, "queue_ms_p50": median.get(group, 0) or 0,
                      "queue_ms_max": queue_max or 0, "cost_usd": round(cost or 0.0, 6), "unpriced": unpriced or 0})
        rows.append(entry)
    rows.sort(key=lambda entry: (entry["input_tokens"] + entry["output_tokens"], entry["requests"]), reverse=True)
    return {"since": query.since, "until": query.until, "by": list(query.by), "scope": scope, "rows": rows}


_COUNTED = ("requests", "errors", "input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens",
            "reasoning_tokens", "unknown_usage", "unpriced")
_HEAD = ("REQUESTS", "ERRORS", "INPUT", "CACHED", "CACHE WRITE", "OUTPUT", "REASONING", "UNKNOWN", "UNPRICED",
         "COST", "QUEUE P50", "QUEUE MAX")


def format_usage(document: Mapping[str, Any]) -> str:
    """The answer as a table (``slotproxy usage``): the groups, then requests, errors, tokens, cost and waits,
    and a line of totals (the median wait of all the rows is not theirs to add up: it is left blank)."""
    by = [str(name) for name in document.get("by", [])]
    rows = document.get("rows", [])
    head = [name.upper() for name in by] + list(_HEAD)
    body = [[_cell(row.get(name), name) for name in by] + [str(row.get(name, 0)) for name in _COUNTED]
            + [_dollars(row.get("cost_usd")), f"{row.get('queue_ms_p50', 0)} ms", f"{row.get('queue_ms_max', 0)} ms"]
            for row in rows]
    if rows:
        body.append(["TOTAL"] + [""] * (len(by) - 1)
                    + [str(sum(int(row.get(name) or 0) for row in rows)) for name in _COUNTED]
                    + [_dollars(sum(float(row.get("cost_usd") or 0) for row in rows)),
                       "", f"{max(int(row.get('queue_ms_max') or 0) for row in rows)} ms"])
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
             for line in [head, *body]]
    if not body:
        lines.append("(no requests in this span)")
    scope = "the whole fleet" if document.get("scope") == "fleet" else "this replica's ledger"
    lines.append(f"{_clock(document.get('since'))} to {_clock(document.get('until'))}, from {scope}")
    if document.get("ledger"):
        lines.append(f"ledger: {document['ledger']}")
    return "\n".join(lines)


def _dollars(value: object) -> str:
    """``$12.34``; below a cent, to the millionth: ``$0.004125``."""
    amount = float(value) if isinstance(value, (int, float)) else 0.0
    return f"${amount:,.2f}" if amount >= 0.01 or amount == 0 else f"${amount:.6f}"


def _cell(value: object, name: str) -> str:
    if value is None:
        return "-"
    if name == "hour" and isinstance(value, int):
        return _clock(value)
    return str(value)


def _clock(epoch_ms: object) -> str:
    if not isinstance(epoch_ms, int):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch_ms / 1000))
