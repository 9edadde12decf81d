"""`bert-engine push`: a trained model or adapter, with a generated model card, ready for the Hub.

`stage(source)` gathers what a Hub repository needs into a fresh folder and checks that it loads;
`model_card(...)` writes its README.md from the run's own records (manifest, train_config.json,
eval.json); hub.upload_folder sends it. The source may be:

- a training output folder (`train --output-dir`): its best/ is pushed, with train_config.json;
- a packed starter folder (`pack --to`): its manifest.json carries metrics and the command;
- a plain model folder in the Hugging Face layout (the task must then be named).

Only model files are staged (weights as safetensors, configs, tokenizer, records), never optimizer
state or pickles, and never a file whose real path lies outside the source folder.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

from ..checkpoints.hub import DEFAULT_BACKBONE_ID
from ..checkpoints.lora import looks_local
from ..runtime.inference import Predictor
from ..tasks.registry import RegisteredTask

logger = logging.getLogger(__name__)

# What a pushed repository holds; anything else in a run folder (trainer_state.pt, logs) stays home.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter.safetensors",
               "adapter_config.json", "tokenizer.json", "vocab.txt", "tokenizer_config.json",
               "special_tokens_map.json", "manifest.json", "eval.json", "task_options.json")
SHARD_GLOB = "model-*-of-*.safetensors"
# Hugging Face pipeline tags a task alias may name (the card's pipeline_tag and widget kind).
PIPELINE_TAGS = ("text-classification", "token-classification", "question-answering", "fill-mask",
                 "sentence-similarity", "feature-extraction", "zero-shot-classification")


class PushError(ValueError):
    """The folder cannot be pushed as it is; the message names the file or value and what to do."""


@dataclass
class Source:
    """What a folder to push holds: its model files and the records the card is written from."""

    folder: Path  # the model files (a run's best/)
    task: str
    kind: str  # "run", "packed" or "model"
    train_config: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    adapter: dict[str, Any] | None = None
    files: list[Path] = field(default_factory=list)


def read_source(path: str | Path, task: str | None = None) -> Source:
    """Look at `path` and say what it is (see the module docstring).

    Raises:
        PushError: not a run, packed or model folder; no task known; a file that points outside.
    """
    root = Path(path)
    if not root.is_dir():
        raise PushError(f"{str(path)!r} is not a folder; give a training output folder, a packed starter folder "
                        "or a model folder")
    train_config = _read_json(root / "train_config.json")
    if (root / "best").is_dir() and train_config is not None:
        source = Source(root / "best", task or train_config.get("task"), "run", train_config=train_config)
    elif (root / "manifest.json").is_file():
        manifest = _read_json(root / "manifest.json")
        source = Source(root, task or manifest.get("task"), "packed", manifest=manifest,
                        train_config=manifest.get("training"))
    elif (root / "config.json").is_file():
        source = Source(root, task, "model", train_config=train_config)
    else:
        raise PushError(f"{str(path)!r} holds no model: expected best/ with train_config.json (a training run), "
                        "manifest.json (a packed folder) or config.json (a model folder)")
    if not source.task:
        raise PushError(f"{str(path)!r} does not say which task it was trained for; pass --task")
    source.eval = _read_json(source.folder / "eval.json")
    source.adapter = _read_json(source.folder / "adapter_config.json")
    source.files = _model_files(source.folder)
    if not any(f.name.endswith(".safetensors") for f in source.files):
        raise PushError(f"{source.folder}: no safetensors weights to push (model.safetensors or adapter.safetensors); "
                        "a .bin checkpoint can be re-saved with bert_engine.save_pretrained")
    if source.adapter is not None:
        base = str(source.adapter.get("base_model", ""))
        if base != "default" and looks_local(base):
            raise PushError(f"{source.folder}: the adapter's base model is the local folder {base!r}, which the Hub "
                            "cannot reach; push that model first and train the adapter on its Hub id, or train with "
                            "--merge-lora and push the merged model")
    return source


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    _check_inside(path, path.parent)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PushError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(value, dict):
        raise PushError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_inside(path: Path, folder: Path) -> None:
    """A file read or pushed must really lie in its folder: a link elsewhere (a key, a password file)
    is refused before it is opened."""
    real = path.resolve()
    if not real.is_relative_to(folder.resolve()):
        raise PushError(f"{path} points outside the folder being pushed ({real}); copy the file in instead")


def _model_files(folder: Path) -> list[Path]:
    names = [n for n in MODEL_FILES if (folder / n).exists()] + sorted(p.name for p in folder.glob(SHARD_GLOB))
    for name in names:
        _check_inside(folder / name, folder)
    return [folder / name for name in names if (folder / name).is_file()]


def base_model_id(source: Source) -> str | None:
    """The Hub id of the model the pushed one was trained from (None: unknown or local)."""
    if source.adapter is not None:
        base = str(source.adapter.get("base_model", ""))
        return DEFAULT_BACKBONE_ID if base == "default" else base
    model = (source.train_config or {}).get("model")
    if model in (None, "default"):
        return DEFAULT_BACKBONE_ID if source.train_config is not None else None
    return None if looks_local(str(model)) else str(model)


def pipeline_tag(task: RegisteredTask) -> str | None:
    for name in (task.spec.name, *task.spec.aliases):
        if name in PIPELINE_TAGS:
            return name
    return None


def widget_example(task: RegisteredTask) -> dict[str, str] | None:
    """The task's first example in the Hub widget's form (text, plus context for QA)."""
    if not task.spec.examples:
        return None
    example = dict(task.spec.examples[0])
    fields = task.spec.input_fields
    if set(fields) == {"question", "context"}:
        return {"text": str(example["question"]), "context": str(example["context"])}
    return {"text": str(example[fields[0]])}


def metric_rows(source: Source) -> list[tuple[str, str, int | None, dict[str, float]]]:
    """(data, split, examples, {metric: value}) rows from the records the folder carries."""
    rows = []
    for key, values in ((source.manifest or {}).get("metrics") or {}).items():
        data, _, split = key.rpartition(":")
        numbers = {k: v for k, v in values.items() if k != "examples" and isinstance(v, (int, float))}
        rows.append((data or key, split, values.get("examples"), numbers))
    if not rows and source.eval:
        numbers = {k: v for k, v in source.eval.items() if k != "step" and isinstance(v, (int, float))}
        eval_file = (source.train_config or {}).get("eval_file")
        rows.append((Path(eval_file).name if eval_file else "evaluation data",
                     (source.train_config or {}).get("eval_split") or "", None, numbers))
    return rows


def training_command(source: Source) -> str | None:
    if source.manifest and source.manifest.get("command"):
        return str(source.manifest["command"])
    if source.train_config is not None and source.kind == "run":  # only a run's push ships train_config.json
        return f"bert-engine train {source.task} --config train_config.json"
    return None


LICENSE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]{0,63}$")  # the Hub's licence ids: apache-2.0, cc-by-4.0, other


def check_license(license: str) -> None:
    """`license` is one licence id as the Hub's card metadata takes it (apache-2.0, mit, cc-by-4.0, other):
    one short word, never text that would become lines of the card. ValueError naming it otherwise."""
    if not isinstance(license, str) or not LICENSE.match(license):
        raise ValueError(f"--license {license!r:.80} is not a licence id like apache-2.0, mit or cc-by-4.0 (one word: "
                         "letters, digits, '.', '+', '-')")


def model_card(source: Source, task: RegisteredTask, repo_id: str, *, license: str = "apache-2.0") -> str:
    """README.md for the repository: YAML metadata the Hub reads (licence, base model, pipeline tag,
    widget), then how to use it, its evaluation, how it was trained."""
    base = base_model_id(source)
    example = widget_example(task)
    metadata = ModelCardData(
        license=license, library_name="bert-engine", base_model=base, pipeline_tag=pipeline_tag(task),
        tags=["bert-engine", task.spec.name, *(["lora"] if source.adapter else [])],
        widget=[example] if example else None)
    what = (f"a LoRA adapter (rank {source.adapter.get('rank')} on {', '.join(source.adapter.get('targets', []))}) "
            f"and a trained head ({source.adapter.get('head', 'the task head')})" if source.adapter
            else "a fine-tuned model in the Hugging Face BERT layout")
    lines = [f"# {repo_id.split('/')[-1]}", "",
             f"**{task.spec.title}** for bert_engine: {what}"
             + (f", on [{base}](https://huggingface.co/{base})." if base else "."), ""]
    if task.spec.description:
        lines += [task.spec.description.strip(), ""]
    lines += ["## Use", "", "```python", "from bert_engine import pipeline", "",
              f'pipe = pipeline("{task.spec.name}", model="{repo_id}")']
    if task.spec.examples:
        call = ", ".join(f"{k}={v!r}" for k, v in dict(task.spec.examples[0]).items())
        lines.append(f"print(pipe({call}))")
    lines += ["```", "", f"From the shell: `bert-engine predict {task.spec.name} --model {repo_id} ...`.", ""]
    labels = (source.manifest or {}).get("labels") or _config_labels(source.folder)
    if labels:
        lines += [f"Labels: {', '.join(f'`{label}`' for label in labels)}.", ""]
    rows = metric_rows(source)
    if rows:
        names = sorted({name for *_, numbers in rows for name in numbers})
        lines += ["## Evaluation", "", "| data | split | examples | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for data, split, examples, numbers in rows:
            cells = [_number(numbers[n]) if n in numbers else "" for n in names]
            lines.append(f"| {data} | {split} | {examples if examples is not None else ''} | " + " | ".join(cells) + " |")
        if source.kind == "run" and source.eval and "step" in source.eval:
            lines += ["", f"The best evaluation during training, at step {source.eval['step']}."]
        fitted = {metric: option for metric, option in task.spec.tuned_options.items() if metric in names}
        answers_with = ((source.manifest or {}).get("options") or {})
        if fitted:  # e.g. sentiment's temperature: the other columns were measured before it was fitted
            lines += ["", "The evaluation fits " + ", ".join(
                f"`{option}` (`{metric}`)" + (f"; the model answers with {answers_with[option]} by default"
                                              if option in answers_with else "") for metric, option in fitted.items())
                + ". The other columns are at the options the evaluation ran with, before that fit."]
        lines.append("")
    command = training_command(source)
    settings = source.train_config or {}
    if command or settings:
        lines += ["## Training", ""]
        if command:
            lines += ["```bash", command, "```", ""]
        shown = {k: settings.get(k) for k in ("train_file", "max_steps", "epochs", "batch_size", "lr", "lora_rank",
                                                "max_seq_len", "precision", "seed") if settings.get(k) is not None}
        if shown:
            lines += ["| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in shown.items()), ""]
        date = (source.manifest or {}).get("date")
        if date:
            lines += [f"Packed on {date}.", ""]
    lines += ["## Licence", "", f"{license}" + (f", as the base model {base}." if base else "."), ""]
    return f"---\n{metadata.to_yaml()}\n---\n\n" + "\n".join(lines)


def _number(value: float) -> str:
    """Counts as integers, fractions to 4 places, percentages (EM, F1 on a 0-100 scale) to 2."""
    if float(value).is_integer() and abs(value) >= 1:
        return str(int(value))
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"


def _config_labels(folder: Path) -> list[str]:
    config = _read_json(folder / "config.json") or {}
    id2label = config.get("id2label") or {}
    try:
        return [id2label[k] for k in sorted(id2label, key=int)]
    except (TypeError, ValueError):
        return []


def stage(source: Source, task: RegisteredTask, repo_id: str, into: Path, *, license: str = "apache-2.0",
          check: bool = True) -> list[str]:
    """Copy the model files and the card into `into` (a new folder) and, with `check`, load the task
    from it, so a push never publishes a model that does not load. Returns the staged file names."""
    check_license(license)
    into.mkdir(parents=True, exist_ok=False)
    for path in source.files:
        shutil.copyfile(path, into / path.name)
    if source.kind == "run" and source.train_config is not None:  # to train it again: a new run, not a resume
        again = {**source.train_config, "resume": False}
        (into / "train_config.json").write_text(json.dumps(again, indent=2) + "\n", encoding="utf-8")
    (into / "README.md").write_text(model_card(source, task, repo_id, license=license), encoding="utf-8")
    if check:
        Predictor.load(task, str(into))
        logger.info("the staged %s model loads", task.spec.name)
    return sorted(p.name for p in into.iterdir())
