"""bert_engine's C kernels at another git revision against the working tree's, in one process: a whole MiniLM
forward with every layer in one C call (BERT_ENGINE_KERNELS=tiled), the two builds of the library taking turns,
beside oneDNN's packed modules.

    python -m benchmarks.native_ab --base 00ff668                      # 1x24 ... 1x192
    python -m benchmarks.native_ab --base HEAD~1 --shapes 1x128,1x160 --rounds 40 --json out.json

A change to the C code that gains a few percent is within what a shared machine's speed moves from one run to
the next (up to 2x on the Cascade Lake Xeon of session 41); timed in one process, each round running both builds
and the packed modules in turn on the same model, the two see the same machine. The base's sources
(runtime/native.py's SOURCES, read with `git show`) are built with the same compiler and flags; both libraries
run at the width native.py picks for this CPU. Each build's output is compared with the other's before anything
is timed (max |difference|: 0 where the change keeps the bits).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json
from benchmarks.encoder import model_folders
from benchmarks.fp32_kernels import load_with

SHAPES = "1x24,1x64,1x128,1x192"


def build_at(revision: str, folder: Path):
    """The kernel library built from the C sources as they are at git `revision`, loaded and set to this CPU's
    widths, as native.py sets its own."""
    from bert_engine.runtime import native

    root = Path(native.__file__).resolve().parents[2]
    sources = []
    for path in native.SOURCES:
        name = path.relative_to(root).as_posix()
        shown = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{name}"], capture_output=True)
        if shown.returncode != 0:
            raise SystemExit(f"--base {revision!r}: git cannot show {name}: {shown.stderr.decode().strip()}")
        (folder / path.name).write_bytes(shown.stdout)
        sources.append(str(folder / path.name))
    target = folder / "base.so"
    cc = native.compiler()
    if cc is None:
        raise SystemExit(f"no C compiler here: {native.unavailable()}")
    done = subprocess.run([*cc, *native.FLAGS, *sources, "-o", str(target), *native.LIBS], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"the base's sources did not build: {done.stderr.strip()[:300]}")
    lib = native._load(target)
    lib.tiled_matmul_set_isa(native.wanted_isa())
    lib.int8_matmul_set_isa(native.wanted_int8_isa())
    return lib


def main(argv: list[str] | None = None) -> dict:
    from bert_engine.runtime import native

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision whose C kernels to compare with")
    parser.add_argument("--shapes", default=SHAPES, help="BxT,... (batch x tokens)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    ours = native.library()
    if ours is None:
        raise SystemExit(f"bert_engine's kernels cannot run here: {native.unavailable()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"base": build_at(args.base, Path(tmp)), "working tree": ours}
        folder = model_folders(["minilm"], Path(tmp))["minilm"]
        fused, _ = load_with(folder, "tiled", reference=False)
        packed, _ = load_with(folder, "packed", reference=False)
        try:
            for shape in args.shapes.split(","):
                batch, tokens = (int(v) for v in shape.split("x"))
                ids = torch.randint(1000, 30000, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

                def run(name: str, inputs: dict = inputs):
                    native._state["library"] = libraries[name]
                    return fused(**inputs).last_hidden_state

                contenders = {name: (lambda n=name: run(n)) for name in libraries}
                contenders["packed"] = lambda inputs=inputs: packed(**inputs).last_hidden_state
                with torch.inference_mode():
                    diff = float((run("base") - run("working tree")).abs().max())
                    times = interleaved(contenders, args.rounds)
                ms = {name: 1e3 * median(t) for name, t in times.items()}
                rows.append({"shape": shape, "base_ms": round(ms["base"], 3), "working_tree_ms": round(ms["working tree"], 3),
                             "packed_ms": round(ms["packed"], 3), "speedup": round(ms["base"] / ms["working tree"], 3),
                             "base_vs_packed": round(ms["packed"] / ms["base"], 3),
                             "working_tree_vs_packed": round(ms["packed"] / ms["working tree"], 3),
                             "max_abs_diff": diff})
        finally:
            native._state["library"] = ours
    result = {"machine": machine(), "base": args.base, "rounds": args.rounds, "rows": rows}
    info = result["machine"]
    print(f"# MiniLM forward, the layers in one C call, kernels at {args.base} vs the working tree; {info['cpu']} "
          f"({info['cpu_capability']}), {info['threads']} threads; medians of {args.rounds} rounds in turn")
    print_table(rows, ["shape", "base_ms", "working_tree_ms", "packed_ms", "speedup", "base_vs_packed",
                       "working_tree_vs_packed", "max_abs_diff"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
