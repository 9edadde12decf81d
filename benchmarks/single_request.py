"""Where a visitor's single request spends its time: the whole `Predictor.predict` call against the model's
forward pass alone on the same tokens, per task, over the first N items of its dev/test data.

    python -m benchmarks.single_request [--tasks sentiment,ner] [--items 100] [--repeats 3] [--json OUT]
    python -m benchmarks.single_request --tasks sentiment --data FILE --split all   # another file of one task

Each item is predicted as a visitor's request (one text, the starter model, default options), then the
model's forward is timed on that item's tokens alone. Reported: p50 of each and the difference, the time
spent outside the encoder (tokenising, batching, the task's decoding: the CRF for NER, and the result's
building), and of that the task's postprocess alone (the CRF and the words' grouping for NER). Run it
alone: other work on the cores moves every column.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine, print_table, task_names, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SOURCES = {"sentiment": ("sst2/dev.tsv", "dev"), "ner": ("conll2003/eng.testb", "test"),
           "qa": ("squad/dev-v1.1.json", "dev")}


def measure(name: str, items: int, repeats: int, data: tuple[str, str] | None = None) -> dict:
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task(name)
    path, split = data or (str(DATA / SOURCES[name][0]), SOURCES[name][1])
    inputs = [dict(x) for x, _ in list(task.spec.read_data(path, split))[:items]]
    predictor = Predictor.load(task)
    for item in inputs[:20]:  # warm-up
        predictor.predict(item)
    whole, forward, decoding = [], [], []
    options = predictor.check_options({})
    for _ in range(repeats):
        for item in inputs:
            start = time.perf_counter()
            predictor.predict(item)
            whole.append(time.perf_counter() - start)
            batch = task.spec.preprocess(item, predictor.tokenizer, **options)
            with torch.inference_mode():
                start = time.perf_counter()
                output = predictor.model(**batch.model_inputs())
                forward.append(time.perf_counter() - start)
                start = time.perf_counter()
                task.spec.postprocess(output, batch, **options)
                decoding.append(time.perf_counter() - start)
    request, encoder = 1e3 * statistics.median(whole), 1e3 * statistics.median(forward)
    return {"task": name, "items": len(inputs), "request_p50_ms": round(request, 2),
            "forward_p50_ms": round(encoder, 2), "outside_ms": round(request - encoder, 2),
            "outside_share": round((request - encoder) / request, 3),
            "postprocess_p50_ms": round(1e3 * statistics.median(decoding), 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="sentiment,ner", help=f"comma-separated: {', '.join(SOURCES)}")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default=None, help="with one task: its items from this file instead")
    parser.add_argument("--split", default="all", help="the split of --data (default: all)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = task_names(parser, args.tasks, SOURCES)
    if args.data and len(names) != 1:
        parser.error("--data needs exactly one task in --tasks")
    data = (args.data, args.split) if args.data else None
    rows = [measure(name, args.items, args.repeats, data) for name in names]
    info = machine()
    print(f"# a visitor's single request, {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads")
    print_table(rows, list(rows[0]))
    write_json(args.json, {"machine": info, "rows": rows})


if __name__ == "__main__":
    main()
