"""bert_engine's own AVX2 int8 matmul (bert_engine/runtime/int8_matmul.c, Int8Linear's "tiled" kernel) and the
int8 layer in one C call (fused_layer.c): the scheme's arithmetic exactly (checked against the same codes and
integer sums worked out in torch), a row's answer independent of its batch and of the threads, the fused layer
against the int8 modules, the kernel chosen on AVX2 CPUs and refused, with its reason, where it cannot run."""

import pytest
import torch
from conftest import outputs_at_both_widths
from torch import nn

from bert_engine import BertModel
from bert_engine.config import BertConfig
from bert_engine.model import encoder_of
from bert_engine.runtime import fast, native
from bert_engine.runtime.fast import Int8Linear, hadamard, quantize_int8

reason = native.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"the AVX2 kernels cannot run here: {reason}")


def _reference(layer: Int8Linear, linear: nn.Linear, x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """The tiled kernel's arithmetic in torch: rotated rows, each row's [low, high] onto codes 0..127, the
    weight's codes and scales, integer sums (exact in float64 at these sizes)."""
    weight = linear.weight.detach().double()
    rows = x.double()
    if rotation is not None:
        size = rotation.shape[0]
        weight = (weight.view(weight.shape[0], -1, size) @ rotation.double()).view_as(weight)
        rows = (rows.view(rows.shape[0], -1, size) @ rotation.double()).view_as(rows)
    scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
    codes = torch.clamp(torch.round(weight / scale[:, None]), -127, 127)
    low, high = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
    x_codes = torch.round(((rows - low) * (127 / (high - low).clamp_min(1e-12))).clamp(0, 127))
    sums = x_codes @ codes.T
    out = low * (codes * scale[:, None]).sum(dim=1) + (high - low) / 127 * sums * scale + linear.bias.detach().double()
    return out.float()


@pytest.mark.parametrize(("features", "outputs", "block"), [(64, 48, 16), (96, 40, 16), (70, 33, None), (48, 20, 8)])
@pytest.mark.parametrize("rows", [1, 4, 6, 13])
def test_its_arithmetic_is_the_schemes(features, outputs, block, rows):
    """Rotation in blocks of 16 in C, other blocks in torch first, K not a multiple of 4, N not of 16, row counts
    around the tile's 4. The reference rounds in float64, the kernel in float32: a code may land one step off
    where a value sits on a rounding edge, so the bound is one input step times the weight's reach, not 1e-6."""
    torch.manual_seed(features + rows)
    linear = nn.Linear(features, outputs)
    x = torch.randn(rows, features) * 2 + 0.3
    x[:, 1] *= 30  # a wide channel, which the rotation spreads
    rotation = hadamard(block) if block else None
    layer = Int8Linear(linear, input_rotation=rotation, kernel="tiled")
    assert layer.rotates_inside == (block == 16)
    with torch.inference_mode():
        out = layer(x)
    expected = _reference(layer, linear, x, rotation)
    step = float((x.abs().max() * 2) / 127 * linear.weight.detach().abs().max())
    assert float((out - expected).abs().max()) < 2 * step
    assert float((out - expected).abs().mean()) < 1e-3 * float(expected.abs().mean())


@pytest.mark.skipif(reason is not None or native.wanted_int8_isa() != 512,
                    reason="the int8 kernel's VNNI width needs an AVX-512 VNNI CPU whose torch capability is AVX512")
@pytest.mark.parametrize(("rows", "features", "outputs"), [(1, 64, 16), (5, 70, 33), (12, 384, 1152), (13, 96, 40),
                                                          (25, 1536, 384), (200, 48, 20)])
def test_the_vnni_width_gives_the_avx2_widths_bits(rows, features, outputs):
    """vpdpbusd's int32 sums are the exact integers vpmaddubsw + vpmaddwd make of 7-bit codes: the same bits,
    whatever the rows, an odd number of panels (a pair with itself), K not a multiple of 4 and the threads."""
    torch.manual_seed(rows + features)
    layer = Int8Linear(nn.Linear(features, outputs), kernel="tiled")
    x = torch.randn(rows, features)
    got = outputs_at_both_widths(native.library().int8_matmul_set_isa, native.int8_isa(), lambda: layer(x))
    assert all(torch.equal(out, got[256, 1]) for out in got.values())


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(11, 64) * torch.logspace(-2, 2, 11)[:, None]
    x[4] = 0.5  # a constant row: no range of its own
    layer = Int8Linear(linear, input_rotation=hadamard(16), kernel="tiled")
    before = torch.get_num_threads()
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        try:
            torch.set_num_threads(1)
            one_thread = layer(x.flip(0)).flip(0)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(together, alone) and torch.equal(together, one_thread)
    assert torch.allclose(together[4], linear(x[4:5])[0], atol=0.02)


def _int8_model(act="gelu", seed=0, hidden=64, heads=4):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=120, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                        intermediate_size=2 * hidden, hidden_act=act, max_position_embeddings=128)
    model = BertModel(config, add_pooler=False).eval()
    model.padding_free = True
    return quantize_int8(model)


def _run(model, monkeypatch, fused, ids, mask=None):
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1" if fused else "0")
    with torch.inference_mode():
        return model(ids, mask).last_hidden_state


@pytest.mark.parametrize(("act", "hidden", "heads"), [("gelu", 64, 4), ("relu", 48, 6), ("gelu_new", 96, 4)])
def test_the_int8_layer_in_one_call_answers_as_its_modules(monkeypatch, act, hidden, heads):
    """The same int8 matmuls inside and outside fused_layer.c; the attention, norms and GELU between them
    differ in their last bits, which can move an int8 code by one step: close, not equal."""
    monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "tiled")
    model = _int8_model(act, hidden=hidden, heads=heads)
    assert all(layer.fused is fast.fused_layer for layer in encoder_of(model).layers)
    ids = torch.randint(1, 120, (3, 21))
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[1, 13:] = 0
    fused, modules = _run(model, monkeypatch, True, ids, mask), _run(model, monkeypatch, False, ids, mask)
    real = mask.bool()
    assert float((fused[real] - modules[real]).abs().max()) < 2e-2
    assert float((fused[real] - modules[real]).abs().mean()) < 1e-4
    alone = _run(model, monkeypatch, True, ids[1:2, :13])
    assert torch.equal(alone[0], fused[1, :13])  # a text's own answer, whatever is batched with it


def test_an_int8_model_runs_the_tiled_kernel_on_avx2_cpus_and_says_so(monkeypatch, minilm_dir):
    from bert_engine import load
    from bert_engine.runtime.precision import prepare_for_inference

    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "avx2")  # no VNNI, no AVX-512: the tiled kernel first
    assert fast.int8_kernel() == "tiled"
    model, _ = load(minilm_dir)
    reference, _ = load(minilm_dir)
    prepare_for_inference(model, "int8")
    assert model.int8_kernel == "tiled" and fast.int8_fused_label(model) == "every input: " + fast.FUSED_WORDS
    ids = torch.randint(1000, 20000, (2, 30))
    with torch.inference_mode():
        got, want = model(ids).last_hidden_state, reference.eval()(ids).last_hidden_state
    cosine = torch.nn.functional.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    assert float(cosine.min()) > 0.98, cosine.min()
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
    assert fast.int8_fused_label(model) == "off (BERT_ENGINE_FUSED_LAYERS=0)"


def test_without_a_compiler_auto_falls_back_and_tiled_is_refused_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.forget()
    try:
        assert fast.int8_kernel() in ("fbgemm", "onednn", None)
        monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "tiled")
        with pytest.raises(ValueError, match="BERT_ENGINE_INT8_KERNEL=tiled: bert_engine's AVX2 kernel cannot run "
                                             "here: CC='/nonexistent/cc' is not a program found here"):
            fast.int8_kernel()
        with pytest.raises(RuntimeError, match="the AVX2 int8 kernel cannot run here"):
            Int8Linear(nn.Linear(16, 16), kernel="tiled")
    finally:
        monkeypatch.undo()
        native.forget()


def test_a_projection_wider_than_the_kernel_takes_runs_another_int8_kernel(monkeypatch):
    monkeypatch.setattr(fast, "TILED_INT8_MAX_FEATURES", 32)
    monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "tiled")
    model = _int8_model()  # hidden 64: every projection is wider than 32
    layer = encoder_of(model).layers[0]
    assert layer.attention.qkv.kernel in ("fbgemm", "onednn") and layer.fused is None
    with pytest.raises(ValueError, match="at most 32 input features, not 64"):
        Int8Linear(nn.Linear(64, 8), kernel="tiled")


def test_info_says_where_int8_layers_run_fused(monkeypatch, tmp_path, capsys, minilm_dir):
    import json

    from bert_engine.cli import main

    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    cases = [("tiled", "every input: " + fast.FUSED_WORDS)]
    # the same words as a quantised model's (int8_fused_label of the model), from the kernel alone
    assert fast.int8_fused_label(kernel="tiled") == "every input: " + fast.FUSED_WORDS
    assert fast.int8_fused_label(kernel="onednn") == "not used: the int8 matmuls are onednn's"
    if fast.fbgemm_int8_available():
        cases.append(("fbgemm", "not used: the int8 matmuls are fbgemm's"))
    for kernel, expected in cases:
        monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", kernel)
        assert main(["info", "--model", str(minilm_dir), "--kernels"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["int8_kernel"] == kernel and info["int8_fused_layers"] == expected
        assert all("busy" in c and "tries" in c and "layer_rows" not in c for c in info["kernels"].values())
        # whole layers are timed where the tiled kernel is AVX-512 wide (fast._wide), and shown once
        assert ("layer_timings" in info) == (native.isa() == 512 and fast.short_rows_incumbent() == "packed")
        assert "layer_timings" not in info or {"rows_ms", "busy", "tries"} <= set(info["layer_timings"])
