"""Runtime state that survives restarts: manual limits, auto-reductions, cooldowns, stars.

Written atomically (temp file, fsync, rename) after every change, so a kill -9 at
any moment leaves either the old file or the new one, never a torn one. A file
that cannot be read is renamed aside (never silently overwritten) and the proxy
starts from the YAML alone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["STATE_VERSION", "StateStore"]

log = logging.getLogger("slotproxy.state")

STATE_VERSION = 1


def _shape_problem(data: object) -> str | None:
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        return f"not a version-{STATE_VERSION} slotproxy state object"
    if not isinstance(data.get("providers", {}), dict):
        return "'providers' is not an object"
    return None


class StateStore:
    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self.writes = 0

    def load(self) -> dict[str, Any] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            problem = _shape_problem(data)
            if problem is not None:
                raise ValueError(problem)
        except (OSError, ValueError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                self.path.replace(aside)
            except OSError:
                aside = self.path
            log.error("state file %s is unreadable (%s); set aside as %s, starting from the YAML config",
                      self.path, exc, aside)
            return None
        return data

    def save(self, data: dict[str, Any]) -> None:
        if self.path is None:
            return
        document = {"version": STATE_VERSION, "written_at": int(time.time() * 1000), **data}
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(temp, "w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path)
            self.writes += 1
        except OSError as exc:
            log.error("could not write the state file %s: %s", self.path, exc)
