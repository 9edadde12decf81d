"""QA's answerability verifier (plugins/qa_answerability.py) and the "no answer" choice of the task."""

import math

import numpy as np
import pytest

from bert_engine.hookspecs import InputError
from plugins.qa import OPTIONS, no_answer_rule, postprocess
from plugins.qa_answerability import FEATURES, features, fit, no_answer_probability


def _result(answer="Lyon", start=0, gap=-2.0, score=0.8):
    return {"answers": [{"answer": answer, "start": start, "end": start + len(answer), "score": score}],
            "no_answer": {"null_gap": gap, "score": 1 - score}}


def test_features_see_what_the_question_asks_that_the_context_never_says():
    context = "Lyon is the largest city of the region, rebuilt in 1998."
    plain = dict(zip(FEATURES, features("Which is the largest city of the region?", context, _result())))
    assert plain["missing_paragraph"] == 0 and plain["missing_name"] == 0 and plain["negation"] == 0
    swapped = dict(zip(FEATURES, features("Which is the largest city of Burgundy?", context, _result())))
    assert swapped["missing_name"] == 1 and swapped["missing_paragraph"] > 0
    assert dict(zip(FEATURES, features("What was rebuilt in 1999?", context, _result())))["missing_number"] == 1
    assert dict(zip(FEATURES, features("Which is not the largest city?", context, _result())))["negation"] == 1
    flipped = dict(zip(FEATURES, features("Which is the smallest city?", context, _result())))
    assert flipped["antonym_near"] == 1  # "smallest" never said, "largest" stands near the answer
    none = features("Who?", context, {"answers": [], "no_answer": {"null_gap": None, "score": 1.0}})
    assert none[0] == 30.0 and len(none) == len(FEATURES)


def test_the_paragraph_share_reads_the_answers_paragraph_not_the_whole_document():
    """A paragraph inside a long document scores as the paragraph alone: read over the whole document, the share of
    the question's words it never says fell with the document's length (a scientific paper says nearly every word
    somewhere), and the verifier refused about a quarter of COVID-QA's answerable questions."""
    question = "Which enzyme cleaves the spike protein of the coronavirus?"
    paragraph = "Entry needs the host protease TMPRSS2, which primes the viral envelope before fusion."
    answer = paragraph.index("TMPRSS2")
    alone = dict(zip(FEATURES, features(question, paragraph, _result("TMPRSS2", answer))))
    far = " ".join(["Unrelated methods text."] * 60)  # 1,400 characters either side, past PARAGRAPH_CHARS
    document = f"The enzyme that cleaves the spike protein of a coronavirus is a protease. {far} {paragraph} {far}"
    start = document.index("TMPRSS2")
    inside = dict(zip(FEATURES, features(question, document, _result("TMPRSS2", start))))
    assert alone["missing_paragraph"] > 0.5 and inside["missing_paragraph"] == alone["missing_paragraph"]
    assert inside["missing_near"] == alone["missing_near"]


def test_fit_separates_and_the_record_predicts_as_numpy_does():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, len(FEATURES)))
    y = (x[:, 3] + 0.5 * x[:, 0] + rng.normal(scale=0.3, size=400) > 0).astype(int)
    verifier = fit(x.tolist(), y.tolist())
    p = np.array([no_answer_probability(row, verifier) for row in x.tolist()])
    assert ((p > 0.5) == y).mean() > 0.9
    assert verifier["weights"][3] > verifier["weights"][0] > 0  # the informative features, in their order
    with pytest.raises(ValueError, match="two answerable and two unanswerable"):
        fit(x[:5].tolist(), [1] * 5)
    stale = {**verifier, "features": ["null_gap"]}
    with pytest.raises(ValueError, match="refit it"):
        no_answer_probability(x[0].tolist(), stale)


def test_the_no_answer_choice_is_a_preset_or_a_probability():
    verifier = {"presets": {"eager": 0.9, "balanced": 0.5, "cautious": 0.2}}
    assert no_answer_rule(None, verifier) == 0.9 and no_answer_rule("Cautious ", verifier) == 0.2  # None: eager
    assert no_answer_rule("never", verifier) is None and no_answer_rule(0.7, verifier) == 0.7
    assert no_answer_rule("eager", None) is None  # a model without a verifier: only a raw null_threshold decides
    assert no_answer_rule(" 0.25", verifier) == 0.25 and no_answer_rule("1", verifier) == 1.0  # as the CLI sends it
    for bad in ("sometimes", 1.5, True, [0.5], "1.5", "nan", "-0.1"):
        with pytest.raises(InputError, match="no_answer must be one of eager, balanced, cautious, never"):
            no_answer_rule(bad, verifier)


def _verifier(bias: float) -> dict:
    n = len(FEATURES)
    return {"features": list(FEATURES), "mean": [0.0] * n, "scale": [1.0] * n, "weights": [0.0] * n, "bias": bias,
            "presets": {"eager": 0.9, "balanced": 0.5, "cautious": 0.1}}


def test_the_verifier_decides_unless_a_raw_null_threshold_is_given(tmp_path):
    from conftest import reference_checkpoint

    from bert_engine.checkpoints.loader import load_tokenizer
    from bert_engine.heads import SpanOutput
    from plugins.qa import preprocess

    tokenizer = load_tokenizer(str(reference_checkpoint(tmp_path, "BertForQuestionAnswering")))
    inputs = {"question": "Who built it?", "context": "The council built the bridge."}
    batch = preprocess(inputs, tokenizer, **OPTIONS)
    T = batch.input_ids.shape[1]
    starts = torch_zeros(T)
    output = SpanOutput(starts, starts.clone())

    def decide(**options):
        return postprocess(output, batch, **{**OPTIONS, **options})["no_answer"]

    sure_none = decide(answerability=_verifier(3.0))  # P(no answer) = 0.95 > eager 0.9 (the default)
    assert sure_none["predicted"] and sure_none["rule"] == "verifier"
    assert math.isclose(sure_none["probability"], 1 / (1 + math.exp(-3.0)), abs_tol=1e-6)
    assert not decide(answerability=_verifier(3.0), no_answer="never")["predicted"]
    assert not decide(answerability=_verifier(1.0), no_answer="eager")["predicted"]  # 0.73 < 0.9
    raw = decide(answerability=_verifier(3.0), null_threshold=100.0)
    assert raw["rule"] == "null gap" and not raw["predicted"]  # the caller's raw threshold wins
    assert decide()["rule"] == "none" and not decide()["predicted"]


def torch_zeros(T):
    import torch

    return torch.zeros(1, T)


@pytest.mark.parametrize(("record", "problem"), [
    (1, "of type int, not a mapping"), ("abc", "of type str"), ([], "of type list"),
    ({"x": 1}, "it has no features, mean, scale, weights, bias"),
    ({**_verifier(0.0), "features": ["null_gap"]}, "refit it"),
    ({**_verifier(0.0), "mean": [0.0]}, "its mean is not"), ({**_verifier(0.0), "weights": None}, "its weights is not"),
    ({**_verifier(0.0), "scale": [float("nan")] * len(FEATURES)}, "its scale is not"),
    ({**_verifier(0.0), "scale": [0.0] * len(FEATURES)}, "its scale holds a 0"),
    ({**_verifier(0.0), "bias": "1"}, "its bias"), ({**_verifier(0.0), "bias": True}, "its bias"),
    ({**_verifier(0.0), "presets": {"eager": 2.0}}, "its presets"), ({**_verifier(0.0), "presets": [1]}, "its presets"),
])
def test_a_verifier_record_that_cannot_be_read_is_an_input_error_naming_what_is_wrong(record, problem):
    """The option `answerability` (a model's manifest sets it; a caller may too): anything but a record
    no_answer_probability can read is refused before any work, naming what is wrong, not an AttributeError later."""
    from plugins.qa import check_options

    with pytest.raises(InputError, match=f"qa: answerability must be a verifier record .* but .*{problem}"):
        check_options({**OPTIONS, "answerability": record})
    check_options({**OPTIONS, "answerability": _verifier(0.0)})  # a good record, and none, pass
    check_options(dict(OPTIONS))
