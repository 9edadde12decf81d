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
from qa_calibrate import auc  # this folder's: one ROC AUC for both scripts
from tqdm import tqdm

from bert_engine.heads import SpanOutput
from bert_engine.model import encoder_of
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import qa
from plugins.qa_answerability import features
from plugins.qa_data import read_data

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def predict_with_cls(predictor, items: list[dict], max_rows: int = 32) -> tuple[list[dict], torch.Tensor]:
    """qa.predict_many's answers, and each item's [CLS] vector from its first window, (N, hidden)."""
    options = predictor.check_options({"null_threshold": None, "top_k": 1})
    batches = [qa.preprocess(item, predictor.tokenizer, **options) for item in items]
    order = sorted(range(len(items)), key=lambda i: batches[i].input_ids.shape[1])
    groups, group, rows = [], [], 0
    for i in order:
        if group and rows + len(batches[i]) > max_rows:
            groups.append(group)
            group, rows = [], 0
        group.append(i)
        rows += len(batches[i])
    groups += [group] if group else []
    captured: list[torch.Tensor] = []
    hook = encoder_of(predictor.model).register_forward_hook(
        lambda module, args, out: captured.append(out.last_hidden_state[:, 0].float().cpu()))
    results: list = [None] * len(items)
    cls = torch.zeros(len(items), encoder_of(predictor.model).config.hidden_size)
    pad = predictor.tokenizer.pad_token_id
    try:
        for group in tqdm(groups, desc="qa", unit="batch"):
            parts = [batches[i] for i in group]
            inputs = {"input_ids": qa._padded(parts, "input_ids", pad), "attention_mask": qa._padded(parts, "attention_mask", 0),
                      "token_type_ids": qa._padded(parts, "token_type_ids", 0)}
            captured.clear()
            output = predictor.forward_rows(inputs)
            vectors = torch.cat(captured)
            starts, ends = output.start_logits.float().cpu(), output.end_logits.float().cpu()
            row = 0
            for i in group:
                n, t = len(batches[i]), batches[i].input_ids.shape[1]
                results[i] = qa.postprocess(SpanOutput(starts[row:row + n, :t], ends[row:row + n, :t]), batches[i],
                                            **options)
                cls[i] = vectors[row]
                row += n
    finally:
        hook.remove()
    return results, cls


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
            s = score(model, x[held])
            labels = y[held].tolist()
            aucs.append(auc([v for v, n in zip(s, labels) if n], [v for v, n in zip(s, labels) if not n]))
        mean_auc = sum(aucs) / folds
        if mean_auc > best_auc:
            best, best_auc = l2, mean_auc
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the QA checkpoint folder (a pack)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--report", type=Path, default=Path("runs/qa_cls_verifier.json"))
    args = parser.parse_args()
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
        s, labels = score(model, x[half:]), y[half:].tolist()
        report["variants"][name] = {"l2": l2, "heldout_auc": auc([v for v, n in zip(s, labels) if n],
                                                                 [v for v, n in zip(s, labels) if not n])}
        print(f"{name}: L2 {l2:g} (5-fold CV on half A), ROC AUC on half B {report['variants'][name]['heldout_auc']:.3f}")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
