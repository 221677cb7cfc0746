"""Reading a config file: YAML → plain data (with the line of every key) → ``Config``.

This is the one place where YAML and pydantic errors become ``ConfigError``.
Each problem reads ``key.path: what is wrong (line N)``.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from proxy.config.model import Config
from proxy.errors import ConfigError

__all__ = ["MAX_YAML_DEPTH", "MAX_YAML_NODES", "beside_config", "load_config", "missing_folders", "parse_config"]

MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64
_MERGE_TAG = "tag:yaml.org,2002:merge"

Loc = tuple[str | int, ...]


class _TooManyNodes(yaml.YAMLError):
    pass


class _Loader(yaml.SafeLoader):
    """A SafeLoader that counts nodes with aliases expanded and keeps mapping keys as text.

    Counting while composing stops an alias bomb (billion laughs) after
    ``MAX_YAML_NODES`` nodes, before anything is constructed. Keys stay the
    text written in the file so that ``2024:`` or ``on:`` mean what they say.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.expanded_nodes = 0
        self.depth = 0
        self._subtree_sizes: dict[int, int] = {}

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            size = self._subtree_sizes.get(id(node))
            if size is None:
                raise ComposerError(
                    None, None, f"alias *{event.anchor} refers to a node that contains it",
                    event.start_mark,
                )
            self._count(size)
            return node
        before = self.expanded_nodes
        self._count(1)
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise _TooManyNodes(f"YAML nests deeper than {MAX_YAML_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if node is not None:
            self._subtree_sizes[id(node)] = self.expanded_nodes - before
        return node

    def _count(self, nodes: int) -> None:
        self.expanded_nodes += nodes
        if self.expanded_nodes > MAX_YAML_NODES:
            raise _TooManyNodes(
                f"YAML aliases expand to more than {MAX_YAML_NODES} nodes (an alias bomb?)"
            )

    def construct_mapping(  # type: ignore[override]
        self, node: MappingNode, deep: bool = False
    ) -> dict[str, Any]:
        self.flatten_mapping(node)
        mapping: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                raise ConstructorError(
                    None, None, "mapping keys must be plain strings", key_node.start_mark
                )
            mapping[key_node.value] = self.construct_object(value_node, deep=deep)
        return mapping


_PROVIDER_EXAMPLE = ("add at least one provider, e.g. providers: {openai: {upstream: 'https://api.openai.com/v1', "
                     "api_key_env: OPENAI_API_KEY}}, or run `slotproxy init` for a commented config that serves as is")


def beside_config(configured: str | None, config_path: str | os.PathLike[str] | None) -> Path | None:
    """A path the config names (the state file's, the ledger's), relative ones taken from the config
    file's folder, like nginx's prefix (from the working directory for a config with no file)."""
    if configured is None:
        return None
    path = Path(configured)
    if not path.is_absolute() and config_path is not None:
        path = Path(config_path).resolve().parent / path
    return path


def missing_folders(config: Config, config_path: str | os.PathLike[str]) -> list[str]:
    """The problems with the folders the config's files go in (``check`` and ``serve`` refuse to start)."""
    ledger = beside_config(config.ledger.path, config_path)
    if ledger is not None and not ledger.parent.is_dir():
        problem = (f"ledger.path: the folder {ledger.parent} does not exist: create it, or set ledger.path to "
                   "another file (null keeps no ledger)")
        return [problem]
    return []


def load_config(path: str | os.PathLike[str], *, require_providers: bool = False) -> Config:
    """Read and validate a config file; ``ConfigError`` lists every problem found.

    ``require_providers`` (``check`` and ``serve``): a file with no provider, empty included, is refused.
    """
    source = os.fspath(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}", source=source) from None
    except OSError as exc:
        problem = f"cannot read config file {source}: {exc.strerror}"
        raise ConfigError(problem, source=source) from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", source=source) from exc
    return parse_config(text, source, require_providers=require_providers)


def parse_config(text: str, source: str = "<string>", *, require_providers: bool = False) -> Config:
    """Validate config text; ``ConfigError`` lists every problem found (see ``load_config``)."""
    data, lines, problems = _read_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping of sections (server:, providers:, ...), "
            f"not {_kind(data)}",
            source=source,
        )
    if require_providers and data.get("providers") in (None, {}):
        line = lines.get(("providers",))
        what = "required key is missing" if "providers" not in data else "is empty"
        problems.append((line, _located(("providers",), f"{what}: {_PROVIDER_EXAMPLE}", line)))
        data = {**data, "providers": {}}
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems += [_problem(error, lines) for error in exc.errors()]
        raise ConfigError(_ordered(problems), source=source) from exc
    if problems:
        raise ConfigError(_ordered(problems), source=source)
    return config


# --- YAML ----------------------------------------------------------------------------


def _read_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int], list[tuple[int | None, str]]]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}, []
        lines, duplicates = _index(node)
        return loader.construct_document(node), lines, duplicates
    except _TooManyNodes as exc:
        raise ConfigError(str(exc), source=source) from None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_problem(exc), source=source) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", source=source) from exc
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", source=source) from None
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    what = ", ".join(part for part in (exc.context, exc.problem) if part)
    mark = exc.problem_mark or exc.context_mark
    if mark is None:
        return f"invalid YAML: {what}"
    return f"invalid YAML: {what} (line {mark.line + 1}, column {mark.column + 1})"


def _index(root: Node) -> tuple[dict[Loc, int], list[tuple[int | None, str]]]:
    """The line of every key path, and the duplicate keys, walking aliases as expanded.

    The walk is bounded because composing already refused more than
    ``MAX_YAML_NODES`` expanded nodes.
    """
    lines: dict[Loc, int] = {}
    duplicates: list[tuple[int | None, str]] = []

    def walk(node: Node, path: Loc, merged: bool) -> None:
        if isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                _note(lines, path + (i,), item.start_mark.line + 1, merged)
                walk(item, path + (i,), merged)
        elif isinstance(node, MappingNode):
            walk_mapping(node, path, merged)

    def walk_mapping(node: MappingNode, path: Loc, merged: bool) -> None:
        seen: set[str] = set()
        merges: list[Node] = []
        for key, value in node.value:
            if key.tag == _MERGE_TAG:
                merges.append(value)
                continue
            if not isinstance(key, ScalarNode):
                continue
            line = key.start_mark.line + 1
            if key.value in seen and not merged:
                duplicates.append((line, _located(path, f"duplicate key {key.value!r}", line)))
            seen.add(key.value)
            _note(lines, path + (key.value,), line, merged)
            walk(value, path + (key.value,), merged)
        for value in merges:
            for source in value.value if isinstance(value, SequenceNode) else [value]:
                walk(source, path, True)

    walk(root, (), False)
    return lines, duplicates


def _note(lines: dict[Loc, int], path: Loc, line: int, merged: bool) -> None:
    """Record a key's line; a key written in place wins over one brought in by ``<<:``."""
    if merged:
        lines.setdefault(path, line)
    else:
        lines[path] = line


# --- validation errors ---------------------------------------------------------------

_MESSAGES = {
    "missing": "required key is missing",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "set_type": "must be a list",
    "frozen_set_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def _problem(error: ErrorDetails, lines: dict[Loc, int]) -> tuple[int | None, str]:
    loc = tuple(part for part in error["loc"] if part != "[key]")
    line = _line_of(loc, lines)
    return line, _located(loc, _message(error, loc), line)


def _message(error: ErrorDetails, loc: Loc) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    msg = error["msg"]
    return msg[:1].lower() + msg[1:]


def _unknown_key(loc: Loc) -> str:
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown key"
    allowed = [field.alias or name for name, field in model.model_fields.items()]
    allowed = [key for key in allowed if not key.startswith("$")]
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (allowed: {', '.join(allowed)})"


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``loc``, following dict values."""
    current: Any = Config
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return None
            current = field.annotation
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
        elif typing.get_origin(current) is tuple and isinstance(part, int):
            current = typing.get_args(current)[0]
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(options) != 1:
                return annotation
            annotation = options[0]
        else:
            return annotation


def _line_of(loc: Loc, lines: dict[Loc, int]) -> int | None:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def _located(loc: Loc, message: str, line: int | None) -> str:
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    text = f"{path.lstrip('.')}: {message}" if path else message
    return f"{text} (line {line})" if line is not None else text


def _ordered(problems: list[tuple[int | None, str]]) -> list[str]:
    ranked = sorted(problems, key=lambda p: (p[0] is None, p[0] or 0))
    return list(dict.fromkeys(text for _, text in ranked))


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"
