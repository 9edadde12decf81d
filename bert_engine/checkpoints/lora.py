"""LoRA adapters for the encoder's linear layers: add, train, save small, load on a base, merge.

A LoRA layer keeps the base weight W frozen and learns a low-rank update: y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ
with A (r, in), B (out, r), s = alpha / r; B starts at zero so training starts from the base model.
The fused q/k/v projection takes one (A, B) pair per selected part ("query", "key", "value"), so
"query,value" adapts exactly those two projections as LoRA on separate matrices would.

Adapter files hold only the LoRA tensors and the head (`adapter.safetensors`) plus
`adapter_config.json` (rank, alpha, targets, the base model and its sha256).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..files import recorded_field
from .hub import ADAPTER_WEIGHTS, Resolved, default_backbone, resolve
from .loading import (
    CheckpointError,
    Loaded,
    contained,
    find_weights,
    inside_any,
    load_model,
    metadata_file,
    read_weights,
    save_weights,
    saved_config,
)

logger = logging.getLogger(__name__)

# Target name -> (module path inside each BertLayer, part of a fused output or None).
TARGETS = {
    "query": ("attention.qkv", 0),
    "key": ("attention.qkv", 1),
    "value": ("attention.qkv", 2),
    "attention_output": ("attention.out", None),
    "ffn_up": ("ffn.up", None),
    "ffn_down": ("ffn.down", None),
}
DEFAULT_TARGETS = ("query", "value")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.rank}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {unknown or list(self.targets)} are not among {sorted(TARGETS)}")

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus one low-rank update per adapted slice of its output.

    Args:
        base: the layer to adapt (its parameters are frozen here).
        parts: which of `num_parts` equal slices of the output get an update (one part: the whole).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, parts: tuple[int, ...] = (0,),
                 num_parts: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.scaling = alpha / rank
        self.part_size = base.out_features // num_parts
        self.parts = tuple(sorted(parts))
        self.dropout = nn.Dropout(dropout)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_a = nn.ParameterList(nn.Parameter(torch.empty(rank, base.in_features, device=device, dtype=dtype))
                                       for _ in self.parts)
        self.lora_b = nn.ParameterList(nn.Parameter(torch.zeros(self.part_size, rank, device=device, dtype=dtype))
                                       for _ in self.parts)
        for a in self.lora_a:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear initialises its weight

    def delta(self) -> Tensor:
        """The full (out, in) weight update s·B·A, zero rows for parts without an adapter."""
        update = self.base.weight.new_zeros(self.base.weight.shape)
        for part, a, b in zip(self.parts, self.lora_a, self.lora_b):
            rows = slice(part * self.part_size, (part + 1) * self.part_size)
            update[rows] = (b @ a) * self.scaling
        return update

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)  # (…, out)
        h = self.dropout(x)
        pieces = list(y.split(self.part_size, dim=-1))  # one piece per part (a single one if unfused)
        for part, a, b in zip(self.parts, self.lora_a, self.lora_b):
            pieces[part] = pieces[part] + (h @ a.T) @ b.T * self.scaling
        return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]

    def merged(self) -> nn.Linear:
        """The base layer with the update folded into its weight (no extra cost at inference)."""
        with torch.no_grad():
            self.base.weight += self.delta()
        return self.base


def add_lora(encoder: nn.Module, config: LoraConfig) -> list[str]:
    """Replace the targeted linears of every encoder layer with LoRALinear and freeze the encoder.

    Returns the names of the adapted modules. Only the LoRA tensors of the encoder stay trainable.
    """
    for p in encoder.parameters():
        p.requires_grad_(False)
    by_module: dict[str, list[int | None]] = {}
    for target in config.targets:
        path, part = TARGETS[target]
        by_module.setdefault(path, []).append(part)
    adapted = []
    for i, layer in enumerate(encoder.layers):
        for path, parts in by_module.items():
            parent_name, attr = path.rsplit(".", 1)
            parent = layer.get_submodule(parent_name)
            base = getattr(parent, attr)
            fused = parts[0] is not None
            setattr(parent, attr, LoRALinear(base, config.rank, config.alpha,
                                             tuple(parts) if fused else (0,), 3 if fused else 1, config.dropout))
            adapted.append(f"layers.{i}.{path}")
    return adapted


def merge_lora(module: nn.Module) -> int:
    """Fold every LoRALinear under `module` back into a plain nn.Linear; returns how many were merged."""
    count = 0
    for _, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, LoRALinear):
                setattr(child, attr, sub.merged())
                count += 1
    return count


def lora_state(model: nn.Module) -> dict[str, Tensor]:
    """The LoRA tensors of `model` (names as in its state dict)."""
    return {k: v for k, v in model.state_dict().items() if ".lora_a." in k or ".lora_b." in k}


def reduce_rank(tensors: dict[str, Tensor], scale: float, rank: int) -> tuple[dict[str, Tensor], float]:
    """The adapter `tensors` with each LoRA delta (scale * B @ A) cut to its best rank-`rank` approximation
    (truncated SVD), split evenly between the new A and B for a scale of 1 (alpha = rank). Other tensors
    (the head's) pass through unchanged.

    Returns:
        (the new tensors, in each one's dtype; the smallest share of a delta's squared norm kept).

    Raises:
        ValueError: naming `rank` where it is not below every delta's current rank, or below 1.
    """
    out, kept = {}, 1.0
    for name, a in tensors.items():
        if ".lora_b." in name:
            continue
        if ".lora_a." not in name:
            out[name] = tensors[name]
            continue
        b_name = name.replace(".lora_a.", ".lora_b.")
        if not 1 <= rank < a.shape[0]:
            raise ValueError(f"rank {rank}: the adapter has rank {a.shape[0]}; give a rank from 1 to {a.shape[0] - 1}")
        delta = scale * tensors[b_name].double() @ a.double()
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        total = float((s**2).sum())
        kept = min(kept, float((s[:rank] ** 2).sum()) / total if total else 1.0)
        root = s[:rank].sqrt()
        out[b_name] = (u[:, :rank] * root).to(tensors[b_name].dtype).contiguous()
        out[name] = (root[:, None] * vh[:rank]).to(a.dtype).contiguous()
    return out, kept


# -- adapter files ------------------------------------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
MAX_LORA_SCALE = 1000.0  # alpha / rank: the adapters here use 1 (alpha = rank); far above, every answer is overflow


def file_sha256(path) -> str:

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_adapter(model: nn.Module, folder, config: LoraConfig, base_model: str, base_folder) -> None:
    """Write the LoRA tensors, the head's own parameters (not the tied decoder) and the pooler, plus configs.

    Args:
        base_model: how to find the base again: a folder, a Hub id, or "default" (the offline backbone).
        base_folder: the resolved base folder, whose weights' sha256 is recorded.
    """

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tied = {id(p) for p in model.encoder.embeddings.parameters()}
    tensors = dict(lora_state(model))
    for name, param in model.named_parameters():
        if (name.startswith("head.") or name.startswith("encoder.pooler.")) and id(param) not in tied:
            tensors[name] = param
    save_weights({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, folder / ADAPTER_WEIGHTS)
    saved_config(model).to_json_file(folder / "config.json", architectures=["BertModel"])
    meta = {"format": "bert_engine.lora", **config.to_dict(), "base_model": base_model,
            "base_sha256": file_sha256(find_weights(Path(base_folder))), "head": type(model.head).__name__}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def read_adapter_config(folder) -> dict:
    """adapter_config.json, checked: a JSON object with rank, alpha, targets and base_model of the right types.

    Raises:
        CheckpointError: naming the file and the key that is missing or wrong.
    """
    path = metadata_file(Path(folder), ADAPTER_CONFIG)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{Path(folder).name}/{ADAPTER_CONFIG}: not valid JSON ({type(err).__name__})") from None
    expected = {"rank": int, "alpha": (int, float), "targets": list, "base_model": str}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{Path(folder).name}/{ADAPTER_CONFIG}: expected a JSON object")
    for key, kind in expected.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise CheckpointError(f"{Path(folder).name}/{ADAPTER_CONFIG}: {key!r} is missing or not a "
                                  f"{getattr(kind, '__name__', 'number')} (got {meta.get(key)!r:.60})")
    if meta["rank"] < 1 or not all(isinstance(t, str) for t in meta["targets"]):
        raise CheckpointError(f"{Path(folder).name}/{ADAPTER_CONFIG}: rank must be >= 1 and targets a list of names")
    if not math.isfinite(meta["alpha"]) or not 0 < meta["alpha"] <= MAX_LORA_SCALE * meta["rank"]:
        raise CheckpointError(f"{Path(folder).name}/{ADAPTER_CONFIG}: alpha {meta['alpha']!r:.30} must be a finite "
                              f"number above 0 and at most {MAX_LORA_SCALE:g} x rank ({meta['rank']})")
    return meta


def looks_local(name: str, probe: bool = True) -> bool:
    """Whether a model name is meant as a local path rather than a Hub id (owner/name): by its form, and with
    `probe` where a file or folder of that name exists (a server reading a visitor's name does not ask)."""

    parts = name.replace("\\", "/").split("/")
    return (name.startswith(("/", "~", ".")) or "\\" in name or ".." in parts or len(parts) > 2
            or (probe and Path(name).exists()))


def _manifest_task(folder: Path) -> str | None:
    """The task a packed folder's manifest.json names, when it is a plain name (None: no manifest, or not one)."""
    task = recorded_field(folder, "manifest.json", "task")  # read as a metadata file: inside, capped, regular
    return task if isinstance(task, str) and task.isidentifier() else None


def check_local_base(base: str, adapter_folder, allowed_dirs) -> None:
    """An adapter's base_model that is a local folder must lie inside `allowed_dirs` (None: anywhere);
    checked before anything is opened, so the error says nothing of what exists on the server."""

    if allowed_dirs is None or not looks_local(base):
        return
    if not inside_any(base, allowed_dirs):
        raise CheckpointError(f"{Path(adapter_folder).name}: the adapter's base_model is a local folder outside the "
                              "folders models may be loaded from; refused")


def check_base_weights(meta: dict, base_folder, adapter_folder) -> None:
    """Raise CheckpointError unless the base's weights are those the adapter (its config `meta`) was trained on."""
    found = file_sha256(find_weights(Path(base_folder)))
    if meta.get("base_sha256") and found != meta["base_sha256"]:
        raise CheckpointError(f"{adapter_folder}: the adapter was trained on base weights with sha256 "
                              f"{meta['base_sha256']}, but {base_folder} has {found}")


def copy_adapter_weights(model: nn.Module, folder, *, grow: bool = False, b_scale: float = 1.0) -> dict[str, Tensor]:
    """Copy the adapter file's tensors (LoRA, head, pooler) into `model`, which has its LoRA modules;
    return them. Raises CheckpointError, naming the keys or the tensor, where the file does not fit.

    With `grow`, the model's LoRA rank may be higher than the file's (an adapter grown on a warm start): the
    file's A fills the first rows of each A and its B, times `b_scale` (the file's alpha / rank over
    the model's), the first columns of each B; the rest of B stays zero, so the model starts out
    computing exactly what the file's adapter computed."""
    contained(Path(folder), ADAPTER_WEIGHTS)  # refused where it links outside (a Hub cache's blobs are inside)
    path = Path(folder) / ADAPTER_WEIGHTS  # read by its own name: a cache blob's name has no .safetensors suffix
    weights = read_weights(path)
    own = model.state_dict()
    unexpected = sorted(set(weights) - set(own))
    missing = sorted(set(lora_state(model)) - set(weights))
    if unexpected or missing:
        task = _manifest_task(Path(folder))
        if task is not None:  # the usual reason: another task's head (an NER adapter picked in the sentiment tab)
            raise CheckpointError(f"{folder}: a model of task {task!r} (its manifest.json), which does not fit the "
                                  f"head asked for: load it with its task (its tab in the playground, "
                                  f"pipeline({task!r}, model=...), `bert-engine predict {task} --model ...`) "
                                  f"(missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        raise CheckpointError(f"{path}: does not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}")
    slots = {}
    for name, tensor in weights.items():
        slots[name] = _slot(name, own[name], tensor) if grow else (() if own[name].shape == tensor.shape else None)
        if slots[name] is None:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, tensor in weights.items():
            if ".lora_b." in name:  # A's extra rows keep their fresh initialisation, B's extra columns are zero
                tensor = tensor.float() * b_scale
                own[name].zero_()
            own[name][slots[name]].copy_(tensor.to(own[name].dtype))
    return weights


def _slot(name: str, target: Tensor, tensor: Tensor):
    """Where `tensor` goes inside `target`: all of it for equal shapes, the first rows of a LoRA A
    (r, in) or the first columns of a LoRA B (out, r) of a higher rank; None where it does not fit."""
    if target.shape == tensor.shape:
        return ()
    if target.dim() != 2 or tensor.dim() != 2:
        return None
    if ".lora_a." in name and tensor.shape[1] == target.shape[1] and tensor.shape[0] < target.shape[0]:
        return (slice(0, tensor.shape[0]), slice(None))
    if ".lora_b." in name and tensor.shape[0] == target.shape[0] and tensor.shape[1] < target.shape[1]:
        return (slice(None), slice(0, tensor.shape[1]))
    return None


def _adapter_labels(folder: Path) -> list[str] | None:
    """The label names in an adapter folder's config.json (None where it has none).

    Raises:
        CheckpointError: naming the file, where it is not JSON or its id2label is not {"0": name, ...}.
    """
    try:
        data = json.loads(metadata_file(folder, "config.json").read_text(encoding="utf-8"))
        id2label = data.get("id2label") or {}
        return [str(id2label[k]) for k in sorted(id2label, key=int)] if id2label else None
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError, TypeError) as err:
        raise CheckpointError(f"{folder.name}/config.json: not a JSON object with id2label as "
                              f"{{\"0\": name, ...}} ({type(err).__name__})") from None


def load_adapter(resolved: Resolved, head, *, merge: bool = True, allowed_dirs=None, local_files_only: bool = False,
                 **kwargs) -> Loaded:
    """The base model named in the adapter's config, with the task head, LoRA tensors applied.

    Args:
        resolved: the adapter's folder (hub.resolve's answer).
        head: the head factory (as for bert_engine.load).
        merge: fold the adapters into the base weights (inference); False keeps them trainable.
        allowed_dirs: where a local base_model may lie (None: anywhere).
        kwargs: for the base model: dtype, device, attn_backend; and Hub arguments.
    Returns:
        A Loaded record: `checkpoint` the adapter's folder, `base` the base model's, `adapter` its
        config, `tokenizer_folder` the adapter's folder if it holds tokenizer files, else the base's.
    Raises:
        CheckpointError: the base's weights differ from those the adapter was trained on, or the
            adapter file does not fit (names the keys).
    """
    folder = Path(resolved.folder)
    meta = read_adapter_config(folder)
    config = LoraConfig(rank=meta["rank"], alpha=meta["alpha"], targets=tuple(meta["targets"]),
                        dropout=meta.get("dropout", 0.0))
    if meta["base_model"] != "default":  # "default" is the installed backbone, the operator's choice
        check_local_base(meta["base_model"], folder, allowed_dirs)
    base_name = default_backbone() if meta["base_model"] == "default" else meta["base_model"]
    labels = _adapter_labels(folder)
    kwargs.pop("strict", None)  # the base has no head by design; the adapter's keys are checked below
    hub_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("dtype", "device", "attn_backend")}
    base = load_model(resolve(base_name, local_files_only=local_files_only, **hub_kwargs), head, labels=labels,
                      warn_missing=False, **kwargs)
    model = base.model
    check_base_weights(meta, base.checkpoint.folder, folder)
    hidden = model.encoder.config.hidden_size
    if config.rank > hidden:  # checked before add_lora allocates rank x (in + out) for every target
        raise CheckpointError(f"{folder.name}/{ADAPTER_CONFIG}: rank {config.rank:,} is above the base model's hidden "
                              f"size {hidden}; no LoRA delta of it has a higher rank")
    add_lora(model.encoder, config)
    weights = copy_adapter_weights(model, folder)
    report = base.report
    report.missing = [k for k in report.missing if k not in weights]
    report.defaulted = [k for k in report.defaulted if k not in weights]
    if report.defaulted:
        logger.info("%s: no weights for %s; the head's defaults apply", folder.name, ", ".join(report.defaulted))
    if merge:
        merge_lora(model)
    has_tokenizer = any((folder / name).is_file() for name in ("tokenizer.json", "vocab.txt"))
    return Loaded(model, resolved, report, adapter={**meta, "folder": str(folder)}, base=base.checkpoint,
                  tokenizer_folder=folder if has_tokenizer else base.checkpoint.folder)
