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
- `option`: each declared option set alone to a bad value (NaN, -1, 0, a billion, a word) is refused with
  InputError or answered with a result the rules above accept; nothing else is raised.
- `crash`: the task's own code (the head's forward, postprocess) raised, SystemExit included; the stage is named.
- `brief`, `pipeline_output`: when declared, they answer (brief with a string) for every result.
- `time`: every case (a prediction, a tab event, the training check) finishes within `case_timeout_s`.
- `labels`: a task declaring `labels` gets a head exposing them as `head.labels` on a checkpoint without any.
- `tab`: build_tab builds inside a gr.Blocks and registers an event with api_name equal to the task's
  name (the app's API endpoint; no other api_name), whose first inputs are the task's input_fields.
- `tab-event`: that event, fired through Gradio (its pre- and postprocessing) with each example, answers.
- `training` (with sample data in read_data's format): read_data yields (inputs, target) pairs,
  training_batch (or preprocess) -> forward -> loss is a finite scalar whose gradient reaches the model,
  and the metric (or evaluate) returns finite numbers including the declared best_metric.
- `name` (check_plugin): no task name or alias is already taken in the full registry (built-ins and installed plugins).
Plugin authors call `assert_task_conforms(task, data=...)` from their own tests.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from .. import ui
from ..checkpoints.hub import default_backbone
from ..checkpoints.loader import load_tokenizer
from ..config import PRESETS
from ..heads import BertWithHead
from ..hookspecs import InputError, takes_keyword
from ..runtime.cancel import PredictionTimeout, call_with_timeout
from ..runtime.inference import Predictor
from ..tokenizer import Tokenizer
from .evaluation import evaluate_task
from .registry import ENTRY_POINT_GROUP, RegisteredTask, builtin_plugins, load_registry

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


def _not_plain(node: Any, path: str) -> str:
    """Where in `node` JSON would change something: the first tuple or non-string key, as a path."""
    if isinstance(node, tuple):
        return f"{path} (a tuple)"
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                return f"{path} (the key {key!r}, not a string)"
            found = _not_plain(value, f"{path}.{key}")
            if found:
                return found
    if isinstance(node, list):
        for index, value in enumerate(node):
            found = _not_plain(value, f"{path}[{index}]")
            if found:
                return found
    return "" if path != "result" else f"{path} ({type(node).__name__} at the top)"


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
    else:
        if json.loads(json.dumps(result)) != result:  # a tuple or a non-string key changes on the way
            fail("json", f"result is not plain JSON data (dicts with string keys, lists, strings, numbers): "
                         f"{_not_plain(result, 'result')} comes back from JSON changed")
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


CASE_TIMEOUT_S = 60.0


def check_task(task: RegisteredTask, predictor: Predictor | None = None, *, build_tab: bool = True,
               data: str | Path | None = None, split: str | None = None,
               case_timeout_s: float = CASE_TIMEOUT_S) -> list[Violation]:
    """Run the task on every golden case (and its examples), its tab's event, and with `data` (a small
    file in read_data's format) the training side; return the violations found."""
    if predictor is None:
        try:
            predictor = tiny_predictor(task)
        except (Exception, SystemExit) as err:  # nothing else can run without a model: the one violation
            return [Violation(task.spec.name, "build_head", "crash",
                              f"build_head raised {type(err).__name__}: {str(err)[:200]} (on the tiny model's config)")]
    head = getattr(predictor.model, "head", None)
    labels = set(getattr(head, "labels", None) or predictor.model.config.id2label.values()) or None
    violations = _check_labels(task, predictor)

    def timed(case: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call_with_timeout(function, case_timeout_s, *args, what=f"{task.spec.name} {case}", **kwargs)
        except PredictionTimeout as err:
            violations.append(Violation(task.spec.name, case, "time", str(err)))
            raise _Skip from None

    for case, inputs in golden_cases(task):
        try:
            output = timed(case, predictor.predict, inputs)
        except (InputError, _Skip):
            continue  # InputError: the documented answer to bad input
        except (Exception, SystemExit, GeneratorExit) as err:  # a crash the user would see (SystemExit too)
            violations.append(_crash(task, case, err))
            continue
        violations += check_result(task, case, inputs, output["result"], labels)
        violations += _check_shapes(task, case, output["result"])
    violations += _check_options(task, predictor, timed, labels)
    if task.spec.explain is not None:
        violations += _check_explain(task, predictor, timed)
    if build_tab and task.spec.build_tab is not None:
        violations += _check_tab(task, predictor, timed)
    if data is not None:
        violations += _check_training(task, predictor, Path(data), split, timed)
    return violations


def _check_explain(task: RegisteredTask, predictor: Predictor, timed) -> list[Violation]:
    """A declared `explain` answers every example with ExplainTarget records whose scores are one finite,
    differentiable value per row, and Integrated Gradients' attributions are finite and add up (rule
    `explain`)."""
    from ..runtime.explain import explain  # noqa: PLC0415 - only for tasks that declare it

    found = []
    for i, example in enumerate(task.spec.examples[:3] or ({field: "A short example." for field in task.spec.input_fields},)):
        case = f"explain example {i}"
        try:
            explained = timed(case, explain, predictor, dict(example), steps=32)
        except (InputError, _Skip):
            continue
        except (Exception, SystemExit, GeneratorExit) as err:
            found.append(Violation(task.spec.name, case, "explain", f"raised {type(err).__name__}: {str(err)[:200]}"))
            continue
        for target in explained["targets"]:
            difference = target["score"] - target["baseline_score"]
            if not all(math.isfinite(v) for v in target["attributions"]):
                found.append(Violation(task.spec.name, case, "explain", f"{target['name']!r}: attributions not finite"))
            elif abs(target["completeness_gap"]) > 0.25 * abs(difference) + 0.01:
                found.append(Violation(task.spec.name, case, "explain",
                                       f"{target['name']!r}: attributions sum to {target['sum']:.4g} but the score moved "
                                       f"{difference:.4g} from the baseline: does the score read only the rows it is "
                                       "handed?"))
    return found


# Values a caller may send for any option (a form's free text, an API client's mistake): each must be refused with
# InputError, naming it, or give a good answer; the written-out tagging task of docs/plugins.md once crashed in the
# tokenizer on max_length=16 (its fixed stride did not fit), a case no golden input reached.
BAD_OPTION_VALUES = (float("nan"), -1, 0, 10**9, "lots")


def _check_options(task: RegisteredTask, predictor: Predictor, timed, labels: set[str] | None) -> list[Violation]:
    """Rule `option`: the first golden case with each declared option set alone to each of BAD_OPTION_VALUES."""
    found: list[Violation] = []
    inputs = golden_cases(task)[0][1]
    for name in task.spec.options:
        for value in BAD_OPTION_VALUES:
            case = f"option {name}={value!r}"
            try:
                output = timed(case, lambda n=name, v=value: predictor.predict(dict(inputs), **{n: v}))  # (an option
                # may be named like timed's own parameters: sentiment's `function`)
            except (InputError, _Skip):
                continue
            except (Exception, SystemExit, GeneratorExit) as err:
                stage = getattr(err, "request_stage", None)
                found.append(Violation(task.spec.name, case, "option",
                                       f"raised {type(err).__name__}: {str(err)[:200]}"
                                       + (f" in {stage}" if stage else "")
                                       + " (a bad option value must be refused with InputError, naming it)"))
                continue
            found += check_result(task, case, inputs, output["result"], labels)
    return found


def _crash(task: RegisteredTask, case: str, err: BaseException) -> Violation:
    """A case that raised something other than InputError: bad input refused the wrong way (raised while
    reading the input: rule `input-error`) or the task's code failing (rule `crash`, naming the stage:
    the head's forward, postprocess...)."""
    stage = getattr(err, "request_stage", None)
    what = f"raised {type(err).__name__}: {str(err)[:200]}"
    if stage in (None, "preprocess"):
        return Violation(task.spec.name, case, "input-error", f"{what} (only InputError is allowed)")
    return Violation(task.spec.name, case, "crash", f"{what} in {stage}")


def _check_shapes(task: RegisteredTask, case: str, result: Any) -> list[Violation]:
    """`brief` and `pipeline_output`, when declared, answer for every result the task gives (the All tasks
    tab, MCP and pipeline() call them; one that raises would drop the answer there)."""
    found = []
    for rule, call in (("brief", lambda: task.spec.brief(result)),
                       ("pipeline_output", lambda: task.spec.pipeline_output(result, dict(task.spec.options), True))):
        if getattr(task.spec, rule) is None:
            continue
        try:
            value = call()
        except (Exception, SystemExit, GeneratorExit) as err:
            found.append(Violation(task.spec.name, case, rule, f"raised {type(err).__name__}: {str(err)[:200]}"))
            continue
        if rule == "brief" and not isinstance(value, str):
            found.append(Violation(task.spec.name, case, rule, f"must return a string, got {type(value).__name__}"))
    return found


class _Skip(Exception):
    """A case already recorded as a violation (it hit the time limit)."""


def _check_labels(task: RegisteredTask, predictor: Predictor) -> list[Violation]:
    declared = task.spec.labels
    if declared is None:
        return []
    config = dataclasses.replace(predictor.model.config, id2label={}, label2id={})
    try:
        head = task.spec.build_head(config)
    except (Exception, SystemExit, GeneratorExit) as err:
        return [Violation(task.spec.name, "labels", "labels", f"build_head on a checkpoint without labels raised "
                                                              f"{type(err).__name__}: {str(err)[:200]}")]
    found = getattr(head, "labels", None)
    if found is None or tuple(found) != tuple(declared):
        return [Violation(task.spec.name, "labels", "labels", f"the task declares labels {declared} but a new head "
                                                              f"has head.labels = {found!r}")]
    width = _scores_per_row(head, config)
    if width is not None and width != len(found):  # softmax over 5 scores for 2 labels: sums that are not 1
        return [Violation(task.spec.name, "labels", "labels", f"the head gives {width} scores per row (the last "
                                                              f"dimension of its output) for its {len(found)} labels "
                                                              f"{tuple(found)}: size its output layer by the labels")]
    return []


def _scores_per_row(head: Any, config) -> int | None:
    """The last dimension of what `head` returns for one short row (a tensor, or an output with `.logits`);
    None where it returns something else or fails (the golden cases report a failure)."""
    from ..model import EncoderOutput  # noqa: PLC0415 - the encoder's output type, for one made-up row

    hidden = torch.randn(1, 3, config.hidden_size)
    encoded = EncoderOutput(hidden, pooled=torch.tanh(hidden[:, 0]), attention_mask=torch.ones(1, 3, dtype=torch.long))
    try:
        with torch.no_grad():
            output = head(encoded)
    except (Exception, SystemExit):
        return None
    output = getattr(output, "logits", output)
    return int(output.shape[-1]) if isinstance(output, torch.Tensor) and output.dim() >= 2 else None


def _check_tab(task: RegisteredTask, predictor: Predictor, timed) -> list[Violation]:
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    name = task.spec.name

    def fail(rule: str, case: str, message: str) -> list[Violation]:
        return [Violation(name, case, rule, message)]

    wired: list[str] = []  # the endpoints ui.wire connected

    def record(function, api_name):
        if api_name:
            wired.append(api_name)
        return function

    try:
        with gr.Blocks() as blocks, ui.wiring(record):
            task.spec.build_tab(predictor)
    except (Exception, SystemExit, GeneratorExit) as err:
        return fail("tab", "tab", f"build_tab raised {type(err).__name__}: {str(err)[:200]}")
    endpoints = blocks.get_api_info()["named_endpoints"]  # Gradio's public API description (view_api's)
    named = [endpoint.lstrip("/") for endpoint in endpoints]
    others = [api for api in named if api != name]
    if name not in named or others:
        return fail("tab", "tab", f"the tab's events have api_name {named}; exactly one must be {name!r} (the task's "
                                  "name, the app's API endpoint), the others with api_visibility='private'")
    if name not in wired:
        return fail("tab", "tab", f"the endpoint {name!r} is not connected with bert_engine.ui.wire: the playground "
                                  "shows a task's InputError as its message, names the MCP tool and tells visitors "
                                  "apart only for the events ui.wire connects")
    parameters = endpoints[f"/{name}"]["parameters"]
    fields = task.spec.input_fields
    if len(parameters) < len(fields):
        return fail("tab", "tab", f"event {name!r} takes {len(parameters)} inputs; its first must be the task's "
                                  f"input_fields {fields}")
    violations: list[Violation] = []
    for i, example in enumerate(task.spec.examples):
        values = [example[f] for f in fields] + [p.get("parameter_default") for p in parameters[len(fields):]]
        case = f"tab event, example {i}"
        try:
            timed(case, blocks, *values, api_name=name)
        except _Skip:
            continue
        except (Exception, SystemExit, GeneratorExit) as err:  # gr.Error included: an example must answer, not show an error
            violations += fail("tab-event", case, f"firing {name!r} through Gradio raised {type(err).__name__}: "
                                                  f"{str(err)[:200]}")
    return violations


def _check_training(task: RegisteredTask, predictor: Predictor, data: Path, split: str | None,
                    timed) -> list[Violation]:
    spec = task.spec
    case = f"training on {data.name}"

    def fail(message: str) -> list[Violation]:
        return [Violation(spec.name, case, "training", message)]

    if spec.read_data is None:
        return fail("sample data was given but the task declares no read_data")
    try:
        return timed(case, _training_steps, task, predictor, data, split, fail)
    except _Skip:
        return []
    except (Exception, SystemExit, GeneratorExit) as err:
        return fail(f"raised {type(err).__name__}: {str(err)[:300]}")


def _training_steps(task: RegisteredTask, predictor: Predictor, data: Path, split: str | None, fail) -> list[Violation]:

    spec = task.spec
    pairs = list(islice(spec.read_data(str(data), split or "train"), 4))
    if not pairs or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], Mapping) for p in pairs):
        return fail(f"read_data({data.name!r}, {split or 'train'!r}) must yield (inputs, target) pairs, got "
                    f"{pairs[:1]!r:.120}")
    violations: list[Violation] = []
    if spec.loss is not None:
        model = predictor.model.train()
        head_labels = getattr(getattr(model, "head", None), "labels", None)
        labels = tuple(head_labels) if head_labels else None  # as the trainer hands them (training.jobs)
        try:
            if spec.training_batch is not None:
                extra = {"labels": labels} if takes_keyword(spec.training_batch, "labels") else {}
                batch, targets = spec.training_batch(pairs, predictor.tokenizer, generator=torch.Generator().manual_seed(0),
                                                     **extra)
            else:
                fields = spec.input_fields + spec.optional_fields
                inputs = {f: [x.get(f) for x, _ in pairs] for f in fields if any(x.get(f) is not None for x, _ in pairs)}
                batch, targets = spec.preprocess(inputs, predictor.tokenizer, **spec.options), [t for _, t in pairs]
            model.zero_grad(set_to_none=True)
            loss = spec.loss(model(**batch.model_inputs()), targets,
                             **({"labels": labels} if takes_keyword(spec.loss, "labels") else {}))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not torch.isfinite(loss):
                violations += fail(f"loss must be a finite scalar tensor, got {loss!r:.120}")
            elif not loss.requires_grad:
                violations += fail("the loss has no gradient: it does not depend on the model's parameters")
            else:
                loss.backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                if not grads or not all(torch.isfinite(g).all() for g in grads) or not any(g.abs().sum() > 0 for g in grads):
                    violations += fail("the loss's gradient does not reach the model's parameters, or is not finite")
        finally:
            model.zero_grad(set_to_none=True)
            model.eval()
    if spec.metric is not None or spec.evaluate is not None:
        metrics = evaluate_task(spec, predictor, pairs)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not numbers or not all(math.isfinite(v) for v in numbers.values()):
            violations += fail(f"the metric must return finite numbers by name, got {metrics!r:.200}")
        elif spec.best_metric is not None and spec.best_metric not in numbers:
            violations += fail(f"best_metric {spec.best_metric!r} is not among the metric's numbers {sorted(numbers)}")
    return violations


def check_plugin(name: str, *, data: str | Path | None = None, split: str | None = None,
                 case_timeout_s: float = CASE_TIMEOUT_S) -> dict[str, Any]:
    """Load one plugin in isolation (built-in or entry point) and check each of its tasks; then load
    the full registry as the app would, and name any of its tasks another plugin already registers
    (the registry would refuse the whole plugin). `data` feeds the training check (one task).

    Raises:
        ValueError: no plugin of that name; case_timeout_s not a number of seconds above 0.
    """
    if (isinstance(case_timeout_s, bool) or not isinstance(case_timeout_s, (int, float))
            or not math.isfinite(case_timeout_s) or case_timeout_s <= 0):
        raise ValueError(f"case_timeout_s must be a number of seconds above 0, got {case_timeout_s!r}")
    builtins = tuple(m for m in builtin_plugins() if m.rsplit(".", 1)[-1] == name)
    installed = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if not builtins and name not in installed:  # a name no plugin has (a typo): the caller's error, exit 2
        known = sorted({m.rsplit(".", 1)[-1] for m in builtin_plugins()} | installed)
        raise ValueError(f"no plugin named {name!r} is installed; plugins: {', '.join(known)}")
    if builtins and name in installed:  # an entry point of a built-in's name never loads: its failure, not a pass
        full = load_registry(entry_points=True, selected={name}, strict=False)
        clashes = [dataclasses.asdict(f) for f in full.failures if f.stage == "duplicate" and f.source == "entry point"]
        if clashes:
            return {"plugin": name, "ok": False, "failures": clashes, "tasks": {}}
    registry = load_registry(builtins=builtins, entry_points=not builtins, selected={name}, strict=False)
    if registry.failures:
        failure = registry.failures[0]
        return {"plugin": name, "ok": False, "failures": [dataclasses.asdict(failure)], "tasks": {}}
    if not registry.plugins:
        return {"plugin": name, "ok": False, "failures": [{"plugin": name, "stage": "import",
                                                           "message": "no such plugin installed"}], "tasks": {}}
    if data is not None and len(registry.tasks) != 1:
        raise ValueError(f"--data feeds one task's training check; plugin {name} has {len(registry.tasks)} "
                         f"({', '.join(registry.tasks)}): check them from a test with assert_task_conforms(task, data=...)")
    owners = _owners_elsewhere(name)
    tasks = {}
    for task_name, task in registry.tasks.items():
        found = check_task(task, data=data, split=split, case_timeout_s=case_timeout_s)
        for claimed in (task_name, *task.spec.aliases):
            if claimed in owners:
                kind = "task name" if claimed == task_name else "alias"
                found.insert(0, Violation(task_name, "registry", "name", f"{kind} {claimed!r} is already registered "
                                          f"by plugin {owners[claimed]!r}; the app would refuse plugin {name} whole"))
        tasks[task_name] = {"cases": len(golden_cases(task)), "violations": [str(v) for v in found],
                            "training": "checked" if data is not None else "not checked (no sample data: --data FILE)"}
    return {"plugin": name, "ok": all(not t["violations"] for t in tasks.values()), "failures": [], "tasks": tasks}


def _owners_elsewhere(name: str) -> dict[str, str]:
    """Task name or alias -> plugin, for every task the other plugins (built-in and installed) register."""
    others = tuple(m for m in builtin_plugins() if m.rsplit(".", 1)[-1] != name)
    full = load_registry(builtins=others, entry_points=True, excluded={name}, strict=False)
    return {claimed: task.plugin for task_name, task in full.tasks.items() for claimed in (task_name, *task.spec.aliases)}


def assert_task_conforms(task: RegisteredTask, predictor: Predictor | None = None, *,
                         data: str | Path | None = None, split: str | None = None) -> None:
    """pytest helper for plugin authors: fails listing every violated rule. Give `data` (a few examples
    in read_data's format) to check the training side too."""
    violations = check_task(task, predictor, data=data, split=split)
    assert not violations, "task does not conform:\n" + "\n".join(str(v) for v in violations)
