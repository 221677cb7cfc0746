"""The status document that ``GET /_slotproxy/status``, ``slotproxy status`` and the dashboard read."""

from __future__ import annotations

from typing import Any

from ..runtime import ProxyState

__all__ = ["status_document"]


def status_document(state: ProxyState) -> dict[str, Any]:
    """Every provider's status from one backend snapshot; with Redis, ``await backend.refresh()`` first."""
    return {
        "providers": [status.to_dict() for status in state.backend.statistics()],
        "backend": state.backend.backend_status(),
        "config": {
            "path": state.config_path,
            "loaded_at": int(state.loaded_at * 1000),
            "error": state.config_error,
        },
    }
