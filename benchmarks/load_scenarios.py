"""The three worst cases of issue 36, replayed against a running app (`python -m benchmarks.load_test
--scenario NAME` starts it and calls these):

- long-sessions: 12 sessions each keep one long legal request in flight (sentiment read in windows
  over ~63,000 tokens: the longest the limits allow); one light visitor's short sentiment requests are
  timed meanwhile. Target: the light visitor's p99 <= 5 s.
- deep-albert: 15 normal clients, first alone, then beside one visitor who picked, in the sentiment
  tab, the deepest ALBERT the limits accept (256 applied layers) and sends it long texts. Target: the
  normal clients keep >= 80 % of their quiet throughput.
- mcp-sessions: 8 MCP sessions, one slow tool call each, all at once. Target: none refused.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

LIGHT = ("A gorgeous, witty, seductive movie.", "", "truncate")


def _stats(latencies: list[float]) -> dict[str, float]:
    from benchmarks.load_test import percentile

    return {"requests": len(latencies), "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "p99_s": percentile(latencies, 99), "max_s": max(latencies) if latencies else float("nan")}


def long_sessions(url: str, seconds: float, sessions: int = 12, drain: float = 150) -> dict[str, Any]:
    """The light visitor's latencies while `sessions` sessions each keep a long legal request in flight."""
    from benchmarks.load_test import attack_calls, visitor

    long_args = attack_calls()[0][1]  # sentiment, windows, just under the token limit
    stop, lock = threading.Event(), threading.Lock()
    outcomes: dict[str, int] = {}
    light: list[float] = []
    light_errors: list[str] = []

    def long_loop(i: int) -> None:
        client = visitor(url, f"10.2.0.{i + 1}")  # twelve visitors, each one long request at a time
        while not stop.is_set():
            try:
                client.predict(*long_args, api_name="/sentiment")
                key = "answered"
            except Exception as err:  # noqa: BLE001 - a refusal or a time-out is an outcome
                key = str(err)[:60]
            with lock:
                outcomes[key] = outcomes.get(key, 0) + 1

    def light_loop() -> None:
        client = visitor(url, "10.3.0.1")
        time.sleep(5)  # the long requests are under way
        while not stop.is_set():
            start = time.perf_counter()
            try:
                client.predict(*LIGHT, api_name="/sentiment")
                light.append(time.perf_counter() - start)
            except Exception as err:  # noqa: BLE001 - counted and reported
                light_errors.append(str(err)[:120])
            time.sleep(0.5)

    threads = [threading.Thread(target=long_loop, args=(i,), daemon=True) for i in range(sessions)]
    threads.append(threading.Thread(target=light_loop, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    deadline = time.monotonic() + drain
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return {"scenario": "long-sessions", "sessions": sessions, "seconds": seconds, "light": _stats(light),
            "light_errors": light_errors[:5], "long_outcomes": outcomes,
            "target": "light p99 <= 5 s", "met": bool(light) and not light_errors and _stats(light)["p99_s"] <= 5}


def deep_albert_folder(root: Path) -> Path:
    """An ALBERT checkpoint at the limit config.py accepts: 256 applied layers (one shared layer run 256
    times: a few hundred thousand parameters, each token ~2.4 GFLOP), with MiniLM's tokenizer."""
    import dataclasses

    from bert_engine.checkpoints.hub import default_backbone
    from bert_engine.checkpoints.loader import load_tokenizer
    from bert_engine.checkpoints.loading import save_pretrained
    from bert_engine.config import MAX_APPLIED_LAYERS, BertConfig
    from bert_engine.model import BertModel

    tokenizer = load_tokenizer(default_backbone())
    config = dataclasses.replace(BertConfig(), model_type="albert", vocab_size=tokenizer.vocab_size, embedding_size=64,
                                 hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                 num_hidden_layers=MAX_APPLIED_LAYERS, max_position_embeddings=512)
    folder = root / "deep-albert"
    save_pretrained(BertModel(config), folder, tokenizer)
    return folder


def mcp_sessions(url: str, sessions: int = 8) -> dict[str, Any]:
    """`sessions` MCP sessions, each one slow tool call (sentiment over a long text in windows), at once."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from benchmarks.load_test import attack_calls

    text = attack_calls()[0][1][0][:40_000]  # a few seconds of work each

    async def one() -> tuple[bool, str, float]:
        start = time.perf_counter()
        async with streamable_http_client(url + "gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                answer = await session.call_tool("sentiment", {"text": text, "long_input": "windows"})
        words = " ".join(part.text for part in answer.content if part.type == "text")
        return answer.isError, words[:120], time.perf_counter() - start

    async def all_at_once():
        return await asyncio.gather(*(one() for _ in range(sessions)))

    results = asyncio.run(all_at_once())
    refused = [words for error, words, _ in results if error]
    return {"scenario": "mcp-sessions", "sessions": sessions, "refused": len(refused), "refusals": refused[:3],
            "seconds": _stats([s for _, _, s in results]), "target": "0 refused", "met": not refused}


def report(result: dict[str, Any]) -> None:
    print(json.dumps(result, indent=2, default=str))
