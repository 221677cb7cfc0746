"""``slotproxy init``: a commented config that serves as is, and the JSON Schema its first line names.

The config is ``proxy/config/example.yaml``, shipped in the package and kept identical to the repository's
``config.example.yaml`` by a test. Its first line points editors at ``./slotproxy.schema.json``, a path
relative to the config itself, so the schema is written beside the copy: the line then works wherever the
copy lives, offline, and describes this version's config (a URL would describe whichever version it
serves).
"""

from __future__ import annotations

from pathlib import Path

from .fetch import CliError

__all__ = ["SCHEMA_NAME", "example_text", "schema_text", "write_example"]

SCHEMA_NAME = "slotproxy.schema.json"


def example_text() -> str:
    from importlib.resources import files

    return files("proxy.config").joinpath("example.yaml").read_text(encoding="utf-8")


def schema_text() -> str:
    import json

    from ..config import config_json_schema

    return json.dumps(config_json_schema(), indent=2) + "\n"


def write_example(path: Path, *, force: bool, default_name: str) -> tuple[Path, list[str]]:
    """Write the example config at ``path`` (a folder: ``default_name`` in it) and the schema beside it;
    the config's path and the lines to print. An existing config is kept unless ``force``."""
    if path.is_dir():
        path = path / default_name
    folder = path.parent
    if not folder.is_dir():
        raise CliError(f"cannot write {path}: the folder {folder} does not exist; create it first")
    if path.exists() and not force:
        raise CliError(f"{path} already exists and was left as it is; pass --force to replace it with the example")
    try:
        path.write_text(example_text(), encoding="utf-8")
        said = [f"wrote {path}", _write_schema(folder / SCHEMA_NAME, force)]
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path, said


def _write_schema(schema: Path, force: bool) -> str:
    text = schema_text()
    if schema.is_file():
        if schema.read_text(encoding="utf-8") == text:
            return f"kept {schema} (already this version's schema)"
        if not force:
            return (f"kept {schema}, which differs from this version's schema (--force replaces it; "
                    "`slotproxy schema` prints this version's)")
    schema.write_text(text, encoding="utf-8")
    return f"wrote {schema} (the JSON Schema the config's first line names, for editors that check YAML)"
