"""The package's shape: no import cycle between its modules (function-level imports included, so a
cycle cannot hide inside a function), imports that point down the layers (core < checkpoints < runtime
< tasks < serving, training, shipping < cli), and plugins that import only the public paths."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bert_engine"


def module_name(path: Path) -> str:
    """bert_engine/runtime/inference.py -> "runtime.inference"; a package's __init__ -> the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], tree: ast.AST | None = None) -> set[str]:
    """The package's modules that `path` (parsed: `tree`) imports, anywhere in its source (relative or absolute)."""
    here = module_name(path).split(".") if path.name != "__init__.py" else [*module_name(path).split("."), "x"]
    found = set()
    for node in ast.walk(tree or ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = [p for p in here[: len(here) - node.level] if p]
            stem = [*base, *(node.module.split(".") if node.module else [])]
            targets = [".".join([*stem, a.name]) for a in node.names]
            if not all(t in modules for t in targets):  # `from .. import settings` imports the module, not the face
                targets.append(".".join(stem))
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


# -- layers --------------------------------------------------------------------------------------------
# Each module's layer, lowest first; a module imports only its own layer and those below it. The peers
# serving, training and shipping do not import one another. Imports under `if TYPE_CHECKING:` are
# annotations, not dependencies, and do not count.
LAYERS = {
    "core": 0,         # config, model, heads, crf, tokenizer, files; hookspecs + ui (the plugin contract); settings
    "checkpoints": 1,
    "runtime": 2,
    "tasks": 3,
    "serving": 4, "training": 4, "shipping": 4,
    "cli": 5,          # cli, __main__ and the package face
}
TOP = {"cli", "__main__", ""}


def layer_of(module: str) -> str:
    first = module.split(".")[0]
    if module in TOP:
        return "cli"
    return first if first in LAYERS else "core"


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """imported_modules, leaving out imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            node.body = []
    return imported_modules(path, modules, tree)


def wrong_way_imports() -> list[str]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    found = []
    for name, path in sorted(paths.items()):
        mine = layer_of(name)
        for target in sorted(runtime_imports(path, set(paths)) - {name}):
            theirs = layer_of(target)
            if LAYERS[theirs] > LAYERS[mine] or (LAYERS[theirs] == LAYERS[mine] and theirs != mine):
                found.append(f"{name or 'bert_engine'} ({mine}) imports {target or 'bert_engine'} ({theirs})")
    return found


def test_imports_point_down_the_layers():
    assert wrong_way_imports() == []


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        assert layer_of(name) in LAYERS
        if "." in name:  # a module in a subpackage: the subpackage is a layer
            assert name.split(".")[0] in LAYERS, name


# What plugins (built-in and the example) may import: docs/plugins.md, "Imports you can rely on".
PUBLIC = ("bert_engine", "bert_engine.hookspecs", "bert_engine.ui", "bert_engine.progress", "bert_engine.config", "bert_engine.model",
          "bert_engine.heads", "bert_engine.crf", "bert_engine.tokenizer", "bert_engine.runtime.inference",
          "bert_engine.runtime.explain", "bert_engine.training.pretraining", "bert_engine.tasks.registry",
          "bert_engine.tasks.conformance")
PLUGIN_SOURCES = [*sorted((ROOT / "plugins").glob("*.py")), *sorted((ROOT / "examples").glob("*/*/*.py")),
                  *sorted((ROOT / "examples").glob("*/tests/*.py"))]


def engine_imports(path: Path) -> set[str]:
    """The bert_engine modules `path` imports ("bert_engine" for names taken from the package face)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bert_engine":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "bert_engine")
    return found


def test_plugins_import_only_public_paths():
    assert PLUGIN_SOURCES
    private = {f"{path.relative_to(ROOT)}: {module}" for path in PLUGIN_SOURCES
               for module in engine_imports(path) if module not in PUBLIC}
    assert not private, "not a public import path (docs/plugins.md): " + ", ".join(sorted(private))


def test_the_public_paths_are_documented_for_plugin_authors():
    section = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8").split("## Imports you can rely on")[1]
    section = section.split("\n## ")[0]
    for module in PUBLIC:
        assert f"`{module}`" in section, module


def test_the_engine_imports_no_plugins_playground_or_gradio_at_module_level():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                assert name.split(".")[0] not in ("plugins", "playground", "gradio", "app"), f"{path}: {name}"


def test_old_flat_paths_still_import_the_moved_modules():
    import importlib

    import bert_engine

    for old, new in bert_engine.MOVED.items():
        assert importlib.import_module(f"bert_engine.{old}") is importlib.import_module(f"bert_engine.{new}")
    from bert_engine.serving import LazyPredictor
    from bert_engine.training import TrainConfig, init_distributed, train

    assert LazyPredictor and TrainConfig and init_distributed and train


def family_tests(source: str) -> list[str]:
    """Comparisons that branch on a model family's name: `x.model_type == "albert"`, `family in ("bert", ...)`."""
    from bert_engine.families import FAMILIES

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = {c.value for o in operands for c in ([o] if isinstance(o, ast.Constant) else
                                                        getattr(o, "elts", []) if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [])
                    if isinstance(c, ast.Constant)}
        named = any(isinstance(o, ast.Attribute) and o.attr == "model_type" for o in operands)
        if named or literals & set(FAMILIES):
            found.append(ast.unparse(node))
    return found


def test_no_module_branches_on_a_family_name():
    """Family quirks live in bert_engine/families.py's records; code reads `config.family.<quirk>`."""
    sources = [p for p in [*PACKAGE.rglob("*.py"), *(ROOT / "plugins").glob("*.py"), *(ROOT / "playground").glob("*.py")]
               if p.name != "families.py"]
    found = {f"{p.relative_to(ROOT)}: {test}" for p in sources for test in family_tests(p.read_text(encoding="utf-8"))}
    assert not found, "branch on the family's record instead: " + "; ".join(sorted(found))


def test_the_family_guard_finds_a_planted_branch():
    assert family_tests('if config.model_type == "roberta":\n    pass') == ["config.model_type == 'roberta'"]
    assert family_tests('ok = name in ("albert", "distilbert")')
    assert not family_tests('if config.family.shared_layers:\n    pass')


def test_every_family_has_a_key_table():
    from bert_engine.checkpoints.loading import KEY_TABLES
    from bert_engine.families import FAMILIES

    assert set(KEY_TABLES) == set(FAMILIES)


GRADIO_PRIVATE = ("fns", "get_blocks_context", "LocalContext", "blocks_config", "dependencies", "default_config")


def gradio_private_uses(source: str) -> list[str]:
    """Imports from Gradio's modules (its public face is `gradio`) and Gradio-private names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradio."):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("gradio.")]
        elif isinstance(node, ast.Attribute) and node.attr in GRADIO_PRIVATE:
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Name) and node.id in GRADIO_PRIVATE:
            found.append(node.id)
    return found


def test_nothing_reaches_into_gradio_internals():
    """Handlers are wrapped where the host wires them (bert_engine.ui.wiring) and the caller comes from
    gr.Request: no private event table, no request context, no patched instances."""
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "plugins").glob("*.py"), *(ROOT / "playground").glob("*.py"),
               ROOT / "app.py", *(ROOT / "tests").rglob("*.py")]
    found = {f"{p.relative_to(ROOT)}: {use}" for p in sources if p.name != "test_layout.py"
             for use in gradio_private_uses(p.read_text(encoding="utf-8"))}
    assert not found, "; ".join(sorted(found))
    assert gradio_private_uses("from gradio.context import LocalContext\nx = app.fns") == [
        "from gradio.context import ...", "app.fns"]


def test_the_qa_plugin_keeps_to_its_span_logic():
    """plugins/qa.py holds the span logic and its tab; training data lives in qa_data.py, scoring in
    qa_metric.py, the answerability verifier in qa_answerability.py (issue 37: under 450 lines)."""
    lines = (ROOT / "plugins" / "qa.py").read_text(encoding="utf-8").count("\n")
    assert lines < 450, f"plugins/qa.py has {lines} lines"


def test_the_engine_finds_its_built_in_tasks_without_naming_their_package():
    """The registry reads the distribution's `bert_engine.builtins` entry points; no engine module
    names the package that holds the built-in tasks (issue 37)."""
    import plugins
    from bert_engine.tasks.registry import builtin_plugins

    assert builtin_plugins() == tuple(plugins.BUILTIN)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith("plugins."), f"{path.relative_to(ROOT)} names {node.value!r}"
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
                assert not ast.unparse(node.args[0]).strip("'\"").startswith("plugins"), path
