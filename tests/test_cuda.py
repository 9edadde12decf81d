"""The engine on a CUDA GPU: the same answers as on the CPU, in fp32, bf16 and fp16, for inference and training.

CI has no GPU, so these skip there and say why; `scripts/gpu_call.sh` runs them (with the rest of the
GPU-independent files it names) on a lent GPU, and benchmarks/README.md records that run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bert_engine import BertConfig, BertModel
from bert_engine.checkpoints.loader import load
from bert_engine.checkpoints.loading import save_pretrained
from bert_engine.runtime.inference import Predictor
from bert_engine.serving.pipeline import pipeline
from bert_engine.tasks.registry import load_registry
from bert_engine.training.jobs import TaskJob
from bert_engine.training.loop import train
from bert_engine.training.train_config import TrainConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: CI has none; scripts/gpu_call.sh runs these on a lent one")

FIXTURES = Path(__file__).parent / "fixtures"
TEXTS = ["A gripping, beautifully made film.", "Dull and far too long.", "It was fine, I suppose, for a Tuesday.",
         "The cast is wonderful but the script never finds its rhythm and the ending drags on and on."]


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 on the GPU as fp32 (no TF32 matmuls), so CPU and GPU compare at fp32's own error."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _encoder_and_batch():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config).eval()
    ids = torch.randint(5, 500, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 5:] = 0  # rows of 20, 12 and 5 real tokens
    return model, ids, mask


def _headed(task_name: str, checkpoint: Path, folder: Path) -> Path:
    """`checkpoint` with the task's head, its weights drawn once and saved: every device loads the same model."""
    task = load_registry(entry_points=False).task(task_name)
    loaded = load(str(checkpoint), task.spec.build_head)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if name.startswith("head."):
                param.normal_(0, 0.5)
    save_pretrained(loaded.model, folder, loaded.tokenizer)
    return folder


def test_the_encoder_on_cuda_gives_the_cpu_outputs_in_fp32():
    model, ids, mask = _encoder_and_batch()
    with torch.inference_mode():
        cpu = model(ids, mask).last_hidden_state
        gpu = model.to("cuda")(ids.cuda(), mask.cuda()).last_hidden_state.cpu()
    real = mask.bool()
    assert torch.allclose(gpu[real], cpu[real], atol=1e-4, rtol=1e-4), (gpu[real] - cpu[real]).abs().max()


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.08), (torch.float16, 0.01)])
def test_half_precision_on_cuda_stays_near_fp32(dtype, tolerance):
    model, ids, mask = _encoder_and_batch()
    model.to("cuda")
    with torch.inference_mode():
        full = model(ids.cuda(), mask.cuda()).last_hidden_state.float()
        half = model.to(dtype)(ids.cuda(), mask.cuda()).last_hidden_state.float()
    real = mask.cuda().bool()
    assert torch.isfinite(half[real]).all()
    error = ((half[real] - full[real]).norm() / full[real].norm()).item()
    assert error < tolerance, f"{dtype}: relative error {error:.4f} over the real tokens"


def test_the_padding_free_path_equals_the_padded_one_on_cuda():
    model, ids, mask = _encoder_and_batch()
    model.to("cuda")
    ids, mask = ids.cuda(), mask.cuda()
    with torch.inference_mode():
        model.padding_free = False
        padded = model(ids, mask).last_hidden_state
        model.padding_free = True
        unpadded = model(ids, mask).last_hidden_state
    real = mask.bool()
    assert torch.allclose(unpadded[real], padded[real], atol=1e-5)
    assert (unpadded[~real] == 0).all()  # the padding-free path leaves zeros where the padding was


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_sentiment_pipeline_on_cuda_answers_as_on_the_cpu(tiny_checkpoint, tmp_path, precision):
    folder = str(_headed("sentiment", tiny_checkpoint, tmp_path / "sentiment"))
    on_cpu = pipeline("sentiment", model=folder, device="cpu")(TEXTS)
    on_gpu = pipeline("sentiment", model=folder, device="cuda", precision=precision)(TEXTS)
    tolerance = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}[precision]
    for cpu, gpu in zip(on_cpu, on_gpu):
        assert set(cpu) == set(gpu)
        assert abs(cpu["score"] - gpu["score"]) < tolerance or cpu["label"] != gpu["label"] and \
            abs(cpu["score"] - 0.5) < tolerance, (precision, cpu, gpu)


@pytest.mark.parametrize("kernels", ["tiled", "packed"])
def test_a_cpu_kernel_setting_does_not_stop_a_half_precision_model_on_cuda(tiny_checkpoint, tmp_path, monkeypatch,
                                                                            kernels):
    """BERT_ENGINE_KERNELS picks the CPU's matmuls: "tiled" (fp32 only) refused every bf16 load on a GPU (session
    50's lent H200)."""
    monkeypatch.setenv("BERT_ENGINE_KERNELS", kernels)
    folder = str(_headed("sentiment", tiny_checkpoint, tmp_path / "sentiment"))
    answers = pipeline("sentiment", model=folder, device="cuda", precision="bf16")(TEXTS)
    assert len(answers) == len(TEXTS) and all(answer["label"] for answer in answers)


def test_qa_spans_on_cuda_are_the_cpu_spans(tiny_checkpoint, tmp_path):
    task = load_registry(entry_points=False).task("qa")
    folder = str(_headed("qa", tiny_checkpoint, tmp_path / "qa"))
    context = ("The Amazon is the largest rainforest on Earth. It covers much of Brazil and Peru, and the river "
               "that runs through it carries more water than any other.")
    items = [{"question": q, "context": context} for q in ("What is the largest rainforest?", "Which countries?",
                                                           "What does the river carry?")]
    answers = {}
    for device in ("cpu", "cuda"):
        predictor = Predictor.load(task, folder, device=device, precision="fp32")
        answers[device] = [predictor.predict(item)["result"]["answers"][0] for item in items]
    for cpu, gpu in zip(answers["cpu"], answers["cuda"]):
        assert (gpu["start"], gpu["end"]) == (cpu["start"], cpu["end"])
        assert gpu["score"] == pytest.approx(cpu["score"], abs=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_on_cuda_in_half_precision_learns_the_fixture_and_loads_back(tiny_checkpoint, tmp_path, precision):
    task = load_registry(entry_points=False).task("sentiment")
    sst = str(FIXTURES / "sst_tiny.tsv")
    cfg = TrainConfig(task="sentiment", model=str(tiny_checkpoint), train_file=sst, eval_file=sst,
                      output_dir=str(tmp_path / "run"), max_steps=40, batch_size=8, lr=1e-2, log_every=10,
                      eval_every=20, save_every=100, warmup_ratio=0.25, device="cuda", precision=precision)
    result = train(TaskJob(task, cfg), cfg)
    assert result["best"] >= 0.9, result
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in logged if "loss" in row]
    assert losses and all(map(lambda v: v == v, losses)) and losses[-1] < losses[0], losses
    # the checkpoint it wrote answers on the CPU as it scored on the GPU
    back = pipeline("sentiment", model=str(tmp_path / "run" / "best"), device="cpu")
    assert len(back(TEXTS)) == len(TEXTS)


def test_an_explanation_of_the_gpus_default_bf16_model_adds_up(tiny_checkpoint, tmp_path):
    from bert_engine.runtime.explain import explain

    task = load_registry(entry_points=False).task("sentiment")
    predictor = Predictor.load(task, str(_headed("sentiment", tiny_checkpoint, tmp_path / "s")), device="cuda")
    assert next(predictor.model.parameters()).dtype in (torch.bfloat16, torch.float16)  # "auto" on a GPU
    explained = explain(predictor, {"text": TEXTS[0]}, steps=32)
    assert "fp32 copy" in explained["explained_on"]
    for target in explained["targets"]:
        difference = target["score"] - target["baseline_score"]
        assert abs(target["completeness_gap"]) <= 0.05 * abs(difference) + 1e-3, target


def _close(a, b, tolerance: float, where: str = "result") -> None:
    """Two results alike: the same structure and text, numbers within `tolerance`."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            _close(a[key], b[key], tolerance, f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, tolerance, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, abs=tolerance), where
    else:
        assert a == b, where


INPUTS = {"fill_mask": {"text": "The capital of France is [MASK]."},
          "ner": {"text": "Angela Merkel met Emmanuel Macron in Paris on Tuesday."},
          "summary": {"text": "The council met on Monday. It voted to build a new bridge over the river. "
                              "The bridge will cost ten million pounds. Work starts in the spring. "
                              "Residents welcomed the news, though some worried about traffic."}}


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_every_other_task_answers_on_cuda_as_on_the_cpu(tiny_checkpoint, tmp_path, name):
    """Each task's postprocess gets the GPU's output and the CPU's batch: none may mix the two."""
    task = load_registry(entry_points=False).task(name)
    folder = str(_headed(name, tiny_checkpoint, tmp_path / name))
    on_cpu = Predictor.load(task, folder, device="cpu", precision="fp32").predict(INPUTS[name])["result"]
    on_gpu = Predictor.load(task, folder, device="cuda", precision="fp32").predict(INPUTS[name])["result"]
    _close(on_cpu, on_gpu, 1e-3)
    in_bf16 = Predictor.load(task, folder, device="cuda", precision="bf16").predict(INPUTS[name])["result"]
    assert set(in_bf16) == set(on_cpu)  # the same answer's shape; its numbers are bf16's
