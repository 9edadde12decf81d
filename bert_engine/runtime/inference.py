"""Predictor: one task's model and tokenizer on a device, run in inference mode, results with provenance.

Places the model on a device in a precision (both chosen by precision.py), checks the inputs
against the task's declared fields and options, and batches many inputs of one call by length.
Serving many callers (lazy loading, merging concurrent requests, time limits) is serving/predictors.py's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import settings
from ..checkpoints.hub import default_backbone
from ..checkpoints.loader import load, run_checkpoint
from ..checkpoints.loading import CheckpointError, Loaded, metadata_file
from ..hookspecs import InputError, PluginError, TaskContext, TaskSpec
from ..model import BETWEEN_LAYERS, encoder_of
from ..progress import progress_bar
from ..tokenizer import Batch, Tokenizer
from . import fast
from .cancel import ModelLock
from .cpu_load import FREE_CPUS
from .fairness import ComputeGate, chunk_flops
from .precision import device_for, parameter_dtype, prepare_for_inference

if TYPE_CHECKING:  # annotations only: the registry sits above the runtime
    from ..tasks.registry import RegisteredTask

logger = logging.getLogger(__name__)

MAX_INPUT_CHARS = 1_000_000  # per field; longer input is refused before tokenising
# Per input, after tokenising: every window row's real tokens together. Bounds the forward work one
# request can cause (65,536 tokens: ~128 windows of 512, about 6 s of MiniLM on 2 CPU cores).


def max_request_tokens() -> int:
    """Tokens one input may need over all its windows: BERT_ENGINE_MAX_TOKENS, read now."""
    return settings.get("BERT_ENGINE_MAX_TOKENS")


def __getattr__(name: str) -> Any:  # MAX_REQUEST_TOKENS, as plugins written against 0.x read it: the setting now
    if name == "MAX_REQUEST_TOKENS":
        return max_request_tokens()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def max_request_flops() -> float:
    """The work one input may cause through the model, in FLOPs: BERT_ENGINE_MAX_GFLOP, read now."""
    return settings.get("BERT_ENGINE_MAX_GFLOP") * 1e9


def _gflop(flops: float) -> str:
    return f"{flops / 1e9:,.0f} GFLOP" if flops >= 10e9 else f"{flops / 1e9:.2g} GFLOP"


def check_request_cost(task: str, batch: Batch, limit: int | None = None, model: nn.Module | None = None,
                       max_flops: float | None = None, remedy: str = "Shorten the text") -> float:
    """InputError when one input of `batch` needs more than `limit` tokens over all its window rows, or, given
    the `model` (its encoder), more than `max_flops` of work (default max_request_flops()) through it: each
    row's forward pass at its real tokens (row_flops); the error ends with `remedy` (what the task lets a caller
    do). Returns the batch's work in FLOPs (0 without a model)."""
    limit = max_request_tokens() if limit is None else limit
    real = batch.attention_mask.sum(dim=1).tolist()
    per_input: dict[int, list[int]] = {}
    for tokens, index in zip(real, batch.sample_index):  # a task may keep fewer rows than it windowed
        per_input.setdefault(index, []).append(tokens)
    max_flops = max_request_flops() if max_flops is None and model is not None else max_flops
    total = 0.0
    for index, rows in per_input.items():
        tokens = sum(rows)
        which = "the input" if len(per_input) == 1 else f"inputs[{index}]"
        overlap = " (windows overlap, so a long text reaches it sooner than its length says)" if len(rows) > 1 else ""
        detail = None
        if tokens > limit:
            detail = (f"needs {len(rows):,} window(s) with {tokens:,} tokens in all; the limit per request is "
                      f"{limit:,} tokens over all windows{overlap}. {remedy}")
        elif model is not None:
            work = sum(row_flops(model, n) for n in rows)
            total += work
            if work > max_flops:
                detail = (f"needs {len(rows):,} window(s) with {tokens:,} tokens in all, {_gflop(work)} of work through "
                          f"this model ({_gflop(work / max(tokens, 1))} a token); the limit per request is {_gflop(max_flops)} (BERT_ENGINE_MAX_GFLOP){overlap}. "
                          f"{remedy}, or pick a smaller model")
        if detail is not None:
            err = InputError(f"{task}: {which} {detail}")
            err.input_index, err.input_detail = index, detail  # (predict_in_batches names its place in the list)
            raise err
    return total


@dataclass
class RequestWork:
    """The work a request may still cause after its forward pass: the passes its task's postprocess adds
    (TaskContext.encode), each charged before it runs and refused where it would pass `limit` (FLOPs)."""

    task: str
    limit: float
    used: float = 0.0

    def check(self, flops: float, what: str = "the task's further passes") -> None:
        """InputError when `flops` more would pass the limit, or alone pass one input's (a batch of inputs shares
        its inputs' limits; no one input's search may take the others' share); nothing charged."""
        alone = flops > max_request_flops()
        if alone or self.used + flops > self.limit:
            total = flops if alone else self.used + flops
            whose = "this input's" if alone or self.limit <= max_request_flops() else "this request's"
            raise InputError(f"{self.task}: {what} would bring {whose} work to {_gflop(total)}; the limit per "
                             f"input is {_gflop(max_request_flops())} (BERT_ENGINE_MAX_GFLOP). Ask the task for less "
                             "(its options), or use a shorter text")

    def charge(self, flops: float, what: str = "the task's further passes") -> None:
        self.check(flops, what)
        self.used += flops


REQUEST_WORK: ContextVar[RequestWork | None] = ContextVar("bert_engine_request_work", default=None)


class ResultNotJSON(PluginError):
    """A task answered a value JSON cannot hold (NaN or infinity, a set, an array, an object): the CLI and
    the playground's API answer JSON, so they refuse it as the task's fault (stage "postprocess")."""


def json_problem(err: BaseException) -> str:
    """What json.dumps(..., allow_nan=False) refused, in words ("holds NaN or infinity", ...)."""
    text = " ".join(str(err).split())[:200]
    if isinstance(err, RecursionError) or "Circular reference" in text:
        return "refers to itself (a dict or list inside itself)"
    if isinstance(err, ValueError):
        return "holds NaN or infinity"
    return f"is not JSON data ({text})"


def _key_problem(value: Any, depth: int = 0) -> str | None:
    """A dict key JSON would turn into a string (1 -> "1": two keys may become one), anywhere in `value`."""
    if depth > 200:
        return None  # json.dumps refused it already
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"has a key that is not text ({key!r}), which JSON turns into text"
            found = _key_problem(item, depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _key_problem(item, depth + 1)
            if found:
                return found
    return None


def check_json_result(task: str, result: Any) -> Any:
    """`result` if JSON holds it as it is (dicts with text keys, lists, strings, finite numbers, None);
    else ResultNotJSON naming what is wrong."""
    try:
        json.dumps(result, allow_nan=False)
        problem = _key_problem(result)
    except (TypeError, ValueError, RecursionError) as caught:
        problem = json_problem(caught)
        if problem == "holds NaN or infinity":
            problem += " (from the task's postprocess, or a model that overflowed at this precision)"
    if problem is None:
        return result
    err = ResultNotJSON(f"{task}: the result {problem}")
    err.request_stage = "postprocess"
    raise err


def _staged_head(build_head):
    """The task's head factory, with its failures marked as the task's (stage "build_head"), so a caller
    can tell a plugin's broken head from a bad checkpoint or a bad input."""
    def build(config):
        with request_stage("build_head"):
            return build_head(config)

    return build


@contextmanager
def request_stage(stage: str):
    """Note on any exception leaving the block which stage of a request raised it (`err.request_stage`:
    preprocess, forward or postprocess), for the failure record; the innermost stage wins."""
    try:
        yield
    except BaseException as err:
        if getattr(err, "request_stage", None) is None:
            with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
                err.request_stage = stage
        raise


@dataclass
class LastInput:
    """One input's first row, kept on the CPU for the attention view (the serving layer keeps one per
    visitor: serving.predictors)."""

    tokens: list[str]
    batch: Batch

    @classmethod
    def of(cls, batch: Batch, row: int, tokenizer) -> LastInput:
        """Row `row` of `batch`, without its padding, copied to the CPU."""
        n = int(batch.attention_mask[row].sum())
        rows = slice(row, row + 1)
        keep = Batch(batch.input_ids[rows, :n].cpu().clone(), batch.attention_mask[rows, :n].cpu().clone(),
                     batch.token_type_ids[rows, :n].cpu().clone(), batch.offsets[rows], batch.sequence_ids[rows],
                     batch.word_ids[rows], [0], batch.truncated[:1])  # one row, not the windows
        return cls(tokenizer.convert_ids_to_tokens(batch.input_ids[row, :n].tolist()), keep)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(task: str, field: str, value: str) -> None:
    """Refuse text holding a lone surrogate (JSON can carry "\\ud800"; no UTF-8 text can): it would
    reach the output, and no response holding it can be encoded."""
    found = _LONE_SURROGATE.search(value)
    if found:
        raise InputError(f"{task}: input {field!r} holds a lone surrogate {found.group()!r} at character "
                         f"{found.start():,}; text must be valid Unicode")


# Letters and symbols drawn as nothing (Hangul fillers, the blank Braille pattern, Khmer's inherent vowels): no
# more text than a zero-width space, and answered as one unknown token before (session 57's audit)
_BLANK_LOOKING = "\u115f\u1160\u17b4\u17b5\u2800\u3164\uffa0"
_WORD = re.compile(f"[^\\W{_BLANK_LOOKING}]")  # a word character that is not one of those
_READABLE = frozenset("LNPS")  # letters, numbers, punctuation, symbols: what a tokenizer reads as text (marks
# alone, combining accents and variation selectors, an uncased tokenizer strips: nothing is left)


def readable(value: str) -> bool:
    """Whether `value` holds a character a tokenizer reads as text (a letter, number, punctuation or symbol),
    not only control, format (zero-width), separator or lone combining characters, which every model reads as
    nothing and answered anyway (a zero-width space classified POSITIVE at 0.72)."""
    if _WORD.search(value):  # (most text: found at its first letter)
        return True
    return any(unicodedata.category(c)[0] in _READABLE and c not in _BLANK_LOOKING for c in value)


TASK_OPTIONS_FILE = "task_options.json"  # a training checkpoint's task options ({"options": ...}; jobs.TaskJob.save)


def _options_in(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        return {}
    try:
        options = json.loads(metadata_file(folder, name).read_text(encoding="utf-8")).get("options") or {}
    except CheckpointError as err:
        logger.warning("%s; its options are ignored", err)
        return {}
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    if not isinstance(options, dict):
        logger.warning("%s: \"options\" is not a mapping; ignored", path)
        return {}
    return options


def model_options(folder: Path, spec) -> dict[str, Any]:
    """The option defaults a model is served with, that the task knows: the task options it was
    trained with (`folder`/task_options.json, which training writes beside each checkpoint, e.g.
    NER's casing), under those of a packed model's manifest.json ("options": {name: value}). A
    missing or unreadable file gives none; an unknown option is logged and left out.

    Raises:
        CheckpointError: a value the task refuses (its check_options), naming the file it came from: every
            request would otherwise fail naming an option its caller never gave."""
    options: dict[str, Any] = {}
    for name in (TASK_OPTIONS_FILE, "manifest.json"):
        found = _options_in(Path(folder), name)
        unknown = sorted(set(found) - set(spec.options))
        if unknown:
            logger.warning("%s: option(s) %s are not options of task %r; ignored", Path(folder) / name, unknown,
                           spec.name)
        found = {k: v for k, v in found.items() if k in spec.options}
        if found and spec.check_options is not None:
            try:
                spec.check_options(MappingProxyType({**copy.deepcopy(dict(spec.options)), **found}))
            except InputError as err:
                raise CheckpointError(f"{Path(folder) / name}: its \"options\" hold a value task {spec.name!r} refuses "
                                      f"({err}); correct or remove it") from None
        options.update(found)
    return options


class Predictor:
    """Runs one registered task. `predict` returns {"task", "result", "provenance"}."""

    def __init__(self, task: RegisteredTask, model: nn.Module, tokenizer: Tokenizer, *,
                 model_id: str, revision: str | None = None, untrained_head: bool = False,
                 loaded: Loaded | None = None, model_options: Mapping[str, Any] | None = None) -> None:
        """`model_options`: option defaults this model was calibrated with (a packed model's manifest
        "options", e.g. QA's null_threshold; `load` reads them from the folder). A model built by hand
        from a loaded one (quantised, pruned) passes them on, or it answers with the task's defaults."""
        unknown = sorted(set(model_options or {}) - set(task.spec.options))
        if unknown:
            raise ValueError(f"{task.spec.name}: model_options {unknown} are not options of this task "
                             f"(it has {sorted(task.spec.options)})")
        self.task = task
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.untrained_head = untrained_head
        self.loaded = loaded  # where the model came from (checkpoint, load report, adapter), when loaded
        self.precision: str | None = None  # "int8" etc. when chosen; else the parameters' dtype says it
        self.device = next(model.parameters()).device
        self.max_rows = 32  # rows (windows) per forward pass
        # The fairness gate every forward chunk waits at (fairness.GATE in a server: the serving layer
        # sets it); None: forwards run as they come (a script, the CLI).
        self.gate: ComputeGate | None = None
        # Option defaults the model folder was calibrated with (its manifest's "options", e.g. QA's
        # null_threshold): over the task's defaults, under the caller's own options.
        self.model_options: dict[str, Any] = dict(model_options or {})
        # (checkpoint, device, load keywords) when loaded by `load`: explain.py loads an fp32 copy with
        # plain kernels from it when this model's kernels have no backward (packed, int8, compiled)
        self.source: tuple[str, torch.device, dict[str, Any]] | None = None
        self._lock = ModelLock()  # one forward pass at a time per model; callers queue, a cut-off one lets go

    @classmethod
    def load(cls, task: RegisteredTask, checkpoint: str | None = None, *, device: str | None = None,
             precision: str = "auto", pack: bool = True, compile: bool = False, **load_kwargs) -> Predictor:
        """Load the task's model: `checkpoint`, else the task's default, else the default backbone.

        Args:
            precision: "auto" (fp32 on CPU, bf16/fp16 on GPU), "fp32", "bf16", "fp16" or "int8"
                (dynamic quantisation of the encoder's linear layers, CPU only); see precision.py.
            pack: on the CPU, run the encoder's linear layers through pre-packed oneDNN matmuls.
            compile: torch.compile the encoder layers (slow first calls, faster steady state); on
                the CPU instead of the packed linears (Inductor cannot lower them); with int8, each
                projection's input quantiser (one fused pass; the int8 matmuls stay oneDNN's).
        """
        if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
            raise TypeError(f"the model must be a folder or a Hub id (text), got {type(checkpoint).__name__}")
        if checkpoint is not None and not str(checkpoint).strip():  # not "the default" in disguise
            raise ValueError("the model is empty: give a checkpoint folder or a Hub id, or leave it out for the "
                             "task's default")
        for name in ("BERT_ENGINE_SHARE_CPUS", "BERT_ENGINE_MAX_TOKENS", "BERT_ENGINE_MAX_GFLOP"):
            settings.get(name)  # read at each request: a bad value fails here, at load, named, not as a plugin's bug
        name = run_checkpoint(checkpoint or task.spec.default_checkpoint or default_backbone())  # a run: its best/
        target = device_for(precision, device)
        # parameter_dtype checks the precision against the device and CPU before anything loads
        loaded = load(name, _staged_head(task.spec.build_head), device=target,
                      dtype=parameter_dtype(precision, target), **load_kwargs)
        model = prepare_for_inference(loaded.model, precision, pack=pack, compile=compile)
        predictor = cls(task, model, loaded.tokenizer, model_id=str(name), loaded=loaded,
                        revision=loaded.checkpoint.commit or loaded.checkpoint.revision, untrained_head=loaded.untrained,
                        model_options=model_options(loaded.checkpoint.folder, task.spec))
        predictor.precision = "int8" if precision == "int8" else None
        # how to load the same weights again with plain kernels (an explanation needs gradients: explain.py)
        predictor.source = (name, target, dict(load_kwargs))
        return predictor

    def check_inputs(self, inputs: Any, options: Mapping[str, Any]) -> dict[str, Any]:
        """Raise InputError naming the problem; return the options merged with the task's defaults."""
        self.check_fields(inputs)
        return self.check_options(options)

    def check_fields(self, inputs: Any) -> None:
        """Raise InputError on inputs that are not a mapping of the task's fields to text within the limits
        (`check_inputs` without the options: for callers that checked those once for many inputs)."""
        spec = self.task.spec
        if not isinstance(inputs, Mapping):
            raise InputError(f"{spec.name}: inputs must be a mapping with {spec.input_fields}, got {type(inputs).__name__}")
        for field in spec.input_fields + spec.optional_fields:
            value = inputs.get(field)
            if value is None and field in spec.optional_fields:
                continue
            if value is None:
                raise InputError(f"{spec.name}: input {field!r} is missing; the task reads "
                                 f"{', '.join(spec.input_fields + spec.optional_fields)}")
            if not isinstance(value, str):
                raise InputError(f"{spec.name}: input {field!r} must be text, got {type(value).__name__}")
            if len(value) > MAX_INPUT_CHARS:
                raise InputError(f"{spec.name}: input {field!r} has {len(value):,} characters; "
                                 f"the limit is {MAX_INPUT_CHARS:,}")
            check_unicode(spec.name, field, value)
            if value.strip() and not readable(value):  # (only whitespace: the task's own "empty" message)
                raise InputError(f"{spec.name}: input {field!r} has no readable text, only control or invisible "
                                 f"characters ({', '.join(f'U+{ord(c):04X}' for c in dict.fromkeys(value.strip()[:200]))[:120]})"
                                 "; type some words")

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Raise InputError on an option the task does not declare, or on a value the task's check_options
        refuses; return them merged with its defaults and the model's (`check_task_options`)."""
        return check_task_options(self.task.spec, options, self.model_options)

    def get(self) -> Predictor:
        """Itself: the same call as LazyPredictor.get, so callers need not know which they hold."""
        return self

    def run(self, batch: Batch, options: Mapping[str, Any]) -> Any:
        """Model and postprocess over a preprocessed batch, under this model's lock and inference mode.

        Raises:
            InputError: an input needs more than max_request_tokens() tokens (checked before any forward).
        """
        name = self.task.spec.name
        work = self.check_cost(batch)
        # The passes a postprocess adds are charged against the same bound: each input's, for the batch's inputs
        inputs = len(set(batch.sample_index)) or 1
        token = REQUEST_WORK.set(RequestWork(name, max_request_flops() * inputs, work))
        try:
            with torch.inference_mode():
                with request_stage("forward"):
                    output = self._forward(batch.to(self.device))
                with request_stage("postprocess"):
                    # Postprocessing may re-run the encoder (beam search, a summary's second pass): context.encode
                    # takes turns at the gate and the model's lock per chunk, like every forward.
                    if self.task.takes_context:
                        options = {**options, "context": self.context()}
                    return self.task.spec.postprocess(output, batch.to("cpu"), **options)
        finally:
            REQUEST_WORK.reset(token)

    def check_cost(self, batch: Batch) -> float:
        """InputError when an input of `batch` needs more tokens (BERT_ENGINE_MAX_TOKENS) or more work through
        this model (BERT_ENGINE_MAX_GFLOP) than one request may: for a task that runs its inputs' rows its own
        way (qa.predict_many). Returns the batch's work in FLOPs."""
        return check_request_cost(self.task.spec.name, batch, model=encoder_of(self.model), remedy=self.cost_remedy())

    def cost_remedy(self) -> str:
        """What a caller of this task can do about an input over the request limits, from its options."""
        options = self.task.spec.options
        if "long_input" in options:  # (past the limits, the text was read in windows: its start alone is cheaper)
            return "Shorten the text, or read its start alone (long_input='truncate')"
        if len(self.task.spec.input_fields) > 1:  # (QA: a question and its context)
            return f"Shorten the {self.task.spec.input_fields[-1]} to the part that matters"
        return "Shorten the text"

    def context(self) -> TaskContext:
        """What a postprocess (or explain) that asks for `context` gets: the tokenizer, the encoder, the
        head's label names in id order, and the check of further passes against the request's work limit."""
        labels = getattr(getattr(self.model, "head", None), "labels", None)
        return TaskContext(self.tokenizer, self._encode, tuple(labels) if labels else None, self._check_work)

    def _check_work(self, rows: int, length: int, what: str = "the task's further passes") -> None:
        work = REQUEST_WORK.get()
        if work is not None:
            work.check(rows * row_flops(encoder_of(self.model), length), what)

    def forward_rows(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """The model's output for already-tokenised rows, for a task that batches inputs its own way
        (e.g. qa.predict_many); chunked and scheduled like every forward."""
        with torch.inference_mode():
            return self._forward_inputs({k: v.to(self.device) for k, v in inputs.items()})

    def predict(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        """Preprocess -> model -> postprocess for one input.

        Raises:
            InputError: bad input or options (the message names the value).
        """
        return self.predict_checked(inputs, self.check_inputs(inputs, options))

    def predict_checked(self, inputs: Mapping[str, Any], options: Mapping[str, Any], *,
                        on_batch: Callable[[Batch, int], None] | None = None) -> dict[str, Any]:
        """`predict` for inputs the caller has checked, with `options` merged with the task's defaults
        (check_inputs's answer): each request is validated once. `on_batch(batch, 0)` is handed the
        tokenised input after the prediction (the serving layer keeps it for the attention view)."""
        spec = self.task.spec
        start = time.perf_counter()
        with request_stage("preprocess"):
            batch = spec.preprocess(dict(inputs), self.tokenizer, **options)  # a copy: the caller's stays as it was
            if not isinstance(batch, Batch):
                raise PluginError(f"{spec.name}: preprocess returned {type(batch).__name__}, not the Batch the "
                                  "tokenizer gives (return tokenizer(...))")
        result = self.run(batch, options)
        latency_ms = (time.perf_counter() - start) * 1000
        if on_batch is not None:
            on_batch(batch, 0)
        return {"task": spec.name, "result": result, "provenance": self.provenance(latency_ms)}

    def _encode(self, inputs: Mapping[str, Any]):
        """The encoder alone over model inputs (TaskContext.encode), in chunks that wait their turn at the
        fairness gate and hold the model's lock, like every forward: a postprocess's extra passes (fill-mask
        targets, a summary's sentences) are charged to the visitor who asked."""
        encoder = encoder_of(self.model)
        moved = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        work = REQUEST_WORK.get()
        if work is not None and moved["input_ids"].dim() == 2:  # refused before it runs where it passes the bound
            rows, length = moved["input_ids"].shape
            work.charge(rows * row_flops(encoder, length))
        return forward_in_chunks(encoder, moved, self.max_rows, lock=self._lock, gate=self.gate)

    def _forward(self, batch: Batch):
        return self._forward_inputs(batch.model_inputs())

    def _forward_inputs(self, inputs: Mapping[str, Any]):
        return forward_in_chunks(self.model, inputs, self.max_rows, lock=self._lock, gate=self.gate)

    def provenance(self, latency_ms: float | None = None) -> dict[str, Any]:
        """Which plugin, model, device, precision and kernels answered (and the request's latency): worked out
        once per state of those, as a request's cost is mostly its cold Python (0.17 ms worked out each time)."""
        model = self.model
        kept = self.__dict__.get("_provenance")
        # the model's first parameter, whose dtype follows a cast after loading (found again for another model)
        first = kept[0][1] if kept is not None and kept[0][0] is model else next(model.parameters(), None)
        key = (model, first, self.precision, None if first is None else first.dtype, self.model_id, self.revision,
               self.device, self.untrained_head, getattr(model, "kernel_choice", None),
               getattr(model, "int8_kernel", None), getattr(model, "compiled", False))
        if kept is None or kept[0] != key:
            kept = self._provenance = (key, self._provenance_now())
        info = {name: dict(value) if isinstance(value, dict) else value for name, value in kept[1].items()}
        if latency_ms is not None:
            info["latency_ms"] = round(latency_ms, 2)
        return info

    def _provenance_now(self) -> dict[str, Any]:
        dtype = self.precision or str(next(self.model.parameters()).dtype).removeprefix("torch.")
        info = {"plugin": self.task.plugin, "plugin_version": self.task.plugin_version, "task": self.task.spec.name,
                "model": self.model_id, "revision": self.revision, "device": str(self.device), "dtype": dtype,
                "family": getattr(encoder_of(self.model), "config", None).model_type,
                "untrained_head": self.untrained_head}
        kernels = getattr(self.model, "kernel_choice", None)
        if kernels:  # which matmul kernel each projection uses on this machine (runtime.fast.choose_kernels)
            info["kernels"] = {name: fast.kernel_label(choice) for name, choice in kernels.items()}
            if next(self.model.parameters()).dtype == torch.float32 and not getattr(self.model, "int8_kernel", None):
                info["fused_layers"] = fast.fused_label(kernels)  # where each layer runs as one C call
        int8 = getattr(self.model, "int8_kernel", None)
        if int8:  # whose int8 matmuls the quantised projections run (runtime.fast.int8_kernel)
            info["int8_kernel"] = int8
            info["fused_layers"] = fast.int8_fused_label(self.model)
        compiled = getattr(self.model, "compiled", False)
        if compiled:  # True: torch.compile'd encoder layers; int8 says which part (load(compile=True), a compiler found)
            info["compiled"] = compiled
        return info

    def attention(self, last: LastInput) -> tuple[list[str], list[torch.Tensor]]:
        """The tokens of `last` (an input's first row) and every layer's (N, T, T) attention over them."""
        batch, n = last.batch, len(last.tokens)
        encoder = encoder_of(self.model)
        gate = self.gate.turn(row_flops(encoder, n)) if self.gate is not None else contextlib.nullcontext()
        with gate, self._lock, torch.inference_mode():
            out = encoder(batch.input_ids[:1, :n].to(self.device), None,
                          batch.token_type_ids[:1, :n].to(self.device), output_attentions=True)
        return last.tokens, [a[0].float().cpu() for a in out.attentions]


def check_task_options(spec: TaskSpec, options: Mapping[str, Any],
                       model_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`options` over the task's defaults (and a loaded model's, `model_options`), after raising InputError on
    an option the task does not declare or a value its check_options refuses. Without `model_options` it
    needs no model: `pipeline()` checks the caller's options this way before loading one."""
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise InputError(f"{spec.name}: unknown option(s) {', '.join(unknown)}; known: {', '.join(spec.options) or 'none'}")
    for name, value in options.items():
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(text, str):
                check_unicode(spec.name, name, text)
    # The defaults copied for this request: a task that changes a list or dict option in place (careless, or
    # hostile) must not carry one visitor's request into every later visitor's defaults.
    merged = {**copy.deepcopy({**spec.options, **(model_options or {})}), **options}
    if spec.check_options is not None:
        spec.check_options(MappingProxyType(merged))
    return merged


def row_flops(model: nn.Module, length: int) -> float:
    """The work of one padded row of `length` tokens through `model`'s encoder (BertConfig.forward_flops;
    a model without a BertConfig: 2 FLOPs per parameter and token)."""
    config = getattr(model, "config", None)
    if hasattr(config, "forward_flops"):
        return float(config.forward_flops(1, length))
    return 2.0 * length * sum(p.numel() for p in model.parameters())


def forward_in_chunks(model: nn.Module, inputs: Mapping[str, Any], max_rows: int = 32, *,
                      max_flops: float | None = None, lock: Any = None, gate: ComputeGate | None = None) -> Any:
    """`model(**inputs)` over chunks of at most `max_rows` rows and `max_flops` of work (at least one
    row; default BERT_ENGINE_CHUNK_GFLOP), so many windows cannot exhaust memory and no chunk holds the
    machine long, whatever the model's depth; each chunk waits for its turn at `gate` (fairness.py),
    is charged its FLOPs there, and holds `lock` (the model's) while it runs. Tensor inputs are sliced
    along the batch, other keywords passed whole, outputs concatenated."""
    rows, length = inputs["input_ids"].shape[:2]
    per_row = row_flops(model, length)
    parts, i = [], 0
    while i < rows:
        # sized at each chunk: a gate shared with other visitors hands out shorter chunks (fairness.py)
        budget = max_flops if max_flops is not None else gate.chunk_budget() if gate is not None else chunk_flops()
        step = max(1, min(max_rows, int(budget // max(per_row, 1.0))))
        chunk = {k: v[i:i + step] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        cost = per_row * chunk["input_ids"].shape[0]
        with gate.turn(cost) if gate is not None else contextlib.nullcontext() as turn, \
                lock if lock is not None else contextlib.nullcontext():
            # One row more work than a turn (a deep or wide model, a long row): hand the turn back between
            # layers, so nobody waits for the whole row.
            pausing = turn is not None and cost > budget
            token = BETWEEN_LAYERS.set(_between_layers(turn, lock, cost, model, budget)) if pausing else None
            try:
                with _threads(_chunk_threads(turn, chunk["input_ids"])):
                    parts.append(model(**chunk))
            finally:
                if token is not None:
                    BETWEEN_LAYERS.reset(token)
        i += step
    return parts[0] if len(parts) == 1 else _concat(parts)


def _chunk_threads(turn, input_ids: torch.Tensor) -> int | None:
    """A forward chunk's intra-op threads: its turn's at the gate (all, or half while lighter visitors wait), and
    on the CPU no more than other work leaves CPUs free (cpu_load.FREE_CPUS); None: as set."""
    wanted = turn.threads() if turn is not None else None
    if not input_ids.is_cpu:
        return wanted
    return FREE_CPUS.threads(wanted if wanted is not None else torch.get_num_threads())


_THREADS_LOCK = threading.Lock()
_THREADS_HELD = {"blocks": 0, "base": 0}  # _threads blocks running now (any thread), and the count before the first


@contextmanager
def _threads(count: int | None):
    """Run the block on `count` intra-op threads (None: as set). torch's count is its calling thread's (OpenMP's
    per-thread setting), and a thread started later takes the last count set anywhere: so each block puts its
    own thread back to the count before the first of the blocks running now (a thread started while another's
    block held a half share starts at that half share, and its own "before" would keep it there). Putting back
    only when the last block ended left an earlier one's thread at its half share (the playground then blamed
    that request's task for changing torch's thread count: a hostile-visitor audit, session 53)."""
    if count is None:
        yield
        return
    with _THREADS_LOCK:
        if _THREADS_HELD["blocks"] == 0:
            _THREADS_HELD["base"] = torch.get_num_threads()
        _THREADS_HELD["blocks"] += 1
        base = _THREADS_HELD["base"]
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _THREADS_HELD["blocks"] -= 1
        if torch.get_num_threads() != base:
            torch.set_num_threads(base)


def threads_held() -> bool:
    """Whether a forward chunk has set torch's thread count for its turn now (the serving layer does not then
    read a changed count as a task's doing)."""
    return _THREADS_HELD["blocks"] > 0


def _between_layers(turn, lock: Any, cost: float, model: nn.Module, budget: float) -> Callable[[int], None]:
    """The BETWEEN_LAYERS hook of one chunk: every few layers (about `budget` of work), charge them, let the
    model's lock and the gate's turn go (others run), and take both again, in the gate-then-lock order
    every forward uses."""
    config = getattr(encoder_of(model), "config", None)
    layers = max(1, int(getattr(config, "applied_layers", 1)))
    per_layer = cost / layers
    every = max(1, int(budget // max(per_layer, 1.0)))

    def between(applied: int) -> None:
        if applied % every:
            return
        if lock is not None:
            lock.__exit__(None, None, None)
        turn.hand_back(per_layer * every)
        if lock is not None:
            lock.__enter__()
    return between


def predict_in_batches(predictor, items: list[Mapping[str, Any]], *, batch_size: int = 32,
                       progress: bool = False, on_batch: Callable[[Batch, int, int], None] | None = None,
                       checked: bool = False, **options: Any) -> list[Any]:
    """Results for many inputs, in order, through length-sorted, dynamically padded batches.

    For tasks whose `preprocess` accepts a list of texts in each input field and whose `postprocess`
    returns one result per input (a single result for a batch of one). Inputs are checked up front;
    an empty or non-text input raises InputError naming its position.

    Args:
        on_batch: called as on_batch(batch, row, item) for each item's first row, once its batch is
            answered (serving.BatchingPredictor keeps each visitor's for the attention view).
        checked: the items and options were already checked (check_inputs) by the caller.
    """
    predictor = predictor.get()  # a LazyPredictor loads here
    spec = predictor.task.spec
    fields = spec.input_fields + spec.optional_fields
    bad = {i: problem for i, item in enumerate(items) if (problem := _not_an_input(item, spec.input_fields))}
    if bad:
        first = next(iter(bad))
        said = "; ".join(f"inputs[{i}]: {problem}" for i, problem in list(bad.items())[:5])
        more = f"; and {len(bad) - 5:,} more" if len(bad) > 5 else ""
        err = InputError(f"{spec.name}: {said}{more}")
        err.position, err.detail = first, bad[first]  # the first, for a caller that drops it and goes on
        raise err
    if not checked:
        for item in items:
            predictor.check_fields(item)
        options = predictor.check_options(options)
    results: list[Any] = [None] * len(items)
    # One input needs no lengths: skip tokenising it twice.
    groups = [[0]] if len(items) == 1 else length_groups(_token_lengths(predictor.tokenizer, items, fields), batch_size)
    for chunk in progress_bar(groups, disable=not progress, desc=spec.name, unit="batch"):
        inputs = {f: [items[i].get(f) for i in chunk] for f in fields
                  if any(items[i].get(f) is not None for i in chunk)}
        try:
            with request_stage("preprocess"):
                batch = spec.preprocess(inputs, predictor.tokenizer, **options)
        except InputError as err:  # about one input of the chunk: name its place in the caller's list
            if err.position is None or not 0 <= err.position < len(chunk):
                raise
            raise InputError.at(spec.name, chunk[err.position], err.detail) from None
        try:
            chunk_results = predictor.run(batch, options)
        except InputError as err:  # about one input (past the request limits, or a postprocess's InputError.at)
            index, detail = ((err.position, err.detail) if err.position is not None
                             else (getattr(err, "input_index", None), getattr(err, "input_detail", "")))
            if index is None or not 0 <= index < len(chunk):
                raise
            raise InputError.at(spec.name, chunk[index], detail) from None
        for i, result in zip(chunk, chunk_results if len(chunk) > 1 else [chunk_results]):
            results[i] = result
        if on_batch is not None:
            for k, i in enumerate(chunk):  # each item's first row
                on_batch(batch, batch.sample_index.index(k), i)
    return results


# A batch's inputs lie within this factor of each other's length in word pieces (plus LENGTH_SLACK): every row
# is padded to the longest, and attention runs over the padding. Without it one long text in a short list (a
# Space's merged requests, 31 short texts and one of ~500 tokens) made the whole batch take 690 ms where the
# texts one by one took 324 (fill-mask, 2-core AVX-512 EPYC); now the long one runs in a pass of its own and
# the list takes 149 ms.
LENGTH_SPREAD = 2.0
LENGTH_SLACK = 16


def length_groups(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices of the inputs in batches: sorted by length, at most `batch_size` each, and a new batch where the
    next input is more than LENGTH_SPREAD times the batch's shortest (+ LENGTH_SLACK) long."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        group = groups[-1] if groups else None
        if group is None or len(group) >= batch_size or lengths[i] > LENGTH_SPREAD * lengths[group[0]] + LENGTH_SLACK:
            groups.append([i])
        else:
            group.append(i)
    return groups


def _token_lengths(tokenizer: Tokenizer, items: list[Mapping[str, Any]], fields: tuple[str, ...]) -> list[int]:
    """Word pieces per input over all its fields, to sort by: character counts misjudge numbers,
    tables and non-Latin scripts (on CoNLL, batches sorted by characters were 41 % padding)."""
    total = [0] * len(items)
    for field in fields:
        present = [i for i, item in enumerate(items) if item.get(field)]
        for i, encoding in zip(present, tokenizer.pieces([items[i][field] for i in present])):
            total[i] += len(encoding.ids)
    return total


def _not_an_input(item: Any, fields: list[str]) -> str:
    """What makes `item` no input of a task with these fields ("": nothing): not a mapping, a field missing, not
    text, or empty."""
    if not isinstance(item, Mapping):
        return f"not a text or a mapping of {', '.join(fields)} (got {type(item).__name__})"
    for field in fields:
        value = item.get(field)
        if value is None:
            return f"no {field}"
        if not isinstance(value, str):
            return f"the {field} is not text (got {type(value).__name__})"
        if not value.strip():
            return f"the {field} is empty"
    return ""


def can_batch(spec, items: list[Mapping[str, Any]]) -> bool:
    """Whether the task's `predict_many` answers `items` in one batched call: it has one, it takes one
    input field, and no item fills an optional field (predict_many takes the texts of that one field).
    The one rule for every caller: pipeline lists, `predict --file`, evaluation and request batching."""
    return (spec.predict_many is not None and len(spec.input_fields) == 1
            and all(item.get(field) is None for item in items for field in spec.optional_fields))


def predict_texts(predictor, texts: list[str], *, batch_size: int = 32,
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
