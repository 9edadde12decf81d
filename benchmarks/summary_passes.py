"""A summary visitor's request split into its passes, the engine beside transformers (in this process) on the same
inputs: the BertSum windows of one article, then its sentences each alone (the centroid pass), and the shared
steps (pysbd's sentences and the tokenizer), over the first N articles of the BBC News test split.

    python -m benchmarks.summary_passes [--articles 40] [--rounds 2] [--json OUT]

transformers runs each pass as `benchmarks/summary_reference.py` does (32 rows a forward, each padded to its
longest); the engine runs its encoder on the same padded batch (its own path: the real tokens alone). Medians and
means in ms, and the token rows each side computes. Run it alone: other work on the cores moves every column.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "bbc_news_summary" / "bbc_news_summary.jsonl"


def measure(articles: int, rounds: int, data: Path) -> dict:
    import transformers

    import plugins.summary as summary
    from benchmarks.summary_reference import chunks
    from benchmarks.workloads import merged_folder
    from bert_engine.model import encoder_of
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task("summary")
    texts = [x["text"] for x, _ in list(task.spec.read_data(str(data), "test"))[:articles]]
    with tempfile.TemporaryDirectory() as tmp:
        folder = merged_folder("summary", Path(tmp))
        engine = Predictor.load(task, str(folder))
        model = transformers.BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
    options = engine.check_options({})
    encoder = encoder_of(engine.model)
    times: dict[str, list[float]] = {k: [] for k in ("shared: sentences + tokens", "engine: windows", "transformers: windows",
                                                     "engine: sentences alone", "transformers: sentences alone",
                                                     "engine: whole request")}
    rows = {"windows, real tokens": 0, "windows, padded": 0, "sentences, real tokens": 0, "sentences, padded": 0}

    def clock(name: str, function, *args, **kwargs) -> None:
        start = time.perf_counter()
        function(*args, **kwargs)
        times[name].append(1e3 * (time.perf_counter() - start))

    def reference(inputs: dict) -> None:
        for _, part in chunks(inputs):
            model(**part)

    with torch.inference_mode():
        for round_ in range(rounds):
            for text in texts:
                clock("shared: sentences + tokens", summary.preprocess, {"text": [text]}, engine.tokenizer, **options)
                windows = summary.preprocess({"text": [text]}, engine.tokenizer, **options)
                alone = summary.centroid_batch(engine.tokenizer, [text], windows.meta["spans"], 512, -1)
                clock("engine: windows", encoder, **windows.model_inputs())
                clock("transformers: windows", reference, windows.model_inputs())
                clock("engine: sentences alone", encoder, **alone.model_inputs())
                clock("transformers: sentences alone", reference, alone.model_inputs())
                clock("engine: whole request", engine.predict, {"text": text})
                if round_ == 0:
                    for key, batch in (("windows", windows), ("sentences", alone)):
                        rows[f"{key}, real tokens"] += int(batch.attention_mask.sum())
                        rows[f"{key}, padded"] += sum(part["input_ids"].numel() for _, part in chunks(batch.model_inputs()))
    return {"articles": len(texts), "rounds": rounds, "rows": rows,
            "ms": {name: {"median": round(statistics.median(v), 1), "mean": round(statistics.fmean(v), 1)}
                   for name, v in times.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--articles", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=DATA, help=f"BBC News Summary JSON lines (default: {DATA})")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data: no file at {args.data} (the BBC News Summary JSON lines of the shared data folder)")
    if args.articles < 1 or args.rounds < 1:
        parser.error("--articles and --rounds must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    result = {"machine": machine(), **measure(args.articles, args.rounds, args.data)}
    print(f"# a summary visitor's passes, {result['articles']} articles x {result['rounds']} rounds, {result['machine']['cpu']}")
    print("| step | median ms | mean ms |\n|---|---|---|")
    for name, figures in result["ms"].items():
        print(f"| {name} | {figures['median']} | {figures['mean']} |")
    print("token rows: " + ", ".join(f"{k} {v:,}" for k, v in result["rows"].items()))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
