"""Sentiment: parity with the transformers text-classification pipeline, long input, batches, Hub."""

import math

import pytest
import torch
import transformers
from conftest import SENTENCES, reference_checkpoint

from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins.sentiment import calibration, classify_many, expected_calibration_error

REVIEWS = [
    "a gorgeous , witty , seductive movie .",
    "the plot is predictable and the acting is wooden .",
    "it 's not bad , but i would n't watch it again .",
    "Ünïcödé and emoji 🤗 in a review: 北京 too!",
] + SENTENCES


def _ranked(output):
    """The pipeline's ranked list for one input (some versions wrap it in an outer list)."""
    return output[0] if output and isinstance(output[0], list) else output


@pytest.fixture(scope="module")
def task():
    return load_registry(entry_points=False).task("sentiment")


@pytest.fixture(scope="module", params=[
    {"id2label": {0: "NEGATIVE", 1: "POSITIVE"}},
    {"id2label": {i: f"{i + 1} stars" for i in range(5)}},
    {"id2label": {0: "joy", 1: "anger", 2: "fear"}, "problem_type": "multi_label_classification"},
], ids=["binary", "five-stars", "multi-label"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentiment")
    return reference_checkpoint(folder, "BertForSequenceClassification", **request.param)


def test_matches_the_reference_pipeline(task, checkpoint):
    predictor = Predictor.load(task, str(checkpoint))
    pipeline = transformers.pipeline("text-classification", model=str(checkpoint), top_k=None)
    for text in REVIEWS:
        ours = predictor.predict({"text": text})["result"]
        theirs = _ranked(pipeline(text))
        assert [item["label"] for item in ours["labels"]] == [item["label"] for item in theirs]
        for mine, ref in zip(ours["labels"], theirs):
            assert mine["score"] == pytest.approx(ref["score"], abs=1e-5)
        assert ours["label"] == theirs[0]["label"]


def test_pairs_match_the_reference_pipeline(task, tmp_path):
    folder = reference_checkpoint(tmp_path, "BertForSequenceClassification",
                                  id2label={0: "entailment", 1: "neutral", 2: "contradiction"})
    predictor = Predictor.load(task, str(folder))
    pipeline = transformers.pipeline("text-classification", model=str(folder), top_k=None)
    premise, hypothesis = "A man is playing a guitar on stage.", "Someone is making music."
    ours = predictor.predict({"text": premise, "text_pair": hypothesis})["result"]
    theirs = _ranked(pipeline({"text": premise, "text_pair": hypothesis}))
    for mine, ref in zip(ours["labels"], theirs):
        assert (mine["label"], mine["score"]) == (ref["label"], pytest.approx(ref["score"], abs=1e-5))


def test_top_k_and_function(task, checkpoint):
    predictor = Predictor.load(task, str(checkpoint))
    result = predictor.predict({"text": REVIEWS[0]}, top_k=1)["result"]
    assert len(result["labels"]) == 1 and not result["normalised"]
    raw = predictor.predict({"text": REVIEWS[0]}, function="none")["result"]
    assert raw["function"] == "none"
    with pytest.raises(InputError, match="top_k must be a positive integer or None, got 0"):
        predictor.predict({"text": "x"}, top_k=0)
    with pytest.raises(InputError, match="function 'tanh' is not one of"):
        predictor.predict({"text": "x"}, function="tanh")


def test_long_input_is_never_cut_silently(task, checkpoint):
    predictor = Predictor.load(task, str(checkpoint))
    long_text = " ".join(REVIEWS * 120)
    cut = predictor.predict({"text": long_text})["result"]["long_input"]
    assert cut == {"policy": "truncate", "windows": 1, "truncated": True}
    windows = predictor.predict({"text": long_text}, long_input="windows", max_length=128, stride=32)["result"]
    assert windows["long_input"]["windows"] > 10 and not windows["long_input"]["truncated"]
    short = predictor.predict({"text": REVIEWS[0]}, long_input="windows")["result"]["long_input"]
    assert short == {"policy": "windows", "windows": 1, "truncated": False}


def test_classify_many_keeps_order_and_equals_single_predictions(task, checkpoint):
    predictor = Predictor.load(task, str(checkpoint))
    texts = REVIEWS * 3
    many = classify_many(predictor, texts, batch_size=4)
    singles = [predictor.predict({"text": t})["result"] for t in texts]
    for a, b in zip(many, singles):
        assert a["label"] == b["label"] and a["score"] == pytest.approx(b["score"], abs=1e-5)
    with pytest.raises(InputError, match=r"inputs\[1\]: the text is empty"):
        classify_many(predictor, ["fine", "  "])


def test_loads_from_a_hub_id_served_locally(task, checkpoint, fake_hub, tmp_path):
    fake_hub.repos[("owner/sentiment", "main")] = checkpoint
    hub = Predictor.load(task, "owner/sentiment", endpoint=fake_hub.endpoint, cache_dir=tmp_path / "cache")
    local = Predictor.load(task, str(checkpoint))
    a, b = hub.predict({"text": REVIEWS[1]}), local.predict({"text": REVIEWS[1]})
    assert a["result"] == b["result"]
    assert a["provenance"]["model"] == "owner/sentiment" and len(a["provenance"]["revision"]) == 40


def test_minilm_encoder_with_a_fresh_head(task, minilm_dir):
    predictor = Predictor.load(task, str(minilm_dir))  # the bare backbone: no trained head, said in the provenance
    output = predictor.predict({"text": "A fine film."})
    assert output["provenance"]["untrained_head"] is True
    assert [item["label"] for item in output["result"]["labels"]] in (["NEGATIVE", "POSITIVE"], ["POSITIVE", "NEGATIVE"])
    assert sum(item["score"] for item in output["result"]["labels"]) == pytest.approx(1.0, abs=1e-5)


def test_metric_and_reader(task, tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("sentence\tlabel\ngood film \t1\nbad film \t0\n")
    rows = list(task.spec.read_data(path))
    assert rows == [({"text": "good film"}, 1), ({"text": "bad film"}, 0)]
    assert task.spec.metric([{"label_id": 1}, {"label_id": 1}], [1, 0]) == {"accuracy": 0.5, "macro_f1": pytest.approx((0 + 2 / 3) / 2)}


def test_temperature_divides_the_logits_and_is_checked(task, checkpoint):
    predictor = Predictor.load(task, str(checkpoint))
    plain = predictor.predict({"text": REVIEWS[0]})["result"]
    warm = predictor.predict({"text": REVIEWS[0]}, temperature=2.0)["result"]
    function = {"softmax": torch.softmax, "sigmoid": lambda x, dim: torch.sigmoid(x)}[plain["function"]]
    expected = function(torch.tensor(plain["logits"]) / 2.0, dim=-1)
    assert warm["label"] == plain["label"] and warm["logits"] == plain["logits"] and warm["temperature"] == 2.0
    for item in warm["labels"]:
        assert item["score"] == pytest.approx(float(expected[predictor.model.head.labels.index(item["label"])]), abs=1e-5)
    for bad in (0, -1.0, "hot", True, 50):
        with pytest.raises(InputError, match=f"temperature must be a number in \\[0.05, 20\\], got {bad!r}"):
            predictor.predict({"text": "x"}, temperature=bad)


def test_calibration_fits_the_temperature_on_one_half_and_scores_the_other():
    # Over-confident logits: the true class wins 75 % of the time, at logit gaps of 4 (98 % confidence).
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 2, (2000,), generator=g)
    right = torch.rand(2000, generator=g) < 0.75
    predicted = torch.where(right, targets, 1 - targets)
    logits = torch.nn.functional.one_hot(predicted, 2).float() * 4.0
    figures = calibration(logits, targets, 1.0)
    assert figures["ece"] == pytest.approx(0.98 - 0.75, abs=0.03)
    assert figures["tuned_temperature"] == pytest.approx(4.0 / math.log(0.75 / 0.25), rel=0.1)  # conf. 75 %
    assert figures["heldout_ece"] < 0.03 < figures["heldout_ece_at_1"]
    assert figures["heldout_nll"] < figures["heldout_nll_at_1"] and figures["heldout_total"] == 1000
    assert expected_calibration_error(torch.tensor([[0.0, 9.0], [9.0, 0.0]]), torch.tensor([1, 0])) < 1e-3


def test_a_fresh_head_saves_its_label_names_for_the_reference(task, minilm_dir, tmp_path):
    # MiniLM's config has no labels; the task head starts with its defaults, and a saved model
    # must carry those names so transformers (and a later load) reads NEGATIVE/POSITIVE, not LABEL_0/1.
    from bert_engine.checkpoints.loader import load
    from bert_engine.checkpoints.loading import save_pretrained

    model, tokenizer = load(minilm_dir, task.spec.build_head)
    assert not model.config.id2label
    save_pretrained(model, tmp_path, tokenizer)
    reference = transformers.AutoConfig.from_pretrained(tmp_path)
    assert reference.id2label == {0: "NEGATIVE", 1: "POSITIVE"}


def test_a_pair_whose_first_text_cannot_fit_a_window_is_the_users_error_not_a_bug():
    from bert_engine import pipeline

    classify = pipeline("sentiment")
    with pytest.raises(InputError, match="the first must fit in one window of 512 tokens"):
        classify({"text": "a " * 300_000, "text_pair": "b " * 300_000}, long_input="windows")
    assert classify({"text": "a fine film", "text_pair": "b " * 3000}, long_input="windows")[0]["label"]


def test_a_line_longer_than_csvs_field_limit_is_named(tmp_path):
    from plugins.sentiment import read_data

    data = tmp_path / "long.tsv"
    data.write_text("sentence\tlabel\nshort\t1\n" + "w " * 70000 + "\t1\n")
    with pytest.raises(ValueError, match="long.tsv:3: field larger than field limit"):
        list(read_data(data))
