"""Issue 35's answerability head, tried as a verifier: does the QA model's own [CLS] vector (its last
layer, the position the span head reads "no answer" from) separate SQuAD 2.0's unanswerable questions
better than the shipped verifier's ten features?

    python scripts/qa_cls_verifier.py --model plugins/starter/qa [--report runs/qa_cls_verifier.json]

Predicts every SQuAD 2.0 dev question once (no threshold), keeping each question's [CLS] vector
(its first window's; most SQuAD contexts fit one), and fits three logistic regressions on half A
(the first 5,936 questions, as scripts/qa_calibrate.py) with the L2 strength chosen by 5-fold
cross-validation inside half A: the ten features, the [CLS] vector alone, and both. Reports each one's
ROC AUC on half B (held out: never fitted or tuned on). A measurement, not a shipped decision.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from qa_calibrate import auc, need_files  # this folder's: one ROC AUC for both scripts

from bert_engine.model import encoder_of
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import qa
from plugins.qa_answerability import features
from plugins.qa_data import read_data

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def predict_with_cls(predictor, items: list[dict]) -> tuple[list[dict], torch.Tensor]:
    """qa.predict_many's answers (no threshold), and each item's [CLS] vector from its first window, (N, hidden):
    the encoder's outputs, caught by a hook, come in predict_many's order (qa.window_groups)."""
    options = {"null_threshold": None, "top_k": 1}
    # tokenised once more here (seconds, beside minutes of forward passes) for each input's window count
    checked = predictor.check_options(options)
    batches = [qa.preprocess(item, predictor.tokenizer, **checked) for item in items]
    captured: list[torch.Tensor] = []
    hook = encoder_of(predictor.model).register_forward_hook(
        lambda module, args, out: captured.append(out.last_hidden_state[:, 0].float().cpu()))
    try:
        results = qa.predict_many(predictor, items, progress=True, **options)
    finally:
        hook.remove()
    rows, first, row = torch.cat(captured), torch.zeros(len(items), dtype=torch.long), 0
    for i in (i for group in qa.window_groups(batches) for i in group):
        first[i] = row
        row += len(batches[i])
    if row != len(rows):
        raise RuntimeError(f"caught {len(rows)} encoder rows for {row} windows: predict_many's order changed")
    return results, rows[first]


def labelled_auc(scores: list[float], labels: list[float]) -> float:
    """ROC AUC of scores where label 1 (no answer) is the positive class."""
    return auc([v for v, n in zip(scores, labels) if n], [v for v, n in zip(scores, labels) if not n])


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised L2 logistic regression by L-BFGS: (mean, scale, weights with the bias last)."""
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    z = torch.cat([(x - mean) / scale, torch.ones(len(x), 1)], 1).double()
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")
    target = y.double()

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w, target) + l2 * (w[:-1] ** 2).sum() / len(z)
        loss.backward()
        return loss

    optimiser.step(closure)
    return mean, scale, w.detach()


def score(model, x: torch.Tensor) -> list[float]:
    mean, scale, w = model
    return (torch.cat([(x - mean) / scale, torch.ones(len(x), 1)], 1).double() @ w).tolist()


def chosen_l2(x: torch.Tensor, y: torch.Tensor, grid=(0.1, 1.0, 10.0, 100.0, 1000.0), folds: int = 5) -> float:
    """The L2 strength with the best mean ROC AUC over `folds` contiguous folds of (x, y)."""
    bounds = [len(x) * k // folds for k in range(folds + 1)]
    best, best_auc = grid[0], -1.0
    for l2 in grid:
        aucs = []
        for k in range(folds):
            held = torch.zeros(len(x), dtype=torch.bool)
            held[bounds[k]:bounds[k + 1]] = True
            model = fit_logistic(x[~held], y[~held], l2)
            aucs.append(labelled_auc(score(model, x[held]), y[held].tolist()))
        mean_auc = sum(aucs) / folds
        if mean_auc > best_auc:
            best, best_auc = l2, mean_auc
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the QA checkpoint folder (a pack)")
    parser.add_argument("--data", type=Path, default=DATA,
                        help=f"the datasets folder holding squad/ (and qed/) (default: {DATA})")
    parser.add_argument("--report", type=Path, default=Path("runs/qa_cls_verifier.json"))
    args = parser.parse_args()
    need_files(parser, args.data, "squad/dev-v2.0.json")
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    predictor = Predictor.load(load_registry(entry_points=False).task("qa"), args.model)
    examples = list(read_data(args.data / "squad" / "dev-v2.0.json", "dev"))
    results, cls = predict_with_cls(predictor, [x for x, _ in examples])
    y = torch.tensor([float(t["answers"] == [""]) for _, t in examples])
    feats = torch.tensor([features(x["question"], x["context"], r) for (x, _), r in zip(examples, results)])
    half = len(examples) // 2
    report = {"model": args.model, "calibration_questions": half, "heldout_questions": len(examples) - half,
              "variants": {}}
    for name, x in (("ten features", feats), ("[CLS] vector", cls), ("both", torch.cat([feats, cls], 1))):
        l2 = chosen_l2(x[:half], y[:half])
        model = fit_logistic(x[:half], y[:half], l2)
        report["variants"][name] = {"l2": l2, "heldout_auc": labelled_auc(score(model, x[half:]), y[half:].tolist())}
        print(f"{name}: L2 {l2:g} (5-fold CV on half A), ROC AUC on half B {report['variants'][name]['heldout_auc']:.3f}")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
