"""The two kinds of training the loop runs: fine-tuning a registered task, and MLM + NSP pretraining.

A task job gets everything task-specific through the TaskSpec (data reader, training batches, loss,
metric or evaluate), so a third-party task trains with the same command as a built-in one. Both jobs
save in the Hugging Face layout, or as a small LoRA adapter + head when LoRA is on.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoints.hub import default_backbone
from ..checkpoints.loader import load, load_tokenizer
from ..checkpoints.loading import Loaded, save_pretrained
from ..checkpoints.lora import (
    LoraConfig,
    add_lora,
    check_base_weights,
    copy_adapter_weights,
    merge_lora,
    read_adapter_config,
    save_adapter,
)
from ..config import PRESETS, BertConfig
from ..families import FAMILIES
from ..families import family as get_family
from ..heads import IGNORE_INDEX, BertWithHead
from ..hookspecs import TaskSpec, takes_keyword
from ..runtime.distributed import Distributed, gather_objects
from ..runtime.inference import TASK_OPTIONS_FILE, Predictor
from ..tasks.evaluation import evaluate_task, read_examples
from ..tasks.registry import RegisteredTask
from .loop import seed_everything
from .pretraining import (
    OBJECTIVES,
    PairBuilder,
    collate_pairs,
    mask_tokens,
    masked_lm_counts,
    read_documents,
    tokenize_documents,
)
from .train_config import TrainConfig, parse_best_metric

logger = logging.getLogger(__name__)


def resolve_model_name(name: str | None) -> str:
    return str(default_backbone()) if name in (None, "default") else name


def _texts(value) -> list[str]:
    """Every string inside an example's inputs (a dict of fields, lists of words), in order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _texts(v)]
    return []


def check_targets(spec: TaskSpec, labels, examples: list, path: str) -> None:
    """Every label the data uses must be one of the head's, checked before training starts (an
    out-of-range id would otherwise stop the run mid-way). Label ids are positions, names are names."""
    if spec.target_labels is None or not labels:
        return
    labels = list(labels)
    for number, (_, target) in enumerate(examples, 1):
        for label in spec.target_labels(target):
            known = 0 <= label < len(labels) if isinstance(label, int) else label in labels
            if not known:
                raise ValueError(f"{path}: example {number} has label {label!r}, but the head's labels are "
                                 f"{labels} (ids 0-{len(labels) - 1}); start from a checkpoint with these labels "
                                 "or fix the data")


def split_task_options(spec: TaskSpec, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Training options -> (for training batches, for evaluation). With a training_batch, its keyword
    arguments take them; without one, preprocess does (the task's declared options). Evaluation takes
    the declared ones. An option neither accepts is refused, naming what is accepted."""
    declared = set(spec.options)
    if spec.training_batch is not None:
        parameters = inspect.signature(spec.training_batch).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        accepted = ({n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY or p.default is not p.empty}
                    - {"generator", "labels"})  # the host's own arguments, not options
        batch = {k: v for k, v in options.items() if takes_any or k in accepted}
    else:
        accepted, batch = declared, {k: v for k, v in options.items() if k in declared}
    unknown = sorted(set(options) - set(batch) - declared)
    if unknown:
        raise ValueError(f"task {spec.name!r} has no training option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(sorted(accepted | declared)) or 'none'}")
    return batch, {k: v for k, v in options.items() if k in declared}


class TaskJob:
    """Fine-tune a registered task: its head on a checkpoint, optionally with LoRA adapters."""

    kind = "train"  # which settings it reads (train_config.settings_read)

    def __init__(self, task: RegisteredTask, cfg: TrainConfig) -> None:
        spec = task.spec
        missing = [name for name in ("read_data", "loss") if getattr(spec, name) is None]
        if missing:
            raise ValueError(f"task {spec.name!r} cannot be trained: it declares no {' and no '.join(missing)}")
        if not cfg.train_file:
            raise ValueError("train_file is required to fine-tune a task")
        self.task, self.spec, self.cfg = task, spec, cfg
        seed_everything(cfg.seed)  # the new head's initialisation is part of the run
        self.base_name = cfg.model or "default"  # never the starter model: runs must not build on each other
        # Training a head is what this does, and a warm start (init_adapter) supplies one: a base without the
        # head's weights is no news here ("train the head first" said so to a user training it).
        self.loaded = load(resolve_model_name(self.base_name), spec.build_head, warn_missing=False)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.examples = read_examples(spec, cfg.train_file, cfg.train_split, cfg.train_limit)
        if not self.examples:
            raise ValueError(f"{cfg.train_file}: no {cfg.train_split!r} examples for task {spec.name!r}")
        check_targets(spec, getattr(self.model.head, "labels", None), self.examples, cfg.train_file)
        eval_file = cfg.eval_file or cfg.train_file
        self.eval_examples = []
        if cfg.eval_file or cfg.eval_split != cfg.train_split:
            try:
                self.eval_examples = read_examples(spec, eval_file, cfg.eval_split, cfg.eval_limit)
            except ValueError as err:
                if cfg.eval_file:  # asked for by name: its errors are the user's to fix
                    raise
                logger.warning("no evaluation data (%s); the final weights will be kept", err)
            check_targets(spec, getattr(self.model.head, "labels", None), self.eval_examples, eval_file)
        self.lora = _prepare_lora(self.model, cfg)
        if cfg.init_adapter:
            _warm_start(self.model, cfg.init_adapter, self.lora, self.loaded)
        self.batch_options, self.eval_options = split_task_options(spec, cfg.options)
        self._lengths: list[int] | None = None
        self._check_best_metric()

    def _check_best_metric(self) -> None:
        """A misspelt --best-metric fails now, not at the first evaluation (maybe an hour in): the evaluation run
        on two held-out examples names the metrics. Some appear only with enough data of a kind (QA's best_f1
        needs unanswerable questions), so a name they lack is refused only when it is a near miss of one they
        give ("acuracy"), else warned of. The task's declared best_metric is the conformance kit's to check."""
        name, _ = parse_best_metric(self.cfg.best_metric)
        if not name or name == self.spec.best_metric or not self.eval_examples:
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                predictor = Predictor(self.task, self.model, self.tokenizer, model_id=f"{self.cfg.output_dir} (check)")
                metrics = evaluate_task(self.spec, predictor, self.eval_examples[:2], **self.eval_options)
        finally:
            self.model.train(was_training)
        numbers = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        if name in numbers:
            return
        near = difflib.get_close_matches(name, numbers, n=1, cutoff=0.85)
        if near:
            raise ValueError(f"best_metric {name!r} is not reported by the evaluation of task {self.spec.name!r}; "
                             f"did you mean {near[0]!r}? It reports: {', '.join(numbers)}")
        logger.warning("best_metric %r is not among the metrics the evaluation of two held-out examples gave (%s); "
                       "if the first evaluation does not report it either, training stops there", name,
                       ", ".join(numbers) or "none")

    def example_lengths(self) -> list[int]:
        """Each training example's token count (its text inputs together), for length bucketing."""
        if self._lengths is None:
            texts = [_texts(inputs) for inputs, _ in self.examples]
            unique = list(dict.fromkeys(t for parts in texts for t in parts))  # QA contexts repeat: count each once
            counts = {t: len(encoding.ids) for t, encoding in zip(unique, self.tokenizer.pieces(unique))}
            self._lengths = [sum(counts[t] for t in parts) for parts in texts]
        return self._lengths

    @property
    def best_metric(self) -> tuple[str | None, str]:
        """The metric that picks the best checkpoint and its goal: the config's, else the task's."""
        return parse_best_metric(self.cfg.best_metric, self.spec)

    def collate(self, examples: list, generator: torch.Generator):
        spec = self.spec
        if spec.training_batch is not None:
            labels = {"labels": self.labels} if takes_keyword(spec.training_batch, "labels") else {}
            return spec.training_batch(examples, self.tokenizer, generator=generator, **labels, **self.batch_options)
        fields = spec.input_fields + spec.optional_fields
        inputs = {f: [x.get(f) for x, _ in examples] for f in fields if any(x.get(f) is not None for x, _ in examples)}
        batch = spec.preprocess(inputs, self.tokenizer, **{**spec.options, **self.batch_options})
        return batch, [target for _, target in examples]

    def loss(self, model: nn.Module, batch, targets):
        device = next(model.parameters()).device
        output = model(**batch.to(device).model_inputs())
        labels = {"labels": self.labels} if takes_keyword(self.spec.loss, "labels") else {}
        return self.spec.loss(output, targets, **labels), {}

    @property
    def labels(self) -> tuple[str, ...] | None:
        """The head's label names in id order (the checkpoint's id2label when it has one)."""
        labels = getattr(self.model.head, "labels", None)
        return tuple(labels) if labels else None

    def evaluate(self, model: nn.Module, rank: int, world: int) -> dict[str, Any]:
        if not self.eval_examples:
            return {}

        predictor = Predictor(self.task, model, self.tokenizer, model_id=f"{self.cfg.output_dir} (training)")
        return evaluate_task(self.spec, predictor, self.eval_examples, rank=rank, world=world, **self.eval_options)

    def save(self, model: nn.Module, folder: Path) -> None:
        save_model(model, folder, self.tokenizer, self.lora, self.base_name, self.cfg, self.loaded)
        if self.eval_options:  # the task options it was trained with: how the checkpoint must be served
            (Path(folder) / TASK_OPTIONS_FILE).write_text(json.dumps({"options": self.eval_options}, indent=2) + "\n",
                                                          encoding="utf-8")


def preset_config(preset: str, family: str, tokenizer, max_seq_len: int) -> BertConfig:
    """A size preset as a `family` encoder for `tokenizer`: its vocabulary and padding id, RoBERTa's
    position offset and one segment, DistilBERT's no segments, ALBERT's embeddings at most 128 wide."""
    base = PRESETS[preset]
    traits = get_family(family)
    extra: dict[str, Any] = {"type_vocab_size": traits.segments or 0}
    if traits.shared_layers:
        extra["embedding_size"] = min(128, base.hidden_size // 2)
    offset = traits.position_offset(tokenizer.pad_token_id)
    return dataclasses.replace(base, model_type=family, vocab_size=tokenizer.vocab_size,
                               pad_token_id=tokenizer.pad_token_id,
                               max_position_embeddings=max(base.max_position_embeddings, max_seq_len + offset), **extra)


def _objective(asked: str | None, family: str) -> str:
    """The pretraining objective: the one asked for, checked against the family's heads, or the family's own."""
    own = get_family(family).objective
    objective = asked or own
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if objective not in ("mlm", own):  # a sentence-pair objective needs the family's own sentence head
        head = {"mlm+nsp": "BERT's next-sentence", "mlm+sop": "ALBERT's sentence-order"}[objective]
        raise ValueError(f"objective {objective} needs {head} head; a {family} model has none (its objective: {own})")
    return objective


def _checkpoint_family(name: str) -> str:
    """The family a local checkpoint folder declares (a Hub id: BERT's objective unless --objective says)."""
    try:
        return BertConfig.from_json_file(Path(name) / "config.json").model_type
    except (OSError, ValueError):
        return "bert"  # load() says what is wrong with a broken checkpoint


class PretrainJob:
    """Masked-LM pretraining from raw documents, from scratch or from a checkpoint, with the family's
    objective: MLM + NSP (BERT), MLM + SOP (ALBERT), MLM on one segment (RoBERTa, DistilBERT)."""

    kind = "pretrain"  # which settings it reads (train_config.settings_read)

    def __init__(self, cfg: TrainConfig) -> None:
        if not cfg.train_file:
            raise ValueError("train_file (a text file or folder) is required to pretrain")
        if cfg.preset and cfg.model not in (None, "default"):
            raise ValueError("give either preset (from scratch) or model (continue), not both")
        if cfg.family not in FAMILIES:
            raise ValueError(f"family {cfg.family!r} is not one of {sorted(FAMILIES)}")
        self.cfg = cfg
        seed_everything(cfg.seed)
        self.base_name = cfg.model or "default"
        self.loaded = None  # from scratch: no checkpoint behind the model
        if cfg.preset:
            if cfg.preset not in PRESETS:
                raise ValueError(f"preset {cfg.preset!r} is not one of {sorted(PRESETS)}")
            self.tokenizer = load_tokenizer(cfg.tokenizer or resolve_model_name(cfg.model))
            config = preset_config(cfg.preset, cfg.family, self.tokenizer, cfg.max_seq_len)
            self.objective = _objective(cfg.objective, config.model_type)
            self.model = BertWithHead(config, "mlm" if self.objective == "mlm" else "pretraining")
        else:
            if cfg.tokenizer:
                raise ValueError("tokenizer is for --preset runs; a checkpoint brings its own")
            resolved = resolve_model_name(cfg.model)
            family = _checkpoint_family(resolved)
            self.objective = _objective(cfg.objective, family)
            self.loaded = load(resolved, "mlm" if self.objective == "mlm" else "pretraining")
            self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
            if self.loaded.untrained:
                logger.info("the checkpoint has no %s head; training a new one", self.objective)
        logger.info("pretraining objective: %s (%s)", self.objective, self.model.encoder.config.model_type)
        builder = PairBuilder(tokenize_documents(read_documents(cfg.train_file), self.tokenizer), cfg.max_seq_len,
                              cfg.short_seq_prob, objective=self.objective)
        self.builder = builder
        self._epoch = 0
        self.examples: list = builder.pairs(cfg.seed)  # epoch 0's pairs; new_epoch rebuilds them later
        self.eval_pairs = []
        if cfg.eval_file:
            eval_builder = PairBuilder(tokenize_documents(read_documents(cfg.eval_file), self.tokenizer),
                                       cfg.max_seq_len, cfg.short_seq_prob, objective=self.objective)
            self.eval_pairs = eval_builder.pairs(cfg.seed + 99991)[:cfg.eval_limit or 512]
        self.lora = _prepare_lora(self.model, cfg)

    def example_lengths(self) -> list[int]:
        """Each pair's token count (this epoch's pairs), for length bucketing."""
        return [len(pair.a) + len(pair.b) for pair in self.examples]

    def collate(self, pairs: list, generator: torch.Generator):
        batch, nsp = collate_pairs(pairs, self.tokenizer)
        masked, labels = mask_tokens(batch.input_ids, self.tokenizer, mlm_prob=self.cfg.mlm_prob,
                                     whole_word=self.cfg.whole_word_mask, generator=generator)
        batch.input_ids = masked
        return batch, (labels, nsp)

    def loss(self, model: nn.Module, batch, targets):
        labels, nsp = targets
        device = next(model.parameters()).device
        labels, nsp = labels.to(device), nsp.to(device)
        chosen = labels != IGNORE_INDEX
        output = model(**batch.to(device).model_inputs(), predict_positions=chosen)  # (N, V) logits
        if self.objective == "mlm":
            mlm_loss, mlm_correct, count = _mlm_loss(output.logits, labels[chosen])
            return mlm_loss, {"mlm_loss": mlm_loss.item(), "mlm_accuracy": mlm_correct / max(count, 1)}
        mlm_loss, mlm_correct, count = _mlm_loss(output.mlm_logits, labels[chosen])
        nsp_loss = nn.functional.cross_entropy(output.nsp_logits.float(), nsp)
        nsp_acc = (output.nsp_logits.argmax(-1) == nsp).float().mean().item()
        stats = {"mlm_loss": mlm_loss.item(), "nsp_loss": nsp_loss.item(),
                 "mlm_accuracy": mlm_correct / max(count, 1), "nsp_accuracy": nsp_acc}
        return mlm_loss + nsp_loss, stats

    def evaluate(self, model: nn.Module, rank: int, world: int) -> dict[str, Any]:
        if not self.eval_pairs:
            return {}

        device = next(model.parameters()).device
        totals = {"nll": 0.0, "top1": 0, "top5": 0, "masked": 0, "nsp_correct": 0, "pairs": 0}
        generator = torch.Generator().manual_seed(12345)  # the same masks at every evaluation
        mine = self.eval_pairs[rank::world]
        for start in range(0, len(mine), 64):
            batch, (labels, nsp) = self.collate(mine[start:start + 64], generator)
            labels, nsp = labels.to(device), nsp.to(device)
            chosen = labels != IGNORE_INDEX
            output = model(**batch.to(device).model_inputs(), predict_positions=chosen)
            logits = output.logits if self.objective == "mlm" else output.mlm_logits  # (N, V)
            counts = masked_lm_counts(logits, labels[chosen])
            counts["nsp_correct"] = 0 if self.objective == "mlm" else (output.nsp_logits.argmax(-1) == nsp).sum().item()
            counts["pairs"] = nsp.numel()
            totals = {k: totals[k] + counts[k] for k in totals}
        parts = gather_objects([totals], Distributed(rank, world))
        summed = {k: sum(p[0][k] for p in parts) for k in totals}
        masked = max(summed["masked"], 1)
        return {"mlm_accuracy": summed["top1"] / masked, "mlm_top5": summed["top5"] / masked,
                "mlm_loss": summed["nll"] / masked, "perplexity": math.exp(min(summed["nll"] / masked, 50)),
                **({} if self.objective == "mlm" else
                   {f"{self.objective[4:]}_accuracy": summed["nsp_correct"] / max(summed["pairs"], 1)})}

    def new_epoch(self, epoch: int) -> None:
        """Fresh NSP pairs for each epoch (masks are fresh in every batch anyway), as many as before."""
        if epoch != self._epoch:
            count = len(self.examples)
            pairs = self.builder.pairs(self.cfg.seed + epoch)
            self.examples[:] = (pairs * (count // max(len(pairs), 1) + 1))[:count]
            self._epoch = epoch

    def save(self, model: nn.Module, folder: Path) -> None:
        save_model(model, folder, self.tokenizer, self.lora, self.base_name, self.cfg, self.loaded)


def _mlm_loss(logits: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy of (N, V) logits at the masked positions against their (N,) original ids."""
    picked = logits.float()
    if gold.numel() == 0:
        return logits.sum() * 0.0, 0, 0
    loss = nn.functional.cross_entropy(picked, gold)
    return loss, int((picked.argmax(-1) == gold).sum()), int(gold.numel())


def _prepare_lora(model: nn.Module, cfg: TrainConfig):
    """Add LoRA adapters (encoder frozen) or freeze the encoder, as the config says."""
    if cfg.lora_rank:
        hidden = model.encoder.config.hidden_size
        if cfg.lora_rank > hidden:  # before add_lora allocates rank x (in + out) floats for every target
            raise ValueError(f"lora_rank {cfg.lora_rank:,} is above the model's hidden size {hidden}: no LoRA delta of "
                             f"it has a higher rank, and the adapter would be larger than the model; use at most {hidden}")
        lora = LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                          targets=tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip()),
                          dropout=cfg.lora_dropout)
        adapted = add_lora(model.encoder, lora)
        if model.encoder.pooler is not None:
            # The pooler feeds only the task head (sentence-embedding checkpoints never trained it):
            # it trains with the head and is saved in the adapter file.
            for p in model.encoder.pooler.parameters():
                p.requires_grad_(True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("LoRA rank %d on %d modules; %s trainable parameters", lora.rank, len(adapted), f"{trainable:,}")
        return lora
    if cfg.freeze_encoder:
        for p in model.encoder.parameters():
            p.requires_grad_(False)
    return None


def _warm_start(model: nn.Module, folder: str, lora, loaded: Loaded) -> None:
    """Start from an adapter's tensors (init_adapter), checked against this run's LoRA and base weights."""
    if lora is None:
        raise ValueError(f"init_adapter {folder!r} needs LoRA training: set lora_rank (the adapter's rank)")
    if not (Path(folder) / "adapter_config.json").is_file():  # a file, a typo, a full checkpoint: said plainly
        raise ValueError(f"init_adapter {folder!r}: {'no such folder' if not Path(folder).is_dir() else 'no adapter_config.json in it'}"
                         "; give a packed model's folder (e.g. plugins/starter/sentiment) or a LoRA run's best/")
    meta = read_adapter_config(folder)
    mine = lora.to_dict()
    if meta["targets"] != mine["targets"]:
        raise ValueError(f"init_adapter {folder!r}: its targets are {meta['targets']!r}, this run's {mine['targets']!r}")
    if meta["rank"] > mine["rank"]:
        raise ValueError(f"init_adapter {folder!r}: its rank {meta['rank']} is higher than this run's "
                         f"lora_rank {mine['rank']} (a warm start can keep or grow the rank, not shrink it)")
    check_base_weights(meta, loaded.checkpoint.folder, folder)
    # Its update s·B·A is kept exactly: s = alpha / rank differs where the rank or alpha does.
    copy_adapter_weights(model, folder, grow=True,
                         b_scale=(meta["alpha"] / meta["rank"]) / (mine["alpha"] / mine["rank"]))
    if (meta["rank"], meta["alpha"]) != (mine["rank"], mine["alpha"]):
        logger.info("LoRA grown from rank %d (alpha %g) to rank %d (alpha %g); the added directions start at zero",
                    meta["rank"], meta["alpha"], mine["rank"], mine["alpha"])
    logger.info("LoRA tensors, head and pooler start from %s", folder)


def save_model(model: nn.Module, folder: Path, tokenizer, lora, base_name: str, cfg: TrainConfig,
               loaded: Loaded | None) -> None:
    """Hugging Face layout, or adapter + head (and with merge_lora the merged model in folder/merged)
    under LoRA; `loaded` says which base model the adapter belongs to."""

    folder = Path(folder)
    if lora is None:
        save_pretrained(model, folder, tokenizer)
        return
    if loaded is None:
        raise ValueError("cannot record the base model of an adapter: the model was not loaded from a checkpoint")
    save_adapter(model, folder, lora, base_name, (loaded.base or loaded.checkpoint).folder)
    if cfg.merge_lora:
        merged = copy.deepcopy(model)
        merge_lora(merged)
        save_pretrained(merged, folder / "merged", tokenizer)
