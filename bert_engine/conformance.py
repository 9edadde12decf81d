"""The conformance kit: run a task on golden inputs with a tiny model and check its results.

Rules checked on every result (the names appear in violations):
- `json`: the result serialises to JSON.
- `span`: a dict with integer "start"/"end" satisfies 0 <= start < end <= len(text) and text[start:end]
  equals its "word" / "text" / "answer" / "entity" value; the text is the input field named by
  its "field" key, else the task's last input field.
- `probability`: "score" / "probability" / "prob" values lie in [0, 1].
- `distribution`: a list of dicts with "label" and "score" under a key "labels" sums to 1.
- `label`: "label" values belong to the head's label set (when the head has one).
- `input-error`: bad input may only raise the documented InputError.
- `tab`: build_tab builds inside a gr.Blocks.
Plugin authors call `assert_task_conforms(task)` from their own tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .config import PRESETS
from .heads import BertWithHead
from .hookspecs import InputError
from .inference import Predictor
from .registry import RegisteredTask, load_registry
from .tokenizer import Tokenizer

LONG_TEXT = " ".join(f"word{i % 97} is here." if i % 11 == 0 else f"token{i % 53}" for i in range(5000))
GOLDEN_TEXTS = {
    "empty": "",
    "whitespace": "  \n\t  ",
    "5000 words": LONG_TEXT,
    "cjk": "北京大学是中国的一所大学。東京は日本の首都です。서울은 한국의 수도입니다.",
    "emoji": "I love this 😍🔥 but not that 👎🏽 — family 👩‍👩‍👧 and flags 🇫🇷.",
    "plain": "The quick brown fox jumps over the lazy dog near the river bank.",
}
_TEXT_KEYS = ("word", "text", "answer", "entity")
_PROB_KEYS = ("score", "probability", "prob")


@dataclass(frozen=True)
class Violation:
    task: str
    case: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.task}] {self.case}: {self.rule}: {self.message}"


def tiny_predictor(task: RegisteredTask, tokenizer: Tokenizer | None = None) -> Predictor:
    """The task's head on a tiny random encoder (hidden 32, 2 layers) with the real MiniLM tokenizer."""
    from .hub import default_backbone
    from .loading import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(default_backbone())
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=tokenizer.vocab_size, max_position_embeddings=512)
    torch.manual_seed(0)
    model = BertWithHead(config, task.spec.build_head(config)).eval()
    return Predictor(task, model, tokenizer, model_id="tiny-random", untrained_head=True)


def golden_cases(task: RegisteredTask) -> list[tuple[str, dict[str, str]]]:
    """(case name, inputs): each golden text in each input field, the others filled with plain text."""
    fields = task.spec.input_fields
    cases = [(f"example {i}", {f: str(example[f]) for f in fields}) for i, example in enumerate(task.spec.examples)]
    for field in fields:
        for name, text in GOLDEN_TEXTS.items():
            inputs = {f: GOLDEN_TEXTS["plain"] for f in fields}
            inputs[field] = text
            cases.append((f"{field}={name}" if len(fields) > 1 else name, inputs))
    return cases


def check_result(task: RegisteredTask, case: str, inputs: Mapping[str, str], result: Any,
                 labels: set[str] | None) -> list[Violation]:
    """Every rule above, applied to one result."""
    violations: list[Violation] = []

    def fail(rule: str, message: str) -> None:
        violations.append(Violation(task.spec.name, case, rule, message))

    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as err:
        fail("json", f"result is not JSON-serialisable: {err}")
    default_field = task.spec.input_fields[-1]

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Mapping):
            if isinstance(node.get("start"), int) and isinstance(node.get("end"), int):
                field = node.get("field", default_field)
                text = inputs.get(field, "")
                start, end = node["start"], node["end"]
                if not 0 <= start < end <= len(text):
                    fail("span", f"{path}: start={start}, end={end} is outside 0 <= start < end <= {len(text)}")
                else:
                    for key in _TEXT_KEYS:
                        if isinstance(node.get(key), str) and node[key] != text[start:end]:
                            fail("span", f"{path}: {key}={node[key]!r} but text[{start}:{end}]={text[start:end]!r}")
            for key in _PROB_KEYS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                        fail("probability", f"{path}.{key}={value} is not in [0, 1]")
            if labels and isinstance(node.get("label"), str) and node["label"] not in labels:
                fail("label", f"{path}.label={node['label']!r} is not one of the head's labels {sorted(labels)}")
            ranked = node.get("labels")
            if isinstance(ranked, list) and ranked and all(isinstance(r, Mapping) and "score" in r for r in ranked):
                total = sum(float(r["score"]) for r in ranked)
                if node.get("normalised", True) and abs(total - 1.0) > 1e-3:
                    fail("distribution", f"{path}.labels scores sum to {total:.4f}, not 1")
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(result, "result")
    return violations


def check_task(task: RegisteredTask, predictor: Predictor | None = None, *, build_tab: bool = True) -> list[Violation]:
    """Run the task on every golden case (and its examples) and return the violations found."""
    predictor = predictor or tiny_predictor(task)
    head = getattr(predictor.model, "head", None)
    labels = set(getattr(head, "labels", None) or predictor.model.config.id2label.values()) or None
    violations: list[Violation] = []
    for case, inputs in golden_cases(task):
        try:
            output = predictor.predict(inputs)
        except InputError:
            continue  # the documented answer to bad input
        except Exception as err:  # anything else is a crash the user would see
            violations.append(Violation(task.spec.name, case, "input-error",
                                        f"raised {type(err).__name__}: {str(err)[:200]} (only InputError is allowed)"))
            continue
        violations += check_result(task, case, inputs, output["result"], labels)
    if build_tab and task.spec.build_tab is not None:
        violations += _check_tab(task, predictor)
    return violations


def _check_tab(task: RegisteredTask, predictor: Predictor) -> list[Violation]:
    try:
        import gradio as gr

        with gr.Blocks():
            task.spec.build_tab(predictor)
    except Exception as err:
        return [Violation(task.spec.name, "tab", "tab", f"build_tab raised {type(err).__name__}: {str(err)[:200]}")]
    return []


def check_plugin(name: str) -> dict[str, Any]:
    """Load one plugin in isolation (built-in or entry point) and check each of its tasks."""
    from .registry import BUILTIN_PLUGINS

    builtins = tuple(m for m in BUILTIN_PLUGINS if m.rsplit(".", 1)[-1] == name)
    registry = load_registry(builtins=builtins, entry_points=not builtins, selected={name}, strict=False)
    if registry.failures:
        failure = registry.failures[0]
        return {"plugin": name, "ok": False, "failures": [dataclasses.asdict(failure)], "tasks": {}}
    if not registry.plugins:
        return {"plugin": name, "ok": False, "failures": [{"plugin": name, "stage": "import",
                                                           "message": "no such plugin installed"}], "tasks": {}}
    tasks = {}
    for task_name, task in registry.tasks.items():
        found = check_task(task)
        tasks[task_name] = {"cases": len(golden_cases(task)), "violations": [str(v) for v in found]}
    return {"plugin": name, "ok": all(not t["violations"] for t in tasks.values()), "failures": [], "tasks": tasks}


def assert_task_conforms(task: RegisteredTask, predictor: Predictor | None = None) -> None:
    """pytest helper for plugin authors: fails listing every violated rule."""
    violations = check_task(task, predictor)
    assert not violations, "task does not conform:\n" + "\n".join(str(v) for v in violations)
