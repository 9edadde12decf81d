"""Load test: start the playground on loopback and drive every tab with concurrent gradio_client clients.

    python -m benchmarks.load_test                       # 32 clients for 120 s, then a table
    python -m benchmarks.load_test --clients 8 --seconds 30 --max-requests 500 --json load.json

Bounded in time (`--seconds`) and count (`--max-requests`), loopback only. Each client loops over
the tabs (sentiment, NER, QA, summary, fill-mask, and now and then an empty input, which must come
back as the task's message). Reported: requests, errors (anything but the expected messages),
p50/p95/p99 latency per tab and overall, and the server's resident memory after warm-up, at the end
and its peak. The app runs as a separate process (`python app.py`), exactly as users start it.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import machine, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_TEXT = ("The council approved the new budget on Monday after a long debate. Spending on schools rises by "
                "four percent. Road repairs get less money than last year. The mayor said the plan was fair. "
                "Opposition members called it short-sighted. A final vote on taxes is due next month.")
CALLS = {  # api name -> argument lists, cycled
    "sentiment": [("A gorgeous, witty, seductive movie.", "", "truncate"),
                  ("The plot is predictable and the acting is wooden.", "", "truncate")],
    "ner": [("Angela Merkel met Emmanuel Macron in Paris on Tuesday.", True, 3),
            ("Apple opened an office in Berlin.", True, 3)],
    "qa": [("Who wrote the book?", "The book, published in 1851, was written by Herman Melville.", 1),
           ("When was it published?", "The book, published in 1851, was written by Herman Melville.", 2)],
    "summary": [(SUMMARY_TEXT, 2, 0.3, 4, "auto")],
    "fill_mask": [("The capital of France is [MASK].", 5, "independent", ""),
                  ("She [MASK] to the [MASK] every day.", 3, "joint", "")],
}
EMPTY = {"sentiment": ("   ", "", "truncate"), "ner": ("", True, 3)}  # must return the task's own message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_app(port: int, concurrency: int) -> subprocess.Popen:
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "BERT_ENGINE_CONCURRENCY": str(concurrency), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the app exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "config", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the app did not answer on {url} within {timeout_s} s")


def client_loop(url: str, seed: int, stop: threading.Event, budget: list[int], results: list, lock: threading.Lock):
    from gradio_client import Client

    client = Client(url, verbose=False)
    rng = random.Random(seed)
    names = list(CALLS)
    while not stop.is_set():
        with lock:
            if budget[0] <= 0:
                return
            budget[0] -= 1
        name = rng.choice(names)
        empty = name in EMPTY and rng.random() < 0.05
        args = EMPTY[name] if empty else rng.choice(CALLS[name])
        start = time.perf_counter()
        error = None
        try:
            client.predict(*args, api_name=f"/{name}")
            if empty:
                error = "an empty input was answered instead of refused"
        except Exception as err:  # noqa: BLE001 - every failure is counted and reported
            if not (empty and "empty" in str(err)):
                error = f"{type(err).__name__}: {str(err)[:200]}"
        with lock:
            results.append((name, time.perf_counter() - start, error))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--max-requests", type=int, default=20_000, help="stop after this many requests in all")
    parser.add_argument("--concurrency", type=int, default=4, help="the app's per-event concurrency limit")
    parser.add_argument("--drain", type=float, default=120, help="seconds in-flight requests get after the end")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    process = start_app(port, args.concurrency)
    try:
        wait_ready(url, process)
        from gradio_client import Client

        warm = Client(url, verbose=False)  # one request per tab first: models load (lazily) before the clock starts
        for name, calls in CALLS.items():
            warm.predict(*calls[0], api_name=f"/{name}")
        rss_start = rss_mb(process.pid)
        stop, lock, budget, results = threading.Event(), threading.Lock(), [args.max_requests], []
        threads = [threading.Thread(target=client_loop, args=(url, i, stop, budget, results, lock), daemon=True)
                   for i in range(args.clients)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        next_report = began + 10
        while time.perf_counter() - began < args.seconds and any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if time.perf_counter() >= next_report:
                next_report += 10
                print(f"{time.perf_counter() - began:.0f} s: {len(results)} requests, "
                      f"{sum(r[2] is not None for r in results)} errors", file=sys.stderr, flush=True)
        stop.set()
        deadline = time.perf_counter() + args.drain  # requests in flight may finish; then they count as errors
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.perf_counter()))
        stuck = sum(t.is_alive() for t in threads)
        results += [("?", float("nan"), f"no answer {args.drain:g} s after the end")] * stuck
        elapsed = time.perf_counter() - began
        rss_end, rss_peak = rss_mb(process.pid), rss_mb(process.pid, "VmHWM")
    finally:
        process.terminate()
        process.wait(timeout=60)
    rows = []
    for name in [*CALLS, "all"]:
        mine = [r for r in results if name in ("all", r[0])]
        latencies = [r[1] for r in mine if r[1] == r[1]]  # not the NaN of requests never answered
        rows.append({"tab": name, "requests": len(mine), "errors": sum(r[2] is not None for r in mine),
                     "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
                     "p99_s": percentile(latencies, 99), "mean_s": statistics.fmean(latencies) if latencies else None})
    errors = sorted({r[2] for r in results if r[2]})
    info = machine()
    print(f"# load test: {args.clients} clients, {elapsed:.0f} s, {info['cpu']}, {info['threads']} threads; "
          f"{len(results) / elapsed:.1f} requests/s; server RSS {rss_start:.0f} MB after warm-up, "
          f"{rss_end:.0f} MB at the end, peak {rss_peak:.0f} MB")
    print_table(rows, ["tab", "requests", "errors", "p50_s", "p95_s", "p99_s", "mean_s"])
    for error in errors[:10]:
        print("error:", error)
    write_json(args.json, {"machine": info, "clients": args.clients, "seconds": elapsed, "rows": rows,
                           "rss_mb": {"after_warm_up": rss_start, "end": rss_end, "peak": rss_peak},
                           "errors": errors})
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
