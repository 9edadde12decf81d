"""How many predictions an int8 model keeps identical to fp32, for each int8 kernel that runs here
(oneDNN's, FBGEMM's and bert_engine's own AVX2 one: bert_engine.runtime.fast.int8_kernel), on the starter models.

    python -m benchmarks.int8_agreement                               # sentiment, ner, qa; first 1,000 items
    python -m benchmarks.int8_agreement --tasks qa --limit 300 --json out.json
    python -m benchmarks.int8_agreement --kernels tiled,fbgemm

The workloads are benchmarks.int8_sensitivity's: sentiment labels on SST-2 dev (872 items), NER entity
sets (CRF decoding) on CoNLL eng.testb sentences, QA answers on SQuAD dev-v1.1 questions, each the
starter model as `Predictor.load(task, precision=...)` loads it (BERT_ENGINE_INT8_KERNEL set for each
int8 load). Issue 40's targets: sentiment and NER >= 99 %, QA >= 97 % identical to fp32.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks.common import int8_kernel_set, machine, print_table, write_json
from benchmarks.int8_sensitivity import TARGETS, _agreement, _workload
from benchmarks.workloads import DATA


def main(argv: list[str] | None = None) -> dict:
    from bert_engine.runtime.fast import fbgemm_int8_available, int8_kernel, onednn_int8_available, tiled_int8_available
    from bert_engine.runtime.inference import Predictor

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="sentiment,ner,qa")
    parser.add_argument("--limit", type=int, default=1000, help="items per task (the first N)")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--kernels", default="onednn,fbgemm,tiled", help="int8 kernels to compare, of those that run here")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs = {"onednn": onednn_int8_available, "fbgemm": fbgemm_int8_available, "tiled": tiled_int8_available}
    asked = args.kernels.split(",")
    if sorted(set(asked) - set(runs)):
        raise SystemExit(f"--kernels: {sorted(set(asked) - set(runs))} unknown; choose from {', '.join(runs)}")
    kernels = [k for k in asked if runs[k]()]
    unknown = sorted(set(args.tasks.split(",")) - set(TARGETS))
    if unknown or not kernels:
        raise SystemExit(f"--tasks: {unknown} unknown; choose from {', '.join(TARGETS)}" if unknown
                         else f"none of the int8 kernels {', '.join(asked)} runs here")
    rows = []
    for name in args.tasks.split(","):
        task, predict = _workload(name, Path(args.data), args.limit)
        reference = predict(Predictor.load(task, precision="fp32"))
        for kernel in kernels:
            start = time.perf_counter()
            with int8_kernel_set(kernel):
                got = predict(Predictor.load(task, precision="int8"))
            identical = _agreement(reference, got)
            rows.append({"task": name, "int8_kernel": kernel, "items": len(reference), "identical": round(identical, 2),
                         "target": TARGETS[name], "met": identical >= TARGETS[name],
                         "seconds": round(time.perf_counter() - start, 1)})
    result = {"machine": machine(), "default_int8_kernel": int8_kernel(), "limit": args.limit, "rows": rows}
    info = result["machine"]
    print(f"# int8 predictions identical to fp32, {info['cpu']} ({info['cpu_capability']}); "
          f"int8 kernel by default here: {result['default_int8_kernel']}")
    print_table(rows, ["task", "int8_kernel", "items", "identical", "target", "met", "seconds"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
