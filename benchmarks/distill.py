"""A distilled student next to its teacher: size, speed and the task metric retained.

    python -m benchmarks.distill --task sentiment --teacher plugins/starter/sentiment --student runs/distil-sst2/best
    python -m benchmarks.distill --task ner --teacher plugins/starter/ner --student runs/distil-ner/best

Both models answer the same evaluation data (SST-2 dev, CoNLL eng.testb by default) through the task's
batched path; their times are taken in turn (teacher, student, teacher, ...) in one process and the
medians compared. Speed is word pieces per second over the whole set, padding not counted: end to end
(tokenise, encode, postprocess: NER's Viterbi decoding does not shrink with the encoder) and for the
encoder alone on the same length-sorted batches of 32.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULTS = {"sentiment": ("sst2/dev.tsv", "dev", "accuracy"), "ner": ("conll2003/eng.testb", "test", "f1")}


def measure(task_name: str, teacher: str, student: str, data: Path, split: str, limit: int | None,
            repeats: int) -> dict:
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.evaluation import evaluate_task, read_examples
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task(task_name)
    spec = task.spec
    examples = read_examples(spec, str(data), split, limit)
    texts = [inputs["text"] for inputs, _ in examples]
    metric = DEFAULTS[task_name][2]
    models = {"teacher": Predictor.load(task, teacher), "student": Predictor.load(task, student)}
    tokens = int(models["teacher"].tokenizer(texts, truncation=None).attention_mask.sum())
    rows = []
    for name, predictor in models.items():
        scores = evaluate_task(spec, predictor, examples)
        config = getattr(predictor.model, "encoder", predictor.model).config
        head = getattr(predictor.model, "head", None)
        # from the config: the CPU path packs the encoder's linear weights into buffers at load
        parameters = config.parameter_count() + (sum(p.numel() for p in head.parameters()) if head is not None else 0)
        rows.append({"model": name, "layers": config.num_hidden_layers, "parameters": parameters,
                     metric: scores[metric] * (100 if scores[metric] <= 1 else 1)})  # accuracy 0-1, F1 in %
    contenders = {name: (lambda p=p: spec.predict_many(p, texts)) for name, p in models.items()}
    batches = encoder_batches(models["teacher"].tokenizer, texts)
    encoders = {f"{name} encoder": (lambda p=p: [p.forward_rows(b) for b in batches]) for name, p in models.items()}
    with torch.inference_mode():
        times = interleaved({**contenders, **encoders}, repeats, warmup=1)
    for row in rows:
        row["s"] = median(times[row["model"]])
        row["tokens_per_s"] = tokens / row["s"]
        row["encoder_tokens_per_s"] = tokens / median(times[f"{row['model']} encoder"])
    teacher_row, student_row = rows
    student_row["speedup"] = teacher_row["s"] / student_row["s"]
    student_row["encoder_speedup"] = student_row["encoder_tokens_per_s"] / teacher_row["encoder_tokens_per_s"]
    student_row["retained"] = 100 * student_row[metric] / teacher_row[metric]
    student_row["size"] = student_row["parameters"] / teacher_row["parameters"]
    return {"machine": machine(), "task": task_name, "data": str(data), "split": split, "items": len(texts),
            "tokens": tokens, "repeats": repeats, "metric": metric, "rows": rows}


def encoder_batches(tokenizer, texts: list[str], size: int = 32) -> list[dict]:
    """The texts as model inputs in batches of `size`, sorted by length (as the batched path does): the
    model alone, without tokenising or postprocessing, for the encoder's share of the time."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches = []
    for start in range(0, len(order), size):
        batch = tokenizer([texts[i] for i in order[start:start + size]])
        batches.append({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                        "token_type_ids": batch.token_type_ids})
    return batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(DEFAULTS), required=True)
    parser.add_argument("--teacher", required=True, help="the teacher: a task model folder (e.g. the starter one)")
    parser.add_argument("--student", required=True, help="the distilled student (bert-engine distill's best/)")
    parser.add_argument("--data", default=None, help="evaluation data (default: SST-2 dev / CoNLL eng.testb)")
    parser.add_argument("--split", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    path, split, _ = DEFAULTS[args.task]
    result = measure(args.task, args.teacher, args.student, Path(args.data or DATA / path), args.split or split,
                     args.limit, args.repeats)
    info = result["machine"]
    print(f"# distillation, {args.task} on {result['items']} items ({result['tokens']:,} word pieces); {info['cpu']} "
          f"({info['cpu_capability']}), {info['threads']} threads, torch {info['torch']}; median of {args.repeats}")
    print_table(result["rows"], ["model", "layers", "parameters", "size", result["metric"], "retained", "s",
                                 "tokens_per_s", "speedup", "encoder_tokens_per_s", "encoder_speedup"])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
