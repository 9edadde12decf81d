"""bert-engine distill: the student's start, the three losses, and a run end to end."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import reference_checkpoint

from bert_engine import load
from bert_engine.tasks.registry import load_registry
from bert_engine.training.distill import DistillJob, cosine_loss, every_other_layer, make_student, soft_target_loss
from bert_engine.training.loop import train
from bert_engine.training.train_config import TrainConfig

SST = Path(__file__).parent / "fixtures" / "sst_tiny.tsv"


def test_the_student_starts_from_every_other_teacher_layer():
    assert every_other_layer(6, 3) == [0, 2, 4]
    assert every_other_layer(12, 6) == [0, 2, 4, 6, 8, 10]  # DistilBERT's choice from BERT-base
    assert every_other_layer(6, 4) == [0, 2, 3, 4]
    for bad in (0, 6, 7):
        with pytest.raises(ValueError, match=r"student_layers must lie in \[1, 5\]"):
            every_other_layer(6, bad)


def test_make_student_copies_embeddings_head_and_the_chosen_layers(tmp_path):
    folder = reference_checkpoint(tmp_path / "teacher", "BertForSequenceClassification", num_hidden_layers=4,
                                  id2label={0: "NEG", 1: "POS"})
    teacher, tokenizer = load(folder, "sequence")
    student = make_student(teacher, 2)
    assert len(student.encoder.layers) == 2 and student.encoder.config.num_hidden_layers == 2
    for mine, theirs in zip(student.encoder.layers, [teacher.encoder.layers[0], teacher.encoder.layers[2]]):
        for (name, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), name
    assert torch.equal(student.head.classifier.weight, teacher.head.classifier.weight)
    assert student.head.classifier.weight.data_ptr() != teacher.head.classifier.weight.data_ptr()  # a copy
    batch = tokenizer(["A fine film.", "Dull."])
    assert student(**batch.model_inputs()).logits.shape == (2, 2)


def test_soft_target_loss_is_zero_for_equal_outputs_and_ignores_padding():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    logits = torch.randn(2, 3)
    same = SimpleNamespace(logits=logits)
    assert soft_target_loss(same, same, mask, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    assert soft_target_loss(same, SimpleNamespace(logits=torch.randn(2, 3)), mask, 2.0) > 0
    start = torch.randn(2, 4)
    changed_padding = start.clone()
    changed_padding[mask == 0] = 50.0  # what padded positions hold does not matter
    teacher = SimpleNamespace(start_logits=start, end_logits=start)
    student = SimpleNamespace(start_logits=changed_padding, end_logits=changed_padding)
    assert soft_target_loss(teacher, student, mask, 1.0).item() == pytest.approx(0.0, abs=1e-5)
    tokens = torch.randn(2, 4, 5)
    other = tokens.clone()
    other[mask == 0] = torch.randn(3, 5)
    assert soft_target_loss(SimpleNamespace(logits=tokens), SimpleNamespace(logits=other), mask, 2.0).item() == \
        pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="returns none of logits, start_logits, end_logits"):
        soft_target_loss(SimpleNamespace(scores=logits), SimpleNamespace(scores=logits), mask, 2.0)


def test_cosine_loss_counts_real_tokens_only():
    hidden = torch.randn(2, 4, 8)
    other = hidden.clone()
    other[1, 3] = -hidden[1, 3]  # a padded position pointing the other way
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert cosine_loss(hidden, other, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert cosine_loss(hidden, -hidden, mask).item() == pytest.approx(2.0, abs=1e-5)


def test_distillation_trains_a_smaller_student_that_transformers_loads(tmp_path):
    import transformers

    teacher = reference_checkpoint(tmp_path / "teacher", "BertForSequenceClassification", num_hidden_layers=4,
                                   id2label={0: "NEGATIVE", 1: "POSITIVE"})
    task = load_registry(entry_points=False).task("sentiment")
    cfg = TrainConfig(task="sentiment", teacher=str(teacher), student_layers=2, train_file=str(SST),
                      eval_file=str(SST), output_dir=str(tmp_path / "run"), max_steps=30, batch_size=8, lr=5e-3,
                      log_every=5, save_every=100, alpha_soft=1.0, alpha_task=0.0, alpha_cos=0.0, warmup_ratio=0.1)
    job = DistillJob(task, cfg)
    result = train(job, cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    soft = [line["soft_loss"] for line in lines if "soft_loss" in line]
    assert soft[-1] < soft[0] * 0.5, soft  # the student learns the teacher's distribution
    assert "accuracy" in result["last_eval"]
    student = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "run" / "last")
    assert student.config.num_hidden_layers == 2 and student.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}


@pytest.mark.parametrize("changes, message", [
    (dict(teacher=None), "teacher .* is required"),
    (dict(lora_rank=4), "trains the whole student"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(alpha_soft=0.0, alpha_task=0.0, alpha_cos=0.0), "not all 0"),
    (dict(student_layers=2), r"student_layers must lie in \[1, 1\]"),
])
def test_impossible_distillation_settings_are_refused_by_name(tmp_path, tiny_checkpoint, changes, message):
    teacher = reference_checkpoint(tmp_path / "teacher", "BertForSequenceClassification",
                                   id2label={0: "NEGATIVE", 1: "POSITIVE"})
    task = load_registry(entry_points=False).task("sentiment")
    values = dict(task="sentiment", teacher=str(teacher), student_layers=1, train_file=str(SST),
                  output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=message):
        DistillJob(task, TrainConfig(**{**values, **changes}))


def test_a_teacher_without_a_trained_head_is_refused(tmp_path, tiny_checkpoint):
    task = load_registry(entry_points=False).task("sentiment")
    cfg = TrainConfig(task="sentiment", teacher=str(tiny_checkpoint), student_layers=1, train_file=str(SST),
                      output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="the teacher has no trained sentiment head"):
        DistillJob(task, cfg)
