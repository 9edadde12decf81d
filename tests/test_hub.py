"""Resolving Hub ids through huggingface_hub against a loopback server that imitates the Hub."""

import socket

import pytest
import torch

from bert_engine import PRESETS, BertWithHead, HubError, load, resolve, save_pretrained


@pytest.fixture
def hub_repo(fake_hub, tmp_path, tiny_tokenizer):
    """owner/tiny at revisions "main" and "v2" (different weights), served by the fake Hub."""
    config = PRESETS["tiny"].with_labels(["neg", "pos"])
    for revision in ("main", "v2"):
        torch.manual_seed(0 if revision == "main" else 1)
        model = BertWithHead(config, "sequence").eval()
        fake_hub.repos[("owner/tiny", revision)] = save_pretrained(model, tmp_path / "repo" / revision, tiny_tokenizer)
    return fake_hub


def _load(hub, tmp_path, **kwargs):
    kwargs.setdefault("endpoint", hub.endpoint)
    return load("owner/tiny", "sequence", cache_dir=tmp_path / "cache", **kwargs)


def _logits(model, tokenizer):
    return model(**tokenizer(["the cat sat", "hello"]).model_inputs()).logits


def test_download_matches_the_local_folder(hub_repo, tmp_path):
    loaded = _load(hub_repo, tmp_path)
    model, tokenizer = loaded
    local, _ = load(tmp_path / "repo" / "main", "sequence")
    torch.testing.assert_close(_logits(model, tokenizer), _logits(local, tokenizer))
    assert loaded.checkpoint.name == "owner/tiny" and len(loaded.checkpoint.commit) == 40
    assert not any("pytorch_model.bin" in r for r in hub_repo.requests)  # safetensors found first


def test_revision_selects_other_weights(hub_repo, tmp_path):
    main_loaded, v2_loaded = _load(hub_repo, tmp_path), _load(hub_repo, tmp_path, revision="v2")
    (main, tokenizer), (v2, _) = main_loaded, v2_loaded
    assert v2_loaded.checkpoint.commit != main_loaded.checkpoint.commit
    assert not torch.allclose(_logits(main, tokenizer), _logits(v2, tokenizer))


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("owner/missing", {}, "Hub repository 'owner/missing' not found"),
        ("owner/tiny", {"revision": "v9"}, "revision 'v9' not found in 'owner/tiny'"),
    ],
)
def test_unknown_repository_or_revision(hub_repo, tmp_path, name, kwargs, message):
    with pytest.raises(HubError, match=message):
        resolve(name, endpoint=hub_repo.endpoint, cache_dir=tmp_path / "cache", **kwargs)


def test_missing_file_is_named(hub_repo, tmp_path):
    (tmp_path / "repo" / "main" / "tokenizer.json").unlink()
    (tmp_path / "repo" / "main" / "vocab.txt").unlink()
    with pytest.raises(HubError, match="'owner/tiny' has no tokenizer file; looked for tokenizer.json, vocab.txt"):
        _load(hub_repo, tmp_path)


def test_server_error_gives_clear_message(hub_repo, tmp_path):
    import time

    hub_repo.faults["config.json"] = "500"
    started = time.monotonic()
    with pytest.raises(HubError, match="could not download 'config.json' of 'owner/tiny': the Hub answered HTTP 500 "
                                       r"\(an error on its side\) and there is no cached copy"):
        _load(hub_repo, tmp_path)
    assert time.monotonic() - started < 10  # not after huggingface_hub's 23 s of retries


def test_a_server_error_on_the_weights_is_named_at_once(hub_repo, tmp_path):
    import time

    hub_repo.faults["model.safetensors"] = "500"
    started = time.monotonic()
    with pytest.raises(HubError, match="could not download 'model.safetensors' of 'owner/tiny': the Hub answered "
                                       "HTTP 500"):
        _load(hub_repo, tmp_path)
    assert time.monotonic() - started < 10  # the size probe does not retry (huggingface_hub's back-off: 23 s)


def test_a_hub_answering_500_leaves_the_cached_copy_usable(hub_repo, tmp_path):
    first, tokenizer = _load(hub_repo, tmp_path)
    hub_repo.faults["config.json"] = "500"
    again, _ = _load(hub_repo, tmp_path)
    torch.testing.assert_close(_logits(again, tokenizer), _logits(first, tokenizer))


@pytest.mark.parametrize("fault", ["drop", "truncate"])
def test_interrupted_download_leaves_no_corrupt_file(hub_repo, tmp_path, fault):
    hub_repo.faults["model.safetensors"] = fault
    with pytest.raises(HubError, match="model.safetensors"):
        _load(hub_repo, tmp_path)
    # nothing half-written is visible under the final name...
    assert not list((tmp_path / "cache").rglob("snapshots/*/model.safetensors"))
    # ...so once the network is healthy the next load downloads and works
    del hub_repo.faults["model.safetensors"]
    model, tokenizer = _load(hub_repo, tmp_path)
    assert torch.isfinite(_logits(model, tokenizer)).all()


def test_offline_uses_the_cache_without_network(hub_repo, tmp_path, monkeypatch):
    online, tokenizer = _load(hub_repo, tmp_path)
    hub_repo.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline, _ = _load(hub_repo, tmp_path)
    assert hub_repo.requests == []
    torch.testing.assert_close(_logits(offline, tokenizer), _logits(online, tokenizer))


def test_offline_without_cache_says_what_to_do(hub_repo, tmp_path):
    with pytest.raises(HubError, match="not in the local cache and offline mode is on"):
        _load(hub_repo, tmp_path, local_files_only=True)
    assert hub_repo.requests == []


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_hub_without_cache(tmp_path):
    with pytest.raises(HubError, match="could not reach the Hub .*'owner/tiny'.*no cached copy"):
        resolve("owner/tiny", endpoint=_closed_port(), cache_dir=tmp_path / "cache", etag_timeout=2)
    # the reason is the connection's, not huggingface_hub's "outgoing traffic has been disabled" of the cache
    # lookup that follows it (no offline mode was asked for)
    with pytest.raises(HubError) as refused:
        resolve("owner/tiny", endpoint=_closed_port(), cache_dir=tmp_path / "cache", etag_timeout=2)
    assert "offline" not in str(refused.value).lower() and "disabled" not in str(refused.value), refused.value
    assert "connect" in str(refused.value).lower() or "refused" in str(refused.value).lower(), refused.value


def test_unreachable_hub_with_cache_uses_the_cache(hub_repo, tmp_path, caplog):
    _load(hub_repo, tmp_path)
    with caplog.at_level("WARNING"):
        model, tokenizer = _load(hub_repo, tmp_path, endpoint=_closed_port(), etag_timeout=2)
    assert torch.isfinite(_logits(model, tokenizer)).all()
    assert "the Hub is unreachable; using the cached copy of" in caplog.text  # said once the copy is found


def test_unreachable_hub_without_cache_is_one_error_naming_the_missing_folder_too(tmp_path, caplog, monkeypatch):
    """`--model runs/sst2` before any training run reads as a Hub id: the one error says the folder is not there
    either, and no warning line ("using the cached copy if there is one") comes before it."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING"), pytest.raises(HubError) as refused:
        resolve("runs/sst2", endpoint=_closed_port(), cache_dir=tmp_path / "cache", etag_timeout=2)
    assert str(refused.value).endswith("There is no local folder 'runs/sst2' here either")
    assert not caplog.records, caplog.text


@pytest.mark.parametrize(
    ("name", "message"),
    [("not a valid id!", "neither an existing folder nor a Hub id"), ("./missing/folder", "neither an existing folder")],
)
def test_bad_names(name, message):
    with pytest.raises(HubError, match=message):
        resolve(name)


def test_a_file_instead_of_a_folder(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(HubError, match="is a file; give the checkpoint's folder"):
        resolve(path)


@pytest.mark.parametrize("fault", [None, "500", "drop"])
def test_a_token_never_reaches_logs_or_error_messages(hub_repo, tmp_path, caplog, monkeypatch, fault):
    import logging

    secret = "hf_SeCrEtToKeN0123456789abcdefghij"
    monkeypatch.setenv("HF_TOKEN", secret)
    if fault:
        hub_repo.faults["config.json"] = fault
    caplog.set_level(logging.DEBUG)
    message = ""
    try:
        _load(hub_repo, tmp_path, token=secret)
    except HubError as err:
        message = f"{err!s} {err!r} {err.__cause__!r}"
    assert fault is None or message  # the faults do fail the load
    assert secret not in message and secret not in caplog.text
    assert f"Bearer {secret}" in hub_repo.authorizations  # the token was used, only on the wire


def test_a_mistyped_local_folder_is_said_to_be_one(tmp_path, monkeypatch):
    """'models/sst-2' for the folder models/sst2 reads as a Hub id: the error says the folder is not here
    either, when its first folder is (it had read as a network problem only)."""
    from bert_engine.checkpoints.hub import HubError, resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(HubError, match=r"There is no folder 'models/sst-2' here either \(the folder 'models' exists: a typo\?\)"):
        resolve("models/sst-2", local_files_only=True)
    with pytest.raises(HubError) as other:
        resolve("owner/elsewhere", local_files_only=True)
    assert "typo" not in str(other.value)


# -- what a download may cost: sizes checked from the Hub's HEAD before a byte is fetched, a deadline -------


def _gets(hub, filename: str) -> list[str]:
    return [r for r in hub.requests if r.startswith("GET ") and r.split("?")[0].endswith("/" + filename)]


def test_a_sharded_checkpoint_loads_from_the_hub(fake_hub, tmp_path, tiny_tokenizer):
    import json

    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    folder = save_pretrained(BertWithHead(PRESETS["tiny"].with_labels(["neg", "pos"]), "sequence").eval(),
                             tmp_path / "sharded", tiny_tokenizer)
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, folder / shard)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    fake_hub.repos[("owner/sharded", "main")] = folder
    # the shards come through the Hub's cache, whose blobs have no .safetensors name: read as safetensors all the same
    model, tokenizer = load("owner/sharded", "sequence", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    # each shard's size is asked once (for the shards' total, then kept for its own check), then the download
    for shard in halves:
        assert fake_hub.requests.count(f"HEAD /owner/sharded/resolve/main/{shard}") == 2  # ours + hf_hub_download's
    local, _ = load(folder, "sequence")
    torch.testing.assert_close(_logits(model, tokenizer), _logits(local, tokenizer))


def test_weights_larger_than_the_config_allows_are_refused_before_downloading(hub_repo, tmp_path):
    hub_repo.faults["model.safetensors"] = "huge"  # 10 GB declared for a model of a few hundred kB
    with pytest.raises(HubError, match=r"'model.safetensors' of 'owner/tiny' is 10,737,418,240 bytes; a file of "
                                       "this kind over .* bytes is not downloaded"):
        _load(hub_repo, tmp_path)
    assert _gets(hub_repo, "model.safetensors") == []


def test_the_download_budget_is_checked_from_declared_sizes(hub_repo, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "repo" / "main" / "model.safetensors"
    save_file({**load_file(weights), "padding": torch.zeros(2**19)}, weights)  # 2 MB more: over a 1 MB budget
    monkeypatch.setenv("BERT_ENGINE_MAX_DOWNLOAD_MB", "1")
    with pytest.raises(HubError, match="'owner/tiny' needs more than 1 MB downloaded .*BERT_ENGINE_MAX_DOWNLOAD_MB"):
        _load(hub_repo, tmp_path)
    assert _gets(hub_repo, "model.safetensors") == []


def test_a_config_the_engine_cannot_load_costs_no_weights_download(hub_repo, tmp_path):
    import json

    config = tmp_path / "repo" / "main" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        _load(hub_repo, tmp_path)
    assert _gets(hub_repo, "model.safetensors") == []


def test_an_index_naming_too_many_shards_is_refused_before_any_shard(hub_repo, tmp_path):
    import json

    from bert_engine.files import MAX_SHARDS

    folder = tmp_path / "repo" / "main"
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {f"t{i}": f"model-{i:05d}.safetensors" for i in range(MAX_SHARDS + 1)}}))
    with pytest.raises(ValueError, match=f"names {MAX_SHARDS + 1} shard files; at most {MAX_SHARDS}"):
        _load(hub_repo, tmp_path)
    assert not any("model-0" in r for r in hub_repo.requests)


@pytest.mark.parametrize("how", ["setting", "caller"])
def test_a_trickling_download_is_stopped_at_its_deadline(hub_repo, tmp_path, monkeypatch, how):
    import contextlib
    import time

    from bert_engine.checkpoints.hub import download_deadline

    hub_repo.faults["model.safetensors"] = "trickle"  # a byte every 0.2 s: no read ever times out
    if how == "setting":
        monkeypatch.setenv("BERT_ENGINE_DOWNLOAD_TIMEOUT", "2")
    started = time.monotonic()
    with download_deadline(2) if how == "caller" else contextlib.nullcontext(), \
            pytest.raises(HubError, match="downloading 'model.safetensors' of 'owner/tiny' ran past its time limit"):
        _load(hub_repo, tmp_path)
    assert time.monotonic() - started < 10
    # the next try, with the server healthy again, downloads and works
    del hub_repo.faults["model.safetensors"]
    model, tokenizer = _load(hub_repo, tmp_path)
    assert torch.isfinite(_logits(model, tokenizer)).all()


def test_an_older_huggingface_hub_imports_and_refuses_only_downloads(tmp_path, tiny_tokenizer):
    # huggingface_hub before 1.0 (requests, no client factory) sits beside transformers 4.x, as in the peers'
    # virtualenv of benchmarks.peers, whose summary glue imports the plugins: bert_engine must import there (it
    # ended the summary benchmark, session 56), load folders, and refuse a download it cannot bound, saying why.
    import subprocess
    import sys

    save_pretrained(BertWithHead(PRESETS["tiny"].with_labels(["neg", "pos"]), "sequence").eval(), tmp_path / "m",
                    tiny_tokenizer)
    script = f"""
import sys, types
import huggingface_hub
from huggingface_hub.utils import _http

class Before1(types.ModuleType):  # huggingface_hub as 0.x has it: no client factory to set
    def __getattr__(self, name):
        if name == "set_client_factory":
            raise AttributeError(name)
        return getattr(huggingface_hub, name)

old = Before1("huggingface_hub")
old.__path__, old.__version__ = huggingface_hub.__path__, "0.36.0"
sys.modules["huggingface_hub"] = old
del _http.default_client_factory
from bert_engine import HubError, resolve
from bert_engine.checkpoints import hub
assert not hub.HOOKED
assert resolve({str(tmp_path / "m")!r}).folder.name == "m"
try:
    resolve("owner/tiny", endpoint="http://127.0.0.1:9")
except HubError as err:
    print("refused:", err)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: 'owner/tiny': huggingface_hub" in done.stdout and "cannot bound a download's time" in done.stdout
