"""BertConfig: the model's hyper-parameters, read from and written to a published `config.json`.

Field names are the keys BERT checkpoints use, so loading a config is "keep known keys,
construct". Runtime choices that are not part of the checkpoint (the attention backend) are
typed fields too but are never written to disk. Training settings live elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bert_engine.families import FAMILIES, Family
from bert_engine.families import family as get_family

logger = logging.getLogger(__name__)

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish", "tanh")
AttnBackend = Literal["eager", "sdpa"]

# Keys that transformers writes into config.json as bookkeeping; they do not change the model.
# They are accepted quietly; any other key we do not know is reported by name.
_METADATA_KEYS = frozenset(
    {
        "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype",
        "gradient_checkpointing", "use_cache", "output_past", "finetuning_task",
        "bos_token_id", "eos_token_id", "directionality", "pooler_fc_size", "pooler_num_attention_heads",
        "pooler_num_fc_layers", "pooler_size_per_head", "pooler_type", "tokenizer_class",
        "num_labels",  # (transformers derives it from id2label, which says the labels here)
        "tie_word_embeddings",  # BERT always ties the MLM decoder; checkpoints/loading.py warns if a checkpoint differs
    }
)
# Keys written by transformers whose non-default value would change the model in a way this
# encoder does not implement; we refuse them instead of silently computing something else.
_UNSUPPORTED_IF_TRUE = ("is_decoder", "add_cross_attention", "chunk_size_feed_forward")

# Runtime-only fields: not part of the checkpoint, never written to config.json.
_RUNTIME_FIELDS = ("attn_backend",)

# Limits a config.json must pass before any module is built (a hostile or mistaken file could ask for
# a 100,000-layer ALBERT: tiny in parameters, endless in work). The largest published encoders apply 48.
MAX_APPLIED_LAYERS = 256
MAX_FLOPS_PER_TOKEN = 10 * 10**9

# The fields of a family with shared layers (ALBERT), written only for it.
_SHARED_LAYER_FIELDS = ("embedding_size", "num_hidden_groups", "inner_group_num")


@dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters of a BERT encoder; defaults describe bert-base-uncased.

    Raises:
        ValueError: on any impossible value, naming the field and the numbers involved.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # "gelu" is the exact erf form the original weights were trained with
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # number of segment ids (sentence A / B)
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12  # the original TF checkpoints were trained with 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"  # the only kind BERT checkpoints use
    classifier_dropout: float | None = None  # None: heads use hidden_dropout_prob
    id2label: dict[int, str] = field(default_factory=dict)
    label2id: dict[str, int] = field(default_factory=dict)
    problem_type: str | None = None  # "single_label_classification" | "multi_label_classification" | "regression"
    model_type: str = "bert"  # the family: bert, roberta, albert or distilbert
    # ALBERT: embeddings of this size projected to hidden_size, and layers shared in groups (layer i of
    # num_hidden_layers runs group int(i / (num_hidden_layers / num_hidden_groups)), all inner_group_num layers of it)
    embedding_size: int | None = None
    num_hidden_groups: int = 1
    inner_group_num: int = 1
    attn_backend: AttnBackend = "sdpa"  # runtime: "sdpa" (fast) or "eager" (reference, can return weights)

    def __post_init__(self) -> None:
        family = get_family(self.model_type)
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "num_hidden_groups", "inner_group_num")
        if family.has_segments:
            positive += ("type_vocab_size",)
        elif self.type_vocab_size != 0:
            raise ValueError(f"type_vocab_size must be 0 for {family.name} (it has no segments), "
                             f"got {self.type_vocab_size!r}")
        if family.shared_layers:
            if self.embedding_size is None:
                object.__setattr__(self, "embedding_size", 128)  # transformers' AlbertConfig default
            positive += ("embedding_size",)
        elif (self.embedding_size not in (None, self.hidden_size) or self.num_hidden_groups != 1
              or self.inner_group_num != 1):
            raise ValueError(f"embedding_size, num_hidden_groups and inner_group_num are ALBERT's; a "
                             f"{family.name} model has embedding_size {self.hidden_size} and no layer groups")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "layer_norm_eps", "classifier_dropout"):
            value = getattr(self, name)  # (a string: "'>' not supported between 'str' and 'int'", no field named)
            if not (value is None and name == "classifier_dropout") and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(f"classifier_dropout must be in [0, 1) or None, got {self.classifier_dropout!r}")
        if not (isinstance(self.initializer_range, (int, float)) and 0 < self.initializer_range < 10):
            raise ValueError(f"initializer_range must be a positive number below 10, got {self.initializer_range!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; choose one of {ACTIVATIONS}")
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"position_embedding_type {self.position_embedding_type!r} is not supported; "
                "this engine implements the 'absolute' learned positions of BERT"
            )
        applied = self.applied_layers
        if applied > MAX_APPLIED_LAYERS:  # before anything is built: ALBERT's shared layers pass the parameter limit
            raise ValueError(f"the encoder would apply {applied:,} layers per token (num_hidden_layers "
                             f"{self.num_hidden_layers:,}" + (f" x inner_group_num {self.inner_group_num:,}"
                             if family.shared_layers else "") + f"); the limit is {MAX_APPLIED_LAYERS}")
        if self.flops_per_token > MAX_FLOPS_PER_TOKEN:
            raise ValueError(f"the encoder would cost {self.flops_per_token / 1e9:,.1f} GFLOP per token; the limit is "
                             f"{MAX_FLOPS_PER_TOKEN / 1e9:.0f} (bert-large costs 0.6, ALBERT-xxlarge 4.8)")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            raise ValueError(f"pad_token_id must be an integer token id, got {self.pad_token_id!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary of size {self.vocab_size}")
        if self.attn_backend not in ("eager", "sdpa"):
            raise ValueError(f"attn_backend {self.attn_backend!r} is not one of 'eager', 'sdpa'")
        if self.max_position_embeddings <= self.position_offset:
            raise ValueError(f"max_position_embeddings {self.max_position_embeddings} leaves no position after "
                             f"{family.name}'s offset of pad_token_id + 1 = {self.position_offset}")
        # JSON keys are strings; checkpoints store id2label as {"0": "NEGATIVE", ...}, and some
        # writers store null for an absent mapping.
        for name in ("id2label", "label2id"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, {})
            elif not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a mapping, got {type(getattr(self, name)).__name__}")
        try:
            id2label = {int(k): str(v) for k, v in self.id2label.items()}
            label2id = {str(k): int(v) for k, v in self.label2id.items()} or {v: k for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ValueError(f"id2label must map integer ids to names, got {self.id2label!r:.100}") from None
        if id2label and sorted(id2label) != list(range(len(id2label))):
            raise ValueError(f"id2label keys must be 0..{len(id2label) - 1}, got {sorted(id2label)}")
        object.__setattr__(self, "id2label", id2label)
        object.__setattr__(self, "label2id", label2id)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def family(self) -> Family:
        """The family's quirks (bert_engine.families)."""
        return get_family(self.model_type)

    @property
    def embedding_width(self) -> int:
        """The size of the token embeddings: ALBERT's embedding_size, otherwise hidden_size."""
        return self.embedding_size if self.family.shared_layers else self.hidden_size

    @property
    def position_offset(self) -> int:
        """RoBERTa numbers real tokens from pad_token_id + 1 (padding sits at pad_token_id); others from 0."""
        return self.family.position_offset(self.pad_token_id)

    @property
    def max_tokens(self) -> int:
        """The longest row the position table allows."""
        return self.max_position_embeddings - self.position_offset

    def with_labels(self, labels: list[str] | tuple[str, ...]) -> BertConfig:
        """A copy whose id2label/label2id describe `labels` in order."""
        return dataclasses.replace(
            self, id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}
        )

    # -- config.json ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config", **overrides: Any) -> BertConfig:
        """Build a config from the keys of a config.json; unknown keys are logged by name.

        Raises:
            ValueError: if a value is impossible, or an option this encoder does not implement is set.
        """
        known = {f.name for f in dataclasses.fields(cls)} - set(_RUNTIME_FIELDS)
        data = dict(data)
        try:
            family = get_family(data.get("model_type", "bert"))
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        if data.get("sinusoidal_pos_embds"):  # stored as weights all the same; they load like learned ones
            logger.info("%s: sinusoidal position embeddings are read from the weights", source)
        data = {family.config_keys.get(k, k): v for k, v in data.items()}
        for key, value in family.config_defaults.items():
            data.setdefault(key, value)
        if family.classifier_dropout_key in data:
            data["classifier_dropout"] = data.pop(family.classifier_dropout_key)
        metadata = _METADATA_KEYS.union(*(f.config_metadata for f in FAMILIES.values()))
        for key in _UNSUPPORTED_IF_TRUE:
            if data.get(key):
                raise ValueError(f"{source}: {key}={data[key]!r} is not supported by this encoder-only BERT")
        unknown = sorted(set(data) - known - metadata - set(_UNSUPPORTED_IF_TRUE))
        if unknown:
            logger.warning("%s: ignoring unknown config keys %s", source, ", ".join(unknown))
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs.update(overrides)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """The config.json form: checkpoint keys only, label ids as strings like transformers writes them."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _RUNTIME_FIELDS}
        data["id2label"] = {str(k): v for k, v in self.id2label.items()}
        if not self.id2label:
            del data["id2label"], data["label2id"]
        if self.problem_type is None:
            del data["problem_type"]
        family = self.family
        if not family.shared_layers:
            for name in _SHARED_LAYER_FIELDS:
                del data[name]
        if family.classifier_dropout_required and data["classifier_dropout"] is None:
            data["classifier_dropout"] = self.hidden_dropout_prob  # what our heads use; these configs need a number
        data[family.classifier_dropout_key] = data.pop("classifier_dropout")
        for theirs, ours in family.config_keys.items():  # the family's own spelling (DistilBertConfig's)
            data[theirs] = data.pop(ours)
        for name in family.config_defaults:
            del data[name]
        if "qa_dropout" in family.config_metadata:  # DistilBertConfig's keys of the same meaning
            data.update(sinusoidal_pos_embds=False, qa_dropout=data["dropout"], tie_weights_=True)
        return data

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides: Any) -> BertConfig:
        """Read a config.json file.

        Raises:
            FileNotFoundError: if `path` does not exist.
            ValueError: if the file is not a JSON object or holds impossible values (the path is named).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a UTF-8 text file") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply to be a config") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, source=str(path), **overrides)

    def parameter_count(self) -> int:
        """Parameters of the encoder this config describes (embeddings, layers, pooler), computed
        without allocating anything; loading compares it with a limit and with the weights' size."""
        H, I, E = self.hidden_size, self.intermediate_size, self.embedding_width
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * E + 2 * E
        if self.family.shared_layers:
            embeddings += E * H + H  # the projection to hidden_size
        layer = 4 * H * H + 4 * H + 2 * H * I + I + H + 4 * H  # q, k, v, out; up, down; two LayerNorms
        return embeddings + self.distinct_layers * layer + H * H + H

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of one token's pass through the encoder's layers (attention over other
        tokens left out): every applied layer's q, k, v, out and FFN matmuls. The cost a request's
        token counts in, whatever the family (ALBERT applies its shared layers many times)."""
        H, I = self.hidden_size, self.intermediate_size
        return 2 * self.applied_layers * (4 * H * H + 2 * H * I)

    def forward_flops(self, rows: int, length: int) -> int:
        """FLOPs of one forward pass over `rows` rows of `length` tokens: every applied layer's
        projections (flops_per_token) and its attention over the row (q·kᵀ and weights·v, 2 x 2·T·H per
        token). What a request costs the machine: the fairness gate charges and sizes chunks by it."""
        return rows * length * (self.flops_per_token + 4 * self.applied_layers * length * self.hidden_size)

    @property
    def applied_layers(self) -> int:
        """Layers a token passes through: ALBERT runs each of its inner_group_num layers at every step."""
        return self.num_hidden_layers * (self.inner_group_num if self.family.shared_layers else 1)

    @property
    def distinct_layers(self) -> int:
        """Layers with weights of their own: ALBERT shares them, num_hidden_groups x inner_group_num."""
        if self.family.shared_layers:
            return self.num_hidden_groups * self.inner_group_num
        return self.num_hidden_layers

    def layer_schedule(self) -> list[int]:
        """The distinct layer each of the encoder's steps runs, in order (ALBERT repeats its groups)."""
        if not self.family.shared_layers:
            return list(range(self.num_hidden_layers))
        return [group * self.inner_group_num + inner for i in range(self.num_hidden_layers)
                for group in [int(i / (self.num_hidden_layers / self.num_hidden_groups))]  # transformers' arithmetic
                for inner in range(self.inner_group_num)]

    def to_json_file(self, path: str | Path, **extra: Any) -> None:
        """Write config.json; `extra` adds keys such as `architectures`."""
        Path(path).write_text(json.dumps({**self.to_dict(), **extra}, indent=2, sort_keys=True) + "\n", encoding="utf-8")


PRESETS: dict[str, BertConfig] = {
    # tiny: tests and demos; unequal sizes make a wrong transpose fail loudly.
    "tiny": BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=37, max_position_embeddings=64),
    "mini": BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "small": BertConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "base": BertConfig(),
}
