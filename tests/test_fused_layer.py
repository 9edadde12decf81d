"""A whole encoder layer in one C call (bert_engine/runtime/fused_layer.c, runtime.fast.fused_layer): the same
outputs as the torch modules it replaces, on every shape it takes (odd lengths, head widths of 8, 16 and 24,
batches with and without padding, each activation), independent of the batch and the threads, and the
modules running wherever it does not apply."""

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import outputs_at_both_widths

from bert_engine import BertModel
from bert_engine.config import BertConfig
from bert_engine.model import encoder_of
from bert_engine.runtime import fast, native

reason = native.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"the AVX2 kernels cannot run here: {reason}")


def _model(hidden=64, heads=4, inner=128, act="gelu", layers=2, seed=0, family="bert"):
    """A random encoder with every projection through the tiled kernel; LayerNorms not at their identity.
    family "distilbert": built without a token-type table, as a DistilBERT checkpoint's model is."""
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=120, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=inner, hidden_act=act, max_position_embeddings=128,
                        model_type=family, type_vocab_size=0 if family == "distilbert" else 2)
    model = BertModel(config, add_pooler=False).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
    model.padding_free = True  # as prepare_for_inference sets it
    return fast.pack_linear_layers(model, kernel="tiled")


def _run(model, monkeypatch, fused, ids, mask=None):
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1" if fused else "0")
    with torch.inference_mode():
        return model(ids, mask).last_hidden_state


def _activation(values, code, threads=2):
    out = values.clone()
    native.library().fused_activation(ctypes.c_void_p(out.data_ptr()), out.numel(), code, threads)
    return out


def test_its_gelu_and_relu_are_as_close_to_the_truth_as_torchs():
    x = torch.linspace(-12, 12, 96_000)
    truth = F.gelu(x.double())
    assert float((_activation(x, 0).double() - truth).abs().max()) < 2 * float((F.gelu(x).double() - truth).abs().max())
    truth = F.gelu(x.double(), approximate="tanh")
    assert float((_activation(x, 1).double() - truth).abs().max()) < 5e-7
    assert torch.equal(_activation(x, 2), F.relu(x))
    assert torch.equal(_activation(x, 0, threads=1), _activation(x, 0, threads=2))


@pytest.mark.skipif(reason is not None or native.wanted_isa() != 512,
                    reason="the AVX-512 width needs a CPU whose torch capability is AVX512")
@pytest.mark.parametrize("code", [0, 1, 2])
def test_each_activation_at_avx512s_width_is_avx2s_bits(code):
    """16 lanes at a time where the matmuls run at AVX-512's width (the last 8 of a length 8 past a multiple of
    16 as at AVX2's), every value the same bits: past erf's last piece, zeros of both signs, infinities, NaN."""
    x = torch.cat([torch.linspace(-12, 12, 8_000), torch.tensor([0.0, -0.0, 4.0, -4.0, 3.9999998, float("inf"),
                                                                   float("-inf"), float("nan")])])
    assert x.numel() % 16 == 8
    got = outputs_at_both_widths(native.library().tiled_matmul_set_isa, native.isa(), lambda: _activation(x, code))
    assert all(torch.equal(out.view(torch.int32), got[256, 1].view(torch.int32)) for out in got.values())


def test_its_erf_table_is_what_scripts_fit_erf_prints_and_within_its_bound():
    from scripts.fit_erf import c_table, fit, largest_error

    table = fit()
    source = (Path(native.__file__).parent / "fused_layer.c").read_text()
    assert c_table(table) in source
    error, _ = largest_error(table)
    assert error < 9e-8  # the bound fused_layer.c states
    # the GELU on what it is fed between the pieces' edges, NaN and the infinities, against float64
    x = torch.tensor([-4.0, -3.0, -2.0, -1.0, -0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.65685, -5.65685] * 4) * 2 ** 0.5
    assert float((_activation(x, 0).double() - F.gelu(x.double())).abs().max()) < 4e-7
    # (against float64: torch's own float32 GELU gives NaN for +inf in its AVX-512 code and inf in its AVX2 code)
    odd = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-30, -1e-30, 1e-40, 0.0, 0.0])
    assert torch.equal(_activation(odd, 0).isnan(), F.gelu(odd.double()).isnan())
    assert torch.equal(_activation(odd, 0).nan_to_num(), F.gelu(odd.double()).float().nan_to_num())


@pytest.mark.parametrize(("hidden", "heads", "act"), [(64, 4, "gelu"), (48, 6, "relu"), (96, 4, "gelu_new"),
                                                     (128, 2, "gelu")])
@pytest.mark.parametrize("length", [1, 5, 17, 40])
def test_one_text_gets_the_modules_answer(monkeypatch, hidden, heads, act, length):
    """Head widths 16, 8, 24 and 64 (BERT-base's; the context's steps of 16 and 8), lengths that are not
    multiples of the 4 queries or 16 keys it takes at once."""
    model = _model(hidden, heads, 2 * hidden, act, seed=length)
    assert all(layer.fused is fast.fused_layer for layer in encoder_of(model).layers)
    ids = torch.randint(1, 120, (1, length))
    fused, modules = _run(model, monkeypatch, True, ids), _run(model, monkeypatch, False, ids)
    torch.testing.assert_close(fused, modules, atol=3e-6, rtol=1e-5)


def test_a_padded_batch_gets_the_modules_answer_and_each_text_its_own(monkeypatch):
    """Right and left padding (the real tokens of each row next to each other) run fused, each row attending
    to itself only; a text's output is the same to the bit alone as anywhere in the batch."""
    model = _model()
    ids = torch.randint(1, 120, (4, 23))
    mask = torch.ones(4, 23, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, :20] = 0  # left padding
    mask[3, 1:] = 0
    fused, modules = _run(model, monkeypatch, True, ids, mask), _run(model, monkeypatch, False, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(fused[real], modules[real], atol=3e-6, rtol=1e-5)
    for row in (0, 1, 3):  # (left padding moves the positions, alone or not)
        keep = real[row]
        alone = _run(model, monkeypatch, True, ids[row:row + 1, keep])
        assert torch.equal(alone[0], fused[row, keep])
    equal = _run(model, monkeypatch, True, ids[:, :9])  # no padding: no mask, rows end to end
    assert torch.equal(equal[1], _run(model, monkeypatch, True, ids[1:2, :9])[0])


@pytest.mark.skipif(reason is not None or native.wanted_isa() != 512,
                    reason="the AVX-512 width needs a CPU whose torch capability is AVX512")
@pytest.mark.parametrize(("hidden", "heads"), [(64, 8), (48, 2), (96, 4), (128, 4), (128, 2)])
def test_the_avx512_width_gives_the_avx2_widths_bits(monkeypatch, hidden, heads):
    """The attention follows the matmuls' width; at either, each score and context value is the same chain of
    fused multiply-adds and each softmax total the same sum: head widths 8, 24, 24, 32 and 64 (a last step of
    8, 16 or 24 of D; 16 or 32 keys), lengths across the 16 and 32 keys a step takes, padded rows."""
    model = _model(hidden, heads, 2 * hidden, seed=hidden + heads)
    ids = torch.randint(1, 120, (3, 49))
    mask = torch.ones(3, 49, dtype=torch.long)
    mask[1, 17:] = 0
    mask[2, 33:] = 0
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    got = outputs_at_both_widths(native.library().tiled_matmul_set_isa, native.isa(),
                                 lambda: model(ids, mask).last_hidden_state)
    assert all(torch.equal(out, got[256, 1]) for out in got.values())
    modules = _run(model, monkeypatch, False, ids, mask)
    torch.testing.assert_close(got[512, 2][mask.bool()], modules[mask.bool()], atol=3e-6, rtol=1e-5)


def test_the_thread_count_does_not_change_a_bit(monkeypatch):
    model = _model(seed=3)
    ids = torch.randint(1, 120, (2, 37))
    before = torch.get_num_threads()
    two = _run(model, monkeypatch, True, ids)
    try:
        torch.set_num_threads(1)
        one = _run(model, monkeypatch, True, ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_modules_run_where_it_does_not_apply(monkeypatch):
    """SiLU (no code for it), a padding mask with a hole, gradients, the setting off, a packed projection:
    fused_layer answers None and the layer's modules give the output."""
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    silu = _model(act="silu")
    layer = encoder_of(silu).layers[0]
    x = torch.randn(1, 6, 64)
    with torch.inference_mode():
        assert fast.fused_layer(layer, x, None, None) is None
    model = _model()
    layer = encoder_of(model).layers[0]
    from bert_engine.model import Unpadded, additive_padding_mask

    holed = torch.tensor([[1, 0, 1, 1]])
    unpadded = Unpadded(holed)
    with torch.inference_mode():
        assert fast.fused_layer(layer, torch.randn(3, 64), additive_padding_mask(holed, torch.float32), unpadded) is None
        assert fast.fused_layer(layer, x, additive_padding_mask(torch.ones(1, 6), torch.float32), None) is None
        assert fast.fused_layer(layer, x, None, None) is not None
    assert fast.fused_layer(layer, x.requires_grad_(), None, None) is None
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
    with torch.inference_mode():
        assert fast.fused_layer(layer, x.detach(), None, None) is None
    packed = fast.pack_linear_layers(BertModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=4, intermediate_size=64)).eval())
    assert encoder_of(packed).layers[0].fused is None


def test_a_real_checkpoint_stays_within_the_parity_bound(monkeypatch, tmp_path, minilm_dir):
    """MiniLM, fused, against transformers' fp32 output: within the 4e-6 the tiled kernel's modules keep."""
    transformers = pytest.importorskip("transformers")
    from bert_engine.checkpoints.loader import load_pretrained

    folder = minilm_dir
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    model = fast.pack_linear_layers(load_pretrained(str(folder)).eval(), kernel="tiled")
    reference = transformers.AutoModel.from_pretrained(str(folder)).eval()
    ids = torch.randint(1000, 20000, (1, 30))
    with torch.inference_mode():
        want = reference(input_ids=ids).last_hidden_state
    got = _run(model, monkeypatch, True, ids)
    assert float((got - want).abs().max()) < 4e-6


@pytest.mark.parametrize("fused", [True, False])
def test_a_classifier_over_cls_gets_the_last_layer_for_cls_alone(monkeypatch, fused):
    """first_token_only: the last layer computes each row's first token, (B, 1, H), equal to the whole
    layer's first row (to the bit where fused, whose query rows are computed alike); padding at the end is
    fine, a row whose first token is padding turns it off; attentions or hidden states asked for too."""
    model = _model(seed=7)
    ids = torch.randint(1, 120, (3, 14))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, 5:] = 0
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1" if fused else "0")
    with torch.inference_mode():
        whole = model(ids, mask).last_hidden_state
        first = model(ids, mask, first_token_only=True).last_hidden_state
        unmasked = model(ids, first_token_only=True).last_hidden_state
        left = mask.flip(1)
        ignored = model(ids, left, first_token_only=True).last_hidden_state
        with_states = model(ids, mask, output_hidden_states=True, first_token_only=True).last_hidden_state
    assert first.shape == (3, 1, 64) and unmasked.shape == (3, 1, 64)
    if fused:
        assert torch.equal(first, whole[:, :1])
    else:
        torch.testing.assert_close(first, whole[:, :1], atol=2e-6, rtol=1e-5)
    assert ignored.shape == (3, 14, 64) and with_states.shape == (3, 14, 64)


def test_a_sequence_head_asked_for_cls_alone_answers_alike_and_trains(tiny_config):
    """BertWithHead(first_token_only=True), as the sentiment task's batches ask: the same logits, the
    encoder's output (B, 1, H), gradients through the first-row path; unasked, the full output as documented."""
    from bert_engine.heads import BertWithHead

    torch.manual_seed(0)
    model = BertWithHead(tiny_config.with_labels(["a", "b"]), "sequence").train()
    ids = torch.randint(5, 99, (2, 6))
    model(ids, first_token_only=True).logits.sum().backward()
    assert model.encoder.layers[-1].ffn.up.weight.grad is not None
    model.eval()
    with torch.no_grad():
        first, whole = model(ids, first_token_only=True), model(ids)
    assert first.encoder.last_hidden_state.shape == (2, 1, 32) and whole.encoder.last_hidden_state.shape == (2, 6, 32)
    torch.testing.assert_close(first.logits, whole.logits, atol=1e-6, rtol=1e-5)


def test_the_provenance_and_info_say_where_layers_run_fused(monkeypatch, tmp_path):
    """fused_label reads choose_kernels' answer: every input, short inputs only, or which projection keeps
    it from running; the setting off says so. A tiled sentiment predictor's provenance carries it."""
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    tiled = {name: {"chose": "tiled"} for name in fast.PROJECTIONS}
    assert fast.fused_label(tiled) == "every input: " + fast.FUSED_WORDS
    assert "the layers in one C call" in fast.FUSED_WORDS
    short = {**tiled, "up": {"chose": "tiled", "past_rows": [256, "packed"]}}
    assert fast.fused_label(short) == "inputs of up to 256 rows: " + fast.FUSED_WORDS
    assert fast.fused_label({**tiled, "up": {"chose": "packed"}}) == "not used: up does not run the tiled kernel"
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
    assert fast.fused_label(tiled) == "off (BERT_ENGINE_FUSED_LAYERS=0)"
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "tiled")
    predictor = Predictor.load(load_registry(entry_points=False).task("sentiment"), None, precision="fp32")
    assert predictor.provenance()["fused_layers"] == "every input: " + fast.FUSED_WORDS


def test_short_inputs_keep_every_projection_tiled_where_fusing_costs_their_matmuls_little(monkeypatch):
    """favour_fusion (AVX2 CPUs, where the tiled kernel is the incumbent): one projection whose short rows
    timed 15 % faster packed joins the others on the tiled kernel when the layer's matmuls lose at most 10 %,
    keeping its long-input kernel; past 10 %, or with the setting off or another incumbent, nothing changes."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "tiled")

    def choice(up_packed):
        rows = {"24": {"packed": 1.0, "plain": 1.2, "tiled": 1.0}, "128": {"packed": 2.0, "plain": 2.4, "tiled": 2.0},
                "2048": {"packed": 30, "plain": 31, "tiled": 33}}
        up = {n: {**t, "packed": t["packed"] * up_packed} for n, t in rows.items()}
        made = {name: {"rows": rows, "chose": "tiled", "past_rows": [256, "packed"]} for name in fast.PROJECTIONS}
        made["up"] = {"rows": up, "chose": "packed"}
        return made

    near = choice(0.85)  # up: tiled 1/0.85 = 1.18x its packed; the layer: 4.0 against 3.85 (1.04x)
    fast.favour_fusion(near)
    assert fast.kernel_label(near["up"]) == "tiled up to 256 rows, then packed"
    assert fast.fused_label(near) == "inputs of up to 256 rows: " + fast.FUSED_WORDS
    far = choice(0.5)  # the layer: 4.0 against 3.5 (1.14x)
    fast.favour_fusion(far)
    assert far["up"]["chose"] == "packed" and fast.fused_label(far) == "not used: up does not run the tiled kernel"
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
    off = choice(0.85)
    fast.favour_fusion(off)
    assert off["up"]["chose"] == "packed"
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "packed")
    monkeypatch.setattr(fast.native, "isa", lambda: 256)  # (an AVX-512-wide kernel has its own rule: test_native.py)
    elsewhere = choice(0.85)
    fast.favour_fusion(elsewhere)
    assert elsewhere["up"]["chose"] == "packed"


@pytest.mark.parametrize("group", [1, 20, 45, 10_000])
def test_sequences_in_groups_get_the_same_bits(monkeypatch, group):
    """A batch goes through fused_layer.c in groups of whole sequences (FUSED_GROUP_ROWS rows, one longer sequence
    alone): each step works per row or per sequence, so any grouping gives every text the same bits, [CLS]-only
    runs included."""
    model = _model(seed=5)
    ids = torch.randint(1, 120, (5, 23))
    mask = torch.ones(5, 23, dtype=torch.long)
    mask[1, 9:] = 0
    mask[3, 17:] = 0
    whole = _run(model, monkeypatch, True, ids, mask)
    monkeypatch.setattr(fast, "FUSED_GROUP_ROWS", group)
    grouped = _run(model, monkeypatch, True, ids, mask)
    assert torch.equal(grouped[mask.bool()], whole[mask.bool()])
    layer = encoder_of(model).layers[0]
    x = torch.randn(5, 23, 64)
    with torch.inference_mode():
        first = fast.fused_layer(layer, x, None, None, first_only=True)
        monkeypatch.setattr(fast, "FUSED_GROUP_ROWS", 10_000)
        assert torch.equal(first, fast.fused_layer(layer, x, None, None, first_only=True))


@pytest.mark.parametrize(("tiled_long", "fused_everywhere"), [(31.0, True), (32.0, False)])
def test_long_inputs_join_the_tiled_kernel_where_their_matmuls_lose_at_most_five_percent(monkeypatch, tiled_long,
                                                                                         fused_everywhere):
    """favour_fusion for batches past COLD_ROWS rows: where every projection runs the tiled kernel for short
    inputs and all four on it cost long inputs' matmuls at most FUSION_MARGIN_LONG (5 %) over their packed
    choice, long inputs run it too, and so each layer in one C call at every length."""
    monkeypatch.setattr(fast, "short_rows_incumbent", lambda: "tiled")
    rows = {"24": {"packed": 1.2, "plain": 1.2, "tiled": 1.0}, "128": {"packed": 2.4, "plain": 2.4, "tiled": 2.0},
            "2048": {"packed": 30.0, "plain": 31.0, "tiled": tiled_long}}
    choice = {name: {"rows": rows, "chose": "tiled", "past_rows": [256, "packed"]} for name in fast.PROJECTIONS}
    fast.favour_fusion(choice)
    if fused_everywhere:
        assert all(fast.kernel_label(c) == "tiled" for c in choice.values())
        assert fast.fused_label(choice) == "every input: " + fast.FUSED_WORDS
    else:
        assert all(fast.kernel_label(c) == "tiled up to 256 rows, then packed" for c in choice.values())
        assert fast.fused_label(choice) == "inputs of up to 256 rows: " + fast.FUSED_WORDS


def _both_ways(model, *args, **kwargs):
    """The model's output with every layer in one C call (fused_stack) and with one call a layer; asserts the
    one call ran (it answers None where it does not apply)."""
    encoder = encoder_of(model)
    answered = []

    def spy(*a, **k):
        answered.append(fast.fused_stack(*a, **k))
        return answered[-1]

    with torch.inference_mode():
        encoder.fused_stack = spy
        stacked = model(*args, **kwargs)
        encoder.fused_stack = None
        layered = model(*args, **kwargs)
        encoder.fused_stack = fast.fused_stack
    return stacked, layered, answered


@pytest.mark.parametrize("layers", [1, 3])
def test_every_layer_in_one_call_gives_the_bits_of_one_call_a_layer(monkeypatch, layers):
    """fused_stack runs fused_layer for each layer in one C call: one text, a padded batch (each text's rows
    alone), the last layer for [CLS] alone, and an int8 model's layers; the same bits every way."""
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    model = _model(layers=layers, seed=layers)
    assert encoder_of(model).fused_stack is fast.fused_stack  # set with the layers' fused path
    ids = torch.randint(1, 120, (3, 19))
    mask = torch.ones(3, 19, dtype=torch.long)
    mask[1, 7:] = 0
    for args, kwargs in (((ids[:1],), {}), ((ids, mask), {}), ((ids, mask), {"first_token_only": True})):
        stacked, layered, answered = _both_ways(model, *args, **kwargs)
        assert answered and answered[-1] is not None
        assert torch.equal(stacked.last_hidden_state, layered.last_hidden_state)
    # sequences in groups of at most FUSED_GROUP_ROWS rows: the scratch the call asks for is a group's, not the batch's
    monkeypatch.setattr(fast, "FUSED_GROUP_ROWS", 20)
    asked = []
    take = fast.SCRATCH.take
    monkeypatch.setattr(fast.SCRATCH, "take", lambda floats: asked.append(floats) or take(floats))
    stacked, layered, answered = _both_ways(model, ids)
    assert answered[-1] is not None and torch.equal(stacked.last_hidden_state, layered.last_hidden_state)
    assert asked[0] == 20 * (5 * 64 + 128)  # (3 texts of 19 rows: groups of one text, 20 rows the most)
    monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "tiled")
    int8 = fast.quantize_int8(_model(layers=layers, seed=9))
    assert encoder_of(int8).fused_stack is fast.fused_stack
    stacked, layered, answered = _both_ways(int8, ids, mask)
    assert answered[-1] is not None and torch.equal(stacked.last_hidden_state, layered.last_hidden_state)


def test_the_layers_run_one_by_one_where_one_call_does_not_apply(monkeypatch):
    """A layer that does not run fused (None from fused_stack, the others then run as before), hidden states
    or attentions asked for (the layers' own outputs), a hook between layers (a long row handing its turn
    back, model.BETWEEN_LAYERS): each answered as one call a layer does, with the same bits."""
    from bert_engine.model import BETWEEN_LAYERS

    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    model = _model(layers=2)
    ids = torch.randint(1, 120, (1, 9))
    _, _, answered = _both_ways(model, ids, output_hidden_states=True)
    assert answered == []  # not asked
    seen = []
    token = BETWEEN_LAYERS.set(seen.append)
    try:
        stacked, layered, answered = _both_ways(model, ids)
    finally:
        BETWEEN_LAYERS.reset(token)
    assert answered == [] and seen == [1, 1] and torch.equal(stacked.last_hidden_state, layered.last_hidden_state)
    encoder_of(model).layers[1].fused = None  # (its modules run)
    stacked, layered, answered = _both_ways(model, ids)
    assert answered == [None] and torch.equal(stacked.last_hidden_state, layered.last_hidden_state)
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
    with torch.inference_mode():
        assert fast.fused_stack(encoder_of(model), list(encoder_of(model).layers), torch.randn(1, 9, 64), None,
                                None) is None


def test_a_layer_given_new_weights_is_planned_again(monkeypatch):
    """fused_layer works out a layer's plan once (pointers into its tensors); a norm or projection given a new
    tensor afterwards must be read, not the old one's memory."""
    model = _model(seed=7)
    ids = torch.randint(1, 120, (1, 11))
    before = _run(model, monkeypatch, True, ids)
    layer = encoder_of(model).layers[1]
    with torch.no_grad():
        layer.ffn_norm.weight = torch.nn.Parameter(layer.ffn_norm.weight * 2)
        layer.attention.qkv.register_buffer("panels", layer.attention.qkv.panels * 0.5, persistent=False)
    fused, modules = _run(model, monkeypatch, True, ids), _run(model, monkeypatch, False, ids)
    torch.testing.assert_close(fused, modules, atol=3e-6, rtol=1e-5)
    assert not torch.allclose(fused, before)


def _embeddings_both_ways(monkeypatch, embeddings, *args):
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    with torch.inference_mode():
        fused = embeddings(*args)
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "0")
    with torch.inference_mode():
        plain = embeddings(*args)
    return fused, plain


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_the_embeddings_in_one_call_get_the_modules_answer(monkeypatch, family):
    """fused_embeddings (a fused model's BertEmbeddings in inference): torch's sums in torch's order and the
    layers' LayerNorm, within 1e-6 of the modules, segments or none, given positions or its own, a batch."""
    model = _model(hidden=64, family=family)
    embeddings = encoder_of(model).embeddings
    assert embeddings.fused is fast.fused_embeddings
    assert (embeddings.token_type_embeddings is None) == (family == "distilbert")
    with torch.no_grad():
        for table in (embeddings.word_embeddings, embeddings.position_embeddings):
            table.weight.normal_()
    calls = 0
    real = native.library().fused_embeddings

    def counted(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(native.library(), "fused_embeddings", counted)
    ids = torch.randint(0, 120, (3, 17))
    types = torch.randint(0, 2, (3, 17))
    for positions in (None, torch.arange(5, 22), torch.randint(0, 128, (3, 17))):
        fused, plain = _embeddings_both_ways(monkeypatch, embeddings, ids, types, positions)
        assert calls and fused.shape == plain.shape == (3, 17, 64)
        assert float((fused - plain).abs().max()) < 1e-6
        calls = 0
    one = _embeddings_both_ways(monkeypatch, embeddings, ids[1:2], types[1:2], None)[0]
    assert torch.equal(one[0], _embeddings_both_ways(monkeypatch, embeddings, ids, types, None)[0][1])


def test_the_embeddings_fall_back_to_the_modules_where_the_c_code_does_not_apply(monkeypatch):
    """An id outside its table: nothing read past it, the modules run and name it; RoBERTa's positions, a
    renormalising table, gradients wanted: the modules' answer; new weights: read, not the planned ones."""
    model = _model(hidden=64)
    embeddings = encoder_of(model).embeddings
    ids, types = torch.randint(0, 120, (2, 9)), torch.zeros(2, 9, dtype=torch.int64)
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    for bad_ids, bad_types, bad_positions in ((ids + 120, types, None), (ids, types + 2, None),
                                             (ids, types, torch.full((9,), 128))):
        with torch.inference_mode():
            assert fast.fused_embeddings(embeddings, bad_ids, bad_types, bad_positions) is None
        with pytest.raises(IndexError), torch.inference_mode():
            embeddings(bad_ids, bad_types, bad_positions)
    with torch.inference_mode():
        assert fast.fused_embeddings(embeddings, ids, types, None) is not None
    assert fast.fused_embeddings(embeddings, ids, types, None) is None  # gradients wanted: the modules
    with torch.no_grad():
        replaced = torch.nn.Parameter(embeddings.word_embeddings.weight * 3)
    embeddings.word_embeddings.weight = replaced
    fused, plain = _embeddings_both_ways(monkeypatch, embeddings, ids, types, None)
    assert float((fused - plain).abs().max()) < 1e-6 and float(plain.abs().max()) > 0
    monkeypatch.setenv("BERT_ENGINE_FUSED_LAYERS", "1")
    with torch.inference_mode():
        embeddings.word_embeddings.max_norm = 1.0
        assert fast.fused_embeddings(embeddings, ids, types, None) is None
        embeddings.word_embeddings.max_norm = None
        assert fast.fused_embeddings(embeddings, ids, types, None) is not None
        roberta = encoder_of(_model(hidden=64)).embeddings
        roberta.roberta_padding = 1
        assert fast.fused_embeddings(roberta, ids, types, None) is None
