"""Packed CPU linear layers and int8 quantisation (bert_engine/runtime/fast.py) keep the model's outputs."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import SENTENCES
from torch import nn

from bert_engine import PRESETS, BertModel, load
from bert_engine.runtime.fast import (
    Int8Linear,
    PackedLinear,
    can_pack,
    fbgemm_int8_available,
    hadamard,
    onednn_int8_available,
    pack_linear_layers,
    quantize_int8,
    tiled_int8_available,
)
from bert_engine.runtime.precision import prepare_for_inference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def _encode(model, batch):
    with torch.inference_mode():
        return model(**batch).last_hidden_state


def test_packed_minilm_equals_the_plain_model_on_padded_real_sentences(minilm_dir):
    model, tokenizer = load(minilm_dir)
    batch = tokenizer(SENTENCES).model_inputs()
    assert (batch["attention_mask"] == 0).any()
    packed = pack_linear_layers(copy.deepcopy(model))
    kinds = {type(m).__name__ for m in packed.modules()}
    assert "PackedLinear" in kinds and not any(isinstance(m, nn.Linear) for m in packed.layers.modules())
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(_encode(packed, batch)[real], _encode(model, batch)[real], atol=2e-5, rtol=0)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_fused_activation_matches_for_each_kind(act):
    config = dataclasses.replace(PRESETS["tiny"], hidden_act=act)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    batch = {"input_ids": torch.randint(5, 99, (3, 11)), "attention_mask": torch.ones(3, 11, dtype=torch.long)}
    plain = _encode(model, batch)
    packed = pack_linear_layers(copy.deepcopy(model))
    fused = packed.layers[0].ffn.up.attr
    assert fused == ("gelu" if act.startswith("gelu") else "none")
    torch.testing.assert_close(_encode(packed, batch), plain, atol=1e-5, rtol=0)


def test_packing_twice_is_a_no_op_and_other_devices_or_dtypes_are_left_alone():
    model = BertModel(PRESETS["tiny"]).eval()
    pack_linear_layers(model)
    first = model.layers[0].attention.qkv
    pack_linear_layers(model)
    assert model.layers[0].attention.qkv is first and isinstance(first, PackedLinear)
    half = BertModel(PRESETS["tiny"]).to(torch.float16)
    assert not can_pack(half)
    assert isinstance(pack_linear_layers(half).layers[0].attention.qkv, nn.Linear)


needs_onednn_int8 = pytest.mark.skipif(not onednn_int8_available(), reason="this torch build has no oneDNN int8")
INT8_KERNELS = [pytest.param("onednn", marks=needs_onednn_int8),
                pytest.param("fbgemm", marks=pytest.mark.skipif(not fbgemm_int8_available(),
                                                                reason="this torch build has no FBGEMM int8")),
                pytest.param("tiled", marks=pytest.mark.skipif(not tiled_int8_available(),
                                                               reason="bert_engine's AVX2 kernels cannot run here"))]


@pytest.fixture
def onednn_int8(monkeypatch):
    """The oneDNN int8 path (its fused quantisers, its row chunks), whichever the CPU would pick."""
    if not onednn_int8_available():
        pytest.skip("this torch build has no oneDNN int8")
    monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "onednn")


@needs_onednn_int8
def test_prepare_for_inference_int8_quantises_only_encoder_linears(minilm_dir):
    model, _ = load(minilm_dir)
    prepare_for_inference(model, "int8")
    linears = [m for m in model.layers.modules() if isinstance(m, (nn.Linear, Int8Linear, PackedLinear))]
    assert len(linears) == 4 * 6 and all(isinstance(m, (Int8Linear, PackedLinear)) for m in linears)
    assert isinstance(model.pooler.dense, nn.Linear)


@pytest.mark.parametrize("kernel", INT8_KERNELS)
@pytest.mark.parametrize("activation", [None, torch.nn.functional.gelu])
def test_int8_linear_stays_within_its_quantisation_error(activation, kernel):
    torch.manual_seed(0)
    linear = nn.Linear(96, 64)
    x = torch.randn(2, 7, 96) * 3 + 1  # not centred on 0: the asymmetric input range matters
    expected = linear(x) if activation is None else activation(linear(x))
    with torch.inference_mode():
        out = Int8Linear(linear, activation, kernel=kernel)(x)
    assert out.shape == (2, 7, 64) and out.dtype == torch.float32
    # input step (range / 255) and weight step (max |w| / 127), summed over 96 products: a few hundredths
    error = (out - expected).abs()
    assert float(error.max()) < 0.05 * float(expected.abs().max())
    assert float(error.mean()) < 0.02 * float(expected.abs().mean())  # 7-bit weights without VNNI: about 1 %


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_linear_scales_each_token_on_its_own(kernel):
    # one token 1,000x larger than the rest (as [SEP] rows can be): with one input scale per call every
    # other token would fall into a handful of uint8 steps around 0; per-token scales keep each row's
    # error at its own few-percent level (FBGEMM takes one scale per call: each row is brought to [0, 1] first)
    torch.manual_seed(0)
    linear = nn.Linear(96, 64, bias=False)
    x = torch.randn(8, 96)
    x[3] *= 1000
    with torch.inference_mode():
        expected, out = linear(x), Int8Linear(linear, kernel=kernel)(x)
    relative = (out - expected).norm(dim=1) / expected.norm(dim=1)
    assert float(relative.max()) < 0.03, relative


@pytest.mark.parametrize("kernel", INT8_KERNELS)
@pytest.mark.parametrize("one_sided", [False, True])
def test_int8_linear_gives_a_row_the_same_output_alone_or_in_any_batch(kernel, one_sided):
    """A text's int8 answer must not depend on the texts batched with it. FBGEMM quantises a whole input
    with one range; every row mapped onto exactly [0, 1] makes that range the same for any batch."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different reach
    if one_sided:
        x = torch.nn.functional.gelu(x)
    x[4] = 0.5  # a constant row: no range of its own
    layer = Int8Linear(linear, one_sided_input=one_sided, input_rotation=hadamard(16), kernel=kernel)
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        reversed_batch = layer(x.flip(0)).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reversed_batch)
    assert torch.allclose(together[4], linear(x[4:5])[0], atol=0.02)


def test_int8_kernel_follows_the_cpu_and_the_setting(monkeypatch):
    from bert_engine.runtime import fast
    from bert_engine.runtime.fast import int8_kernel

    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "avx2")  # AVX2 without VNNI: the tiled kernel, else FBGEMM
    assert int8_kernel() == ("tiled" if tiled_int8_available() else "fbgemm" if fbgemm_int8_available()
                             else "onednn" if onednn_int8_available() else None)
    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "default")  # no VNNI, not AVX2 either: FBGEMM first
    assert int8_kernel() == ("fbgemm" if fbgemm_int8_available() else "onednn" if onednn_int8_available() else
                             "tiled" if tiled_int8_available() else None)
    monkeypatch.delenv("BERT_ENGINE_CPU_CAPABILITY")  # VNNI: the tiled kernel where it sums with VNNI, else oneDNN
    monkeypatch.setattr(fast, "int8_weight_limit", lambda: 127)
    for width, isa, first in ((512, "AVX512", "tiled"), (256, "AVX512", "onednn"), (512, "AVX512+AMX", "onednn")):
        monkeypatch.setattr(fast.native, "int8_isa", lambda width=width: width)
        monkeypatch.setattr(fast, "cpu_isa", lambda isa=isa: isa)
        if tiled_int8_available() and onednn_int8_available():
            assert int8_kernel() == first, (width, isa)
    monkeypatch.undo()
    monkeypatch.setenv("BERT_ENGINE_CPU_CAPABILITY", "avx2")
    for kernel, available in (("onednn", onednn_int8_available()), ("fbgemm", fbgemm_int8_available())):
        monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", kernel)
        if available:
            assert int8_kernel() == kernel
        else:
            with pytest.raises(ValueError, match=f"has no {kernel} int8"):
                int8_kernel()
    monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "mkl")
    with pytest.raises(ValueError, match="BERT_ENGINE_INT8_KERNEL='mkl': choose auto, onednn, fbgemm, tiled"):
        int8_kernel()
    with pytest.raises(ValueError, match="kernel 'mkl'"):
        Int8Linear(nn.Linear(8, 8), kernel="mkl")


@needs_onednn_int8
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_spends_every_code_on_a_one_sided_input(bias):
    # a GELU's output (>= -0.17, up to several units), as FFN down's input is: steps symmetric about 0
    # leave about half the codes unused; each row's [min, max] in 255 steps is about twice as fine
    torch.manual_seed(0)
    linear = nn.Linear(384, 96, bias=bias)
    x = torch.nn.functional.gelu(torch.randn(16, 384) * 2 - 1)
    x[5] *= 50  # and each row keeps its own range
    with torch.inference_mode():
        expected = linear(x)
        symmetric, one_sided = Int8Linear(linear)(x), Int8Linear(linear, one_sided_input=True)(x)
    error = {name: float(((out - expected).norm(dim=1) / expected.norm(dim=1)).mean())
             for name, out in (("symmetric", symmetric), ("one_sided", one_sided))}
    assert error["one_sided"] < 0.75 * error["symmetric"], error
    assert error["one_sided"] < 0.02, error


@needs_onednn_int8
def test_int8_quantises_ffn_down_for_its_one_sided_input_and_only_it(minilm_dir):
    model, _ = load(minilm_dir)
    quantised = quantize_int8(copy.deepcopy(model), rotation=None)
    for layer in quantised.layers:
        assert layer.ffn.down.one_sided_input
        assert not any(p.one_sided_input for p in (layer.attention.qkv, layer.attention.out, layer.ffn.up))
    assert "per-token [min, max] input steps" in repr(quantised.layers[0].ffn.down)
    # rotated (the default), FFN down's input is no longer one-sided: symmetric steps
    assert not any(layer.ffn.down.one_sided_input for layer in quantize_int8(copy.deepcopy(model)).layers)


def test_hadamard_is_orthonormal_and_rotation_blocks_divide_the_width():
    from bert_engine.runtime.fast import rotation_block

    for size in (1, 2, 16, 64):
        matrix = hadamard(size)
        assert torch.allclose(matrix @ matrix.T, torch.eye(size), atol=1e-6) and torch.equal(matrix, matrix.T)
        assert torch.allclose(matrix.abs(), torch.full((size, size), size ** -0.5))
    with pytest.raises(ValueError, match="power-of-two size, got 12"):
        hadamard(12)
    assert rotation_block(384, 16) == 16 and rotation_block(1536, 128) == 128 and rotation_block(48, 64) == 16
    assert rotation_block(33, 16) == 1 and rotation_block(384, 1) == 1


def test_rotating_the_value_heads_changes_no_output():
    from bert_engine.runtime.fast import rotate_value_heads

    torch.manual_seed(0)
    config = dataclasses.replace(PRESETS["tiny"], hidden_size=96, num_attention_heads=3)  # heads of 32
    model = BertModel(config).eval()
    ids = torch.randint(5, config.vocab_size, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    expected = _encode(model, {"input_ids": ids, "attention_mask": mask})
    before = model.layers[0].attention.out.weight.clone()
    for layer in model.layers:
        rotate_value_heads(layer.attention, 16)
    assert not torch.allclose(model.layers[0].attention.out.weight, before)  # it did rotate
    assert torch.allclose(_encode(model, {"input_ids": ids, "attention_mask": mask}), expected, atol=1e-5)


@needs_onednn_int8
@pytest.mark.parametrize("block", [4, 16, 64])
def test_rotation_spreads_an_outlier_channel_over_its_block(block):
    # one input channel 100x wider than the rest (as in BERT's LayerNorm outputs and FFN activations): per
    # token it sets every channel's step; rotated by Hadamard blocks, it is shared by its block and the steps
    # shrink; the weight takes the inverse rotation, so without rounding the output is the same
    from bert_engine.runtime.fast import hadamard

    torch.manual_seed(0)
    linear = nn.Linear(384, 256)
    x = torch.randn(128, 384)
    x[:, 7] *= 100.0
    with torch.inference_mode():
        expected = linear(x)
        plain, rotated = Int8Linear(linear)(x), Int8Linear(linear, input_rotation=hadamard(block))(x)
    error = {name: float(((out - expected).norm(dim=1) / expected.norm(dim=1)).mean())
             for name, out in (("plain", plain), ("rotated", rotated))}
    assert error["rotated"] < 0.7 * error["plain"], error
    assert f"inputs rotated in blocks of {block}" in repr(Int8Linear(linear, input_rotation=hadamard(block)))
    with pytest.raises(ValueError, match="size 256 does not divide in_features 384"):
        Int8Linear(linear, input_rotation=hadamard(256))


@needs_onednn_int8
def test_int8_rotation_by_default_on_every_projection_and_closer_to_fp32(minilm_dir):
    from bert_engine.runtime.fast import ROTATION_BLOCK

    model, tokenizer = load(minilm_dir)
    batch = tokenizer(SENTENCES).model_inputs()
    real = batch["attention_mask"].bool()
    plain = _encode(model, batch)[real]
    rotated, unrotated = quantize_int8(copy.deepcopy(model)), quantize_int8(copy.deepcopy(model), rotation=None)
    for layer in rotated.layers:  # attention.out's input is rotated through V's weights instead
        assert all(p.input_rotation is not None and p.input_rotation.shape[0] == ROTATION_BLOCK
                   for p in (layer.attention.qkv, layer.ffn.up, layer.ffn.down))
        assert layer.attention.out.input_rotation is None
    assert all(p.input_rotation is None for layer in unrotated.layers
               for p in (layer.attention.qkv, layer.attention.out, layer.ffn.up, layer.ffn.down))
    error = {name: float((_encode(m, batch)[real] - plain).norm(dim=-1).mean() / plain.norm(dim=-1).mean())
             for name, m in (("rotated", rotated), ("unrotated", unrotated))}
    assert error["rotated"] < error["unrotated"], error


@needs_onednn_int8
def test_int8_feed_forward_runs_in_row_chunks_with_the_same_output_to_the_bit(minilm_dir):
    from bert_engine.runtime.fast import FFN_CHUNK_ROWS

    model, tokenizer = load(minilm_dir)
    batch = tokenizer(SENTENCES * 3).model_inputs()  # padded rows, many more tokens than a chunk of 8
    quantised = quantize_int8(copy.deepcopy(model))
    assert {layer.ffn.chunk_rows for layer in quantised.layers} == {FFN_CHUNK_ROWS}
    assert {layer.ffn.chunk_rows for layer in model.layers} == {None}  # fp32 is left alone
    whole = _encode(quantised, batch)
    calls = []
    quantised.layers[0].ffn.up.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    for layer in quantised.layers:
        layer.ffn.chunk_rows = 8
    assert torch.equal(_encode(quantised, batch), whole)
    assert len(calls) > 3 and max(calls) == 8
    calls.clear()
    quantised.train()  # training never chunks
    with torch.inference_mode():
        quantised(**batch)
    assert len(calls) == 1


@needs_onednn_int8
def test_smoothing_moves_an_outlier_channel_into_the_weights():
    # a LayerNorm output with one channel 100x wider than the rest (BERT's LayerNorms have such channels):
    # quantised per token, that channel sets every token's step and the others round coarsely; divided
    # out (and multiplied into the weight's column) the steps fit the ordinary channels
    from bert_engine.runtime.fast import smoothing_divisors

    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(384), nn.Linear(384, 128)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.weight[7] = 100.0
        norm.bias.normal_(0, 0.1)
    with torch.inference_mode():
        x = norm(torch.randn(64, 384))
        expected = linear(x)
        divisors = smoothing_divisors(linear, [norm], alpha=0.5)
        plain, smoothed = Int8Linear(linear)(x), Int8Linear(linear, input_divisor=divisors)(x)
    assert int(divisors.argmax()) == 7 and torch.isclose(divisors.log().mean(), torch.tensor(0.0), atol=1e-5)
    error = {name: float(((out - expected).norm(dim=1) / expected.norm(dim=1)).mean())
             for name, out in (("plain", plain), ("smoothed", smoothed))}
    assert error["smoothed"] < 0.5 * error["plain"], error


@needs_onednn_int8
def test_int8_smooths_the_projections_that_read_a_layernorm_and_only_where_it_knows_which(minilm_dir):
    model, tokenizer = load(minilm_dir)
    quantised = quantize_int8(copy.deepcopy(model), smoothing=0.5)
    for layer in quantised.layers:  # qkv reads the previous ffn_norm (or the embeddings'), FFN up attention_norm
        assert layer.attention.qkv.input_multiplier is not None and layer.ffn.up.input_multiplier is not None
        assert layer.attention.out.input_multiplier is None and layer.ffn.down.input_multiplier is None
    assert "smoothed" in repr(quantised.layers[0].ffn.up)
    assert all(layer.attention.qkv.input_multiplier is None  # off by default (fast.SMOOTHING_ALPHA says why)
               for layer in quantize_int8(copy.deepcopy(model)).layers)
    batch = tokenizer(SENTENCES).model_inputs()
    real = batch["attention_mask"].bool()
    plain, smoothed = _encode(model, batch)[real], _encode(quantised, batch)[real]
    assert float(torch.nn.functional.cosine_similarity(smoothed, plain, dim=-1).min()) > 0.99
    with pytest.raises(ValueError, match="smoothing must lie in \\[0, 1\\].*got 1.5"):
        quantize_int8(copy.deepcopy(model), smoothing=1.5)
    # ALBERT: the first run of the shared layer reads the embedding projection, not a norm: no smoothing
    albert = BertModel(dataclasses.replace(PRESETS["tiny"], model_type="albert", embedding_size=64,
                                           num_hidden_groups=1)).eval()
    shared = quantize_int8(albert, smoothing=0.5).layers[0]
    assert shared.attention.qkv.input_multiplier is None and shared.ffn.up.input_multiplier is not None


@needs_onednn_int8
def test_int8_keeps_the_named_projections_in_fp32_and_refuses_unknown_names(minilm_dir):
    model, tokenizer = load(minilm_dir)
    batch = tokenizer(SENTENCES).model_inputs()
    plain = _encode(model, batch)
    quantised = quantize_int8(copy.deepcopy(model), keep_fp32=("ffn.down", "0.attention.qkv"))
    first, last = quantised.layers[0], quantised.layers[5]
    assert isinstance(first.attention.qkv, PackedLinear) and isinstance(last.attention.qkv, Int8Linear)
    assert all(isinstance(layer.ffn.down, PackedLinear) for layer in quantised.layers)
    assert isinstance(last.ffn.up, Int8Linear) and last.ffn.up.post_op == "gelu"  # GELU applied inside the int8 module
    real = batch["attention_mask"].bool()
    similarity = torch.nn.functional.cosine_similarity(_encode(quantised, batch)[real], plain[real], dim=-1)
    assert float(similarity.min()) > 0.98
    with pytest.raises(ValueError, match=r"\['ffn.gate'\] name no encoder projection"):
        quantize_int8(copy.deepcopy(model), keep_fp32=("ffn.gate",))


def test_kernels_are_chosen_per_machine_timed_once_and_kept(tmp_path, monkeypatch):
    """BERT_ENGINE_KERNELS=auto: each projection gets the fastest of oneDNN's packed matmul, MKL's plain one
    and (where it builds) the tiled AVX2 kernel on the model's own shapes, for short and long inputs apart;
    the timings are kept per machine and shape and read back without timing again; the choice shows in the
    provenance. Outputs agree either way."""
    from bert_engine.runtime import fast
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    cache = tmp_path / "kernels.json"
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(cache))
    task = load_registry(entry_points=False).task("sentiment")
    predictor = Predictor.load(task, None, precision="fp32")
    choice = predictor.model.kernel_choice
    attention = fast.native.library() is not None  # (the layers' attention is a choice where the C code runs)
    assert set(choice) == set(fast.PROJECTIONS) | ({fast.ATTENTION} if attention else set())
    assert not attention or choice[fast.ATTENTION]["chose"] == fast.pick_attention(choice[fast.ATTENTION]["rows"])
    projections = {name: c for name, c in choice.items() if name != fast.ATTENTION}
    classes = {fast.PackedLinear: "packed", nn.Linear: "plain", fast.TiledLinear: "tiled"}
    layer = predictor.model.encoder.layers[0]
    kinds = {"qkv": layer.attention.qkv, "out": layer.attention.out, "up": layer.ffn.up, "down": layer.ffn.down}
    # each projection's pick from its own timings, then favour_fusion over the four (AVX2 CPUs: all four tiled
    # where fusing costs their matmuls little)
    expected = {}
    for name, found in projections.items():
        short = {n: t for n, t in found["rows"].items() if int(n) <= fast.COLD_ROWS}
        long = {n: t for n, t in found["rows"].items() if int(n) > fast.COLD_ROWS}
        picked = {"rows": found["rows"], "chose": fast.pick_kernel({"rows": short}, fast.short_rows_incumbent())}
        picked |= {"layer_rows": found["layer_rows"]} if "layer_rows" in found else {}  # whole layers timed (AVX-512)
        if fast.pick_kernel({"rows": long}) != picked["chose"]:
            picked["past_rows"] = [fast.COLD_ROWS, fast.pick_kernel({"rows": long})]
        expected[name] = picked
    fast.favour_fusion(expected)
    for name, found in projections.items():
        assert fast.choice_tiers(found) == fast.choice_tiers(expected[name]), name
        module, tiers = kinds[name], []
        while isinstance(module, fast.RowSwitch):  # tiers: kernel up to rows, then the next ...
            tiers += [classes[type(module.short)], module.rows]
            module = module.long
        assert (*tiers, classes[type(module)]) == fast.choice_tiers(found), name
    assert predictor.provenance()["kernels"] == {name: fast.kernel_label(c) for name, c in choice.items()}
    layers = "layer_rows" in choice["qkv"]  # where the tiled kernel is AVX-512 wide: whole layers timed, kept too
    assert len(json.loads(cache.read_text())) == 4 + layers + attention
    assert layers == (fast.short_rows_incumbent() != "tiled" and fast.native.library() is not None
                      and fast.native.isa() == 512)
    # keyed by what the kernels can use, not the model name alone (an "AMD EPYC" VM is AVX2 or AVX-512)
    assert all(f"|{fast.cpu_isa()}|" in key for key in json.loads(cache.read_text()))

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again although the cache holds this machine's timings")

    monkeypatch.setattr(fast, "time_kernels", no_timing)
    monkeypatch.setattr(fast, "time_layers", no_timing)
    monkeypatch.setattr(fast, "time_attention", no_timing)
    again = Predictor.load(task, None, precision="fp32").model.kernel_choice
    assert again == choice
    text = {"text": "A gorgeous, witty, seductive movie."}
    scores = {}
    for kernels in ("packed", "plain"):
        monkeypatch.setenv("BERT_ENGINE_KERNELS", kernels)
        model = Predictor.load(task, None, precision="fp32")
        wanted = fast.PackedLinear if kernels == "packed" else nn.Linear
        assert all(isinstance(m, wanted) for m in (model.model.encoder.layers[0].attention.qkv,
                                                     model.model.encoder.layers[-1].ffn.down))
        scores[kernels] = model.predict(text)["result"]["score"]
    assert scores["packed"] == pytest.approx(scores["plain"], abs=1e-4)
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "fastest")
    with pytest.raises(Exception, match="BERT_ENGINE_KERNELS='fastest' is not one of auto, packed, plain, tiled"):
        Predictor.load(task, None, precision="fp32")


def test_a_masked_lm_heads_decoder_is_a_kernel_choice_too(tmp_path, monkeypatch):
    """The fill-mask head's decoder (hidden -> vocabulary) is timed on the rows it sees and packed where
    oneDNN wins, like the encoder's projections; BERT_ENGINE_KERNELS=plain keeps it plain. A packed copy
    leaves the word embeddings it was tied to alone, and the candidates stay the same."""
    from bert_engine.runtime import fast
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    task = load_registry(entry_points=False).task("fill_mask")
    auto = Predictor.load(task, None, precision="fp32")
    choice = auto.model.kernel_choice
    assert set(choice) - {fast.ATTENTION} == set(fast.KERNEL_CHOICES)  # (and the attention where the C code runs)
    assert isinstance(auto.model.head.decoder, fast.PackedLinear) == (choice["decoder"]["chose"] == "packed")
    assert any(key.endswith("x30522|decoder") for key in json.loads((tmp_path / "kernels.json").read_text()))
    text = {"text": "The capital of France is [MASK]."}
    answers = {}
    for kernels in ("packed", "plain"):
        monkeypatch.setenv("BERT_ENGINE_KERNELS", kernels)
        predictor = Predictor.load(task, None, precision="fp32")
        head = predictor.model.head
        assert isinstance(head.decoder, fast.PackedLinear if kernels == "packed" else nn.Linear)
        assert predictor.model.encoder.embeddings.word_embeddings.weight.shape == (30522, 384)
        answers[kernels] = predictor.predict(text)["result"]["predictions"][0]["candidates"]
    assert [c["token"] for c in answers["packed"]] == [c["token"] for c in answers["plain"]]
    assert [c["score"] for c in answers["packed"]] == pytest.approx([c["score"] for c in answers["plain"]], abs=1e-5)
    if onednn_int8_available():  # int8 quantises the encoder; the decoder stays fp32 and is still a choice
        monkeypatch.setenv("BERT_ENGINE_KERNELS", "auto")
        int8 = Predictor.load(task, None, precision="int8")
        assert set(int8.model.kernel_choice) == {"decoder"}
        assert isinstance(int8.model.head.decoder, fast.PackedLinear) == (choice["decoder"]["chose"] == "packed")
        assert int8.provenance()["kernels"] == {"decoder": choice["decoder"]["chose"]}


@needs_onednn_int8
def test_compiled_int8_says_which_quantisers_it_fuses(onednn_int8):
    """The provenance of int8 + compile: fused on long inputs, eager on short ones and on the feed-forward's
    row chunks (under the fused floor, so they never reach the compiled quantisers)."""
    from bert_engine.runtime import fast

    if fast.cpp_compiler() is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler; none here")
    model = BertModel(PRESETS["tiny"]).eval()
    prepare_for_inference(model, "int8", compile=True)  # torch.compile is lazy: nothing is built here
    assert model.compiled == (f"int8 input quantisers, for batches of {fast.FUSED_MIN_ROWS:,}+ tokens (shorter "
                              f"ones, and the feed-forward's {fast.FFN_CHUNK_ROWS}-row chunks, run them eagerly)")
