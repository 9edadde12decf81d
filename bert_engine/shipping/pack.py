"""`bert-engine pack`: a LoRA run's adapter + head copied into a starter folder, evaluated there, and
described by manifest.json (training record, metrics, the options it answers with). Pushing to the
Hub is publish.py's; the adapter's tensors are checkpoints/lora.py's.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..checkpoints.hub import ADAPTER_WEIGHTS, DEFAULT_BACKBONE_ID, PACK_MANIFEST
from ..checkpoints.loading import save_weights
from ..checkpoints.lora import ADAPTER_CONFIG, read_adapter_config, reduce_rank
from ..runtime.inference import Predictor
from ..tasks.evaluation import evaluate_task
from ..tasks.registry import RegisteredTask

logger = logging.getLogger(__name__)


def pack(task: RegisteredTask, run_dir: str | Path, to: str | Path, *, checkpoint: str = "best",
         eval_data: Sequence[str] = (), eval_splits: Sequence[str] = (), eval_limit: int | None = None,
         command_line: str = "", adapter_dtype: str = "fp32", adapter_rank: int | None = None,
         options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Copy a run's best (or last) adapter + head into `to`, evaluate it there, write its manifest.

    Args:
        run_dir: a training output folder, or a packed folder to pack again (re-evaluated, options re-tuned).
        checkpoint: "best" or "last", the run's checkpoint to pack.
        eval_data, eval_splits: data to report metrics on, with one split for all or one per file.
        adapter_dtype: "fp32", or "fp16" to store the adapter's tensors at half the size.
        adapter_rank: store each LoRA delta cut to this rank (truncated SVD).
        options: task options tuned for this model: evaluated with, and the packed model's defaults.
    Returns the manifest (also written to `to`/manifest.json).
    Raises:
        ValueError: the folder is neither a run nor a packed folder, or an argument does not fit it.
    """
    run = Path(run_dir)
    source = run / checkpoint
    if source.is_dir() or not (run / PACK_MANIFEST).is_file():
        if not (run / "train_config.json").is_file():
            raise ValueError(f"{run}: neither a training output folder (no train_config.json) nor a packed folder")
        if not source.is_dir():
            raise ValueError(f"{run}: no {checkpoint}/ checkpoint to pack")
        best = run / "best" / "eval.json"
        run_record = _run_record(run)
        commands = (run_record or {}).get("commands") or []  # the CLI lines that trained it, resumed runs in turn
        record = {"training": json.loads((run / "train_config.json").read_text(encoding="utf-8")),
                  "best_eval_during_training": json.loads(best.read_text(encoding="utf-8")) if best.is_file() else None,
                  "run": run_record, "command": " && ".join(commands) or None}
        if checkpoint == "last":  # the schedule's end, packed instead of the best of the run's own evaluations
            record["checkpoint"] = {"packed": "last", "last_eval_during_training": _last_eval(run)}
    else:  # a packed folder as --run, packed again (re-evaluated, options re-tuned) when its run is gone
        if checkpoint != "best":
            raise ValueError(f"{run}: a packed folder holds one model, not a run's checkpoints; leave out --checkpoint")
        earlier = json.loads((run / PACK_MANIFEST).read_text(encoding="utf-8"))
        record = {key: earlier.get(key) for key in ("training", "best_eval_during_training", "run", "command")}
        record.update({key: earlier[key] for key in ("checkpoint", "adapter_rank_reduced") if earlier.get(key)})
        # how it answers (a tuned temperature, a threshold) and what it scored: kept unless redone here
        record["earlier"] = {"options": earlier.get("options") or {}, "metrics": earlier.get("metrics") or {},
                             "metrics_from": earlier.get("metrics_from") or f"the pack of {earlier.get('date')}",
                             "adapter_dtype": stored_dtype(run / ADAPTER_WEIGHTS)}
        source = run
    if not (source / "adapter_config.json").is_file():
        raise ValueError(f"{source}: no adapter_config.json; train with --lora-rank to get a small starter model")
    if adapter_rank is not None:  # checked before anything is written
        trained = read_adapter_config(source)["rank"]
        if not 1 <= adapter_rank < trained:
            raise ValueError(f"--adapter-rank {adapter_rank}: the adapter has rank {trained}; give a rank "
                             f"from 1 to {trained - 1}")
    target = Path(to)
    if target.is_file():
        raise ValueError(f"--to {str(target)!r} is a file; give a folder")
    strangers = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if strangers and not (target / PACK_MANIFEST).is_file():  # a pack is replaced; other folders are left alone
        raise ValueError(f"--to {str(target)!r} already holds files that are not a pack ({', '.join(strangers[:5])}"
                         f"{', ...' if len(strangers) > 5 else ''}); give a new or empty folder")
    if strangers:  # a pack of another task is not replaced by this one without a word
        try:
            held = json.loads((target / PACK_MANIFEST).read_text(encoding="utf-8")).get("task")
        except (OSError, ValueError, AttributeError):
            held = None
        if held is not None and held != task.spec.name:
            raise ValueError(f"--to {str(target)!r} holds a pack of task {held!r}, not {task.spec.name!r}; give a new "
                             "or empty folder (or remove that pack first)")
    # Built and evaluated in a staging folder beside `to`, moved in only when complete: a failed pack
    # leaves `to` as it was (no half-written folder, and a pack packed again in place keeps its manifest).
    staging = target.parent / f".{target.name}.packing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        manifest = _pack_into(staging, task, source, record, adapter_rank, adapter_dtype, options, eval_data,
                              eval_splits, eval_limit, command_line, shown=target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(staging.iterdir(), key=lambda p: p.name == PACK_MANIFEST):  # the manifest last
        os.replace(path, target / path.name)
    staging.rmdir()
    return manifest


def _pack_into(target: Path, task: RegisteredTask, source: Path, record: dict[str, Any], adapter_rank: int | None,
               adapter_dtype: str, options: Mapping[str, Any] | None, eval_data: Sequence[str],
               eval_splits: Sequence[str], eval_limit: int | None, command_line: str, *,
               shown: Path | None = None) -> dict[str, Any]:
    """pack()'s work in the (empty) folder `target`: the adapter, its evaluation and the manifest."""
    for name in ("adapter.safetensors", "adapter_config.json", "config.json"):
        shutil.copy(source / name, target / name)
    if adapter_rank is not None:
        record["adapter_rank_reduced"] = _reduce_adapter_rank(target, adapter_rank)
    if adapter_dtype == "fp16":
        _halve_adapter(target / "adapter.safetensors")
    predictor = Predictor.load(task, str(target))
    # The task options the model was trained with (`train -o`, e.g. NER's casing) are how it must be
    # served; then the tuned ones (-o here): evaluated with, and the packed model's defaults.
    trained = {k: v for k, v in ((record["training"] or {}).get("options") or {}).items() if k in task.spec.options}
    fixed = {**trained, **(options or {})}
    # A pack packed again: the options its manifest answered with stay (below those fixed here, and re-tuned
    # where this pack's evaluation tunes them); re-packing without --eval-data once dropped a tuned temperature.
    earlier = record.pop("earlier", None) or {}
    kept = {k: v for k, v in (earlier.get("options") or {}).items() if k in task.spec.options and k not in fixed}
    options = {**kept, **fixed}
    predictor.check_options(options)
    metrics = {}
    for data, split in zip(eval_data, _eval_splits(eval_data, eval_splits)):
        examples = list(islice(task.spec.read_data(data, split), eval_limit))
        metrics[f"{Path(data).name}:{split}"] = {
            "examples": len(examples), **evaluate_task(task.spec, predictor, examples, progress=True, **options)}
    adapter = json.loads((target / "adapter_config.json").read_text(encoding="utf-8"))
    head = getattr(predictor.model, "head", None)
    manifest = {
        "task": task.spec.name, "base_model": adapter["base_model"], "base_sha256": adapter["base_sha256"],
        "base_hub_id": DEFAULT_BACKBONE_ID if adapter["base_model"] == "default" else None,
        "labels": list(getattr(head, "labels", ()) or ()),
        "lora": {k: adapter[k] for k in ("rank", "alpha", "targets")},
        **record, "metrics": metrics, "command": command_line or record["command"],
        "adapter_dtype": stored_dtype(target / ADAPTER_WEIGHTS),  # as stored: a pack of an fp16 pack stays fp16
        "date": datetime.date.today().isoformat(),
        "files": {p.name: p.stat().st_size for p in sorted(target.iterdir()) if p.name != "manifest.json"},
    }
    # A task whose evaluation tunes an option on one half of the data: the packed model answers with it
    # by default, in the tab and the API (Predictor.model_options). QA on SQuAD 2.0: the cautious
    # no-answer threshold (refusing few answerable questions: qa.cautious_threshold), not best_f1's,
    # which is tuned for a half-unanswerable mix; sentiment: the temperature of its scores.
    retuned = {}
    for metric_name, option in task.spec.tuned_options.items():  # what the task's evaluation tunes
        tuned = [m[metric_name] for m in metrics.values() if metric_name in m]
        if tuned and option in task.spec.options and option not in fixed:
            retuned[option] = tuned[0]
    if options or retuned:
        manifest["options"] = {**kept, **retuned, **fixed}
    if earlier.get("metrics") and not metrics:
        if adapter_rank is None and manifest["adapter_dtype"] == earlier.get("adapter_dtype"):  # the same weights
            manifest["metrics"] = earlier["metrics"]
            manifest["metrics_from"] = earlier["metrics_from"].removesuffix(
                " (the same weights; not evaluated again)") + " (the same weights; not evaluated again)"
        else:
            logger.warning("%s: the earlier pack's metrics are dropped (its weights changed: %s); pass --eval-data "
                           "to score it again", shown or target,
                           "rank cut" if adapter_rank is not None else "dtype changed")
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def stored_dtype(path: Path) -> str:
    """"fp16" where an adapter file's floating tensors are float16, else "fp32" (read from its header)."""
    with safe_open(str(path), "pt") as handle:
        kinds = {handle.get_slice(name).get_dtype() for name in handle.keys()}
    return "fp16" if "F16" in kinds and "F32" not in kinds else "fp32"


def _halve_adapter(path: Path) -> None:
    """Store an adapter's float32 tensors as float16 (half the file; loading casts them back), refusing
    a value float16 cannot hold."""
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if tensor.dtype == torch.float32 and tensor.numel() and tensor.abs().max() > torch.finfo(torch.float16).max:
            raise ValueError(f"{path}: tensor {name} holds values beyond float16's range; pack without --adapter-dtype fp16")
    save_weights({k: v.half() if v.dtype == torch.float32 else v for k, v in tensors.items()}, path)


def _reduce_adapter_rank(folder: Path, rank: int) -> dict:
    """Cut the adapter in `folder` to `rank` by truncated SVD of each delta (`lora.reduce_rank`), in place;
    returns what the manifest records: the trained and stored ranks and the smallest energy share kept."""
    config = read_adapter_config(folder)  # the whole file, checked
    trained = {"trained_rank": config["rank"], "trained_alpha": config["alpha"]}
    tensors, kept = reduce_rank(load_file(folder / ADAPTER_WEIGHTS), config["alpha"] / config["rank"], rank)
    save_weights(tensors, folder / ADAPTER_WEIGHTS)
    config.update(rank=rank, alpha=float(rank))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return {**trained, "stored_rank": rank, "min_energy_kept": round(kept, 4)}


def _last_eval(run: Path) -> dict | None:
    """The last evaluation a run logged (metrics.jsonl), with its step; None where it logged none."""
    last = None
    if (run / "metrics.jsonl").is_file():
        for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            entry = json.loads(line) if line.strip() else {}
            if isinstance(entry.get("eval"), dict):
                last = {"step": entry.get("step"), **entry["eval"]}
    return last


def _eval_splits(data: list[str], splits: list[str]) -> list[str]:
    """One split per --eval-data: the single one given (or "test") for all, or one each, paired in order."""
    if len(splits) <= 1:
        return [splits[0] if splits else "test"] * len(data)
    if len(splits) != len(data):
        raise ValueError(f"{len(splits)} --eval-split values for {len(data)} --eval-data files: give one split "
                         "for all of them, or one per file in the same order")
    return splits


def _run_record(run: Path) -> dict | None:
    """The run's wall time, device and machine (run.json, written when training ends); for a run from
    before run.json existed, the wall time the metrics log spans, pauses of over an hour left out."""
    record = run / "run.json"
    if record.is_file():
        return json.loads(record.read_text(encoding="utf-8"))
    log = run / "metrics.jsonl"
    if not log.is_file():
        return None
    times = [json.loads(line)["time"] for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    gaps = [b - a for a, b in zip(times, times[1:]) if 0 <= b - a < 3600]
    return {"wall_seconds": round(sum(gaps), 1), "from": "metrics.jsonl"} if gaps else None
