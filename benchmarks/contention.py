"""A visitor's requests beside other work: the engine's forwards on torch's thread count against on the CPUs other
work leaves free (runtime/cpu_load.py, BERT_ENGINE_SHARE_CPUS), with 0, 1, ... busy processes beside them.

    python -m benchmarks.contention [--tasks sentiment,qa] [--requests 40] [--loads 0,1,2] [--json OUT]

Each load level starts that many processes that spin (`while True: pass`: one CPU each), waits a moment, then
sends the task's requests (the starter model, default options, one at a time: a visitor) in turns of 10 with
BERT_ENGINE_SHARE_CPUS on and off, so a slow spell falls on both alike. Reported per task and load: p50 / p95
/ mean of each, and on / off (above 1: sharing the CPUs is faster). The answers are checked to agree first. Items:
SST-2 dev for sentiment, SQuAD dev-v1.1 for QA, from ../shared/data (the tasks' examples where it is missing).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine, print_table, task_names, write_json

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SOURCES = {"sentiment": ("sst2/dev.tsv", "dev"), "qa": ("squad/dev-v1.1.json", "all")}
TURN = 10  # requests per turn of each setting


def _items(task, name: str, count: int) -> list[dict]:
    path, split = DATA / SOURCES[name][0], SOURCES[name][1]
    if path.exists():
        return [dict(x) for x, _ in list(task.spec.read_data(str(path), split))[:count]]
    examples = [dict(x) for x in task.spec.examples]
    return (examples * (count // len(examples) + 1))[:count]


def _spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def measure(name: str, requests: int, load: int) -> dict:
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task(name)
    items = _items(task, name, requests)
    predictor = Predictor.load(task)
    times: dict[str, list[float]] = {"on": [], "off": []}
    answers: dict[str, list] = {"on": [], "off": []}
    before = os.environ.get("BERT_ENGINE_SHARE_CPUS")
    busy = _spinners(load)
    try:
        time.sleep(0.5)
        for item in items[:5]:  # warm-up
            predictor.predict(item)
        for start in range(0, len(items), TURN):
            for setting in ("on", "off") if (start // TURN) % 2 == 0 else ("off", "on"):
                os.environ["BERT_ENGINE_SHARE_CPUS"] = "1" if setting == "on" else "0"
                for item in items[start:start + TURN]:
                    began = time.perf_counter()
                    result = predictor.predict(item)["result"]
                    times[setting].append(time.perf_counter() - began)
                    answers[setting].append(result.get("label", result.get("answer")))
    finally:
        for process in busy:
            process.kill()
            process.wait()
        if before is None:
            os.environ.pop("BERT_ENGINE_SHARE_CPUS", None)
        else:
            os.environ["BERT_ENGINE_SHARE_CPUS"] = before
    same = sum(a == b for a, b in zip(answers["on"], answers["off"])) / len(items)
    p50 = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    p95 = {k: 1e3 * sorted(v)[int(0.95 * (len(v) - 1))] for k, v in times.items()}
    mean = {k: 1e3 * statistics.fmean(v) for k, v in times.items()}
    return {"task": name, "busy_processes": load, "requests": len(items), "on_p50_ms": round(p50["on"], 2),
            "on_p95_ms": round(p95["on"], 2), "on_mean_ms": round(mean["on"], 2), "off_p50_ms": round(p50["off"], 2),
            "off_p95_ms": round(p95["off"], 2), "off_mean_ms": round(mean["off"], 2),
            "on_vs_off": round(p50["off"] / p50["on"], 2), "identical": round(100 * same, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="sentiment,qa", help=f"comma-separated: {', '.join(SOURCES)}")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--loads", default="0,1,2", help="numbers of spinning processes beside the requests")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = task_names(parser, args.tasks, SOURCES)
    try:
        loads = [int(n) for n in args.loads.split(",") if n]
    except ValueError:
        parser.error(f"--loads: {args.loads!r} is not a comma-separated list of whole numbers")
    if not loads or min(loads) < 0 or args.requests < 1:
        parser.error("--loads needs numbers of 0 or more, --requests 1 or more")
    import torch

    from bert_engine.runtime.cpu_load import cpu_quota

    info = machine()
    quota = cpu_quota()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"# a visitor's requests beside spinning processes, {info['cpu']} ({info['cpu_capability']}), "
          f"{torch.get_num_threads()} threads, {cpus} CPUs, "
          f"{'no cgroup CPU limit' if quota is None else f'a cgroup CPU limit of {quota:g}'}")
    rows = [measure(name, args.requests, load) for name in names for load in loads]
    print_table(rows, list(rows[0]))
    write_json(args.json, {"machine": info, "cgroup_cpu_limit": quota, "rows": rows})


if __name__ == "__main__":
    main()
