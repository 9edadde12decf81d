"""The Predictor (bert_engine/runtime/inference.py): input checks, batched prediction, and what postprocess gets."""

import pytest
import torch

from bert_engine import BertWithHead
from bert_engine.hookspecs import InputError, TaskContext, TaskSpec, hookimpl
from bert_engine.runtime.inference import MAX_INPUT_CHARS, predict_in_batches
from bert_engine.runtime.precision import prepare_for_inference
from bert_engine.tasks.conformance import tiny_predictor
from bert_engine.tasks.registry import Registry, load_registry

BUILTIN = load_registry(entry_points=False)


@pytest.fixture(scope="module")
def sentiment():
    return tiny_predictor(BUILTIN.task("sentiment"))


@pytest.mark.parametrize("inputs, options, message", [
    ("just text", {}, "inputs must be a mapping"),
    ({"text": 3}, {}, "input 'text' must be text, got int"),
    ({"text": "x" * (MAX_INPUT_CHARS + 1)}, {}, "has 1,000,001 characters; the limit is 1,000,000"),
    ({"text": "ok \udc00"}, {}, "input 'text' holds a lone surrogate"),
    ({"text": "ok"}, {"colour": "red"}, "unknown option\\(s\\) colour; known: top_k"),
])
def test_bad_inputs_and_options_are_named(sentiment, inputs, options, message):
    with pytest.raises(InputError, match=message):
        sentiment.predict(inputs, **options)


def test_batched_prediction_equals_one_at_a_time_and_names_bad_positions(sentiment):
    texts = ["short", "a somewhat longer sentence with more words in it", "mid length text", "x"]
    batched = predict_in_batches(sentiment, [{"text": t} for t in texts], batch_size=3)
    for text, result in zip(texts, batched):
        single = sentiment.predict({"text": text})["result"]
        assert [r["label"] for r in result["labels"]] == [r["label"] for r in single["labels"]]
        for a, b in zip(result["labels"], single["labels"]):
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    with pytest.raises(InputError, match=r"^sentiment: inputs\[1\]: the text is empty; inputs\[3\]: no text; "
                                         r"inputs\[4\]: the text is not text \(got int\); inputs\[5\]: not a text or "
                                         r"a mapping of text \(got list\)$"):
        predict_in_batches(sentiment, [{"text": "fine"}, {"text": " "}, {"text": "ok"}, {"text": None}, {"text": 5},
                                       ["a"]])


def test_one_long_input_does_not_pad_a_short_list_around_it(sentiment, monkeypatch):
    """A short list (a Space's merged requests) is sorted by length and a much longer input runs in a pass
    of its own: no row is padded to several times its length. Answers are in the caller's order."""
    from bert_engine.runtime import inference

    texts = ["good", "a long review " * 120, "bad film", "fine", "quite a nice and long enough sentence here"]
    widths = []
    original = sentiment.run
    monkeypatch.setattr(sentiment, "run", lambda batch, options: widths.append(
        (len(batch), batch.input_ids.shape[1], int(batch.attention_mask.sum(1).min()))) or original(batch, options))
    batched = predict_in_batches(sentiment, [{"text": t} for t in texts], batch_size=16)
    assert len(widths) >= 2 and all(width <= inference.LENGTH_SPREAD * shortest + inference.LENGTH_SLACK
                                    for _, width, shortest in widths), widths
    assert sum(rows for rows, _, _ in widths) >= len(texts)
    for text, result in zip(texts, batched):
        single = sentiment.predict({"text": text})["result"]
        assert [r["label"] for r in result["labels"]] == [r["label"] for r in single["labels"]]
    assert inference.length_groups([5, 500, 7, 12, 40, 30], 32) == [[0, 2, 3], [5, 4], [1]]
    assert inference.length_groups([10] * 5, 2) == [[0, 1], [2, 3], [4]] and inference.length_groups([], 4) == []


def test_a_postprocess_declaring_context_gets_the_tokenizer_and_the_encoder():
    seen = {}

    def postprocess(output, batch, *, context: TaskContext):
        encoded = context.encode(batch.model_inputs())
        seen.update(tokenizer=context.tokenizer, same=torch.equal(encoded.last_hidden_state, output))
        return {}

    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            register(TaskSpec(name="ctx", title="Context", build_head=lambda config: torch.nn.Identity(),
                              preprocess=lambda inputs, tokenizer: tokenizer(inputs["text"]),
                              postprocess=postprocess))

    registry = Registry(strict=True)
    registry.load_plugin("ctx", "0", "test", Plugin)
    task = registry.task("ctx")
    assert task.takes_context
    predictor = tiny_predictor(task)
    predictor.model.head.forward = lambda encoded: encoded.last_hidden_state  # the head hands on the states
    predictor.predict({"text": "hello there"})
    assert seen == {"tokenizer": predictor.tokenizer, "same": True}
    assert not BUILTIN.task("sentiment").takes_context and BUILTIN.task("fill_mask").takes_context


def test_inference_runs_the_encoder_padding_free(tiny_config):
    model = prepare_for_inference(BertWithHead(tiny_config.with_labels(["a", "b"]), "token"), "fp32")
    assert model.encoder.padding_free


@pytest.mark.slow  # torch.compile's first calls take about 15 s
def test_a_compiled_predictor_runs_padding_free_and_answers_as_the_eager_one(tiny_config, monkeypatch):
    from bert_engine.runtime import fast  # noqa: PLC0415
    from bert_engine.runtime.fast import onednn_int8_available  # noqa: PLC0415

    monkeypatch.setattr(fast, "FUSED_MIN_ROWS", 1)  # the fused int8 quantisers on these few rows too

    eager = BertWithHead(tiny_config.with_labels(["a", "b"]), "token")
    compiled = BertWithHead(tiny_config.with_labels(["a", "b"]), "token")
    weights = {name: tensor.clone() for name, tensor in eager.state_dict().items()}
    compiled.load_state_dict(weights)
    prepare_for_inference(eager, "fp32")
    prepare_for_inference(compiled, "fp32", compile=True)  # the default pack=True gives way to the compiler
    assert compiled.compiled and not eager.compiled  # what provenance() reports
    ids = torch.randint(5, 99, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = mask[2, 3:] = 0
    real = mask.bool()
    with torch.inference_mode():
        torch.testing.assert_close(compiled(ids, mask).logits[real], eager(ids, mask).logits[real], atol=1e-5, rtol=1e-5)
    if onednn_int8_available():  # int8: the quantisers are compiled, the int8 matmuls stay oneDNN's
        monkeypatch.setenv("BERT_ENGINE_INT8_KERNEL", "onednn")  # FBGEMM (AVX2's default) quantises in its own op
        int8 = BertWithHead(tiny_config.with_labels(["a", "b"]), "token")
        int8.load_state_dict(weights)
        int8_compiled = BertWithHead(tiny_config.with_labels(["a", "b"]), "token")
        int8_compiled.load_state_dict(weights)
        prepare_for_inference(int8, "int8")
        prepare_for_inference(int8_compiled, "int8", compile=True)
        assert "fused quantiser" in repr(int8_compiled)
        # what provenance() says (the threshold patched to 1 above)
        assert int8_compiled.compiled.startswith("int8 input quantisers, for batches of 1+ tokens")
        with torch.inference_mode():
            torch.testing.assert_close(int8_compiled(ids, mask).logits[real], int8(ids, mask).logits[real],
                                       atol=1e-4, rtol=1e-4)


def test_the_fused_int8_quantisers_give_the_eager_codes():
    from bert_engine.runtime.fast import Int8Linear, hadamard, one_sided_codes, symmetric_codes  # noqa: PLC0415

    torch.manual_seed(0)
    x = torch.randn(37, 64) * torch.linspace(0.1, 8, 64)  # channels of very different widths
    rotation = hadamard(16)
    rotated = (x.reshape(-1, 16) @ rotation).view_as(x)
    codes, scale, mid = symmetric_codes(x, None, rotation)
    expected, _, expected_scale, _ = Int8Linear._codes(rotated.clone())
    assert mid is None and codes.dtype == torch.uint8
    assert torch.equal(codes, expected.view(torch.uint8).add_(128)) and torch.equal(scale, expected_scale)
    gelu = torch.nn.functional.gelu(x)  # one-sided: FFN down's input
    codes, step, mid = one_sided_codes(gelu, None, None)
    expected, _, expected_step, expected_mid = Int8Linear._one_sided_codes(gelu.clone())
    assert (codes.int() - expected.view(torch.uint8).add_(128).int()).abs().max() <= 1
    torch.testing.assert_close(step, expected_step)
    torch.testing.assert_close(mid, expected_mid)


def test_compile_without_a_cpp_compiler_falls_back_to_eager_and_says_so(tiny_config, monkeypatch, caplog):
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    from bert_engine.runtime import fast  # noqa: PLC0415
    from bert_engine.runtime.fast import encoder_of  # noqa: PLC0415

    # the real search, not a stub: Inductor is told to look for a compiler that is not there
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++-compiler",))
    from torch._inductor import cpp_builder  # noqa: PLC0415

    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        assert fast.cpp_compiler() is None
        model = BertWithHead(tiny_config.with_labels(["a", "b"]), "token")
        with caplog.at_level("WARNING", logger="bert_engine.runtime.precision"):
            prepare_for_inference(model, "fp32", compile=True)
        assert "none was found" in caplog.text and "running without compile" in caplog.text
        assert not model.compiled and not isinstance(encoder_of(model).layers[0], torch._dynamo.eval_frame.OptimizedModule)
        ids = torch.randint(5, 99, (2, 9))
        with torch.inference_mode():
            assert model(ids, torch.ones_like(ids)).logits.shape == (2, 9, 2)  # it answers, uncompiled
        caplog.clear()
        from bert_engine import pipeline  # noqa: PLC0415 - pipeline(compile=) reaches the same decision

        with caplog.at_level("WARNING", logger="bert_engine.runtime.precision"):
            classify = pipeline("sentiment", precision="int8", compile=True)
        assert "running without compile" in caplog.text and not classify.predictor.provenance().get("compiled")
        assert classify("a fine film")[0]["label"] == "POSITIVE"  # it answers, uncompiled
    finally:
        monkeypatch.undo()
        cpp_builder.cpp_compiler_search.cache_clear()
    assert fast.cpp_compiler()  # this machine has one: found again once the setting is back


def test_the_provenance_is_worked_out_once_and_follows_the_model(monkeypatch):
    """provenance() keeps what it worked out while the model, precision and kernels stay as they were: a
    caller changing an answer's provenance changes no later one, and a model cast after loading is named."""
    monkeypatch.setenv("BERT_ENGINE_KERNELS", "packed")
    predictor = tiny_predictor(BUILTIN.task("sentiment"))
    prepare_for_inference(predictor.model)
    first = predictor.predict({"text": "a fine film"})["provenance"]
    assert first["dtype"] == "float32" and first["latency_ms"] >= 0 and first["kernels"]["qkv"] == "packed"
    first["dtype"] = "changed"
    first["kernels"]["qkv"] = "changed"
    again = predictor.provenance()
    assert again["dtype"] == "float32" and again["kernels"]["qkv"] == "packed"
    assert "latency_ms" not in again
    plain = tiny_predictor(BUILTIN.task("sentiment"))  # (packed weights cannot be cast)
    assert plain.provenance()["dtype"] == "float32"
    plain.model.to(torch.bfloat16)
    assert plain.provenance()["dtype"] == "bfloat16"
    plain.precision = "int8"
    assert plain.provenance()["dtype"] == "int8"


def test_overlapping_chunk_thread_settings_put_back_the_count_before_the_first():
    """A chunk that hands its turn back between layers runs on inside its thread setting while the next holder's
    starts: each putting back its own "before" left torch at the first one's half share once the other ended
    last. Now the count before the first comes back when the last ends, and threads_held says one is running
    (the playground does not read that count as a task's change)."""
    from bert_engine.runtime.inference import _threads, threads_held

    start = torch.get_num_threads()
    first, second = _threads(1), _threads(start)
    first.__enter__()
    assert torch.get_num_threads() == 1 and threads_held()
    second.__enter__()  # the next holder: its "before" is the first's 1
    first.__exit__(None, None, None)
    assert threads_held()
    second.__exit__(None, None, None)
    assert torch.get_num_threads() == start and not threads_held()
    with _threads(None):
        assert not threads_held()  # (None: as set, nothing held)


def test_a_chunk_in_one_thread_puts_its_own_thread_back_while_another_still_runs():
    """torch's thread count is per thread. A request's chunk (thread X, a half share) overlapped by another's (thread
    Y) kept X at the half share when it ended first (only the last block put a count back, in Y): the playground
    then blamed X's task for changing torch's thread count (the session-53 hostile-visitor audit)."""
    import threading

    from bert_engine.runtime.inference import _threads

    start = torch.get_num_threads()
    if start < 2:
        pytest.skip("one thread: no half share to take")
    x_in, y_in, x_out, y_out = (threading.Event() for _ in range(4))
    seen = {}

    def x():
        with _threads(1):
            x_in.set()
            y_in.wait(10)
        seen["x after"] = torch.get_num_threads()
        x_out.set()

    def y():
        x_in.wait(10)
        with _threads(1):
            y_in.set()
            x_out.wait(10)
            seen["y inside"] = torch.get_num_threads()
        y_out.set()

    threads = [threading.Thread(target=x), threading.Thread(target=y)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"x after": start, "y inside": 1}


def test_a_build_head_that_returns_no_module_is_named_at_load(tmp_path):
    """A plugin's build_head returned a plain function: it loaded, and every request then failed in postprocess
    with "'NoneType' object is not iterable" (the session-52 plugin audit). Now the load says what is wrong."""
    from conftest import reference_checkpoint

    from bert_engine import PRESETS
    from bert_engine.runtime.inference import Predictor

    with pytest.raises(TypeError, match="a head must be an nn.Module .*got function"):
        BertWithHead(PRESETS["tiny"], lambda encoded: encoded.pooled)

    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            register(TaskSpec(name="lam", title="L", build_head=lambda config: (lambda encoded: encoded.pooled),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {}))

    registry = load_registry(entry_points=False)
    assert registry.load_plugin("lam", "0.1", "test", Plugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertForSequenceClassification", id2label={0: "A", 1: "B"}))
    with pytest.raises(TypeError, match="a head must be an nn.Module"):
        Predictor.load(registry.task("lam"), tiny)
