"""The package's shape: each folder of ``proxy/`` is a layer and imports between them point one way, no
import cycle, the limiter core stays pure, and no module grows past ``MAX_LINES``.

Read from the source with ``ast``, so an import hidden in a function or under
``TYPE_CHECKING`` counts too. Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` first, so those are edges as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "proxy"
MAX_LINES = 600

STACK = ("cli", "tools", "server", "admin", "http")
"""From the top: each of these folders may import the ones after it, and every one of ``BELOW``."""
BELOW = {
    "telemetry": {"providers", "limiter", "config"},
    "providers": {"limiter", "config"},
    "backends": {"ledger", "limiter"},
    "ledger": set(),
    "config": {"limiter"},
    "limiter": set(),
}
"""The folders under the HTTP layer, and which of them each may import."""
SHARED = {"proxy", "proxy.errors", "proxy.logs", "proxy.aio"}
"""Modules at the top of the package that every folder may import; they import no folder."""
ENTRY = {"proxy.__main__": {"cli"}}
"""``python -m proxy``: imported by nobody, it may import what it runs."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    base = current.split(".") if is_package else current.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def _with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & set(MODULES)


def imports_of(name: str) -> set[str]:
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = _resolve(name, path.name == "__init__.py", node.level, node.module) if node.level else node.module
            if root is None:
                continue
            targets = [f"{root}.{alias.name}" if f"{root}.{alias.name}" in MODULES else root for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "proxy" or target.startswith("proxy."):
                found |= _with_parents(target)
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle_in_the_package() -> None:
    # A module's own package __init__ running first is not a cycle through that module.
    graph = {name: {t for t in imports_of(name) if not name.startswith(t + ".")} for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _third_party(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def allowed_folders() -> dict[str, set[str]]:
    allowed = {folder: set(below) for folder, below in BELOW.items()}
    for index, folder in enumerate(STACK):
        allowed[folder] = set(STACK[index + 1:]) | set(BELOW)
    return allowed


def folder_of(name: str) -> str | None:
    """The folder (layer) a module is in; None for a module at the top of the package."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def layer_violations() -> list[str]:
    allowed = allowed_folders()
    found = []
    for name in sorted(MODULES):
        source = folder_of(name)
        for target in sorted(imports_of(name)):
            destination = folder_of(target)
            if target in SHARED or destination == source:
                continue
            if source is None:
                ok = destination in ENTRY.get(name, set())
            else:
                ok = destination in allowed[source]
            if not ok:
                found.append(f"{name} -> {target}")
    return found


def test_every_folder_and_top_module_has_its_place_in_the_layers() -> None:
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(STACK) | set(BELOW), folders ^ (set(STACK) | set(BELOW))
    top = {name for name in MODULES if folder_of(name) is None}
    assert top == SHARED | set(ENTRY), top ^ (SHARED | set(ENTRY))


def test_imports_between_the_folders_point_one_way() -> None:
    """cli -> tools -> server -> admin -> http -> {providers, ledger, backends, config, limiter}; below the
    HTTP layer backends -> {ledger, limiter}, providers -> {limiter, config}, config -> limiter; anyone ->
    proxy.errors, proxy.logs, proxy.aio. Lazy imports inside functions count."""
    offending = layer_violations()
    assert not offending, "imports against the layers:\n" + "\n".join(offending)


def test_the_layer_check_finds_an_edge_upward() -> None:
    assert "admin" not in allowed_folders()["http"] and "http" in allowed_folders()["admin"]
    assert "backends" not in allowed_folders()["providers"] and "cli" not in allowed_folders()["tools"]
    assert all(folder not in allowed_folders()[folder] for folder in allowed_folders())


def test_no_module_is_over_the_line_limit() -> None:
    """Split where the seams are long before this: a module near the limit is a room with two uses."""
    sizes = {str(path.relative_to(PACKAGE.parent)): len(path.read_text(encoding="utf-8").splitlines())
             for path in PACKAGE.rglob("*.py")}
    over = sorted(f"{path}: {lines} lines" for path, lines in sizes.items() if lines > MAX_LINES)
    assert not over, f"over {MAX_LINES} lines:\n" + "\n".join(over)


def test_the_limiter_core_imports_no_aiohttp_and_no_redis() -> None:
    core = {name for name in MODULES if name.startswith("proxy.limiter")}
    reached, todo = set(), list(core)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [t for t in imports_of(name) if t not in reached]
    assert reached - core <= {"proxy", "proxy.errors"}, reached - core
    for name in reached & set(MODULES):
        assert not _third_party(name) & {"aiohttp", "redis", "yarl"}, name


def test_no_event_loop_is_run_inside_an_import_fallback() -> None:
    """An error while serving must not be chained to "No module named 'uvloop'": no ``asyncio.run`` or
    ``uvloop.run`` call sits inside an ``except`` block anywhere in the package."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for handler in (node for node in ast.walk(tree) if isinstance(node, ast.ExceptHandler)):
            for call in (node for node in ast.walk(handler) if isinstance(node, ast.Call)):
                func = call.func
                if isinstance(func, ast.Attribute) and func.attr == "run" and \
                        isinstance(func.value, ast.Name) and func.value.id in ("asyncio", "uvloop"):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{call.lineno}")
    assert not offenders, offenders
