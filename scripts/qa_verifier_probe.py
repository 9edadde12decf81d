"""Would a richer "no answer" verifier help? Verifier variants fitted on half A of SQuAD 2.0 dev, scored on half B.

    python scripts/qa_verifier_probe.py [--model plugins/starter/qa] [--report runs/qa_verifier_probe.json]

The shipped verifier (plugins/qa_answerability.py) is a logistic regression over ten features: the span head's
scores and words of the question the text never says. This script fits the same kind of regression over those
ten plus, in turn:
- `hidden`: the QA encoder's own last-layer states: [CLS] of the window with the lowest null score, the best
  span's first and last tokens, and the mean over the question's tokens (4 x 384 numbers: a linear probe, in the
  spirit of Retro-Reader's verifier over the reader's states);
- `similarity`: the base MiniLM's sentence embedding (all-MiniLM-L6-v2 is a sentence-similarity model; mean of the
  last layer, normalised): cosine of the question with the best span's sentence, with the paragraph's closest
  sentence, their difference, and whether the two are the same sentence (sentences split at . ! ? + space);
each of those alone with the ten, [CLS] alone with the ten, both with the ten, and the ten alone (the
shipped verifier's, the baseline): five variants.

Each variant's L2 weight is chosen by 5-fold cross-validation on half A (contiguous folds: whole articles stay
together), its thresholds ("eager": at most 5 % of half A's answerable refused, "balanced" 15 %, "cautious" half
A's best F1, as scripts/qa_calibrate.py sets them) read off the out-of-fold scores, and its weights refitted on
all of half A. Reported on half B: ROC AUC of P(no answer), and per preset F1, unanswerable caught, answerable
refused; on SQuAD 1.1 dev (less half A's articles, whose answerable questions half A holds) and QED dev:
answerable refused. Nothing here changes the pack. Predictions are cached as scripts/qa_calibrate.py caches them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qa_calibrate import DATA, at, auc, need_files, predictions, question_keys, scored, thresholds  # noqa: E402
from qa_cls_verifier import fit_logistic, score  # noqa: E402 - session 23's [CLS] probe: its regression, reused

from bert_engine import load  # noqa: E402
from bert_engine.checkpoints.hub import default_backbone  # noqa: E402
from bert_engine.runtime.inference import Predictor  # noqa: E402
from bert_engine.tasks.registry import load_registry  # noqa: E402
from bert_engine.tokenizer import Batch  # noqa: E402
from plugins import qa  # noqa: E402
from plugins.qa_answerability import features  # noqa: E402
from plugins.qa_windows import preprocess_many  # noqa: E402

FILES = {"v2": "squad/dev-v2.0.json", "v1": "squad/dev-v1.1.json", "qed": "qed/qed-dev.squad.json"}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
FOLDS = 5
L2 = (0.1, 1.0, 10.0, 100.0, 1000.0)  # qa_cls_verifier.chosen_l2's grid


def hidden_states(predictor, rows) -> np.ndarray:
    """Per question: [CLS] of its lowest-null window, the best span's first and last token, the question's mean
    (the QA encoder's last layer; zeros where there is no span)."""
    items = [x for x, _, _ in rows]
    options = predictor.check_options({})
    batches = preprocess_many(items, predictor.tokenizer, **options)
    captured: list[torch.Tensor] = []
    hook = predictor.model.head.register_forward_hook(
        lambda module, args, output: captured.append(args[0].last_hidden_state.float()))
    out = np.zeros((len(items), 4 * predictor.model.config.hidden_size), dtype=np.float32)
    try:
        for group in tqdm(qa.window_groups(batches), desc="hidden states", unit="batch"):
            output = predictor.forward_rows(Batch.stacked([batches[i] for i in group],
                                                          predictor.tokenizer.pad_token_id).model_inputs())
            states = torch.cat(captured)  # the forward's chunks, in row order
            captured.clear()
            null = (output.start_logits[:, 0] + output.end_logits[:, 0]).float()
            row = 0
            for i in group:
                batch, n = batches[i], len(batches[i])
                window = row + int(null[row:row + n].argmin())
                parts = [states[window, 0]]
                answers = rows[i][2]["answers"]
                zeros = torch.zeros_like(states[window, 0])
                span = [zeros, zeros]
                for k in range(n if answers else 0):  # the first window holding the best span
                    positions = batch.tokens_within(k, answers[0]["start"], answers[0]["end"], sequence=1)
                    if positions:
                        span = [states[row + k, positions[0]], states[row + k, positions[-1]]]
                        break
                parts += span
                question = [t for t, s in enumerate(batch.sequence_ids[window - row]) if s == 0]
                parts.append(states[window, question].mean(0))
                out[i] = torch.cat(parts).numpy()
                row += n
    finally:
        hook.remove()
    return out


def similarities(encoder, tokenizer, rows) -> np.ndarray:
    """Per question: cosine of the question with the best span's sentence, with the closest sentence, their
    difference, and whether those are one sentence (the base sentence-embedding model)."""
    texts: dict[str, int] = {}
    plan = []
    for x, _, result in rows:
        context = x["context"]
        bounds, start = [], 0
        for piece in SENTENCE_END.split(context):
            begin = context.find(piece, start)
            bounds.append((begin, begin + len(piece)))
            start = begin + len(piece)
        answers = result["answers"]
        at_answer = next((k for k, (b, e) in enumerate(bounds) if answers and b <= answers[0]["start"] < e), None)
        ids = [texts.setdefault(context[b:e], len(texts)) for b, e in bounds]
        plan.append((texts.setdefault(x["question"], len(texts)), ids, at_answer))
    ordered = sorted(texts, key=len)
    vectors = np.zeros((len(ordered), encoder.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for k in tqdm(range(0, len(ordered), 64), desc="sentence embeddings", unit="batch"):
            chunk = ordered[k:k + 64]
            inputs = tokenizer(chunk, max_length=128, truncation="longest_first").model_inputs()
            mask = inputs["attention_mask"].unsqueeze(-1).float()
            mean = (encoder(**inputs).last_hidden_state * mask).sum(1) / mask.sum(1)
            vectors[[texts[t] for t in chunk]] = torch.nn.functional.normalize(mean, dim=-1).numpy()
    out = []
    for question, ids, at_answer in plan:
        cosines = vectors[ids] @ vectors[question]
        best = int(cosines.argmax())
        answer = cosines[at_answer] if at_answer is not None else cosines[best]
        out.append([answer, cosines[best], answer - cosines[best], float(at_answer == best)])
    return np.asarray(out, dtype=np.float32)


def probe(name, columns, sets, half):
    """One variant: fitted on half A (L2 by cross-validation), thresholds from out-of-fold scores, scored."""
    v2_rows, v2_x = sets["v2"]
    x = torch.from_numpy(columns(v2_x)).double()
    labels = torch.tensor([float(t["answers"] == [""]) for _, t, _ in v2_rows], dtype=torch.float64)
    x_a, y_a = x[:half], labels[:half]
    folds = np.array_split(np.arange(half), FOLDS)
    best = None
    for l2 in L2:  # as qa_cls_verifier.chosen_l2, keeping each fold's held-out scores for the thresholds
        oof = np.zeros(half)
        for fold in folds:
            train = torch.from_numpy(np.setdiff1d(np.arange(half), fold))
            oof[fold] = score(fit_logistic(x_a[train], y_a[train], l2), x_a[torch.from_numpy(fold)])
        fold_auc = auc(list(oof[y_a.numpy() == 1]), list(oof[y_a.numpy() == 0]))
        if best is None or fold_auc > best[0]:
            best = (fold_auc, l2, oof)
    fold_auc, l2, oof = best
    model = fit_logistic(x_a, y_a, l2)

    def rows_of(rows, values):
        return [(float(v), span, none) for v, (_, span, none) in zip(values, scored(rows, lambda *_: 0.0))]

    cut = thresholds(rows_of(v2_rows[:half], oof))
    held = rows_of(v2_rows[half:], score(model, x[half:]))
    report = {"features": x.shape[1], "l2": l2, "half_A_out_of_fold_auc": round(fold_auc, 4),
              "half_B_auc": round(auc([s for s, _, n in held if n], [s for s, _, n in held if not n]), 4)}
    for preset in ("eager", "balanced", "cautious"):
        m = at(held, cut[preset])
        entry = {"half B F1": round(m["f1"], 1), "unanswerable caught %": round(100 * m["unanswerable_caught"], 1),
                 "answerable refused %": round(100 * m["answerable_refused"], 1)}
        for other in ("v1", "qed"):
            rows, other_x = sets[other]
            refused = at(rows_of(rows, score(model, torch.from_numpy(columns(other_x)).double())), cut[preset])
            entry[f"{other} refused %"] = round(100 * refused["answerable_refused"], 1)
        report[preset] = entry
    logging.getLogger(__name__).info("%s: half B AUC %.4f", name, report["half_B_auc"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="plugins/starter/qa",
                        help="the QA checkpoint folder, a pack (default: %(default)s)")
    parser.add_argument("--data", type=Path, default=DATA,
                        help=f"the datasets folder holding squad/ and qed/ (../shared/data beside the checkout; "
                             f"default: {DATA})")
    parser.add_argument("--report", type=Path, default=Path("runs/qa_verifier_probe.json"),
                        help="where the JSON report goes; the predictions are cached beside it (default: %(default)s)")
    args = parser.parse_args()
    need_files(parser, args.data, *FILES.values())
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = Path(args.model)
    predictor = Predictor.load(load_registry(entry_points=False).task("qa"), str(folder)).get()
    cache = args.report.parent / f"qa_predictions_{hashlib.sha256((folder / 'adapter.safetensors').read_bytes()).hexdigest()[:12]}"
    base = load(default_backbone())
    encoder = base.model.eval()
    sets = {}
    for name, file in FILES.items():
        rows = predictions(predictor, args.data / file, "dev", cache / Path(file).name)
        if name == "v1":  # half A's articles hold most of SQuAD 1.1 dev's questions of those articles
            titles = {t for _, t in question_keys(args.data / FILES["v2"])[:len(sets["v2"][0]) // 2]}
            keep = [t not in titles for _, t in question_keys(args.data / file)]
            rows = [row for row, k in zip(rows, keep) if k]
        ten = np.array([features(x["question"], x["context"], r) for x, _, r in rows], dtype=np.float32)
        sets[name] = (rows, np.hstack([ten, hidden_states(predictor, rows), similarities(encoder, base.tokenizer, rows)]))
    width = predictor.model.config.hidden_size * 4
    variants = {
        "ten features (the shipped verifier's)": lambda x: x[:, :10],
        "+ hidden states": lambda x: x[:, :10 + width],
        "+ [CLS] alone": lambda x: x[:, :10 + width // 4],
        "+ similarity": lambda x: np.hstack([x[:, :10], x[:, 10 + width:]]),
        "+ hidden states + similarity": lambda x: x,
    }
    half = len(sets["v2"][0]) // 2
    report = {"model": str(folder), "half_A": half, "half_B": len(sets["v2"][0]) - half,
              "SQuAD 1.1 dev questions (less half A's articles)": len(sets["v1"][0]),
              "variants": {name: probe(name, columns, sets, half) for name, columns in variants.items()}}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
