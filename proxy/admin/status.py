"""The status document that ``GET /_slotproxy/status``, ``slotproxy status`` and the dashboard read."""

from __future__ import annotations

from typing import Any

from ..http.runtime import ProxyState
from ..http.state import LimitLevelId, ManualLimits
from ..limiter import ProviderStatus

__all__ = ["provider_document", "status_document"]


def status_document(state: ProxyState) -> dict[str, Any]:
    """Every provider's status from one backend snapshot; with Redis, ``await backend.refresh()`` first."""
    return {
        "providers": [provider_document(state, status) for status in state.backend.statistics()],
        "backend": state.backend.backend_status(),
        "spend": state.spend.document(),
        "config": {
            "path": state.config_path,
            "loaded_at": int(state.loaded_at * 1000),
            "error": state.config_error,
            "missing_since": None if state.config_missing_since is None else int(state.config_missing_since * 1000),
        },
    }


def provider_document(state: ProxyState, status: ProviderStatus) -> dict[str, Any]:
    """One provider's object in the status document (also what an admin write answers with).

    ``relayed_429`` and ``websockets`` are this replica's: the 429s it relayed to clients (the retries ran
    out, or there were none), the sockets open through it."""
    name = status.provider
    document = {**status.to_dict(), "websockets": state.open_sockets.count(name),
                "relayed_429": state.backend.backoffs.relayed_total(name)}
    manual = state.manual_limits
    _mark_manual(document, manual, (name, "provider", ""))
    for key in document["keys"]:
        _mark_manual(key, manual, (name, "key", key["name"]))
    for model in document["models"]:
        _mark_manual(model, manual, (name, "model", model["pattern"]))
    windowing = state.windowing(name)
    if windowing is not None:
        for owner in (document, *document["keys"]):
            for window in owner.get("windows") or ():
                windowing.status(window)
    return document


def _mark_manual(entry: dict[str, Any], manual: ManualLimits, level: LimitLevelId) -> None:
    """``manual``: the limit was set by hand (admin API or dashboard) and differs from the configured one;
    ``manual_set_at``: when (epoch ms), else null."""
    mark = manual.get(level)
    holds = mark is not None and mark.holds(entry["limit"], entry["configured_limit"], entry.get("auto_reduced_from"))
    entry["manual"] = holds
    entry["manual_set_at"] = mark.set_at if holds and mark is not None else None
