"""QA's answerability verifier: whether a context answers a question at all, read from the span head's
output and the words the question and context share (a small external verifier, after Retro-Reader's
idea of checking the reader's answer, Zhang et al. 2020).

The span head's null gap alone tells SQuAD 2.0's unanswerable questions from answerable ones only
weakly (ROC AUC about 0.6): its training negatives are edits of SQuAD 1.1 questions, not the real
thing. Most real unanswerable questions are small edits of an answerable one: a name, number or
word the paragraph never says, a "not", an antonym. The features below measure those directly, and
a logistic regression over them and the head's scores gives P(no answer). Its dozen weights are
calibration, fitted on a fixed half of a labelled set (scripts/qa_calibrate.py) and shipped in the
pack's task options; the other half scores it. No model code; no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from plugins.qa_data import antonyms, question_entities
from plugins.qa_metric import normalize_answer

# Words that carry no fact of their own: a question missing one of these from the context still asks
# something the context may answer.
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have having
he her here hers him his how i if in into is it its itself just many may me might more most much must my
no nor not of off on once one only or other our out over own same she should so some such than that the
their them then there these they this those through to too under until up upon us very was we were what
when where which while who whom whose why will with would you your
called name named known kind type year years first used use many much number
""".split())
NEGATION = re.compile(r"\b(?:not|never|no|none|nor|cannot|without)\b|n't\b|n\u2019t\b", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9]+")
NEAR_CHARS = 250  # how far either side of the best span counts as "near the answer"
# How far either side of the best span counts as "its paragraph": about one SQuAD paragraph (mean 800 characters),
# so a long document (a scientific paper: COVID-QA's average 23,500) is read as the paragraphs the verifier was
# calibrated on. Read over the whole context, the share fell with the text's length alone (a paper says nearly
# every word somewhere), and the verifier refused about a quarter of COVID-QA's questions, every one answerable.
PARAGRAPH_CHARS = 1000

FEATURES = (
    "null_gap",          # the span head: no-answer logit minus the best span's (higher: no answer)
    "null_probability",  # its probability of "no answer" against every span considered
    "best_span_probability",
    "missing_paragraph",  # share of the question's content words the text within PARAGRAPH_CHARS of the best span never says
    "missing_near",      # ... that the text near the best span never says
    "missing_name",      # a name of the question the context never says (an entity swap)
    "missing_number",    # a number, year or month of the question the context never says
    "negation",          # the question says not / never / n't
    "antonym_near",      # a question word the context never says whose antonym stands near the answer
    "answer_in_question",  # share of the answer's words the question already says
)


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def content_words(text: str) -> list[str]:
    """The lower-cased, lightly stemmed words of `text` that are not stop words."""
    return [_stem(w) for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def _missing_share(words: list[str], text: str) -> float:
    if not words:
        return 0.0
    present = {_stem(w) for w in set(_WORD.findall(text.lower()))}  # each distinct word stemmed once
    return sum(w not in present for w in words) / len(words)


def features(question: str, context: str, result: Mapping) -> list[float]:
    """The FEATURES of one prediction (`result`: plugins.qa's postprocess output, which must hold at
    least the best span when there is one), in FEATURES order."""
    answers = result.get("answers") or []
    gap = result["no_answer"]["null_gap"]
    gap = 30.0 if gap is None else max(-30.0, min(30.0, float(gap)))
    best = answers[0] if answers else None
    words = content_words(question)
    near = paragraph = context
    if best is not None and "start" in best:
        near = context[max(0, best["start"] - NEAR_CHARS):best["end"] + NEAR_CHARS]
        paragraph = context[max(0, best["start"] - PARAGRAPH_CHARS):best["end"] + PARAGRAPH_CHARS]
    names = [normalize_answer(question[s:e].rstrip(".")) for s, e in question_entities(question)]
    numbers = [n for n in names if n[:1].isdigit()]
    names = [n for n in names if n and not n[:1].isdigit()]
    folded = normalize_answer(context) if names or numbers else ""  # the whole context, read only when needed
    missing_name = float(any(n not in folded for n in names))
    missing_number = float(any(n not in folded for n in numbers))
    table = antonyms()
    opposed = [w for w in _WORD.findall(question.lower()) if w in table]
    antonym_near = 0.0
    if opposed:
        context_words, near_words = set(_WORD.findall(context.lower())), set(_WORD.findall(near.lower()))
        antonym_near = float(any(w not in context_words and table.get(w) in near_words for w in opposed))
    answer_words = content_words(best["answer"]) if best is not None else []
    question_words = set(words)
    in_question = sum(w in question_words for w in answer_words) / len(answer_words) if answer_words else 0.0
    return [
        gap,
        float(result["no_answer"]["score"]),
        float(best["score"]) if best is not None else 0.0,
        _missing_share(words, paragraph),
        _missing_share(words, near),
        missing_name,
        missing_number,
        float(NEGATION.search(question) is not None),
        antonym_near,
        in_question,
    ]


def verifier_problem(verifier) -> str | None:
    """What is wrong with a verifier record (the qa option `answerability`, which a model's manifest sets: `fit`'s
    {"features", "mean", "scale", "weights", "bias"}, and optionally "presets", each of NO_ANSWER_CHOICES but
    "never" mapped to a probability), in words; None where it is one `no_answer_probability` can read."""
    if not isinstance(verifier, Mapping):
        return f"it is of type {type(verifier).__name__}, not a mapping"
    missing = [k for k in ("features", "mean", "scale", "weights", "bias") if k not in verifier]
    if missing:
        return f"it has no {', '.join(missing)}"
    if not isinstance(verifier["features"], (list, tuple)) or list(verifier["features"]) != list(FEATURES):
        return f"its features are not this version's ({', '.join(FEATURES)}); refit it (scripts/qa_calibrate.py)"

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key in ("mean", "scale", "weights"):
        values = verifier[key]
        if not isinstance(values, (list, tuple)) or len(values) != len(FEATURES) or not all(map(number, values)):
            return f"its {key} is not {len(FEATURES)} finite numbers"
    if any(v == 0 for v in verifier["scale"]):
        return "its scale holds a 0"
    if not number(verifier["bias"]):
        return "its bias is not a finite number"
    presets = verifier.get("presets", {})
    if not isinstance(presets, Mapping) or not all(isinstance(k, str) and number(v) and 0.0 <= v <= 1.0
                                                   for k, v in presets.items()):
        return "its presets are not names mapped to probabilities from 0 to 1"
    return None


def no_answer_probability(row: Sequence[float], verifier: Mapping) -> float:
    """P(no answer) of one feature row under a fitted verifier ({"features", "mean", "scale",
    "weights", "bias"}, as `fit` returns it)."""
    if list(verifier["features"]) != list(FEATURES):
        raise ValueError(f"qa: the answerability verifier was fitted on features {list(verifier['features'])}, "
                         f"this version computes {list(FEATURES)}; refit it (scripts/qa_calibrate.py)")
    z = verifier["bias"] + sum(w * (x - m) / s for w, x, m, s in
                               zip(verifier["weights"], row, verifier["mean"], verifier["scale"]))
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))


def fit(rows: Sequence[Sequence[float]], labels: Sequence[int], *, l2: float = 1.0,
        iterations: int = 50) -> dict:
    """Logistic regression of labels (1: no answer) on standardised feature rows by Newton's method
    with an L2 penalty `l2` on the weights; returns the verifier record `no_answer_probability` reads.

    Raises:
        ValueError: fewer than two rows of each label.
    """
    import numpy as np  # noqa: PLC0415 - only calibration fits; inference reads the record with plain Python

    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(x) != len(y):
        raise ValueError(f"qa: fit needs rows of {len(FEATURES)} features and one label each, got {x.shape}")
    if min(y.sum(), len(y) - y.sum()) < 2:
        raise ValueError("qa: fit needs at least two answerable and two unanswerable questions")
    mean, scale = x.mean(0), x.std(0)
    scale[scale == 0] = 1.0
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / scale])
    w = np.zeros(z.shape[1])
    penalty = np.full(z.shape[1], l2)
    penalty[0] = 0.0  # the bias is not shrunk
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -60, 60)))
        gradient = z.T @ (p - y) + penalty * w
        hessian = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return {"features": list(FEATURES), "mean": mean.round(6).tolist(), "scale": scale.round(6).tolist(),
            "weights": w[1:].round(6).tolist(), "bias": round(float(w[0]), 6), "l2": l2}
