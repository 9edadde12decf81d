"""TrainConfig: every training setting, in a module light enough for `bert-engine train --help`
(no torch until a configuration is checked). The loop that uses it is loop.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _help(text: str, **kwargs) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass
class TrainConfig:
    """Every training setting; `bert-engine train/pretrain` flags map one-to-one onto these fields."""

    task: str | None = _help("registered task to fine-tune (train) or evaluate; unused by pretrain", default=None)
    model: str | None = _help("starting checkpoint: folder, Hub id, or 'default' (the offline MiniLM backbone)",
                              default=None)
    preset: str | None = _help("pretrain from scratch with this size: tiny, mini, small or base", default=None)
    train_file: str | None = _help("training data (file, folder, glob pattern of shards, or a comma-separated list of these; in the task's format)",
                                   default=None)
    eval_file: str | None = _help("evaluation data (default: the training file's eval split)", default=None)
    train_split: str = _help("split of the training file to read (for files holding several)", default="train")
    eval_split: str = _help("split of the evaluation file to read", default="dev")
    train_limit: int | None = _help("use only the first N training examples", default=None)
    eval_limit: int | None = _help("evaluate on only the first N examples", default=None)
    output_dir: str = _help("where checkpoints, metrics.jsonl and train_config.json go", default="runs/train")
    epochs: float = _help("passes over the training data (fractions allowed)", default=1.0)
    max_steps: int | None = _help("stop after this many optimizer steps (overrides epochs)", default=None)
    stop_after: int | None = _help("end this invocation at this step (evaluated and checkpointed there) while the "
                                   "learning-rate schedule still spans max_steps / epochs; --resume continues it",
                                   default=None)
    max_minutes: float | None = _help("end the schedule after about this many minutes of training: the step count is "
                                      "set from the speed of steps 10-40 and re-timed at steps 80, 160, ... until half "
                                      "the time is spent (max_steps or epochs cap it; evaluations and checkpoints add "
                                      "their own time); --resume keeps the count", default=None)
    batch_size: int = _help("examples per optimizer step per process, before accumulation", default=16)
    grad_accum: int = _help("micro-batches accumulated per optimizer step", default=1)
    lr: float = _help("peak learning rate of the encoder (and LoRA tensors)", default=5e-5)
    head_lr: float | None = _help("peak learning rate of the task head (default: lr)", default=None)
    weight_decay: float = _help("AdamW weight decay (never applied to biases and LayerNorm)", default=0.01)
    warmup_ratio: float = _help("fraction of steps with linear warm-up, then linear decay to 0", default=0.06)
    max_grad_norm: float = _help("clip the gradient norm to this (0: no clipping)", default=1.0)
    precision: str = _help("autocast: auto (bf16/fp16 on GPUs, fp32 on CPU), fp32, bf16 or fp16 (CPU: where native)",
                           default="auto")
    seed: int = _help("seed for data order, masks, dropout and initialisation", default=42)
    lora_rank: int = _help("train LoRA adapters of this rank with the encoder frozen (0: full fine-tuning)",
                           default=0)
    lora_alpha: float = _help("LoRA scaling numerator (update scaled by alpha / rank)", default=16.0)
    lora_targets: str = _help("comma-separated projections: query, key, value, attention_output, ffn_up, ffn_down",
                              default="query,value")
    lora_dropout: float = _help("dropout on the LoRA input", default=0.0)
    init_adapter: str | None = _help("start the LoRA tensors, head and pooler from this adapter folder (a packed "
                                     "model, e.g. plugins/starter/TASK) with a fresh optimizer and schedule: continues "
                                     "training it when its run is gone; targets and base weights must match, and lora_rank may "
                                     "grow the adapter (its update kept exactly, the added directions starting at zero)",
                                     default=None)
    merge_lora: bool = _help("also write each checkpoint merged, in the Hugging Face layout (best/merged/, ...)",
                             default=False)
    freeze_encoder: bool = _help("train only the head", default=False)
    eval_every: int = _help("evaluate every N steps (0: at the end of each epoch)", default=0)
    save_every: int = _help("write a resumable checkpoint every N steps", default=200)
    resume: bool = _help("continue from output_dir/last (weights, optimizer, scheduler, data position)",
                         default=False)
    log_every: int = _help("log the running loss every N steps", default=10)
    length_buckets: int = _help("batch examples of similar length: sort each window of N batches by length, then "
                                "shuffle the batches (0: plain shuffling); cuts padding, see `padding` in the log",
                                default=0)
    best_metric: str | None = _help("metric that picks the best checkpoint, as name, name:max or name:min (default: "
                                    "the task's declared one, else F1/accuracy/...; names with 'loss' are minimised)",
                                    default=None)
    options: dict[str, Any] = _help("task options (-o NAME=VALUE, repeatable): keywords of the task's training_batch "
                                    "(e.g. ner max_length=128), also used for evaluation where the task declares them",
                                    default_factory=dict)
    device: str | None = _help("cuda, mps or cpu (default: the best available)", default=None)
    max_seq_len: int = _help("pretraining: tokens per sentence pair", default=128)
    mlm_prob: float = _help("pretraining and fill-mask: fraction of tokens chosen for MLM", default=0.15)
    whole_word_mask: bool = _help("pretraining: choose whole words for MLM", default=False)
    short_seq_prob: float = _help("pretraining: probability of a shorter pair", default=0.1)
    objective: str | None = _help("pretraining: mlm (RoBERTa: one segment, dynamic masks), mlm+sop (ALBERT: "
                                  "sentence order) or mlm+nsp (BERT: next sentence); default: the family's",
                                  default=None)
    family: str = _help("pretraining from a preset: bert, roberta, albert or distilbert", default="bert")
    tokenizer: str | None = _help("pretraining from a preset: a tokenizer folder (default: the default backbone's)",
                                  default=None)
    teacher: str | None = _help("distillation: the fine-tuned task model to learn from (folder, Hub id or starter "
                                "folder)", default=None)
    student_layers: int = _help("distillation: the student's layers, from every other teacher layer", default=3)
    temperature: float = _help("distillation: softmax temperature of the soft targets", default=2.0)
    alpha_soft: float = _help("distillation: weight of the soft-target (KL) loss", default=0.5)
    alpha_task: float = _help("distillation: weight of the task's own loss on the labels", default=0.5)
    alpha_cos: float = _help("distillation: weight of the hidden-state cosine loss", default=0.1)

    def __post_init__(self) -> None:
        from ..runtime.precision import TRAINING_NAMES  # noqa: PLC0415 - torch loads when a run is set up, not for --help

        self._check_types()
        if self.precision not in TRAINING_NAMES:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(TRAINING_NAMES)}")
        if isinstance(self.length_buckets, bool) or self.length_buckets < 0:
            raise ValueError(f"length_buckets must be 0 (off) or a number of batches, got {self.length_buckets}")
        for name in ("batch_size", "grad_accum", "log_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or self.max_steps < 1):
            raise ValueError(f"max_steps must be at least 1 (or left out to train for `epochs`), got {self.max_steps}")
        if self.stop_after is not None and (isinstance(self.stop_after, bool) or self.stop_after < 1):
            raise ValueError(f"stop_after must be at least 1 (or left out to run the whole schedule), got {self.stop_after}")
        if self.max_minutes is not None and (isinstance(self.max_minutes, bool) or not self.max_minutes > 0):
            raise ValueError(f"max_minutes must be positive (or left out), got {self.max_minutes}")
        if self.epochs <= 0 and self.max_steps is None:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        parse_best_metric(self.best_metric)  # a malformed name:goal fails now, not at the first evaluation
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must lie in [0, 1), got {self.warmup_ratio}")
        for name in ("lr", "lora_alpha"):  # 0 learns nothing; below 0 climbs the loss
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"head_lr must be positive (or left out to use lr), got {self.head_lr}")
        for name in ("weight_decay", "max_grad_norm", "eval_every", "lora_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("train_limit", "eval_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (or left out for all), got {getattr(self, name)}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must lie in [0, 1), got {self.lora_dropout}")
        if not 0 < self.mlm_prob < 1:
            raise ValueError(f"mlm_prob must lie in (0, 1), got {self.mlm_prob}")
        if self.stop_after is not None and self.max_steps is not None and self.stop_after > self.max_steps:
            raise ValueError(f"stop_after {self.stop_after} is past max_steps {self.max_steps}: the run ends at "
                             f"{self.max_steps}; leave stop_after out, or make it smaller")

    def _check_types(self) -> None:
        """Each setting of the type its field declares, naming the setting and the value otherwise (a config
        file's `batch_size: 8.5` or `lora_rank: true`). A number written as text is read as the number: YAML
        reads `lr: 1e-3` as the string "1e-3"."""
        for setting in dataclasses.fields(self):
            value, kinds = getattr(self, setting.name), {k.strip() for k in str(setting.type).split("|")}
            if value is None and "None" in kinds:
                continue
            if "float" in kinds and isinstance(value, str):
                with contextlib.suppress(ValueError):  # not a number: named as a wrong type below
                    value = float(value)
                    setattr(self, setting.name, value)
            if "int" in kinds and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
                value = int(value)
                setattr(self, setting.name, value)
            ok = (("bool" in kinds and isinstance(value, bool))
                  or ("int" in kinds and isinstance(value, int) and not isinstance(value, bool))
                  or ("float" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
                  or ("str" in kinds and isinstance(value, str))
                  or (setting.name == "options" and isinstance(value, dict)))
            if not ok:
                words = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text",
                         "dict[str, Any]": "a mapping"}
                wanted = " or ".join(sorted(words.get(k, k) for k in kinds - {"None"}))
                raise ValueError(f"{setting.name} must be {wanted}, got {value!r:.80}")

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A JSON or YAML file of field values, then `overrides`; unknown keys raise naming them."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if path.suffix in (".yaml", ".yml"):
            import yaml  # noqa: PLC0415 - only for YAML config files

            try:
                values = yaml.safe_load(text) or {}
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                raise ValueError(f"{path}: not valid YAML{where} ({getattr(err, 'problem', None) or err})") from None
        else:
            try:
                values = json.loads(text)
            except ValueError as err:
                raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown training settings {unknown}; known: {sorted(known)}")
        return cls(**{**values, **overrides})


def parse_best_metric(value: str | None, spec: Any = None) -> tuple[str | None, str]:
    """`name`, `name:max` or `name:min` (None: the task's declared best metric) -> (name, goal).
    A name without a goal takes the task's goal when it is the task's metric, else "min" for a
    loss-like name (loss, perplexity) and "max" otherwise."""
    if value is None:
        return (spec.best_metric, spec.best_metric_goal) if spec is not None else (None, "max")
    name, _, goal = value.partition(":")
    if goal and goal not in ("max", "min"):
        raise ValueError(f"best_metric {value!r}: the goal after ':' must be max or min")
    if not goal:
        if spec is not None and name == spec.best_metric:
            goal = spec.best_metric_goal
        else:
            goal = "min" if "loss" in name or "perplexity" in name else "max"
    return name, goal


# Settings only pretraining reads: `bert-engine train` has no flags for them.
PRETRAIN_ONLY = ("preset", "max_seq_len", "whole_word_mask", "short_seq_prob", "objective", "family", "tokenizer")
# Settings only distillation reads; it trains the whole student, so it has no LoRA flags either.
DISTILL_ONLY = ("teacher", "student_layers", "temperature", "alpha_soft", "alpha_task", "alpha_cos")
NOT_FOR_DISTILL = ("model", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "init_adapter", "merge_lora",
                   "freeze_encoder")


def settings_read(cfg: TrainConfig, kind: str) -> dict[str, Any]:
    """The settings a job of `kind` ("train", "pretrain" or "distill") reads, as train_config.json and a
    pack's manifest record them: the others are left out, so a fine-tuning record does not show a
    pretraining default beside the setting that was used (whole_word_mask false beside options.whole_word
    true, fill-mask's manifest). `TrainConfig.from_file` fills what is left out with the defaults."""
    skip = {"train": (*PRETRAIN_ONLY, *DISTILL_ONLY), "pretrain": DISTILL_ONLY,
            "distill": (*PRETRAIN_ONLY, *NOT_FOR_DISTILL)}[kind]
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
