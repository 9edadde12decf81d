"""Checkpoints and adapters are untrusted: nothing they point to outside their folder (or the allowed
folders) is opened, a config is sized before anything is allocated, and malformed files give an error
that names the file instead of a traceback. Every checkpoint here is built by the test."""

import json
import os
import shutil
import zipfile

import pytest
import torch
from conftest import reference_checkpoint

from bert_engine.checkpoints.loader import load, load_pretrained
from bert_engine.checkpoints.loading import CheckpointError, read_weights


@pytest.fixture
def tiny(tmp_path):
    return reference_checkpoint(tmp_path / "tiny", "BertModel")


def test_a_config_symlinked_outside_the_folder_is_refused(tiny, tmp_path):
    outside = tmp_path / "secret.json"
    outside.write_text((tiny / "config.json").read_text())
    (tiny / "config.json").unlink()
    os.symlink(outside, tiny / "config.json")
    with pytest.raises(CheckpointError, match="tiny/config.json: points outside the checkpoint folder; refused"):
        load_pretrained(tiny)


def test_an_index_shard_named_outside_the_folder_is_never_opened(tiny):
    (tiny / "model.safetensors").rename(tiny / "shard-1.safetensors")
    index = {"weight_map": {"embeddings.word_embeddings.weight": "../../../../proc/self/environ"}}
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="points outside the checkpoint folder; refused") as caught:
        load_pretrained(tiny)
    # The same answer for a target that does not exist: the error tells nothing about the server's files
    index["weight_map"]["embeddings.word_embeddings.weight"] = "../../../../proc/self/no-such-file"
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as missing:
        load_pretrained(tiny)
    assert str(missing.value).replace("no-such-file", "environ") == str(caught.value)


@pytest.mark.parametrize("change, message", [
    # the work limits (config.py) come first: per token, before parameters are even counted
    ({"num_hidden_layers": 1_000_000}, "would apply 1,000,000 layers per token"),
    ({"hidden_size": 32768, "num_attention_heads": 4}, "would cost 17.2 GFLOP per token; the limit is 10"),
    ({"vocab_size": 10**10}, "describes 320,.* parameters; the limit is"),
    ({"intermediate_size": 10**7}, "parameters but the weights files hold .* bytes; the config does not belong"),
    ({"intermediate_size": 10**9}, "GFLOP per token"),
])
def test_a_huge_config_is_refused_before_allocating(tiny, change, message):
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises((CheckpointError, ValueError), match=message):
        load_pretrained(tiny)


@pytest.mark.parametrize("change, message", [
    ({"initializer_range": -1}, "initializer_range must be a positive number"),
    ({"initializer_range": float("nan")}, "initializer_range must be a positive number"),
])
def test_impossible_config_values_are_named(tiny, change, message):
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        load_pretrained(tiny)


def test_deeply_nested_json_is_a_clear_error(tiny):
    (tiny / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_pretrained(tiny)


def test_architectures_must_be_names(tiny):
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "architectures": [[]]}))
    with pytest.raises(CheckpointError, match="architectures must be a list of class names"):
        load_pretrained(tiny, "auto")


def _adapter(folder, **meta):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"id2label": {"0": "NEG", "1": "POS"}}))
    (folder / "adapter_config.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("meta, message", [
    ({}, "'rank' is missing or not a int"),
    ({"rank": 4, "alpha": 8, "targets": ["query"]}, "'base_model' is missing"),
    ({"rank": 0, "alpha": 8, "targets": ["query"], "base_model": "default"}, "rank must be >= 1"),
    # the scale alpha / rank multiplies every delta: NaN, 0 or astronomic, every answer would be NaN or overflow
    ({"rank": 4, "alpha": float("nan"), "targets": ["query"], "base_model": "default"}, "alpha nan must be a finite"),
    ({"rank": 4, "alpha": 1e308, "targets": ["query"], "base_model": "default"}, r"alpha 1e\+308 must be .* at most "
                                                                                  r"1000 x rank \(4\)"),
    ({"rank": 4, "alpha": 0, "targets": ["query"], "base_model": "default"}, "alpha 0 must be a finite number above 0"),
])
def test_a_malformed_adapter_config_names_the_key(tmp_path, meta, message):
    folder = _adapter(tmp_path / "adapter", **meta)
    with pytest.raises(CheckpointError, match=message):
        load(folder, "sequence")


def test_an_adapter_rank_above_the_base_width_is_refused_before_allocating(tmp_path, tiny):
    """rank x (in + out) floats for every target: a rank of ten million asked for gigabytes; no LoRA delta of a
    hidden-32 model has a rank above 32."""
    adapter = _adapter(tmp_path / "adapter", rank=10_000_000, alpha=10_000_000.0, targets=["query"],
                       base_model=str(tiny))
    with pytest.raises(CheckpointError, match="adapter/adapter_config.json: rank 10,000,000 is above the base "
                                              "model's hidden size 32"):
        load(adapter, "sequence")


def test_a_weight_stored_as_bool_or_integers_is_refused(tiny):
    from safetensors.torch import load_file, save_file

    state = load_file(tiny / "model.safetensors")
    name = next(k for k in state if k.endswith("query.weight"))
    save_file({**state, name: state[name] > 0}, tiny / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '.*{name.split('.', 1)[-1]}' is stored as bool; a model weight "
                                              "must be a floating-point tensor"):
        load_pretrained(tiny)


def test_a_fifo_in_place_of_a_metadata_file_is_refused_unread(tiny):
    """Opening a FIFO blocks until someone writes to it: the loader would hang, not fail."""
    from bert_engine.checkpoints.loader import recorded_task
    from bert_engine.files import metadata_file

    for name in ("config.json", "manifest.json", "tokenizer.json"):
        (tiny / name).unlink(missing_ok=True)
        os.mkfifo(tiny / name)
        with pytest.raises(CheckpointError, match=f"tiny/{name}: not a regular file; refused unread"):
            metadata_file(tiny, name)
    assert recorded_task(tiny) is None  # the manifest says nothing it can read
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tiny)


def test_an_adapter_cannot_point_its_base_outside_the_allowed_folders(tmp_path, tiny):
    allowed = tmp_path / "models"
    allowed.mkdir()
    secret = tmp_path / "elsewhere"
    shutil.copytree(tiny, secret)
    adapter = _adapter(allowed / "adapter", rank=4, alpha=8.0, targets=["query"], base_model=str(secret))
    with pytest.raises(CheckpointError, match="base_model is a local folder outside the folders models may be "
                                              "loaded from; refused") as caught:
        load(adapter, "sequence", allowed_dirs=[allowed])
    assert str(secret) not in str(caught.value)
    missing = _adapter(allowed / "adapter2", rank=4, alpha=8.0, targets=["query"], base_model="/no/such/folder")
    with pytest.raises(CheckpointError) as same:  # an existing and a missing folder read the same
        load(missing, "sequence", allowed_dirs=[allowed])
    assert str(same.value).replace("adapter2", "adapter") == str(caught.value)


# -- .bin pickles: every malformed file is a CheckpointError naming it ---------------------------------

def test_a_six_byte_bin_is_a_clear_error(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"abcdef")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: unreadable .bin file"):
        read_weights(path)


@pytest.mark.parametrize("state, entry", [({1: torch.zeros(2)}, "entry 1"), ({"a": {"b": torch.zeros(2)}}, "entry 'a'")])
def test_a_bin_must_map_names_to_tensors(tmp_path, state, entry):
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=entry):
        read_weights(path)


@pytest.mark.parametrize("payload, named", [("system", ("GLOBAL posix.system", "GLOBAL os.system")),
                                             ("eval", ("GLOBAL eval",)),
                                             ("torch.load", ("GLOBAL torch.serialization.load",))])
def test_the_pickle_refusal_names_the_global_without_terminal_codes_or_bad_advice(tmp_path, payload, named):
    """torch's refusal advises re-running with weights_only=False or allow-listing the global: the message
    keeps only what was refused (a blocked module, an eval, a nested torch.load alike)."""
    path = tmp_path / "pytorch_model.bin"
    torch.save({"a": _RunsCode(payload)}, path)
    with pytest.raises(CheckpointError) as caught:
        read_weights(path)
    message = str(caught.value)
    assert any(n in message for n in named), message
    for advice in ("weights_only", "safe_globals", "if you trust", "Re-running"):
        assert advice not in message, message
    assert message.isprintable(), message


def test_a_plain_pickle_is_refused_in_one_message_naming_why(tmp_path, recwarn):
    """pickle.dump's own format (not torch.save's zip): torch warns about the protocol and puts its reason on a
    line of its own; the refusal names it ("Unsupported operand 149") and nothing else is printed."""
    import pickle

    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(pickle.dumps({"a": _RunsCode()}, protocol=4))
    with pytest.raises(CheckpointError, match=r"refused to load; .*\(Unsupported operand \d+\)"):
        read_weights(path)
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


class _RunsCode:
    CALLS = {"system": (os.system, ("echo owned",)), "eval": (eval, ("1 + 1",)),
             "torch.load": (torch.load, ("/nonexistent.bin",))}

    def __init__(self, payload: str = "system") -> None:
        self.payload = payload

    def __reduce__(self):
        return self.CALLS[self.payload]


def test_a_zip_bomb_bin_is_refused_before_it_inflates(tmp_path):
    """torch.save writes stored zip entries; one deflated entry of 64 MB of zeros is ~64 KB on disk and
    torch.load would inflate it. The refusal must come from the archive's directory, before any read."""
    plain = tmp_path / "plain.bin"
    torch.save({"w": torch.zeros(16 * 2**20)}, plain)
    bomb = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    assert bomb.stat().st_size < 2**20 < 64 * 2**20
    assert torch.load(bomb, weights_only=True)["w"].numel() == 16 * 2**20  # torch itself would inflate it
    with pytest.raises(CheckpointError, match="compressed"):
        read_weights(bomb)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_holding_nan_or_infinity_are_refused_by_name(tiny, value):
    """Such a model answers NaN to everything, and NaN is not JSON: refuse it at load, naming the tensor."""
    from safetensors.torch import load_file, save_file

    state = load_file(tiny / "model.safetensors")
    name = next(k for k in state if k.endswith("attention.self.query.weight"))
    state[name][0, 0] = value
    save_file(state, tiny / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds NaN or infinite values"):
        load_pretrained(tiny)


def test_a_sparse_safetensors_file_is_judged_by_its_header_before_any_read(tiny):
    """A valid header declaring one 3 GiB tensor, the file sparse (small on disk): refused from the header's
    declared sizes, in a subprocess whose peak memory stays far below the tensor's size (issue 36: 8.9 GB)."""
    import subprocess
    import sys

    weights = tiny / "model.safetensors"
    weights.unlink()
    size = 3 * 2**30
    header = json.dumps({"huge": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(weights, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(8 + len(header) + size)  # sparse: no data blocks written
    # The peak is this process's own (/proc/self/status VmHWM): getrusage's ru_maxrss keeps the high-water mark of
    # the memory it was forked from (Linux records it at exec), so it read 2.7 GB beside a large pytest worker.
    probe = ("import re, sys\nfrom bert_engine.checkpoints.loader import load\n"
             "try:\n    load(sys.argv[1])\nexcept Exception as err:\n    print(type(err).__name__, err)\n"
             "status = open('/proc/self/status').read()\n"
             "print('peak_kb', re.search(r'VmHWM:\\s+(\\d+)', status).group(1))\n")
    done = subprocess.run([sys.executable, "-c", probe, str(tiny)], capture_output=True, text=True, timeout=120)
    assert "CheckpointError" in done.stdout and "declare 3,221,225,472 bytes of tensors" in done.stdout, done.stdout
    peak_mb = int(done.stdout.split("peak_kb")[1]) / 1024
    assert peak_mb < 1024, f"peak RSS {peak_mb:.0f} MB"  # the interpreter and torch: a few hundred MB


def test_a_safetensors_header_with_an_unknown_dtype_or_bad_shape_is_named(tiny):
    from bert_engine.checkpoints.loading import declared_bytes

    path = tiny / "odd.safetensors"
    for entry, message in (({"dtype": "Q4", "shape": [2]}, "no readable dtype"),
                           ({"dtype": "F32", "shape": [-1]}, "impossible shape")):
        header = json.dumps({"t": {**entry, "data_offsets": [0, 8]}}).encode()
        path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
        with pytest.raises(CheckpointError, match=message):
            declared_bytes(path)
    deep = b"[" * 200_000 + b"]" * 200_000  # the decoder recurses per level: a RecursionError, not a ValueError
    path.write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(CheckpointError, match="corrupt header \\(JSON nested too deeply\\)"):
        declared_bytes(path)


def _with_normaliser(folder, steps):
    """The checkpoint's tokenizer.json with `steps` appended to its normaliser (a Sequence)."""
    from tokenizers import Tokenizer as Backend

    path = folder / "tokenizer.json"
    if not path.is_file():
        from bert_engine import load_tokenizer
        load_tokenizer(folder).save(folder)
    spec = json.loads(path.read_text())
    base = spec.get("normalizer")
    spec["normalizer"] = {"type": "Sequence", "normalizers": ([base] if base else []) + steps}
    path.write_text(json.dumps(spec))
    Backend.from_file(str(path))  # still a valid tokenizer.json for the library itself


def test_a_normaliser_that_multiplies_text_is_refused_at_load(tiny):
    """A Replace rule "a" -> 50 x "a " would turn the 1,000,000-character input limit into 100 million
    characters before tokenising (issue 36 #5): refused when the tokenizer loads, naming the growth."""
    from bert_engine import load_tokenizer

    _with_normaliser(tiny, [{"type": "Replace", "pattern": {"String": "a"}, "content": "a " * 50}])
    with pytest.raises(ValueError, match="can make a text 100 times longer before tokenising.*the limit is 8"):
        load_tokenizer(tiny)


def test_text_that_a_legal_normaliser_lengthens_past_the_limit_is_refused_in_pieces(tiny):
    """A rule within the load limit (x 8) still meets the per-request bound, measured a piece at a
    time: an InputError naming the sizes, not gigabytes of tokens (and not a failing plugin)."""
    import time

    from bert_engine import load_tokenizer
    from bert_engine.errors import InputError

    _with_normaliser(tiny, [{"type": "Replace", "pattern": {"String": "a"}, "content": "aaaaaaaa"}])
    tokenizer = load_tokenizer(tiny)
    assert tokenizer.grows
    assert tokenizer("a cat").input_ids.shape[0] == 1  # ordinary text still tokenises
    start = time.monotonic()
    with pytest.raises(InputError, match="turns the first .* characters into .*the limit is 2,000,000"):
        tokenizer("a" * 1_000_000)
    assert time.monotonic() - start < 10


def test_a_tokenizer_that_panics_is_the_models_error_not_the_tasks(tiny):
    """A picked checkpoint's catastrophic pre-tokeniser regex makes the Rust library panic (pyo3's
    PanicException, a BaseException) on a long run of one letter: the request gets an InputError naming
    it, so the task's plugin is not marked failing for every visitor (issue 36 #6)."""
    from bert_engine import load_tokenizer
    from bert_engine.errors import InputError

    path = tiny / "tokenizer.json"
    if not path.is_file():
        load_tokenizer(tiny).save(tiny)
    spec = json.loads(path.read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|a)+$"}, "behavior": "Isolated", "invert": False}
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="regular expression '\\(a\\|a\\)\\+\\$', which repeats a group"):
        load_tokenizer(tiny)  # refused at load now (session 57); a tokenizer built in code still panics on it:
    from bert_engine.tokenizer import Backend, Tokenizer

    tokenizer = Tokenizer(Backend.from_str(json.dumps(spec)))
    with pytest.raises(InputError, match="this model's tokenizer crashed on the text \\(PanicException: "):
        tokenizer("a" * 40 + "b")
    with pytest.raises(InputError, match="PanicException"):
        tokenizer.pieces(["a" * 40 + "b"])


def _tokenizer_spec(tiny) -> dict:
    from bert_engine import load_tokenizer

    path = tiny / "tokenizer.json"
    if not path.is_file():
        load_tokenizer(tiny).save(tiny)
    return json.loads(path.read_text())


@pytest.mark.parametrize(("part", "change", "message"), [
    ("model", {"max_input_chars_per_word": 10**9}, "reads words of up to 1,000,000,000 characters"),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": "(a|a)+b"}, "behavior": "Isolated", "invert": False},
     "which repeats a group"),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "BertPreTokenizer"}, {
        "type": "Split", "pattern": {"Regex": "\\s*x"}, "behavior": "Isolated", "invert": False}]},
     "more to match after a repetition without bound"),
    ("normalizer", {"type": "Replace", "pattern": {"Regex": "a*a*c"}, "content": ""},
     "repeats two parts of one alternative"),
    ("normalizer", {"type": "Replace", "pattern": {"Regex": "(?:x+)"}, "content": ""},
     "repeats something inside a group"),
])
def test_a_tokenizer_whose_work_could_grow_faster_than_its_text_is_refused_at_load(tiny, part, change, message):
    """A hostile-visitor audit (session 57): a picked model's tokenizer.json with WordPiece's longest word set to 10^9
    made NER on one 16,000-letter word take 116 s, and a Split regex `(a|a)+b` about 1 ms a character, in the
    request's thread where no time limit stops it; the stuck request then turned the task off for every visitor.
    Such a file is refused when it loads, naming what in it and why."""
    from bert_engine import load_tokenizer

    spec = _tokenizer_spec(tiny)
    spec[part] = {**spec[part], **change} if part == "model" else change
    (tiny / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tiny)
    with pytest.raises(ValueError, match=message):  # and the whole model with it
        load(tiny)


def test_the_patterns_of_real_tokenizers_load(tiny):
    """What the refusal admits: BERT's, ALBERT's (" {2,}"), GPT-2's byte-level split and a few simple rules."""
    from bert_engine import load_tokenizer
    from bert_engine.tokenizer import regex_problem

    gpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
    for pattern in (gpt2, " {2,}", "\\s+", "``", "[ \\t]+$", "\\p{N}{1,3}", "(?i:'s|'t|'re)"):
        assert regex_problem(pattern) is None, pattern
    spec = _tokenizer_spec(tiny)
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [spec["pre_tokenizer"], {
        "type": "Split", "pattern": {"Regex": gpt2}, "behavior": "Isolated", "invert": False}]}
    spec["normalizer"] = {"type": "Sequence", "normalizers": [spec["normalizer"], {
        "type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]}
    (tiny / "tokenizer.json").write_text(json.dumps(spec))
    assert load_tokenizer(tiny)("it's  a test").input_ids.shape[0] == 1
