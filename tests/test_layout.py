"""The package's shape: no import cycle between its modules (function-level imports included, so a
cycle cannot hide inside a function)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bert_engine"


def module_name(path: Path) -> str:
    """bert_engine/runtime/inference.py -> "runtime.inference"; a package's __init__ -> the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, anywhere in its source (relative or absolute)."""
    here = module_name(path).split(".") if path.name != "__init__.py" else [*module_name(path).split("."), "x"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = [p for p in here[: len(here) - node.level] if p]
            stem = [*base, *(node.module.split(".") if node.module else [])]
            targets = [".".join([*stem, a.name]) for a in node.names] + [".".join(stem)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bert_engine."):
            stem = node.module.split(".")[1:]
            targets = [".".join([*stem, a.name]) for a in node.names] + [".".join(stem)]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("bert_engine.")]
        found.update(t for t in targets if t in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source (subpackages included)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths) - {""}
    return {name: {m for m in imported_modules(path, modules) if m != name}
            for name, path in paths.items() if name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_export_is_listed_and_loads():
    import bert_engine

    assert sorted(bert_engine.__all__) == sorted(bert_engine._EXPORTS)
    for name in bert_engine.__all__:
        assert getattr(bert_engine, name) is not None
