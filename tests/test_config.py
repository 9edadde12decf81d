import dataclasses
import json
import logging

import pytest

from bert_engine import PRESETS, BertConfig


def test_config_json_round_trip(tmp_path):
    config = PRESETS["tiny"].with_labels(["NEG", "POS"])
    config.to_json_file(tmp_path / "config.json", architectures=["BertForSequenceClassification"])
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["id2label"] == {"0": "NEG", "1": "POS"}
    assert "attn_backend" not in data  # runtime choice, not part of the checkpoint
    assert BertConfig.from_json_file(tmp_path / "config.json") == config


def test_label_ids_from_json_strings_become_ints():
    config = BertConfig.from_dict({"id2label": {"0": "a", "1": "b"}})
    assert config.id2label == {0: "a", 1: "b"} and config.label2id == {"a": 0, "b": 1}
    assert config.num_labels == 2


def test_unknown_keys_are_reported_by_name(caplog):
    with caplog.at_level(logging.WARNING):
        BertConfig.from_dict({"hidden_size": 768, "rotary_dim": 64, "transformers_version": "4.8.2"})
    assert "rotary_dim" in caplog.text
    assert "transformers_version" not in caplog.text  # bookkeeping keys are expected


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"hidden_size": 768, "num_attention_heads": 10}, "hidden_size 768 is not divisible by num_attention_heads 10"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob must be in [0, 1), got 1.5"),
        ({"hidden_act": "mish"}, "hidden_act 'mish' is not supported"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"pad_token_id": 40000}, "pad_token_id 40000 is outside the vocabulary of size 30522"),
        ({"is_decoder": True}, "is_decoder=True is not supported"),
        ({"layer_norm_eps": 0}, "layer_norm_eps must be > 0"),
        ({"layer_norm_eps": "x"}, "layer_norm_eps must be a number, got 'x'"),  # (was: '>' not supported ...)
        ({"attention_probs_dropout_prob": "0.1"}, "attention_probs_dropout_prob must be a number, got '0.1'"),
        ({"classifier_dropout": []}, "classifier_dropout must be a number, got []"),
    ],
)
def test_impossible_values_raise_naming_them(values, message):
    with pytest.raises(ValueError) as info:
        BertConfig.from_dict(values)
    assert message in str(info.value)


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        BertConfig.from_json_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        BertConfig.from_json_file(path)


def test_config_is_frozen_and_replace_validates():
    config = PRESETS["tiny"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 64
    with pytest.raises(ValueError, match="not divisible"):
        dataclasses.replace(config, num_attention_heads=5)


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="albert", num_hidden_layers=100_000, hidden_size=8, num_attention_heads=2, intermediate_size=8),
     r"would apply 100,000 layers per token .*the limit is 256"),
    (dict(model_type="albert", num_hidden_layers=12, inner_group_num=64), r"would apply 768 layers"),
    (dict(hidden_size=8192, num_attention_heads=64, intermediate_size=65536, num_hidden_layers=48),
     r"would cost 128\.8 GFLOP per token; the limit is 10"),
    (dict(pad_token_id=True), "pad_token_id must be an integer token id, got True"),
])
def test_configs_beyond_the_work_limits_are_refused_before_anything_is_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        BertConfig(**overrides)


def test_the_cost_of_a_token_counts_every_applied_layer():
    base = BertConfig()
    assert base.flops_per_token == 2 * 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    albert = BertConfig(model_type="albert", num_hidden_layers=12, inner_group_num=2)
    assert albert.flops_per_token == 2 * base.flops_per_token  # shared weights, twice the work
