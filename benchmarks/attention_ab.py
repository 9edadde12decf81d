"""The layers' attention, bert_engine's own (fused_layer.c's, `runtime.fast.native_attention`) against torch's
scaled_dot_product_attention, on real questions: the same QA model and kernels otherwise, the two attentions in
turn, the answers compared.

    python -m benchmarks.attention_ab                        # 300 SQuAD dev questions in batches, 60 one by one
    python -m benchmarks.attention_ab --json benchmarks/results/avx512/attention_ab.json

"batched" runs `qa.predict_many` (a file of questions: windows of neighbouring lengths share forwards of 32
rows); "one by one" runs `predict` per question (a visitor's request). The load-time choice (`choose_kernels`'s
"attention" entry) is printed beside them: what BERT_ENGINE_KERNELS=auto runs on this machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import interleaved, machine, median, print_table, write_json
from bert_engine.runtime import fast, native
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry

SQUAD_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad" / "dev-v1.1.json"


def questions(path: Path, count: int) -> list[dict[str, str]]:
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    items = [{"question": q["question"], "context": p["context"]}
             for article in data for p in article["paragraphs"] for q in p["qas"]]
    return items[:count]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(SQUAD_DEV), help="SQuAD-format dev file (default: ../shared's v1.1)")
    parser.add_argument("--batched", type=int, default=300, help="questions answered as one file")
    parser.add_argument("--single", type=int, default=60, help="questions answered one request at a time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if native.library() is None:
        raise SystemExit(f"bert_engine's C kernels do not run here: {native.unavailable()}")
    from plugins import qa

    predictor = Predictor.load(load_registry(entry_points=False).task("qa"))
    chosen = predictor.model.kernel_choice.get(fast.ATTENTION, {})
    items = questions(Path(args.data), max(args.batched, args.single))
    answers: dict[tuple[str, str], list] = {}

    def run(kind: str, mode: str):
        def go() -> None:
            fast.use_attention(predictor.model, kind)
            if mode == "batched":
                answers[kind, mode] = [r["answer"] for r in qa.predict_many(predictor, items[:args.batched])]
            else:
                answers[kind, mode] = [predictor.predict(i)["result"]["answer"] for i in items[:args.single]]
        return go

    rows = []
    for mode, count in (("batched", args.batched), ("one by one", args.single)):
        times = interleaved({kind: run(kind, mode) for kind in ("native", "sdpa")}, args.repeats, warmup=1)
        same = sum(a == b for a, b in zip(answers["native", mode], answers["sdpa", mode])) / count
        for kind in ("native", "sdpa"):
            rows.append({"mode": mode, "attention": kind, "questions": count, "s_median": median(times[kind]),
                         "s_min": min(times[kind]),
                         "sdpa_over_native": median(times["sdpa"]) / median(times["native"]) if kind == "native" else None,
                         "same_answers": same if kind == "native" else None})
    fast.use_attention(predictor.model, chosen.get("chose"))
    print(f"# {machine()['cpu']} ({machine()['cpu_class']}); load-time choice: {chosen.get('chose')} "
          f"(timings ms: {chosen.get('rows')})")
    print_table(rows, ["mode", "attention", "questions", "s_median", "s_min", "sdpa_over_native", "same_answers"])
    write_json(args.json, {"machine": machine(), "choice": chosen, "rows": rows})


if __name__ == "__main__":
    main()
