import dataclasses

import pytest
import torch

from bert_engine import HEADS, BertModel, BertWithHead
from bert_engine.model import additive_padding_mask


def _batch(config, B=3, T=11):
    input_ids = torch.randint(5, config.vocab_size, (B, T))
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, 7:] = 0
    attention_mask[2, 3:] = 0
    input_ids[attention_mask == 0] = config.pad_token_id
    token_type_ids = torch.zeros(B, T, dtype=torch.long)
    token_type_ids[0, 6:] = 1
    return input_ids, attention_mask, token_type_ids


@pytest.mark.parametrize(
    ("head", "shapes"),
    [
        ("mlm", {"logits": (3, 11, 99)}),
        ("nsp", {"logits": (3, 2)}),
        ("pretraining", {"mlm_logits": (3, 11, 99), "nsp_logits": (3, 2)}),
        ("sequence", {"logits": (3, 3)}),
        ("token", {"logits": (3, 11, 3)}),
        ("span", {"start_logits": (3, 11), "end_logits": (3, 11)}),
    ],
)
def test_every_head_returns_its_documented_shape(tiny_config, head, shapes):
    model = BertWithHead(tiny_config.with_labels(["a", "b", "c"]), head).eval()
    out = model(*_batch(tiny_config))
    for name, shape in shapes.items():
        assert tuple(getattr(out, name).shape) == shape
    assert out.encoder.last_hidden_state.shape == (3, 11, 32)


def test_encoder_output_shapes(tiny_config):
    out = BertModel(tiny_config).eval()(*_batch(tiny_config))
    assert out.last_hidden_state.shape == (3, 11, 32)
    assert out.pooled.shape == (3, 32)
    assert out.attentions is None


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_padding_keeps_unpadded_outputs(tiny_config, backend):
    config = dataclasses.replace(tiny_config, attn_backend=backend)
    model = BertModel(config).eval()
    ids = torch.randint(5, 99, (1, 6))
    alone = model(ids).last_hidden_state
    padded_ids = torch.cat([ids, torch.zeros(1, 9, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 6), torch.zeros(1, 9)], dim=1).long()
    padded = model(padded_ids, mask).last_hidden_state
    torch.testing.assert_close(padded[:, :6], alone, atol=1e-6, rtol=1e-5)


def test_sdpa_and_eager_agree(tiny_config):
    eager = BertModel(dataclasses.replace(tiny_config, attn_backend="eager")).eval()
    sdpa = BertModel(dataclasses.replace(tiny_config, attn_backend="sdpa")).eval()
    sdpa.load_state_dict(eager.state_dict())
    batch = _batch(tiny_config)
    a, b = eager(*batch), sdpa(*batch)
    torch.testing.assert_close(a.last_hidden_state, b.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.pooled, b.pooled, atol=1e-5, rtol=1e-5)


def test_attention_weights_are_returned_per_layer_and_ignore_padding(tiny_config):
    model = BertModel(tiny_config).eval()  # sdpa backend: weights come from the eager path on request
    input_ids, attention_mask, token_type_ids = _batch(tiny_config)
    out = model(input_ids, attention_mask, token_type_ids, output_attentions=True)
    assert len(out.attentions) == tiny_config.num_hidden_layers
    weights = out.attentions[0]
    assert weights.shape == (3, 4, 11, 11)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 11))
    assert weights[2, :, :, 3:].max() == 0  # padded keys of row 2 get no attention
    plain = model(input_ids, attention_mask, token_type_ids)
    torch.testing.assert_close(out.last_hidden_state, plain.last_hidden_state, atol=1e-5, rtol=1e-5)


def test_fully_padded_row_stays_finite(tiny_config):
    model = BertModel(tiny_config).eval()
    ids = torch.randint(5, 99, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert torch.isfinite(model(ids, mask).last_hidden_state).all()
    assert additive_padding_mask(mask, torch.float16).dtype == torch.float16


def test_mlm_decoder_is_tied_to_word_embeddings(tiny_config):
    model = BertWithHead(tiny_config, "pretraining")
    assert model.head.mlm.decoder.weight is model.encoder.embeddings.word_embeddings.weight


@pytest.mark.parametrize("kind", ["mlm", "pretraining"])
def test_mlm_logits_at_chosen_positions_equal_the_full_logits_there(tiny_config, kind):
    torch.manual_seed(0)
    model = BertWithHead(tiny_config, kind).eval()
    ids = torch.randint(5, 99, (2, 7))
    chosen = torch.zeros(2, 7, dtype=torch.bool)
    chosen[0, 2] = chosen[1, 5] = chosen[1, 6] = True
    full, picked = model(ids), model(ids, predict_positions=chosen)
    field = "logits" if kind == "mlm" else "mlm_logits"
    assert getattr(picked, field).shape == (3, tiny_config.vocab_size)
    torch.testing.assert_close(getattr(picked, field), getattr(full, field)[chosen])
    with pytest.raises(ValueError, match="masked-LM heads, not SequenceClassificationHead"):
        BertWithHead(tiny_config.with_labels(["a", "b"]), "sequence")(ids, predict_positions=chosen)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": torch.randint(0, 99, (1, 65))}, "sequence length 65 exceeds max_position_embeddings 64"),
        ({"input_ids": torch.tensor([[2, 150, 3]])}, "token id 150 is outside the vocabulary of size 99"),
        ({"input_ids": torch.tensor([[2, -1, 3]])}, "token id -1 is outside the vocabulary"),
        ({"input_ids": torch.tensor([[2, 5, 3]]), "token_type_ids": torch.tensor([[0, 2, 0]])},
         "token_type_ids must lie in [0, 2), got 2"),
        ({"input_ids": torch.tensor([2, 5, 3])}, "input_ids must be (batch, tokens), got shape (3,)"),
    ],
)
def test_bad_inputs_raise_naming_the_value(tiny_config, kwargs, message):
    with pytest.raises(ValueError) as info:
        BertModel(tiny_config)(**kwargs)
    assert message in str(info.value)


def test_unknown_head_name_is_rejected(tiny_config):
    with pytest.raises(ValueError, match="unknown head 'summary'"):
        BertWithHead(tiny_config, "summary")
    assert set(HEADS) == {"mlm", "nsp", "pretraining", "sequence", "token", "span"}


def test_one_tiny_batch_overfits(tiny_config):
    model = BertWithHead(tiny_config.with_labels(["a", "b"]), "sequence").train()
    input_ids, attention_mask, token_type_ids = _batch(tiny_config, B=4, T=8)
    labels = torch.tensor([0, 1, 1, 0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(input_ids, attention_mask).logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 < losses[0]


def _padding_free_pair(config):
    """The same weights twice: one computing padding as transformers does, one padding-free."""
    padded = BertModel(config).eval()
    free = BertModel(config).eval()
    free.load_state_dict(padded.state_dict())
    free.padding_free = True
    return padded, free


def test_padding_free_layers_keep_every_real_output_and_zero_the_padding(tiny_config):
    padded, free = _padding_free_pair(tiny_config)
    ids, mask, types = _batch(tiny_config)
    real = mask.bool()
    a = padded(ids, mask, types, output_attentions=True, output_hidden_states=True)
    b = free(ids, mask, types, output_attentions=True, output_hidden_states=True)
    torch.testing.assert_close(b.last_hidden_state[real], a.last_hidden_state[real], atol=1e-6, rtol=1e-5)
    assert not b.last_hidden_state[~real].any()
    torch.testing.assert_close(b.pooled, a.pooled, atol=1e-6, rtol=1e-5)
    for x, y in zip(b.hidden_states, a.hidden_states, strict=True):
        torch.testing.assert_close(x[real], y[real], atol=1e-6, rtol=1e-5)
    for x, y in zip(b.attentions, a.attentions, strict=True):  # a padded query's row means nothing either way
        torch.testing.assert_close(x.transpose(1, 2)[real], y.transpose(1, 2)[real], atol=1e-6, rtol=1e-5)


def test_padding_free_gradients_equal_the_padded_ones(tiny_config):
    padded, free = _padding_free_pair(tiny_config)
    ids, mask, types = _batch(tiny_config)
    real = mask.bool()
    for model in (padded, free):
        out = model(ids, mask, types)
        (out.last_hidden_state[real].square().sum() + out.pooled.sum()).backward()
    for (name, p), q in zip(padded.named_parameters(), free.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_training_runs_padding_free_and_evaluation_computes_padding_as_the_reference(tiny_config):
    config = dataclasses.replace(tiny_config, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(config)
    ids, mask, types = _batch(config)
    assert not model.train()(ids, mask, types).last_hidden_state[~mask.bool()].any()
    assert model.eval()(ids, mask, types).last_hidden_state[~mask.bool()].abs().sum() > 0
