"""The committed starter pack: every model loads (adapter + head on the MiniLM base) and makes real
predictions that an untrained head would not make, offline."""

import json
import re
from pathlib import Path

import pytest

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins.starter import STARTER_ROOT

PACKED = sorted(p.name for p in STARTER_ROOT.iterdir() if (p / "manifest.json").is_file()) if STARTER_ROOT.is_dir() else []


@pytest.fixture(scope="module")
def registry():
    return load_registry(entry_points=False)


def _predictor(registry, task):
    spec = registry.task(task).spec
    assert spec.default_checkpoint == str(STARTER_ROOT / task)  # the tab's default, no configuration needed
    predictor = Predictor.load(registry.task(task))
    assert predictor.untrained_head is False
    return predictor


def test_the_pack_is_small_and_documented():
    assert "sentiment" in PACKED
    for task in PACKED:
        folder = STARTER_ROOT / task
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["task"] == task and manifest["base_model"] == "default" and len(manifest["base_sha256"]) == 64
        assert manifest["metrics"] and manifest["command"].startswith("bert-engine train")
        assert sum(p.stat().st_size for p in folder.iterdir()) < 4_000_000


@pytest.mark.skipif("sentiment" not in PACKED, reason="no sentiment starter model packed")
def test_sentiment_starter(registry):
    from plugins.sentiment import EXAMPLES

    predictor = _predictor(registry, "sentiment")
    labels = [predictor.predict(example)["result"]["label"] for example in EXAMPLES]  # the tab's examples
    assert labels == ["POSITIVE", "NEGATIVE", "POSITIVE"]
    assert predictor.predict({"text": "I loved every minute of this wonderful film."})["result"]["score"] > 0.9


@pytest.mark.skipif("ner" not in PACKED, reason="no NER starter model packed")
def test_ner_starter(registry):
    predictor = _predictor(registry, "ner")
    text = "Angela Merkel met Emmanuel Macron in Paris on Monday."
    entities = {(e["text"], e["type"]) for e in predictor.predict({"text": text})["result"]["entities"]}
    assert ("Angela Merkel", "PER") in entities and ("Paris", "LOC") in entities


@pytest.mark.skipif("qa" not in PACKED, reason="no QA starter model packed")
def test_qa_starter(registry):
    predictor = _predictor(registry, "qa")
    context = "The Eiffel Tower is a wrought-iron tower in Paris. It was completed in 1889 for the World's Fair."
    result = predictor.predict({"question": "When was the Eiffel Tower completed?", "context": context})["result"]
    assert "1889" in result["answer"]
    from plugins.qa import EXAMPLES  # the tab's: two answerable, one not (the calibrated threshold says so)

    answers = [predictor.predict(example)["result"]["answer"] for example in EXAMPLES]
    assert "cloud" in answers[0] and "Herman Melville" in answers[1] and answers[2] is None


@pytest.mark.skipif("qa" not in PACKED, reason="no QA starter model packed")
def test_a_span_far_behind_no_answer_keeps_a_probability_above_0(registry):
    # six decimals made every span of an unanswerable question 0.0 (an outside test); six significant digits now
    predictor = _predictor(registry, "qa")
    result = predictor.predict({"question": "Who is the president?", "context": "Florida is a state."},
                               top_k=3, no_answer="never")["result"]
    assert result["answers"] and all(0 < a["score"] < 1e-3 for a in result["answers"]), result["answers"]
    assert 0 < result["no_answer"]["score"] <= 1


@pytest.mark.skipif("summary" not in PACKED, reason="no summary starter model packed")
def test_summary_starter(registry):
    from plugins.summary import read_data, rouge

    predictor = _predictor(registry, "summary")
    fixture = Path(__file__).parent / "fixtures" / "bbc_tiny.jsonl"
    scores = []
    for inputs, target in read_data(fixture, "all"):
        result = predictor.predict(inputs, num_sentences=2)["result"]
        assert result["mode"] == "hybrid"  # auto, with a trained scorer
        scores.append(rouge([result["summary"]], [target["summary"]])["rouge2"])
    assert sum(scores) / len(scores) > 30  # a random scorer picks about 2 of 7 sentences at random
    # the tab's examples have no headline: their lead is sentence 0, which a scorer trained with BBC's
    # headlines in its rows learned to drop (the storm example lost "cutting power to 40,000 homes")
    from plugins.summary import EXAMPLES
    for example in EXAMPLES:
        result = predictor.predict(example)["result"]
        assert result["lead"] == 0 and 0 in result["selected"], example["text"][:40]


@pytest.mark.skipif("summary" not in PACKED, reason="no summary starter model packed")
def test_a_summary_splits_each_article_into_sentences_once(registry, monkeypatch):
    # the hybrid default's second pass (each sentence alone, for the centroid) reuses the first pass's sentences:
    # splitting again cost a tenth of a request's time, for the same spans
    import plugins.summary as summary

    predictor = _predictor(registry, "summary")
    text = summary.EXAMPLES[0]["text"]
    expected = predictor.predict({"text": text})["result"]
    calls = []
    monkeypatch.setattr(summary, "split_sentences", lambda t: calls.append(t) or summary_split(t))
    for mode in ("auto", "centroid", "hybrid", "supervised"):
        calls.clear()
        result = predictor.predict({"text": text}, mode=mode)["result"]
        assert calls == [text], mode
        if mode == "auto":
            assert result == expected and result["mode"] == "hybrid"


def summary_split(text):
    from plugins.sentences import split_sentences

    return split_sentences(text)


@pytest.mark.skipif("fill_mask" not in PACKED, reason="no fill-mask starter model packed")
def test_fill_mask_starter(registry):
    from scripts.fill_mask_probes import PROBES

    predictor = _predictor(registry, "fill_mask")
    result = predictor.predict({"text": "She opened the [MASK] and walked into the garden."})["result"]
    assert result["predictions"][0]["candidates"][0]["token"] == "door"
    # The thirty everyday cloze sentences (scripts/fill_mask_probes.py, written before any pack was scored): the
    # session-27 pack has 11 in its top five, the two before it 10 and 12. ("Once upon a [MASK]" lost "time" in
    # that pack, which this test checked before: MODEL_CARD.md says so.)
    found = sum(expected in [c["token"] for c in predictor.predict({"text": text})["result"]["predictions"][0]["candidates"]]
                for text, expected in PROBES)
    assert found >= 9, found


def test_the_fill_mask_tabs_one_mask_examples_are_answered_right_by_the_starter(registry):
    from plugins.fill_mask import EXAMPLES, STARTER_NOTE

    predictor = Predictor.load(registry.task("fill_mask"))
    expected = {"The capital of France is [MASK].": "paris", "A week has seven [MASK].": "days",
                "She drank a cup of hot [MASK].": "tea"}
    for example in EXAMPLES:
        if example["text"].count("[MASK]") == 1:
            first = predictor.predict(example)["result"]["predictions"][0]["candidates"][0]["token"]
            assert first == expected[example["text"]], (example, first)
    assert "all-MiniLM-L6-v2" in STARTER_NOTE


def test_another_tasks_starter_is_refused_naming_the_task_it_is_for(registry):
    """An NER adapter picked for sentiment (a visitor's model picker): the refusal says which task the folder is
    for, not only which tensors are missing or unexpected."""
    from bert_engine.checkpoints.loading import CheckpointError

    folder = STARTER_ROOT / "ner"
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(folder))}: a model of task 'ner' \\(its manifest.json\\), "
                                              "which does not fit the head asked for: load it with its task \\(its tab in the playground, pipeline\\('ner'"):
        Predictor.load(registry.task("sentiment"), str(folder))


def test_a_manifest_option_the_task_refuses_is_named_with_its_file(registry, tmp_path):
    """A packed model whose manifest.json holds an option value the task refuses fails at load naming that file
    (every request failed, naming an option its caller never gave)."""
    import shutil

    from bert_engine.checkpoints.loading import CheckpointError

    folder = tmp_path / "sentiment"
    shutil.copytree(STARTER_ROOT / "sentiment", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["options"] = {**manifest.get("options", {}), "temperature": -5}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(folder / 'manifest.json'))}: its \"options\" hold a "
                                              "value task 'sentiment' refuses \\(sentiment: temperature must be"):
        Predictor.load(registry.task("sentiment"), str(folder))
