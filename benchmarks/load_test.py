"""Load test: start the playground on loopback and drive every tab with concurrent gradio_client clients.

    python -m benchmarks.load_test                       # 32 clients for 120 s, then a table
    python -m benchmarks.load_test --clients 8 --seconds 30 --max-requests 500 --json load.json
    python -m benchmarks.load_test --clients 15 --seconds 60 --attacker   # quiet, then with one attacker
    python -m benchmarks.load_test --scenario long-sessions --seconds 60  # issue 36's worst cases, one each:
    python -m benchmarks.load_test --scenario deep-albert --clients 15 --seconds 60
    python -m benchmarks.load_test --scenario mcp-sessions

Bounded in time (`--seconds`) and count (`--max-requests`), loopback only. Each client loops over
the tabs (sentiment, NER, QA, summary, fill-mask, and now and then an empty input, which must come
back as the task's message). Reported: requests, errors (anything but the expected messages),
p50/p95/p99 latency per tab and overall, and the server's resident memory after warm-up, at the end
and its peak. The app runs as a separate process (`python app.py`), exactly as users start it.

With `--attacker`, the clients run twice for `--seconds` each: first alone (quiet), then beside one
attacker: a single visitor (one session) sending, from `--attacker-threads` parallel requests, the
slowest requests the limits allow (sentiment with windows at the token limit, a 1,990-sentence
summary, fill-mask with 100 targets, QA over a long context). Reported: the normal clients'
requests/s in each phase and their ratio, and what the attacker got (answers, refusals).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import load_scenarios
from benchmarks.common import machine, print_table, write_json

SCENARIOS = ("mixed", "long-sessions", "deep-albert", "mcp-sessions")

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
    "summary": [(SUMMARY_TEXT, "2 sentences", 4, "auto")],
    "fill_mask": [("The capital of France is [MASK].", 5, "independent", ""),
                  ("She [MASK] to the [MASK] every day.", 3, "joint", "")],
}
EMPTY = {"sentiment": ("   ", "", "truncate"), "ner": ("", True, 3)}  # must return the task's own message


ATTACKER_ADDRESS = "10.66.0.1"


def visitor(url: str, address: str):
    """A gradio_client session as a visitor at `address` sees it: loopback connections are the app's trusted
    proxy (uvicorn's default), so X-Forwarded-For names the visitor's address, as a Space's proxy does;
    without it every simulated visitor would be one address and share its in-flight cap."""
    from gradio_client import Client

    return Client(url, verbose=False, headers={"X-Forwarded-For": address})


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
    """`python app.py` on loopback; its log goes to a temporary file (a pipe nobody reads would fill
    up and freeze the server mid-test)."""
    import tempfile

    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "BERT_ENGINE_CONCURRENCY": str(concurrency), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=log, text=True)
    process.log = log
    return process


def app_log_tail(process: subprocess.Popen, chars: int = 2000) -> str:
    process.log.seek(0)
    return process.log.read()[-chars:]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the app exited with {process.returncode}: {app_log_tail(process)}")
        try:
            with urllib.request.urlopen(url + "config", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the app did not answer on {url} within {timeout_s} s")


def attack_calls() -> list[tuple[str, tuple]]:
    """The slowest requests the app's limits allow (each must be answered or refused, quickly)."""
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
             "tau upsilon phi chi psi omega").split()
    rng = random.Random(0)
    prose = " ".join(rng.choice(words) for _ in range(44_000))  # ~63,000 tokens: just under the request limit
    sentences = " ".join(f"Sentence {i} tells of {rng.choice(words)} and {rng.choice(words)}." for i in range(1_990))
    targets = ", ".join(words[:20] * 5)
    return [("sentiment", (prose, "", "windows")),
            ("summary", (sentences, "5 sentences", 4, "auto")),
            ("fill_mask", ("The [MASK] " + " ".join(words * 4), 5, "independent", targets)),
            ("qa", ("Which letter comes after eta?", prose[:170_000], 1))]


def attacker_loop(url: str, stop: threading.Event, client, results: list, lock: threading.Lock, offset: int,
                  calls: list | None = None):
    """Slow requests (`calls`, default attack_calls()) back to back; `client` None: a new session for every
    request (the per-visitor in-flight limit never sees the same visitor twice; only the compute gate's
    scheduling is left)."""

    calls = calls or attack_calls()
    i = offset
    while not stop.is_set():
        name, args = calls[i % len(calls)]
        i += 1
        start = time.perf_counter()
        try:
            (client or visitor(url, ATTACKER_ADDRESS)).predict(*args, api_name=f"/{name}")
            outcome = "answered"
        except Exception as err:  # noqa: BLE001 - a refusal is an answer too
            outcome = "refused: " + str(err)[:120]
        with lock:
            results.append((name, time.perf_counter() - start, outcome))


def client_loop(url: str, seed: int, stop: threading.Event, budget: list[int], results: list, lock: threading.Lock):
    client = visitor(url, f"10.1.{seed // 250}.{seed % 250 + 1}")  # each client a visitor of its own
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
    parser.add_argument("--concurrency", type=int, default=64, help="the app's per-event concurrency limit "
                        "(BERT_ENGINE_CONCURRENCY; the app's default)")
    parser.add_argument("--drain", type=float, default=120, help="seconds in-flight requests get after the end")
    parser.add_argument("--attacker", action="store_true", help="run quiet, then beside one attacker; compare")
    parser.add_argument("--attacker-threads", type=int, default=4, help="the attacker's parallel requests")
    parser.add_argument("--rotate-sessions", action="store_true",
                        help="the attacker opens a new session for every request (dodging per-visitor limits)")
    parser.add_argument("--scenario", choices=SCENARIOS, default="mixed",
                        help="mixed: the clients above; the others replay issue 36's worst cases "
                             "(benchmarks/load_scenarios.py): long-sessions, deep-albert (implies --attacker), "
                             "mcp-sessions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.attacker = args.attacker or args.scenario == "deep-albert"
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory() as models:
        if args.scenario == "deep-albert":  # the attacker's model, in a folder the app's picker allows
            args.albert = str(load_scenarios.deep_albert_folder(Path(models)))
            os.environ["BERT_ENGINE_MODEL_DIRS"] = models
        process = start_app(port, args.concurrency)
        try:
            wait_ready(url, process)
            from gradio_client import Client

            warm = Client(url, verbose=False)  # one request per tab first: models load (lazily) before the clock starts
            for name, calls in CALLS.items():
                warm.predict(*calls[0], api_name=f"/{name}")
            rss_start = rss_mb(process.pid)
            if args.scenario in ("long-sessions", "mcp-sessions"):
                result = (load_scenarios.long_sessions(url, args.seconds) if args.scenario == "long-sessions"
                          else load_scenarios.mcp_sessions(url))
                result.update(machine=machine(), rss_mb={"after_warm_up": rss_start, "end": rss_mb(process.pid),
                                                         "peak": rss_mb(process.pid, "VmHWM")})
                load_scenarios.report(result)
                write_json(args.json, result)
                return 0 if result["met"] else 1
            phases = {}
            for phase in (["quiet", "attacked"] if args.attacker else ["run"]):
                phases[phase] = run_phase(url, args, attacked=phase == "attacked")
            rss_end, rss_peak = rss_mb(process.pid), rss_mb(process.pid, "VmHWM")
        finally:
            process.terminate()
            process.wait(timeout=60)
    info = machine()
    errors: list[str] = []
    for phase, (results, elapsed, attacks) in phases.items():
        rows = []
        for name in [*CALLS, "all"]:
            mine = [r for r in results if name in ("all", r[0])]
            latencies = [r[1] for r in mine if r[1] == r[1]]  # not the NaN of requests never answered
            rows.append({"tab": name, "requests": len(mine), "errors": sum(r[2] is not None for r in mine),
                         "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
                         "p99_s": percentile(latencies, 99), "mean_s": statistics.fmean(latencies) if latencies else None})
        errors += sorted({r[2] for r in results if r[2]})
        print(f"# load test, {phase}: {args.clients} clients, {elapsed:.0f} s, {info['cpu']} "
              f"({info.get('cpu_capability', '?')}), {info['threads']} threads; {len(results) / elapsed:.1f} requests/s")
        print_table(rows, ["tab", "requests", "errors", "p50_s", "p95_s", "p99_s", "mean_s"])
        if attacks:
            outcomes: dict[str, int] = {}
            for name, _, outcome in attacks:
                key = f"{name}: {outcome.split(':')[0]}"
                outcomes[key] = outcomes.get(key, 0) + 1
            sessions = "a new session per request" if args.rotate_sessions else "one session"
            print(f"# the attacker ({args.attacker_threads} parallel requests, {sessions}): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
            for reason in sorted({o for _, _, o in attacks if o != "answered"})[:5]:
                print("#   ", reason)
    ratio = None
    if args.attacker:
        quiet = len(phases["quiet"][0]) / phases["quiet"][1]
        attacked = len(phases["attacked"][0]) / phases["attacked"][1]
        ratio = attacked / quiet
        print(f"# normal clients: {quiet:.1f} requests/s quiet, {attacked:.1f} with the attacker "
              f"({100 * ratio:.0f} % of quiet; the target is at least 80 %)")
    print(f"# server RSS {rss_start:.0f} MB after warm-up, {rss_end:.0f} MB at the end "
          f"({100 * (rss_end / rss_start - 1):+.0f} %; the target is at most +25 %), peak {rss_peak:.0f} MB")
    for error in sorted(set(errors))[:10]:
        print("error:", error)
    write_json(args.json, {"machine": info, "clients": args.clients, "scenario": args.scenario,
                           "throughput_ratio": ratio, "rss_growth": rss_end / rss_start - 1,
                           "phases": {k: {"requests": len(v[0]), "seconds": v[1], "attacks": len(v[2])}
                                      for k, v in phases.items()},
                           "rss_mb": {"after_warm_up": rss_start, "end": rss_end, "peak": rss_peak},
                           "errors": sorted(set(errors))})
    return 1 if errors else 0


def run_phase(url: str, args, *, attacked: bool) -> tuple[list, float, list]:
    """The normal clients for `args.seconds` (with the attacker beside them when `attacked`):
    (their results, the seconds it took, the attacker's results)."""

    stop, lock, budget, results, attacks = threading.Event(), threading.Lock(), [args.max_requests], [], []
    threads = [threading.Thread(target=client_loop, args=(url, i, stop, budget, results, lock), daemon=True)
               for i in range(args.clients)]
    attackers = []
    if attacked:
        # one visitor: one session for every attacking request (or, rotating, a new session each time)
        client = None if args.rotate_sessions else visitor(url, ATTACKER_ADDRESS)
        loop, calls = attacker_loop, attack_calls()
        if getattr(args, "albert", None):  # deep-albert: the visitor's sentiment tab uses the deepest ALBERT allowed
            client = client or visitor(url, ATTACKER_ADDRESS)
            client.predict(args.albert, api_name="/sentiment_model")
            calls = [("sentiment", (calls[0][1][0][:20_000], "", "windows")), ("sentiment", ("A short one.", "", "truncate"))]
        attackers = [threading.Thread(target=loop, args=(url, stop, client, attacks, lock, i, calls), daemon=True)
                     for i in range(args.attacker_threads)]
    for thread in attackers:
        thread.start()
    if attackers:
        time.sleep(2)  # the attack is under way before the clock starts
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    next_report = began + 10
    while time.perf_counter() - began < args.seconds and any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.perf_counter() >= next_report:
            next_report += 10
            print(f"{time.perf_counter() - began:.0f} s: {len(results)} requests, "
                  f"{sum(r[2] is not None for r in results)} errors, {len(attacks)} attacks", file=sys.stderr, flush=True)
    stop.set()
    elapsed = time.perf_counter() - began
    deadline = time.perf_counter() + args.drain  # requests in flight may finish; then they count as errors
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.perf_counter()))
    stuck = sum(t.is_alive() for t in threads)
    results += [("?", float("nan"), f"no answer {args.drain:g} s after the end")] * stuck
    for thread in attackers:
        thread.join(timeout=max(0.0, deadline - time.perf_counter()))
    return results, elapsed, attacks


if __name__ == "__main__":
    raise SystemExit(main())
