"""Real workloads end to end (tokenise -> encode -> postprocess): bert_engine vs transformers.

    python -m benchmarks.workloads                          # sentiment, ner, qa on ../shared/data
    python -m benchmarks.workloads --tasks sentiment --repeats 3 --json out.json
    python -m benchmarks.workloads --precisions fp32,int8   # also the engine's faster CPU modes

Both sides run the same weights: each starter model (LoRA adapter + head on MiniLM) is merged
and saved once in the Hugging Face layout, and both implementations load that folder.

- sentiment: SST-2 dev (872 sentences); reference: `pipeline("text-classification")`.
- ner: CoNLL-2003 eng.testb (3,453 sentences); reference: `pipeline("token-classification",
  aggregation_strategy="first")`. Its argmax decoding is compared with the engine's argmax
  tags (`words[*].argmax`) grouped the same way; the engine's default CRF decoding is a different
  algorithm, so its entity F1 is reported beside it rather than compared. The starter's `casing`
  marks (segment ids on capitalised words) are left off on both sides: transformers' pipeline
  cannot add them, so the F1 here is that model reading text without them, not its testb figure.
- qa: the first N questions of SQuAD dev-v1.1; transformers 5 dropped its QA pipeline, so the
  reference is BertForQuestionAnswering with the decoding of transformers' `run_qa` example
  (windows of 384 tokens, stride 128, best start + end logit over all windows, answers of at most
  30 tokens inside the context).

Both sides get batches of 32. Reported: seconds (median of the repeats, run in turn), items/s, the
speed-up, the share of identical predictions, and each side's task metric.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BATCH = 32


def merged_folder(task_name: str, workdir: Path) -> Path:
    """The task's starter model (adapter merged into MiniLM) saved in the Hugging Face layout."""
    from bert_engine.checkpoints.loader import load
    from bert_engine.checkpoints.loading import save_pretrained
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task(task_name)
    if task.spec.default_checkpoint is None:
        raise SystemExit(f"task {task_name!r} has no starter model in plugins/starter/; build it first")
    folder = workdir / task_name
    model, tokenizer = load(task.spec.default_checkpoint, task.spec.build_head)
    save_pretrained(model, folder, tokenizer)
    return folder


# -- sentiment ---------------------------------------------------------------------------------------

def sentiment(folder: Path, data: Path, precision: str, limit: int | None):
    import transformers

    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task("sentiment")
    examples = list(task.spec.read_data(str(data / "sst2" / "dev.tsv"), "test"))[:limit]
    texts, gold = [x["text"] for x, _ in examples], [t for _, t in examples]
    engine = Predictor.load(task, str(folder), precision=precision)
    reference = transformers.pipeline("text-classification", model=str(folder), device=-1, batch_size=BATCH)
    out = {}

    def run_engine():
        out["engine"] = [r["label_id"] for r in predict_texts(engine, texts, batch_size=BATCH)]

    def run_reference():
        label2id = reference.model.config.label2id
        out["reference"] = [label2id[r["label"]] for r in reference(texts, truncation=True)]

    def accuracy(label_ids):
        return 100 * sum(label == g for label, g in zip(label_ids, gold)) / len(gold)

    return len(texts), run_engine, run_reference, out, lambda side: {"accuracy": accuracy(out[side])}


# -- ner -----------------------------------------------------------------------------------------------

def ner(folder: Path, data: Path, precision: str, limit: int | None):
    import transformers

    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry
    task = load_registry(entry_points=False).task("ner")
    examples = list(task.spec.read_data(str(data / "conll2003" / "eng.testb"), "test"))[:limit]
    texts = [x["text"] for x, _ in examples]
    engine = Predictor.load(task, str(folder), precision=precision)
    reference = transformers.pipeline("token-classification", model=str(folder), device=-1, batch_size=BATCH,
                                      aggregation_strategy="first")
    out = {}

    def run_engine():
        results = predict_texts(engine, texts, batch_size=BATCH)
        out["engine_crf"] = [sorted((e["start"], e["end"], e["type"]) for e in r["entities"]) for r in results]
        out["engine"] = [_argmax_entities(r["words"]) for r in results]

    def run_reference():
        out["reference"] = [sorted((e["start"], e["end"], e["entity_group"]) for e in r) for r in reference(texts)]

    def score(side):
        report = {}
        for key in (side, "engine_crf") if side == "engine" else (side,):
            found = [set(p) for p in out[key]]
            gold = [set(_gold_entities(x, t)) for x, t in examples]
            tp = sum(len(f & g) for f, g in zip(found, gold))
            p, r = tp / max(1, sum(map(len, found))), tp / max(1, sum(map(len, gold)))
            report["f1" if key != "engine_crf" else "crf_f1"] = 100 * 2 * p * r / max(p + r, 1e-9)
        return report

    return len(texts), run_engine, run_reference, out, score


def _argmax_entities(words: list[dict]) -> list[tuple[int, int, str]]:
    """Entities from per-word argmax tags, grouped as the pipeline's aggregation does: a B- or a new type
    starts an entity, I- of the same type continues it (an I- after O or another type starts one)."""
    entities, current = [], None
    for w in words:
        tag = w["argmax"]
        if tag == "O":
            current = None
            continue
        prefix, kind = tag.split("-", 1)
        if current is not None and prefix == "I" and current[2] == kind:
            current[1] = w["end"]
        else:
            current = [w["start"], w["end"], kind]
            entities.append(current)
    return sorted(tuple(e) for e in entities)


def _gold_entities(inputs: dict, target) -> list[tuple[int, int, str]]:
    """The gold entities of a read_data example as (start, end, type) character spans."""
    from plugins.tagging import chunks

    spans, start = [], 0
    for word in target["words"]:  # read_data joins the words with single spaces
        spans.append((start, start + len(word)))
        start += len(word) + 1
    assert " ".join(target["words"]) == inputs["text"]
    return [(spans[b][0], spans[e - 1][1], kind) for b, e, kind in chunks(target["tags"])]


# -- qa ------------------------------------------------------------------------------------------------

def qa(folder: Path, data: Path, precision: str, limit: int | None):
    import transformers

    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry
    from plugins.qa import predict_many
    from plugins.qa_metric import squad_scores

    task = load_registry(entry_points=False).task("qa")
    examples = list(task.spec.read_data(str(data / "squad" / "dev-v1.1.json")))[:limit or 1000]
    items, golds = [x for x, _ in examples], [t["answers"] for _, t in examples]
    engine = Predictor.load(task, str(folder), precision=precision)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.BertForQuestionAnswering.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    out = {}

    def run_engine():
        out["engine"] = [r["answer"] or "" for r in predict_many(engine, items, max_rows=BATCH)]

    def run_reference():
        out["reference"] = reference_qa(model, tokenizer, items)

    return len(items), run_engine, run_reference, out, lambda side: {"f1": squad_scores(out[side], golds)["f1"]}


def reference_qa(model, tokenizer, items, max_length=384, stride=128, max_answer_len=30, n_best=20) -> list[str]:
    """transformers' run_qa decoding: windows per question, windows batched 32 at a time in input
    order, the best start + end logit sum over every window of a question."""
    encoded = tokenizer([x["question"] for x in items], [x["context"] for x in items], truncation="only_second",
                        max_length=max_length, stride=stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True, padding="longest")
    starts, ends = [], []
    with torch.inference_mode():
        for i in range(0, len(encoded["input_ids"]), BATCH):
            batch = {k: torch.tensor(encoded[k][i:i + BATCH]) for k in ("input_ids", "attention_mask", "token_type_ids")}
            output = model(**batch)
            starts += output.start_logits.tolist()
            ends += output.end_logits.tolist()
    best: dict[int, tuple[float, str]] = {}
    for row, sample in enumerate(encoded["overflow_to_sample_mapping"]):
        offsets, sequence_ids = encoded["offset_mapping"][row], encoded.sequence_ids(row)
        s_top = sorted(range(len(offsets)), key=lambda t: -starts[row][t])[:n_best]
        e_top = sorted(range(len(offsets)), key=lambda t: -ends[row][t])[:n_best]
        for s in s_top:
            for e in e_top:
                if sequence_ids[s] != 1 or sequence_ids[e] != 1 or e < s or e - s + 1 > max_answer_len:
                    continue
                score = starts[row][s] + ends[row][e]
                if sample not in best or score > best[sample][0]:
                    context = items[sample]["context"]
                    best[sample] = (score, context[offsets[s][0]:offsets[e][1]])
    return [best.get(i, (0.0, ""))[1] for i in range(len(items))]


TASKS = {"sentiment": sentiment, "ner": ner, "qa": qa}


def run(tasks: list[str], precisions: list[str], repeats: int, data: Path, limit: int | None, workdir: Path) -> dict:
    rows = []
    for name in tasks:
        folder = merged_folder(name, workdir)
        for precision in precisions:
            n, run_engine, run_reference, out, score = TASKS[name](folder, data, precision, limit)
            contenders = {"engine": run_engine} if precision != "fp32" else {"engine": run_engine,
                                                                             "transformers": run_reference}
            if precision != "fp32":
                run_reference()  # predictions to compare with, not timed again
            times = interleaved(contenders, repeats, warmup=1)  # first calls build kernels and caches
            same = sum(a == b for a, b in zip(out["engine"], out["reference"])) / n
            for impl, ts in times.items():
                side = "engine" if impl == "engine" else "reference"
                rows.append({"task": name, "impl": impl, "precision": precision, "items": n, "s": median(ts),
                             "items_per_s": n / median(ts), "identical": 100 * same if impl == "engine" else None,
                             **{k: round(v, 2) for k, v in score(side).items()}})
    reference = {r["task"]: r["s"] for r in rows if r["impl"] == "transformers"}
    for r in rows:
        r["speedup"] = reference[r["task"]] / r["s"] if r["task"] in reference else None
    return {"machine": machine(), "repeats": repeats, "batch_size": BATCH, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="sentiment,ner,qa")
    parser.add_argument("--precisions", default="fp32", help="engine precisions: fp32 (always compared), bf16, int8")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per contender, run in turn")
    parser.add_argument("--data", default=str(DATA), help="the shared data folder (default: ../shared/data)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N items per task (qa: default 1000)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    precisions = ["fp32"] + [p for p in args.precisions.split(",") if p and p != "fp32"]
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.tasks.split(","), precisions, args.repeats, Path(args.data), args.limit, Path(tmp))
    info = result["machine"]
    print(f"# end-to-end workloads, {info['cpu']}, {info['threads']} threads, torch {info['torch']}, "
          f"transformers {info.get('transformers')}; batch {BATCH}; median of {args.repeats}")
    print_table(result["rows"], ["task", "impl", "precision", "items", "s", "items_per_s", "speedup", "identical",
                                 "accuracy", "f1", "crf_f1"])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
