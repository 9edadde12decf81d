"""Checkpoints in the Hugging Face layout: read weights safely, map their names to ours, save.

One explicit table (`ENCODER_TABLE`, `HEAD_TABLES`) documents the checkpoint format: every
parameter of ours and the checkpoint key(s) it comes from. Every checkpoint key is consumed or
reported as unexpected, missing keys are reported by name, and shapes must match exactly.
Network access lives in hub.py; this module reads only local files.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .. import settings
from ..config import BertConfig
from ..files import (  # noqa: F401  (re-exported: loading is where callers look for them)
    MAX_METADATA_BYTES,
    MAX_TOKENIZER_BYTES,
    CheckpointError,
    contained,
    inside_any,
    metadata_file,
    weight_files,
)
from ..heads import BertWithHead
from ..model import BertModel, encoder_of
from .hub import WEIGHT_FILES, max_weight_bytes

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer
    from .hub import Resolved

logger = logging.getLogger(__name__)


# -- the mapping tables, one per family ------------------------------------------------------------
# (our parameter, checkpoint key(s)). Several checkpoint keys are concatenated along dim 0, in order:
# we fuse query/key/value into one projection. "{i}" is the index of a distinct layer (ALBERT shares
# layers: its keys name a group and a layer in it). Checkpoint keys are written after normalisation
# (see `normalise_key`): no "bert."/"roberta."/"albert."/"distilbert." prefix, LayerNorm.weight/bias.
_EMBEDDINGS = [
    ("embeddings.word_embeddings.weight", ("embeddings.word_embeddings.weight",)),
    ("embeddings.position_embeddings.weight", ("embeddings.position_embeddings.weight",)),
    ("embeddings.token_type_embeddings.weight", ("embeddings.token_type_embeddings.weight",)),
    ("embeddings.layer_norm.weight", ("embeddings.LayerNorm.weight",)),
    ("embeddings.layer_norm.bias", ("embeddings.LayerNorm.bias",)),
]


def _layer_rows(prefix: str, q: str, k: str, v: str, out: str, attention_norm: str, up: str, down: str,
                ffn_norm: str) -> list[tuple[str, tuple[str, ...]]]:
    """A layer's rows, given the family's name for each of its parts (under `prefix`)."""
    rows = []
    for part in ("weight", "bias"):
        rows += [
            (f"layers.{{i}}.attention.qkv.{part}", tuple(f"{prefix}{name}.{part}" for name in (q, k, v))),
            (f"layers.{{i}}.attention.out.{part}", (f"{prefix}{out}.{part}",)),
            (f"layers.{{i}}.attention_norm.{part}", (f"{prefix}{attention_norm}.{part}",)),
            (f"layers.{{i}}.ffn.up.{part}", (f"{prefix}{up}.{part}",)),
            (f"layers.{{i}}.ffn.down.{part}", (f"{prefix}{down}.{part}",)),
            (f"layers.{{i}}.ffn_norm.{part}", (f"{prefix}{ffn_norm}.{part}",)),
        ]
    return rows


_BERT_LAYER = _layer_rows("encoder.layer.{i}.", "attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                          "output.dense", "output.LayerNorm")
_POOLER = [("pooler.dense.weight", ("pooler.dense.weight",)), ("pooler.dense.bias", ("pooler.dense.bias",))]


def _mlm(transform: str, norm: str, bias: str) -> list[tuple[str, tuple[str, ...]]]:
    # decoder.weight is tied to the word embeddings: not a parameter of its own (see KeyTable.tied).
    return [("transform.weight", (transform + ".weight",)), ("transform.bias", (transform + ".bias",)),
            ("transform_norm.weight", (norm + ".weight",)), ("transform_norm.bias", (norm + ".bias",)),
            ("bias", (bias,))]


def _linear(ours: str, theirs: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(f"{ours}.weight", (f"{theirs}.weight",)), (f"{ours}.bias", (f"{theirs}.bias",))]


def _heads(mlm, nsp=None, sequence="classifier"):
    tables = {"mlm": mlm, "sequence": _linear("classifier", sequence), "token": _linear("classifier", "classifier"),
              "span": _linear("qa_outputs", "qa_outputs")}
    if nsp is not None:
        tables["nsp"] = nsp
        tables["pretraining"] = [("mlm." + o, k) for o, k in mlm] + [("nsp." + o, k) for o, k in nsp]
    return tables


@dataclass(frozen=True)
class KeyTable:
    """How one model family's checkpoints name their weights (its quirks: bert_engine.families; docs/families.md)."""

    name: str  # config.json's model_type
    prefix: str  # the encoder's key prefix in a checkpoint with a head ("bert.")
    encoder: list[tuple[str, tuple[str, ...]]]  # embeddings, layers ("{i}": a distinct layer), pooler
    heads: dict[str, list[tuple[str, tuple[str, ...]]]]  # head kind -> its rows (ours under "head.")
    architectures: dict[str | None, str]  # head kind -> the transformers class of that checkpoint
    tied: str  # the MLM decoder matrix: the word embeddings again
    aliases: dict[str, str] = field(default_factory=dict)  # another spelling -> the table's
    layer_key: Any = None  # i -> the format arguments of a distinct layer's keys (ALBERT: group, layer)
    pooler_in_head: dict[str, list[tuple[str, tuple[str, ...]]]] = field(default_factory=dict)  # head -> pooler rows

    def head_rows(self, head: str | None) -> list[tuple[str, tuple[str, ...]]]:
        return self.heads.get(head, []) if head else []


def _classes(stem: str, heads: tuple[str | None, ...]) -> dict[str | None, str]:
    names = {None: "Model", "mlm": "ForMaskedLM", "nsp": "ForNextSentencePrediction", "pretraining": "ForPreTraining",
             "sequence": "ForSequenceClassification", "token": "ForTokenClassification", "span": "ForQuestionAnswering"}
    return {head: stem + names[head] for head in heads}


_ALBERT_LAYER = "encoder.albert_layer_groups.{group}.albert_layers.{inner}."
KEY_TABLES: dict[str, KeyTable] = {
    "bert": KeyTable(
        "bert", "bert.", _EMBEDDINGS + _BERT_LAYER + _POOLER,
        _heads(_mlm("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.bias"),
               _linear("classifier", "cls.seq_relationship")),
        _classes("Bert", (None, "mlm", "nsp", "pretraining", "sequence", "token", "span")),
        tied="cls.predictions.decoder.weight", aliases={"cls.predictions.decoder.bias": "cls.predictions.bias"}),
    "roberta": KeyTable(  # BERT's layers; its classification head's dense + tanh is our pooler
        "roberta", "roberta.", _EMBEDDINGS + _BERT_LAYER + _POOLER,
        _heads(_mlm("lm_head.dense", "lm_head.layer_norm", "lm_head.bias"), sequence="classifier.out_proj"),
        _classes("Roberta", (None, "mlm", "sequence", "token", "span")),
        tied="lm_head.decoder.weight", aliases={"lm_head.decoder.bias": "lm_head.bias"},
        pooler_in_head={"sequence": _linear("pooler.dense", "classifier.dense")}),
    "albert": KeyTable(  # factorised embeddings, shared layer groups, sentence-order prediction as "nsp"
        "albert", "albert.",
        _EMBEDDINGS + _linear("embedding_projection", "encoder.embedding_hidden_mapping_in")
        + _layer_rows(_ALBERT_LAYER, "attention.query", "attention.key", "attention.value", "attention.dense",
                      "attention.LayerNorm", "ffn", "ffn_output", "full_layer_layer_norm")
        + _linear("pooler.dense", "pooler"),
        _heads(_mlm("predictions.dense", "predictions.LayerNorm", "predictions.bias"),
               _linear("classifier", "sop_classifier.classifier")),
        _classes("Albert", (None, "mlm", "pretraining", "sequence", "token", "span")),
        tied="predictions.decoder.weight", aliases={"predictions.decoder.bias": "predictions.bias"}),
    "distilbert": KeyTable(  # no segments; its pre_classifier + ReLU is our pooler
        "distilbert", "distilbert.",
        [row for row in _EMBEDDINGS if "token_type" not in row[0]]
        + _layer_rows("transformer.layer.{i}.", "attention.q_lin", "attention.k_lin", "attention.v_lin",
                      "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm"),
        _heads(_mlm("vocab_transform", "vocab_layer_norm", "vocab_projector.bias")),
        _classes("DistilBert", (None, "mlm", "sequence", "token", "span")),
        tied="vocab_projector.weight", pooler_in_head={"sequence": _linear("pooler.dense", "pre_classifier")}),
}
# Kept for callers of the BERT tables by their old names.
ENCODER_TABLE = KEY_TABLES["bert"].encoder
HEAD_TABLES = KEY_TABLES["bert"].heads
# Checkpoint keys consumed without a parameter: buffers older transformers versions saved.
_BUFFER_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")
_PREFIXES = tuple(family.prefix for family in KEY_TABLES.values())


def key_table(model_or_config: nn.Module | BertConfig) -> KeyTable:
    config = model_or_config if isinstance(model_or_config, BertConfig) else getattr(model_or_config, "config", None)
    return KEY_TABLES[getattr(config, "model_type", "bert")]


def normalise_key(key: str, family: KeyTable | None = None) -> str:
    """Checkpoint key -> the table's spelling: drop the family prefix ("bert.", "roberta.", ...), legacy
    gamma/beta names, another spelling of the MLM bias."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
    key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
    aliases = family.aliases if family is not None else {a: k for f in KEY_TABLES.values() for a, k in f.aliases.items()}
    return aliases.get(key, key)


def expand_table(model: nn.Module, *, with_origin: bool = False) -> list:
    """The table rows for this model: one row per parameter of ours, layer indices filled in. With
    `with_origin`, each row also says whether its checkpoint keys belong to the encoder (saved under
    the family's prefix) or to the head."""
    encoder, prefix, head_name = _parts(model)
    config = encoder.config
    family = key_table(config)
    head_pooler = family.pooler_in_head.get(head_name) if isinstance(model, BertWithHead) else None
    rows = []
    for ours, keys in family.encoder:
        if ours.startswith("pooler.") and (encoder.pooler is None or head_pooler is not None):
            continue
        if ours.startswith("embeddings.token_type") and encoder.embeddings.token_type_embeddings is None:
            continue
        layers = range(config.distinct_layers) if "{i}" in ours else [None]
        for i in layers:
            names = dict(i=i, group=None, inner=None)
            if i is not None and config.family.shared_layers:
                names.update(group=i // config.inner_group_num, inner=i % config.inner_group_num)
            rows.append((prefix + ours.format(i=i), tuple(k.format(**names) for k in keys), True))
    if head_pooler is not None and encoder.pooler is not None:
        rows += [(prefix + ours, keys, False) for ours, keys in head_pooler]
    if isinstance(model, BertWithHead):
        if head_name in ("nsp", "pretraining") and head_name not in family.heads:
            raise CheckpointError(f"a {family.name} model has no next-sentence head: {family.name} is pretrained "
                                  "without NSP (bert-engine pretrain --objective mlm)")
        rows += [("head." + ours, keys, False) for ours, keys in family.head_rows(head_name)]
        # Parameters the table does not cover (a task head's own, e.g. CRF transitions) keep their
        # names, "head.*", in the checkpoint too. The tied MLM decoder is not a parameter of its own.
        covered = {ours for ours, _, _ in rows}
        tied = model.encoder.embeddings.word_embeddings.weight
        rows += [(name, (name,), False) for name, param in model.named_parameters(remove_duplicate=False)
                 if name.startswith("head.") and name not in covered and param is not tied]
    return rows if with_origin else [(ours, keys) for ours, keys, _ in rows]


def _parts(model: nn.Module) -> tuple[BertModel, str, str | None]:
    if isinstance(model, BertWithHead):
        return model.encoder, "encoder.", model.head_name
    if isinstance(model, BertModel):
        return model, "", None
    raise TypeError(f"expected a BertModel or BertWithHead, got {type(model).__name__}")


# -- reading weight files ----------------------------------------------------------------------------


def find_weights(folder: Path) -> Path:
    """The weights file of a checkpoint folder, safetensors preferred; raises CheckpointError if none."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            contained(folder, name)
            return folder / name
    raise CheckpointError(f"{folder}: no weights file found (looked for {', '.join(WEIGHT_FILES)})")


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit


def declared_bytes(path: Path) -> int:
    """The bytes of tensor data a safetensors file's header declares (dtype x shape of each tensor),
    read from its first bytes only: a sparse or lying file is judged before any tensor is read.

    Raises:
        CheckpointError: a header that is not the format's, too long, or names an unknown dtype.
    """
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: unreadable safetensors file, truncated or corrupt (no header)")
        length = int.from_bytes(head, "little")
        if length > MAX_SAFETENSORS_HEADER:
            raise CheckpointError(f"{path}: unreadable safetensors file, corrupt (a header of {length:,} bytes; the "
                                  f"format's limit is {MAX_SAFETENSORS_HEADER:,})")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable safetensors file, corrupt header ({err})") from None
        except RecursionError:  # arrays nested thousands deep: not a header, whatever the decoder thinks
            raise CheckpointError(f"{path}: unreadable safetensors file, corrupt header (JSON nested too "
                                  "deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: unreadable safetensors file, corrupt header (not a JSON object)")
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_BYTES or not isinstance(entry.get("shape"), list):
            raise CheckpointError(f"{path}: tensor {name!r} has no readable dtype and shape in the header")
        size = _DTYPE_BYTES[entry["dtype"]]
        for dim in entry["shape"]:
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
                raise CheckpointError(f"{path}: tensor {name!r} has an impossible shape {entry['shape']!r}")
            size *= dim
        total += size
    return total


def check_size(config: BertConfig, weights: Path, source: str) -> None:
    """Refuse, before allocating, a config whose parameters exceed BERT_ENGINE_MAX_PARAMETERS or could not be in
    the weights files (at 2 bytes each, the smallest dtype we load, with room for a missing head), and
    weights files that declare more tensor data than a model of this config could hold (8 bytes a
    parameter, with room for heads): sizes come from what safetensors headers declare, not from the
    files' sizes (a sparse file is small on disk and huge once read)."""
    count = config.parameter_count()
    limit = settings.get("BERT_ENGINE_MAX_PARAMETERS")  # 2e9: 8 GB in fp32
    if count > limit:
        raise CheckpointError(f"{source}: config.json describes {count:,} parameters; the limit is {limit:,} "
                              "(BERT_ENGINE_MAX_PARAMETERS)")
    files = [f for f in weight_files(weights) if f.is_file()]
    stored = sum(declared_bytes(f) if f.suffix == ".safetensors" else f.stat().st_size for f in files)
    room = 2 * config.vocab_size * config.hidden_size + 64 * 2**20  # an untrained MLM head, pooler or task head
    if 2 * count > 2 * stored + room:
        raise CheckpointError(f"{source}: config.json describes {count:,} parameters but the weights files hold "
                              f"{stored:,} bytes; the config does not belong to these weights")
    if stored > max_weight_bytes(config):
        raise CheckpointError(f"{source}: the weights files declare {stored:,} bytes of tensors, more than a model of "
                              f"this config holds ({count:,} parameters); they do not belong to this config")


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """Read a safetensors / .bin file, or a sharded checkpoint through its index .json.

    `.bin` files are unpickled with `weights_only=True`: a pickle that would run code is refused.

    Raises:
        CheckpointError: naming the file, if it is truncated, corrupt, unsafe or not a state dict.
    """
    path = Path(path)
    if path.name.endswith(".index.json"):
        state: dict[str, Tensor] = {}
        for shard in weight_files(path):
            state.update(read_weights(shard))
        return state
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file does not exist")
    if path.suffix == ".safetensors":
        try:
            state = load_file(path)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable safetensors file, truncated or corrupt ({err})") from None
    else:
        state = read_pickle(path)
    return check_finite(state, path)


def check_finite(state: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """Refuse weights holding NaN or infinity (every answer of such a model would be NaN), and weights or biases
    stored as booleans or integers (cast to 0/1 they would load silently; buffers such as position_ids may be
    integers)."""
    for name, tensor in state.items():
        if name.endswith((".weight", ".bias", ".gamma", ".beta")) and not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}; "
                                  "a model weight must be a floating-point tensor")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or infinite values; the checkpoint is broken")
    return state


def read_pickle(path: Path) -> dict[str, Tensor]:
    """A .bin state dict, unpickled with weights_only=True after the zip-bomb check."""
    check_not_compressed(path)
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol it did not write: the refusal says it
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: refused to load; the pickle holds objects other than tensors, which could run code "
            f"({pickle_refusal_reason(err)}). Convert the checkpoint to safetensors from a trusted source."
        ) from None
    except Exception as err:  # noqa: BLE001 - an untrusted file: every way it fails to unpickle is "corrupt"
        raise CheckpointError(f"{path}: unreadable .bin file, truncated or corrupt "
                              f"({type(err).__name__}: {printable(str(err))[:200]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors (a state dict), got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise CheckpointError(f"{path}: expected a dict of tensors (a state dict) with names as keys; "
                                  f"entry {printable(repr(key))[:80]} holds {type(value).__name__}")
    return state


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def printable(text: str) -> str:
    """`text` without terminal escape codes or control characters (a message must not repaint a terminal)."""
    return "".join(c if c.isprintable() else " " for c in _ANSI.sub("", text)).strip()


def pickle_refusal_reason(err: Exception) -> str:
    """The line of torch's weights_only refusal that names what was refused (e.g. "unsupported GLOBAL
    posix.system"), without its advice to re-run with weights_only=False."""
    lines = [printable(line) for line in str(err).splitlines()]
    named = [line.split("WeightsUnpickler error:", 1)[1].strip() for line in lines if "WeightsUnpickler error:" in line]
    if named and not named[0]:  # the reason on a line of its own ("Unsupported operand 149": a plain pickle)
        after = lines.index(next(line for line in lines if "WeightsUnpickler error:" in line)) + 1
        named = [line for line in lines[after:] if line][:1]
    reasons = named or [line for line in lines if line and not re.search(
        r"weights_only|Weights only load failed|trust|Check the doc|safe_globals", line)]
    reason = re.split(r"\.? ?Please use|\. ?To allowlist|\. ?Re-running", reasons[0] if reasons else "")[0].strip()
    return (reason or "unsupported object")[:200]


def check_not_compressed(path: Path) -> None:
    """Refuse a .bin zip archive with compressed entries before torch inflates them: torch.save writes
    them stored, so compression only serves a zip bomb (2 MB that inflates to gigabytes)."""
    if not zipfile.is_zipfile(path):
        return  # the legacy pickle format reads tensors straight from the file: bounded by its size
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable .bin file, truncated or corrupt ({err})") from None
    packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise CheckpointError(f"{path}: refused to load; {len(packed)} entries are compressed (e.g. "
                              f"{printable(packed[0])[:80]!r}), which torch.save never writes. Convert the "
                              "checkpoint to safetensors from a trusted source.")


# -- mapping checkpoint names to ours ------------------------------------------------------------------

@dataclass
class LoadReport:
    """What happened to every key: `missing` are ours with no source, `unexpected` the checkpoint's unused,
    `defaulted` a head's optional parameters the checkpoint lacks (e.g. a CRF over a plain token head)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    defaulted: list[str] = field(default_factory=list)

    head_rows: set[str] = field(default_factory=set)  # ours, whose checkpoint keys belong to a head

    def encoder_missing(self) -> list[str]:
        """Missing encoder weights (not a head's; RoBERTa's and DistilBERT's pooler is their head's)."""
        return [k for k in self.missing if not k.startswith("head.") and k not in self.head_rows]


def convert_state_dict(checkpoint: dict[str, Tensor], model: nn.Module,
                       source: str = "checkpoint") -> tuple[dict[str, Tensor], LoadReport]:
    """Map checkpoint tensors onto `model`'s parameter names, checking every shape.

    Returns:
        (our state dict, a LoadReport). Tensors keep their dtype; the caller casts.
    Raises:
        CheckpointError: if a tensor's shape differs from ours, naming the key and both shapes.
    """
    # Normalised name -> the checkpoint's spellings of it (both spellings of the MLM bias may occur).
    family = key_table(encoder_of(model))
    spellings: dict[str, list[str]] = {}
    for key in checkpoint:
        spellings.setdefault(normalise_key(key, family), []).append(key)
    by_norm = {norm: keys[0] for norm, keys in spellings.items()}
    expected = dict(model.state_dict())
    consumed: set[str] = set()
    ours_state: dict[str, Tensor] = {}
    report = LoadReport()
    # A head may name parameters with a meaningful default (`optional_parameters`, prefixes under head.).
    optional = tuple("head." + p for p in getattr(getattr(model, "head", None), "optional_parameters", ()))
    for ours, keys, in_encoder in expand_table(model, with_origin=True):
        if not in_encoder:
            report.head_rows.add(ours)
        present = [k for k in keys if k in by_norm]
        if len(present) < len(keys):
            (report.defaulted if optional and ours.startswith(optional) else report.missing).append(ours)
            continue
        parts = [checkpoint[by_norm[k]] for k in keys]
        want = expected[ours].shape
        part_shape = torch.Size([want[0] // len(keys), *want[1:]]) if len(keys) > 1 else want
        for key, tensor in zip(keys, parts):
            if tensor.shape != part_shape:
                raise CheckpointError(
                    f"{source}: tensor {by_norm[key]!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                    f"but the model expects {tuple(part_shape)} (for {ours!r})"
                )
        ours_state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        consumed.update(spelling for k in keys for spelling in spellings[k])
    for key in (*_BUFFER_KEYS, family.tied):
        consumed.update(spellings.get(key, ()))
    report.unexpected = sorted(set(checkpoint) - consumed)
    _check_tied_decoder(checkpoint, by_norm.get(family.tied), ours_state, model, source)
    return ours_state, report


def _check_tied_decoder(checkpoint, key, ours_state, model, source) -> None:
    embeddings = next((v for k, v in ours_state.items() if k.endswith("embeddings.word_embeddings.weight")), None)
    if key is None or embeddings is None or not isinstance(model, BertWithHead) or not hasattr(model.head, "tie_to"):
        return
    decoder = checkpoint[key]
    if decoder.shape != embeddings.shape or not torch.equal(decoder, embeddings):
        logger.warning("%s: %s differs from the word embeddings; the decoder is tied to the embeddings, "
                       "so the checkpoint's separate copy is not used", source, key)


def load_state(model: nn.Module, checkpoint: dict[str, Tensor], *, source: str = "checkpoint",
               strict: bool = False, warn_missing: bool = True) -> LoadReport:
    """Copy a checkpoint's tensors into `model` (cast to its dtype) and report what did not fit.

    Missing encoder weights always raise (the encoder would be random); a missing head is left at
    its fresh initialisation with a warning unless `strict`; unexpected keys are logged by name.

    Raises:
        CheckpointError: on a shape mismatch, missing encoder weights, or (strict) any missing/unexpected key.
    """
    state, report = convert_state_dict(checkpoint, model, source)
    if report.encoder_missing() or (strict and (report.missing or report.unexpected)):
        problems = []
        if report.missing:
            problems.append(f"missing {_names(report.missing)}")
        if report.unexpected:
            problems.append(f"unexpected {_names(report.unexpected)}")
        raise CheckpointError(f"{source}: checkpoint does not fit the model: {'; '.join(problems)}")
    if report.missing and warn_missing:
        logger.warning("%s: no weights for %s; they keep their fresh initialisation (train the head first)",
                       source, _names(report.missing))
    if report.defaulted and warn_missing:  # an adapter loaded next may supply them (lora.load_adapter says)
        logger.info("%s: no weights for %s; the head's defaults apply", source, _names(report.defaulted))
    # A pooler in the checkpoint is expected to go unused by heads that do not need one (QA, NER, MLM).
    unused_pooler = [k for k in report.unexpected if normalise_key(k).startswith("pooler.")]
    others = [k for k in report.unexpected if k not in unused_pooler]
    if unused_pooler:
        logger.info("%s: this head uses no pooler; not loading %s", source, _names(unused_pooler))
    if others:
        logger.warning("%s: unused checkpoint keys %s", source, _names(others))
    params = dict(model.state_dict())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return report


def _names(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# -- saving in the Hugging Face layout -------------------------------------------------------------------

def to_checkpoint_state(model: nn.Module) -> dict[str, Tensor]:
    """Our parameters under the checkpoint names transformers expects for the model's family
    (query/key/value split again; the encoder under "bert."/"roberta."/... when there is a head)."""
    encoder, _, _ = _parts(model)
    own = model.state_dict()
    prefix = key_table(encoder).prefix if isinstance(model, BertWithHead) else ""
    out: dict[str, Tensor] = {}
    for ours, keys, in_encoder in expand_table(model, with_origin=True):
        pieces = own[ours].chunk(len(keys), dim=0) if len(keys) > 1 else (own[ours],)
        for key, piece in zip(keys, pieces):
            out[prefix + key if in_encoder else key] = piece.detach().contiguous().cpu()
    return out


def saved_config(model: nn.Module) -> BertConfig:
    """The config to write with a model: the encoder's, with the label names of a head that has
    them (a task head built with default labels, on a base config that has none)."""
    config = encoder_of(model).config
    labels = getattr(getattr(model, "head", None), "labels", None)
    if labels and [config.id2label.get(i) for i in range(len(config.id2label))] != list(labels):
        config = config.with_labels(list(labels))
    return config


def save_weights(state: dict[str, Tensor], path: Path) -> Path:
    """A safetensors file with the permissions of any other file we write (safetensors writes through a
    private temporary file, 0600: a model others could not read beside a config they could)."""
    try:
        save_file(state, path, metadata={"format": "pt"})
    except SafetensorError as err:  # its error for a failed write (a full disk): an OSError naming the file
        raise OSError(f"could not write {path}: {err}") from None
    path.chmod(0o666 & ~_umask())
    return path


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask must set one to read it: racy with threads)
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        current = os.umask(0o022)
        os.umask(current)
        return current


def save_pretrained(model: nn.Module, folder: str | Path, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ the tokenizer) so transformers and we can load them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    encoder, _, head_name = _parts(model)
    architectures = key_table(encoder).architectures
    architecture = architectures.get(head_name, architectures[None])
    config = saved_config(model)
    if head_name == "span" and config.num_labels != 2:
        # transformers sizes qa_outputs from num_labels; a span head always has two (start, end).
        config = config.with_labels(["start", "end"])
    config.to_json_file(folder / "config.json", architectures=[architecture])
    save_weights(to_checkpoint_state(model), folder / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


# -- one plain checkpoint -------------------------------------------------------------------------------

@dataclass
class Loaded:
    """What loading a checkpoint gives: the model, and the facts about where it came from (instead of
    attributes stuck onto the module). `bert_engine.load` fills in the tokenizer.

    Unpacks as `model, tokenizer = load(...)`.
    """

    model: nn.Module
    checkpoint: Resolved  # what was asked for: the folder or Hub snapshot (an adapter's own folder)
    report: LoadReport  # missing / unexpected / defaulted keys
    tokenizer: Tokenizer | None = None
    adapter: dict[str, Any] | None = None  # an adapter's config (rank, targets, base_model, ...) and folder
    base: Resolved | None = None  # an adapter's base model
    tokenizer_folder: Path | None = None  # where the tokenizer files are (default: the checkpoint's folder)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer))

    @property
    def untrained(self) -> bool:
        """Some of the model's parameters (a new head) were not in the checkpoint."""
        return bool(self.report.missing)


def load_model(resolved: Resolved, head: str | nn.Module | None = None, *, labels: list[str] | None = None,
               attn_backend: str = "sdpa", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               strict: bool = False, warn_missing: bool = True) -> Loaded:
    """A checkpoint in the Hugging Face layout (already resolved to a local folder) as a BertModel,
    or a BertWithHead when `head` is given; see bert_engine.load for the arguments.

    Raises:
        CheckpointError: a file is unsafe, corrupt, or does not fit (names the file and the tensor).
        ValueError: config.json holds impossible values.
    """
    if not (resolved.folder / "config.json").is_file():
        raise CheckpointError(f"{resolved.folder}: no config.json; not a checkpoint in the Hugging Face layout")
    config_file = metadata_file(resolved.folder, "config.json")
    config = BertConfig.from_json_file(config_file, attn_backend=attn_backend)
    if labels is not None:
        config = config.with_labels(list(labels))
    weights = find_weights(resolved.folder)
    check_size(config, weights, resolved.folder.name)  # before any tensor is read or allocated
    checkpoint = read_weights(weights)
    if head == "auto":
        head = _head_from_architectures(config_file)
    if head is None:
        family = key_table(config)
        has_pooler = any(normalise_key(k, family).startswith("pooler") for k in checkpoint)
        model: nn.Module = BertModel(config, add_pooler=has_pooler)
    else:
        # A task passes a head factory: it needs the checkpoint's config (sizes, labels) first.
        model = BertWithHead(config, head(config) if callable(head) and not isinstance(head, nn.Module) else head)
    report = load_state(model, checkpoint, source=str(weights), strict=strict, warn_missing=warn_missing)
    model.to(device=device, dtype=dtype).eval()
    return Loaded(model, resolved, report)


def _head_from_architectures(config_file: Path) -> str | None:
    data = json.loads(config_file.read_text(encoding="utf-8"))
    family = KEY_TABLES.get(data.get("model_type", "bert"), KEY_TABLES["bert"])
    names = data.get("architectures") or [family.architectures[None]]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{config_file.name}: architectures must be a list of class names, got {names!r:.80}")
    by_class = {cls: head for head, cls in family.architectures.items()}
    if names[0] not in by_class:
        raise CheckpointError(f"{config_file}: architecture {names[0]!r} is not one of {sorted(by_class)}")
    return by_class[names[0]]
