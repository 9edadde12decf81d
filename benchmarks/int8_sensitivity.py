"""Which encoder projections to keep in fp32 when the rest run in int8: per-layer sensitivity.

    python -m benchmarks.int8_sensitivity                       # sentiment, ner, qa starters on ../shared/data
    python -m benchmarks.int8_sensitivity --probe qa --keep-candidates 4

Agreement is the share of predictions identical to the fp32 model's: sentiment labels on SST-2
dev, NER entity sets (CRF decoding) on CoNLL eng.testb sentences, QA answers on SQuAD dev-v1.1
questions. Steps:

1. every projection in int8 (oneDNN, bert_engine.runtime.fast.Int8Linear): the agreement to beat;
2. on the probe task, each of the 24 projections (6 layers x qkv, attention output, FFN up, FFN
   down) kept in fp32 alone: how much agreement it buys back, on the --probe-limit items that follow
   the --limit scored ones (ranking and scoring on the same items would overfit the ranking);
3. the K projections that bought most kept together, K = 0..--keep-candidates, on every task, with
   the encoder's speed-up over fp32 (32x128, interleaved medians).

Every quantised model's inputs are rotated (--rotation BLOCK, bert_engine.runtime.fast.ROTATION_BLOCK by default;
'none' for none) and a row "no rotation" repeats K = 0 without it.
With --smoothing ALPHA every model is smoothed (SmoothQuant without data, bert_engine.runtime.fast.
smoothing_divisors) and a row "no smoothing" repeats K = 0 without it; --alphas compares strengths on
the probe items first. A last row rounds the weights alone (activations in fp32): the bound the
weight format sets.
The first K whose agreement meets the targets (sentiment and NER >= 99 %, QA >= 97 %) is the
recommendation, written as a `KEEP_FP32` tuple for bert_engine/runtime/fast.py.
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json
from benchmarks.workloads import DATA

TARGETS = {"sentiment": 99.0, "ner": 99.0, "qa": 97.0}


def _workload(task_name: str, data: Path, limit: int, offset: int = 0):
    """(task, predict(predictor) -> comparable predictions) on items offset .. offset + limit."""
    from bert_engine.runtime.inference import predict_texts
    from bert_engine.tasks.registry import load_registry
    from plugins.qa import predict_many

    task = load_registry(entry_points=False).task(task_name)
    if task_name == "sentiment":
        texts = [x["text"] for x, _ in task.spec.read_data(str(data / "sst2" / "dev.tsv"), "dev")][offset:offset + limit]
        return task, lambda p: [r["label_id"] for r in predict_texts(p, texts, batch_size=32)]
    if task_name == "ner":
        texts = [x["text"] for x, _ in task.spec.read_data(str(data / "conll2003" / "eng.testb"), "test")][
            offset:offset + limit]
        return task, lambda p: [sorted((e["start"], e["end"], e["type"]) for e in r["entities"])
                                for r in predict_texts(p, texts, batch_size=32)]
    items = [x for x, _ in task.spec.read_data(str(data / "squad" / "dev-v1.1.json"), "dev")][offset:offset + limit]
    return task, lambda p: [r["answer"] or "" for r in predict_many(p, items, max_rows=32)]


def _agreement(a: list, b: list) -> float:
    return 100.0 * sum(x == y for x, y in zip(a, b)) / len(a)


class Task:
    def __init__(self, name: str, data: Path, limit: int, offset: int = 0) -> None:
        from bert_engine.runtime.inference import Predictor

        self.name = name
        self.task, self.predict = _workload(name, data, limit, offset)
        fp32 = Predictor.load(self.task, precision="fp32", pack=False)
        self.plain, self.tokenizer, self.model_id = fp32.model, fp32.tokenizer, fp32.model_id
        self.model_options = fp32.model_options  # e.g. QA's calibrated null_threshold, from the pack's manifest
        self.reference = self.predict(Predictor.load(self.task, precision="fp32"))

    smoothing: float | None = None  # set by main: the strength every quantised model uses unless told
    rotation: int | None = None  # set by main: the Hadamard block every quantised model uses unless told

    def quantised(self, keep: tuple[str, ...], smoothing: float | None | str = "default",
                  rotation: int | None | str = "default"):
        from bert_engine.runtime.fast import quantize_int8
        from bert_engine.runtime.inference import Predictor

        smoothing = self.smoothing if smoothing == "default" else smoothing
        rotation = self.rotation if rotation == "default" else rotation
        model = quantize_int8(copy.deepcopy(self.plain), keep_fp32=keep, smoothing=smoothing, rotation=rotation)
        # the reference's option defaults too: without them QA would never say "no answer" where the
        # fp32 model, calibrated, does, and every such question would count as a disagreement
        return Predictor(self.task, model, self.tokenizer, model_id=self.model_id, model_options=self.model_options)

    def agreement(self, keep: tuple[str, ...], smoothing: float | None | str = "default",
                  rotation: int | None | str = "default") -> float:
        return _agreement(self.predict(self.quantised(keep, smoothing, rotation)), self.reference)

    def weights_only_agreement(self) -> float:
        """Agreement with only the projections' weights rounded as Int8Linear rounds them (per output
        channel, fast.int8_weight_limit levels) and everything else in fp32: the bound that the weight
        format alone sets, whatever the activations' scheme."""
        from bert_engine.runtime.fast import LINEAR_NAMES, int8_weight_limit, quantize_weight
        from bert_engine.runtime.inference import Predictor

        model, levels = copy.deepcopy(self.plain), int8_weight_limit()
        with torch.no_grad():
            for layer in model.encoder.layers:
                for name in LINEAR_NAMES:
                    owner, attr = name.split(".")
                    weight = getattr(getattr(layer, owner), attr).weight
                    codes, scale = quantize_weight(weight, levels)
                    weight.copy_(codes.float() * scale[:, None])
        predictor = Predictor(self.task, model, self.tokenizer, model_id=self.model_id, model_options=self.model_options)
        return _agreement(self.predict(predictor), self.reference)


def encoder_speedup(task: Task, keep: tuple[str, ...], repeats: int,
                    smoothing: float | None | str = "default", rotation: int | None | str = "default") -> float:
    """fp32 (packed) time over int8 time of the task model's encoder on 32x128."""
    from bert_engine.runtime.fast import pack_linear_layers

    encoder_fp32 = pack_linear_layers(copy.deepcopy(task.plain)).encoder
    encoder_int8 = task.quantised(keep, smoothing, rotation).model.encoder
    ids = torch.randint(1000, 20000, (32, 128), generator=torch.Generator().manual_seed(0))

    def run(encoder):
        def call():
            with torch.inference_mode():
                encoder(input_ids=ids)
        return call

    times = interleaved({"fp32": run(encoder_fp32), "int8": run(encoder_int8)}, repeats)
    return median(times["fp32"]) / median(times["int8"])


def main(argv: list[str] | None = None) -> None:
    from bert_engine.runtime.fast import LINEAR_NAMES, ROTATION_BLOCK, SMOOTHING_ALPHA

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="sentiment,ner,qa")
    parser.add_argument("--probe", default="qa", help="the task whose agreement ranks the projections")
    parser.add_argument("--limit", type=int, default=500, help="items per task (sentiment: up to 872)")
    parser.add_argument("--probe-limit", type=int, default=200,
                        help="items of the probe task in step 2 (the ones after the --limit scored ones)")
    parser.add_argument("--keep-candidates", type=int, default=6, help="largest K tried in step 3")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoothing", default="none",
                        help=f"SmoothQuant strength alpha in [0, 1] for every quantised model (e.g. {SMOOTHING_ALPHA}), "
                             "or 'none' (the library's default)")
    parser.add_argument("--rotation", default=str(ROTATION_BLOCK),
                        help=f"Hadamard block size of the int8 inputs' rotation (the library's default, {ROTATION_BLOCK}), "
                             "or 'none'; a rotated run adds a row without it")
    parser.add_argument("--alphas", default=None,
                        help="comma-separated strengths to compare first, on the probe items (not the scored ones)")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    data = Path(args.data)
    Task.smoothing = None if args.smoothing == "none" else float(args.smoothing)
    Task.rotation = None if args.rotation == "none" else int(args.rotation)
    tasks = {name: Task(name, data, args.limit) for name in args.tasks.split(",")}
    # ranked on items after the scored ones: a projection chosen on the questions it is scored on
    # looks better than it is (2.attention.qkv: +4 points on its probe questions, -0.2 on the rest)
    probe = Task(args.probe, data, args.probe_limit, offset=args.limit)
    if args.alphas:
        strengths = [None if a.strip() == "none" else float(a) for a in args.alphas.split(",")]
        print(f"# {args.probe}, {args.probe_limit} probe items, every projection int8, by smoothing strength:")
        print_table([{"smoothing": str(a), args.probe: probe.agreement((), a)} for a in strengths],
                    ["smoothing", args.probe])
    layers = len(probe.plain.encoder.layers)
    names = [f"{i}.{n}" for i in range(layers) for n in LINEAR_NAMES]
    gains, ranking = [], []
    if args.keep_candidates:  # the ranking only chooses what steps K >= 1 keep in fp32
        base = probe.agreement(())
        gains = sorted(((probe.agreement((n,)) - base, n) for n in names), reverse=True)
        ranking = [{"projection": n, "probe": args.probe, "agreement_gain": g} for g, n in gains]
        print(f"# {args.probe}, {args.probe_limit} items: every projection int8 agrees {base:.1f} %; kept alone in fp32:")
        print_table(ranking[:10], ["projection", "probe", "agreement_gain"])
    rows = []
    for k in range(args.keep_candidates + 1):
        keep = tuple(n for _, n in gains[:k])
        row = {"kept_fp32": k, "projections": ", ".join(keep) or "-"}
        for name, task in tasks.items():
            row[name] = task.agreement(keep)
        row["speedup"] = encoder_speedup(next(iter(tasks.values())), keep, args.repeats)
        row["meets_targets"] = all(row[n] >= TARGETS.get(n, 99.0) for n in tasks)
        rows.append(row)
    # K = 0 again without each option the run applies, so its effect is read in the same run
    for label, option, value in (("smoothing", "smoothing", Task.smoothing), ("rotation", "rotation", Task.rotation)):
        if value is not None:
            row = {"kept_fp32": f"0, no {label}", "projections": "-",
                   **{name: task.agreement((), **{option: None}) for name, task in tasks.items()}}
            row["speedup"] = encoder_speedup(next(iter(tasks.values())), (), args.repeats, **{option: None})
            rows.append(row)
    rows.append({"kept_fp32": "weights only", "projections": "int8 weights, fp32 activations (a bound, not a mode)",
                 **{name: task.weights_only_agreement() for name, task in tasks.items()}})
    info = machine()
    print(f"# int8 agreement with fp32 (%), {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads; "
          f"smoothing {Task.smoothing}; rotation {Task.rotation}; speed-up: encoder fp32 / int8 at 32x128; targets {TARGETS}")
    print_table(rows, ["kept_fp32", *tasks, "speedup", "meets_targets", "projections"])
    chosen = next((r for r in rows if r.get("meets_targets")), None)
    print("recommended: KEEP_FP32 =", tuple(chosen["projections"].split(", ")) if chosen and chosen["kept_fp32"]
          else () if chosen else "none of these meets the targets")
    write_json(args.json, {"machine": info, "ranking": ranking, "rows": rows})


if __name__ == "__main__":
    main()
