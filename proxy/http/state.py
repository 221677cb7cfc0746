"""Runtime state that survives restarts: manual limits, auto-reductions, cooldowns, stars.

Written atomically (temp file, fsync, rename) after every change, so a kill -9 at
any moment leaves either the old file or the new one, never a torn one. A file
that cannot be read is renamed aside (never silently overwritten) and the proxy
starts from the YAML alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["MAX_RUNTIME_STARS", "STATE_VERSION", "LimitLevelId", "ManualLimit", "ManualLimits", "StarOverrides", "StateStore",
           "StateWriter", "TooManyStars"]

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


MAX_RUNTIME_STARS = 10_000
"""Workspaces the admin API may star beyond the YAML's: each is kept in the state file."""


class TooManyStars(ValueError):
    """Starring one more workspace at runtime would pass ``MAX_RUNTIME_STARS``."""


class StarOverrides:
    """Stars set at runtime (admin API) over the YAML's ``workspaces.starred``.

    Only what differs from the YAML is kept: unstarring a workspace the YAML does not
    star forgets it, so the state file does not grow with star/unstar pairs.
    """

    def __init__(self) -> None:
        self._overrides: dict[str, bool] = {}

    def load(self, raw: object, yaml_starred: tuple[str, ...]) -> None:
        """Overrides from a state file, without unstars of workspaces the YAML does not star, capped."""
        self._overrides = {}
        if not isinstance(raw, dict):
            return
        starred = 0
        for workspace, value in raw.items():
            name, on = str(workspace), bool(value)
            if not on and name not in yaml_starred:
                continue
            if on:
                if starred >= MAX_RUNTIME_STARS:
                    continue
                starred += 1
            self._overrides[name] = on

    def effective(self, yaml_starred: tuple[str, ...]) -> frozenset[str]:
        from_yaml = {w for w in yaml_starred if self._overrides.get(w, True)}
        return frozenset(from_yaml | {w for w, on in self._overrides.items() if on})

    def set(self, workspace: str, starred: bool, yaml_starred: tuple[str, ...]) -> None:
        if starred:
            if not self._overrides.get(workspace) and self.runtime_stars() >= MAX_RUNTIME_STARS:
                raise TooManyStars(f"at most {MAX_RUNTIME_STARS} workspaces can be starred through the admin API; "
                                   "unstar some, or star them in the YAML (workspaces.starred)")
            self._overrides[workspace] = True
        elif workspace in yaml_starred:
            self._overrides[workspace] = False
        else:
            self._overrides.pop(workspace, None)

    def runtime_stars(self) -> int:
        return sum(1 for on in self._overrides.values() if on)

    def yaml_changed(self, before: tuple[str, ...], after: tuple[str, ...]) -> None:
        """A YAML edit of a workspace's star is a manual act: it wins over the admin API's override."""
        for workspace in set(before) ^ set(after):
            self._overrides.pop(workspace, None)

    def as_dict(self) -> dict[str, bool]:
        return dict(self._overrides)


LimitLevelId = tuple[str, Literal["provider", "key", "model"], str]
"""A limit the admin API can set: (provider, kind, name); the provider's own has the name ``""``."""

_KINDS: dict[str, Literal["key", "model"]] = {"keys": "key", "models": "model"}


@dataclass(frozen=True, slots=True)
class ManualLimit:
    """A limit set by hand: the value, when (epoch ms), and the configured value it was set over."""

    limit: int | None
    set_at: int
    configured: int | None

    def holds(self, limit: int | None, configured: int | None, auto_reduced_from: int | None) -> bool:
        """Still in force: set over today's configured value (a YAML edit since wins) and still the limit,
        or the limit an auto-reduction came down from."""
        return configured == self.configured and self.limit in (limit, auto_reduced_from)

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "set_at": self.set_at, "configured": self.configured}


class ManualLimits:
    """The limits set through the admin API that differ from the configured ones, kept in the state file
    so that after a restart status still says which limits were set by hand, and when."""

    def __init__(self) -> None:
        self._marks: dict[LimitLevelId, ManualLimit] = {}

    def set(self, level: LimitLevelId, limit: int | None, configured: int | None, now_ms: int) -> None:
        """A limit set by hand; one equal to the configured value is a restore, and forgets the mark."""
        if limit == configured:
            self._marks.pop(level, None)
        else:
            self._marks[level] = ManualLimit(limit, now_ms, configured)

    def clear(self, level: LimitLevelId) -> None:
        self._marks.pop(level, None)

    def get(self, level: LimitLevelId) -> ManualLimit | None:
        return self._marks.get(level)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """``{provider: {"limit": mark, "keys": {name: mark}, "models": {pattern: mark}}}``."""
        document: dict[str, dict[str, Any]] = {}
        for (provider, kind, name), mark in self._marks.items():
            entry = document.setdefault(provider, {})
            if kind == "provider":
                entry["limit"] = mark.to_dict()
            else:
                entry.setdefault(f"{kind}s", {})[name] = mark.to_dict()
        return document

    def load(self, raw: object) -> None:
        """Marks from a state file; an entry of the wrong shape is skipped."""
        self._marks = {}
        if not isinstance(raw, dict):
            return
        for provider, entry in raw.items():
            if not isinstance(entry, dict):
                continue
            self._load_one((str(provider), "provider", ""), entry.get("limit"))
            for field_name, kind in _KINDS.items():
                named = entry.get(field_name)
                if isinstance(named, dict):
                    for name, mark in named.items():
                        self._load_one((str(provider), kind, str(name)), mark)

    def _load_one(self, level: LimitLevelId, raw: object) -> None:
        if not isinstance(raw, dict):
            return
        limit, set_at, configured = raw.get("limit"), raw.get("set_at"), raw.get("configured")
        if all(value is None or (isinstance(value, int) and not isinstance(value, bool))
               for value in (limit, configured)) and isinstance(set_at, int):
            self._marks[level] = ManualLimit(limit, set_at, configured)


class StateWriter:
    """Writes the state file after changes, a burst of them coalesced into one write per loop turn."""

    def __init__(self, store: StateStore, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self._snapshot = snapshot
        self._pending = False

    def schedule(self) -> None:
        if self.store.path is None or self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.save()
            return
        self._pending = True
        loop.call_soon(self.save)

    def save(self) -> None:
        self._pending = False
        self.store.save(self._snapshot())
