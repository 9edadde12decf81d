"""Would more features make QA's answerability verifier better? The experiment of session 30 (not shipped).

    python scripts/qa_verifier_features.py --model plugins/starter/qa [--report runs/qa_verifier_features.json]

The shipped verifier (`plugins.qa_answerability`) is a logistic regression over ten features. This script
adds seven more, read from the head's best 20 spans and the context's sentences:
- missing_sentence: share of the question's content words the best span's sentence never says;
- null_logit: the no-answer logit itself, not only against the best span's;
- question_words: how many content words the question has;
- asks_which: the question asks "which ...";
- entropy: of the softmax over the best 20 spans' logits and the no-answer logit;
- sentence_cover: the largest share of the question's content words one sentence says;
- sentence_distance: sentences between the best span's and that one.

It fits both verifiers on half A of SQuAD 2.0 dev (as scripts/qa_calibrate.py does) and reports, for
each: ROC AUC by 5-fold cross-validation inside half A (questions at random, and whole articles per
fold), the held-out half B's ROC AUC, and, at the `eager` threshold read on half A (refuse at most 5 % of
its answerable questions), half B's F1 and the share of SQuAD 1.1 dev and QED dev questions refused.
The seventeen were chosen by backward elimination on half A's cross-validation only.

Predictions (top 20 spans per question, no threshold) are cached next to the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
from qa_calibrate import (  # this folder's
    DATA,
    EVALUATION_FILES,
    at,
    auc,
    need_files,
    question_keys,
    refusal_threshold,
    scored,
)

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import qa
from plugins.qa_answerability import _WORD, FEATURES, _stem, content_words, features
from plugins.qa_data import read_data

SPANS = 20
EXTRA = ("missing_sentence", "null_logit", "question_words", "asks_which", "entropy", "sentence_cover",
         "sentence_distance")
DROPPED = ("best_span_probability", "answer_in_question")  # backward elimination on half A dropped them
_SENTENCE_END = re.compile(r"([.!?][\"')\]\u201d\u2019]*)\s+|\n+")


def sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of the sentences of `text`: a cut after . ! or ? and the space after it, or a line break."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end(1) if match.group(1) else match.start()
        if end > start:
            spans.append((start, end))
        start = match.end()
    return spans + ([(start, len(text))] if start < len(text) else [])


def extra_features(question: str, context: str, result: dict) -> list[float]:
    """The EXTRA features of one prediction (`result` with the best SPANS spans and their logits)."""
    words = content_words(question)
    best = result["answers"][0] if result["answers"] else None
    cover, covering, home = -1.0, 0, None
    for i, (start, end) in enumerate(sentences(context)):
        present = {_stem(w) for w in _WORD.findall(context[start:end].lower())}
        said = sum(w in present for w in words) / len(words) if words else 0.0
        if said > cover:
            cover, covering = said, i
        if best is not None and home is None and start <= best["start"] < end:
            home = (i, 1.0 - said)
    missing, distance = (1.0, 5.0) if home is None else (home[1], float(min(5, abs(home[0] - covering))))
    null = result["no_answer"]["logit"]
    logits = [a["logit"] for a in result["answers"][:SPANS]] + [null]
    top = max(logits)
    weights = [math.exp(v - top) for v in logits]
    entropy = -sum(w / sum(weights) * math.log(w / sum(weights)) for w in weights if w > 0)
    return [missing, max(-30.0, min(30.0, null)), float(min(30, len(words))),
            float(re.search(r"\bwhich\b", question, re.IGNORECASE) is not None), entropy, max(cover, 0.0), distance]


def rows_of(predictor, path: Path, cache: Path) -> tuple[np.ndarray, np.ndarray, list]:
    """(all features, labels 1 = no answer, (inputs, target, result) rows) of a SQuAD file."""
    examples = list(read_data(path, "dev"))
    if cache.exists():
        results = json.loads(cache.read_text())
    else:
        results = qa.predict_many(predictor, [x for x, _ in examples], null_threshold=None, no_answer="never",
                                  top_k=SPANS, progress=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(results))
    x = np.array([features(i["question"], i["context"], {**r, "answers": r["answers"][:1]})
                  + extra_features(i["question"], i["context"], r) for (i, _), r in zip(examples, results)])
    y = np.array([t["answers"] == [""] for _, t in examples], dtype=float)
    return x, y, [(i, t, r) for (i, t), r in zip(examples, results)]


def logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0):
    """plugins.qa_answerability.fit's regression (standardised, Newton, L2 on the weights): a scorer."""
    mean, scale = x.mean(0), x.std(0)
    scale[scale == 0] = 1.0
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / scale])
    w, penalty = np.zeros(z.shape[1]), np.full(z.shape[1], l2)
    penalty[0] = 0.0
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -60, 60)))
        step = np.linalg.solve((z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty + 1e-9), z.T @ (p - y) + penalty * w)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return lambda new: np.hstack([np.ones((len(new), 1)), (new - mean) / scale]) @ w


def cross_validated_auc(x: np.ndarray, y: np.ndarray, folds: np.ndarray) -> float:
    scores = np.zeros(len(y))
    for fold in np.unique(folds):
        test = folds == fold
        scores[test] = logistic(x[~test], y[~test])(x[test])
    return auc(scores[y == 1].tolist(), scores[y == 0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, default=DATA,
                        help=f"the datasets folder holding squad/ (and qed/) (default: {DATA})")
    parser.add_argument("--report", type=Path, default=Path("runs/qa_verifier_features.json"))
    args = parser.parse_args()
    need_files(parser, args.data, *EVALUATION_FILES)
    folder = Path(args.model)
    predictor = Predictor.load(load_registry(entry_points=False).task("qa"), str(folder))
    key = hashlib.sha256((folder / "adapter.safetensors").read_bytes()).hexdigest()[:12]
    cache = args.report.parent / f"qa_predictions_{key}_top{SPANS}"
    v2 = args.data / "squad" / "dev-v2.0.json"
    x, y, v2_rows = rows_of(predictor, v2, cache / v2.name)
    others = {name: rows_of(predictor, path, cache / path.name) for name, path in (
        ("SQuAD 1.1 dev", args.data / "squad" / "dev-v1.1.json"), ("QED dev", args.data / "qed" / "qed-dev.squad.json"))}
    half = len(y) // 2
    titles = [t for _, t in question_keys(v2)][:half]
    by_article = np.array([sorted(set(titles)).index(t) % 5 for t in titles])
    at_random = np.random.default_rng(0).permutation(half) % 5
    names = list(FEATURES) + list(EXTRA)
    spans_b = [(span, none) for _, span, none in scored(v2_rows[half:], lambda inputs, result: 0.0)]
    report = {"model": str(folder), "calibration_questions": half, "heldout_questions": len(y) - half, "verifiers": {}}
    for label, chosen in (("shipped ten", list(FEATURES)), ("with the seven more", [n for n in names if n not in DROPPED])):
        cols = [names.index(n) for n in chosen]
        xa, ya, xb, yb = x[:half, cols], y[:half], x[half:, cols], y[half:]
        score = logistic(xa, ya)
        sa, sb = score(xa), score(xb)
        eager = refusal_threshold(sa[ya == 0].tolist(), 0.05)
        held = [(s, span, none) for s, (span, none) in zip(sb.tolist(), spans_b)]
        row = {"features": chosen,
               "half A cross-validated AUC, questions at random": cross_validated_auc(xa, ya, at_random),
               "half A cross-validated AUC, whole articles per fold": cross_validated_auc(xa, ya, by_article),
               "half B AUC": auc(sb[yb == 1].tolist(), sb[yb == 0].tolist()),
               "half B F1 at eager": at(held, eager)["f1"],
               "half B unanswerable caught at eager": at(held, eager)["unanswerable_caught"],
               "half B answerable refused at eager": at(held, eager)["answerable_refused"]}
        for name, (ox, _, _) in others.items():
            refused = score(ox[:, cols]) > eager
            row[f"{name} refused at eager"] = float(refused.mean())
        report["verifiers"][label] = row
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))
    for label, row in report["verifiers"].items():
        print(label)
        for k, v in row.items():
            if k != "features":
                print(f"  {k}: {v:.4f}")


if __name__ == "__main__":
    main()
