"""QA's host work for a file of questions, per question: what runs on the CPU around the forward pass, which is
all a GPU leaves (session 50's H200: the engine's QA behind transformers' at 0.81x while every other task was
ahead). The shipped starter on the first N SQuAD v1.1 dev questions, in interleaved rounds:

    python -m benchmarks.qa_host [--questions 1000] [--rounds 5] [--json OUT]

- preprocess, one at a time: `plugins.qa.preprocess` per question (two tokenizer calls each), as before session 50;
- preprocess, all at once: `plugins.qa.preprocess_many` (what `predict_many` runs: two calls for the whole file);
- postprocess: the span search and the "no answer" verifier of each question, on logits computed once.

Medians of the rounds, in ms a question. Run it alone: other work on the cores moves every column.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "squad" / "dev-v1.1.json"


def measure(questions: int, rounds: int, data: Path) -> dict:
    import plugins.qa as qa
    from bert_engine.heads import SpanOutput
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry
    from bert_engine.tokenizer import Batch

    task = load_registry(entry_points=False).task("qa")
    items = [x for x, _ in list(task.spec.read_data(str(data)))[:questions]]
    predictor = Predictor.load(task).get()
    options, tokenizer = predictor.check_options({}), predictor.tokenizer
    batches = qa.preprocess_many(items, tokenizer, **options)
    logits = []
    with torch.inference_mode():
        for group in qa.window_groups(batches, 32):
            out = predictor.forward_rows(Batch.stacked([batches[i] for i in group], tokenizer.pad_token_id).model_inputs())
            row = 0
            for i in group:
                n, width = len(batches[i]), batches[i].input_ids.shape[1]
                logits.append((i, SpanOutput(out.start_logits[row:row + n, :width].float(),
                                             out.end_logits[row:row + n, :width].float())))
                row += n
    steps = {
        "preprocess, one at a time": lambda: [qa.preprocess(item, tokenizer, **options) for item in items],
        "preprocess, all at once": lambda: qa.preprocess_many(items, tokenizer, **options),
        "postprocess": lambda: [qa.postprocess(output, batches[i], **options) for i, output in logits],
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(1e3 * (time.perf_counter() - start) / len(items))
    return {"questions": len(items), "rounds": rounds, "threads": torch.get_num_threads(),
            "ms_per_question": {name: round(statistics.median(v), 3) for name, v in times.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data", type=Path, default=DATA, help=f"SQuAD v1.1 dev (default: {DATA})")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data: no file at {args.data} (SQuAD v1.1 dev, in the shared data folder)")
    if args.questions < 1 or args.rounds < 1:
        parser.error("--questions and --rounds must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    result = {"machine": machine(), **measure(args.questions, args.rounds, args.data)}
    print(f"# QA's host work, {result['questions']} SQuAD dev questions x {result['rounds']} rounds, "
          f"{result['machine']['cpu']} ({result['machine']['cpu_class']})")
    print("| step | median ms a question |\n|---|---|")
    for name, ms in result["ms_per_question"].items():
        print(f"| {name} | {ms} |")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
