"""A provider's shared state as status shows it: the STATS script's answer decoded into a ``ProviderStatus``
(and, before Redis has answered, the settings alone); limits as the scripts write them."""

from __future__ import annotations

import json
from typing import Any

from ...limiter import (
    Budget,
    HolderStatus,
    KeyStatus,
    LimiterSettings,
    ModelStatus,
    ProviderStatus,
    WaiterStatus,
    policy,
)
from .client import text

__all__ = ["limit_arg", "limit_value", "status_from", "unread_status"]

_TRANSPORTS = {"ws": "websocket"}
"""A waiter's transport as the scripts keep it: absent for HTTP (most waiters), ``ws`` for a WebSocket."""


def status_from(provider: str, result: list[Any], settings: LimiterSettings, reclaims: int) -> ProviderStatus:
    """A provider's STATS answer as its status."""
    raw, leases, cooling, queued, now_ms, infos, levels, pause_end, held, window_rows = result
    cfg = _pairs(raw)
    now = int(text(now_ms))
    paused_until = int(text(pause_end))
    auto_from = cfg.get("auto_reduced_from")
    queue = []
    for item in infos:
        info = _json(item)
        queue.append(WaiterStatus(workspace=info["w"], starred=bool(info["starred"]),
                                  prompt_started_at=int(info["p"]), waited_ms=now - int(info["t"]),
                                  conversation=info["c"] or None,
                                  transport=_TRANSPORTS.get(info.get("tr", ""), "http")))
    counters = {name: int(cfg.get(name, "0") or 0) for name in policy.COUNTERS}
    counters["reclaims"] = reclaims
    by_level = {text(lid): (_pairs(pairs), int(count)) for lid, pairs, count in levels}
    for fields, _ in by_level.values():
        for name in ("backoffs", "auto_reductions"):
            counters[name] += int(fields.get(name, "0") or 0)
    windows = _windows(window_rows) if settings.windows is not None else None
    keys = tuple(_key_status(key.name, key.name in {k.name for k in settings.pool()},
                             *by_level.get(f"k:{key.name}", ({}, 0)), now, settings.budgets,
                             None if windows is None else windows.get(key.name, ()))
                 for key in settings.keys)
    models = []
    for cap in settings.models:
        fields, count = by_level.get(f"m:{cap.pattern}", ({}, 0))
        models.append(ModelStatus(cap.pattern, limit_value(fields.get("limit")),
                                  limit_value(fields.get("configured_limit")), count))
    return ProviderStatus(
        provider=provider,
        limit=limit_value(cfg.get("limit")),
        configured_limit=limit_value(cfg.get("configured_limit")),
        in_flight=int(leases) + int(cooling),
        queued=int(queued),
        paused=paused_until > now,
        paused_until=paused_until if paused_until > now else None,
        cooldown_ms=int(cfg.get("cooldown_ms", "0") or 0),
        auto_reduced=auto_from is not None,
        auto_reduced_from=int(auto_from) if auto_from is not None else None,
        notice=cfg.get("notice"),
        queue=tuple(queue),
        counters=counters,
        keys=keys,
        models=tuple(models),
        budget=_budget_status(cfg, now) if settings.budgets and not settings.pool() else None,
        holders=tuple(_holder(_json(item), now) for item in held),
        windows=windows.get("", ()) if windows is not None and not settings.pool() else None,
    )


def unread_status(provider: str, settings: LimiterSettings, local_in_flight: int) -> ProviderStatus:
    """Before Redis answered (or while it does not): the settings, and this replica's own slots."""
    windows = None if settings.windows is None else ()
    keys = tuple(_key_status(key.name, key.available, {"limit": limit_arg(key.limit),
                                                       "configured_limit": limit_arg(key.limit)},
                             0, 0, settings.budgets, windows) for key in settings.keys)
    models = tuple(ModelStatus(cap.pattern, cap.limit, cap.limit, 0) for cap in settings.models)
    return ProviderStatus(provider=provider, limit=settings.limit, configured_limit=settings.limit,
                          in_flight=local_in_flight, queued=0, paused=False,
                          paused_until=None, cooldown_ms=int(settings.release_cooldown * 1000),
                          auto_reduced=False, auto_reduced_from=None, notice=None, keys=keys, models=models,
                          windows=windows if not settings.pool() else None)


def _pairs(raw: list[Any]) -> dict[str, str]:
    return {text(raw[i]): text(raw[i + 1]) for i in range(0, len(raw), 2)}


def _blocked(fields: dict[str, str], name: str, now: int) -> int | None:
    value = int(fields.get(name, "0") or 0)
    return value if value > now else None


def _budget_status(fields: dict[str, str], now: int) -> dict[str, int | None]:
    """A level's budget as status shows it (``Budget.to_dict``, as the memory backend gives it)."""
    budget = Budget()
    raw = fields.get("budget")
    if raw:
        remaining_requests, remaining_tokens, reset = json.loads(raw)
        budget = Budget(remaining_requests=remaining_requests, remaining_tokens=remaining_tokens,
                        reset_at=int(reset) / 1000 if reset not in ("", None) else None)
    held = _blocked(fields, "held_until", now)
    return budget.to_dict(None if held is None else held / 1000)


def _windows(raw: Any) -> dict[str, tuple[dict[str, Any], ...]]:
    """The window rows of STATS by key ('' for the provider's own), as ``WindowBook.status`` gives them."""
    decoded = json.loads(text(raw) or "[]")
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in decoded if isinstance(decoded, list) else ():
        by_key.setdefault(row["k"], []).append({
            "group": row["g"], "window": row["w"], "limit": row.get("limit"), "source": row.get("source"),
            "available": int(row["available"]), "reserved": int(row["reserved"]), "held": int(row["held"]),
            "held_total": int(row["held_total"]), "hits": int(row["hits"]), "ratio": None,
            "estimate_error_p50": None, "estimate_error_p90": None})
    return {key: tuple(rows) for key, rows in by_key.items()}


def _key_status(name: str, available: bool, fields: dict[str, str], count: int, now: int,
                budgets: bool, windows: tuple[dict[str, Any], ...] | None = None) -> KeyStatus:
    auto_from = fields.get("auto_reduced_from")
    return KeyStatus(
        name=name,
        available=available,
        limit=limit_value(fields.get("limit")),
        configured_limit=limit_value(fields.get("configured_limit")),
        in_flight=count,
        paused_until=_blocked(fields, "paused_until", now),
        auto_reduced_from=int(auto_from) if auto_from is not None else None,
        notice=fields.get("notice"),
        budget=_budget_status(fields, now) if budgets else None,
        windows=windows,
    )


def _holder(info: dict[str, Any], now: int) -> HolderStatus:
    """A lease's ``lmap`` entry as a status row (a lease put back after Redis lost its data has no entry)."""
    granted_at = int(info.get("t") or now)
    return HolderStatus(workspace=info.get("w") or "default", starred=bool(info.get("s")),
                        conversation=info.get("c") or None, model=info.get("md") or None, key=info.get("k") or None,
                        transport=_TRANSPORTS.get(info.get("tr") or "", "http"), granted_at=granted_at,
                        held_ms=max(0, now - granted_at))


def limit_arg(limit: int | None) -> str:
    return "none" if limit is None else str(limit)


def limit_value(raw: str | None) -> int | None:
    if raw is None or raw in ("", "none"):
        return None
    return int(raw)


def _json(value: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(text(value))
    return data

