"""bert_engine's own attention for layers whose matmuls run elsewhere (runtime.fast.native_attention: fused_layer.c's
attention, each sequence and head over its own tokens): torch's answer on every shape it takes, torch's backend
wherever it does not apply, and chosen per machine by timing it beside torch's (choose_kernels' "attention")."""

import json

import pytest
import torch

from bert_engine import BertModel
from bert_engine.config import BertConfig
from bert_engine.model import encoder_of
from bert_engine.runtime import fast, native

reason = native.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"the AVX2 kernels cannot run here: {reason}")


def _model(hidden=64, heads=4, layers=2, seed=0, packed=True):
    """A random encoder on oneDNN's packed projections (no layer fused), padding-free as in inference."""
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=120, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, max_position_embeddings=128)
    model = BertModel(config, add_pooler=False).eval()
    model.padding_free = True  # as prepare_for_inference sets it
    return fast.pack_linear_layers(model, kernel="packed") if packed else model


def _counted(model):
    """Every layer's attention through native_attention, counting the calls that answered (not None)."""
    answered = []

    def counting(*args):
        out = fast.native_attention(*args)
        answered.append(out is not None)
        return out

    for layer in encoder_of(model).layers:
        layer.attention.native = counting
    return answered


def _run(model, ids, mask=None, native_on=True):
    fast.use_attention(model, "native" if native_on else None)
    with torch.inference_mode():
        return model(ids, mask).last_hidden_state


@pytest.mark.parametrize(("hidden", "heads"), [(64, 4), (48, 6), (96, 4), (128, 2), (384, 12)])
@pytest.mark.parametrize("lengths", [(1,), (17,), (40, 9, 33), (120, 5)])
def test_a_batch_gets_torchs_answer(hidden, heads, lengths):
    """Head widths 16, 8, 24, 64 and 32 (MiniLM's); batches of mixed lengths (unpadded rows), each text's tokens
    attending to its own alone; one text alone runs torch's attention (native_attention answers None)."""
    model = _model(hidden, heads, seed=sum(lengths))
    ids = torch.randint(1, 120, (len(lengths), max(lengths)))
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    want = _run(model, ids, mask, native_on=False)
    answered = _counted(model)
    with torch.inference_mode():
        got = model(ids, mask).last_hidden_state
    assert answered and all(answered) == (len(lengths) > 1) and (any(answered) == all(answered))  # every layer
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-6, rtol=1e-5)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))  # padding's outputs stay zeros (padding-free)
    for row, n in enumerate(lengths):  # each text alone (torch's attention): its own answer
        alone = _run(model, ids[row:row + 1, :n])
        torch.testing.assert_close(alone[0], got[row, :n], atol=2e-6, rtol=1e-5)


def test_torchs_backend_runs_where_it_does_not_apply():
    """A head width that is not a multiple of 8, a mask with holes (padding between a row's tokens), gradients
    wanted, attentions asked for, bf16: torch's backend answers (the same values), native_attention None."""
    odd = _model(hidden=36, heads=3)  # head width 12
    ids = torch.randint(1, 120, (2, 10))
    answered = _counted(odd)
    with torch.inference_mode():
        odd(ids)
    assert answered and not any(answered)
    model = _model()
    holes = torch.ones(2, 10, dtype=torch.long)
    holes[0, 3:5] = 0
    answered = _counted(model)
    with torch.inference_mode():
        got = model(ids, holes).last_hidden_state
    assert answered and not any(answered)
    torch.testing.assert_close(got, _run(model, ids, holes, native_on=False), atol=0, rtol=0)
    answered = _counted(model)
    with torch.inference_mode():
        with_weights = model(ids, output_attentions=True)
    assert not answered and len(with_weights.attentions) == 2  # the eager backend's weights, native not asked
    layer = encoder_of(model).layers[0].attention
    qkv = torch.randn(1, 4, 192, requires_grad=True)
    assert fast.native_attention(layer, qkv, None, None) is None
    assert fast.native_attention(layer, qkv.detach().bfloat16(), None, None) is None


def test_the_choice_is_timed_once_per_machine_and_kept(monkeypatch, tmp_path):
    """choose_kernels times the attention beside torch's on the model's own width and heads and keeps the
    timings in the kernel cache; the next load reads them; pick_attention takes the native one only where it is
    10 % faster over the shapes timed."""
    assert fast.pick_attention({"24": {"sdpa": 1.0, "native": 0.5}, "128": {"sdpa": 2.0, "native": 1.9}}) == "native"
    assert fast.pick_attention({"24": {"sdpa": 1.0, "native": 0.95}}) == "sdpa"  # within the margin: torch's
    assert fast.pick_attention({"24": {"sdpa": 1.0, "native": 0.5}, "128": {"sdpa": 1.0, "native": 3.0}}) == "sdpa"
    assert fast.pick_attention({}) == "sdpa"
    real = fast.time_attention(64, 4, shapes=((1, 8), (2, 16)), repeats=1)  # the timing itself, briefly
    assert set(real) == {"8", "32"} and all(set(t) == {"sdpa", "native"} and min(t.values()) > 0 for t in real.values())
    timings = []

    def timed(hidden, heads, shapes=None, repeats=7):
        timings.append((hidden, heads))
        return {"24": {"sdpa": 1.0, "native": 0.5}, "1024": {"sdpa": 9.0, "native": 6.0}}

    monkeypatch.setattr(fast, "time_attention", timed)
    cache = tmp_path / "kernels.json"
    model = _model(packed=False)
    choice = fast.choose_kernels(model, cache)
    assert choice[fast.ATTENTION]["chose"] == "native" and timings == [(64, 4)]
    assert any("|attention|64 wide|4 heads" in key for key in json.loads(cache.read_text()))
    again = fast.choose_kernels(_model(seed=1, packed=False), cache)
    assert again[fast.ATTENTION]["chose"] == "native" and timings == [(64, 4)]  # read, not timed again


def test_a_predictor_says_which_attention_it_runs(monkeypatch, tmp_path):
    """The provenance's kernels name the attention where BERT_ENGINE_KERNELS=auto chose it; the layers run it."""
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    monkeypatch.setattr(fast, "time_attention",
                        lambda hidden, heads, shapes=None, repeats=7: {"128": {"sdpa": 2.0, "native": 1.0}})
    monkeypatch.setenv("BERT_ENGINE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "auto")
    predictor = Predictor.load(load_registry(entry_points=False).task("sentiment"), None, precision="fp32")
    assert predictor.provenance()["kernels"]["attention"] == "native"
    assert all(layer.attention.native is fast.native_attention for layer in encoder_of(predictor.model).layers)
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "packed")  # a kernel named: torch's attention, as before
    predictor = Predictor.load(load_registry(entry_points=False).task("sentiment"), None, precision="fp32")
    assert "attention" not in predictor.provenance()["kernels"]
    assert all(layer.attention.native is None for layer in encoder_of(predictor.model).layers)


def test_a_real_checkpoint_stays_within_the_parity_bound(minilm_dir):
    """MiniLM with the native attention against transformers' fp32 output, a padded batch: within 4e-6."""
    transformers = pytest.importorskip("transformers")
    from bert_engine.checkpoints.loader import load_pretrained

    model = fast.pack_linear_layers(load_pretrained(str(minilm_dir)).eval(), kernel="packed")
    model.padding_free = True
    reference = transformers.AutoModel.from_pretrained(str(minilm_dir)).eval()
    ids = torch.randint(1000, 20000, (3, 150))
    mask = torch.ones(3, 150, dtype=torch.long)
    mask[1, 90:] = 0
    mask[2, 7:] = 0
    with torch.inference_mode():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    answered = _counted(model)
    with torch.inference_mode():
        got = model(ids, mask).last_hidden_state
    assert answered and all(answered)
    real = mask.bool()
    assert float((got[real] - want[real]).abs().max()) < 4e-6
