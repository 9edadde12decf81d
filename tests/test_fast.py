"""Packed CPU linear layers and int8 quantisation (bert_engine/fast.py) keep the model's outputs."""

import copy
import dataclasses

import pytest
import torch
from conftest import SENTENCES
from torch import nn

from bert_engine import PRESETS, BertModel, load
from bert_engine.fast import PackedLinear, can_pack, pack_linear_layers
from bert_engine.precision import prepare_for_inference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def _encode(model, batch):
    with torch.inference_mode():
        return model(**batch).last_hidden_state


def test_packed_minilm_equals_the_plain_model_on_padded_real_sentences(minilm_dir):
    model, tokenizer = load(minilm_dir)
    batch = tokenizer(SENTENCES).model_inputs()
    assert (batch["attention_mask"] == 0).any()
    packed = pack_linear_layers(copy.deepcopy(model))
    kinds = {type(m).__name__ for m in packed.modules()}
    assert "PackedLinear" in kinds and not any(isinstance(m, nn.Linear) for m in packed.layers.modules())
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(_encode(packed, batch)[real], _encode(model, batch)[real], atol=2e-5, rtol=0)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_fused_activation_matches_for_each_kind(act):
    config = dataclasses.replace(PRESETS["tiny"], hidden_act=act)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    batch = {"input_ids": torch.randint(5, 99, (3, 11)), "attention_mask": torch.ones(3, 11, dtype=torch.long)}
    plain = _encode(model, batch)
    packed = pack_linear_layers(copy.deepcopy(model))
    fused = packed.layers[0].ffn.up.attr
    assert fused == ("gelu" if act.startswith("gelu") else "none")
    torch.testing.assert_close(_encode(packed, batch), plain, atol=1e-5, rtol=0)


def test_packing_twice_is_a_no_op_and_other_devices_or_dtypes_are_left_alone():
    model = BertModel(PRESETS["tiny"]).eval()
    pack_linear_layers(model)
    first = model.layers[0].attention.qkv
    pack_linear_layers(model)
    assert model.layers[0].attention.qkv is first and isinstance(first, PackedLinear)
    half = BertModel(PRESETS["tiny"]).to(torch.float16)
    assert not can_pack(half)
    assert isinstance(pack_linear_layers(half).layers[0].attention.qkv, nn.Linear)


def test_prepare_for_inference_int8_quantises_only_encoder_linears(minilm_dir):
    model, _ = load(minilm_dir)
    prepare_for_inference(model, "int8")
    quantised = torch.ao.nn.quantized.dynamic.Linear
    linears = [m for m in model.layers.modules() if isinstance(m, (nn.Linear, quantised, PackedLinear))]
    assert len(linears) == 4 * 6 and all(isinstance(m, quantised) for m in linears)
    assert isinstance(model.pooler.dense, nn.Linear)
