"""SQuAD scoring with the official EM / F1 semantics (v1.1 and v2.0), and the no-answer thresholds
read off scored questions: the F1-best one (the official script's find_best_thresh) and the cautious
one a visitor-facing default may use. Holds no model code: `plugins.qa` predicts, this scores.
"""

from __future__ import annotations

import collections
import math
import re
import string

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, and fold whitespace (SQuAD v1.1's script)."""
    text = text.lower().translate(_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, truth: str) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not predicted or not gold:  # SQuAD 2.0: "no answer" is right exactly when the truth is "no answer"
        return float(predicted == gold)
    common = collections.Counter(predicted) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: list[str], golds: list[list[str]]) -> dict[str, float]:
    """Exact match and F1 in percent, each the maximum over the gold answers (official semantics)."""
    if not golds:
        raise ValueError("no questions to score")
    em = sum(max(normalize_answer(p) == normalize_answer(t) for t in gold) for p, gold in zip(predictions, golds))
    f1 = sum(max(f1_score(p, t) for t in gold) for p, gold in zip(predictions, golds))
    return {"exact_match": 100.0 * em / len(golds), "f1": 100.0 * f1 / len(golds)}


def metric(results: list[dict], targets: list[dict]) -> dict[str, float]:
    """Official SQuAD EM / F1 of the results' best answers against the targets' gold answers, and the share
    of questions answered "no answer" (`no_answer_rate`, in percent: on data where every question has an
    answer, the share refused); on data with unanswerable questions (SQuAD 2.0) also the official v2
    figures (`v2_scores`)."""
    scores = squad_scores([r["answer"] or "" for r in results], [t["answers"] for t in targets])
    scores["no_answer_rate"] = 100.0 * sum(not r["answer"] for r in results) / len(results)  # None: "no answer"
    if any(t["answers"] == [""] for t in targets):
        scores.update(v2_scores(results, targets))
    return scores


def _question_scores(result: dict, gold: list[str]) -> tuple[float, float, float, float]:
    """(null gap, F1 and EM of the best span answer, the score of answering nothing) for one question."""
    best = result["answers"][0]["answer"] if result["answers"] else ""
    gap = result["no_answer"]["null_gap"]
    gap = math.inf if gap is None else gap  # no span at all: no answer at any threshold
    span_f1 = max(f1_score(best, t) for t in gold)
    span_em = float(max(normalize_answer(best) == normalize_answer(t) for t in gold))
    return gap, span_f1, span_em, float(gold == [""])


def best_threshold(scored: list[tuple[float, float, float, float]], key: int = 1) -> tuple[float, float]:
    """The null-gap threshold that maximises the mean score (F1 for key 1, EM for key 2) when a
    question is answered "no answer" where its gap exceeds it, as the official v2 script's
    find_best_thresh does; returns (best score in percent, threshold)."""
    if not scored:
        raise ValueError("no questions to score")
    ordered = sorted(scored, key=lambda q: q[0])
    total = sum(q[3] for q in ordered)  # everything answered "no answer": right where there is none
    best, threshold = total, min(ordered[0][0], 0.0) - 1.0
    for gap, f1, em, none in ordered:  # answer this one (and every smaller gap) with its span instead
        total += (f1 if key == 1 else em) - none
        if total > best and math.isfinite(gap):
            best, threshold = total, gap
    return 100.0 * best / len(ordered), threshold


def v2_scores(results: list[dict], targets: list[dict]) -> dict[str, float]:
    """The official SQuAD 2.0 figures: HasAns / NoAns EM and F1 of the results as predicted, best_exact /
    best_f1 with their thresholds (on the null gap), and an honest variant: the F1 threshold tuned on
    the first half of the questions, scored on the second half (`heldout_f1` at `tuned_threshold`)."""
    scored = [_question_scores(r, t["answers"]) for r, t in zip(results, targets)]
    has = [i for i, t in enumerate(targets) if t["answers"] != [""]]
    none = [i for i, t in enumerate(targets) if t["answers"] == [""]]
    predicted = [r["no_answer"]["predicted"] for r in results]

    def as_predicted(indices: list[int], key: int) -> float:
        if not indices:
            return 0.0
        return 100.0 * sum(scored[i][3] if predicted[i] else scored[i][key] for i in indices) / len(indices)

    out = {"HasAns_exact": as_predicted(has, 2), "HasAns_f1": as_predicted(has, 1), "HasAns_total": len(has),
           "NoAns_exact": as_predicted(none, 2), "NoAns_f1": as_predicted(none, 1), "NoAns_total": len(none)}
    out["best_exact"], out["best_exact_thresh"] = best_threshold(scored, key=2)
    out["best_f1"], out["best_f1_thresh"] = best_threshold(scored, key=1)
    half = len(scored) // 2
    if half:
        _, tuned = best_threshold(scored[:half], key=1)
        heldout = scored[half:]
        out["tuned_threshold"] = tuned
        out["heldout_f1"] = _f1_at(heldout, tuned)
        out["heldout_total"] = len(heldout)
        cautious = cautious_threshold(scored[:half])
        if cautious is not None:
            out["default_threshold"] = cautious
            out["default_heldout_f1"] = _f1_at(heldout, cautious)
            for name, unanswerable in (("default_heldout_HasAns_refused", 0.0), ("default_heldout_NoAns_caught", 1.0)):
                gaps = [q[0] for q in heldout if q[3] == unanswerable]
                out[name] = sum(gap > cautious for gap in gaps) / max(len(gaps), 1)
    return out


def _f1_at(scored: list[tuple[float, float, float, float]], threshold: float) -> float:
    """Mean F1 in percent when a question whose null gap exceeds `threshold` is answered "no answer"."""
    return 100.0 * sum(q[3] if q[0] > threshold else q[1] for q in scored) / len(scored)


ANSWERABLE_REFUSAL = 0.05  # the share of answerable questions the default threshold may refuse


def cautious_threshold(scored: list[tuple[float, float, float, float]],
                       refusal: float = ANSWERABLE_REFUSAL) -> float | None:
    """The null-gap threshold a user-facing default uses: the lowest that refuses at most `refusal`
    of the answerable questions (their gap's (1 - refusal) quantile). best_f1's threshold is tuned for
    SQuAD 2.0's half-unanswerable mix and refuses many answerable questions; a visitor asks mostly
    answerable ones, so the default errs toward answering and says "no answer" where the model is
    clearly surer of it than of any span. None without answerable questions."""
    gaps = sorted(q[0] for q in scored if not q[3] and math.isfinite(q[0]))
    if not gaps:
        return None
    index = min(len(gaps) - 1, math.ceil((1.0 - refusal) * len(gaps)) - 1)
    return gaps[max(index, 0)]

