"""How much of this machine's CPUs other work takes, and how many threads a forward pass should use beside it.

A forward pass on the CPU splits each step (a matmul, the attention, a LayerNorm) over its intra-op threads and
waits at the end of the step for the slowest. Where other work holds some of the CPUs (another process, a
neighbour on the same host stealing a virtual CPU, a test run), one of the threads is often not running, and
every step waits a scheduler time slice for it: on the 2-core Cascade Lake Xeon, beside a process keeping both
cores busy, a sentiment request took 186-204 ms p50 on 2 threads and 14-18 ms on 1 (session 44, by hand;
`python -m benchmarks.contention` measures it). So each forward chunk runs on at most as many threads as
there are CPUs free of other work, read from `/proc/stat` over the last `WINDOW_S` or more, and no more than the
container's CPU limit (its cgroup's quota, which torch's thread count does not follow); on a quiet machine without
a limit that is every thread, as before. BERT_ENGINE_SHARE_CPUS=0 turns it off.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import settings

WINDOW_S = 0.1  # /proc/stat counts in clock ticks (10 ms): a share read over less is mostly rounding


def affinity_cpus() -> list[int] | None:
    """The CPUs this process may run on (a container's cpuset, a taskset); None where the OS does not say."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def cpu_quota(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup may use (a container's `--cpus`, a Kubernetes CPU limit): cgroup v2's cpu.max,
    else v1's cpu.cfs_quota_us over cpu.cfs_period_us, in the container's own cgroup folder (the folder `own` names,
    else the root of `root`, as in its own namespace); None where there is no limit or none can be read. torch's
    thread count follows the CPUs a process sees, not this: 16 threads under a 2-CPU limit spend much of their time
    throttled, waiting for each other."""
    return cgroup_limit(root, own)[0]


def cgroup_limit(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> tuple[float | None, Path | None]:
    """(cpu_quota's limit, the cpu.stat file that counts the periods the cgroup was throttled in); (None, None)
    where there is no limit."""
    folders = []  # the folders /proc names first (a root without a limit may hold a limited child), then the root
    for line in (_text(Path(own)) or "").splitlines():
        hierarchy, _, controllers_path = line.partition(":")
        controllers, _, path = controllers_path.partition(":")
        if hierarchy.isdigit() and path.startswith("/") and path != "/" and (controllers in ("", "cpu") or
                                                                             "cpu" in controllers.split(",")):
            folders.append(path.lstrip("/"))
    for folder in [*folders, ""]:
        base = Path(root, folder)
        words = (_text(base / "cpu.max") or "").split()  # cgroup v2: "max 100000" or "200000 100000"
        if words[:1] == ["max"]:
            return None, None
        if len(words) >= 2 and words[0].isdigit() and words[1].isdigit():
            return _limit(int(words[0]), int(words[1]), base)
        for v1 in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            base = Path(root, v1, folder)
            quota, period = _integer(base / "cpu.cfs_quota_us"), _integer(base / "cpu.cfs_period_us")
            if quota is not None and period is not None:
                return (None, None) if quota <= 0 else _limit(quota, period, base)
    return None, None


def _text(path: Path) -> str | None:
    """A small kernel file's text, None where it cannot be read."""
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None


def _integer(path: Path) -> int | None:
    text = (_text(path) or "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def _limit(quota: int, period: int, folder: Path) -> tuple[float | None, Path | None]:
    return (quota / period, folder / "cpu.stat") if quota > 0 and period > 0 else (None, None)


def throttled_periods(stat: Path | str) -> int | None:
    """The periods a cgroup ran out of its CPU quota in (its cpu.stat's nr_throttled), None where not readable."""
    for line in (_text(Path(stat)) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "nr_throttled":
            return int(value) if value.strip().isdigit() else None
    return None


def busy_ticks(stat: str = "/proc/stat", cpus: list[int] | None = None) -> int | None:
    """Clock ticks the CPUs `cpus` (None: all, the total row) spent on anything but idle and iowait since boot, a
    virtual machine's steal included; None where `stat` (Linux's per-CPU counters) cannot be read or parsed."""
    names = ["cpu"] if cpus is None else [f"cpu{n}" for n in cpus]
    try:
        with open(stat, encoding="ascii") as counters:
            rows = {line.split()[0]: line.split()[1:9] for line in counters if line.startswith("cpu")}
        ticks = [[int(v) for v in rows[name]] for name in names]  # user .. steal, per CPU
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError):
        return None
    if any(len(t) < 5 for t in ticks):
        return None
    return sum(sum(t) - t[3] - t[4] for t in ticks)


class FreeCpus:
    """The number of CPUs (of this process's) that other work left free over the latest window of at least
    `window` seconds: read from `stat` when a window has passed since the last reading, else the last answer.
    Other work is every CPU second the counters show less this process's own (`own`: its threads' CPU time,
    spinning ones included). Thread-safe; a reading costs one read of `stat` (tens of microseconds)."""

    def __init__(self, stat: str = "/proc/stat", window: float = WINDOW_S,
                 own: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 cpus: list[int] | None = None, quota: float | None | bool = True,
                 throttling: Path | str | None = None) -> None:
        self.stat, self.window, self.own, self.clock = stat, window, own, clock
        self.cpus = cpus if cpus is not None else affinity_cpus()
        # The cgroup's CPU limit (True: read it now, cgroup_limit), rounded, at least 1 (None: no limit), and the file
        # that counts its throttled periods. The limit holds while the cgroup is throttled: short requests now and
        # then run on every thread within the quota's burst (under a 1-CPU limit a sentiment request took 11.6 ms
        # p50 on 2 threads, 16.1 on 1), a steady stream of them does not (64 ms p95 on 2, 24 on 1; session 44).
        if quota is True:
            quota, throttling = cgroup_limit()
        self.limit = None if quota is None else max(1, round(quota))
        self.throttling = throttling
        self._throttled = throttled_periods(throttling) if throttling is not None else None
        self._capped = throttling is None  # where throttling cannot be watched, the limit always holds
        self._lock = threading.Lock()
        self._last: tuple[int, float, float] | None = None  # (busy ticks, own CPU seconds, clock) of the last reading
        self._free: float | None = None  # CPUs free of other work over the last window; None: not known yet
        self._reading(clock())

    def _reading(self, now: float) -> None:
        ticks = busy_ticks(self.stat, self.cpus)
        if ticks is None:
            self._last = None
            return
        own = self.own()
        if self._last is not None:
            before_ticks, before_own, before = self._last
            seconds = now - before
            count = len(self.cpus) if self.cpus else os.cpu_count() or 1
            others = (ticks - before_ticks) / os.sysconf("SC_CLK_TCK") - (own - before_own)
            self._free = count - min(float(count), max(0.0, others / seconds))
            self._watch_throttling((own - before_own) / seconds)
        self._last = (ticks, own, now)

    def _watch_throttling(self, own_rate: float) -> None:
        """The limit starts to hold when the cgroup was throttled in the last window, and stops when a window saw
        no throttling and this process using under half the limit (requests now and then, not a stream)."""
        if self.throttling is None or self.limit is None:
            return
        throttled = throttled_periods(self.throttling)
        if throttled is None or self._throttled is None:
            self._capped = True
        elif throttled > self._throttled:
            self._capped = True
        elif own_rate < 0.5 * self.limit:
            self._capped = False
        self._throttled = throttled

    def free(self) -> float | None:
        """CPUs free of other work over the latest window (a fraction: 1.3 of 2), None where not known."""
        with self._lock:
            now = self.clock()
            if self._last is None or now - self._last[2] >= self.window:
                self._reading(now)
            return self._free

    def threads(self, wanted: int) -> int:
        """At most `wanted` threads, at most the cgroup's CPU limit (`limit`) while it throttles, and at most the CPUs
        other work left free, rounded (at least 1); those not known (no /proc/stat, the first window not over, no
        limit) do not count. `wanted` where BERT_ENGINE_SHARE_CPUS is off."""
        if not settings.get("BERT_ENGINE_SHARE_CPUS") or wanted <= 1:  # (the setting is read, and checked, first)
            return wanted
        free = self.free()
        most = wanted if self.limit is None or not self._capped else min(wanted, self.limit)
        return most if free is None else max(1, min(most, round(free)))


FREE_CPUS = FreeCpus()  # the process's one reading: every forward chunk asks it (inference.forward_in_chunks)
