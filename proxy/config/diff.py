"""What a reload changed: a compact diff of two effective configs, for the reload's log line.

Pure: two validated configs in, one short phrase per change out, such as
``openai.limit 8 → 3``, ``anthropic.models["claude-opus-*"].limit 2 → 1`` or
``providers added: gemini``. The effective config is compared (each provider with
every setting resolved, as ``check`` prints it), and values are shown as ``check``
shows them: a value ``check`` masks is never printed, only that it changed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from .model import Config

__all__ = ["config_changes", "describe_changes"]

_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLAIN_NAME = re.compile(r"[^\s,\"]+\Z")

# One change: the path as its pieces (the first bare, then ".field" or '["name"]'), its phrase, and the
# (old, new) it shows, which a provider's change is matched against ``defaults``' by.
_Change = tuple[tuple[str, ...], str, tuple[str, str] | None]


def config_changes(old: Config, new: Config) -> list[str]:
    """Every effective difference from ``old`` to ``new``, in config order; empty when there is none.

    A provider setting that changed only because it inherits a changed ``defaults`` value is said once,
    as the ``defaults`` change.
    """
    raw_old, raw_new = _effective(old), _effective(new)
    shown_old, shown_new = old.masked(), new.masked()
    changes: list[str] = []
    inherited: set[tuple[tuple[str, ...], tuple[str, str] | None]] = set()
    for section in _keys(raw_new, raw_old):
        if section not in raw_old or section not in raw_new:  # a section every config has; never expected
            continue
        if section == "providers":
            for path, text, values in _providers(raw_old[section], raw_new[section], shown_old[section],
                                                 shown_new[section]):
                if len(path) > 1 and (path[1:], values) in inherited:
                    continue
                changes.append(text)
            continue
        for path, text, values in _walk((section,), raw_old[section], raw_new[section], shown_old[section],
                                        shown_new[section]):
            if section == "defaults":
                inherited.add((path[1:], values))
            changes.append(text)
    return changes


def describe_changes(changes: Sequence[str], limit: int = 20) -> str:
    """The changes as one phrase for a log line: ``no effective change`` when there are none, and at most
    ``limit`` of them, then how many more."""
    if not changes:
        return "no effective change"
    shown = ", ".join(changes[:limit])
    return shown if len(changes) <= limit else f"{shown} and {len(changes) - limit} more"


def _effective(config: Config) -> dict[str, Any]:
    """The config ``masked()`` shows, unmasked: its shape is the same, value for value."""
    data = config.model_dump(mode="json")
    data["providers"] = {name: config.provider(name).model_dump(mode="json", exclude={"name"})
                         for name in config.provider_names()}
    return data


def _providers(raw_old: dict[str, Any], raw_new: dict[str, Any], old: dict[str, Any],
               new: dict[str, Any]) -> Iterator[_Change]:
    for name, settings in raw_new.items():
        if name in raw_old:
            yield from _walk((name,), raw_old[name], settings, old[name], new[name])
    yield from _added_removed(("providers",), list(raw_old), list(raw_new))


def _walk(path: tuple[str, ...], raw_old: Any, raw_new: Any, old: Any, new: Any) -> Iterator[_Change]:
    if raw_old == raw_new:
        return
    if isinstance(raw_old, dict) and isinstance(raw_new, dict):
        for key in raw_new:
            if key in raw_old:
                yield from _walk((*path, _segment(key)), raw_old[key], raw_new[key], old[key], new[key])
        yield from _added_removed(path, list(raw_old), list(raw_new))
        return
    if _named(raw_old) and _named(raw_new):
        old_by_name = {item["name"]: index for index, item in enumerate(raw_old)}
        new_by_name = {item["name"]: index for index, item in enumerate(raw_new)}
        for name, index in new_by_name.items():
            if name in old_by_name:
                was = old_by_name[name]
                yield from _walk((*path, f"[{json.dumps(name)}]"), raw_old[was], raw_new[index], old[was],
                                 new[index])
        yield from _added_removed(path, list(old_by_name), list(new_by_name))
        return
    shown_old, shown_new = _show(old), _show(new)
    if shown_old == shown_new:  # only a masked part changed: say so, never what it is
        yield path, f"{''.join(path)} changed", None
    else:
        yield path, f"{''.join(path)} {shown_old} → {shown_new}", (shown_old, shown_new)


def _added_removed(path: tuple[str, ...], old: list[Any], new: list[Any]) -> Iterator[_Change]:
    where = "".join(path)
    added = [name for name in new if name not in old]
    removed = [name for name in old if name not in new]
    if added:
        yield path, f"{where} added: {', '.join(map(_name, added))}", None
    if removed:
        yield path, f"{where} removed: {', '.join(map(_name, removed))}", None


def _named(value: Any) -> bool:
    """A list of objects each with a ``name`` (a key pool), compared name by name."""
    return isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)


def _keys(*dicts: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(key for data in dicts for key in data))


def _segment(key: Any) -> str:
    text = str(key)
    return f".{text}" if _BARE.match(text) else f"[{json.dumps(text)}]"


def _name(name: Any) -> str:
    text = str(name)
    return text if _PLAIN_NAME.match(text) else json.dumps(text)


def _show(value: Any) -> str:
    """A value as YAML's flow style writes it: ``null``, ``true``, ``30s``, ``[POST, PUT]``, ``{after: 10m}``
    (a mapping without its null entries)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(map(_show, value)) + "]"
    if isinstance(value, dict):  # a key left null is one not written: say what is
        return "{" + ", ".join(f"{key}: {_show(item)}" for key, item in value.items() if item is not None) + "}"
    return str(value)
