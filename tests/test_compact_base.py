"""scripts/compact_base.py: a base at a third of its size, expanded back, and adapters moved between the two."""

import json
import shutil

import pytest
import torch

from bert_engine.checkpoints.loader import load, load_tokenizer
from bert_engine.checkpoints.loading import CheckpointError, save_pretrained
from bert_engine.checkpoints.lora import LoraConfig, add_lora, save_adapter
from scripts import compact_base


def _adapter(base, folder):
    model, _ = load(base, "sequence", labels=["a", "b"])
    config = LoraConfig(rank=2)
    add_lora(model.encoder, config)
    save_adapter(model, folder, config, str(base), base)
    return folder


def test_pack_expand_and_rebase_an_adapter_both_ways(tiny_checkpoint, tmp_path):
    info = compact_base.pack(str(tiny_checkpoint), tmp_path / "compact")
    assert info["bytes"] < 0.45 * info["source_bytes"]  # int8 embeddings, bf16 matrices
    copy = tmp_path / "copy"
    first = compact_base.expand(tmp_path / "compact", copy)
    assert compact_base.expand(tmp_path / "compact", tmp_path / "again")["sha256"] == first["sha256"]  # same bytes
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    original, _ = load(tiny_checkpoint)
    rounded, _ = load(copy)
    with torch.no_grad():
        a = original(ids).last_hidden_state
        b = rounded(ids).last_hidden_state
    assert (a - b).abs().max() < 0.05 * a.abs().max() and not torch.equal(a, b)

    adapter = _adapter(tiny_checkpoint, tmp_path / "adapter")
    (adapter / "manifest.json").write_text(json.dumps({"task": "sequence", "base_sha256": info["source_sha256"]}))
    moved = compact_base.rebase(adapter, str(tiny_checkpoint), copy, tmp_path / "on-copy")
    assert moved["base_sha256"] == first["sha256"]
    assert json.loads((tmp_path / "on-copy" / "manifest.json").read_text())["base_sha256"] == first["sha256"]
    load(tmp_path / "on-copy", "sequence")  # its recorded base is the copy now, checked by sha256 on loading
    meta = json.loads((tmp_path / "on-copy" / "adapter_config.json").read_text())
    (tmp_path / "on-copy" / "adapter_config.json").write_text(json.dumps({**meta, "base_sha256": info["source_sha256"]}))
    with pytest.raises(CheckpointError, match="trained on base weights with sha256"):
        load(tmp_path / "on-copy", "sequence")  # what rebase rewrites is what loading checks
    (tmp_path / "on-copy" / "adapter_config.json").write_text(json.dumps(meta))
    compact_base.rebase(tmp_path / "on-copy", str(tiny_checkpoint), copy, tmp_path / "back")
    meta = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert meta["base_model"] == str(tiny_checkpoint) and [r["from_base"] for r in meta["rebased"]] == [
        str(tiny_checkpoint), str(copy)]
    assert (tmp_path / "back" / "adapter.safetensors").read_bytes() == (adapter / "adapter.safetensors").read_bytes()


def test_rebase_refuses_an_unrelated_adapter_or_copy(tiny_checkpoint, tmp_path):
    compact_base.pack(str(tiny_checkpoint), tmp_path / "compact")
    copy = tmp_path / "copy"
    compact_base.expand(tmp_path / "compact", copy)
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    model, _ = load(other)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_pretrained(model, other, load_tokenizer(tiny_checkpoint))
    with pytest.raises(SystemExit, match="trained on weights with sha256 .* neither"):
        compact_base.rebase(_adapter(other, tmp_path / "a"), str(tiny_checkpoint), copy, tmp_path / "out")
    on_copy = _adapter(copy, tmp_path / "b")
    with pytest.raises(SystemExit, match="was made from weights with sha256 .* not from"):
        compact_base.rebase(on_copy, str(other), copy, tmp_path / "out")  # back onto the wrong base
    with pytest.raises(SystemExit, match="is a packed copy; `expand` it"):
        compact_base.rebase(tmp_path / "a", str(other), tmp_path / "compact", tmp_path / "out")
    with pytest.raises(SystemExit, match="no compact.json"):
        compact_base.rebase(tmp_path / "a", str(other), other, tmp_path / "out")
