"""Training: masking and NSP statistics, the loop (loss falls, resume, DDP on gloo), LoRA, the commands."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SENTENCES
from safetensors.torch import load_file

from bert_engine.checkpoints.loader import load, load_tokenizer
from bert_engine.checkpoints.loading import CheckpointError, _umask, save_pretrained
from bert_engine.checkpoints.lora import LoraConfig, add_lora, merge_lora, save_adapter
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from bert_engine.training.jobs import PretrainJob, TaskJob
from bert_engine.training.loop import epoch_order, linear_schedule, parameter_groups, train
from bert_engine.training.pretraining import PairBuilder, collate_pairs, mask_tokens, special_mask, tokenize_documents
from bert_engine.training.train_config import TrainConfig, parse_best_metric

FIXTURES = Path(__file__).parent / "fixtures"
SST = FIXTURES / "sst_tiny.tsv"
CONLL = FIXTURES / "conll_tiny.txt"
ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river ran past old stone houses while children played near the bridge and their parents "
         "talked about the harvest , the weather , and the prices at the market in town").split()


def _corpus(path: Path, documents: int = 40, seed: int = 0) -> Path:
    """Documents of several lines each, blank lines between documents (the pretraining format)."""
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for d in range(documents):
            for _ in range(rng.randint(3, 6)):
                handle.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + f" doc{d % 7} .\n")
            handle.write("\n")
    return path


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return load_tokenizer(minilm_dir)


# -- masking and pairs -----------------------------------------------------------------------------------

def test_masking_proportions_and_specials(tokenizer):
    batch = tokenizer([" ".join(WORDS)] * 400, max_length=64)
    generator = torch.Generator().manual_seed(0)
    masked, labels = mask_tokens(batch.input_ids, tokenizer, generator=generator)
    special = special_mask(batch.input_ids, tokenizer)
    chosen = labels != -100
    assert not (chosen & special).any()  # [CLS], [SEP] and padding are never chosen
    assert chosen.sum() / (~special).sum() == pytest.approx(0.15, abs=0.01)
    original = batch.input_ids[chosen]
    now = masked[chosen]
    as_mask = (now == tokenizer.mask_token_id).float().mean().item()
    unchanged = (now == original).float().mean().item()
    assert as_mask == pytest.approx(0.8, abs=0.02)
    assert unchanged == pytest.approx(0.1, abs=0.02)
    assert 1 - as_mask - unchanged == pytest.approx(0.1, abs=0.02)  # random tokens
    assert torch.equal(masked[~chosen], batch.input_ids[~chosen])
    assert torch.equal(labels[chosen], original)


def test_whole_word_masking_takes_words_whole(tokenizer):
    text = "unbelievably extraordinary characterisation of internationalisation " * 6
    batch = tokenizer([text] * 200, max_length=64)
    _, labels = mask_tokens(batch.input_ids, tokenizer, whole_word=True, generator=torch.Generator().manual_seed(1))
    tokens = tokenizer.convert_ids_to_tokens(batch.input_ids[0].tolist())
    chosen = labels != -100
    for t in range(1, len(tokens)):
        if tokens[t].startswith("##"):
            assert torch.equal(chosen[:, t], chosen[:, t - 1])  # a piece goes with the piece before it
    assert 0.1 < chosen.float().mean().item() < 0.2


def test_dynamic_masking_draws_new_masks(tokenizer):
    batch = tokenizer(SENTENCES, max_length=64)
    first = mask_tokens(batch.input_ids, tokenizer, generator=torch.Generator().manual_seed(1))[1]
    second = mask_tokens(batch.input_ids, tokenizer, generator=torch.Generator().manual_seed(2))[1]
    assert not torch.equal(first, second)


def test_nsp_pairs_are_balanced_and_true_pairs_are_contiguous(tmp_path, tokenizer):
    from bert_engine.training.pretraining import read_documents

    documents = tokenize_documents(read_documents(_corpus(tmp_path / "corpus.txt", 80)), tokenizer)
    pairs = PairBuilder(documents, max_seq_len=48).pairs(seed=0)
    share = sum(p.is_random_next for p in pairs) / len(pairs)
    assert len(pairs) > 100 and share == pytest.approx(0.5, abs=0.07)
    streams = [[t for unit in d for t in unit] for d in documents]
    for pair in pairs[:50]:
        assert len(pair.a) + len(pair.b) <= 45
        if not pair.is_random_next:  # B follows A in one document (truncation may drop tokens between)
            assert any(_find(stream, pair.a) >= 0 and _find(stream[_find(stream, pair.a) + len(pair.a):], pair.b) >= 0
                       for stream in streams)
    batch, nsp = collate_pairs(pairs[:4], tokenizer)
    assert nsp.tolist() == [int(p.is_random_next) for p in pairs[:4]]
    assert batch.token_type_ids[0, len(pairs[0].a) + 2] == 1 and batch.token_type_ids[0, 1] == 0


def _find(stream, piece):
    n = len(piece)
    return next((i for i in range(len(stream) - n + 1) if stream[i:i + n] == piece), -1)


# -- the loop --------------------------------------------------------------------------------------------

def test_tiny_model_pretrains_with_falling_loss(tmp_path):
    corpus = _corpus(tmp_path / "corpus.txt", 30)
    cfg = TrainConfig(preset="tiny", train_file=str(corpus), eval_file=str(corpus), output_dir=str(tmp_path / "run"),
                      max_steps=60, batch_size=16, lr=5e-3, max_seq_len=48, log_every=10, warmup_ratio=0.1)
    result = train(PretrainJob(cfg), cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert losses[-1] < losses[0] * 0.7
    assert {"mlm_accuracy", "nsp_accuracy", "perplexity", "mlm_top5"} <= set(result["last_eval"])
    assert result["last_eval"]["perplexity"] < 30522 / 10
    reference = __import__("transformers").BertForPreTraining.from_pretrained(str(tmp_path / "run" / "best"))
    assert reference.config.hidden_size == 32  # the output is a standard checkpoint


def test_parameter_groups_never_decay_biases_or_layernorm(tiny_checkpoint):
    model, _ = load(tiny_checkpoint, "sequence", labels=["a", "b"])
    groups = parameter_groups(model, TrainConfig(weight_decay=0.1, lr=1e-4, head_lr=1e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    for group in groups:
        for p in group["params"]:
            name = names[id(p)]
            no_decay = name.endswith("bias") or "norm" in name
            assert group["weight_decay"] == (0.0 if no_decay else 0.1), name
            assert group["lr"] == (1e-3 if name.startswith("head.") else 1e-4), name


def test_linear_schedule_warms_up_then_decays():
    factor = linear_schedule(warmup=4, total=10)
    assert [round(factor(s), 3) for s in range(10)] == [0.25, 0.5, 0.75, 1.0, 1.0, 0.833, 0.667, 0.5, 0.333, 0.167]


def _sentiment_cfg(tiny_checkpoint, out, **overrides):
    values = dict(task="sentiment", model=str(tiny_checkpoint), train_file=str(SST), eval_file=str(SST),
                  output_dir=str(out), max_steps=8, batch_size=8, lr=5e-3, log_every=2, save_every=100,
                  warmup_ratio=0.25)
    values.update(overrides)
    return TrainConfig(**values)


def test_length_buckets_group_similar_lengths_and_keep_every_example():
    lengths = [(i * 7919) % 300 + 10 for i in range(1000)]
    plain = epoch_order(1000, 3, batch=16)
    bucketed = epoch_order(1000, 3, batch=16, lengths=lengths, buckets=20)
    assert sorted(bucketed) == list(range(1000)) and bucketed == epoch_order(1000, 3, batch=16, lengths=lengths,
                                                                            buckets=20)

    def padding(order):  # the share of padded positions when each batch pads to its longest row
        batches = [order[i:i + 16] for i in range(0, len(order), 16)]
        cells = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        return 1 - sum(lengths) / cells

    assert padding(plain) > 0.4 and padding(bucketed) < 0.1
    # the batches are shuffled, not served shortest first: the first ten are not in length order
    firsts = [max(lengths[i] for i in bucketed[b * 16:(b + 1) * 16]) for b in range(10)]
    assert firsts != sorted(firsts)
    assert epoch_order(1000, 3, batch=16, lengths=None, buckets=20) == plain
    with pytest.raises(ValueError, match="999 lengths for 1000 examples"):
        epoch_order(1000, 3, batch=16, lengths=lengths[:-1], buckets=20)


def test_bucketed_training_logs_less_padding(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    shares = {}
    for buckets in (0, 3):
        cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / f"run{buckets}", max_steps=3, batch_size=4, log_every=1,
                             length_buckets=buckets, eval_file=None)
        train(TaskJob(task, cfg), cfg)
        rows = [json.loads(line) for line in (tmp_path / f"run{buckets}" / "metrics.jsonl").read_text().splitlines()]
        shares[buckets] = sum(r["padding"] for r in rows if "padding" in r) / 3
        # each training record says how much memory the run holds (a growing run shows before it is killed)
        assert all(r["resident_mb"] > 10 for r in rows if "loss" in r)
    assert 0 <= shares[3] < shares[0]


def test_a_glob_pattern_trains_on_every_shard_it_matches(tiny_checkpoint, tmp_path):
    header, *rows = SST.read_text(encoding="utf-8").splitlines(keepends=True)
    for part in range(3):
        (tmp_path / f"shard-{part}.tsv").write_text(header + "".join(rows[part::3]), encoding="utf-8")
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", train_file=str(tmp_path / "shard-*.tsv"))
    assert len(TaskJob(task, cfg).examples) == len(rows)
    with pytest.raises(ValueError, match=r"nothing-\*\.tsv: no file matches this pattern"):
        TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "run", train_file=str(tmp_path / "nothing-*.tsv")))


def test_a_comma_separated_list_mixes_sources_and_names_a_missing_one(tiny_checkpoint, tmp_path):
    header, *rows = SST.read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "a.tsv").write_text(header + "".join(rows[:5]), encoding="utf-8")
    for part in range(2):
        (tmp_path / f"shard-{part}.tsv").write_text(header + "".join(rows[5 + part::2]), encoding="utf-8")
    task = load_registry(entry_points=False).task("sentiment")
    sources = f"{tmp_path / 'a.tsv'}, {tmp_path / 'shard-*.tsv'}"
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", train_file=sources)
    assert len(TaskJob(task, cfg).examples) == len(rows)
    missing = f"{tmp_path / 'a.tsv'},{tmp_path / 'absent.tsv'}"
    with pytest.raises(FileNotFoundError, match="absent.tsv"):
        TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "run", train_file=missing))


def test_resume_after_interrupt_continues_from_the_same_step(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    full_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "full")
    train(TaskJob(task, full_cfg), full_cfg)
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut")

    def interrupt(step, logs):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(TaskJob(task, cfg), cfg, on_step=interrupt)
    state = torch.load(tmp_path / "cut" / "last" / "trainer_state.pt", weights_only=True)
    assert state["state"]["step"] == 3
    resumed_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut", resume=True)
    steps_seen = []
    result = train(TaskJob(task, resumed_cfg), resumed_cfg, on_step=lambda step, logs: steps_seen.append(step))
    assert steps_seen == [4, 5, 6, 7, 8] and result["steps"] == 8
    full = load_file(tmp_path / "full" / "last" / "model.safetensors")
    cut = load_file(tmp_path / "cut" / "last" / "model.safetensors")
    for key in full:
        torch.testing.assert_close(cut[key], full[key], atol=1e-6, rtol=1e-5)


def test_stop_after_ends_early_on_the_full_schedule_and_resume_finishes_it(tiny_checkpoint, tmp_path, caplog):
    task = load_registry(entry_points=False).task("sentiment")
    full_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "full", log_every=1)
    train(TaskJob(task, full_cfg), full_cfg)
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut", log_every=1, stop_after=3)
    result = train(TaskJob(task, cfg), cfg)
    assert result["steps"] == 3
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["scheduled_steps"] == 8
    rows = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("full", "cut")}
    lrs = {run: [r["lr"] for r in rows[run] if "lr" in r] for run in rows}
    assert lrs["cut"] == lrs["full"][:3]  # the 8-step schedule, not one squeezed into 3 steps
    assert [r["step"] for r in rows["cut"] if "eval" in r][-1] == 3  # the stop is evaluated
    resumed_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut", log_every=1, resume=True)
    assert train(TaskJob(task, resumed_cfg), resumed_cfg)["steps"] == 8
    full = load_file(tmp_path / "full" / "last" / "model.safetensors")
    cut = load_file(tmp_path / "cut" / "last" / "model.safetensors")
    for key in full:
        torch.testing.assert_close(cut[key], full[key], atol=1e-6, rtol=1e-5)
    again = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut", resume=True, stop_after=3)  # already past step 3
    with caplog.at_level("WARNING", logger="bert_engine.training.loop"):
        assert train(TaskJob(task, again), again)["steps"] == 8
    assert "at step 8 already, at or past where it should stop (3): nothing to train" in caplog.text
    with pytest.raises(ValueError, match="stop_after must be at least 1.*got 0"):
        _sentiment_cfg(tiny_checkpoint, tmp_path / "bad", stop_after=0)


class _Clock:
    """time for the loop module: monotonic() reads a clock the test moves (one second per step)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def time(self):
        return self.now

    def tick(self, step, logs):
        self.now += 1.0


def test_max_minutes_sets_the_schedule_from_the_first_steps_and_resume_keeps_it(tiny_checkpoint, tmp_path,
                                                                                monkeypatch, caplog):
    from bert_engine.training import loop

    clock = _Clock()
    monkeypatch.setattr(loop, "time", clock)
    task = load_registry(entry_points=False).task("sentiment")
    # 1 s per step, a 1-minute budget: timed over steps 10-40, planned after 39 s, so 21 more steps fit
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "timed", max_steps=1000, max_minutes=1.0, stop_after=50,
                         log_every=1, eval_every=1000)
    with caplog.at_level("INFO", logger="bert_engine.training.loop"):
        assert train(TaskJob(task, cfg), cfg, on_step=clock.tick)["steps"] == 50  # stop_after still cuts it
    assert "max_minutes 1: 1 s per step over steps 10-40; the schedule ends at step 61" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "timed" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert lrs[45] == pytest.approx(5e-3 * (61 - 45) / (61 - 15))  # warm-up 25 % of 61 steps, then decay to step 61
    resumed = dataclasses.replace(cfg, resume=True, stop_after=None)
    assert train(TaskJob(task, resumed), resumed, on_step=clock.tick)["steps"] == 61  # the count kept, not re-timed
    assert json.loads((tmp_path / "timed" / "run.json").read_text())["scheduled_steps"] == 61
    # a GPU speeds up as it meets each new batch shape: 2 s per step to step 40, then 1 s; a 5-minute budget
    sped = _Clock()
    sped.tick = lambda step, logs: setattr(sped, "now", sped.now + (2.0 if step < 40 else 1.0))
    monkeypatch.setattr(loop, "time", sped)
    faster = _sentiment_cfg(tiny_checkpoint, tmp_path / "faster", max_steps=1000, max_minutes=5.0, eval_every=1000)
    caplog.clear()
    with caplog.at_level("INFO", logger="bert_engine.training.loop"):
        assert train(TaskJob(task, faster), faster, on_step=sped.tick)["steps"] == 262
    assert "2 s per step over steps 10-40; the schedule ends at step 151" in caplog.text  # 78 s spent, 222 left
    assert "1 s per step over steps 40-80; the schedule ends at step 262" in caplog.text  # re-timed: 182 s left
    assert "steps 80-160" not in caplog.text  # 198 s spent, past half the time: the count stays (and did not move)
    assert sped.now == pytest.approx(300, abs=1)
    # evaluations are not steps: one costing 50 s inside the first timing leaves the speed at 1 s per step
    slow_eval = _Clock()
    evaluate = loop._evaluate_and_keep_best

    def costly(*args, **kwargs):
        slow_eval.now += 50.0
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "time", slow_eval)
    monkeypatch.setattr(loop, "_evaluate_and_keep_best", costly)
    evaluated = _sentiment_cfg(tiny_checkpoint, tmp_path / "evaluated", max_steps=1000, max_minutes=3.0,
                               eval_every=25)
    caplog.clear()
    with caplog.at_level("INFO", logger="bert_engine.training.loop"):
        assert train(TaskJob(task, evaluated), evaluated, on_step=slow_eval.tick)["steps"] == 80
    assert "1 s per step over steps 10-40; the schedule ends at step 131" in caplog.text  # 89 s spent, 91 left
    # by step 80 the evaluations at 50 and 75 have spent the budget: the schedule ends there
    assert "1 s per step over steps 40-80; the schedule ends at step 80" in caplog.text
    monkeypatch.setattr(loop, "time", sped)
    capped = _sentiment_cfg(tiny_checkpoint, tmp_path / "capped", max_steps=45, max_minutes=10.0, eval_every=1000)
    assert train(TaskJob(task, capped), capped, on_step=sped.tick)["steps"] == 45  # max_steps caps the plan
    with pytest.raises(ValueError, match="max_minutes must be positive.*got 0"):
        _sentiment_cfg(tiny_checkpoint, tmp_path / "bad", max_minutes=0)


KILL_SCRIPT = """
import json, os, signal, sys
from bert_engine.training.jobs import TaskJob
from bert_engine.tasks.registry import load_registry
from bert_engine.training.loop import train
from bert_engine.training.train_config import TrainConfig

cfg = TrainConfig(**json.loads(sys.argv[1]))
task = load_registry(entry_points=False).task("sentiment")

def kill(step, logs):
    if step == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)  # no handler runs, nothing is saved on the way out

train(TaskJob(task, cfg), cfg, on_step=kill)
"""


def test_a_run_killed_mid_epoch_resumes_to_the_same_result(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    full_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "full", save_every=2)
    train(TaskJob(task, full_cfg), full_cfg)
    cut_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut", save_every=2)
    # 24 examples in batches of 8: step 5 is the middle of the second epoch; the last checkpoint is step 4
    killed = subprocess.run([sys.executable, "-c", KILL_SCRIPT, json.dumps(dataclasses.asdict(cut_cfg)), "5"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert torch.load(tmp_path / "cut" / "last" / "trainer_state.pt", weights_only=True)["state"]["step"] == 4
    resumed_cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "cut", save_every=2, resume=True)
    steps_seen = []
    train(TaskJob(task, resumed_cfg), resumed_cfg, on_step=lambda step, logs: steps_seen.append(step))
    assert steps_seen == [5, 6, 7, 8]
    logged = [[(r["step"], "eval" in r) for r in map(json.loads, (tmp_path / run / "metrics.jsonl").open())]
              for run in ("full", "cut")]
    assert logged[1] == logged[0], "the resumed run's log repeats or misses steps"  # step 5 was logged, then redone
    full = load_file(tmp_path / "full" / "last" / "model.safetensors")
    cut = load_file(tmp_path / "cut" / "last" / "model.safetensors")
    for key in full:
        torch.testing.assert_close(cut[key], full[key], atol=1e-6, rtol=1e-5)


def test_a_checkpoint_that_fails_mid_write_leaves_the_previous_one_whole(tiny_checkpoint, tmp_path, monkeypatch):
    import bert_engine.training.loop as training

    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", save_every=2)
    real_save, calls = torch.save, []

    def failing_save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint (step 4): half a file, then the disk "fills up"
            Path(path).write_bytes(b"PK\x03\x04 half a zip")
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(training.torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        train(TaskJob(task, cfg), cfg)
    monkeypatch.setattr(training.torch, "save", real_save)
    last = tmp_path / "run" / "last"
    assert torch.load(last / "trainer_state.pt", weights_only=True)["state"]["step"] == 2  # the step-2 one, whole
    load_file(last / "model.safetensors")
    resumed = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", save_every=2, resume=True)
    assert train(TaskJob(task, resumed), resumed)["steps"] == 8
    assert not (tmp_path / "run" / ".last.partial").exists()


def test_the_best_checkpoint_follows_the_metric_goal(tiny_checkpoint, tmp_path):
    """A metric to minimise keeps its lowest evaluation, not its highest."""
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=12, eval_every=2, lr=1e-2,
                         best_metric="macro_f1:min")
    result = train(TaskJob(task, cfg), cfg)
    evals = [r["eval"]["macro_f1"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open()) if "eval" in r]
    assert len(set(evals)) > 1 and result["best"] == min(evals) and result["best_metric"] == "macro_f1"
    assert json.loads((tmp_path / "run" / "best" / "eval.json").read_text())["macro_f1"] == min(evals)


def test_a_misspelt_best_metric_fails_before_training_naming_the_metrics(tiny_checkpoint, tmp_path):
    """--best-metric acuracy: refused when the job is built (two held-out examples name the metrics), not
    at the first evaluation a thousand steps in; nothing is written."""
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=12, eval_every=2, best_metric="acuracy")
    with pytest.raises(ValueError, match=r"best_metric 'acuracy' is not reported by the evaluation of task 'sentiment'; "
                                         r"did you mean 'accuracy'\? It reports: accuracy, .*macro_f1"):
        TaskJob(task, cfg)
    assert not (tmp_path / "run").exists()


def test_training_a_new_head_does_not_warn_to_train_the_head_first(tiny_checkpoint, tmp_path, caplog):
    """The base has no sentiment head: training one is the point, so the loader's "train the head first" warning
    (meant for predicting with a base) is not shown to someone doing just that."""
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=2)
    with caplog.at_level("INFO"):
        TaskJob(task, cfg)
    assert "train the head first" not in caplog.text


def test_a_best_metric_that_more_data_may_give_is_warned_of_not_refused(tiny_checkpoint, tmp_path, caplog):
    """QA's best_f1 appears only when the evaluated questions include unanswerable ones, which two examples may
    not: a name that is no near miss of a reported one is a warning at the start, not a refusal."""
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=12, eval_every=2, best_metric="heldout_brier")
    with caplog.at_level("WARNING", logger="bert_engine.training.jobs"):
        TaskJob(task, cfg)
    assert "best_metric 'heldout_brier' is not among the metrics the evaluation of two held-out examples gave" in caplog.text
    # the first evaluation settles it, and the error says how to go on from the run folder it leaves
    with pytest.raises(ValueError, match="best_metric 'heldout_brier' is not among the evaluation's metrics .*; correct "
                                         "--best-metric and rerun with --resume: .*run keeps the run"):
        train(TaskJob(task, cfg), cfg)
    fixed = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=12, eval_every=2, best_metric="accuracy",
                           resume=True)
    assert train(TaskJob(task, fixed), fixed)["steps"] == 12


@pytest.mark.parametrize("value, goal", [(None, "max"), ("accuracy", "max"), ("eval_loss", "min"), ("perplexity", "min"),
                                         ("accuracy:min", "min"), ("loss:max", "max")])
def test_best_metric_goals(value, goal):
    assert parse_best_metric(value)[1] == goal
    with pytest.raises(ValueError, match="must be max or min"):
        TrainConfig(best_metric="accuracy:up")


@pytest.mark.parametrize("steps", [0, -5])
def test_max_steps_must_be_positive(steps):
    with pytest.raises(ValueError, match=f"max_steps must be at least 1 .*got {steps}"):
        TrainConfig(max_steps=steps)


@pytest.mark.parametrize("content, message", [
    ("sentence\tlabel\ngood\t1\nbad\t5\n", "example 2 has label 5, but the head's labels are"),
    ("sentence\tlabel\ngood\t1\nbad\tx\n", ":3: label 'x' is not an integer label id"),
    ("sentence\tlabel\ngood\n", ":2: no label"),
    ("text\tlabel\ngood\t1\n", ":1: expected a header line naming the columns 'sentence' and 'label'"),
    (b"\x80\x00\xffPK binary", "not UTF-8 text \\(byte 0"),
])
def test_bad_training_data_is_named_before_training(tiny_checkpoint, tmp_path, content, message):
    data = tmp_path / "train.tsv"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", train_file=str(data), eval_file=None)
    with pytest.raises(ValueError, match=message):
        TaskJob(load_registry(entry_points=False).task("sentiment"), cfg)
    assert not (tmp_path / "run").exists()


def test_fine_tuning_learns_the_fixture(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=40, lr=1e-2, eval_every=20)
    result = train(TaskJob(task, cfg), cfg)
    assert result["best_metric"] == "accuracy" and result["best"] >= 0.9
    assert json.loads((tmp_path / "run" / "best" / "eval.json").read_text())["accuracy"] == result["best"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_one_process(tiny_checkpoint, tmp_path):
    """torchrun with 2 CPU processes (gloo on loopback), 4 examples each, against 1 process with 8."""
    common = ["train", "sentiment", "--model", str(tiny_checkpoint), "--train-file", str(SST), "--eval-file", str(SST),
              "--max-steps", "6", "--lr", "5e-3", "--log-every", "2", "--warmup-ratio", "0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "bert_engine", *common, "--batch-size", "8",
                             "--output-dir", str(tmp_path / "one")], capture_output=True, text=True, env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "bert_engine",
                             *common, "--batch-size", "4", "--output-dir", str(tmp_path / "two")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = json.loads(single.stdout), json.loads(double.stdout)  # rank 0 alone prints
    assert one["steps"] == two["steps"] == 6
    # metrics gathered over both ranks (the logits differ in their last bits between batchings: rel 1e-4)
    assert two["last_eval"] == pytest.approx(one["last_eval"], rel=1e-4)
    a = load_file(tmp_path / "one" / "last" / "model.safetensors")
    b = load_file(tmp_path / "two" / "last" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-4)
    logged = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len([line for line in logged if "loss" in line]) == 3  # rank 0 only: no duplicated lines


# -- LoRA --------------------------------------------------------------------------------------------------

def test_lora_trains_only_adapters_and_head_and_loads_back(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "lora", max_steps=10, lr=1e-2, lora_rank=4,
                         lora_targets="query,value,ffn_down", merge_lora=True)
    job = TaskJob(task, cfg)
    before = {k: v.clone() for k, v in job.model.encoder.state_dict().items() if "lora" not in k and "pooler" not in k}
    train(job, cfg)
    after = job.model.encoder.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # the base encoder is frozen
    last = tmp_path / "lora" / "last"  # the final weights (best/ holds the best evaluation's)
    assert (last / "adapter.safetensors").stat().st_size < 200_000 and not (last / "model.safetensors").exists()
    meta = json.loads((last / "adapter_config.json").read_text())
    assert meta["rank"] == 4 and meta["targets"] == ["query", "value", "ffn_down"] and len(meta["base_sha256"]) == 64
    loaded = load(last, task.spec.build_head)
    adapted, tokenizer = loaded
    merged, _ = load(tmp_path / "lora" / "last" / "merged", task.spec.build_head)
    batch = tokenizer(SENTENCES)
    job.model.eval()
    with torch.no_grad():
        live = job.model(**batch.model_inputs()).logits
        torch.testing.assert_close(adapted(**batch.model_inputs()).logits, live, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(merged(**batch.model_inputs()).logits, live, atol=1e-5, rtol=1e-4)
    assert loaded.report.missing == [] and loaded.adapter["rank"] > 0 and loaded.base is not None

    # an adapter file that is truncated, or links outside its folder, is refused by name
    broken = tmp_path / "broken"
    shutil.copytree(last, broken, ignore=shutil.ignore_patterns("merged"))
    data = (broken / "adapter.safetensors").read_bytes()
    (broken / "adapter.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="adapter.safetensors: unreadable safetensors file"):
        load(broken, task.spec.build_head)
    (tmp_path / "elsewhere.safetensors").write_bytes(data)
    (broken / "adapter.safetensors").unlink()
    (broken / "adapter.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="adapter.safetensors: points outside the checkpoint folder"):
        load(broken, task.spec.build_head)


def test_lora_on_fused_qkv_equals_separate_projections(tiny_checkpoint):
    model, tokenizer = load(tiny_checkpoint)
    add_lora(model, LoraConfig(rank=2, targets=("key",)))
    layer = model.layers[0].attention.qkv
    with torch.no_grad():
        layer.lora_b[0].normal_()
    x = torch.randn(3, 5, 32)
    H = 32
    expected = layer.base(x)
    expected[..., H:2 * H] += (x @ layer.lora_a[0].T) @ layer.lora_b[0].T * layer.scaling
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.merged()(x), expected, atol=1e-5, rtol=1e-5)


def test_reduce_rank_keeps_a_delta_of_lower_rank_exactly_and_the_best_approximation_otherwise():
    from bert_engine.checkpoints.lora import reduce_rank

    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 10, generator=g)
    b = torch.randn(12, 6, generator=g)
    b[:, 3:] = 0  # a rank-6 adapter whose delta has rank 3
    tensors = {"x.lora_a.0": a, "x.lora_b.0": b, "head.bias": torch.ones(4)}
    out, kept = reduce_rank(tensors, 0.5, 3)
    assert out["x.lora_a.0"].shape == (3, 10) and out["x.lora_b.0"].shape == (12, 3) and out["head.bias"] is tensors["head.bias"]
    torch.testing.assert_close(out["x.lora_b.0"] @ out["x.lora_a.0"], 0.5 * b @ a, atol=1e-5, rtol=1e-5)
    assert kept == pytest.approx(1.0)
    # a full-rank delta: rank 2 is its best approximation (Eckart-Young), the share of energy kept reported
    full = {"x.lora_a.0": a, "x.lora_b.0": torch.randn(12, 6, generator=g)}
    out, kept = reduce_rank(full, 1.0, 2)
    s = torch.linalg.svdvals(full["x.lora_b.0"] @ a)
    error = torch.linalg.matrix_norm(out["x.lora_b.0"] @ out["x.lora_a.0"] - full["x.lora_b.0"] @ a)
    assert float(error) == pytest.approx(float(s[2:].square().sum().sqrt()), rel=1e-4)
    assert kept == pytest.approx(float(s[:2].square().sum() / s.square().sum()), rel=1e-5) and kept < 1
    for bad in (0, 6, 9):
        with pytest.raises(ValueError, match=f"rank {bad}: the adapter has rank 6"):
            reduce_rank(full, 1.0, bad)


def test_a_lora_rank_above_the_model_width_is_refused_before_allocating(tiny_checkpoint, tmp_path):
    """A rank of 100,000 on MiniLM once trained, writing 14 GB of checkpoints for one step; no LoRA delta of a
    width-32 model has a rank above 32, and the adapter would be larger than the model."""
    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", lora_rank=33)
    with pytest.raises(ValueError, match="lora_rank 33 is above the model's hidden size 32"):
        TaskJob(task, cfg)
    assert not (tmp_path / "run").exists()
    TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "run", lora_rank=32))  # at the width: allowed


def test_adapter_on_a_changed_base_is_refused(tiny_checkpoint, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, base)
    model, _ = load(base, "sequence", labels=["a", "b"])
    config = LoraConfig(rank=2)
    add_lora(model.encoder, config)
    save_adapter(model, tmp_path / "adapter", config, str(base), base)
    assert load(tmp_path / "adapter", "sequence").report.missing == []
    labels = (tmp_path / "adapter" / "config.json").read_text()
    (tmp_path / "adapter" / "config.json").write_text('{"id2label": ["a", "b"]}')  # a list, not {"0": ...}
    with pytest.raises(CheckpointError, match=r"adapter/config\.json: not a JSON object with id2label"):
        load(tmp_path / "adapter", "sequence")
    (tmp_path / "adapter" / "config.json").write_text(labels)
    other, _ = load(base)
    with torch.no_grad():
        other.embeddings.word_embeddings.weight.mul_(2)
    save_pretrained(other, base)  # the base model changed after the adapter was trained on it
    with pytest.raises(CheckpointError, match="sha256"):
        load(tmp_path / "adapter", "sequence")
    with pytest.raises(ValueError, match="'attention'"):
        LoraConfig(targets=("attention",))
    assert merge_lora(model) == 2


# -- commands ----------------------------------------------------------------------------------------------

def test_train_help_explains_every_setting():
    import dataclasses

    out = subprocess.run([sys.executable, "-m", "bert_engine", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    from bert_engine.training.train_config import DISTILL_ONLY, PRETRAIN_ONLY

    def usage(command: str) -> str:
        return subprocess.run([sys.executable, "-m", "bert_engine", command, "--help"], capture_output=True,
                              text=True, check=True).stdout

    pretrain, distill = usage("pretrain"), usage("distill")
    for f in dataclasses.fields(TrainConfig):
        flag = "--option" if f.name == "options" else "--" + f.name.replace("_", "-")  # -o NAME=VALUE, as predict
        if f.name in PRETRAIN_ONLY:
            assert flag in pretrain and flag not in out, flag
        elif f.name in DISTILL_ONLY:
            assert flag in distill and flag not in out and flag not in pretrain, flag
        elif f.name != "task":
            assert flag in out, flag
    assert "--lora-rank" in out and "LoRA adapters" in " ".join(out.split())


def test_config_file_with_flag_overrides(tiny_checkpoint, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {tiny_checkpoint}\ntrain_file: {SST}\nmax_steps: 2\nbatch_size: 4\nlr: 0.01\n")
    out = subprocess.run([sys.executable, "-m", "bert_engine", "train", "sentiment", "--config", str(config),
                          "--output-dir", str(tmp_path / "run"), "--max-steps", "3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["steps"] == 3
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["batch_size"] == 4 and saved["max_steps"] == 3
    # only what fine-tuning reads: no pretraining or distillation default beside the settings used
    assert not {"whole_word_mask", "max_seq_len", "teacher", "alpha_soft"} & set(saved) and "options" in saved
    again = subprocess.run([sys.executable, "-m", "bert_engine", "train", "sentiment", "--config",
                            str(tmp_path / "run" / "train_config.json"), "--output-dir", str(tmp_path / "again")],
                           capture_output=True, text=True)  # the record is a config file that runs again
    assert again.returncode == 0 and json.loads((tmp_path / "again" / "train_config.json").read_text()) == \
        {**saved, "output_dir": str(tmp_path / "again")}, again.stderr[-2000:]
    bad = tmp_path / "bad.json"
    bad.write_text('{"learning_rate": 0.1}')
    out = subprocess.run([sys.executable, "-m", "bert_engine", "train", "sentiment", "--config", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "unknown training settings ['learning_rate']" in out.stderr


def test_eval_command_prints_standard_metrics(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bert_engine", "eval", "ner", "--data",
                          str(FIXTURES / "conll_tiny.txt"), "--split", "test"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["examples"] == 3 and {"precision", "recall", "f1", "per_type"} <= set(report["metrics"])
    out = subprocess.run([sys.executable, "-m", "bert_engine", "eval", "qa", "--data", str(FIXTURES / "squad_tiny.json"),
                          "--limit", "3"], capture_output=True, text=True)
    assert out.returncode == 0 and set(json.loads(out.stdout)["metrics"]) == {"exact_match", "f1", "no_answer_rate"}
    missing = subprocess.run([sys.executable, "-m", "bert_engine", "eval", "ner", "--data", str(tmp_path / "nope.txt")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.txt" in missing.stderr


def test_a_third_party_task_trains_with_the_same_command(installed_example, tiny_checkpoint, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed_example), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "bert_engine", "train", "similarity", "--model", str(tiny_checkpoint),
                          "--train-file", str(FIXTURES / "sts_tiny.tsv"), "--eval-file", str(FIXTURES / "sts_tiny.tsv"),
                          "--max-steps", "4", "--batch-size", "4", "--output-dir", str(tmp_path / "sts")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["steps"] == 4 and {"spearman", "pearson"} <= set(report["last_eval"])
    assert (tmp_path / "sts" / "best" / "model.safetensors").is_file()


def test_task_options_reach_training_batches_and_unknown_ones_are_named(tiny_checkpoint, tmp_path):
    from bert_engine.cli import _training_config, build_parser

    task = load_registry(entry_points=False).task("ner")
    args = build_parser().parse_args(["train", "ner", "--model", str(tiny_checkpoint), "--train-file", str(CONLL),
                                      "-o", "max_length=16", "-o", "stride=4", "--output-dir", str(tmp_path / "run")])
    cfg = _training_config(args, task="ner")
    assert cfg.options == {"max_length": 16, "stride": 4}
    job = TaskJob(task, cfg)
    batch, _ = job.collate(job.examples[:4], torch.Generator().manual_seed(0))
    assert batch.input_ids.shape[1] <= 16 and job.eval_options == {"max_length": 16, "stride": 4}
    with pytest.raises(ValueError, match="task 'ner' has no training option 'bogus'; its options: .*max_length"):
        TaskJob(task, dataclasses.replace(cfg, options={"bogus": 1}))


def test_a_model_trained_with_a_task_option_is_packed_to_answer_with_it(tiny_checkpoint, tmp_path):
    from bert_engine.cli import main

    task = load_registry(entry_points=False).task("ner")
    cfg = TrainConfig(task="ner", model=str(tiny_checkpoint), train_file=str(CONLL), eval_file=str(CONLL),
                      output_dir=str(tmp_path / "run"), max_steps=2, batch_size=2, lora_rank=4, eval_every=2,
                      precision="fp32", options={"casing": True, "max_length": 32, "stride": 8})
    job = TaskJob(task, cfg)
    batch, _ = job.collate(job.examples[:3], torch.Generator().manual_seed(0))
    assert batch.token_type_ids.eq(1).any() and job.eval_options == {"casing": True, "max_length": 32, "stride": 8}
    train(job, cfg)
    # the run's checkpoints answer with them too, before any pack
    for folder in ("best", "last"):
        assert Predictor.load(task, str(tmp_path / "run" / folder)).model_options == {
            "casing": True, "max_length": 32, "stride": 8}
    # both are how the model was trained: evaluated with, and the packed model's defaults; -o still wins
    assert main(["pack", "ner", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "packed"),
                 "--eval-data", str(CONLL), "--eval-split", "all", "-o", "max_length=48"]) == 0
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["options"] == {"casing": True, "max_length": 48, "stride": 8}
    predictor = Predictor.load(task, str(tmp_path / "packed"))
    assert predictor.model_options == manifest["options"]
    assert predictor.check_options({})["casing"] is True


def test_the_command_lines_that_trained_a_run_become_its_packs_command(tiny_checkpoint, tmp_path, capsys):
    """pack without --command-line records the `bert-engine train` lines the run's run.json lists, a resumed run's
    after the one it resumed: before, a pack's command was null unless it was typed again."""
    from bert_engine.cli import main

    run = tmp_path / "run"
    first = ["train", "sentiment", "--model", str(tiny_checkpoint), "--train-file", str(SST), "--eval-file", str(SST),
             "--output-dir", str(run), "--max-steps", "4", "--stop-after", "2", "--batch-size", "8", "--lora-rank", "4",
             "--eval-every", "2", "--precision", "fp32"]
    assert main(first) == 0
    assert json.loads((run / "run.json").read_text())["commands"] == [shlex.join(["bert-engine", *first])]
    resumed = ["train", "sentiment", "--config", str(run / "train_config.json"), "--resume"]
    assert main(resumed) == 0
    commands = json.loads((run / "run.json").read_text())["commands"]
    assert commands == [shlex.join(["bert-engine", *first]), shlex.join(["bert-engine", *resumed])]
    capsys.readouterr()
    assert main(["pack", "sentiment", "--run", str(run), "--to", str(tmp_path / "packed")]) == 0
    assert json.loads((tmp_path / "packed" / "manifest.json").read_text())["command"] == " && ".join(commands)


def test_a_run_records_its_wall_time_and_machine_and_pack_carries_them(tiny_checkpoint, tmp_path, capsys):
    from bert_engine.cli import main

    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", lora_rank=4, max_steps=4, eval_every=4,
                         precision="fp32", device="cpu")
    train(TaskJob(task, cfg), cfg)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["steps"] == 4 and record["wall_seconds"] > 0 and record["device"] == "cpu"
    assert record["cpu_capability"] and record["torch"] == torch.__version__ and record["autocast"] is None
    capsys.readouterr()
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "packed"),
                 "--eval-data", str(SST), "--eval-split", "all", "--command-line", "bert-engine train sentiment"]) == 0
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["run"] == record and manifest["metrics"][f"{SST.name}:all"]["examples"] == 24
    assert sorted(manifest["files"]) == ["adapter.safetensors", "adapter_config.json", "config.json"]
    assert manifest["adapter_dtype"] == "fp32"

    # --adapter-dtype fp16 stores the same tensors rounded to float16, and the folder still loads and scores
    # (accuracies are not compared: 4 steps leave near-ties that rounding may flip)
    from safetensors.torch import load_file
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "half"),
                 "--eval-data", str(SST), "--eval-split", "all", "--adapter-dtype", "fp16"]) == 0
    half = json.loads((tmp_path / "half" / "manifest.json").read_text())
    assert half["adapter_dtype"] == "fp16" and half["metrics"][f"{SST.name}:all"]["examples"] == 24
    full_tensors = load_file(tmp_path / "packed" / "adapter.safetensors")
    half_tensors = load_file(tmp_path / "half" / "adapter.safetensors")
    assert half_tensors.keys() == full_tensors.keys()
    for name, tensor in half_tensors.items():
        assert tensor.dtype == torch.float16
        torch.testing.assert_close(tensor.float(), full_tensors[name], rtol=1e-3, atol=1e-4)
    assert half["files"]["adapter.safetensors"] < 0.6 * manifest["files"]["adapter.safetensors"]
    # readable as any file we write (safetensors alone writes 0600)
    assert oct((tmp_path / "half" / "adapter.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    # -o: an option tuned for this model is evaluated with and rides in the manifest as the model's default
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "tuned"),
                 "--eval-data", str(SST), "--eval-split", "all", "-o", "max_length=64"]) == 0
    # and the temperature the evaluation fitted on the first half of the data becomes the default too
    tuned = json.loads((tmp_path / "tuned" / "manifest.json").read_text())
    temperature = tuned["metrics"][f"{SST.name}:all"]["tuned_temperature"]
    assert tuned["options"] == {"max_length": 64, "temperature": temperature}
    assert Predictor.load(task, str(tmp_path / "tuned")).model_options == tuned["options"]

    # a packed folder packs again in place (its run is gone): same adapter, the training record kept
    adapter = (tmp_path / "packed" / "adapter.safetensors").read_bytes()
    assert main(["pack", "sentiment", "--run", str(tmp_path / "packed"), "--to", str(tmp_path / "packed"),
                 "--eval-data", str(SST), "--eval-split", "all"]) == 0
    again = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert (tmp_path / "packed" / "adapter.safetensors").read_bytes() == adapter
    assert again["run"] == record and again["training"] == manifest["training"]
    assert again["command"] == "bert-engine train sentiment" and again["options"] == {"temperature": temperature}
    # ... and without --eval-data it keeps how it answers (the tuned temperature, -o max_length) and, the weights
    # being the same, what it scored; cut to a lower rank its metrics no longer hold and are dropped
    assert main(["pack", "sentiment", "--run", str(tmp_path / "tuned"), "--to", str(tmp_path / "retuned")]) == 0
    kept = json.loads((tmp_path / "retuned" / "manifest.json").read_text())
    assert kept["options"] == tuned["options"] and kept["metrics"] == tuned["metrics"]
    assert kept["metrics_from"].startswith(f"the pack of {tuned['date']}")
    assert Predictor.load(task, str(tmp_path / "retuned")).model_options == tuned["options"]
    assert main(["pack", "sentiment", "--run", str(tmp_path / "tuned"), "--to", str(tmp_path / "cut"),
                 "--adapter-rank", "2", "-o", "max_length=32"]) == 0
    cut = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert cut["options"] == {"max_length": 32, "temperature": temperature} and cut["metrics"] == {}
    # an fp16 pack packed again as it is stays fp16 (the manifest says so) and keeps its metrics; a pack of that
    # pack still names the pack that evaluated it
    assert main(["pack", "sentiment", "--run", str(tmp_path / "half"), "--to", str(tmp_path / "half2")]) == 0
    half2 = json.loads((tmp_path / "half2" / "manifest.json").read_text())
    assert half2["adapter_dtype"] == "fp16" and half2["metrics"] == half["metrics"]
    assert main(["pack", "sentiment", "--run", str(tmp_path / "half2"), "--to", str(tmp_path / "half3")]) == 0
    half3 = json.loads((tmp_path / "half3" / "manifest.json").read_text())
    assert half3["metrics_from"] == half2["metrics_from"] == f"the pack of {half['date']} (the same weights; not evaluated again)"
    capsys.readouterr()
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "bad"),
                 "-o", "max_lenght=64"]) == 2
    assert "max_lenght" in capsys.readouterr().err
    # a folder that is not a pack is never written into
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "mine")]) == 2
    assert "already holds files that are not a pack (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]

    # --adapter-rank: stored at a lower rank (truncated SVD), evaluated as stored, the trained rank recorded
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "low"),
                 "--eval-data", str(SST), "--eval-split", "all", "--adapter-rank", "2"]) == 0
    low = json.loads((tmp_path / "low" / "manifest.json").read_text())
    assert low["lora"]["rank"] == 2 and low["lora"]["alpha"] == 2.0
    assert low["adapter_rank_reduced"]["trained_rank"] == 4 and low["adapter_rank_reduced"]["stored_rank"] == 2
    assert 0 < low["adapter_rank_reduced"]["min_energy_kept"] <= 1
    assert load_file(tmp_path / "low" / "adapter.safetensors")["encoder.layers.0.attention.qkv.lora_a.0"].shape[0] == 2
    assert low["metrics"][f"{SST.name}:all"]["examples"] == 24 and Predictor.load(task, str(tmp_path / "low"))
    assert oct((tmp_path / "low" / "adapter.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    capsys.readouterr()
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "too_high"),
                 "--adapter-rank", "4"]) == 2
    assert "--adapter-rank 4: the adapter has rank 4" in capsys.readouterr().err
    assert not (tmp_path / "too_high").exists()  # refused before anything is written

    # --checkpoint last: the run's last/ instead of best/, its last logged evaluation recorded
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "at_end"),
                 "--eval-data", str(SST), "--eval-split", "all", "--checkpoint", "last"]) == 0
    at_end = json.loads((tmp_path / "at_end" / "manifest.json").read_text())
    assert at_end["checkpoint"]["packed"] == "last" and at_end["checkpoint"]["last_eval_during_training"]["step"] == 4
    assert (tmp_path / "at_end" / "adapter.safetensors").read_bytes() == (
        tmp_path / "run" / "last" / "adapter.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "run" / "last")
    capsys.readouterr()
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "no_last"),
                 "--checkpoint", "last"]) == 2
    assert "no last/ checkpoint to pack" in capsys.readouterr().err
    assert main(["pack", "sentiment", "--run", str(tmp_path / "at_end"), "--to", str(tmp_path / "at_end"),
                 "--checkpoint", "last"]) == 2
    assert "a packed folder holds one model" in capsys.readouterr().err

    # one --eval-split per --eval-data, paired in order (Gutenberg's test split, then a whole test file)
    other = tmp_path / "other.tsv"
    other.write_bytes(SST.read_bytes())
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "two"),
                 "--eval-data", str(SST), "--eval-data", str(other), "--eval-split", "dev", "--eval-split", "all"]) == 0
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert sorted(two["metrics"]) == sorted([f"{SST.name}:dev", "other.tsv:all"])
    capsys.readouterr()
    assert main(["pack", "sentiment", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "bad"),
                 "--eval-data", str(SST), "--eval-data", str(other),
                 "--eval-split", "dev", "--eval-split", "all", "--eval-split", "test"]) == 2
    assert "3 --eval-split values for 2 --eval-data" in capsys.readouterr().err


def test_init_adapter_starts_a_run_from_a_packed_adapter_and_checks_it_fits(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    first = _sentiment_cfg(tiny_checkpoint, tmp_path / "first", lora_rank=4, max_steps=4, eval_every=4, precision="fp32")
    train(TaskJob(task, first), first)
    adapter = tmp_path / "first" / "best"
    saved = load_file(adapter / "adapter.safetensors")
    warm = TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "second", lora_rank=4, init_adapter=str(adapter)))
    state = warm.model.state_dict()
    assert any(".lora_b." in name for name in saved)
    for name, tensor in saved.items():  # LoRA tensors, head and pooler all start where the adapter ended
        assert torch.equal(state[name], tensor), name
    # a higher rank grows the adapter: the same function at the start (the added B columns are zero), trainable
    grown = TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "third", lora_rank=8,  # alpha / rank halves
                                         init_adapter=str(adapter)))
    inputs = {"input_ids": torch.tensor([[2, 7, 9, 11, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    with torch.no_grad():
        assert torch.allclose(grown.model.eval()(**inputs).logits, warm.model.eval()(**inputs).logits, atol=1e-5)
    b = next(p for n, p in grown.model.named_parameters() if ".lora_b." in n)
    assert b.shape[1] == 8 and b.requires_grad and not b[:, 4:].any()
    higher = tmp_path / "rank8"
    shutil.copytree(adapter, higher)
    meta = json.loads((higher / "adapter_config.json").read_text())
    (higher / "adapter_config.json").write_text(json.dumps({**meta, "rank": 8}))
    with pytest.raises(ValueError, match="its rank 8 is higher than this run's lora_rank 4"):
        TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "fifth", lora_rank=4, init_adapter=str(higher)))
    with pytest.raises(ValueError, match="needs LoRA training"):
        TaskJob(task, _sentiment_cfg(tiny_checkpoint, tmp_path / "fourth", init_adapter=str(adapter)))


def test_the_qa_loss_is_the_same_for_a_row_alone_and_padded_in_a_batch(tiny_checkpoint):
    from bert_engine.heads import SpanHead
    from plugins.qa import loss as qa_loss

    model = load(str(tiny_checkpoint), SpanHead, warn_missing=False).model.eval()
    with torch.no_grad():
        model.head.qa_outputs.bias.fill_(3.0)  # padding positions would carry real weight in the softmax
    rows = [[2, 7, 9, 11, 13, 3], [2, 8, 3]]
    targets = [(2, 4), (1, 1)]
    with torch.no_grad():
        alone = [qa_loss(model(input_ids=torch.tensor([r])), [t]) for r, t in zip(rows, targets)]
        ids = torch.tensor([rows[0], rows[1] + [0, 0, 0]])
        mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
        padded = qa_loss(model(input_ids=ids, attention_mask=mask), targets)
    assert torch.allclose(padded, (alone[0] + alone[1]) / 2, atol=1e-5)


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_the_log_stays_json(tiny_checkpoint, tmp_path):
    from bert_engine.training.loop import NonFiniteLoss

    class NaNAtThree(TaskJob):
        calls = 0

        def loss(self, model, batch, targets):
            loss, stats = super().loss(model, batch, targets)
            self.calls += 1
            return (loss * float("nan") if self.calls == 3 else loss), stats

    task = load_registry(entry_points=False).task("sentiment")
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", max_steps=5, batch_size=4, log_every=1, save_every=1,
                         eval_file=None)
    with pytest.raises(NonFiniteLoss, match=r"the loss is nan at step 3 .*last checkpoint is from step 2"):
        train(NaNAtThree(task, cfg), cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # every line is JSON; nothing logged for step 3
    saved = torch.load(tmp_path / "run" / "last" / "trainer_state.pt", weights_only=True)
    assert saved["state"]["step"] == 2
    assert not (tmp_path / "run" / "best").exists()


def test_a_checkpoint_with_its_own_label_order_is_trained_and_named_in_it(tmp_path):
    """A third-party task whose data names its labels ("neg"/"pos") and whose default order is
    (neg, pos), fine-tuned from a checkpoint that orders them (pos, neg): training_batch and loss get
    the head's order (`labels=`), postprocess reads `context.labels`, so the ids trained on and the
    names answered follow the checkpoint, never the task's default (issue 39)."""
    from conftest import reference_checkpoint
    from torch import nn

    from bert_engine.hookspecs import TaskSpec
    from bert_engine.tasks.registry import Registry

    class Head(nn.Module):
        needs_pooler, kind = True, "sequence"

        def __init__(self, config):
            super().__init__()
            if config.num_labels == 0:
                config = config.with_labels(["neg", "pos"])
            self.labels = tuple(config.id2label[i] for i in range(config.num_labels))
            self.classifier = nn.Linear(config.hidden_size, len(self.labels))

        def forward(self, encoded):
            return self.classifier(encoded.pooled)

    seen = {}

    def preprocess(inputs, tokenizer, **options):
        return tokenizer(inputs["text"])

    def postprocess(logits, batch, *, context):
        seen["postprocess"] = context.labels
        return {"label": context.labels[int(logits[0].argmax())]}

    def training_batch(examples, tokenizer, *, generator=None, labels):
        seen["training_batch"] = labels
        batch = tokenizer([x["text"] for x, _ in examples])
        return batch, torch.tensor([labels.index(name) for _, name in examples])

    def loss(logits, targets, *, labels):
        seen["loss"] = labels
        return nn.functional.cross_entropy(logits, targets)

    data = tmp_path / "data.tsv"
    data.write_text("text\tlabel\n" + "\n".join(f"{t}\t{name}" for t, name in
                                                [("a fine film", "pos"), ("a dull film", "neg")] * 8) + "\n")

    def read_data(path, split="train"):
        for line in Path(path).read_text().splitlines()[1:]:
            text, name = line.split("\t")
            yield {"text": text}, name

    spec = TaskSpec(name="yesno", title="Yes/no", build_head=Head, preprocess=preprocess, postprocess=postprocess,
                    labels=("neg", "pos"), read_data=read_data, training_batch=training_batch, loss=loss,
                    target_labels=lambda name: (name,))

    class Plugin:
        from bert_engine.hookspecs import hookimpl

        @hookimpl
        def register_tasks(self, register):
            register(spec)

    registry = Registry()
    assert registry.load_plugin("yesno", "1.0", "test", lambda: Plugin())
    task = registry.task("yesno")
    folder = reference_checkpoint(tmp_path / "reversed", "BertForSequenceClassification", id2label={0: "pos", 1: "neg"})
    cfg = TrainConfig(task="yesno", model=str(folder), train_file=str(data), output_dir=str(tmp_path / "run"),
                      max_steps=2, batch_size=4, log_every=1, save_every=100, precision="fp32")
    job = TaskJob(task, cfg)
    batch, targets = job.collate(job.examples[:2], torch.Generator().manual_seed(0))
    assert seen["training_batch"] == ("pos", "neg") and targets.tolist() == [0, 1]  # "pos" is id 0 here
    job.loss(job.model, batch, targets)
    assert seen["loss"] == ("pos", "neg")
    predictor = Predictor(task, job.model.eval(), job.tokenizer, model_id=str(folder))
    assert predictor.predict({"text": "a fine film"})["result"]["label"] in ("pos", "neg")
    assert seen["postprocess"] == ("pos", "neg")


def test_memory_a_training_step_freed_goes_back_to_the_system():
    from bert_engine.training import loop

    if loop._malloc_trim() is None or loop.resident_mb() is None:
        pytest.skip("no glibc malloc_trim or /proc here")
    # 3,000 blocks of 64 KiB (under glibc's mmap threshold: they come from the heap), written to so they are
    # resident, then all freed but the last, which pins the heap's top: glibc keeps the ~190 MiB below it
    blocks = [torch.ones(16_384) for _ in range(3000)]
    last = blocks[-1]
    del blocks
    before = loop.resident_mb()
    loop.release_freed_memory()
    after = loop.resident_mb()
    assert last.sum() == 16_384 and before - after > 100, (before, after)


def test_a_new_run_does_not_write_over_one_and_a_resumed_run_keeps_its_settings(tiny_checkpoint, tmp_path):
    """A fresh run into a run folder had replaced its checkpoints and mixed the two logs; a resume with
    another lr trained on the old schedule while train_config.json and the card said the new one."""
    task = load_registry(entry_points=False).task("sentiment")
    (tmp_path / "a-file").write_text("x")  # an output folder that is a file: named ("[Errno 17] File exists" before)
    on_file = _sentiment_cfg(tiny_checkpoint, tmp_path / "a-file", stop_after=2)
    with pytest.raises(ValueError, match="a-file: it is a file, not a folder"):
        train(TaskJob(task, on_file), on_file)
    under_file = _sentiment_cfg(tiny_checkpoint, tmp_path / "a-file" / "run", stop_after=2)
    with pytest.raises(ValueError, match=f"a-file/run: {tmp_path / 'a-file'} is a file, not a folder"):
        train(TaskJob(task, under_file), under_file)
    cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", stop_after=2)
    train(TaskJob(task, cfg), cfg)
    recorded = (tmp_path / "run" / "train_config.json").read_text()
    again = _sentiment_cfg(tiny_checkpoint, tmp_path / "run")
    with pytest.raises(ValueError, match="holds a run already \\(last, best, metrics.jsonl\\): --resume continues it"):
        train(TaskJob(task, again), again)
    changed = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", resume=True, lr=1e-3, seed=7)
    with pytest.raises(ValueError, match="which keeps these settings as train_config.json has them: "
                                         "lr 0.005 -> 0.001; seed 42 -> 7"):
        train(TaskJob(task, changed), changed)
    assert (tmp_path / "run" / "train_config.json").read_text() == recorded  # the record stays true
    longer = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", resume=True, max_steps=10, eval_every=4)
    assert train(TaskJob(task, longer), longer)["steps"] == 10  # a longer schedule, as the starter recipes resume
    loaded = Predictor.load(task, str(tmp_path / "run"))  # a run's folder loads as its best checkpoint
    assert Path(loaded.model_id) == tmp_path / "run" / "best"
    # and so everywhere a model loads (an outside test: `load()` and `bert-engine info` said "no config.json")
    from bert_engine import load
    from bert_engine.cli import main

    assert load(str(tmp_path / "run"), "sequence").checkpoint.folder == tmp_path / "run" / "best"
    for folder in ("run", "run/best"):  # info: the run's task (train_config.json) gives the head, no --head needed
        assert main(["info", "--model", str(tmp_path / folder)]) == 0, folder


@pytest.mark.parametrize("values, message", [
    ({"max_steps": "three"}, "max_steps must be a whole number, got 'three'"),
    ({"lora_rank": True}, "lora_rank must be a whole number, got True"),
    ({"batch_size": 8.5}, "batch_size must be a whole number, got 8.5"),
    ({"lr": 0}, "lr must be positive, got 0"),
    ({"head_lr": -1.0}, "head_lr must be positive"),
    ({"weight_decay": -1}, "weight_decay must be 0 or more"),
    ({"lora_alpha": 0}, "lora_alpha must be positive"),
    ({"eval_limit": 0}, "eval_limit must be at least 1"),
    ({"stop_after": 10, "max_steps": 3}, "stop_after 10 is past max_steps 3"),
    ({"merge_lora": "yes"}, "merge_lora must be true or false, got 'yes'"),
])
def test_bad_settings_are_named_before_anything_runs(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**values)


def test_a_yaml_config_reads_numbers_written_as_yaml_11_text_and_names_its_errors(tmp_path):
    good = tmp_path / "run.yaml"
    good.write_text("lr: 1e-3\nhead_lr: 2e-3\nmax_steps: 30\n")  # PyYAML reads 1e-3 as the string "1e-3"
    cfg = TrainConfig.from_file(good)
    assert (cfg.lr, cfg.head_lr, cfg.max_steps) == (1e-3, 2e-3, 30)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train_file: [x\n")
    with pytest.raises(ValueError, match="broken.yaml: not valid YAML at line 2"):
        TrainConfig.from_file(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- lr\n")
    with pytest.raises(ValueError, match="list.yaml: expected a mapping of settings, got list"):
        TrainConfig.from_file(listed)


def test_init_adapter_that_is_no_adapter_folder_is_named(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("sentiment")
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    for given, why in ((manifest, "no such folder"), (tmp_path, "no adapter_config.json in it")):
        cfg = _sentiment_cfg(tiny_checkpoint, tmp_path / "run", lora_rank=4, init_adapter=str(given))
        with pytest.raises(ValueError, match=f"init_adapter .*: {why}; give a packed model's folder"):
            TaskJob(task, cfg)
