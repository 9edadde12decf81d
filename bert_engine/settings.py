"""Every BERT_ENGINE_* environment variable in one place: its type, default and meaning, read and
checked by `get` (a bad value is a ValueError naming the variable and the value). docs/settings.md
is this table (tests/test_settings.py keeps them equal, and finds any variable read elsewhere).

Leaves out the variables other tools own (torchrun's RANK / WORLD_SIZE, HF_HUB_OFFLINE, Gradio's
GRADIO_SERVER_NAME / PORT, oneDNN's ONEDNN_MAX_CPU_ISA): their own documentation says what they do.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "int", "float", "str", "bool", "paths" (os.pathsep-separated), "names" (comma-separated)
    default: Any
    read: str  # when it is read: "start" (the app or command starting) or "use" (each time it applies)
    help: str
    least: float = 0  # the smallest value a number may have (0 where nothing below it means anything)


SETTINGS = {s.name: s for s in (
    Setting("BERT_ENGINE_DEVICE", "str", None, "start", "force a device (cpu, cuda, cuda:1, mps) for the app, "
            "`pipeline()` (its device= wins) and the CLI commands that run a model: predict, eval, encode, train "
            "(its --device wins); `info` reads a model on the CPU; default: CUDA, then MPS, then the CPU"),
    Setting("BERT_ENGINE_PRECISION", "str", "auto", "start", "auto, fp32, bf16, fp16 or int8, for the app and "
            "every CLI command that predicts (their --precision wins)"),
    Setting("BERT_ENGINE_TIMEOUT", "float", 120.0, "start", "seconds a playground request (browser, API, MCP) may "
            "take before it is cut off and stopped (0: no limit); the CLI and `pipeline()` run in the caller's process "
            "without a limit"),
    Setting("BERT_ENGINE_CONCURRENCY", "int", 64, "start", "requests per event Gradio hands to the fairness gate at "
            "once (the gate decides who runs next)", least=1),
    Setting("BERT_ENGINE_TUNE_MALLOC", "bool", True, "start", "app.py caps glibc's malloc arenas at 2 and mmaps "
            "blocks over 1 MB, so a long-running server's memory comes back after large requests "
            "(MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_ in the environment win)"),
    Setting("BERT_ENGINE_MCP", "bool", True, "start", "serve every task as an MCP tool at /gradio_api/mcp/"),
    Setting("BERT_ENGINE_MODEL_DIRS", "paths", (), "start", "more folders the model picker may load checkpoints "
            "from, besides the starter pack, ./models and ./runs"),
    Setting("BERT_ENGINE_PLUGINS", "names", None, "start", "only these third-party plugins (comma-separated); "
            "default: every installed one"),
    Setting("BERT_ENGINE_STRICT_PLUGINS", "bool", False, "start", "re-raise the first plugin failure instead of "
            "recording it"),
    Setting("BERT_ENGINE_PLUGIN_TIMEOUT", "float", 30.0, "start", "seconds a plugin may take to import (0: no "
            "limit)"),
    Setting("BERT_ENGINE_KERNELS", "str", "auto", "start", "the CPU's fp32 and bf16 matmuls (the encoder's "
            "projections, and a fill-mask head's decoder, int8 models too): auto (time oneDNN's packed, MKL's "
            "plain and, fp32 on AVX2 CPUs with a C compiler, bert_engine's tiled kernel on the model's shapes "
            "once per machine, for short inputs (up to 256 rows) and long ones apart; another than packed only "
            "where it is at least 10 % faster (on AVX2-only CPUs the tiled one is short inputs' default); on "
            "AVX-512 CPUs a layer's four projections take one kernel, and inputs run the tiled kernel, each layer in "
            "one C call, up to as many rows as whole layers timed that way ran no slower), packed, plain, tiled"),
    Setting("BERT_ENGINE_FUSED_LAYERS", "bool", True, "use", "run an encoder layer whose four projections use "
            "bert_engine's tiled kernels (fp32, or int8's where the int8 kernel is tiled) as one C call (fused_layer.c: attention, residual adds, LayerNorms and the "
            "activation around the matmuls), for inference on rows whose real tokens lie together (no padding, or "
            "padding at either end), and every layer in one call where all of them run so; off: the torch modules"),
    Setting("BERT_ENGINE_SHARE_CPUS", "bool", True, "use", "run each forward chunk on the CPU on at most as many "
            "threads as there are CPUs other work left free over the last 0.1 s or more (/proc/stat; Linux), and while "
            "the container's CPU limit (its cgroup quota) throttles it, on no more than the limit: on a 2-core machine "
            "beside one process keeping a core busy, a sentiment request took 6x as long on 2 threads as on 1; and time "
            "the kernels at a first load on no more threads than that limit; off: every forward and timing uses "
            "torch's thread count"),
    Setting("BERT_ENGINE_INT8_KERNEL", "str", "auto", "use", "int8 models' matmuls: auto (bert_engine's own "
            "kernel where it builds and the CPU has AVX2 and neither VNNI nor AVX-512, or AVX-512 with VNNI and no "
            "AMX; else "
            "FBGEMM where the CPU has no VNNI, oneDNN where it has), onednn, fbgemm, tiled; read at each int8 "
            "model's load"),
    Setting("BERT_ENGINE_KERNEL_CACHE", "str", "", "start", "the file those timings are kept in (default "
            "~/.cache/bert_engine/kernels.json)"),
    Setting("BERT_ENGINE_CPU_CAPABILITY", "str", "", "start", "pretend the CPU has only this capability (avx2, "
            "default): bert_engine's own kernels and precision checks behave as on such a CPU (the tiled kernels "
            "at AVX2's width, no bf16 or VNNI); oneDNN, MKL and torch's own kernels need their own variables "
            "(README)"),
    Setting("BERT_ENGINE_MAX_TOKENS", "int", 65536, "use", "tokens one input may need over all its windows", least=1),
    Setting("BERT_ENGINE_MAX_GFLOP", "float", 2000.0, "use", "the work one input may cause, in GFLOP: its windows' "
            "forward passes through the model (BertConfig.forward_flops), checked before them, and the passes the task's "
            "postprocess adds (fill-mask's joint search, the summary's sentence-by-sentence fallback), checked before each; a batch of N "
            "inputs may cause N times it. MiniLM's 65,536 tokens are about 1,700 GFLOP; bert-base reaches 2,000 at "
            "about 10,600 tokens, bert-large at about 3,000"),
    Setting("BERT_ENGINE_CHUNK_GFLOP", "float", 100.0, "use", "the work of one forward chunk, in GFLOP (padding "
            "included): the unit the fairness gate hands out and charges (rows of 128 tokens: MiniLM about 4,500 tokens, "
            "bert-base about 570)"),
    Setting("BERT_ENGINE_MAX_IN_FLIGHT", "int", 2, "use", "requests one visitor may have running at once", least=1),
    Setting("BERT_ENGINE_MAX_WAITING", "int", 2, "use", "requests one visitor (and one address) may have waiting "
            "for a place beyond those caps, up to the request time limit; more are refused at once (0: none wait)"),
    Setting("BERT_ENGINE_MAX_IN_FLIGHT_PER_IP", "int", 8, "use", "requests one address may have running at once "
            "over all its sessions (0: no cap); its sessions also share one share of the compute gate"),
    Setting("BERT_ENGINE_MODEL_LOADS_PER_MINUTE", "int", 12, "use", "models one address may have the app load in "
            "a minute (a model picked or compared that is not in memory: seconds of CPU each, beside the compute "
            "gate); more are refused until the minute has passed (a reload of a model it picked before, pushed out by others' "
            "picks, is counted but never refused; 0: no limit)"),
    Setting("BERT_ENGINE_MAX_DOWNLOAD_MB", "int", 2048, "use", "the most one Hub checkpoint may download, all its "
            "files together, checked from the sizes the Hub declares before each file is fetched (the weights only "
            "after config.json describes a model they fit)", least=1),
    Setting("BERT_ENGINE_DOWNLOAD_TIMEOUT", "float", 1800.0, "use", "seconds one Hub checkpoint's download may take "
            "in all (0: no limit); slower, it is stopped (nothing half-written is kept; the next try starts over). In the app a "
            "request's own limit (BERT_ENGINE_TIMEOUT) also applies to a model it loads"),
    Setting("BERT_ENGINE_MAX_PARAMETERS", "int", 2_000_000_000, "use", "the largest model a config.json may "
            "describe"),
    Setting("BERT_ENGINE_MAX_FILE_MB", "int", 1024, "use", "the largest input file `predict --file` and `eval "
            "--data` read, in MB (checked from its size before reading; devices and pipes are refused)"),
)}

_CONVERT: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str.strip,
    "paths": lambda v: tuple(p for p in v.split(os.pathsep) if p.strip()),
    "names": lambda v: frozenset(n.strip() for n in v.split(",") if n.strip()),
}


def get(name: str) -> Any:
    """The setting's value now: the environment's, converted, else its default.

    Raises:
        KeyError: `name` is not a BERT_ENGINE_* setting of the table.
        ValueError: the environment holds a value of the wrong type, naming both.
    """
    setting = SETTINGS[name]
    raw = os.environ.get(name)
    if raw is None or (raw.strip() == "" and setting.kind not in ("str", "paths", "names")):
        return setting.default
    if setting.kind == "bool":
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be 1/0, true/false, yes/no or on/off, got {raw!r}")
    try:
        value = _CONVERT[setting.kind](raw)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if setting.kind == 'int' else 'a number'}, got {raw!r}") from None
    if setting.kind == "float" and not math.isfinite(value):  # ("nan" turned a limit off: every comparison False)
        raise ValueError(f"{name} must be a finite number, got {raw!r}")
    if setting.kind in ("int", "float") and value < 0:
        raise ValueError(f"{name} must not be negative, got {raw!r}")
    if setting.kind in ("int", "float") and value < setting.least:  # (0 requests at once: the app could not serve)
        raise ValueError(f"{name} must be at least {setting.least:g}, got {raw!r}")
    return value


def check_all() -> None:
    """Read every setting once: a process that serves requests (the playground) refuses to start on a value of the
    wrong type, named, instead of failing each request that reads it later.

    Raises:
        ValueError: the first setting whose value is refused, naming it.
    """
    for name in SETTINGS:
        get(name)


def table() -> str:
    """The settings as a Markdown table (docs/settings.md holds it)."""
    rows = ["| variable | type | default | read | what it does |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        default = "none" if s.default in (None, ()) else repr(s.default) if s.kind == "str" else str(s.default)
        rows.append(f"| `{s.name}` | {s.kind} | {default} | {'each time it applies' if s.read == 'use' else 'at start'} "
                    f"| {s.help} |")
    return "\n".join(rows)
