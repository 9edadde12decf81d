"""The peers a user would pick instead of the engine, in their own environment: transformers' task
pipelines, and the same pipelines running optimum's ONNX Runtime models (ORTModelFor..., exported
from the same weights with `export=True`, as optimum's docs show).

optimum-onnx 0.1 needs transformers < 4.58 while the engine's suite pins transformers 5, so the peers
live in a virtualenv of their own and answer the benchmark over a pipe (one JSON object per line):

    python -m benchmarks.peers --setup ../venv-peers       # once: transformers 4.57.1, optimum-onnx 0.1.0
    python -m benchmarks.workloads --peers ../venv-peers/bin/python

The venv sees the machine's torch (--system-site-packages) and installs its own transformers,
tokenizers, optimum and onnxruntime. Timing is measured inside the peer process around each call, so
the pipe costs nothing; the workload benchmark runs the contenders in turn, round after round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PINS = ("transformers==4.57.1", "optimum==2.1.0", "optimum-onnx==0.1.0", "onnxruntime==1.32.0", "onnx==1.23.2")
CONTENDERS = ("transformers", "onnxruntime")
PIPELINES = {"sentiment": "text-classification", "ner": "token-classification", "qa": "question-answering",
             "fill_mask": "fill-mask"}  # summary: no pipeline extracts sentences; the glue of summary_reference.py


def setup(venv: Path) -> Path:
    """Create the peers' virtualenv (if missing) and install their pinned packages; returns its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PINS], check=True)
    return python


# -- the peer process (runs in the peers' venv) ---------------------------------------------------------

def _ort_class(task: str):
    from optimum import onnxruntime as ort  # noqa: PLC0415 - only in the peers' venv

    return {"sentiment": ort.ORTModelForSequenceClassification, "ner": ort.ORTModelForTokenClassification,
            "qa": ort.ORTModelForQuestionAnswering, "fill_mask": ort.ORTModelForMaskedLM,
            "summary": ort.ORTModelForFeatureExtraction}[task]


def _auto_class(task: str):
    import transformers  # noqa: PLC0415

    return {"sentiment": transformers.AutoModelForSequenceClassification,
            "ner": transformers.AutoModelForTokenClassification,
            "qa": transformers.AutoModelForQuestionAnswering, "fill_mask": transformers.AutoModelForMaskedLM,
            "summary": transformers.AutoModel}[task]


class Peer:
    """One task's pipelines: transformers on PyTorch, and on ONNX Runtime."""

    def __init__(self, task: str, folder: str, cache: str, items: list[Any], threads: int,
                 options: dict[str, Any] | None = None) -> None:
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        torch.set_num_threads(threads)
        self.task, self.items = task, items
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        started = time.perf_counter()
        exported = Path(cache) / f"{task}-onnx"
        if not (exported / "model.onnx").is_file():
            model = _ort_class(task).from_pretrained(folder, export=True)
            model.save_pretrained(exported)
            tokenizer.save_pretrained(exported)
        self.export_s = time.perf_counter() - started
        unused = {"add_pooling_layer": False} if task == "summary" else {}  # (its pooler: new weights, never read)
        models = {"transformers": _auto_class(task).from_pretrained(folder, **unused).eval(),
                  "onnxruntime": _ort_class(task).from_pretrained(exported)}
        if task == "summary":  # the engine's options (the model's manifest merged in), sent with the load request
            from benchmarks.summary_reference import SummaryReference, ort_encoder, torch_encoder  # noqa: PLC0415

            encoders = {"transformers": torch_encoder(models["transformers"]), "onnxruntime": ort_encoder(models["onnxruntime"])}
            self.pipelines = {name: SummaryReference(folder, encode, options or {}) for name, encode in encoders.items()}
            return
        kwargs: dict[str, Any] = {"aggregation_strategy": "first"} if task == "ner" else {}
        if task == "fill_mask":
            kwargs["top_k"] = 1
        self.pipelines = {name: transformers.pipeline(PIPELINES[task], model=model, tokenizer=tokenizer, device="cpu",
                                                      **kwargs) for name, model in models.items()}

    def _call(self, pipe, items: list[Any], batch: int) -> list[Any]:
        if self.task == "qa":
            return pipe(question=[x["question"] for x in items], context=[x["context"] for x in items],
                        batch_size=batch, max_answer_len=30, doc_stride=128, max_seq_len=384)
        texts = [x["text"] for x in items]
        if self.task == "summary":
            return pipe.many(texts)
        if self.task == "sentiment":
            return pipe(texts, batch_size=batch, truncation=True)
        return pipe(texts, batch_size=batch)

    def _normalise(self, pipe, output: Any) -> Any:
        """The answer in the form the benchmark compares: a label id, entity spans, an answer, a word."""
        if self.task == "sentiment":
            return pipe.model.config.label2id[output["label"]]
        if self.task == "ner":
            return sorted([e["start"], e["end"], e["entity_group"]] for e in output)
        if self.task == "qa":
            return output["answer"]
        if self.task == "summary":
            return output["selected"]
        return (output[0] if isinstance(output, list) else output)["token_str"].strip()

    def run(self, contender: str, mode: str, batch: int, limit: int | None = None) -> dict[str, Any]:
        import torch  # noqa: PLC0415

        pipe, items = self.pipelines[contender], self.items[:limit]
        latencies: list[float] = []
        with torch.inference_mode():
            started = time.perf_counter()
            if mode == "single":  # a visitor: one request at a time
                outputs = []
                for item in items:
                    t = time.perf_counter()
                    outputs += self._call(pipe, [item], 1) if self.task != "qa" else [self._call(pipe, [item], 1)]
                    latencies.append(time.perf_counter() - t)
            else:
                outputs = self._call(pipe, items, batch)
                outputs = outputs if isinstance(outputs, list) else [outputs]
            seconds = time.perf_counter() - started
        return {"seconds": seconds, "latencies": latencies,
                "predictions": [self._normalise(pipe, o) for o in outputs]}

    def one(self, contender: str, index: int) -> dict[str, Any]:
        """One visitor's request: item `index` alone, its seconds and its normalised answer (the benchmark
        takes turns with the engine request by request)."""
        import torch  # noqa: PLC0415

        pipe = self.pipelines[contender]
        with torch.inference_mode():
            started = time.perf_counter()
            output = self._call(pipe, [self.items[index]], 1)
            seconds = time.perf_counter() - started
        return {"seconds": seconds, "prediction": self._normalise(pipe, output if self.task == "qa" else output[0])}


def serve() -> None:
    """Answer the benchmark's requests on stdin, one JSON object per line, on the real stdout (libraries'
    prints go to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints lands on stderr, never in the protocol
    peer: Peer | None = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                peer = Peer(request["task"], request["folder"], request["cache"], request["items"],
                            request.get("threads", 2), request.get("options"))
                reply: dict[str, Any] = {"ok": True, "export_s": peer.export_s}
            elif request["op"] == "run" and peer is not None:
                reply = {"ok": True, **peer.run(request["contender"], request["mode"], request["batch"],
                                                request.get("limit"))}
            elif request["op"] == "one" and peer is not None:
                reply = {"ok": True, **peer.one(request["contender"], request["index"])}
            else:
                reply = {"ok": False, "error": f"unknown request {request.get('op')!r}"}
        except Exception as err:  # reported to the benchmark, which names the contender and stops
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(reply) + "\n")


class PeerProcess:
    """The benchmark's side of the pipe to a peer process (`python` of the peers' venv)."""

    def __init__(self, python: str) -> None:
        root = Path(__file__).resolve().parents[1]
        self.process = subprocess.Popen([python, "-m", "benchmarks.peers", "--serve"], cwd=root, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)

    def ask(self, **request: Any) -> dict[str, Any]:
        self.process.stdin.write(json.dumps(request) + "\n")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process ended (exit {self.process.poll()}); see its stderr above")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"peer: {reply['error']}")
        return reply

    def versions(self) -> dict[str, str]:
        done = subprocess.run([self.process.args[0], "-c", "import json, transformers, optimum.version, "
                               "onnxruntime; print(json.dumps({'transformers': transformers.__version__, "
                               "'optimum': optimum.version.__version__, 'onnxruntime': onnxruntime.__version__}))"],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", metavar="VENV", help="create or update the peers' virtualenv there")
    parser.add_argument("--serve", action="store_true", help="(internal) answer a benchmark on stdin/stdout")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
    elif args.setup:
        print(setup(Path(args.setup)))
    else:
        parser.error("give --setup VENV")


if __name__ == "__main__":
    main()
