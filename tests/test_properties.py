"""Property-based tests: every task's preprocess -> model -> postprocess on arbitrary input.

Nothing may raise anything but InputError (the documented input error), and every character span
a result reports lies inside its text and, where the result quotes it, equals the text there.
Tiny random models with MiniLM's real tokenizer keep each example fast.

Examples per task: 30 in the default suite; a dedicated run sets BERT_ENGINE_FUZZ_EXAMPLES:

    BERT_ENGINE_FUZZ_EXAMPLES=10000 python -m pytest tests/test_properties.py -p no:cacheprovider \
        --hypothesis-show-statistics -q
"""

import os
from pathlib import Path

import pytest
import torch
from conftest import reference_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry

EXAMPLES = int(os.environ.get("BERT_ENGINE_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Pieces real users and attackers paste: specials as literals, controls, zero-width and bidi marks,
# RTL scripts, emoji sequences, combining marks on their own, lone surrogates, markup, CRLF.
PIECES = [
    "hello", "World", "New York", "Ada Lovelace", "Mr.", "3.14", "U.S.", "e.g.", ".", "?", "!", ",", "'", '"',
    "[MASK]", "[SEP]", "[CLS]", "[PAD]", "[UNK]", "[mask]", "##ing", " ", "  ", "\t", "\n", "\r\n", "\n\n",
    "\x00", "\x07", "\x1b[31m", "\x7f", "\x85", "\u2028", "\u200b", "\u200c", "\u200d", "\u200e", "\u202e",
    "\u2066", "\ufeff", "\ufffd", "\u00ad", "مرحبا بالعالم", "שלום", "北京大学", "こんにちは", "한국어", "ǅ", "ﬁ", "Å",
    "e\u0301", "\u0301\u0301\u0301", "\u0e01\u0e34\u0e4a", "🤗", "👩‍👩‍👧", "🇫🇷", "🏳️‍🌈", "\ud800", "\udfff",
    "<script>alert(1)</script>", "&amp;", "{}", "%s", "\\", "a" * 300,
]
TEXTS = st.one_of(
    st.text(st.characters(codec=None), max_size=200),  # arbitrary code points (hypothesis's own mix)
    st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=25).map(" ".join),
    st.sampled_from(["", " ", "\n\t ", "\u200b\u200b", "[MASK]", "[MASK] [MASK] [MASK]", "[SEP][CLS][PAD]",
                     "One sentence.", "\x00" * 10, "\ud800"]),
)


@pytest.fixture(scope="module")
def predictors(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    checkpoints = {
        "sentiment": reference_checkpoint(root / "sentiment", "BertForSequenceClassification"),
        "ner": reference_checkpoint(root / "ner", "BertForTokenClassification",
                                    id2label={0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}),
        "qa": reference_checkpoint(root / "qa", "BertForQuestionAnswering"),
        "fill_mask": reference_checkpoint(root / "mlm", "BertForMaskedLM"),
        "summary": reference_checkpoint(root / "summary", "BertModel"),
    }
    registry = load_registry(entry_points=False)
    return {name: Predictor.load(registry.task(name), str(folder)) for name, folder in checkpoints.items()}


def check_spans(result, text: str, path: str = "result") -> int:
    """Every dict with integer start/end lies inside `text` and quotes it correctly; returns how many."""
    count = 0
    if isinstance(result, dict):
        if isinstance(result.get("start"), int) and isinstance(result.get("end"), int):
            start, end = result["start"], result["end"]
            assert 0 <= start <= end <= len(text), f"{path}: span ({start}, {end}) outside a text of {len(text)}"
            for key in ("text", "word", "answer"):
                if isinstance(result.get(key), str):
                    assert result[key] == text[start:end], f"{path}.{key} {result[key]!r} != {text[start:end]!r}"
            count += 1
        for key, value in result.items():
            count += check_spans(value, text, f"{path}.{key}")
    elif isinstance(result, list):
        for i, value in enumerate(result):
            count += check_spans(value, text, f"{path}[{i}]")
    return count


def run(predictor, inputs, text):
    """Predict; InputError is an answer, anything else fails the test. Returns the result or None."""
    try:
        output = predictor.predict(inputs)
    except InputError as err:
        assert str(err), "an InputError must say what is wrong"
        return None
    check_spans(output["result"], text)
    return output["result"]


@pytest.mark.parametrize("task", ["sentiment", "ner", "summary"])
@FUZZ
@given(text=TEXTS)
def test_one_text_tasks_never_crash_and_spans_stay_inside(predictors, task, text):
    run(predictors[task], {"text": text}, text)


@FUZZ
@given(before=TEXTS, after=TEXTS, masks=st.integers(1, 3))
def test_fill_mask_never_crashes_and_spans_stay_inside(predictors, before, after, masks):
    text = before + " [MASK]" * masks + after
    result = run(predictors["fill_mask"], {"text": text}, text)
    if result is not None:
        assert all(p["text"] == "[MASK]" for p in result["predictions"])


@FUZZ
@given(question=TEXTS, context=TEXTS)
def test_qa_never_crashes_and_answers_come_from_the_context(predictors, question, context):
    result = run(predictors["qa"], {"question": question, "context": context}, context)
    if result is not None and result["answer"] is not None:
        assert result["answer"] in context


def test_every_empty_or_invisible_input_is_an_input_error(predictors):
    for blank in ("", "   ", "\n\t"):
        for task in ("sentiment", "ner", "summary", "fill_mask"):
            with pytest.raises(InputError):
                predictors[task].predict({"text": blank})
        with pytest.raises(InputError, match="question is empty"):
            predictors["qa"].predict({"question": blank, "context": "Some context."})
        with pytest.raises(InputError, match="context is empty"):
            predictors["qa"].predict({"question": "Who?", "context": blank})
    # nothing but control, zero-width or bidi characters: every model read it as nothing and answered anyway
    # ... or letters and symbols drawn as nothing (Hangul fillers, the blank Braille pattern: session 57's audit)
    for invisible in ("\u200b", "\x00\x01\x02", " \u200b\u200c\u2066 ", "\ufeff\u00ad", "\u0301\u0301", "\ufe0f",
                      "\u3164" * 10, "\u2800 \u2800", "\u115f\u1160\uffa0"):
        for task in ("sentiment", "ner", "summary", "fill_mask"):
            with pytest.raises(InputError, match=f"{task}: input 'text' has no readable text"):
                predictors[task].predict({"text": invisible})
        with pytest.raises(InputError, match="qa: input 'question' has no readable text"):
            predictors["qa"].predict({"question": invisible, "context": "Some context."})
        with pytest.raises(InputError, match="sentiment: input 'text_pair' has no readable text"):
            predictors["sentiment"].predict({"text": "Fine.", "text_pair": invisible})


def _rss_peak_mb() -> float | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def _reset_rss_peak() -> bool:
    try:  # Linux: writing 5 resets the peak resident set size (VmHWM) to the current one
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


MEGABYTE_TEXT = ("The committee met in Geneva on Tuesday. Anna Schmidt said the plan would cost 3.5 million euros. "
                 "Critics in Berlin disagreed! ") * 8_000  # ~1.0 MB, 24,000 sentences


@pytest.mark.parametrize("task", ["sentiment", "ner", "summary", "fill_mask", "qa"])
def test_a_megabyte_of_text_is_answered_or_refused_with_bounded_memory(predictors, task):
    text = MEGABYTE_TEXT[:1_000_000]
    inputs = {"question": "Who said it?", "context": text} if task == "qa" else {
        "text": text.replace("cost", "[MASK]", 3) if task == "fill_mask" else text}
    torch.set_num_threads(torch.get_num_threads())
    reset = _reset_rss_peak()
    before = _rss_peak_mb()
    try:
        result = predictors[task].predict(inputs)["result"]
        check_spans(result, inputs.get("context") or inputs["text"])
    except InputError as err:
        assert "limit" in str(err) or "windows" in str(err), err
    after = _rss_peak_mb()
    if reset and before is not None:
        # Long inputs go through truncation or bounded windows in chunks of rows: the peak stays
        # far below what one forward pass over every token at once would take.
        assert after - before < 1500, f"{task}: resident memory peak grew by {after - before:.0f} MB"


# -- every registered task, whatever its fields: a new task is fuzzed without editing this file ----------

REGISTRY = load_registry(entry_points=False)


@pytest.fixture(scope="module")
def tiny_predictors():
    from bert_engine.tasks.conformance import tiny_predictor

    return {name: tiny_predictor(task) for name, task in REGISTRY.tasks.items()}


@pytest.mark.parametrize("task", list(REGISTRY.tasks))
@FUZZ
@given(data=st.data())
def test_every_registered_task_never_crashes_on_any_text(tiny_predictors, task, data):
    """Every input field (and optional field) filled with arbitrary text, on the task's head over a
    tiny random encoder: InputError or a result the conformance kit finds nothing wrong with."""
    from bert_engine.tasks.conformance import check_result

    spec = REGISTRY.task(task).spec
    inputs = {field: data.draw(TEXTS, label=field) for field in spec.input_fields}
    inputs.update({field: data.draw(st.one_of(st.none(), TEXTS), label=field) for field in spec.optional_fields})
    predictor = tiny_predictors[task]
    try:
        output = predictor.predict(inputs)
    except InputError as err:
        assert str(err), "an InputError must say what is wrong"
        return
    labels = set(getattr(predictor.model.head, "labels", None) or ()) or None
    assert check_result(REGISTRY.task(task), "fuzz", inputs, output["result"], labels) == []
