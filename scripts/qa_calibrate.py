"""Calibrate QA's "no answer" decision on one fixed half of SQuAD 2.0 dev and score it on the other.

    python scripts/qa_calibrate.py --model FOLDER [--write-pack] [--report runs/qa_calibration.json]

1. Predicts every SQuAD 2.0 dev question (no threshold) and splits the file in two fixed halves by
   question order: half A (the first 5,936 questions) calibrates, half B (the other 5,937) is held out,
   as `qa_metric.v2_scores` does for its held-out figure.
2. On half A it fits the answerability verifier (`plugins.qa_answerability`: a dozen logistic weights
   over the span head's scores and the question's words the context never says) and reads three
   thresholds on its P(no answer), each named for what a visitor gets: "eager" refuses at most 5 % of
   half A's answerable questions (the shipped default: a visitor mostly asks what the text says),
   "balanced" at most 15 % (with --answerable FILES, of those files' answerable questions too, e.g.
   QED train: another domain's real search questions), "cautious" maximises half A's F1 (SQuAD 2.0's half-unanswerable mix, where
   it refuses about 45 %). The same three on the null gap alone, for comparison.
3. Scores each on half B (F1, HasAns F1, unanswerable caught, answerable refused, ROC AUC), and the
   answerable refusal rate and F1 on SQuAD 1.1 dev and QED dev (all answerable, never tuned on).
4. --long-documents: also a seeded sample of COVID-QA (whole scientific papers, every question answerable),
   its even- and odd-numbered papers reported apart, so one half can inform a choice and the other report it.
5. --write-pack writes the verifier and the thresholds into the folder's manifest.json task options
   (the shipped preset: --preset, default "eager").

--trained-on FILES (SQuAD files the model trained on, e.g. the part of half A that
`scripts/squad_v2_parts.py` writes): their questions leave half A's calibration, and their articles
(by title) leave SQuAD 1.1 dev's figures, which hold the same Wikipedia articles. Half B must not
hold any of them: refused if it does.

Predictions are cached next to the report (one JSON per file and model), so re-running is cheap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
from pathlib import Path

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import qa
from plugins.qa_answerability import FEATURES, features, fit, no_answer_probability
from plugins.qa_data import read_data
from plugins.qa_metric import f1_score

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PRESETS = ("eager", "balanced", "cautious")
EVALUATION_FILES = ("squad/dev-v2.0.json", "squad/dev-v1.1.json", "qed/qed-dev.squad.json")  # under --data
LONG_DOCUMENTS = "covid_qa/COVID-QA.200423.json"  # whole scientific papers, every question answerable
REFUSALS = {"eager": 0.05, "balanced": 0.15}  # the share of half A's answerable questions a preset may refuse


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive scores above a negative), ties counted half (ROC AUC), by ranks: O(n log n)."""
    ranked = sorted([(v, 1) for v in positive] + [(v, 0) for v in negative])
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mean_rank = (i + j + 1) / 2  # 1-based ranks i+1 .. j, ties share their mean
        rank_sum += mean_rank * sum(label for _, label in ranked[i:j])
        i = j
    n_pos, n_neg = len(positive), len(negative)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def question_keys(path: Path) -> list[tuple[str, str]]:
    """(question id, article title) of every question of a SQuAD file, in the order read_data yields them."""
    return [(qa["id"], article.get("title", "")) for article in json.loads(Path(path).read_text(encoding="utf-8"))["data"]
            for p in article["paragraphs"] for qa in p["qas"]]


def trained_on(paths) -> tuple[set[str], set[str]]:
    """(question ids, article titles) of the SQuAD files a model trained on."""
    keys = [key for path in paths for key in question_keys(path)]
    return {i for i, _ in keys}, {t for _, t in keys}


def predictions(predictor, path: Path, split: str, cache: Path) -> list[tuple[dict, dict, dict]]:
    """(inputs, target, result) for every question of a SQuAD file, cached by file and model."""
    examples = list(read_data(path, split))
    results = cached_results(predictor, [x for x, _ in examples], cache)
    return [(x, t, r) for (x, t), r in zip(examples, results)]


def cached_results(predictor, items: list[dict], cache: Path) -> list[dict]:
    """The QA results for `items` (no threshold, the best span kept), read from `cache` or predicted and written there."""
    if cache.exists():
        return json.loads(cache.read_text())
    results = qa.predict_many(predictor, items, null_threshold=None, top_k=1, progress=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(results))
    return results


def long_document_sample(predictor, path: Path, size: int, cache: Path) -> dict[str, list[tuple[dict, dict, dict]]]:
    """`size` questions of a SQuAD-layout file of whole documents (COVID-QA: each a scientific paper, all
    answerable), drawn with seed 0, cached like `predictions`, and split by document: the even-numbered
    documents' questions and the odd-numbered ones', so one half can inform a choice and the other report it."""
    documents = [d for d, article in enumerate(json.loads(Path(path).read_text(encoding="utf-8"))["data"])
                 for p in article["paragraphs"] for _ in p["qas"]]
    examples = list(read_data(path, "dev"))
    picked = sorted(random.Random(0).sample(range(len(examples)), min(size, len(examples))))
    results = cached_results(predictor, [examples[i][0] for i in picked], cache)
    rows = [(*examples[i], r, documents[i] % 2) for i, r in zip(picked, results)]
    name = Path(path).stem
    return {f"{name} sample, even documents": [row[:3] for row in rows if row[3] == 0],
            f"{name} sample, odd documents": [row[:3] for row in rows if row[3] == 1]}


def scored(rows: list[tuple[dict, dict, dict]], score) -> list[tuple[float, float, float]]:
    """(no-answer score, F1 if answered with the span, F1 if answered "no answer") per question."""
    out = []
    for inputs, target, result in rows:
        best = result["answers"][0]["answer"] if result["answers"] else ""
        span_f1 = max(f1_score(best, t) for t in target["answers"]) if best else float(target["answers"] == [""])
        out.append((score(inputs, result), span_f1, float(target["answers"] == [""])))
    return out


def refusal_threshold(scores: list[float], share: float) -> float:
    """The lowest threshold at which at most `share` of these answerable questions' scores lie above it."""
    has = sorted(s for s in scores if math.isfinite(s))
    return has[min(len(has) - 1, math.ceil((1 - share) * len(has)) - 1)]


def thresholds(rows: list[tuple[float, float, float]],
               answerable: list[list[tuple[float, float, float]]] = ()) -> dict[str, float]:
    """The three presets' thresholds read off calibration rows (score above threshold: "no answer").
    "eager" and "balanced" refuse at most their share of the answerable questions of the rows and of
    each set in `answerable` (questions from elsewhere, all answerable): the strictest of them."""
    sets = [[s for s, _, none in rows if not none], *[[s for s, _, _ in extra] for extra in answerable]]
    out = {name: max(refusal_threshold(scores, share) for scores in sets if scores)
           for name, share in REFUSALS.items()}
    ordered = sorted(rows, key=lambda r: r[0])
    total = best = sum(none for _, _, none in ordered)  # everything "no answer"
    out["cautious"] = ordered[0][0] - 1.0
    for s, span, none in ordered:
        total += span - none
        if total > best and math.isfinite(s):
            best, out["cautious"] = total, s
    return out


def at(rows: list[tuple[float, float, float]], threshold: float) -> dict[str, float]:
    """F1 and the decision's rates when a score above `threshold` means "no answer"."""
    has = [r for r in rows if not r[2]]
    nones = [r for r in rows if r[2]]
    f1 = [none if s > threshold else span for s, span, none in rows]
    out = {"f1": 100 * sum(f1) / len(rows), "questions": len(rows)}
    if has:
        out["answerable_refused"] = sum(s > threshold for s, _, _ in has) / len(has)
        out["HasAns_f1"] = 100 * sum(0.0 if s > threshold else span for s, span, _ in has) / len(has)
    if nones:
        out["unanswerable_caught"] = sum(s > threshold for s, _, _ in nones) / len(nones)
    return out


def need_files(parser: argparse.ArgumentParser, data: Path, *names: str) -> None:
    """Before any model loads: every dataset file the script reads is there, or one line names the first
    missing one and what --data should point at (the default is ../shared/data beside the checkout)."""
    for name in names:
        if not (data / name).is_file():
            parser.error(f"--data: no {data / name} (point --data at the folder that holds {name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the QA checkpoint folder (a pack)")
    parser.add_argument("--data", type=Path, default=DATA,
                        help=f"the datasets folder holding squad/ and qed/ (default: {DATA})")
    parser.add_argument("--report", type=Path, default=Path("runs/qa_calibration.json"))
    parser.add_argument("--preset", choices=PRESETS, default="eager", help="the shipped default")
    parser.add_argument("--write-pack", action="store_true", help="write verifier + thresholds into the manifest")
    parser.add_argument("--answerable", nargs="*", type=Path, default=(),
                        help="more answerable questions (SQuAD layout, e.g. ../shared/data/qed/qed-train*.json) the "
                        "eager and balanced presets must not refuse beyond their share either (default: none; the "
                        "shipped pack was calibrated without; QED dev stays held out either way)")
    parser.add_argument("--long-documents", nargs="?", default=None, const="",
                        help=f"also report on a seeded sample of a file of whole documents, split by document "
                             f"(default with no value: --data's {LONG_DOCUMENTS}; about 2.5 s a question on 2 cores)")
    parser.add_argument("--long-sample", type=int, default=400, help="questions drawn from --long-documents")
    parser.add_argument("--trained-on", nargs="*", type=Path, default=(),
                        help="SQuAD files the model was trained on: left out of the calibration and of SQuAD 1.1 "
                        "dev's figures (by article title)")
    args = parser.parse_args()
    need_files(parser, args.data, *EVALUATION_FILES)
    if args.long_documents is not None:
        args.long_documents = Path(args.long_documents or args.data / LONG_DOCUMENTS)
    if args.long_sample < 1:
        parser.error(f"--long-sample: give a number of questions of at least 1, not {args.long_sample}")
    if args.long_documents is not None and not args.long_documents.is_file():
        parser.error(f"--long-documents: no {args.long_documents}")
    logging.basicConfig(level=logging.WARNING)
    folder = Path(args.model)
    predictor = Predictor.load(load_registry(entry_points=False).task("qa"), str(folder))
    key = hashlib.sha256((folder / "adapter.safetensors").read_bytes()).hexdigest()[:12]
    cache = args.report.parent / f"qa_predictions_{key}"

    try:  # checked before the minutes of predicting
        trained_ids, trained_titles = trained_on(args.trained_on)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"error: --trained-on: not a readable SQuAD file ({err})") from None
    v2_ids = [i for i, _ in question_keys(args.data / "squad" / "dev-v2.0.json")]
    if trained_ids & set(v2_ids[len(v2_ids) // 2:]):
        raise SystemExit("error: --trained-on holds questions of the held-out half B of SQuAD 2.0 dev")
    v2 = predictions(predictor, args.data / "squad" / "dev-v2.0.json", "dev", cache / "dev-v2.0.json")
    half = len(v2) // 2
    calibration, heldout = v2[:half], v2[half:]
    calibration = [row for row, i in zip(calibration, v2_ids) if i not in trained_ids]
    rows_a = [features(x["question"], x["context"], r) for x, _, r in calibration]
    verifier = fit(rows_a, [int(t["answers"] == [""]) for _, t, _ in calibration])

    def verified(x, r):
        return no_answer_probability(features(x["question"], x["context"], r), verifier)

    def gap(x, r):
        g = r["no_answer"]["null_gap"]
        return math.inf if g is None else g

    others = {name: predictions(predictor, path, "dev", cache / path.name) for name, path in (
        ("SQuAD 1.1 dev", args.data / "squad" / "dev-v1.1.json"), ("QED dev", args.data / "qed" / "qed-dev.squad.json"))}
    if args.long_documents is not None:
        others.update(long_document_sample(predictor, args.long_documents, args.long_sample,
                                           cache / f"{args.long_documents.stem}-sample{args.long_sample}.json"))
    if trained_titles:
        v1_titles = [t for _, t in question_keys(args.data / "squad" / "dev-v1.1.json")]
        others["SQuAD 1.1 dev"] = [row for row, t in zip(others["SQuAD 1.1 dev"], v1_titles) if t not in trained_titles]
    answerable = {path.name: predictions(predictor, path, "train", cache / path.name) for path in args.answerable}
    report = {"model": str(folder), "calibration_questions": len(calibration), "heldout_questions": len(heldout),
              "trained_on": [str(p) for p in args.trained_on], "SQuAD 1.1 dev questions": len(others["SQuAD 1.1 dev"]),
              "answerable_calibration": {name: len(rows) for name, rows in answerable.items()},
              "features": list(FEATURES), "verifier": verifier, "rules": {}}
    for name, score in (("null gap", gap), ("verifier", verified)):
        rows = scored(calibration, score)
        cut = thresholds(rows, [scored(extra, score) for extra in answerable.values()])
        held = scored(heldout, score)
        rule = {"thresholds": cut,
                "heldout_auc": auc([s for s, _, n in held if n], [s for s, _, n in held if not n]),
                "calibration_auc": auc([s for s, _, n in rows if n], [s for s, _, n in rows if not n]),
                "heldout": {p: at(held, cut[p]) for p in PRESETS}}
        for other, data in others.items():
            rule[other] = {p: at(scored(data, score), cut[p]) for p in PRESETS}
        report["rules"][name] = rule
    # Per feature alone, on the held-out half (oriented: higher = no answer, or flipped if below 0.5)
    singles = {}
    labels = [t["answers"] == [""] for _, t, _ in heldout]
    for i, name in enumerate(FEATURES):
        values = [features(x["question"], x["context"], r)[i] for x, _, r in heldout]
        singles[name] = auc([v for v, n in zip(values, labels) if n], [v for v, n in zip(values, labels) if not n])
    report["feature_heldout_auc"] = singles
    # v1.1's span answers alone, no threshold (the ceiling a threshold can keep)
    report["SQuAD 1.1 dev F1 with no threshold"] = 100 * sum(
        max(f1_score(r["answers"][0]["answer"] if r["answers"] else "", t) for t in tg["answers"])
        for _, tg, r in others["SQuAD 1.1 dev"]) / len(others["SQuAD 1.1 dev"])
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "verifier"}, indent=1))
    if args.write_pack:
        manifest_path = folder / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        rule = report["rules"]["verifier"]
        options = manifest.setdefault("options", {})
        options.pop("null_threshold", None)  # the verifier decides; null_threshold stays a caller's option
        options["answerability"] = {**verifier, "presets": {p: round(v, 6) for p, v in rule["thresholds"].items()}}
        options["no_answer"] = args.preset
        manifest["no_answer_calibration"] = {k: v for k, v in report.items() if k not in ("verifier", "model")}
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"wrote the verifier and the {args.preset!r} threshold into {manifest_path}")


if __name__ == "__main__":
    main()
