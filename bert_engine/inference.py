"""Predictor: one task's model and tokenizer on a device, run in inference mode, results with provenance.

Chooses the device (CUDA, then MPS, then CPU) and dtype (bf16/fp16 on GPU, fp32 on CPU), checks
the inputs against the task's declared fields and options, and keeps the last input so the
playground can show its attention. Batching across requests is the caller's business.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .hookspecs import InputError
from .registry import RegisteredTask
from .tokenizer import Batch, Tokenizer

logger = logging.getLogger(__name__)

MAX_INPUT_CHARS = 1_000_000  # per field; longer input is refused before tokenising


def pick_device(preference: str | None = None) -> torch.device:
    """The given device, else CUDA, then Apple MPS, then CPU."""
    if preference:
        return torch.device(preference)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU (exact parity with the reference)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


@dataclass
class LastInput:
    """The most recent batch, kept on the CPU for the attention view."""

    tokens: list[str]
    batch: Batch


class Predictor:
    """Runs one registered task. `predict` returns {"task", "result", "provenance"}."""

    def __init__(self, task: RegisteredTask, model: nn.Module, tokenizer: Tokenizer, *,
                 model_id: str, revision: str | None = None, untrained_head: bool = False) -> None:
        self.task = task
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.untrained_head = untrained_head
        self.precision: str | None = None  # "int8" etc. when chosen; else the parameters' dtype says it
        self.device = next(model.parameters()).device
        self.last: LastInput | None = None
        self.max_rows = 32  # rows (windows) per forward pass
        self._lock = threading.Lock()  # one forward pass at a time per model; callers queue

    @classmethod
    def load(cls, task: RegisteredTask, checkpoint: str | None = None, *, device: str | None = None,
             precision: str = "auto", pack: bool = True, compile: bool = False, **load_kwargs) -> Predictor:
        """Load the task's model: `checkpoint`, else the task's default, else the default backbone.

        Args:
            precision: "auto" (fp32 on CPU, bf16/fp16 on GPU), "fp32", "bf16", "fp16" or "int8"
                (dynamic quantisation of the encoder's linear layers, CPU only); see fast.py.
            pack: on the CPU, run the encoder's linear layers through pre-packed oneDNN matmuls.
            compile: torch.compile the encoder layers (slow first calls, faster steady state).
        """
        from .fast import precision_dtype, prepare_for_inference
        from .hub import default_backbone
        from .loading import load

        name = checkpoint or task.spec.default_checkpoint or default_backbone()
        target = pick_device(device)
        # precision_dtype checks the precision (and int8's device) before anything loads
        model, tokenizer = load(name, task.spec.build_head, device=target, dtype=precision_dtype(precision, target),
                                **load_kwargs)
        untrained = bool(model.load_report.missing)
        model = prepare_for_inference(model, precision, pack=pack, compile=compile)
        predictor = cls(task, model, tokenizer, model_id=str(name),
                        revision=model.checkpoint.commit or model.checkpoint.revision, untrained_head=untrained)
        predictor.precision = "int8" if precision == "int8" else None
        return predictor

    def check_inputs(self, inputs: Any, options: Mapping[str, Any]) -> dict[str, Any]:
        """Raise InputError naming the problem; return the options merged with the task's defaults."""
        spec = self.task.spec
        if not isinstance(inputs, Mapping):
            raise InputError(f"{spec.name}: inputs must be a mapping with {spec.input_fields}, got {type(inputs).__name__}")
        for field in spec.input_fields + spec.optional_fields:
            value = inputs.get(field)
            if value is None and field in spec.optional_fields:
                continue
            if not isinstance(value, str):
                raise InputError(f"{spec.name}: input {field!r} must be text, got {type(value).__name__}")
            if len(value) > MAX_INPUT_CHARS:
                raise InputError(f"{spec.name}: input {field!r} has {len(value):,} characters; "
                                 f"the limit is {MAX_INPUT_CHARS:,}")
        return self.check_options(options)

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Raise InputError on an option the task does not declare; return them merged with its defaults."""
        spec = self.task.spec
        unknown = sorted(set(options) - set(spec.options))
        if unknown:
            raise InputError(f"{spec.name}: unknown option(s) {', '.join(unknown)}; known: {', '.join(spec.options) or 'none'}")
        return {**spec.options, **options}

    def get(self) -> Predictor:
        """Itself: the same call as LazyPredictor.get, so callers need not know which they hold."""
        return self

    def run(self, batch: Batch, options: Mapping[str, Any]) -> Any:
        """Model and postprocess over a preprocessed batch, under this model's lock and inference mode."""
        with self._lock, torch.inference_mode():
            output = self._forward(batch.to(self.device))
            # Postprocessing may use the model too (logits at chosen positions, beam search).
            return self.task.spec.postprocess(output, batch.to("cpu"), **options)

    def forward_rows(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """The model's output for already-tokenised rows, for a task that batches inputs its own way
        (e.g. qa.predict_many); chunked like every forward, under this model's lock."""
        with self._lock, torch.inference_mode():
            return self._forward_inputs({k: v.to(self.device) for k, v in inputs.items()})

    def predict(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        """Preprocess -> model -> postprocess for one input.

        Raises:
            InputError: bad input or options (the message names the value).
        """
        spec = self.task.spec
        options = self.check_inputs(inputs, options)
        start = time.perf_counter()
        batch = spec.preprocess(inputs, self.tokenizer, **options)
        result = self.run(batch, options)
        latency_ms = (time.perf_counter() - start) * 1000
        self._remember(batch)
        return {"task": spec.name, "result": result, "provenance": self.provenance(latency_ms)}

    def remember(self, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        """Make `inputs` the last input (for the attention view) without predicting: tokenising only."""
        self._remember(self.task.spec.preprocess(inputs, self.tokenizer, **options))

    def _remember(self, batch: Batch) -> None:
        first = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
        self.last = LastInput(self.tokenizer.convert_ids_to_tokens(first), batch)

    def _forward(self, batch: Batch):
        return self._forward_inputs(batch.model_inputs())

    def _forward_inputs(self, inputs: Mapping[str, Any]):
        return forward_in_chunks(self.model, inputs, self.max_rows)

    def provenance(self, latency_ms: float | None = None) -> dict[str, Any]:
        dtype = self.precision or str(next(self.model.parameters()).dtype).removeprefix("torch.")
        info = {"plugin": self.task.plugin, "plugin_version": self.task.plugin_version, "task": self.task.spec.name,
                "model": self.model_id, "revision": self.revision, "device": str(self.device), "dtype": dtype,
                "untrained_head": self.untrained_head}
        if latency_ms is not None:
            info["latency_ms"] = round(latency_ms, 2)
        return info

    def attention(self) -> tuple[list[str], list[torch.Tensor]]:
        """Tokens of the last input's first row and every layer's (N, T, T) attention over them."""
        if self.last is None:
            raise InputError("no input yet: run a prediction in any tab first")
        batch = self.last.batch
        n = len(self.last.tokens)
        encoder = getattr(self.model, "encoder", self.model)
        with self._lock, torch.inference_mode():
            out = encoder(batch.input_ids[:1, :n].to(self.device), None,
                          batch.token_type_ids[:1, :n].to(self.device), output_attentions=True)
        return self.last.tokens, [a[0].float().cpu() for a in out.attentions]


class PredictionTimeout(RuntimeError):
    """A prediction did not finish in time (a hung plugin, an overloaded machine)."""


def call_with_timeout(function, timeout_s: float | None, *args: Any, what: str = "the prediction", **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, or PredictionTimeout after `timeout_s` seconds (None: no limit).

    Python cannot stop a thread: a call that hangs keeps its (daemon) thread, and with it any lock
    it holds, but the caller gets its answer on time and the process stays up.
    """
    if timeout_s is None:
        return function(*args, **kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = function(*args, **kwargs)
        except BaseException as err:  # handed to the caller below
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=target, name="bert-engine-request", daemon=True).start()
    if not done.wait(timeout_s):
        raise PredictionTimeout(f"{what} did not finish within {timeout_s:g} s and was cut off")
    if "error" in box:
        raise box["error"]
    return box["value"]


def forward_in_chunks(model: nn.Module, inputs: Mapping[str, Any], max_rows: int = 32) -> Any:
    """`model(**inputs)` over at most `max_rows` rows at a time, so many windows cannot exhaust
    memory; tensor inputs are sliced along the batch, other keywords passed whole, outputs concatenated."""
    rows = inputs["input_ids"].shape[0]
    if rows <= max_rows:
        return model(**inputs)
    parts = [model(**{k: v[i:i + max_rows] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
             for i in range(0, rows, max_rows)]
    return _concat(parts)


def predict_in_batches(predictor: Predictor | LazyPredictor, items: list[Mapping[str, Any]], *, batch_size: int = 32,
                       progress: bool = False, **options: Any) -> list[Any]:
    """Results for many inputs, in order, through length-sorted, dynamically padded batches.

    For tasks whose `preprocess` accepts a list of texts in each input field and whose `postprocess`
    returns one result per input (a single result for a batch of one). Inputs are checked up front;
    an empty or non-text input raises InputError naming its position.
    """
    from tqdm.auto import tqdm

    predictor = predictor.get()  # a LazyPredictor loads here
    spec = predictor.task.spec
    fields = spec.input_fields + spec.optional_fields
    bad = [i for i, item in enumerate(items)
           if not isinstance(item, Mapping) or any(not isinstance(item.get(f), str) or not item[f].strip()
                                                   for f in spec.input_fields)]
    if bad:
        raise InputError(f"{spec.name}: inputs at positions {bad[:10]} are empty or not text")
    for item in items:
        predictor.check_inputs(item, {})
    options = predictor.check_options(options)
    lengths = _token_lengths(predictor.tokenizer, items, fields)
    order = sorted(range(len(items)), key=lengths.__getitem__)
    results: list[Any] = [None] * len(items)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc=spec.name, unit="batch"):
        chunk = order[start:start + batch_size]
        inputs = {f: [items[i].get(f) for i in chunk] for f in fields
                  if any(items[i].get(f) is not None for i in chunk)}
        batch = spec.preprocess(inputs, predictor.tokenizer, **options)
        chunk_results = predictor.run(batch, options)
        for i, result in zip(chunk, chunk_results if len(chunk) > 1 else [chunk_results]):
            results[i] = result
    return results


def _token_lengths(tokenizer: Tokenizer, items: list[Mapping[str, Any]], fields: tuple[str, ...]) -> list[int]:
    """Word pieces per input over all its fields, to sort by: character counts misjudge numbers,
    tables and non-Latin scripts (on CoNLL, batches sorted by characters were 41 % padding)."""
    total = [0] * len(items)
    for field in fields:
        present = [i for i, item in enumerate(items) if item.get(field)]
        for i, encoding in zip(present, tokenizer.pieces([items[i][field] for i in present])):
            total[i] += len(encoding.ids)
    return total


def predict_texts(predictor: Predictor | LazyPredictor, texts: list[str], *, batch_size: int = 32,
                  progress: bool = False, **options: Any) -> list[Any]:
    """`predict_many` for one-field tasks: each text fills the task's input field (see predict_in_batches)."""
    field = predictor.task.spec.input_fields[0]
    return predict_in_batches(predictor, [{field: text} for text in texts], batch_size=batch_size,
                              progress=progress, **options)


def _concat(parts: list[Any]) -> Any:
    """Concatenate chunked outputs along the batch: tensors, or the tensor fields of a dataclass
    (other fields, such as a head reference, are taken from the first chunk)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if dataclasses.is_dataclass(first):
        values = {}
        for f in dataclasses.fields(first):
            value = getattr(first, f.name)
            if isinstance(value, torch.Tensor):
                value = torch.cat([getattr(p, f.name) for p in parts])
            elif isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):  # per-layer tensors
                value = tuple(torch.cat(layer) for layer in zip(*(getattr(p, f.name) for p in parts)))
            elif dataclasses.is_dataclass(value):  # the encoder's own output inside a head's
                value = _concat([getattr(p, f.name) for p in parts])
            values[f.name] = value
        return dataclasses.replace(first, **values)
    raise TypeError(f"cannot concatenate chunked model outputs of type {type(first).__name__}")


class LazyPredictor:
    """A Predictor that loads its model on first use (thread-safe), so an app starts without loading any.

    Has Predictor's interface (`predict`, `attention`, `provenance`, `last`); `loaded` says whether
    the model is in memory. A load failure (HubError, CheckpointError) propagates to the caller to
    show, and the load is tried again on the next call.
    """

    def __init__(self, task: RegisteredTask, checkpoint: str | None = None, **load_kwargs: Any) -> None:
        self.task = task
        self.checkpoint = checkpoint
        self.load_kwargs = load_kwargs
        self._predictor: Predictor | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._predictor is not None

    def switch(self, checkpoint: str | None) -> Predictor:
        """Load another checkpoint (None: the task's default); on failure the current model stays."""
        with self._lock:
            predictor = Predictor.load(self.task, checkpoint or None, **self.load_kwargs)
            self.checkpoint, self._predictor = checkpoint or None, predictor
        return predictor

    def get(self) -> Predictor:
        if self._predictor is None:
            with self._lock:
                if self._predictor is None:
                    logger.info("loading the model of task %s", self.task.spec.name)
                    self._predictor = Predictor.load(self.task, self.checkpoint, **self.load_kwargs)
        return self._predictor

    def predict(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        return self.get().predict(inputs, **options)

    def attention(self) -> tuple[list[str], list[torch.Tensor]]:
        if self._predictor is None:
            raise InputError(f"no input yet in the {self.task.spec.title} tab: run a prediction there first")
        return self._predictor.attention()

    @property
    def last(self) -> LastInput | None:
        return self._predictor.last if self._predictor is not None else None

    def provenance(self) -> dict[str, Any]:
        return self.get().provenance()


class BatchingPredictor(LazyPredictor):
    """A LazyPredictor that merges concurrent requests into one batched forward pass.

    For one-field tasks with a batched path (`predict_many`): a request waits up to `max_wait_ms`
    for others with the same options, then the first of them runs the whole group through
    `predict_in_batches`. A bad input never fails its neighbours: inputs are checked one by one
    first, and if the group still raises InputError each request is run alone for its own answer.
    Results carry `provenance.batch_size` (how many requests shared the pass).
    """

    def __init__(self, task: RegisteredTask, checkpoint: str | None = None, *, max_batch: int = 16,
                 max_wait_ms: float = 10.0, **load_kwargs: Any) -> None:
        super().__init__(task, checkpoint, **load_kwargs)
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._cond = threading.Condition()

    @property
    def batchable(self) -> bool:
        spec = self.task.spec
        return spec.predict_many is not None and len(spec.input_fields) == 1

    def predict(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        predictor = self.get()
        merged = predictor.check_inputs(inputs, options)
        field = self.task.spec.input_fields[0]
        extra = any(inputs.get(f) is not None for f in self.task.spec.optional_fields)
        if not self.batchable or extra or not str(inputs.get(field, "")).strip():
            output = predictor.predict(inputs, **options)  # nothing to share (or the task's own error)
            output["provenance"]["batch_size"] = 1
            return output
        import json

        key = json.dumps(merged, sort_keys=True, default=str)
        request = {"inputs": dict(inputs), "done": False, "output": None, "error": None}
        with self._cond:
            group = self._pending.setdefault(key, [])
            group.append(request)
            leader = len(group) == 1
            if len(group) >= self.max_batch:
                self._cond.notify_all()
        if leader:
            with self._cond:
                self._cond.wait_for(lambda: len(self._pending.get(key, ())) >= self.max_batch, timeout=self.max_wait)
                group = self._pending.pop(key)
            self._run_group(predictor, group, options)
            with self._cond:
                self._cond.notify_all()
        with self._cond:
            self._cond.wait_for(lambda: request["done"])
        if request["error"] is not None:
            raise request["error"]
        return request["output"]

    def _run_group(self, predictor: Predictor, group: list[dict[str, Any]], options: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            if len(group) == 1:
                self._run_alone(predictor, group, options)
                return
            results = predict_in_batches(predictor, [r["inputs"] for r in group], batch_size=len(group), **options)
            latency_ms = (time.perf_counter() - start) * 1000
            predictor.remember(group[-1]["inputs"], predictor.check_options(options))  # the attention view's input
            for request, result in zip(group, results):
                provenance = {**predictor.provenance(latency_ms), "batch_size": len(group)}
                request["output"] = {"task": self.task.spec.name, "result": result, "provenance": provenance}
        except InputError:
            self._run_alone(predictor, group, options)  # one bad input: everyone gets their own answer
        except Exception as err:
            for request in group:
                request["error"] = err
        finally:
            for request in group:
                request["done"] = True

    @staticmethod
    def _run_alone(predictor: Predictor, group: list[dict[str, Any]], options: dict[str, Any]) -> None:
        for request in group:
            try:
                output = predictor.predict(request["inputs"], **options)
                output["provenance"]["batch_size"] = 1
                request["output"] = output
            except Exception as err:  # handed to that request's own caller
                request["error"] = err
