"""QA's host work for a file of questions, per question: what runs on the CPU around the forward pass, which is
all a GPU leaves (session 50's H200: the engine's QA behind transformers' at 0.81x while every other task was
ahead). The shipped starter on the first N SQuAD v1.1 dev questions, in interleaved rounds:

    python -m benchmarks.qa_host [--questions 1000] [--rounds 5] [--json OUT]

- preprocess, one at a time: `plugins.qa.preprocess` per question (two tokenizer calls each), as before session 50;
- preprocess, all at once: `plugins.qa.preprocess_many` (what `predict_many` runs: two calls for the whole file);
- postprocess: the span search and the "no answer" verifier of each question, on logits computed once;
- forward passes: every window through the encoder, in predict_many's groups of up to 32 rows, the logits
  back on the host (on a GPU: the transfer and its wait included);
- predict_many: the whole file as `plugins.qa.predict_many` answers it (the columns above, checks and glue).

`--device cuda --precision bf16` times them on a GPU (what session 50's 0.81x left unexplained); `--model` runs
another checkpoint than the starter; `--profile N` adds the N functions predict_many spends most time in
(cProfile, one extra pass; its overhead inflates them, so read them as shares).

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


def measure(questions: int, rounds: int, data: Path, *, device: str = "cpu", precision: str = "fp32",
            model: str | None = None, profile: int = 0) -> dict:
    import plugins.qa as qa
    from bert_engine.heads import SpanOutput
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry
    from bert_engine.tokenizer import Batch

    task = load_registry(entry_points=False).task("qa")
    items = [x for x, _ in list(task.spec.read_data(str(data)))[:questions]]
    predictor = Predictor.load(task, model, device=device, precision=precision).get()
    options, tokenizer = predictor.check_options({}), predictor.tokenizer
    batches = qa.preprocess_many(items, tokenizer, **options)
    groups = qa.window_groups(batches, 32)

    def forward() -> list:
        logits = []
        with torch.inference_mode():
            for group in groups:
                out = predictor.forward_rows(Batch.stacked([batches[i] for i in group], tokenizer.pad_token_id).model_inputs())
                starts, ends = out.start_logits.float().cpu(), out.end_logits.float().cpu()
                row = 0
                for i in group:
                    n, width = len(batches[i]), batches[i].input_ids.shape[1]
                    logits.append((i, SpanOutput(starts[row:row + n, :width], ends[row:row + n, :width])))
                    row += n
        return logits

    logits = forward()
    qa.predict_many(predictor, items[:8])  # the first calls (a GPU's kernels, allocator) out of the rounds
    steps = {
        "preprocess, one at a time": lambda: [qa.preprocess(item, tokenizer, **options) for item in items],
        "preprocess, all at once": lambda: qa.preprocess_many(items, tokenizer, **options),
        "postprocess": lambda: [qa.postprocess(output, batches[i], **options) for i, output in logits],
        "forward passes": forward,
        "predict_many": lambda: qa.predict_many(predictor, items),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(1e3 * (time.perf_counter() - start) / len(items))
    result = {"questions": len(items), "rounds": rounds, "threads": torch.get_num_threads(), "device": device,
              "precision": precision,
              "ms_per_question": {name: round(statistics.median(v), 3) for name, v in times.items()}}
    if profile:
        result["profile"] = _profile(lambda: qa.predict_many(predictor, items), profile, len(items))
    return result


def _profile(call, top: int, questions: int) -> list[dict]:
    """The `top` functions by own time in one profiled `call`, in ms a question (cProfile's overhead included)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(call)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
             "own_ms": round(1e3 * own / questions, 4), "cumulative_ms": round(1e3 * cumulative / questions, 4)}
            for (file, line, name), (_, calls, own, cumulative, _) in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data", type=Path, default=DATA, help=f"SQuAD v1.1 dev (default: {DATA})")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--precision", default="fp32", help="fp32 (default), bf16, fp16 or int8 (CPU)")
    parser.add_argument("--model", default=None, help="a QA checkpoint folder (default: the starter)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N functions predict_many spends most time in (cProfile)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data: no file at {args.data} (SQuAD v1.1 dev, in the shared data folder)")
    if args.questions < 1 or args.rounds < 1 or args.profile < 0:
        parser.error("--questions and --rounds must be at least 1, --profile at least 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA GPU")
    logging.basicConfig(level=logging.WARNING)
    from bert_engine.checkpoints.hub import HubError

    try:
        measured = measure(args.questions, args.rounds, args.data, device=args.device, precision=args.precision,
                           model=args.model, profile=args.profile)
    except (ValueError, HubError) as err:  # a device, precision or model it cannot load: one line, named
        parser.error(str(err))
    result = {"machine": machine(), **measured}
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else result["machine"]["cpu_class"]
    print(f"# QA's host work, {result['questions']} SQuAD dev questions x {result['rounds']} rounds, "
          f"{result['machine']['cpu']} ({where}, {args.precision})")
    print("| step | median ms a question |\n|---|---|")
    for name, ms in result["ms_per_question"].items():
        print(f"| {name} | {ms} |")
    if result.get("profile"):
        print("\n| function (profiled predict_many) | calls | own ms a question | cumulative |\n|---|---|---|---|")
        for row in result["profile"]:
            print(f"| {row['function']} | {row['calls']} | {row['own_ms']} | {row['cumulative_ms']} |")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
