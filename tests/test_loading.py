"""Checkpoint loading: key variants, strict reports, shapes, and files that are unsafe or broken."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bert_engine import PRESETS, BertModel, BertWithHead, CheckpointError, load, load_pretrained, save_pretrained
from bert_engine.checkpoints.loading import read_weights, to_checkpoint_state


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_config):
    """A tiny sequence-classification checkpoint in the Hugging Face layout, saved by us."""
    model = BertWithHead(tiny_config.with_labels(["neg", "pos"]), "sequence").eval()
    folder = save_pretrained(model, tmp_path / "ckpt")
    return folder, model


def _outputs(model, config):
    ids = torch.randint(5, config.vocab_size, (2, 7))
    return model(ids, torch.ones_like(ids)).logits


def test_legacy_names_prefix_and_position_ids_buffer_load(tmp_path, tiny_checkpoint, tiny_config):
    folder, model = tiny_checkpoint
    state = load_file(folder / "model.safetensors")
    legacy = {}
    for key, tensor in state.items():
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        legacy[key] = tensor
    legacy["bert.embeddings.position_ids"] = torch.arange(tiny_config.max_position_embeddings)[None]
    save_file(legacy, folder / "model.safetensors")
    loaded = load_pretrained(folder, "sequence", strict=True)
    torch.manual_seed(3)
    expected = _outputs(model, tiny_config)
    torch.manual_seed(3)
    torch.testing.assert_close(_outputs(loaded, tiny_config), expected)


def test_encoder_loads_without_bert_prefix_and_reports_head_keys_unexpected(tiny_checkpoint, caplog):
    folder, _ = tiny_checkpoint
    with caplog.at_level(logging.WARNING):
        encoder = load_pretrained(folder)  # bare encoder from a classification checkpoint
    assert isinstance(encoder, BertModel)
    assert "unused checkpoint keys classifier.bias, classifier.weight" in caplog.text
    with pytest.raises(CheckpointError, match="unexpected classifier.bias, classifier.weight"):
        load_pretrained(folder, strict=True)


def test_missing_head_is_reported_and_initialised(tmp_path, tiny_config, caplog):
    save_pretrained(BertModel(tiny_config), tmp_path)
    with caplog.at_level(logging.WARNING):
        model = load_pretrained(tmp_path, "token", labels=["O", "B-PER", "I-PER"])
    assert "no weights for head.classifier.weight, head.classifier.bias" in caplog.text
    assert model.head.classifier.weight.shape == (3, 32)
    with pytest.raises(CheckpointError, match="missing head.classifier.weight"):
        load_pretrained(tmp_path, "token", labels=["O", "B-PER", "I-PER"], strict=True)


def test_missing_encoder_weight_is_named(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    state = load_file(folder / "model.safetensors")
    del state["bert.encoder.layer.1.attention.self.key.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing encoder\.layers\.1\.attention\.qkv\.weight"):
        load_pretrained(folder, "sequence")


def test_wrong_shape_names_the_tensor_and_both_shapes(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    state = load_file(folder / "model.safetensors")
    state["bert.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(40, 32)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_pretrained(folder, "sequence")
    message = str(info.value)
    assert "'bert.encoder.layer.0.intermediate.dense.weight' has shape (40, 32)" in message
    assert "the model expects (37, 32)" in message and "model.safetensors" in message


def test_wrong_number_of_labels_names_the_classifier(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    with pytest.raises(CheckpointError, match=r"'classifier.weight' has shape \(2, 32\).*expects \(3, 32\)"):
        load_pretrained(folder, "sequence", labels=["a", "b", "c"])


class _Payload:
    """Unpickling this runs `os.system`-like code: it creates a file as its side effect."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bin_with_code_payload_is_refused_and_does_not_run(tmp_path, tiny_checkpoint):
    folder, model = tiny_checkpoint
    marker = tmp_path / "payload-ran"
    state = dict(to_checkpoint_state(model))
    state["bert.pooler.dense.bias"] = _Payload(marker)
    os.remove(folder / "model.safetensors")
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        load_pretrained(folder, "sequence")
    assert "pytorch_model.bin: refused to load" in str(info.value)
    assert not marker.exists()
    # The payload is real: an unsafe unpickler would have run it.
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_plain_bin_state_dict_loads(tiny_checkpoint, tiny_config):
    folder, model = tiny_checkpoint
    torch.save(to_checkpoint_state(model), folder / "pytorch_model.bin")
    os.remove(folder / "model.safetensors")
    loaded = load_pretrained(folder, "sequence", strict=True)
    torch.manual_seed(5)
    expected = _outputs(model, tiny_config)
    torch.manual_seed(5)
    torch.testing.assert_close(_outputs(loaded, tiny_config), expected)


def test_safetensors_preferred_over_bin(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    load_pretrained(folder, "sequence")  # the broken .bin is never opened


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_names_the_file(tiny_checkpoint, damage):
    folder, _ = tiny_checkpoint
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(2048), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable safetensors file"):
        load_pretrained(folder, "sequence")


def test_truncated_bin_names_the_file(tiny_checkpoint):
    folder, model = tiny_checkpoint
    os.remove(folder / "model.safetensors")
    torch.save(to_checkpoint_state(model), folder / "pytorch_model.bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: unreadable \.bin file"):
        load_pretrained(folder, "sequence")


def test_bin_holding_something_else_than_a_state_dict(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointError, match="expected a dict of tensors"):
        read_weights(path)


def test_impossible_config_names_the_file_and_values(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    data = json.loads((folder / "config.json").read_text())
    data["num_attention_heads"] = 5
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config\.json: hidden_size 32 is not divisible by num_attention_heads 5"):
        load_pretrained(folder, "sequence")


def test_folder_without_weights_is_named(tmp_path, tiny_config):
    tiny_config.to_json_file(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no weights file found"):
        load_pretrained(tmp_path)


def test_tokenizer_larger_than_embeddings_is_refused(minilm_dir, tmp_path):
    folder = tmp_path / "mismatched"
    shutil.copytree(minilm_dir, folder)
    model = load_pretrained(minilm_dir)
    small = BertModel(PRESETS["tiny"])  # 99 embedding rows for a 30,522-token tokenizer
    save_pretrained(small, folder)
    (folder / "tokenizer.json").write_bytes((minilm_dir / "tokenizer.json").read_bytes())
    with pytest.raises(CheckpointError, match="tokenizer has 30522 tokens but the model's embedding table has only 99"):
        load(folder)
    assert model.config.vocab_size == 30522


def test_sharded_checkpoint_through_its_index(tiny_checkpoint, tiny_config):
    folder, model = tiny_checkpoint
    state = load_file(folder / "model.safetensors")
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, folder / name)
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.remove(folder / "model.safetensors")
    loaded = load_pretrained(folder, "sequence", strict=True)  # strict: every key of both shards is consumed
    for name, tensor in loaded.state_dict().items():  # and the weights are the saved ones
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_head_auto_reads_architectures(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    model = load_pretrained(folder, "auto")
    assert isinstance(model, BertWithHead) and model.head_name == "sequence"
    assert model.config.id2label == {0: "neg", 1: "pos"}


def test_dtype_and_provenance(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    loaded = load(folder, "sequence", dtype=torch.bfloat16, with_tokenizer=False)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.checkpoint.folder == folder and not loaded.model.training
    assert not hasattr(loaded.model, "checkpoint") and not hasattr(loaded.model, "load_report")  # facts live in Loaded


def test_saved_model_files_are_as_readable_as_the_rest(tiny_config, tmp_path):
    """safetensors writes through a private 0600 temporary file; a saved model must follow the umask
    like its config.json, or a model folder shared with a server or a group is half unreadable."""
    from bert_engine.checkpoints.lora import LoraConfig, add_lora, save_adapter

    previous = os.umask(0o022)
    try:
        model = BertWithHead(tiny_config.with_labels(["no", "yes"]), "sequence")
        save_pretrained(model, tmp_path / "model")
        add_lora(model.encoder, LoraConfig(rank=2))
        save_adapter(model, tmp_path / "adapter", LoraConfig(rank=2), str(tmp_path / "model"), tmp_path / "model")
    finally:
        os.umask(previous)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()}
    assert set(modes.values()) == {"0o644"}, modes
    assert {"model/model.safetensors", "adapter/adapter.safetensors"} <= set(modes)


def test_metadata_that_is_huge_or_points_outside_is_refused_unread(tiny_checkpoint, tmp_path, caplog):
    from bert_engine.checkpoints.loading import MAX_METADATA_BYTES
    from bert_engine.runtime.inference import model_options
    from bert_engine.tasks.registry import load_registry

    folder, _ = tiny_checkpoint
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config + " " * MAX_METADATA_BYTES)  # valid JSON, only too large
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json: 4,19[0-9,]+ bytes; a file of this kind over"):
        load_pretrained(folder, "sequence")
    outside = tmp_path / "elsewhere.json"
    outside.write_text(config)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(folder, "sequence")

    # a model folder's option defaults: a manifest linking outside is ignored (logged), one inside is read
    spec = load_registry(entry_points=False).task("sentiment").spec
    outside.write_text(json.dumps({"options": {"max_length": 64}}))
    (folder / "manifest.json").symlink_to(outside)
    with caplog.at_level(logging.WARNING):
        assert model_options(folder, spec) == {}
    assert "manifest.json" in caplog.text and "ignored" in caplog.text
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(outside.read_text())
    assert model_options(folder, spec) == {"max_length": 64}
