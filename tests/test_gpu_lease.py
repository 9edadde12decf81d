"""scripts/gpu_lease.sh's CPU dry run (SMOKE=1): every stage of a GPU lease on tiny data, so the next lent GPU
finds the script working: the compact base expanded, the shipped adapter rebased onto it, a smoke run, a timed
run, and the adapters back in float16 with the logs."""

import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from safetensors.torch import load

from scripts import compact_base

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.slow
def test_the_lease_script_runs_every_stage_on_a_cpu(tmp_path):
    corpus = tmp_path / "stage" / "corpus"
    (corpus / "gutenberg").mkdir(parents=True)
    text = FIXTURES / "regression" / "wikitext2_test_first3.txt"
    shutil.copy(text, corpus / "gutenberg" / "book.txt")
    for name in ("wiki.valid.tokens", "squad-train.txt", "bbc-train.txt"):
        shutil.copy(text, corpus / name)
    shutil.copy(FIXTURES / "sst_tiny.tsv", corpus / "sst2-dev.tsv")
    carry = tmp_path / "carry"
    compact_base.pack("default", carry / "minilm-compact")
    with lzma.open(carry / "corpus.tar.xz", "wb") as packed, tarfile.open(fileobj=packed, mode="w") as archive:
        archive.add(corpus, arcname="corpus")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "CARRY": str(carry), "WORK": str(work),
           "PY": sys.executable, "TRAIN_MINUTES": "0.2"}
    done = subprocess.run(["bash", "scripts/gpu_lease.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["best.tar", "last.tar", "logs.tar"]  # 8 files come back at most
    with tarfile.open(out / "logs.tar") as logs:
        names = {Path(n).name for n in logs.getnames()}
        rebased = json.load(logs.extractfile("./rebase.json"))
    assert {"base.json", "machine.json", "smoke.log", "train.log", "metrics.jsonl", "run.json", "train_config.json"} <= names
    assert rebased["base_model"] == str(work / "minilm")  # the shipped adapter, moved onto the expanded copy
    with tarfile.open(out / "last.tar") as adapter:
        assert "trainer_state.pt" not in adapter.getnames()  # the adapter only, not the optimizer
        tensors = load(adapter.extractfile("adapter.safetensors").read())
        config = json.load(io.TextIOWrapper(adapter.extractfile("adapter_config.json")))
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float16"}  # half the bytes on the way back
    assert config["base_sha256"] == json.loads((work / "logs" / "base.json").read_text())["sha256"]  # trained on the copy


@pytest.mark.slow
def test_the_lease_script_trains_qa_on_a_cpu(tmp_path):
    """TASK=qa: the QA starter rebased, trained on the SQuAD-layout files the script names, and sent back."""
    data = tmp_path / "stage" / "qa-data"
    data.mkdir(parents=True)
    squad = FIXTURES / "regression" / "squad_v2_dev_second_half.json"  # answerable and unanswerable questions
    for name in ("train-v1.1.part01of08.json", "qed-train.squad.part1of2.json", "qed-train.squad.part2of2.json",
                 "dev-v2.0.json"):
        shutil.copy(squad, data / name)
    carry = tmp_path / "carry"
    compact_base.pack("default", carry / "minilm-compact")
    with lzma.open(carry / "qa-data.tar.xz", "wb") as packed, tarfile.open(fileobj=packed, mode="w") as archive:
        archive.add(data, arcname="qa-data")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "SMOKE": "1", "TASK": "qa", "OUT": str(out), "CARRY": str(carry), "WORK": str(work),
           "PY": sys.executable, "TRAIN_MINUTES": "0.2"}
    done = subprocess.run(["bash", "scripts/gpu_lease.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with tarfile.open(out / "last.tar") as adapter:
        config = json.load(io.TextIOWrapper(adapter.extractfile("adapter_config.json")))
    with tarfile.open(out / "logs.tar") as logs:
        trained = json.load(logs.extractfile("./train_config.json"))
    assert config["head"] == "SpanHead" and config["rank"] == 40  # the QA pack, grown from rank 32 to RANK
    assert trained["task"] == "qa" and trained["batch_size"] == 4 and trained["init_adapter"] == str(work / "init")
