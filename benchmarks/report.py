"""The README's performance figures, generated from the committed results (benchmarks/results/<class>/),
so a figure in the README is always one a benchmark command wrote.

    python -m benchmarks.report            # print the README's performance block
    python -m benchmarks.report --write    # replace it in README.md (between the figures markers)

Each CPU class has its own folder (`avx2`, `avx512`, `avx512-amx`, `gpu`: benchmarks.common.cpu_class
names the machine a run was on), holding what these commands wrote with --json:

    python -m benchmarks.encoder --models minilm,bert-base --shapes 1x128,32x128 --precisions fp32,int8 \\
        --json benchmarks/results/CLASS/encoder.json
    python -m benchmarks.workloads --peers ../venv-peers/bin/python --modes batched,single \\
        --tasks sentiment,ner,qa,fill_mask,summary --json benchmarks/results/CLASS/workloads.json

tests/test_readme.py checks that README.md holds exactly this block.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- figures:performance:start -->", "<!-- figures:performance:end -->"
CLASS_NAMES = {"avx2": "AVX2-only CPU", "avx512": "AVX-512 CPU", "avx512-amx": "AVX-512 + AMX CPU", "gpu": "GPU"}
TASK_NAMES = {"sentiment": "sentiment (SST-2 dev)", "ner": "NER (CoNLL eng.testb)", "qa": "QA (SQuAD 1.1 dev)",
              "fill_mask": "fill-mask (WikiText-2)", "summary": "summary (BBC News test)"}


def load() -> dict[str, dict[str, Any]]:
    """class -> {"encoder": result, "workloads": result} for every committed results file."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(RESULTS.glob("*/*.json")):
        found.setdefault(path.parent.name, {})[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    return found


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _machine(result: dict[str, Any]) -> str:
    info = result["machine"]
    if info.get("gpu"):
        return f"{info['gpu']}, torch {info['torch']}"
    share = info.get("others_cpu_share")  # (recorded since session 44; older runs did not measure it)
    busy = "" if share is None else f", other work {100 * share:.0f} % of the CPUs during the run"
    return f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}{busy}"


def encoder_lines(result: dict[str, Any]) -> list[str]:
    rows = [r for r in result["rows"] if r["impl"] == "engine"]
    peak = result.get("matmul_peak_gflops", {}).get("fp32")
    lines = [f"| encoder forward | vs transformers (int8: its fp32) | vs ONNX Runtime (same precision) | share of the "
             f"fp32 matmul peak{f' ({peak:.0f} GFLOP/s)' if peak else ''} |", "|---|---|---|---|"]
    kernel = result.get("int8_kernel")
    for r in rows:  # the int8 peak the benchmark measures is not the CPU's int8 roofline: shown for fp32 only
        share = "-" if r["precision"] != "fp32" else (
            f"{100 * r['roofline']:.0f} %" if r["roofline"] <= 1 else "over 100 %: the run's peak read low")
        precision = f"{r['precision']} ({kernel})" if kernel and r["precision"].startswith("int8") else r["precision"]
        lines.append(f"| {r['model']} {r['shape']} {precision} | {_x(r.get('speedup'))} | {_x(r.get('vs_ort'))} "
                     f"| {share} |")
    return lines


def workload_lines(result: dict[str, Any]) -> list[str]:
    peers = result.get("peers")
    rows = result["rows"]
    lines = ["| end to end | mode | engine items/s | p50 / p95 ms | vs transformers | vs optimum + ONNX Runtime "
             "| identical |", "|---|---|---|---|---|---|---|"]
    modes = {"batched": "a file (batches of 32)", "single": "a visitor (one request at a time)"}
    on_gpu = str(result.get("device", "cpu")).startswith("cuda")  # a GPU's rows: every precision it ran
    for r in (r for r in rows if r["impl"] == "engine" and (r["precision"] == "fp32" or on_gpu)):
        same = [o["identical"] for o in rows if (o["task"], o["mode"]) == (r["task"], r["mode"])
                and o["impl"] != "engine" and o.get("identical") is not None
                and (not on_gpu or o["precision"] == r["precision"])]
        latency = f"{r['p50_ms']:.0f} / {r['p95_ms']:.0f}" if r.get("p50_ms") is not None else "-"
        mode = modes.get(r["mode"], r["mode"]) + (f", {r['precision']}" if on_gpu else "")
        if r["task"] == "summary" and r["mode"] == "batched":  # benchmarks/summary_reference.py's DOCUMENTS
            mode = mode.replace("batches of 32", "8 articles per call")
        lines.append(f"| {TASK_NAMES.get(r['task'], r['task'])} | {mode} "
                     f"| {r['items_per_s']:.1f} | {latency} | {_x(r.get('vs_transformers'))} "
                     f"| {_x(r.get('vs_onnxruntime'))} | {f'{min(same):.1f} %' if same else '-'} |")
    if peers:
        lines.append("")
        lines.append(f"Peers: transformers {peers['transformers']} pipelines, optimum {peers['optimum']} with "
                     f"onnxruntime {peers['onnxruntime']} (`ORTModelFor...` inside the same pipelines)."
                     + (" Summary has no pipeline: each peer runs plugins/summary.py's own steps around its encoder "
                        "(`benchmarks/summary_reference.py`)." if any(r["task"] == "summary" for r in rows) else ""))
    earlier: dict[str, list[tuple[str, str]]] = {}
    for r in rows:  # rows kept from an earlier run by `benchmarks.workloads --merge`
        if "from" in r and r["impl"] == "engine":
            earlier.setdefault(r["from"]["command"], []).append((r["task"], r["mode"]))
    for command, kinds in earlier.items():
        tasks = sorted({TASK_NAMES.get(task, task).split(" (")[0] for task, _ in kinds})
        modes_ = " and ".join(sorted({mode for _, mode in kinds}))
        lines.append("")
        lines.append(f"The {', '.join(tasks)} rows ({modes_}) come from an earlier run of the same file: `{command}`.")
    return lines


def render(results: dict[str, dict[str, Any]] | None = None) -> str:
    """The README's performance block for every CPU class with results."""
    results = load() if results is None else results
    parts = [START, "", "Generated by `python -m benchmarks.report --write` from benchmarks/results/ (each file says "
             "the command and the machine). Ratios above 1 mean the engine is faster, within one run on one "
             "machine.", ""]
    for cpu_class in sorted(results, key=lambda c: list(CLASS_NAMES).index(c) if c in CLASS_NAMES else 99):
        found = results[cpu_class]
        any_result = found.get("encoder") or found.get("workloads") or next(iter(found.values()))  # what is shown
        parts += [f"**{CLASS_NAMES.get(cpu_class, cpu_class)}** ({_machine(any_result)}):", ""]
        if "encoder" in found:
            parts += [*encoder_lines(found["encoder"]), ""]
        if "workloads" in found:
            parts += [*workload_lines(found["workloads"]), ""]
    parts.append(END)
    return "\n".join(parts)


def write(readme: Path = ROOT / "README.md") -> bool:
    """Replace the block in `readme`; True when it changed."""
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: no {START} ... {END} markers")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    new = before + render() + after
    readme.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = parser.parse_args(argv)
    if args.write:
        print("README.md updated" if write() else "README.md already current")
    else:
        print(render())


if __name__ == "__main__":
    main()
