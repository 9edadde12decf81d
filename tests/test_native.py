"""bert_engine's own AVX2 matmul (bert_engine/runtime/tiled_matmul.c, built by runtime/native.py): its
outputs, its independence from the batch and the threads, how it is built and kept, what happens where it
cannot be built, and how `choose_kernels` uses it."""

import copy
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import outputs_at_both_widths
from torch import nn

from bert_engine import PRESETS, BertModel
from bert_engine.runtime import cpu_load, fast, native
from bert_engine.runtime.precision import PrecisionError, prepare_for_inference

reason = native.unavailable()
needs_kernel = pytest.mark.skipif(reason is not None, reason=f"the AVX2 kernel cannot run here: {reason}")


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """native.py looking again, building into its own folder; what it found is forgotten afterwards too."""
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    native.forget()
    yield tmp_path / "native"
    monkeypatch.undo()
    native.forget()


def _reference(x, linear, activation=None):
    out = nn.functional.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    return out if activation is None else activation(out)


@needs_kernel
@pytest.mark.parametrize(("rows", "out_features", "in_features", "bias"), [
    (0, 16, 8, True), (1, 1, 1, True), (1, 384, 384, True), (5, 100, 33, False), (6, 16, 128, True),
    (7, 1152, 384, True), (193, 40, 1536, True),
    (400, 24, 1536, False),  # 2.4 MB of input: the kernel takes chunks of rows first
])
def test_tiled_linear_equals_a_float64_matmul_as_closely_as_torchs_own(rows, out_features, in_features, bias):
    torch.manual_seed(rows + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    x = torch.randn(2, rows, in_features)
    with torch.inference_mode():
        got, torch_own = fast.TiledLinear(linear)(x), linear(x)
    assert got.shape == (2, rows, out_features) and got.dtype == torch.float32
    if rows:
        error = float((got.double() - _reference(x, linear)).abs().max())
        assert error <= 3 * float((torch_own.double() - _reference(x, linear)).abs().max()) + 1e-7


@needs_kernel
def test_tiled_linear_takes_strided_inputs_applies_its_activation_and_names_a_wrong_input():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(64, 10).t()  # (10, 64), not contiguous
    with torch.inference_mode():
        got = fast.TiledLinear(linear, nn.functional.gelu)(x)
    torch.testing.assert_close(got.double(), _reference(x, linear, nn.functional.gelu), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match=r"fp32 CPU inputs of 64 features, not torch.float64 cpu \(3, 64\)"):
        fast.TiledLinear(linear)(torch.randn(3, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="fp32 only"):
        fast.TiledLinear(nn.Linear(4, 4).to(torch.bfloat16))


@needs_kernel
def test_a_rows_outputs_do_not_depend_on_its_batch_or_the_thread_count():
    """Each output is one row's sum in a fixed order: bit-identical alone, at any place in a batch of any
    size (tiles of 6 rows, chunks of 192), and on 1 or 2 threads."""
    torch.manual_seed(1)
    linear = nn.Linear(384, 1536)
    tiled = fast.TiledLinear(linear)
    rows = torch.randn(400, 384)
    before = torch.get_num_threads()
    with torch.inference_mode():
        alone = torch.cat([tiled(rows[i:i + 1]) for i in (0, 5, 6, 199, 399)])
        batch = tiled(rows)[[0, 5, 6, 199, 399]]
        reversed_batch = tiled(rows.flip(0)).flip(0)[[0, 5, 6, 199, 399]]
        try:
            torch.set_num_threads(1)
            one_thread = tiled(rows)[[0, 5, 6, 199, 399]]
        finally:
            torch.set_num_threads(before)
    assert torch.equal(alone, batch) and torch.equal(alone, reversed_batch) and torch.equal(alone, one_thread)


@needs_kernel
def test_the_library_is_built_once_and_kept(fresh_native, monkeypatch):
    calls = []
    real_run = native.subprocess.run

    def counting_run(command, *args, **kwargs):
        calls.append(command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting_run)
    assert native.library() is not None
    built = list(fresh_native.glob("tiled_matmul-*.so"))
    assert len(built) == 1 and sum("-shared" in c for c in calls) == 1
    native.forget()
    assert native.library() is not None
    assert sum("-shared" in c for c in calls) == 1  # the second process-start loads the kept library
    assert list(fresh_native.glob("*.partial")) == []


def test_without_a_compiler_the_other_kernels_run_and_one_line_says_why(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger="bert_engine.runtime.native"):
        assert native.library() is None and native.library() is None
    expected = native.cpu_supported() or "CC='/nonexistent/cc' is not a program found here"
    assert native.unavailable() == expected
    assert [r.getMessage() for r in caplog.records] == [
        f"bert_engine's AVX2 kernel is not available: {expected}; the matmuls use oneDNN's and MKL's kernels "
        "(int8: FBGEMM's or oneDNN's)"]
    model = BertModel(PRESETS["tiny"]).eval()
    choice = fast.choose_kernels(model)
    assert choice and all("tiled_ms" not in c and c["chose"] in ("packed", "plain") for c in choice.values())
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "tiled")
    with pytest.raises(PrecisionError, match=f"BERT_ENGINE_KERNELS=tiled: .*cannot run here: {re.escape(expected)}"):
        prepare_for_inference(copy.deepcopy(model), "fp32")


@needs_kernel
def test_a_compiler_with_arguments_builds_and_a_kept_library_that_will_not_load_is_built_again(fresh_native,
                                                                                                monkeypatch):
    monkeypatch.setenv("CC", f"{native.compiler()[0]} -g0")  # as "ccache gcc" would read
    kept = native._build(native.compiler())  # built with it, not loaded yet
    kept.write_bytes(b"cut short")  # a disk that filled up under the build, say
    assert native.library() is not None and kept.stat().st_size > 1000


def test_a_silent_failing_compiler_is_named(fresh_native, monkeypatch):
    if native.cpu_supported() is not None:
        pytest.skip(native.cpu_supported())
    false = __import__("shutil").which("false")
    if false is None:
        pytest.skip("no `false` program here")
    monkeypatch.setenv("CC", false)
    assert native.library() is None
    assert native.unavailable() == f"its build failed: {false} failed (exit 1): it printed nothing"


@needs_kernel
def test_a_failed_build_is_named_and_leaves_nothing_behind(fresh_native, monkeypatch, tmp_path):
    broken = tmp_path / "tiled_matmul.c"
    broken.write_text("int tiled_matmul_version(void) { return }\n")
    monkeypatch.setattr(native, "SOURCES", (broken, *native.SOURCES[1:]))
    assert native.library() is None
    assert native.unavailable().startswith("its build failed: ") and "error" in native.unavailable()
    assert list(fresh_native.glob("*")) == []


def _timings(short: dict[str, float], long: dict[str, float]) -> dict[str, dict[int, float]]:
    """time_kernels' answer: seconds per kernel at 24 / 128 rows (`short`) and 2048 (`long`)."""
    return {k: {24: short[k] / 1000, 128: short[k] / 1000, 2048: long[k] / 1000} for k in short}


@needs_kernel
def test_short_and_long_rows_get_their_own_kernel_and_the_provenance_says_so(monkeypatch, tmp_path):
    """A projection whose short rows run fastest tiled and long ones packed runs both: tiled up to
    COLD_ROWS rows, packed past them; each number of rows counts alike, and 10 % is needed to leave packed."""
    timings = {
        "qkv": _timings({"packed": 1.0, "plain": 1.2, "tiled": 0.7}, {"packed": 10, "plain": 11, "tiled": 12}),
        "out": _timings({"packed": 1.0, "plain": 1.2, "tiled": 0.95}, {"packed": 10, "plain": 8, "tiled": 12}),
        "up": _timings({"packed": 1.0, "plain": 1.2, "tiled": 0.7}, {"packed": 10, "plain": 12, "tiled": 8}),
        "down": _timings({"packed": 1.0, "plain": 1.0, "tiled": 1.0}, {"packed": 10, "plain": 10, "tiled": 10}),
    }
    order = iter(["qkv", "out", "up", "down"])
    monkeypatch.setattr(fast, "time_kernels", lambda *args, **kwargs: timings[next(order)])
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")  # as on an AVX-512 CPU ...
    monkeypatch.setattr(native, "isa", lambda: 256)  # ... without the wide kernel's rule (tested on its own below)
    model = BertModel(PRESETS["tiny"]).eval()
    reference = copy.deepcopy(model)
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    prepare_for_inference(model, "fp32")
    labels = {name: fast.kernel_label(c) for name, c in model.kernel_choice.items() if name != fast.ATTENTION}
    assert labels == {"qkv": f"tiled up to {fast.COLD_ROWS} rows, then packed",
                      "out": f"packed up to {fast.COLD_ROWS} rows, then plain", "up": "tiled", "down": "packed"}
    layer = model.layers[0]
    assert isinstance(layer.attention.qkv, fast.RowSwitch)
    assert isinstance(layer.ffn.up, fast.TiledLinear) and layer.ffn.act is fast._identity
    seen = []
    for part in ("short", "long"):
        getattr(layer.attention.qkv, part).register_forward_hook(lambda m, i, o, part=part: seen.append(part))
    ids = torch.randint(5, 99, (1, 11))
    long_ids = torch.randint(5, 99, (6, 60))  # 360 rows
    with torch.inference_mode():
        for batch in (ids, long_ids):
            out = model(input_ids=batch).last_hidden_state
            torch.testing.assert_close(out, reference(input_ids=batch).last_hidden_state, atol=2e-5, rtol=0)
    assert seen == ["short", "long"]


wide = pytest.mark.skipif(reason is not None or native.wanted_isa() != 512,
                          reason="the kernel's AVX-512 width needs a CPU whose torch capability is AVX512")


@wide
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 16, 8), (5, 24, 33), (12, 40, 128), (13, 100, 130), (25, 1152, 384), (40, 8, 300), (193, 48, 1536),
    (97, 1152, 384), (100, 40, 130),  # past 96 rows: x copied, the panels a block of k at a time
    (1500, 40, 400),  # 2.4 MB of input: chunks of rows first
])
def test_the_avx512_width_gives_the_avx2_widths_bits(rows, out_features, in_features):
    """Each output is the same chain of fused multiply-adds at either width: the same bits, whatever the rows,
    an odd number of panels (run as a pair with itself), k blocks and the threads."""
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features).requires_grad_(False)
    module = fast.TiledLinear(linear)
    x = torch.randn(rows, in_features)
    got = outputs_at_both_widths(native.library().tiled_matmul_set_isa, native.isa(), lambda: module(x))
    assert all(torch.equal(out, got[256, 1]) for out in got.values())
    error = float((got[512, 2].double() - _reference(x, linear)).abs().max())
    assert error <= 3 * float((linear(x).double() - _reference(x, linear)).abs().max()) + 1e-7


def test_the_width_follows_torchs_capability_and_the_setting(monkeypatch):
    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "avx2")
    assert native.wanted_isa() == 256
    monkeypatch.delenv("BERT_ENGINE_CPU_CAPABILITY")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert native.wanted_isa() == 256
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(native, "_cpu_flags", lambda: ["avx2", "fma", "avx512f"])
    assert native.wanted_isa() == 512
    monkeypatch.setattr(native, "_cpu_flags", lambda: ["avx2", "fma"])
    assert native.wanted_isa() == 256


def test_a_wide_kernel_gives_a_layers_projections_one_kernel_in_each_range_of_rows(monkeypatch):
    """Where the tiled kernel is AVX-512 wide and packed is the incumbent, in each range of rows (up to
    SHORT_ROWS_WIDE, up to COLD_ROWS, past it) a layer's four projections take one kernel: the one all four pick from
    their timings there, packed where they differ (a projection that chose tiled or plain alone loses it); below
    COLD_ROWS the tiled kernel only as far as whole layers timed fused say (the next test), so without such timings
    nothing runs fused, however fast the tiled matmuls timed alone. At AVX2's width or with the setting off,
    nothing changes."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")
    monkeypatch.setattr(native, "isa", lambda: 512)

    def choice(plain_mid=2.4, out_plain_mid=None, plain_long=28, tiled_long=40):
        def rows(plain_mid):
            return {"24": {"packed": 1.0, "plain": 1.2, "tiled": 0.5},  # tiled 2x faster alone
                    "128": {"packed": 2.0, "plain": plain_mid, "tiled": 1.0},
                    "2048": {"packed": 30, "plain": plain_long, "tiled": tiled_long}}
        made = {name: {"rows": rows(plain_mid), "chose": "packed"} for name in fast.PROJECTIONS}
        made["out"] = {"rows": rows(out_plain_mid or plain_mid), "chose": "packed", "past_rows": [256, "plain"]}
        made["down"] = {"rows": rows(plain_mid), "chose": "tiled", "past_rows": [256, "packed"]}  # its own: tiled alone
        return made

    def labels(made):
        fast.favour_fusion(made)
        return {fast.kernel_label(c) for c in made.values()}

    plain = choice()
    assert labels(plain) == {"packed"}
    assert fast.fused_label(plain) == "not used: qkv, out, up, down do not run the tiled kernel"
    assert labels(choice(plain_long=26)) == {"packed up to 256 rows, then plain"}
    assert labels(choice(plain_mid=1.7)) == {"packed up to 64 rows, then plain up to 256 rows, then packed"}
    assert labels(choice(plain_mid=1.7, out_plain_mid=2.4)) == {"packed"}  # out's packed at 128: they differ
    past = choice(tiled_long=20)
    assert labels(past) == {"packed up to 256 rows, then tiled"}  # fused past it: all four picked it
    assert fast.fused_label(past) == "inputs past 256 rows: " + fast.FUSED_WORDS
    assert fast.fused_label({name: {"chose": "tiled", "past_rows": [64, "packed", 256, "tiled"]} for name in
                             fast.PROJECTIONS}) == "inputs of up to 64 rows and inputs past 256 rows: " + fast.FUSED_WORDS
    assert fast.fused_label({**past, "up": {"chose": "tiled", "past_rows": [256, "packed"]}}) == (
        "not used: the four projections never run the tiled kernel at the same number of rows")
    assert fast.fused_ranges({name: {"chose": "packed", "past_rows": [16, "tiled", 160, "packed"]}
                              for name in fast.PROJECTIONS}) == [(16, 160)]
    untimed = {name: {"rows": {}, "chose": None} for name in fast.PROJECTIONS}  # a cache file with no timings
    fast.favour_fusion(untimed)
    assert all(c == {"rows": {}, "chose": None} for c in untimed.values())
    for made in (None, "off"):
        if made == "off":
            monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
        else:
            monkeypatch.setattr(native, "isa", lambda: 256)
        kept = choice()
        fast.favour_fusion(kept)
        assert kept["qkv"] == {"rows": kept["qkv"]["rows"], "chose": "packed"}
        assert fast.kernel_label(kept["out"]) == "packed up to 256 rows, then plain"
        assert fast.kernel_label(kept["down"]) == "tiled up to 256 rows, then packed"


def test_a_wide_kernel_fuses_as_far_as_whole_layers_ran_no_slower(monkeypatch):
    """Where whole layers were timed (choose_kernels, AVX-512), the fused reach is read from those timings, not from
    the matmuls' margins: the most rows at which the fused stack ran no slower, none at fewer rows more than
    LAYER_MARGIN slower; past it the kernel all four projections pick there (packed where they differ; up to
    COLD_ROWS never tiled, which would be fused); fused nowhere where it lost at the fewest rows."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")
    monkeypatch.setattr(native, "isa", lambda: 512)

    def labels(ratios, plain_long=28):
        rows = {"24": {"packed": 1.0, "plain": 1.2, "tiled": 3.0},  # the matmuls alone: tiled 3x, never fused by margin
                "128": {"packed": 2.0, "plain": 2.4, "tiled": 6.0},
                "2048": {"packed": 30, "plain": plain_long, "tiled": 40}}
        layer_rows = {str(n): {"fused": ratio, "unfused": 1.0} for n, ratio in ratios.items()}
        made = {name: {"rows": rows, "chose": "packed", "layer_rows": layer_rows} for name in fast.PROJECTIONS}
        fast.favour_fusion(made)
        return {fast.kernel_label(c) for c in made.values()}

    assert labels({16: 0.5, 64: 0.7, 128: 0.92, 160: 0.99, 192: 1.02, 256: 1.05}) == {"tiled up to 160 rows, then packed"}
    assert labels({16: 0.5, 96: 1.02, 128: 0.98, 192: 1.1}) == {"tiled up to 128 rows, then packed"}  # a blip at 96
    assert labels({16: 0.5, 96: 1.05, 128: 0.98}) == {"tiled up to 16 rows, then packed"}
    assert labels({16: 0.5, 256: 0.9}, plain_long=26) == {"tiled up to 256 rows, then plain"}
    assert labels({16: 0.5, 64: 0.8, 128: 1.1}, plain_long=26) == {
        "tiled up to 64 rows, then packed up to 256 rows, then plain"}
    assert labels({16: 1.1, 32: 0.9}) == {"packed"}
    assert labels({}) == {"packed"}  # timed, but the layers cannot run fused (time_layers' {})


@needs_kernel
def test_whole_layers_are_timed_fused_and_not_and_kept_with_the_kernels_they_raced(monkeypatch, tmp_path):
    """time_layers races a stack of the layers fused against one on the unfused kernels, at each number of rows;
    choose_kernels (AVX-512's rule) keeps the timings in the cache with those kernels, reads them back, and times
    again when the kernels they raced change. Layers that cannot run fused are not timed."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")
    monkeypatch.setattr(native, "isa", lambda: 512)  # the rule's width; the kernel runs at this machine's
    model = BertModel(PRESETS["tiny"]).eval()
    timed = fast.time_layers(model.layers, ["packed"], rows=(8, 40), repeats=2)
    assert set(timed) == {"8", "40"}
    assert all(set(t) == {"fused", "unfused"} and min(t.values()) > 0 for t in timed.values())
    odd = copy.deepcopy(model)
    for layer in odd.layers:
        layer.ffn.act = torch.tanh  # an activation fused_layer.c lacks
    assert fast.time_layers(odd.layers, ["packed"], rows=(8,)) == {}
    assert all(type(layer.attention.qkv) is nn.Linear for layer in model.layers)  # copies were timed, not the model
    cache = tmp_path / "kernels.json"
    choice = fast.choose_kernels(model, cache)
    kept = json.loads(cache.read_text())
    key, = (k for k in kept if " layers|" in k)
    layer_rows = choice["qkv"]["layer_rows"]
    assert kept[key]["rows"] == layer_rows and set(layer_rows) == {str(n) for n in fast.LAYER_ROWS}
    assert kept[key]["unfused"] == fast._unfused_wide_tiers(choice)
    reach = fast.fused_reach(layer_rows)
    assert fast.choice_tiers(choice["qkv"]) == tuple(fast._with_fusion(reach, kept[key]["unfused"]))
    assert not reach or fast.fused_ranges(choice)[0][0] == 0 and fast.fused_ranges(choice)[0][1] >= reach
    monkeypatch.setattr(fast, "time_layers", lambda *args, **kwargs: pytest.fail("timed again"))
    assert fast.choose_kernels(model, cache) == choice
    kept[key]["unfused"] = ["packed", 1, "plain"]  # raced against other kernels than today's choice would run
    cache.write_text(json.dumps(kept))
    raced = []
    monkeypatch.setattr(fast, "time_layers", lambda layers, unfused: raced.append(unfused) or {
        "16": {"fused": 1.0, "unfused": 2.0}, "32": {"fused": 2.0, "unfused": 1.0}})
    again = fast.choose_kernels(model, cache)
    assert raced == [fast._unfused_wide_tiers(choice)]
    assert fast.choice_tiers(again["down"])[:2] == ("tiled", 16)


def test_whole_layer_timings_that_contradict_each_other_are_taken_again():
    """_contradicted: a loss past LAYER_MARGIN with wins after it names the loss and the wins (timed again); a loss
    with no win after it is the end of the reach, and a loss within the margin is none."""
    def named(ratios):
        return fast._contradicted({n: {"fused": ratio, "unfused": 1.0} for n, ratio in ratios.items()})

    assert named({16: 0.43, 32: 0.65, 64: 0.75, 96: 1.13, 128: 1.005, 160: 0.9, 192: 0.97, 256: 0.91}) == [
        96, 160, 192, 256]  # a quiet first load of session 43
    assert named({16: 0.5, 96: 1.05, 128: 0.98}) == [96, 128]
    assert named({16: 1.1, 32: 0.9}) == [16, 32]
    assert named({16: 0.5, 96: 1.02, 128: 0.98}) == []
    assert named({16: 0.5, 64: 0.8, 128: 1.1, 256: 1.01}) == []
    assert named({}) == []


@needs_kernel
def test_time_layers_times_contradicting_rows_again_a_bounded_number_of_times(monkeypatch):
    """time_layers asks _contradicted after timing every row count, times again the rows it names, and asks again,
    at most LAYER_RETIMES times."""
    model = BertModel(PRESETS["tiny"]).eval()
    asked, clock = [], []
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock.append(1) or real_clock())
    monkeypatch.setattr(fast, "_contradicted", lambda best: asked.append({n: dict(t) for n, t in best.items()}) or (
        [8] if len(asked) == 1 else []))
    timed = fast.time_layers(model.layers, ["packed"], rows=(8, 40), repeats=1, short_repeats=1)
    assert len(asked) == 2 and set(timed) == {"8", "40"}
    assert len(clock) == 2 * 2 * 3  # (start, end) x (fused, unfused) x (a round at 8 rows, at 40, at 8 again)
    assert all(0 < asked[1][8][v] <= asked[0][8][v] for v in ("fused", "unfused"))  # more rounds: the fastest kept
    asked.clear()
    monkeypatch.setattr(fast, "_contradicted", lambda best: asked.append(1) or [])
    fast.time_layers(model.layers, ["packed"], rows=(8,), repeats=1, short_repeats=1)
    assert len(asked) == 1
    asked.clear()
    monkeypatch.setattr(fast, "_contradicted", lambda best: asked.append(1) or [8])
    fast.time_layers(model.layers, ["packed"], rows=(8,), repeats=1, short_repeats=1)
    assert len(asked) == fast.LAYER_RETIMES + 1  # the last ask finds them still contradicting, and keeps them


@needs_kernel
def test_a_kernel_cache_edited_by_hand_is_timed_again_not_read_into_a_crash(monkeypatch, tmp_path):
    """Entries of the kernel cache that do not hold timings (a string, a figure that is not a number, a missing
    kernel) are timed again; a file that is not a JSON object is started afresh."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")
    monkeypatch.setattr(native, "isa", lambda: 512)
    model = BertModel(PRESETS["tiny"]).eval()
    cache = tmp_path / "kernels.json"
    choice = fast.choose_kernels(model, cache)
    kept = json.loads(cache.read_text())
    layers, = (k for k in kept if " layers|" in k)
    projection = next(k for k in kept if k != layers and "|attention|" not in k)
    timed = []
    real_kernels, real_layers = fast.time_kernels, fast.time_layers
    monkeypatch.setattr(fast, "time_kernels", lambda *a, **k: timed.append("kernels") or real_kernels(*a, **k))
    monkeypatch.setattr(fast, "time_layers", lambda *a, **k: timed.append("layers") or real_layers(*a, **k))
    for broken_layers, broken_projection in (("junk", {"rows": {"24": {"packed": "x"}}}),
                                             ({"rows": {"16": {"fused": "x"}}}, "rows"),
                                             ({"rows": {"16": {"fused": 1.0}}}, {"rows": {"24": {"packed": 1.0}}}),
                                             ({"rows": ["16"]}, {"rows": {"24": {"packed": -1, "plain": 1, "tiled": 1}}})):
        # each beside the entry's other fields as they were (its kernel build, the kernels raced)
        broken_layers = broken_layers if isinstance(broken_layers, str) else {**kept[layers], **broken_layers}
        broken_projection = (broken_projection if isinstance(broken_projection, str)
                             else {**kept[projection], **broken_projection})
        cache.write_text(json.dumps({**kept, layers: broken_layers, projection: broken_projection}))
        timed.clear()
        again = fast.choose_kernels(model, cache)
        assert timed == ["kernels", "layers"] and set(again) == set(choice)
        assert "layer_rows" in again["qkv"] and all(c["rows"] for c in again.values())
    cache.write_text("[1, 2]")
    assert set(fast.choose_kernels(model, cache)) == set(choice)
    assert isinstance(json.loads(cache.read_text()), dict)
    cache.write_text("[" * 100_000 + "]" * 100_000)  # nested past the JSON parser's depth: RecursionError
    assert set(fast.choose_kernels(model, cache)) == set(choice)
    monkeypatch.setattr(fast, "KERNEL_CACHE_BYTES", cache.stat().st_size - 1)  # a file larger than a cache is
    timed.clear()
    assert set(fast.choose_kernels(model, cache)) == set(choice)  # not read: everything timed afresh
    assert timed.count("kernels") == len(set(choice) - {fast.ATTENTION}) and timed.count("layers") == 1
    attention, = (k for k in kept if "|attention|" in k)  # the attention's timings: retimed where broken, too
    cache.write_text(json.dumps({**kept, attention: {**kept[attention], "rows": {"24": {"sdpa": "x"}}}}))
    monkeypatch.setattr(fast, "time_attention", lambda *a, **k: timed.append("attention") or {"24": {"sdpa": 2.0,
                                                                                                  "native": 1.0}})
    timed.clear()
    assert fast.choose_kernels(model, cache)[fast.ATTENTION]["chose"] == "native" and timed == ["attention"]


@pytest.mark.busy_meter
def test_the_busy_meter_counts_other_processes_not_this_one():
    """cpu_busy_meter: the share of the machine's CPU time other work took. Processes spinning beside the
    measurement show; this process's own threads, filling the machine, do not."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat here: the meter answers None")
    if (os.cpu_count() or 1) <= torch.get_num_threads():
        share, a = fast.cpu_busy_meter(), torch.randn(512, 512)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            a = (a @ a).tanh()  # every CPU busy, all of it this process's
        assert share() < 0.75
    spinners = min(os.cpu_count() or 1, 2)
    share = fast.cpu_busy_meter()
    procs = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
             for _ in range(spinners)]
    for proc in procs:
        proc.wait(timeout=30)
    assert share() >= 0.6 * spinners / (os.cpu_count() or 1)


@pytest.mark.busy_meter
def test_the_busy_meter_reads_the_cpus_this_process_may_run_on(monkeypatch, tmp_path):
    """Only the CPUs of this process's affinity (a cpuset, a taskset) count, each CPU's busy time (all but idle and
    iowait, steal included) over the wall time; a CPU missing from the counters, or counters that cannot be read,
    give None."""
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"

    def write(ticks):  # ticks per CPU: (user, system, idle, iowait, steal)
        rows = [f"cpu{n} {u} 0 {s} {i} {w} 0 0 {st}" for n, (u, s, i, w, st) in enumerate(ticks)]
        stat.write_text("cpu  1 2 3 4 5 6 7 8 9 10\n" + "\n".join(rows) + "\nintr 12345\n", encoding="ascii")

    calls = []
    monkeypatch.setattr(time, "monotonic", lambda: 100.0 + bool(calls.append(1) or len(calls) > 1))  # then 1 s on
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 2, 3})
    write([(0, 0, 0, 0, 0)] * 4)
    share = fast.cpu_busy_meter(str(stat))
    # one second: CPU 0 (not ours) busy; CPU 1 half busy (user + system) and a quarter waiting on a disk; CPU 2
    # busy; CPU 3 a quarter stolen by the host
    write([(hz, 0, 0, 0, 0), (hz // 4, hz // 4, hz // 4, hz // 4, 0), (hz, 0, 0, 0, 0), (0, 0, 3 * hz // 4, 0, hz // 4)])
    assert share() == pytest.approx((0.5 + 1 + 0.25) / 3, abs=0.03)  # less this process's own few ms
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 7})
    assert fast.cpu_busy_meter(str(stat))() is None  # no line for cpu7
    assert fast.cpu_busy_meter(str(tmp_path / "missing"))() is None


@needs_kernel
def test_timings_taken_on_a_busy_machine_are_taken_again_at_the_next_loads(monkeypatch, tmp_path, caplog):
    """Kernel and layer timings taken while other work used BUSY_SHARE of the CPUs or more are timed again at
    the next load, up to BUSY_TRIES timings; each time the less busy of the two is kept. Quiet ones, and those
    where the machine cannot be measured, are read back."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")
    monkeypatch.setattr(native, "isa", lambda: 512)
    model = BertModel(PRESETS["tiny"]).eval()
    timed = []  # the same figures at every timing, so that the kernels the layers race stay the same
    monkeypatch.setattr(fast, "time_kernels", lambda linear, activation, rows: timed.append("kernels") or {
        kernel: dict.fromkeys(rows, seconds) for kernel, seconds in (("packed", 2e-3), ("plain", 3e-3), ("tiled", 1e-3))})
    monkeypatch.setattr(fast, "time_layers", lambda layers, unfused: timed.append("layers") or {
        "16": {"fused": 1.0, "unfused": 2.0}})
    monkeypatch.setattr(fast, "time_attention", lambda hidden, heads: timed.append("attention") or {
        "24": {"sdpa": 2.0, "native": 1.0}})
    cache = tmp_path / "kernels.json"
    projections = len(fast._projections(model.layers[0]))

    def load(busy):
        monkeypatch.setattr(fast, "cpu_busy_meter", lambda: lambda: busy)
        timed.clear()
        fast.choose_kernels(model, cache)
        kept = json.loads(cache.read_text())
        return sorted(timed), {(e["busy"], e["tries"]) for e in kept.values()}

    every = sorted(["kernels"] * projections + ["layers", "attention"])
    with caplog.at_level(logging.INFO, logger="bert_engine.runtime.fast"):
        assert load(0.5) == (every, {(0.5, 1)})
    assert caplog.text.count("timed again at the next load") == 1  # one line for the six entries
    assert ("kernel timings (qkv, out, up, down, whole layers, attention) taken while other work used 50 % of the CPUs: timed "
            "again at the next load (2 of 3)") in caplog.text
    assert load(0.6) == (every, {(0.5, 2)})  # busier than the first: the first kept
    assert load(0.1) == (every, {(0.1, 3)})  # quieter: kept, and settled
    assert load(0.9) == ([], {(0.1, 3)})
    cache.unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bert_engine.runtime.fast"):
        assert [load(0.9)[1] for _ in range(fast.BUSY_TRIES)] == [{(0.9, n)} for n in range(1, fast.BUSY_TRIES + 1)]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "kept as they are; delete" in warned[0].getMessage() and str(cache) in warned[0].getMessage()
    assert load(0.9) == ([], {(0.9, fast.BUSY_TRIES)})  # as busy every time: kept after BUSY_TRIES
    cache.unlink()
    assert load(None) == (every, {(None, 1)})  # not measured (no /proc/stat): read back as it is
    assert load(None)[0] == []
    cache.unlink()
    assert load(fast.BUSY_SHARE - 0.01)[1] == {(fast.BUSY_SHARE - 0.01, 1)} and load(0.0)[0] == []
    for edited in ({"busy": "x"}, {"busy": float("nan")}, {"busy": -1.0}, {"busy": 2.0}, {"tries": -5},
                   {"tries": True}, {"tries": 1.5}, {"tries": 10**9}, {"qkv_ms": float("nan")}):
        cache.write_text(json.dumps({k: {**e, **edited} for k, e in json.loads(cache.read_text()).items()}))
        assert load(0.0) == (every, {(0.0, 1)})  # a share, count or figure edited by hand: timed again, once
        assert load(0.0)[0] == []


@needs_kernel
def test_three_tiers_run_in_turn_and_a_visitors_rows_fuse(monkeypatch):
    """A projection's tiers (tiled up to 64 rows, packed up to 256, plain past): each length runs its own kernel,
    the answers agree with the unswapped model, and only the rows every projection runs tiled are fused."""
    model = BertModel(PRESETS["tiny"]).eval()
    reference = copy.deepcopy(model)
    tiers = ("tiled", 64, "packed", 256, "plain")
    fast.use_kernels(model, {name: tiers for name in fast.PROJECTIONS})
    layer = model.layers[0]
    qkv = layer.attention.qkv
    assert isinstance(qkv, fast.RowSwitch) and isinstance(qkv.long, fast.RowSwitch)
    assert isinstance(qkv.kernel_at(64), fast.TiledLinear)
    assert isinstance(qkv.long.kernel_at(65), fast.PackedLinear) and type(qkv.long.kernel_at(300)) is nn.Linear
    assert layer.fused is fast.fused_layer
    hidden = model.config.hidden_size
    assert fast._plan(layer, 64, hidden) is not None and fast._plan(layer, 65, hidden) is None
    with torch.inference_mode():
        for shape in ((1, 11), (2, 50), (6, 60)):  # 11, 100 and 360 rows
            ids = torch.randint(5, 99, shape)
            torch.testing.assert_close(model(input_ids=ids).last_hidden_state,
                                       reference(input_ids=ids).last_hidden_state, atol=2e-5, rtol=0)


def test_the_incumbent_keeps_its_place_unless_another_is_ten_percent_faster():
    """On AVX2-only CPUs the tiled kernel is short inputs' incumbent (a whole forward measured faster with
    it than a projection timed alone shows); elsewhere packed is. Either keeps its place within 10 %."""
    even = {"rows": {"24": {"packed": 1.0, "plain": 1.0, "tiled": 1.0}, "128": {"packed": 2.0, "plain": 2, "tiled": 2}}}
    assert fast.pick_kernel(even, "tiled") == "tiled" and fast.pick_kernel(even, "packed") == "packed"
    close = {"rows": {"24": {"packed": 0.92, "plain": 1.0, "tiled": 1.0}}}
    assert fast.pick_kernel(close, "tiled") == "tiled"
    ahead = {"rows": {"24": {"packed": 0.85, "plain": 1.0, "tiled": 1.0}}}
    assert fast.pick_kernel(ahead, "tiled") == "packed"
    untimed = {"rows": {"24": {"packed": 1.0, "plain": 0.95}}}  # read where the tiled kernel does not run
    assert fast.pick_kernel(untimed, "tiled") == "packed" and fast.pick_kernel({"rows": {}}) is None
    assert fast.short_rows_incumbent() == ("tiled" if fast.cpu_isa() == "AVX2" else "packed")


@needs_kernel
def test_the_tiled_kernel_answers_like_the_packed_one_in_a_pipeline(monkeypatch, tmp_path):
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    task = load_registry(entry_points=False).task("sentiment")
    text = {"text": "A gorgeous, witty, seductive movie."}
    results = {}
    for kernels in ("packed", "tiled"):
        monkeypatch.setenv("BERT_ENGINE_KERNELS", kernels)
        predictor = Predictor.load(task, None, precision="fp32")
        assert predictor.provenance()["kernels"] == dict.fromkeys(fast.PROJECTIONS, kernels)
        results[kernels] = predictor.predict(text)["result"]
    assert results["tiled"]["label"] == results["packed"]["label"]
    assert results["tiled"]["logits"] == pytest.approx(results["packed"]["logits"], abs=1e-5)


@needs_kernel
def test_a_tiled_model_is_explained_on_a_plain_copy_and_refuses_a_backward(monkeypatch, tmp_path):
    """The tiled kernel has no backward: "why this answer" runs on an fp32 copy with plain kernels, and a
    gradient asked of the kernel itself is an error, not a silent zero."""
    from bert_engine.runtime.explain import explain
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "tiled")
    predictor = Predictor.load(load_registry(entry_points=False).task("sentiment"), None, precision="fp32")
    explained = explain(predictor, {"text": "A gorgeous, witty, seductive movie."}, steps=4)
    assert "fp32 copy with plain kernels" in explained["explained_on"] and "tiled" in explained["explained_on"]
    with torch.enable_grad(), pytest.raises(RuntimeError, match="has no backward"):
        fast.TiledLinear(nn.Linear(8, 8))(torch.randn(2, 8, requires_grad=True))


@needs_kernel
def test_kernel_timings_of_another_build_are_taken_again(monkeypatch, tmp_path):
    """Timings are kept with the build of the kernel they measured; a changed kernel (source, compiler or
    flags) is timed again rather than chosen on its predecessor's figures."""
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    model = BertModel(PRESETS["tiny"]).eval()
    first = fast.choose_kernels(model, tmp_path / "kernels.json")
    assert all(c["tiled_build"] == native.build() for c in first.values())
    timed = []
    real = fast.time_kernels
    monkeypatch.setattr(fast, "time_kernels", lambda *a, **k: timed.append(1) or real(*a, **k))
    fast.choose_kernels(model, tmp_path / "kernels.json")
    assert timed == []  # the same build: read back
    monkeypatch.setattr(native, "build", lambda: "another-build")
    again = fast.choose_kernels(model, tmp_path / "kernels.json")
    assert len(timed) == len(set(again) - {fast.ATTENTION})  # (each projection's; the attention's build too:)
    assert all(c["tiled_build"] == "another-build" for c in again.values())


def test_a_fixed_choice_without_the_tiled_kernel_never_builds_it(fresh_native, monkeypatch):
    """BERT_ENGINE_KERNELS=packed (or plain) loads a model without building or loading the C kernel."""
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "packed")
    monkeypatch.setattr(native, "library", lambda: pytest.fail("the tiled kernel was built for a packed model"))
    model = prepare_for_inference(BertModel(PRESETS["tiny"]).eval(), "fp32")
    assert isinstance(model.layers[0].attention.qkv, fast.PackedLinear)


def test_kernels_are_timed_within_the_containers_cpu_limit(monkeypatch):
    """Under a cgroup quota below torch's thread count, the kernels are timed on the quota's threads (on more, a
    timing waits out throttled periods), the timings are kept under that count, and torch's own count is back
    after."""
    monkeypatch.setattr(cpu_load.FREE_CPUS, "limit", 1)
    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)
    seen = []
    monkeypatch.setattr(fast, "time_kernels", lambda linear, activation, rows: seen.append(torch.get_num_threads()) or {
        kernel: {n: 0.001 for n in rows} for kernel in ("packed", "plain", "tiled")})
    monkeypatch.setattr(fast, "time_layers", lambda layers, unfused: seen.append(torch.get_num_threads()) or {})
    try:
        threads = torch.get_num_threads()
        assert fast.timing_threads() == 1
        fast.choose_kernels(BertModel(PRESETS["tiny"]).eval())
        assert seen and set(seen) == {1} and torch.get_num_threads() == threads
        monkeypatch.setenv("BERT_ENGINE_SHARE_CPUS", "0")  # as the forwards: every thread
        assert fast.timing_threads() == threads
        monkeypatch.delenv("BERT_ENGINE_SHARE_CPUS")
        monkeypatch.setattr(cpu_load.FREE_CPUS, "limit", None)
        assert fast.timing_threads() == threads
    finally:
        torch.set_num_threads(before)
