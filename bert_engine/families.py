"""The model families the engine builds, loads and saves, one record each: what sets a family's
encoder apart from BERT's. Code asks the record (`config.family.segments`), never the family's name;
how a family's checkpoint *names* its weights is checkpoints/loading.py's key tables. See
docs/families.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Family:
    """One family's quirks, read wherever the encoder, its heads, its config.json or its pretraining differ."""

    name: str  # config.json's model_type
    objective: str  # the pretraining objective its checkpoints were trained with ("mlm+nsp", "mlm+sop", "mlm")
    segments: int | None = 2  # segment (token_type) embeddings a preset gets: BERT 2, RoBERTa 1, DistilBERT none
    positions_after_padding: bool = False  # RoBERTa: real tokens are numbered from pad_token_id + 1
    shared_layers: bool = False  # ALBERT: narrow embeddings projected to hidden_size, layers shared in groups
    pooler_activation: str = "tanh"  # DistilBERT's pre_classifier uses ReLU
    mlm_activation: str | None = None  # the MLM transform's activation when it is not hidden_act (RoBERTa: gelu)
    distillable: bool = True  # a student keeps every other layer (meaningless when the layers are shared)
    # config.json: the family's own spelling of our keys (theirs -> ours), defaults it leaves unwritten,
    # keys that change nothing, the classifier dropout's key, and keys transformers' class insists on
    config_keys: Mapping[str, str] = field(default_factory=dict)
    config_defaults: Mapping[str, object] = field(default_factory=dict)
    config_metadata: frozenset[str] = frozenset()
    classifier_dropout_key: str = "classifier_dropout"
    classifier_dropout_required: bool = False  # transformers' config class needs a number, not null

    @property
    def has_segments(self) -> bool:
        return self.segments is not None

    def position_offset(self, pad_token_id: int) -> int:
        """The position of the first real token."""
        return pad_token_id + 1 if self.positions_after_padding else 0


FAMILIES: Mapping[str, Family] = MappingProxyType({
    "bert": Family("bert", "mlm+nsp"),
    "roberta": Family("roberta", "mlm", segments=1, positions_after_padding=True, mlm_activation="gelu"),
    "albert": Family(
        "albert", "mlm+sop", shared_layers=True, distillable=False,
        config_metadata=frozenset({"down_scale_factor", "gap_size", "net_structure_type", "num_memory_blocks"}),
        classifier_dropout_key="classifier_dropout_prob", classifier_dropout_required=True),
    "distilbert": Family(
        "distilbert", "mlm", segments=None, pooler_activation="relu",
        config_keys={"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                     "hidden_dim": "intermediate_size", "activation": "hidden_act", "dropout": "hidden_dropout_prob",
                     "attention_dropout": "attention_probs_dropout_prob", "seq_classif_dropout": "classifier_dropout"},
        config_defaults={"type_vocab_size": 0, "layer_norm_eps": 1e-12},  # its LayerNorms use 1e-12, not a key
        config_metadata=frozenset({"qa_dropout", "tie_weights_", "sinusoidal_pos_embds"}),
        classifier_dropout_required=True),
})


def family(name: str) -> Family:
    """The record of `name`.

    Raises:
        ValueError: naming the family and the known ones.
    """
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"model_type {name!r} is not one of {tuple(FAMILIES)}") from None
