"""No single request can cost unbounded time or memory: the slow requests of the hardening review are
refused up front (InputError naming the figure) or run in bounded time, and the user is blamed only
for the user's input."""

import math
import time

import gradio as gr
import pytest
import torch
from conftest import assert_cpu_goes_quiet, reference_checkpoint

from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor, max_request_tokens, row_flops
from bert_engine.tasks.conformance import tiny_predictor
from bert_engine.tasks.registry import Registry, load_registry
from playground.app import guarded
from plugins.summary import mmr_select

REGISTRY = load_registry(entry_points=False)


def _plain_mmr(scores, embeddings, candidates, k, lam):
    """The textbook loop, as the summary plugin ran it before (O(k^2 S) in Python)."""
    unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    similarity = unit @ unit.T
    chosen, remaining = [], list(candidates)
    while remaining and len(chosen) < k:
        def gain(i):
            return lam * float(scores[i]) - (1 - lam) * max((float(similarity[i, j]) for j in chosen), default=0.0)
        best = max(remaining, key=gain)
        chosen.append(best)
        remaining.remove(best)
    return chosen


def test_mmr_chooses_as_the_plain_loop_did_ties_included():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 30, (), generator=generator))
        embeddings = torch.randn(n, 6, generator=generator)
        if trial % 3 == 0:
            embeddings[n // 2:] = embeddings[0]  # duplicate sentences: tied gains
        scores = torch.rand(n, generator=generator)
        if trial % 4 == 0:
            scores = torch.round(scores * 2) / 2
        candidates = sorted(torch.randperm(n, generator=generator)[:max(1, n - 2)].tolist())
        k, lam = int(torch.randint(1, n + 1, (), generator=generator)), float(torch.rand((), generator=generator))
        assert mmr_select(scores, embeddings, candidates, k, lam) == _plain_mmr(scores, embeddings, candidates, k, lam)


def test_mmr_over_2000_sentences_is_fast():
    embeddings, scores = torch.randn(2000, 384), torch.rand(2000)
    start = time.perf_counter()
    chosen = mmr_select(scores, embeddings, list(range(2000)), 600, 0.7)
    assert len(set(chosen)) == 600
    assert time.perf_counter() - start < 10  # a bound, not a benchmark: the plain loop took over 460 s


def test_a_summary_of_2000_sentences_finishes_in_bounded_time():
    predictor = tiny_predictor(REGISTRY.task("summary"))
    text = " ".join(f"Sentence number {i} talks about topic {i % 17} in some detail." for i in range(2000))
    start = time.perf_counter()
    result = predictor.predict({"text": text}, mode="centroid")["result"]
    assert len(result["sentences"]) == 2000  # every sentence is listed, the chosen ones marked
    assert sum(s["selected"] for s in result["sentences"]) == math.ceil(0.3 * 2000)  # ratio 0.3, none too short
    assert time.perf_counter() - start < 120


@pytest.mark.parametrize("targets, message", [
    ([f"word{i}" for i in range(2000)], "2,000 target words; at most 100"),
    (["the " * 600], "is 600 word pieces; at most 8"),
])
def test_fill_mask_targets_are_bounded_and_blamed_on_the_input(targets, message):
    predictor = tiny_predictor(REGISTRY.task("fill_mask"))
    with pytest.raises(InputError, match=message):
        predictor.predict({"text": "The capital of France is [MASK]."}, targets=targets)


def test_fill_mask_batched_targets_equal_one_at_a_time():
    predictor = tiny_predictor(REGISTRY.task("fill_mask"))
    text = "The capital of France is [MASK], on the Seine."
    words = ["paris", "london", "antidisestablishmentarianism", "new york", "x"]
    together = {c["word"]: c["log_score"] for c in predictor.predict({"text": text}, targets=words)["result"]["candidates"]}
    for word in words:
        alone = predictor.predict({"text": text}, targets=[word])["result"]["candidates"][0]["log_score"]
        assert together[word] == pytest.approx(alone, abs=1e-5)


@pytest.mark.parametrize("inputs", [
    {"text": "good movie. " * 83_000},
    {"text": "good movie. " * 41_000, "pair": "bad film. " * 50_000},
])
def test_a_megabyte_with_windows_is_refused_before_any_forward(inputs):
    predictor = tiny_predictor(REGISTRY.task("sentiment"))
    start = time.perf_counter()
    with pytest.raises(InputError, match=f"the limit per request is {max_request_tokens():,} tokens"):
        predictor.predict(inputs, long_input="windows")
    assert time.perf_counter() - start < 30  # tokenising only (it was a 60 s forward)


def test_the_bound_is_per_input_in_a_batch():
    predictor = tiny_predictor(REGISTRY.task("sentiment"))
    from bert_engine.runtime.inference import check_request_cost

    batch = predictor.tokenizer(["short", "long " * 2000], max_length=64, stride=8, return_overflowing=True)
    check_request_cost("sentiment", batch, limit=3000)  # each input alone fits
    with pytest.raises(InputError, match="inputs\\[1\\] needs .* window"):
        check_request_cost("sentiment", batch, limit=1000)


def test_a_checkpoint_with_64_positions_answers_long_input(tmp_path):
    folder = reference_checkpoint(tmp_path / "short", "BertForSequenceClassification", max_position_embeddings=64,
                                  id2label={0: "NEG", 1: "POS"})
    predictor = Predictor.load(REGISTRY.task("sentiment"), str(folder))
    assert predictor.tokenizer.model_max_length == 64
    long_text = "a fine film with a plot. " * 100
    assert predictor.predict({"text": long_text})["result"]["long_input"]["truncated"]
    assert predictor.predict({"text": long_text}, long_input="windows")["result"]["long_input"]["windows"] > 1


def test_a_cut_off_forward_pass_stops_and_frees_the_model():
    registry = Registry()
    registry.tasks = dict(REGISTRY.tasks)
    predictor = tiny_predictor(REGISTRY.task("summary"))
    call = guarded(predictor.predict, "summary", registry, 0.3)
    text = " ".join(f"Sentence {i} is about subject {i % 23} and more." for i in range(2000))
    with pytest.raises(gr.Error, match="cut off"):
        call({"text": text})
    start = time.monotonic()
    predictor.forward_rows(predictor.tokenizer("hello").model_inputs())  # takes the model's lock
    assert time.monotonic() - start < 10, "the cancelled request kept the model's lock"
    assert_cpu_goes_quiet()


def _gflop_needed(predictor, inputs, **options) -> float:
    """The work check_cost counts for `inputs` through `predictor`'s model, in GFLOP."""
    batch = predictor.task.spec.preprocess(inputs, predictor.tokenizer, **predictor.check_options(options))
    return predictor.check_cost(batch) / 1e9


def test_the_bound_is_work_through_the_model_not_tokens(tmp_path, monkeypatch):
    """The same text under the same token limit: refused through a model with twice the layers where the
    smaller one answers, the message naming the work, the limit and its setting; nothing runs."""
    text = {"text": "a fine film with a plot. " * 40}
    small = Predictor.load(REGISTRY.task("sentiment"), str(reference_checkpoint(
        tmp_path / "two", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"})))
    deep = Predictor.load(REGISTRY.task("sentiment"), str(reference_checkpoint(
        tmp_path / "four", "BertForSequenceClassification", num_hidden_layers=4, id2label={0: "NEG", 1: "POS"})))
    needed_small, needed_deep = _gflop_needed(small, dict(text)), _gflop_needed(deep, dict(text))
    assert needed_deep == pytest.approx(2 * needed_small, rel=0.05)
    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", str((needed_small + needed_deep) / 2))
    assert small.predict(dict(text))["result"]["label"] in ("NEG", "POS")
    calls = []
    deep.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(InputError, match=r"sentiment: the input needs 1 window\(s\) with \d+ tokens in all, .* GFLOP "
                                         r"of work through this model .*the limit per request is .* GFLOP \(BERT_ENGINE_MAX_GFLOP\)"):
        deep.predict(dict(text))
    assert calls == []


def test_the_work_bound_is_per_input_in_a_batch(monkeypatch):
    predictor = tiny_predictor(REGISTRY.task("sentiment"))
    from bert_engine.runtime.inference import check_request_cost

    batch = predictor.tokenizer(["short", "long " * 2000], max_length=64, stride=8, return_overflowing=True)
    encoder = predictor.model.encoder
    work = check_request_cost("sentiment", batch, model=encoder, max_flops=1e15)
    long_alone = work - check_request_cost("sentiment", predictor.tokenizer("short"), model=encoder)
    check_request_cost("sentiment", batch, model=encoder, max_flops=long_alone * 1.01)  # each input alone fits
    with pytest.raises(InputError, match="inputs\\[1\\] needs .* GFLOP of work"):
        check_request_cost("sentiment", batch, model=encoder, max_flops=long_alone * 0.99)


def test_a_joint_search_past_the_work_bound_is_refused_before_any_pass(monkeypatch):
    """fill-mask's joint search re-encodes the text once per beam for each mask after the first: counted
    in FLOPs through the model before the first of those passes runs."""
    predictor = tiny_predictor(REGISTRY.task("fill_mask"))
    text = {"text": "The [MASK] sat on the [MASK] near the [MASK] of the [MASK] house."}
    options = {"mode": "joint", "beam_width": 16}
    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", str(_gflop_needed(predictor, dict(text), **options) * 20))
    assert predictor.predict(dict(text), mode="joint", beam_width=2)["result"]["mode"] == "joint"
    passes = []
    predictor.model.register_forward_pre_hook(lambda *args: passes.append(1))
    encoder_passes = []
    predictor.model.encoder.register_forward_pre_hook(lambda *args: encoder_passes.append(1))
    with pytest.raises(InputError, match=r"mode joint over 4 masks \(16 beams .*BERT_ENGINE_MAX_GFLOP"):
        predictor.predict(dict(text), **options)
    assert len(passes) == 1 and len(encoder_passes) == 1  # the request's own forward, no pass of the search


def test_a_joint_search_refused_in_a_list_names_its_input(monkeypatch):
    """In a list of texts (one batch, one postprocess), the joint search past the bound was refused naming the
    search alone; now it names which text of the caller's list, as a request limit does."""
    from bert_engine.serving.pipeline import Pipeline

    predictor = tiny_predictor(REGISTRY.task("fill_mask"))
    many = "The [MASK] sat on the [MASK] near the [MASK] of the [MASK] house."
    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", str(_gflop_needed(predictor, {"text": many}, mode="joint",
                                                                   beam_width=16) * 20))
    fill = Pipeline(predictor, raw=True, mode="joint", beam_width=16)
    texts = ["A [MASK] day.", "The [MASK] is [MASK].", many, "One [MASK]."]
    with pytest.raises(InputError, match=r"^fill_mask: inputs\[2\]: mode joint over 4 masks \(16 beams"):
        fill(texts)
    assert len(fill(texts[:2] + texts[3:])) == 3


def test_a_postprocess_pass_past_the_work_bound_is_refused_before_it_runs(monkeypatch):
    """A task's postprocess that re-encodes without checking first (a third-party plugin) is stopped at the
    pass that would take the request past its bound, before that pass runs."""
    from bert_engine.runtime.inference import REQUEST_WORK

    predictor = tiny_predictor(REGISTRY.task("fill_mask"))
    inputs = predictor.tokenizer(["word " * 100] * 8).model_inputs()
    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", "1")
    assert REQUEST_WORK.get() is None
    predictor._encode(inputs)  # outside a request: not charged
    from bert_engine.runtime.inference import RequestWork

    token = REQUEST_WORK.set(RequestWork("fill_mask", limit=1e9))
    try:
        runs = []
        predictor.model.encoder.register_forward_pre_hook(lambda *args: runs.append(1))
        with pytest.raises(InputError, match="fill_mask: the task's further passes would bring this input's work"):
            for _ in range(1000):
                predictor._encode(inputs)
        rows, length = inputs["input_ids"].shape
        per_pass = rows * row_flops(predictor.model.encoder, length)
        assert len(runs) == int(1e9 // per_pass) > 0  # every pass that fits ran, the next did not
        assert REQUEST_WORK.get().used == pytest.approx(per_pass * len(runs))
    finally:
        REQUEST_WORK.reset(token)


def test_one_inputs_search_may_not_take_its_batchs_other_shares(monkeypatch):
    """A batch of inputs (a Space merges visitors' requests) may do each input's share of work after its forward
    pass; a search checked for one input (context.check_work) may not use the others' shares."""
    from bert_engine.runtime.inference import RequestWork

    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", "1")
    work = RequestWork("fill_mask", limit=3e9)  # three inputs' shares
    work.check(0.9e9)
    with pytest.raises(InputError, match="the limit per input is 1 GFLOP"):
        work.check(1.5e9)  # within the batch's 3 GFLOP, past one input's 1
    for _ in range(3):
        work.charge(0.9e9)  # passes of several inputs add up to the batch's shares
    with pytest.raises(InputError):
        work.charge(0.9e9)


def test_a_list_or_stream_names_the_input_past_the_limit_after_the_answers_before_it(monkeypatch):
    """A request limit met by one input of a list (pipeline, predict_in_batches) names its place in the list; a
    stream answers the inputs before it first."""
    from bert_engine.serving.pipeline import Pipeline

    predictor = tiny_predictor(REGISTRY.task("sentiment"))
    monkeypatch.setenv("BERT_ENGINE_MAX_TOKENS", "600")
    classify = Pipeline(predictor, long_input="windows")
    texts = ["good", "bad", "great movie. " * 300, "fine"]
    with pytest.raises(InputError, match="^sentiment: inputs\\[2\\]: needs .* tokens in all; the limit per request is 600 "
                                         ".*Shorten the text, or read its start alone \\(long_input='truncate'\\)$"):
        classify(texts)
    answered = []
    with pytest.raises(InputError, match="^sentiment: inputs\\[2\\]: needs"):
        for answer in classify(iter(texts)):
            answered.append(answer)
    assert len(answered) == 2
    # each task's refusal says what its caller can do: QA has no truncation to point to (it said "or truncate it if
    # the task offers that"; session 58's fresh-clone trial)
    assert tiny_predictor(REGISTRY.task("qa")).cost_remedy() == "Shorten the context to the part that matters"
    assert tiny_predictor(REGISTRY.task("ner")).cost_remedy() == "Shorten the text"


@pytest.mark.parametrize("value, message", [("abc", "must be a number"), ("nan", "must be a finite number"),
                                            ("inf", "must be a finite number"), ("-5", "must not be negative")])
def test_a_bad_work_limit_fails_the_load_naming_the_setting(monkeypatch, value, message):
    """Not every request later, blamed on the task's plugin (the playground's model loads at start)."""
    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", value)
    with pytest.raises(ValueError, match=f"BERT_ENGINE_MAX_GFLOP {message}"):
        Predictor.load(REGISTRY.task("sentiment"), "plugins/starter/sentiment")
