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
        "tie_word_embeddings",  # BERT always ties the MLM decoder; loading.py warns if a checkpoint differs
    }
)
# Keys written by transformers whose non-default value would change the model in a way this
# encoder does not implement; we refuse them instead of silently computing something else.
_UNSUPPORTED_IF_TRUE = ("is_decoder", "add_cross_attention", "chunk_size_feed_forward")

# Runtime-only fields: not part of the checkpoint, never written to config.json.
_RUNTIME_FIELDS = ("attn_backend",)


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
    model_type: str = "bert"
    attn_backend: AttnBackend = "sdpa"  # runtime: "sdpa" (fast) or "eager" (reference, can return weights)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "type_vocab_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
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
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary of size {self.vocab_size}")
        if self.attn_backend not in ("eager", "sdpa"):
            raise ValueError(f"attn_backend {self.attn_backend!r} is not one of 'eager', 'sdpa'")
        if self.model_type != "bert":
            raise ValueError(f"model_type {self.model_type!r} is not 'bert'")
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
        for key in _UNSUPPORTED_IF_TRUE:
            if data.get(key):
                raise ValueError(f"{source}: {key}={data[key]!r} is not supported by this encoder-only BERT")
        unknown = sorted(set(data) - known - _METADATA_KEYS - set(_UNSUPPORTED_IF_TRUE))
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
        H, I, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * H + 2 * H
        layer = 4 * H * H + 4 * H + 2 * H * I + I + H + 4 * H  # q, k, v, out; up, down; two LayerNorms
        return embeddings + L * layer + H * H + H

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
