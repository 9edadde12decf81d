"""One plain training loop for every task and for pretraining, on one process or many (TrainConfig: train_config.py).

A job supplies the model, the examples, how a list of examples becomes a batch, the loss and the
evaluation; the loop owns the rest: AdamW without weight decay on biases and LayerNorm, linear
warm-up and decay, gradient accumulation and clipping, bf16/fp16 autocast, seeding, evaluation
with best-checkpoint keeping, resumable checkpoints (Ctrl-C saves one), a tqdm bar and a JSON-lines
metrics log. Under torchrun it runs DistributedDataParallel (NCCL on GPUs, gloo on CPUs): each
global batch is split across ranks, only rank 0 logs and saves, and metrics are reduced over ranks.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import random
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ..progress import progress_bar
from ..runtime.distributed import Distributed
from ..runtime.precision import autocast_dtype, cpu_capability, pick_device
from .train_config import TrainConfig, parse_best_metric, settings_read

logger = logging.getLogger(__name__)

BEST_METRIC_PREFERENCE = ("f1", "accuracy", "rouge2", "top1", "exact_match", "mlm_accuracy")


class Job(Protocol):
    """What the loop needs from a kind of training (task fine-tuning, pretraining)."""

    model: nn.Module
    tokenizer: Any
    examples: list

    def collate(self, examples: list, generator: torch.Generator) -> tuple[Any, Any]: ...
    def loss(self, model: nn.Module, batch: Any, targets: Any) -> tuple[torch.Tensor, dict[str, float]]: ...
    def evaluate(self, model: nn.Module, rank: int, world: int) -> dict[str, Any]: ...
    def save(self, model: nn.Module, folder: Path) -> None: ...
    # optional: example_lengths() -> list[int], the token count of each example, for length bucketing


# -- distributed ---------------------------------------------------------------------------------------

def _mean_over_ranks(values: dict[str, float], dist_info: Distributed, device) -> dict[str, float]:
    if dist_info.world == 1 or not values:
        return values
    import torch.distributed as dist  # noqa: PLC0415 - only under torchrun

    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return {k: float(v) / dist_info.world for k, v in zip(keys, tensor.tolist())}


# -- pieces of the loop ---------------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def parameter_groups(model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices only (never biases or LayerNorm), the head at head_lr."""
    groups: dict[tuple[bool, bool], list] = {}
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        no_decay = name.endswith("bias") or id(param) in norms or param.ndim < 2
        is_head = name.startswith("head.")
        groups.setdefault((no_decay, is_head), []).append(param)
    return [{"params": params, "weight_decay": 0.0 if no_decay else cfg.weight_decay,
             "lr": (cfg.head_lr or cfg.lr) if is_head else cfg.lr}
            for (no_decay, is_head), params in sorted(groups.items())]


def linear_schedule(warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the peak rate at a step: 0 -> 1 over `warmup` steps, then 1 -> 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor


def machine_description(device: torch.device) -> dict[str, Any]:
    """What a run's figures depend on: the CPU (model, capability class), the GPU, torch's version."""
    names = []
    if Path("/proc/cpuinfo").is_file():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    info = {"cpu": names[0] if names else platform.processor() or "unknown", "cpu_capability": cpu_capability().describe(),
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def epoch_order(n: int, seed: int, *, batch: int, lengths: list[int] | None = None, buckets: int = 0) -> list[int]:
    """The epoch's example order, a permutation of range(n) seeded by `seed`.

    With `lengths` and `buckets`, consecutive runs of `batch` examples have similar lengths: the
    shuffled order is cut into windows of `buckets` batches, each window is sorted by length and cut
    into batches, and the batches are shuffled, so the model still sees a random mix of batch lengths.
    """
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator).tolist()
    if not lengths or buckets < 1:
        return order
    if len(lengths) != n:
        raise ValueError(f"example_lengths gave {len(lengths)} lengths for {n} examples")
    window = batch * buckets
    chunks = []
    for start in range(0, n, window):
        part = sorted(order[start:start + window], key=lengths.__getitem__)
        chunks.extend(part[i:i + batch] for i in range(0, len(part), batch))
    full = [c for c in chunks if len(c) == batch]  # a short batch stays last, where the epoch ends
    short = [c for c in chunks if len(c) < batch]
    shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
    return [i for chunk in shuffled + short for i in chunk]


def pick_best_metric(metrics: dict[str, Any], preferred: str | None) -> str | None:
    """`preferred` (it must be among `metrics`), else the first of BEST_METRIC_PREFERENCE reported,
    else the first number that is not a loss."""
    if preferred:
        if preferred not in metrics:
            raise ValueError(f"best_metric {preferred!r} is not among the evaluation's metrics {sorted(metrics)}")
        return preferred
    for name in BEST_METRIC_PREFERENCE:
        if isinstance(metrics.get(name), (int, float)):
            return name
    return next((k for k, v in metrics.items() if isinstance(v, (int, float)) and "loss" not in k), None)


class MetricsLog:
    """Appends one JSON object per line to output_dir/metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def keep_until(self, step: int) -> None:
        """Drop the records after `step`: a run resumed from its checkpoint at `step` logs those steps
        again, and each step must appear once. Lines that are not JSON (a crash mid-write) go too."""
        if not self.enabled or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        scratch = self.path.with_name(self.path.name + ".partial")
        scratch.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        scratch.replace(self.path)

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(_finite({"time": round(time.time(), 3), **record})) + "\n")


def resident_mb() -> float | None:
    """This process's resident memory now, in MiB, from /proc/self/statm; None where there is none
    (not Linux). Logged with each training record: a run whose memory keeps growing shows it long
    before the kernel's out-of-memory killer ends it without a word."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


TRIM_EVERY = 50  # steps between release_freed_memory calls


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (macOS, musl, Windows)."""
    try:
        import ctypes  # noqa: PLC0415

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' CDLL takes no None
        return None


def release_freed_memory() -> None:
    """Hand the pages the C allocator holds free back to the system (glibc's malloc_trim). A training
    step's activations come and go in sizes that change with every batch (QA's windows, length buckets);
    glibc keeps what was freed, scattered, and a process's resident memory only climbs: session 25's QA
    run grew from 4 to 24 GB in 1,091 steps and was killed by the kernel. Called every TRIM_EVERY steps:
    after every step it held QA's resident memory at 1.1 GB against 4.7 GB untrimmed (120 steps), but
    each step then faulted its gigabytes of activations in afresh (about 18 % slower)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float as None: metrics.jsonl stays JSON (NaN is not)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class NonFiniteLoss(ValueError):
    """The training loss became NaN or infinite: the run stops before it saves anything from that step."""


# -- the loop ------------------------------------------------------------------------------------------

def _earlier_commands(path: Path) -> list[str]:
    """The command lines an earlier run.json in a resumed run's folder lists (none if it is absent or unreadable)."""
    try:
        commands = json.loads(path.read_text(encoding="utf-8")).get("commands")
    except (OSError, ValueError, AttributeError):
        return []
    return [c for c in commands if isinstance(c, str)] if isinstance(commands, list) else []


def train(job: Job, cfg: TrainConfig, *, dist_info: Distributed | None = None,
          on_step: Callable[[int, dict[str, float]], None] | None = None,
          command: str | None = None) -> dict[str, Any]:
    """Train `job.model` as `cfg` says; returns {"steps", "best", "last_eval", "output_dir"}.

    `on_step(step, logs)` is called after every optimizer step (tests use it to interrupt a run).
    `command`: the command line that started this invocation; run.json lists it after those of the runs
    it resumed (`commands`), and `bert-engine pack` records them as the model's training command.
    KeyboardInterrupt writes a resumable checkpoint to output_dir/last before it propagates.
    """
    dist_info = dist_info or Distributed()
    device = torch.device(f"cuda:{dist_info.local_rank}") if (
        dist_info.world > 1 and torch.cuda.is_available() and (cfg.device in (None, "cuda"))) else pick_device(cfg.device)
    out = Path(cfg.output_dir)
    model = job.model.to(device).train()
    optimizer = torch.optim.AdamW(parameter_groups(model, cfg), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
    n = len(job.examples)
    global_batch = cfg.batch_size * dist_info.world
    micro_per_epoch = max(1, math.ceil(n / global_batch))
    steps_per_epoch = max(1, math.ceil(micro_per_epoch / cfg.grad_accum))
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    end = min(total, cfg.stop_after or total)  # where this invocation stops; the schedule spans `total`
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(int(cfg.warmup_ratio * total), total))
    amp_dtype = autocast_dtype(cfg.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    forward_model = model
    if dist_info.world > 1:
        forward_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=False)
    check_run_folder(out, cfg, getattr(job, "kind", "train"))  # before the log below trims anything
    log = MetricsLog(out / "metrics.jsonl", dist_info.is_main)
    state = {"step": 0, "best": None, "best_metric": None, "last_eval": None}
    seed_everything(cfg.seed + dist_info.rank)  # dropout; a resumed run restores the saved RNG states instead
    if cfg.resume:
        state = _restore(out / "last", model, optimizer, scheduler, scaler, state)
        log.keep_until(state["step"])
    if cfg.max_minutes and state.get("planned_steps"):  # a timed run resumed: the count set when it began
        total, end = _replan(cfg, scheduler, state["planned_steps"])
    # max_minutes: the speed of steps PLAN_FROM-PLAN_AT sets the count, re-timed over each doubling of the steps
    # (a GPU speeds up as it meets each new batch shape) until half the time is spent
    timing = _Timing(total) if cfg.max_minutes and not state.get("planned_steps") else None
    if dist_info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(settings_read(cfg, getattr(job, "kind", "train")), indent=2) + "\n",
                                               encoding="utf-8")
        logger.info("training %d examples, %d steps (%d per epoch), global batch %d x %d accumulation on %s%s%s",
                    n, total, steps_per_epoch, global_batch, cfg.grad_accum, device,
                    f" with {dist_info.world} processes" if dist_info.world > 1 else "",
                    f"; stopping at step {end}" if end < total else "")
    if cfg.length_buckets and not hasattr(job, "example_lengths"):
        logger.warning("length_buckets: this kind of training does not report example lengths; plain shuffling")
    if state["step"] >= end and dist_info.is_main:
        logger.warning("the run is at step %d already, at or past where it should %s (%d): nothing to train",
                       state["step"], "stop" if end < total else "end", end)
    state.setdefault("wall_seconds", 0.0)  # summed over the run's parts when resumed
    started, wall_before = time.monotonic(), state["wall_seconds"]
    bar = progress_bar(total=total, initial=state["step"], disable=not dist_info.is_main, desc="train", unit="step")
    running: dict[str, float] = {}
    running_count = 0
    step = state["step"]
    try:
        while step < end:
            epoch, within = divmod(step, steps_per_epoch)
            if hasattr(job, "new_epoch"):
                job.new_epoch(epoch)
            lengths = job.example_lengths() if cfg.length_buckets and hasattr(job, "example_lengths") else None
            order = epoch_order(n, cfg.seed + epoch, batch=global_batch, lengths=lengths, buckets=cfg.length_buckets)
            for s in range(within, steps_per_epoch):
                stats = _one_step(job, cfg, forward_model, model, optimizer, scheduler, scaler, amp_dtype, device,
                                  order, s, dist_info)
                step += 1
                if step % TRIM_EVERY == 0:
                    release_freed_memory()
                if timing is not None and timing.due(step - state["step"]):
                    now, window_from = time.monotonic(), timing.window_from
                    spent = wall_before + now - started
                    measured = timing.measure(step, step - state["step"], now, cfg.max_minutes * 60 - spent)
                    if measured is not None:
                        per_step, planned = measured
                        if dist_info.world > 1:  # every process must stop at the same step
                            planned = int(_mean_over_ranks({"steps": float(planned)}, dist_info, device)["steps"])
                        if not state.get("planned_steps") or abs(planned - total) > REPLAN_TOLERANCE * total:
                            total, end = _replan(cfg, scheduler, planned)
                            bar.total = total
                            bar.refresh()
                            if dist_info.is_main:
                                logger.info("max_minutes %g: %.3g s per step over steps %d-%d; the schedule ends at "
                                            "step %d", cfg.max_minutes, per_step, window_from, step, total)
                        state["planned_steps"] = total
                        if spent > cfg.max_minutes * 30:  # past half the time: the count stays
                            timing = None
                if not math.isfinite(stats["loss"]):  # the weights are ruined from here: stop, save nothing
                    raise NonFiniteLoss(
                        f"train: the loss is {stats['loss']} at step {step} (lr {scheduler.get_last_lr()[0]:.3g}); "
                        f"the run stopped there and saved nothing from that step (the last checkpoint is from step "
                        f"{step - 1 - (step - 1) % cfg.save_every}). Lower --lr, use --precision fp32, or check the "
                        f"data and the task's loss")
                for k, v in stats.items():
                    running[k] = running.get(k, 0.0) + v
                running_count += 1
                bar.update(1)
                logs = {}
                if step % cfg.log_every == 0 or step == end:
                    logs = _mean_over_ranks({k: v / running_count for k, v in running.items()}, dist_info, device)
                    logs["lr"] = scheduler.get_last_lr()[0]
                    logs["resident_mb"] = resident_mb()
                    bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items() if k in ("loss", "lr")})
                    log.write(step=step, epoch=round(step / steps_per_epoch, 4), **logs)
                    running, running_count = {}, 0
                end_of_epoch = (s == steps_per_epoch - 1)
                aside = time.monotonic()  # evaluations and checkpoints: left out of max_minutes' speed
                if (cfg.eval_every and step % cfg.eval_every == 0) or (not cfg.eval_every and end_of_epoch) or step == end:
                    _evaluate_and_keep_best(job, cfg, model, step, state, dist_info, log, out)
                    model.train()
                state["wall_seconds"] = wall_before + time.monotonic() - started
                if step % cfg.save_every == 0 and dist_info.is_main:
                    _checkpoint(out / "last", job, model, optimizer, scheduler, scaler, {**state, "step": step})
                if timing is not None:
                    timing.aside += time.monotonic() - aside
                if on_step is not None:
                    on_step(step, logs)
                if step >= end:
                    break
    except KeyboardInterrupt:
        if dist_info.is_main:
            logger.warning("interrupted at step %d; saving a resumable checkpoint to %s", step, out / "last")
            _checkpoint(out / "last", job, model, optimizer, scheduler, scaler, {**state, "step": step})
        raise
    finally:
        bar.close()
    if dist_info.is_main:
        _checkpoint(out / "last", job, model, optimizer, scheduler, scaler, {**state, "step": step})
        record = {"steps": step, "scheduled_steps": total, "wall_seconds": round(state["wall_seconds"], 3),
                  "device": str(device),
                  "autocast": str(amp_dtype).replace("torch.", "") if amp_dtype else None, "processes": dist_info.world,
                  **machine_description(device)}
        commands = _earlier_commands(out / "run.json") if cfg.resume else []
        if command:
            record["commands"] = [*commands, command]
        (out / "run.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if state["best"] is None:  # no evaluation data: the final weights are the result
            with atomic_folder(out / "best") as scratch:
                job.save(model, scratch)
    return {"steps": step, "best": state["best"], "best_metric": state["best_metric"],
            "last_eval": state["last_eval"], "output_dir": str(out)}


# max_minutes: the steps timed to set the schedule's length (the first PLAN_FROM warm caches and kernels),
# and how far a later timing must move the count to change the schedule.
PLAN_FROM, PLAN_AT, REPLAN_TOLERANCE = 10, 40, 0.02


class _Timing:
    """max_minutes' clock: the speed over steps PLAN_FROM-PLAN_AT, then over each doubling of the steps, with
    evaluations and checkpoints (`aside`, seconds the loop adds) left out; `measure` turns it into a step count."""

    def __init__(self, cap: int) -> None:
        self.cap, self.next, self.aside = cap, PLAN_AT, 0.0  # cap: the count max_steps / epochs allow
        self.since, self.window_from = 0.0, 0

    def due(self, done: int) -> bool:
        return done in (PLAN_FROM, self.next)

    def measure(self, step: int, done: int, now: float, left: float) -> tuple[float, int] | None:
        """(seconds per step, the step where `left` seconds run out) over the window ending now; None
        when this only opens the first window. Opens the next window either way."""
        measured = None
        if done > PLAN_FROM:
            per_step = max(1e-6, (now - self.since - self.aside) / (step - self.window_from))
            measured = per_step, max(step, min(self.cap, step + int(left / per_step)))
            self.next = 2 * done
        self.since, self.window_from, self.aside = now, step, 0.0
        return measured


def _replan(cfg: TrainConfig, scheduler, planned: int) -> tuple[int, int]:
    """A timed run's schedule set to `planned` steps: the learning-rate curve (warm-up, decay) rebuilt to
    end there; returns (total, end) as train() keeps them."""
    scheduler.lr_lambdas = [linear_schedule(int(cfg.warmup_ratio * planned), planned)] * len(scheduler.lr_lambdas)
    return planned, min(planned, cfg.stop_after or planned)


def _one_step(job, cfg, forward_model, model, optimizer, scheduler, scaler, amp_dtype, device, order, s,
              dist_info) -> dict[str, float]:
    """One optimizer step over `grad_accum` micro-batches of this rank's share of the global batches."""
    global_batch = cfg.batch_size * dist_info.world
    totals: dict[str, float] = {}
    for micro in range(cfg.grad_accum):
        g = s * cfg.grad_accum + micro
        indices = order[g * global_batch:(g + 1) * global_batch]
        mine = indices[dist_info.rank * cfg.batch_size:(dist_info.rank + 1) * cfg.batch_size]
        if not mine:  # the epoch's last global batch may not reach every rank or micro-step
            mine = indices[:1] or order[:1]
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + g * 31 + dist_info.rank)
        batch, targets = job.collate([job.examples[i] for i in mine], generator)
        sync = micro == cfg.grad_accum - 1 or dist_info.world == 1
        context = nullcontext() if sync else forward_model.no_sync()
        with context:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss, stats = job.loss(forward_model, batch, targets)
            scaler.scale(loss / cfg.grad_accum).backward()
        totals["loss"] = totals.get("loss", 0.0) + loss.item() / cfg.grad_accum
        mask = getattr(batch, "attention_mask", None)
        if isinstance(mask, torch.Tensor) and mask.numel():
            stats = {**stats, "padding": 1.0 - float(mask.sum()) / mask.numel()}  # the share of padded positions
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v / cfg.grad_accum
    scaler.unscale_(optimizer)
    if cfg.max_grad_norm > 0:
        totals["grad_norm"] = float(nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm))
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return totals


def _evaluate_and_keep_best(job, cfg, model, step, state, dist_info, log, out) -> None:
    model.eval()
    with torch.inference_mode():
        metrics = job.evaluate(model, dist_info.rank, dist_info.world)
    if not metrics:
        return
    state["last_eval"] = metrics
    log.write(step=step, eval=metrics)
    preferred, goal = getattr(job, "best_metric", None) or parse_best_metric(cfg.best_metric)
    try:
        name = pick_best_metric(metrics, preferred)
    except ValueError as err:  # the run folder now holds this run: say how to go on from it
        raise ValueError(f"{err}; correct --best-metric and rerun with --resume: {out} keeps the run (from its "
                         "last checkpoint, or from step 0 if it has none)") from None
    if name is None:
        return
    goal = goal if name == preferred else "max"
    value = float(metrics[name])
    if state["best"] is None or (value < state["best"] if goal == "min" else value > state["best"]):
        state["best"], state["best_metric"] = value, name
        if dist_info.is_main:
            with atomic_folder(out / "best") as scratch:
                job.save(model, scratch)
                (scratch / "eval.json").write_text(json.dumps({"step": step, **metrics}, indent=2) + "\n",
                                                   encoding="utf-8")
            logger.info("step %d: %s %.4f (best so far), saved to %s", step, name, value, out / "best")


@contextmanager
def atomic_folder(target: Path):
    """Write a folder all or nothing: into a hidden sibling, then swapped in by renames, so a crash
    or a kill mid-write leaves the previous complete folder (or, between the two renames, its
    `.old` copy, which `_restore` falls back to) and never a half-written one."""
    target = Path(target)
    scratch = target.with_name(f".{target.name}.partial")
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(scratch, ignore_errors=True)  # left by an earlier crash
    scratch.mkdir(parents=True)
    yield scratch
    for path in scratch.rglob("*"):  # on disk before the rename makes them visible
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    scratch.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _checkpoint(folder: Path, job, model, optimizer, scheduler, scaler, state) -> None:
    """Weights in the job's format plus everything needed to continue exactly (trainer_state.pt),
    written atomically."""
    with atomic_folder(folder) as scratch:
        _write_checkpoint(scratch, job, model, optimizer, scheduler, scaler, state)


def _write_checkpoint(folder: Path, job, model, optimizer, scheduler, scaler, state) -> None:
    job.save(model, folder)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "state": state, "rng": {
                    "python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}},
               folder / "trainer_state.pt")


def _numpy_state() -> tuple:
    """numpy's RNG state with its key array as a tensor, so the file loads with weights_only=True."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)


# What a resumed run cannot set anew: what its checkpoint restores (the optimizer's rates and decay, the RNG
# states the seed set) and what its model was built with. A new value would be recorded without being used, or
# fail to load. The rest may change on a resume, as the starter recipes do (a longer schedule, more data).
RESUME_KEEPS = frozenset({"task", "model", "preset", "family", "tokenizer", "objective", "teacher", "student_layers",
                          "lr", "head_lr", "weight_decay", "seed", "lora_rank", "lora_alpha", "lora_targets",
                          "init_adapter", "freeze_encoder"})


def check_run_folder(out: Path, cfg, kind: str) -> None:
    """A new run does not write over another (its checkpoints, its log); a resumed one keeps what its
    checkpoint restores and its model was built with (RESUME_KEEPS): a changed lr would be recorded in
    train_config.json and the model card without having been used."""
    record = out / "train_config.json"
    for folder in (out, *out.parents):  # the run's folder, or one it would be made in, that is a file
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--output-dir {out}: {'it' if folder == out else folder} is a file, not a folder; name "
                             "a folder for the run (it is made)")
    if not cfg.resume:
        held = [name for name in ("last", "best", "metrics.jsonl") if (out / name).exists()]
        if held:
            raise ValueError(f"{out} holds a run already ({', '.join(held)}): --resume continues it; for a new run "
                             "choose another --output-dir, or remove that one")
        return
    if not record.is_file() or not (out / "last").exists():
        return  # nothing to continue yet: _restore starts from step 0 and says so
    try:
        earlier = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    now = json.loads(json.dumps(settings_read(cfg, kind), default=str))
    changed = [f"{k} {earlier[k]!r} -> {now[k]!r}" for k in sorted(set(earlier) & set(now) & RESUME_KEEPS)
               if earlier[k] != now[k]]
    if changed:
        raise ValueError(f"--resume continues the run in {out} from its checkpoint, which keeps these settings as "
                         f"{record.name} has them: {'; '.join(changed)}. Resume without changing them, or start a new "
                         "run in another --output-dir (--init-adapter starts one from a packed model)")


def _restore(folder: Path, model, optimizer, scheduler, scaler, state) -> dict[str, Any]:
    path = folder / "trainer_state.pt"
    fallback = folder.with_name(f".{folder.name}.old") / "trainer_state.pt"
    if not path.is_file() and fallback.is_file():  # killed between atomic_folder's two renames
        path = fallback
    if not path.is_file():
        logger.warning("resume: no %s yet; starting from step 0", path)
        return state
    saved = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers only
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    rng = saved["rng"]
    random.setstate(rng["python"])
    kind, keys, position, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    logger.info("resumed from %s at step %d", path, saved["state"]["step"])
    return saved["state"]
