"""The BERT encoder: embeddings -> N post-LayerNorm transformer layers -> tanh pooler.

Holds the attention backends (an eager reference that can return weights, and SDPA) and
nothing task-specific: heads live in heads.py, checkpoint names in checkpoints/loading.py.

Shape legend: B batch, T tokens, H hidden size, N heads, D head size (H = N·D), I intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import BertConfig


@dataclass
class EncoderOutput:
    """What the encoder returns.

    last_hidden_state: (B, T, H) float; zeros at padding where the padding-free path ran
        (BertModel.padding_free). pooled: (B, H) tanh(dense(h_[CLS])), or None without a pooler.
    attentions: one (B, N, T, T) tensor per layer when asked for, else None.
    attention_mask: the (B, T) padding mask the encoder was given (None: no padding).
    hidden_states: the embeddings' output and every layer's, (B, T, H) each, when asked for.
    """

    last_hidden_state: Tensor
    pooled: Tensor | None = None
    attentions: tuple[Tensor, ...] | None = None
    attention_mask: Tensor | None = None  # (B, T) the input mask, for heads that pool or decode over tokens
    hidden_states: tuple[Tensor, ...] | None = None


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACT2FN: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact erf form, as in the original BERT
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def additive_padding_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Turn a (B, T) 1/0 padding mask into a (B, 1, 1, T) mask added to attention scores.

    Padded keys get the dtype's most negative finite value rather than -inf: a row whose keys
    are all padding then softmaxes to a uniform (finite) distribution instead of NaN, so a
    fully padded sequence in a batch cannot poison the gradients or the other rows.
    """
    mask = attention_mask[:, None, None, :].to(dtype)  # (B, 1, 1, T)
    return (1.0 - mask) * torch.finfo(dtype).min


# -- attention backends: (q, k, v, mask, dropout_p, need_weights) -> (context, weights | None) -------

def eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                    need_weights: bool) -> tuple[Tensor, Tensor | None]:
    """Reference attention, softmax(q·kᵀ/√D + mask)·v; q, k, v are (B, N, T, D)."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, N, T, T)
    if mask is not None:
        scores = scores + mask
    # Softmax in float32: half-precision softmax over long rows loses the small probabilities.
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)  # (B, N, T, T)
    context = F.dropout(weights, p=dropout_p) @ v  # (B, N, T, D)
    return context, weights if need_weights else None


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                   need_weights: bool) -> tuple[Tensor, Tensor | None]:
    """Fused attention through torch's scaled_dot_product_attention; cannot return weights."""
    if need_weights:
        raise ValueError("the 'sdpa' attention backend cannot return attention weights; use 'eager'")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None


ATTENTION_BACKENDS = {"eager": eager_attention, "sdpa": sdpa_attention}

# Called after each applied layer but the last, with the number of layers applied so far, where set: the
# runtime hands its turn at the fairness gate back between layers when one row is more work than a turn
# (runtime/inference.py), so a deep model's row cannot hold the machine for seconds.
BETWEEN_LAYERS: ContextVar[Callable[[int], None] | None] = ContextVar("bert_engine_between_layers", default=None)


class Unpadded:
    """Where the real tokens of a padded (B, T) batch lie, to run the token-wise work (every linear
    layer, LayerNorm, GELU) on those R tokens alone and pad only for attention, which needs the
    (B, N, T, T) layout. On a mixed-length batch that skips the padding's share of the matmuls;
    the real tokens' values are the padded path's (the same maths, rows in another order).
    """

    def __init__(self, attention_mask: Tensor) -> None:
        self.batch, self.tokens = attention_mask.shape
        self.index = attention_mask.reshape(-1).nonzero().squeeze(-1)  # (R,) flat positions in B*T

    def unpad(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (R, ...)."""
        return x.reshape(self.batch * self.tokens, *x.shape[2:]).index_select(0, self.index)

    def pad(self, x: Tensor) -> Tensor:
        """(R, ...) -> (B, T, ...), zeros at padding."""
        full = x.new_zeros(self.batch * self.tokens, *x.shape[1:]).index_copy(0, self.index, x)
        return full.view(self.batch, self.tokens, *x.shape[1:])


# -- modules in forward order --------------------------------------------------------------------

class BertEmbeddings(nn.Module):
    """Token + learned absolute position + segment embeddings, then LayerNorm and dropout.

    Per family: ALBERT's are embedding_size wide (BertModel projects them to hidden_size); RoBERTa
    numbers positions from pad_token_id + 1 and gives padding the position pad_token_id; DistilBERT
    has no segment embeddings (token_type_ids are ignored).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E = config.embedding_width
        self.word_embeddings = nn.Embedding(config.vocab_size, E, padding_idx=config.pad_token_id)
        padding = config.pad_token_id if config.family.positions_after_padding else None
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, E, padding_idx=padding)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, E) if config.type_vocab_size else None
        self.layer_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.roberta_padding = padding
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings), persistent=False)

    # Set by runtime.fast.use_kernels where the layers run as one C call each: the embeddings in one too, for
    # inference (fast.fused_embeddings), which answers None where it does not apply.
    fused: Callable[..., Tensor | None] | None = None

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        if self.fused is not None and not self.training:
            out = self.fused(self, input_ids, token_type_ids, position_ids)
            if out is not None:
                return out
        B, T = input_ids.shape
        if position_ids is None:
            if self.roberta_padding is None:
                position_ids = self.position_ids[:T]  # (T,) broadcast over the batch
            else:  # RoBERTa: real tokens count from padding_idx + 1, padding keeps padding_idx
                real = input_ids.ne(self.roberta_padding).to(torch.long)  # (B, T)
                position_ids = torch.cumsum(real, dim=1) * real + self.roberta_padding
        x = self.word_embeddings(input_ids)  # (B, T, E)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)  # (B, T, E)
        return self.dropout(self.layer_norm(x))


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused q/k/v projection and an output projection.

    The checkpoint's separate query/key/value matrices are concatenated on load (checkpoints/loading.py),
    so one (3H, H) matmul replaces three (H, H) ones.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob
        self.attend = ATTENTION_BACKENDS[config.attn_backend]

    # Set by runtime.fast.use_attention where bert_engine's own attention (fused_layer.c, each sequence over its own
    # tokens, no padding) timed faster than torch's on this machine: for inference, it answers None where it does
    # not apply and the backend runs.
    native: Callable[..., Tensor | None] | None = None

    def forward(self, x: Tensor, mask: Tensor | None, need_weights: bool = False,
                unpadded: Unpadded | None = None) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, H), or (R, H) real tokens with `unpadded` saying where they lie in (B, T)."""
        qkv = self.qkv(x)  # (B, T, 3H) or (R, 3H)
        if self.native is not None and not need_weights and not self.training:
            context = self.native(self, qkv, mask, unpadded)  # (B, T, H) or (R, H), as qkv
            if context is not None:
                return self.out(context), None
        if unpadded is not None:
            qkv = unpadded.pad(qkv)  # (B, T, 3H): attention needs the batch layout
        B, T, H3 = qkv.shape
        N = self.num_heads
        qkv = qkv.view(B, T, 3, N, H3 // (3 * N)).permute(2, 0, 3, 1, 4)  # (3, B, N, T, D)
        attend = eager_attention if need_weights else self.attend
        context, weights = attend(qkv[0], qkv[1], qkv[2], mask, self.dropout_p if self.training else 0.0,
                                  need_weights)  # (B, N, T, D)
        context = context.transpose(1, 2).reshape(B, T, H3 // 3)  # (B, T, H)
        if unpadded is not None:
            context = unpadded.unpad(context)  # (R, H)
        return self.out(context), weights


class FeedForward(nn.Module):
    """Position-wise H -> I -> H with the configured activation (GELU for BERT).

    `chunk_rows` (None: off): in inference, inputs of more rows (tokens) than this run through the layer
    that many rows at a time. The int8 projections set it (runtime.fast.quantize_int8): each makes several
    passes over the (rows, I) intermediate (the row scales, the rotation, the codes), which at 32 x 128
    tokens is 25 MB in MiniLM and goes to memory on every pass; in chunks it stays in cache. The output is
    the same to the bit: every row is computed on its own.
    """

    chunk_rows: int | None = None

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        rows = self.chunk_rows
        if rows is not None and not self.training and x.numel() > rows * x.shape[-1]:
            parts = x.reshape(-1, x.shape[-1]).split(rows)  # (rows, H) each
            out = torch.cat([self.down(self.act(self.up(part))) for part in parts])
            return out.view(*x.shape[:-1], out.shape[-1])
        return self.down(self.act(self.up(x)))  # (B, T, H)


class BertLayer(nn.Module):
    """One post-LN transformer layer: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    # Set by runtime.fast.use_kernels where the projections run bert_engine's own AVX2 kernel: the whole layer
    # in one C call for inference (fast.fused_layer), which answers None where it does not apply.
    fused: Callable[..., Tensor | None] | None = None

    def forward(self, x: Tensor, mask: Tensor | None, need_weights: bool = False,
                unpadded: Unpadded | None = None, first_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """`first_only`: only each sequence's first token's output, (B, 1, H) (its keys and values are every
        token's): for the last layer under a head that reads [CLS] alone (BertModel's first_token_only)."""
        if self.fused is not None and not need_weights and not self.training:
            out = self.fused(self, x, mask, unpadded, first_only)
            if out is not None:
                return out, None
        if first_only:
            return self._first_rows(x, mask, unpadded), None
        attended, weights = self.attention(x, mask, need_weights, unpadded)
        x = self.attention_norm(x + self.dropout(attended))  # (B, T, H) or (R, H)
        x = self.ffn_norm(x + self.dropout(self.ffn(x)))
        return x, weights

    def _first_rows(self, x: Tensor, mask: Tensor | None, unpadded: Unpadded | None) -> Tensor:
        """The layer's output at position 0 of each row alone, (B, 1, H): one query per head against every key."""
        attention = self.attention
        qkv = attention.qkv(x)  # (B, T, 3H) or (R, 3H)
        if unpadded is not None:
            qkv, x = unpadded.pad(qkv), unpadded.pad(x)  # (B, T, ...)
        B, T, H3 = qkv.shape
        N = attention.num_heads
        qkv = qkv.view(B, T, 3, N, H3 // (3 * N)).permute(2, 0, 3, 1, 4)  # (3, B, N, T, D)
        context, _ = attention.attend(qkv[0][:, :, :1], qkv[1], qkv[2], mask,
                                      attention.dropout_p if self.training else 0.0, False)  # (B, N, 1, D)
        attended = attention.out(context.transpose(1, 2).reshape(B, 1, H3 // 3))  # (B, 1, H)
        x = self.attention_norm(x[:, :1] + self.dropout(attended))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class Pooler(nn.Module):
    """act(dense(hidden state of the first token, [CLS])): the sentence vector NSP was trained on.

    tanh for BERT, ALBERT and RoBERTa (whose classification head's dense + tanh loads here); ReLU for
    DistilBERT (its pre_classifier), so sequence heads see one `pooled` vector in every family.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = {"tanh": torch.tanh, "relu": torch.relu}[config.family.pooler_activation]

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.act(self.dense(hidden_states[:, 0]))  # (B, H)


class BertModel(nn.Module):
    """The BERT encoder, and the encoders of RoBERTa, ALBERT and DistilBERT (config.model_type): the
    same post-LN layers; the families differ in their embeddings (BertEmbeddings), ALBERT's projection
    from embedding_size and its shared layers (`layers` holds the distinct ones, `schedule` the order
    they run in), and the pooler's activation.

    Args:
        config: the hyper-parameters; `config.attn_backend` picks the attention backend.
        add_pooler: build the tanh pooler (checkpoints of masked-LM models have none).
    """

    # Padding-free layers (Unpadded): None (the default) in training only, where nothing reads the
    # padding; True always (inference sets it: precision.prepare_for_inference); False never. Where they
    # do not run, padding is computed as transformers does, so every output, padding included, matches.
    padding_free: bool | None = None
    # Set by runtime.fast.use_kernels with the layers' fused path: every layer in one C call where all of them run
    # fused (fast.fused_stack), which answers None where it does not apply and the layers run one by one.
    fused_stack: Callable[..., Tensor | None] | None = None

    def __init__(self, config: BertConfig, add_pooler: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        projected = config.family.shared_layers  # ALBERT: narrow embeddings, projected to hidden_size
        self.embedding_projection = nn.Linear(config.embedding_width, config.hidden_size) if projected else None
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.distinct_layers))
        self.schedule = config.layer_schedule()
        self.pooler = Pooler(config) if add_pooler else None
        self.apply(lambda module: init_weights(module, config.initializer_range))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, position_ids: Tensor | None = None,
                output_attentions: bool = False, output_hidden_states: bool = False,
                first_token_only: bool = False) -> EncoderOutput:
        """Encode a batch.

        Args:
            input_ids: (B, T) int64 token ids.
            attention_mask: (B, T) 1 for real tokens, 0 for padding; None means no padding.
            token_type_ids: (B, T) segment ids (0 for sentence A, 1 for B); None means all 0.
            position_ids: (B, T) or (T,) positions; None means 0..T-1.
            output_attentions: also return every layer's (B, N, T, T) weights; this runs the
                eager backend, the only one that materialises them.
            output_hidden_states: also return the input of the first layer and each layer's output.
            first_token_only: the last layer computes each row's first token alone (a classifier over [CLS]
                reads nothing else: most of that layer's work saved), and last_hidden_state is (B, 1, H).
                Ignored where attentions or hidden states are asked for, or a row's first token is padding.
        Raises:
            ValueError: if the batch is longer than the position table, or an id is out of range.
        """
        self._check_inputs(input_ids, token_type_ids)
        B, T = input_ids.shape
        if token_type_ids is None or self.config.type_vocab_size <= 1:  # RoBERTa, DistilBERT: one segment
            token_type_ids = torch.zeros_like(input_ids)  # (B, T)
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # (B, T, E)
        if self.embedding_projection is not None:
            x = self.embedding_projection(x)  # (B, T, H)
        # An all-ones mask changes nothing; dropping it lets SDPA pick its fastest kernel.
        mask = unpadded = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = additive_padding_mask(attention_mask, x.dtype)  # (B, 1, 1, T)
            if self.padding_free or (self.padding_free is None and self.training):
                unpadded = Unpadded(attention_mask)
        attentions, states = [], [x]
        if unpadded is not None:
            x = unpadded.unpad(x)  # (R, H): the real tokens only
        first_only = (first_token_only and not output_attentions and not output_hidden_states
                      and (attention_mask is None or bool(attention_mask[:, 0].all())))
        between = BETWEEN_LAYERS.get()
        if (self.fused_stack is not None and between is None and not output_attentions and not output_hidden_states
                and not self.training):
            out = self.fused_stack(self, [self.layers[index] for index in self.schedule], x, mask, unpadded, first_only)
            if out is not None:
                x, unpadded = out, None if first_only else unpadded
                return self._finish(x, unpadded, attentions, states, attention_mask, output_attentions,
                                    output_hidden_states)
        for applied, index in enumerate(self.schedule, 1):
            if first_only and applied == len(self.schedule):
                x, weights = self.layers[index](x, mask, False, unpadded, first_only=True)  # (B, 1, H)
                unpadded = None  # nothing left to pad
                continue
            x, weights = self.layers[index](x, mask, output_attentions, unpadded)
            if output_attentions:
                attentions.append(weights)
            if output_hidden_states:
                states.append(x if unpadded is None else unpadded.pad(x))
            if between is not None and applied < len(self.schedule):
                between(applied)
        return self._finish(x, unpadded, attentions, states, attention_mask, output_attentions, output_hidden_states)

    def _finish(self, x: Tensor, unpadded: Unpadded | None, attentions: list, states: list,
                attention_mask: Tensor | None, output_attentions: bool, output_hidden_states: bool) -> EncoderOutput:
        """The last layer's output, padded back where the layers ran without padding, with the pooler's vector."""
        if unpadded is not None:
            x = unpadded.pad(x)  # (B, T, H), zeros at padding
        pooled = self.pooler(x) if self.pooler is not None else None
        return EncoderOutput(x, pooled, tuple(attentions) if output_attentions else None, attention_mask,
                             tuple(states) if output_hidden_states else None)

    def _check_inputs(self, input_ids: Tensor, token_type_ids: Tensor | None) -> None:
        config = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if T > config.max_tokens:
            raise ValueError(
                f"sequence length {T} exceeds max_position_embeddings {config.max_position_embeddings}"
                + (f" less RoBERTa's offset of {config.position_offset}" if config.position_offset else "")
                + "; truncate or split the input into windows"
            )
        if input_ids.numel():
            low, high = torch.aminmax(input_ids)  # one kernel and one device sync per forward, not two
            low, high = int(low), int(high)
            if low < 0 or high >= config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} is outside the vocabulary of size {config.vocab_size}")
        if token_type_ids is not None and token_type_ids.numel() and config.type_vocab_size > 1:
            high = int(token_type_ids.max())
            if high >= config.type_vocab_size or int(token_type_ids.min()) < 0:
                raise ValueError(f"token_type_ids must lie in [0, {config.type_vocab_size}), got {high}")


def mean_pool(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The mean of each row's hidden states over its real tokens (B, T, H) -> (B, H): a sentence vector
    (sentence-transformers' pooling); every row's mean when there is no mask."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    mask = attention_mask.to(hidden.device).unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def encoder_of(model: nn.Module) -> nn.Module:
    """The encoder of a model with a task head (BertWithHead.encoder), or the model itself."""
    return getattr(model, "encoder", model)


def init_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation: N(0, std) for matrices and embeddings, zero biases, unit LayerNorm."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
