"""Precisions (bert_engine/runtime/precision.py): chosen by what the device and CPU support, refused with a
clear message elsewhere, and the faster ones keep the model's answers.

BERT_ENGINE_CPU_CAPABILITY=avx2 makes any machine behave like an AVX2-only CPU, so the refusals are
checked on every machine, and the native paths wherever the CPU has them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_engine.runtime.inference import Predictor
from bert_engine.runtime.precision import (
    CAPABILITY_ENV,
    NAMES,
    PRECISIONS,
    PrecisionError,
    autocast_dtype,
    cpu_capability,
    device_for,
    parameter_dtype,
    resolve,
)
from bert_engine.tasks.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
OBVIOUS = ["A wonderful, moving film with superb acting.", "A dull, tedious mess; I hated every minute."]


@pytest.fixture
def avx2_only(monkeypatch):
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    return cpu_capability()


def test_every_precision_is_one_row_of_the_table():
    assert NAMES == ("auto", "fp32", "bf16", "fp16", "int8")
    assert {p.prepare for p in PRECISIONS.values()} <= {"pack", "quantize", "none"}


def test_auto_is_fp32_on_the_cpu():
    assert resolve("auto", CPU).name == "fp32"
    assert autocast_dtype("auto", CPU) is None


@pytest.mark.parametrize("name, device, message", [
    ("int4", "cpu", "precision 'int4' is not one of auto, fp32, bf16, fp16, int8"),
    ("int8", "cuda", "precision 'int8' runs on cpu only, not on cuda"),
    ("bf16", "mps", "precision 'bf16' runs on cpu, cuda only, not on mps"),
])
def test_unknown_or_misplaced_precisions_are_named(name, device, message):
    with pytest.raises(PrecisionError, match=message):
        resolve(name, torch.device(device))


def test_int8_with_no_device_named_runs_on_the_cpu_even_where_a_gpu_is(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU (nothing is allocated)
    assert device_for("int8") == CPU and device_for("int8", "") == CPU
    assert device_for("auto").type == "cuda" and device_for("bf16").type == "cuda"  # the GPU where it can run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for("fp32") == CPU
    with pytest.raises(ValueError, match="'cuda'"):  # a device named is the device used, or an error
        device_for("int8", "cuda")


def test_the_capability_override_only_lowers_and_is_checked(monkeypatch):
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    pretended = cpu_capability()
    assert not (pretended.bf16 or pretended.fp16 or pretended.amx)
    assert pretended.isa in ("AVX2", "DEFAULT")
    monkeypatch.setenv(CAPABILITY_ENV, "amx-please")
    with pytest.raises(PrecisionError, match=f"{CAPABILITY_ENV}='amx-please' is not one of avx2, default"):
        cpu_capability()


@pytest.mark.parametrize("name, needs", [("bf16", "AVX512-BF16 or AMX"), ("fp16", "AMX-FP16")])
def test_half_precisions_are_refused_on_a_cpu_without_native_support(avx2_only, name, needs):
    with pytest.raises(PrecisionError, match=f"precision '{name}' needs a CPU with {needs}; this one has AVX2"):
        parameter_dtype(name, CPU)
    with pytest.raises(PrecisionError, match=needs):
        autocast_dtype(name, CPU)  # training autocast follows the same rule


def test_int8_is_not_a_training_precision():
    with pytest.raises(PrecisionError, match="training precision 'int8' is not one of auto, fp32, bf16, fp16"):
        autocast_dtype("int8", CPU)


def test_predictor_refuses_before_loading_anything(avx2_only):
    task = load_registry().task("sentiment")
    with pytest.raises(PrecisionError, match="needs a CPU with AVX512-BF16 or AMX"):
        Predictor.load(task, "/nonexistent/folder/never/read", precision="bf16", device="cpu")


def _run(args, **env):
    """`args` run on this machine's CPU, told it has AVX2 only (where a GPU is, it would be picked first)."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, CAPABILITY_ENV: "avx2", "BERT_ENGINE_DEVICE": "cpu", **env})


def test_cli_bf16_on_an_avx2_cpu_is_one_line_and_exit_2():
    done = _run(["-m", "bert_engine", "predict", "sentiment", "--input", "text=fine", "--precision", "bf16"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "bert-engine predict: error: precision 'bf16' needs a CPU with AVX512-BF16 or AMX; this one has AVX2 and "
        "would only emulate it, slower than fp32: use fp32 (or int8 for speed)"]


def test_app_with_bf16_on_an_avx2_cpu_refuses_to_start_in_one_line():
    done = _run(["app.py"], BERT_ENGINE_PRECISION="bf16", GRADIO_SERVER_PORT="1")  # port 1: it must not get there
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == ["ERROR app: BERT_ENGINE_PRECISION: precision 'bf16' needs a CPU with AVX512-BF16 or AMX; "
                      "this one has AVX2 and would only emulate it, slower than fp32: use fp32 (or int8 for speed)"]


def test_app_with_a_bad_kernel_setting_refuses_to_start_in_one_line():
    done = _run(["app.py"], BERT_ENGINE_KERNELS="fastest", GRADIO_SERVER_PORT="1")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == ["ERROR app: BERT_ENGINE_KERNELS='fastest' is not one of auto, packed, plain, tiled"]


def test_app_names_a_model_folder_that_is_not_there_before_anything_else(tmp_path):
    done = _run(["app.py"], BERT_ENGINE_MODEL_DIRS=f"{tmp_path}{os.pathsep}{tmp_path / 'missing'}",
                BERT_ENGINE_KERNELS="fastest", GRADIO_SERVER_PORT="1")
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        f"WARNING app: BERT_ENGINE_MODEL_DIRS: {str(tmp_path / 'missing')!r} is not a folder (yet); the model picker "
        "lists nothing from it until it is", "ERROR app: BERT_ENGINE_KERNELS='fastest' is not one of auto, packed, plain, tiled"]


def _faster_precisions():
    native_bf16 = pytest.mark.skipif(not cpu_capability().bf16,
                                     reason=f"this CPU ({cpu_capability().describe()}) has no native bf16; "
                                            "the refusal is tested above")
    return [pytest.param("bf16", marks=native_bf16), "int8"]


@pytest.mark.parametrize("precision", _faster_precisions())
def test_faster_precisions_keep_obvious_sentiment(precision):
    task = load_registry().task("sentiment")
    exact = Predictor.load(task, precision="fp32")
    fast = Predictor.load(task, precision=precision)
    assert fast.provenance()["dtype"] == {"bf16": "bfloat16", "int8": "int8"}[precision]
    for text in OBVIOUS:
        a, b = exact.predict({"text": text})["result"], fast.predict({"text": text})["result"]
        assert a["label"] == b["label"]
        assert abs(a["score"] - b["score"]) < 0.1


def test_the_cli_lists_the_precision_table():
    """cli.py names the precisions without importing torch (fast --help); it must stay the table's list."""
    from bert_engine import cli
    from bert_engine.runtime.precision import NAMES

    assert cli.PRECISIONS == ", ".join(NAMES)


def test_bert_engine_device_forces_the_device_where_none_is_named_and_a_bad_one_is_named(monkeypatch):
    from bert_engine.runtime.precision import pick_device

    monkeypatch.setenv("BERT_ENGINE_DEVICE", "cpu")
    assert pick_device() == torch.device("cpu") and pick_device("meta") == torch.device("meta")  # named: it wins
    monkeypatch.setenv("BERT_ENGINE_DEVICE", "bogus")
    with pytest.raises(ValueError, match="^BERT_ENGINE_DEVICE: device 'bogus' is not a device name"):
        pick_device()
    assert pick_device("cpu") == torch.device("cpu")


def test_a_cpu_capability_setting_that_is_not_one_is_an_error_not_ignored(monkeypatch):
    """The C kernels read BERT_ENGINE_CPU_CAPABILITY too: "bogus" was taken for unset there (full width)."""
    from bert_engine.runtime import native

    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "bogus")
    for check in (native.cpu_supported, native.wanted_isa):
        with pytest.raises(ValueError, match="BERT_ENGINE_CPU_CAPABILITY='bogus' is not one of avx2, default"):
            check()
    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "AVX2")
    assert native.wanted_isa() == 256
