"""The status document that ``GET /_slotproxy/status``, ``slotproxy status`` and the dashboard read."""

from __future__ import annotations

from typing import Any

from ..http.runtime import ProxyState
from ..limiter import ProviderStatus

__all__ = ["provider_document", "status_document"]


def status_document(state: ProxyState) -> dict[str, Any]:
    """Every provider's status from one backend snapshot; with Redis, ``await backend.refresh()`` first."""
    return {
        "providers": [provider_document(state, status) for status in state.backend.statistics()],
        "backend": state.backend.backend_status(),
        "config": {
            "path": state.config_path,
            "loaded_at": int(state.loaded_at * 1000),
            "error": state.config_error,
            "missing_since": None if state.config_missing_since is None else int(state.config_missing_since * 1000),
        },
    }


def provider_document(state: ProxyState, status: ProviderStatus) -> dict[str, Any]:
    """One provider's object in the status document (also what an admin write answers with)."""
    return {**status.to_dict(), "websockets": state.open_sockets.count(status.provider)}
