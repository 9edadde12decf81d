"""Small heads over the encoder's output, and `BertWithHead`, the encoder plus one head.

Each built-in head matches a standard checkpoint head (masked-LM, next-sentence, pretraining,
sequence / token classification, span) so that checkpoints/loading.py can map its weights by name.
Losses and task logic live with the tasks, not here.

Shape legend: B batch, T tokens, H hidden size, V vocab, L labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import BertConfig
from .model import ACT2FN, BertModel, EncoderOutput, init_weights

IGNORE_INDEX = -100  # the label of a position without a loss (cross_entropy's ignore_index)


@dataclass
class MaskedLMOutput:
    logits: Tensor  # (B, T, V)
    encoder: EncoderOutput | None = None


@dataclass
class PretrainingOutput:
    mlm_logits: Tensor  # (B, T, V)
    nsp_logits: Tensor  # (B, 2): index 0 "B follows A", 1 "B is random"
    encoder: EncoderOutput | None = None


@dataclass
class ClassifierOutput:
    logits: Tensor  # (B, L) per sequence, or (B, T, L) per token
    encoder: EncoderOutput | None = None


@dataclass
class SpanOutput:
    start_logits: Tensor  # (B, T)
    end_logits: Tensor  # (B, T)
    encoder: EncoderOutput | None = None


def _dropout(config: BertConfig) -> nn.Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(p)


class MaskedLMHead(nn.Module):
    """transform (dense + act + LayerNorm) then a decoder tied to the word embeddings, plus a bias."""

    kind = "mlm"  # the checkpoint head it matches (loading.HEAD_TABLES)
    needs_pooler = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E = config.embedding_width  # ALBERT predicts through its smaller embeddings: H -> E -> V
        self.transform = nn.Linear(config.hidden_size, E)
        self.act = ACT2FN[config.family.mlm_activation or config.hidden_act]  # RoBERTa's lm_head: gelu
        self.transform_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(E, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def tie_to(self, word_embeddings: nn.Embedding) -> None:
        """Share the decoder matrix with the input embeddings, as BERT was trained."""
        self.decoder.weight = word_embeddings.weight

    def logits(self, hidden_states: Tensor) -> Tensor:
        """(…, H) -> (…, V); pass only the masked positions to save the V-wide matmul elsewhere."""
        h = self.transform_norm(self.act(self.transform(hidden_states)))
        return self.decoder(h) + self.bias

    def forward(self, encoded: EncoderOutput, positions: Tensor | None = None) -> MaskedLMOutput:
        """Logits (B, T, V); with `positions` ((B, T) bool), only there: (N, V), N = positions.sum()."""
        hidden = encoded.last_hidden_state
        return MaskedLMOutput(self.logits(hidden if positions is None else hidden[positions]))


class NextSentenceHead(nn.Module):
    """Linear over the pooled [CLS] vector: does segment B follow segment A?"""

    kind = "nsp"  # the checkpoint head it matches (loading.HEAD_TABLES)
    needs_pooler = True

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.classifier = nn.Linear(config.hidden_size, 2)

    def forward(self, encoded: EncoderOutput) -> ClassifierOutput:
        return ClassifierOutput(self.classifier(encoded.pooled))  # (B, 2)


class PretrainingHead(nn.Module):
    """Masked-LM and next-sentence heads together, as in BERT's pretraining."""

    kind = "pretraining"  # the checkpoint head it matches (loading.HEAD_TABLES)
    needs_pooler = True

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.mlm = MaskedLMHead(config)
        self.nsp = NextSentenceHead(config)

    def tie_to(self, word_embeddings: nn.Embedding) -> None:
        self.mlm.tie_to(word_embeddings)

    def forward(self, encoded: EncoderOutput, positions: Tensor | None = None) -> PretrainingOutput:
        return PretrainingOutput(self.mlm(encoded, positions).logits, self.nsp(encoded).logits)


class _LinearClassifierHead(nn.Module):
    """Dropout + linear from H to the config's labels, over the features `_features` picks."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.num_labels < 1:
            raise ValueError(f"a {self.kind} classification head needs labels: config.id2label is empty")
        self.dropout = _dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, encoded: EncoderOutput) -> ClassifierOutput:
        return ClassifierOutput(self.classifier(self.dropout(self._features(encoded))))


class SequenceClassificationHead(_LinearClassifierHead):
    """One label distribution per sequence, from the pooled [CLS] vector: logits (B, L)."""

    kind = "sequence"  # the checkpoint head it matches (loading.HEAD_TABLES)
    needs_pooler = True

    @staticmethod
    def _features(encoded: EncoderOutput) -> Tensor:
        return encoded.pooled  # (B, H)


class TokenClassificationHead(_LinearClassifierHead):
    """One label distribution per token, from every hidden state: logits (B, T, L)."""

    kind = "token"  # the checkpoint head it matches (loading.HEAD_TABLES)
    needs_pooler = False

    @staticmethod
    def _features(encoded: EncoderOutput) -> Tensor:
        return encoded.last_hidden_state  # (B, T, H)


class SpanHead(nn.Module):
    """Linear H -> 2 over every token: start and end logits of an answer span (extractive QA)."""

    kind = "span"  # the checkpoint head it matches (loading.HEAD_TABLES)
    needs_pooler = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def forward(self, encoded: EncoderOutput) -> SpanOutput:
        logits = self.qa_outputs(encoded.last_hidden_state)  # (B, T, 2)
        return SpanOutput(logits[..., 0], logits[..., 1], encoded)  # the encoder's padding mask, for the loss


HEADS: dict[str, type[nn.Module]] = {
    "mlm": MaskedLMHead,
    "nsp": NextSentenceHead,
    "pretraining": PretrainingHead,
    "sequence": SequenceClassificationHead,
    "token": TokenClassificationHead,
    "span": SpanHead,
}


class BertWithHead(nn.Module):
    """The encoder and one head; `forward` takes the encoder's arguments and returns the head's output.

    Args:
        config: encoder hyper-parameters (and labels, for classification heads).
        head: a name from HEADS, or any module whose forward takes an EncoderOutput (task heads).
            A head with `tie_to` gets the word embeddings; `needs_pooler` (default True) decides the
            pooler; `kind` (a HEADS name) says which checkpoint head its weights are stored as;
            `optional_parameters` (name prefixes) may be absent from a checkpoint and keep their
            defaults without marking the head untrained (a CRF over a plain token head).
    """

    def __init__(self, config: BertConfig, head: str | nn.Module) -> None:
        super().__init__()
        if isinstance(head, str):
            if head not in HEADS:
                raise ValueError(f"unknown head {head!r}; choose one of {', '.join(sorted(HEADS))}, or auto (what "
                                 "the checkpoint's config names, when loading one)")
            self.head_name = head
            head = HEADS[head](config)
            head.apply(lambda module: init_weights(module, config.initializer_range))
        else:
            if not isinstance(head, nn.Module):  # a task's build_head returned a function, a tensor, None...
                raise TypeError(f"a head must be an nn.Module (a task's build_head returns one), got "
                                f"{type(head).__name__} {head!r:.60}")
            # A task's own head: `kind` names the standard checkpoint head its weights follow, if any.
            self.head_name = getattr(head, "kind", None) or type(head).__name__
        self.config = config
        self.encoder = BertModel(config, add_pooler=getattr(head, "needs_pooler", True))
        self.head = head
        if hasattr(head, "tie_to"):
            head.tie_to(self.encoder.embeddings.word_embeddings)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, position_ids: Tensor | None = None,
                output_attentions: bool = False, output_hidden_states: bool = False,
                predict_positions: Tensor | None = None, first_token_only: bool = False):
        """`predict_positions` ((B, T) bool), for the masked-LM heads only: vocabulary logits at those
        positions alone, (N, V), as training needs them; the V-wide matmul over every other position
        is most of an MLM step's time on a small encoder. `first_token_only` (BertModel's), for a caller
        that reads nothing but what the head makes of [CLS] (a task puts it in its batch's
        meta["model_kwargs"]): the last layer computes each row's first token alone, and the output's
        encoder.last_hidden_state is (B, 1, H)."""
        encoded = self.encoder(input_ids, attention_mask, token_type_ids, position_ids, output_attentions,
                               output_hidden_states, first_token_only=first_token_only and predict_positions is None)
        if predict_positions is None:
            output = self.head(encoded)
        elif isinstance(self.head, (MaskedLMHead, PretrainingHead)):
            output = self.head(encoded, predict_positions)
        else:
            raise ValueError(f"predict_positions applies to masked-LM heads, not {type(self.head).__name__}")
        if hasattr(output, "encoder"):
            output.encoder = encoded
        return output
