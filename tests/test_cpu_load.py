"""Forwards beside other work: the CPUs other work leaves free (runtime/cpu_load.py), read from written
/proc/stat counters and from real spinning processes, and the thread count each forward chunk runs on."""

import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from bert_engine.runtime import cpu_load
from bert_engine.runtime.cpu_load import FreeCpus, busy_ticks
from bert_engine.runtime.inference import forward_in_chunks

TICK = os.sysconf("SC_CLK_TCK")


class Counters:
    """A /proc/stat of two CPUs (and a third this process may not run on), whose busy ticks a test moves."""

    def __init__(self, path):
        self.path, self.busy = path, {0: 0, 1: 0, 7: 0}
        self.write()

    def add(self, cpu: int, seconds: float) -> None:
        self.busy[cpu] += round(seconds * TICK)
        self.write()

    def write(self) -> None:
        total = sum(self.busy.values())
        rows = [f"cpu  {total} 0 0 5000 10 0 0 0 0 0"]
        rows += [f"cpu{n} {ticks} 0 0 5000 10 0 0 0 0 0" for n, ticks in self.busy.items()]
        self.path.write_text("\n".join(rows) + "\nintr 1 2 3\n")


def test_other_work_on_this_process_cpus_leaves_fewer_threads(tmp_path, monkeypatch):
    counters = Counters(tmp_path / "stat")
    now, own = [0.0], [0.0]
    free = FreeCpus(str(tmp_path / "stat"), window=0.1, own=lambda: own[0], clock=lambda: now[0], cpus=[0, 1])
    assert free.threads(2) == 2  # no window over yet: torch's count
    now[0] = 1.0
    counters.add(0, 1.0)  # another process kept one CPU busy for the whole second
    counters.add(7, 1.0)  # a CPU this process may not run on: not counted
    assert free.free() == pytest.approx(1.0) and free.threads(2) == 1 and free.threads(1) == 1
    counters.add(1, 1.0)  # counted only at the next reading, a window on
    now[0] = 1.05
    assert free.threads(2) == 1
    now[0] = 2.0
    counters.add(0, 0.95)  # this process's own second (its threads, spinning ones too) is not other work
    own[0] += 1.0
    assert free.free() == pytest.approx(1.05, abs=0.02) and free.threads(2) == 1  # 1.95 busy, 1 of it ours
    now[0] = 3.0  # quiet: every thread again, never more than asked for
    assert free.threads(2) == 2 and free.threads(8) == 2 and free.threads(1) == 1
    now[0] = 4.0
    counters.add(0, 0.3)  # a little other work: 1.7 CPUs free rounds to 2
    assert free.threads(2) == 2
    now[0] = 5.0
    counters.add(0, 0.7)
    assert free.threads(2) == 1
    monkeypatch.setenv("BERT_ENGINE_SHARE_CPUS", "0")
    assert free.threads(2) == 2


@pytest.mark.parametrize("text", [None, "", "cpu0 1 2\n", "cpu  x y z w v\ncpu0 x y z w v\ncpu1 1 1 1 1 1\n",
                                  "\udcff", "cpu0 1 2 3 4 5 6 7 8\n"])
def test_counters_that_cannot_be_read_leave_torchs_thread_count(tmp_path, text):
    path = tmp_path / "stat"
    if text is not None:
        path.write_text(text, errors="surrogateescape")
    now = [0.0]
    free = FreeCpus(str(path), window=0.1, clock=lambda: now[0], cpus=[0, 1])
    now[0] = 1.0
    assert free.threads(2) == 2 and free.free() is None


def test_the_real_counters_read_where_linux_has_them():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat (not Linux)")
    assert busy_ticks() > 0 and busy_ticks(cpus=[sorted(os.sched_getaffinity(0))[0]]) > 0
    assert busy_ticks(cpus=[100000]) is None  # a CPU the counters do not have


@pytest.mark.busy_meter
def test_spinning_processes_on_every_cpu_leave_one_thread():
    if not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux's /proc/stat and two CPUs or more")
    cpus = sorted(os.sched_getaffinity(0))[:2]  # two CPUs, each held by a spinner pinned to it (any machine's size)
    free = FreeCpus(window=0.3, cpus=cpus, quota=None)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu})) for cpu in cpus]
    try:
        time.sleep(0.6)
        assert free.threads(2) == 1, free.free()
    finally:
        for process in spinners:
            process.kill()
            process.wait()


class Threads(nn.Module):
    """Records the intra-op thread count each forward runs on."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids):
        self.seen.append(torch.get_num_threads())
        return input_ids.float()


def test_each_forward_chunk_runs_on_the_threads_the_free_cpus_allow(monkeypatch):
    before = torch.get_num_threads()
    asked = []
    monkeypatch.setattr(cpu_load.FREE_CPUS, "threads", lambda wanted: asked.append(wanted) or 1)
    model = Threads()
    forward_in_chunks(model, {"input_ids": torch.zeros(5, 3, dtype=torch.long)}, max_rows=2, max_flops=1e12)
    assert model.seen == [1, 1, 1] and asked == [before] * 3 and torch.get_num_threads() == before
    model.seen.clear()
    forward_in_chunks(model, {"input_ids": torch.zeros(2, 3, dtype=torch.long, device="meta")}, max_flops=1e12)
    assert model.seen == [before] and len(asked) == 3  # not on the CPU: not asked


def _cgroup(tmp_path, files: dict[str, str], own: str = "0::/\n"):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self").write_text(own)
    return str(root), str(tmp_path / "self")


@pytest.mark.parametrize(("files", "own", "limit"), [
    ({"cpu.max": "200000 100000\n"}, "0::/\n", 2.0),  # cgroup v2, the container's namespace: its root
    ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # no limit
    ({"kubepods/pod1/cpu.max": "150000 100000\n"}, "0::/kubepods/pod1\n", 1.5),  # v2, the folder /proc names
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "", 1.0),  # cgroup v1
    ({"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"},
     "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n", 3.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "", None),  # v1, no limit
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000", "cpu/bench/cpu.cfs_quota_us": "100000",
      "cpu/bench/cpu.cfs_period_us": "100000"}, "1:cpu:/bench\n", 1.0),  # v1 without a namespace: its own folder
    ({"cpu.max": "lots of\n"}, "", None), ({"cpu.max": "0 0\n"}, "", None), ({}, "garbage", None),
])
def test_a_containers_cpu_limit_is_read_from_its_cgroup(tmp_path, files, own, limit):
    root, own_file = _cgroup(tmp_path, files, own)
    assert cpu_load.cpu_quota(root, own_file) == limit


def test_threads_stay_within_the_containers_cpu_limit(tmp_path):
    Counters(tmp_path / "stat")  # a quiet machine
    now = [0.0]
    free = FreeCpus(str(tmp_path / "stat"), clock=lambda: now[0], cpus=[0, 1], quota=1.0)
    assert free.threads(8) == 1  # before any window: the limit alone
    now[0] = 1.0
    assert free.threads(2) == 1 and free.free() == pytest.approx(2.0)  # quiet, but the cgroup allows one CPU
    for quota, limit in ((2.4, 2), (0.3, 1), (None, None)):
        assert FreeCpus(str(tmp_path / "stat"), cpus=[0, 1], quota=quota).limit == limit


def test_the_limit_holds_while_the_cgroup_is_throttled(tmp_path):
    """Requests now and then run on every thread within the quota's burst; once the cgroup runs out of quota the
    limit holds, until a window without throttling in which this process used under half of it."""
    Counters(tmp_path / "stat")
    throttling = tmp_path / "cpu.stat"
    throttling.write_text("nr_periods 100\nnr_throttled 5\nthrottled_time 1000\n")
    now, own = [0.0], [0.0]
    free = FreeCpus(str(tmp_path / "stat"), clock=lambda: now[0], own=lambda: own[0], cpus=[0, 1], quota=1.0,
                    throttling=throttling)
    assert free.threads(2) == 2
    for t, throttled, used, threads in ((1.0, 7, 0.9, 1), (2.0, 7, 0.9, 1), (3.0, 7, 0.1, 2), (4.0, 8, 0.2, 1)):
        now[0], own[0] = t, own[0] + used
        throttling.write_text(f"nr_periods 100\nnr_throttled {throttled}\nthrottled_time 1000\n")
        assert free.threads(2) == threads, t
    now[0] = 5.0
    throttling.write_text("garbage")  # unreadable: the limit holds
    assert free.threads(2) == 1
    assert cpu_load.throttled_periods(tmp_path / "missing") is None


def test_the_cgroup_limit_comes_with_its_throttling_counter(tmp_path):
    root, own_file = _cgroup(tmp_path, {"pod/cpu.max": "100000 100000\n", "pod/cpu.stat": "nr_throttled 3\n"},
                             "0::/pod\n")
    limit, stat = cpu_load.cgroup_limit(root, own_file)
    assert limit == 1.0 and cpu_load.throttled_periods(stat) == 3
