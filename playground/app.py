"""build_app(registry) -> gr.Blocks: one tab per registered task, then Plugins and Attention.

Built once at start-up from the task registry. Models load lazily per task on first use and
stay cached. A task whose tab fails to build gets an error panel in its place, never a blank app.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import inspect
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import plugins
from bert_engine import settings, ui
from bert_engine.checkpoints.hub import ADAPTER_WEIGHTS, WEIGHT_FILES, HubError, download_deadline
from bert_engine.checkpoints.loader import recorded_task
from bert_engine.checkpoints.loading import CheckpointError, inside_any
from bert_engine.checkpoints.lora import looks_local
from bert_engine.files import read_json
from bert_engine.hookspecs import InputError
from bert_engine.runtime.cancel import (
    CALLER_GONE,
    STUCK_AFTER_S,
    PredictionTimeout,
    RequestCancelled,
    call_with_timeout,
    wait_or_gone,
)
from bert_engine.runtime.explain import DEFAULT_STEPS, MAX_STEPS, checked_method
from bert_engine.runtime.explain import explain as explain_prediction
from bert_engine.runtime.fairness import WAITED, InFlight, TooManyRequests, Waited, one_call, visitor_scope
from bert_engine.runtime.inference import check_json_result, json_problem, threads_held
from bert_engine.runtime.precision import NAMES as PRECISIONS
from bert_engine.runtime.precision import PrecisionError, check_kernel_setting, device_for
from bert_engine.runtime.precision import resolve as resolve_precision
from bert_engine.serving import memory
from bert_engine.serving.pipeline import DTYPES
from bert_engine.serving.predictors import BatchingPredictor, LazyPredictor, ModelShelf
from bert_engine.tasks.registry import (
    HOST_ENDPOINTS,
    REQUEST_STAGES,
    PluginFailure,
    Registry,
    failure_location,
    is_host_endpoint,
    load_registry,
)
from playground import attention, insight
from plugins.starter import STARTER_ROOT

logger = logging.getLogger(__name__)

# Phones: a "Go to a task" menu (narrow screens only) lists every tab in the first screen; Gradio moves the tabs
# that do not fit into an overflow menu behind a bare "..." button, which
# gets a label, so the other tabs are found. Wide tables and heatmaps scroll inside their own box.
# A failed run keeps the last result on screen: the error is the toast's message, and Gradio's "Error"
# overlay, which would cover the previous answer, is not drawn.
PAGE_CSS = """
[data-testid="status-tracker"]:has(.error) { display: none !important; }
.overflow-menu > button::after { content: " More tabs"; font-size: var(--text-md); white-space: nowrap; }
.overflow-menu > button { display: inline-flex; align-items: center; gap: 4px; }
.overflow-dropdown button { display: block; width: 100%; text-align: left; padding: 8px 12px; }
.be-cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(220px, 1fr)); gap: 12px; }
.be-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 10px 12px; }
.be-card-title { font-size: var(--text-sm); color: var(--body-text-color-subdued); margin-bottom: 4px; }
.be-card-answer { overflow-wrap: anywhere; }
.be-card-error .be-card-answer, .be-card-skipped .be-card-answer { color: var(--body-text-color-subdued);
                                                                    font-style: italic; }
.table-wrap, .attention-links { overflow-x: auto; max-width: 100%; }
.be-task-menu { display: none; }
.dark [role=tablist] [role=tab][aria-selected=true] { color: var(--primary-400) !important; }
@media (max-width: 640px) { .be-task-menu { display: block; } }
table th, table th * { white-space: nowrap; word-break: keep-all; overflow-wrap: normal; }
.be-why-field { font-weight: 600; margin-right: .4em; }
.be-why-text { line-height: 1.8; white-space: pre-wrap; }
table.be-compare td, table.be-compare th { padding: 2px 8px; text-align: left; }
tr.be-disagree td { font-weight: 600; }
.attention-links th, .attention-links td { padding: 2px 8px; text-align: left; }
"""

DEFAULT_TIMEOUT_S = 120.0  # a request a task has not answered by then is cut off with a message
BUSY_WAITING_SHARE = 0.25  # a cut-off request that waited this share of its time for others' work: "busy"


def build_app(registry: Registry | None = None, *, checkpoints: dict[str, str] | None = None,
              device: str | None = None, precision: str = "auto", timeout_s: float | None = DEFAULT_TIMEOUT_S):
    """The playground as a Gradio Blocks app.

    Args:
        registry: the task registry (default: load built-ins and installed plugins).
        checkpoints: task name -> folder or Hub id, overriding each task's default model.
        device: force a device ("cpu", "cuda"); default: CUDA, then MPS, then CPU.
        precision: "auto", "fp32", "bf16", "fp16" or "int8" (bert_engine.runtime.precision); checked here
            against the device and CPU, so a precision this machine cannot run fails at start-up
            (PrecisionError) instead of in every tab; so does a BERT_ENGINE_KERNELS it cannot run.
        timeout_s: seconds a prediction may take before the user gets a "cut off" message instead
            (None: no limit). Failures of a task's code show in the Plugins tab.
    """
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    resolve_precision(precision, device_for(precision, device))
    check_kernel_setting()  # BERT_ENGINE_KERNELS: a bad value, or "tiled" where it cannot run, fails here too
    registry = registry or load_registry(builtins=plugins.BUILTIN)  # the built-in tasks, handed to the engine
    checkpoints = checkpoints or {}
    model_dirs = allowed_model_dirs()  # a list the picker reads at each use (tests may extend it)
    for problem in model_dir_problems():  # most likely a typo: the app runs, without the models meant
        logger.warning("%s", problem)
    in_flight = InFlight()  # per visitor, across the tabs (bert_engine.runtime.fairness)
    stuck = StuckTasks(registry)  # tasks whose cut-off request would not stop: off until it does

    def serve(predict, predictor: LazyPredictor, name: str, cut_off_hint: str | None = None):
        return guarded(on_gpu(predict, predictor, timeout_s), name, registry, timeout_s, in_flight, stuck,
                       cut_off_hint=cut_off_hint, model_of=lambda: predictor.checkpoint)

    @contextlib.contextmanager
    def loading():
        """A model picker's load as a request: within the visitor's in-flight cap (waiting for a place up to the
        time limit) and, for a Hub id, a download that ends by that limit (hub.download_deadline)."""
        with in_flight.admit(current_visitor(), current_group(), wait_s=timeout_s or DEFAULT_TIMEOUT_S), \
                download_deadline(timeout_s):
            yield

    # Concurrent requests to a one-field task share a forward pass (see BatchingPredictor); each request
    # is admitted, timed and contained by `guarded` (ServedPredictor).
    # models loaded to compare with the served ones (any visitor's pick), at most 2 at once
    shelf = ModelShelf(max_models=2, device=device, allowed_dirs=model_dirs, shown_name=shown_model_name)
    predictors = {name: ServedPredictor(task, checkpoints.get(name), serve=serve, shelf=shelf, device=device,
                                        answer_wait_s=timeout_s or DEFAULT_TIMEOUT_S,
                                        precision=precision, allowed_dirs=model_dirs, shown_name=shown_model_name)
                  for name, task in registry.tasks.items()}
    precisions = runnable_precisions(device)
    # each tab built once on its own first (outside the app: Gradio files events under the app being built)
    stray = {name: found for name, task in registry.tasks.items()
             if (found := stray_endpoints(gr, task, predictors[name], registry))}
    statuses: dict[str, Any] = {}
    endpoints: dict[str, Any] = {}
    wrap = functools.partial(host_handler, gr, endpoints)
    publish = functools.partial(publish_json, gr, registry=registry)
    with playground_class(gr)(predictors, model_dirs, endpoints, title="bert_engine playground") as app, \
            ui.wiring(wrap, publish=publish):
        gr.Markdown("# bert_engine playground\nBERT written from scratch in PyTorch: pick a task, type or paste "
                    "text, and see what the model answers. " + plural(len(registry.tasks), "task") + ".")
        titles = [(task.spec.title, name) for name, task in registry.tasks.items()]
        titles += [("All tasks", "all_tasks")] if len(single_text_tasks(registry)) > 1 else []
        menu = gr.Dropdown(choices=[*titles, ("Plugins", "plugins"), ("Attention", "attention")], value=None,
                           label="Go to a task", elem_classes=["be-task-menu"], filterable=False)  # phones only (CSS)
        with gr.Tabs() as tabs:
            _build_tabs(gr, app, registry, predictors, statuses, endpoints, (wrap, publish), model_dirs, precisions,
                        timeout_s, stray, loading)
        _build_insight_api(gr, registry, predictors, endpoints, model_dirs, precisions)
        # the menu empties after each jump, so choosing the same entry again (after tapping another tab) jumps again
        menu.change(lambda chosen: (gr.Tabs(selected=chosen), None) if chosen else (gr.skip(), gr.skip()), menu,
                    [tabs, menu], api_visibility="private")
    return app


def _build_tabs(gr, app, registry, predictors, statuses, endpoints, wiring, model_dirs, precisions, timeout_s,
                stray: dict[str, list[str]], loading=contextlib.nullcontext) -> None:
    """One tab per task (with its model picker, why and compare), All tasks, Plugins and Attention; `wiring`:
    the host's (wrap, publish) for ui.wiring; `loading()`, what a picker's load runs inside (build_app's)."""
    for name, task in registry.tasks.items():
        with gr.Tab(task.spec.title, id=name) as tab:
            if task.spec.description:
                gr.Markdown(task.spec.description)
            statuses[name] = _build_model_picker(gr, name, predictors[name], model_dirs, loading)
            _build_task_tab(gr, task, predictors[name], registry, *wiring, stray=stray.get(name, []))
            _build_insight(gr, task, predictors[name], model_dirs, precisions)
        tab.select(with_request(gr, functools.partial(model_line, predictors[name])), None, statuses[name],
                   api_visibility="private")
    if len(single_text_tasks(registry)) > 1:
        with gr.Tab("All tasks", id="all_tasks"):
            _build_all_tasks_tab(gr, registry, predictors, timeout_s)
    with gr.Tab("Plugins", id="plugins") as plugins_tab:
        table = _build_plugins_tab(gr, registry, endpoints)
    # failures since start-up show on opening; not an API endpoint (/plugins is)
    plugins_tab.select(lambda: plugin_rows(registry), None, table, api_visibility="private")
    with gr.Tab("Attention", id="attention") as attention_tab:
        ranges, range_inputs, range_outputs = _build_attention_tab(gr, registry, predictors, loading, attention_tab)
    # each visitor's own model line, once the page opens (the warm-up may have loaded the defaults)
    app.load(with_request(gr, lambda: model_lines(predictors, statuses)), None, list(statuses.values()),
             api_visibility="private")
    app.load(ranges, range_inputs, range_outputs, api_visibility="private")  # the sliders' real ranges


class LastTasks:
    """Each visitor's last task answered (the Attention tab opens on it), the latest `keep` visitors."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._tasks: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, visitor: str | None, task: str) -> None:
        if visitor is None or one_call(visitor):
            return
        with self._lock:
            self._tasks[visitor] = task
            self._tasks.move_to_end(visitor)
            while len(self._tasks) > self.keep:
                self._tasks.popitem(last=False)

    def get(self, visitor: str | None) -> str | None:
        with self._lock:
            return self._tasks.get(visitor) if visitor is not None else None


LAST_TASKS = LastTasks()
# The order a task's requests came in, across the app: "why" and "compare" explain a visitor's request sent last,
# whichever answer finished last (ServedPredictor.remember_request)
_SENT_ORDER = itertools.count()
SENT: ContextVar[int | None] = ContextVar("playground_sent", default=None)


class ServedPredictor(BatchingPredictor):
    """A task's predictor as the app serves it: every prediction, explanation and comparison goes through
    `serve(function, self, task name)` (admission, time limit, ZeroGPU, contained failures: `guarded` and
    `on_gpu`). Each visitor's last answered request is kept for "why" and "compare" (remember_request)."""

    def __init__(self, task, checkpoint: str | None = None, *, serve, shelf: ModelShelf | None = None,
                 answer_wait_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(task, checkpoint, **kwargs)
        self.shelf = shelf
        self.answer_wait_s = answer_wait_s
        self._answering: dict[str | None, int] = {}  # visitor -> their answers on their way in this task
        self._waiting: dict[str | None, int] = {}  # visitor -> their "why" / "compare" waiting for those
        self._answered = threading.Condition()
        self._served = serve(self._answer, self, task.spec.name)
        self._explained = serve(self._explain, self, task.spec.name, cut_off_hint=EXPLAIN_CUT_OFF)
        self._compared = serve(self._compare, self, task.spec.name)

    def _answer(self, inputs, **options: Any) -> dict[str, Any]:
        sent = SENT.get()
        output = super().predict(inputs, **options)
        check_json_result(self.task.spec.name, output["result"])  # the API answers JSON: a task's NaN, set or
        self.remember_request(inputs, options, sent)               # array is its failure, not a string
        LAST_TASKS.note(current_visitor(), self.task.spec.name)
        return output

    def predict(self, inputs, **options: Any) -> dict[str, Any]:
        visitor = current_visitor()  # from the moment its handler asks: waiting for an in-flight place included
        with self._answered:
            _count(self._answering, visitor, +1)
        token = SENT.set(next(_SENT_ORDER))  # (itertools.count: atomic under the GIL)
        try:
            return self._served(inputs, **options)
        finally:
            SENT.reset(token)
            with self._answered:
                _count(self._answering, visitor, -1)
                self._answered.notify_all()

    ANSWER_WAIT_STEP_S = 0.5
    MAX_WAITING = 2  # a visitor's "why" / "compare" that wait at once for their answers, per task

    def wait_for_answers(self) -> None:
        """Wait until the current visitor has no answer on its way in this task, so that "why" or "compare" clicked
        meanwhile (an example clicked, then "why") reads the answer they asked for last, not "no answer yet" or the
        one before it: first for the requests their Gradio session sent before this one (earlier_requests_unfinished;
        not for an MCP caller, whose session Gradio's relay shares with other callers), then for their answers in
        this task however they came (running or waiting for an in-flight place).
        The wait holds no in-flight place (the answer it waits for may need it), lasts at most answer_wait_s (an
        answer ends by its own time limit), ends when the sender leaves, and only MAX_WAITING of a visitor's wait at
        once per task (more go ahead)."""
        visitor, request = current_visitor(), REQUEST.get()
        deadline = time.monotonic() + self.answer_wait_s
        with self._answered:
            if visitor is None or self._waiting.get(visitor, 0) >= self.MAX_WAITING:
                return
            _count(self._waiting, visitor, +1)
        try:
            pause = threading.Event()  # never set: wait_or_gone's steps, ended early only by the sender leaving
            while (not visitor.startswith("mcp") and not one_call(visitor) and earlier_requests_unfinished(request)
                   and deadline - time.monotonic() > 0):
                wait_or_gone(pause, 0.05)
            with self._answered:
                while self._answering.get(visitor) and (left := deadline - time.monotonic()) > 0:
                    wait_or_gone(self._answered, min(left, self.ANSWER_WAIT_STEP_S))
        except RequestCancelled:
            return  # the request itself stops where it is served (guarded), saying so once
        finally:
            with self._answered:
                _count(self._waiting, visitor, -1)

    def explain(self, inputs=None, *, method: str = "integrated_gradients", steps: int = DEFAULT_STEPS,
                **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(explanation, the inputs explained): of `inputs` with `options`, or (None) of the current visitor's
        last answered request in this task (bert_engine.runtime.explain), after any answer of theirs still on its
        way here (wait_for_answers)."""
        if inputs is None:
            self.wait_for_answers()
        return self._explained(inputs, method=method, steps=steps, **options)

    def compare(self, inputs=None, *, other: tuple[str | None, str], this: tuple[str | None, str] | None = None,
                **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(comparison, the inputs compared): `inputs` (None: the visitor's last request) through the visitor's
        model of this tab, or `this` = (checkpoint, precision), and through `other`."""
        if inputs is None:
            self.wait_for_answers()
        return self._compared(inputs, other=other, this=this, **options)

    def _explain(self, inputs, *, method: str, steps: int, **options: Any):
        if inputs is None:
            inputs, options = self.last_request()
        return explain_prediction(self, inputs, method=method, steps=steps, **options), inputs

    def _compare(self, inputs, *, other, this, **options: Any):
        if inputs is None:
            inputs, options = self.last_request()
        if self.shelf is None:
            raise InputError(f"{self.task.spec.name}: comparing needs the app's model shelf")
        sides = []
        for label, choice in (("A", this), ("B", other)):
            predictor = self.get() if choice is None or self._serves(choice) else self.shelf.get(self.task, *choice)
            start = time.perf_counter()
            output = predictor.predict_checked(inputs, predictor.check_inputs(inputs, options))
            provenance = output["provenance"]
            sides.append({"label": label, "model": provenance["model"], "precision": provenance["dtype"],
                          "seconds": round(time.perf_counter() - start, 3), "result": output["result"],
                          "brief": brief_answer(self.task, output["result"]),
                          "untrained_head": bool(provenance.get("untrained_head"))})
        disagree, scores = insight.differences(sides[0]["result"], sides[1]["result"])
        return {"task": self.task.spec.name, "a": sides[0], "b": sides[1], "agree": not disagree,
                "disagreements": disagree, "score_differences": scores}, inputs

    def _serves(self, choice: tuple[str | None, str]) -> bool:
        """Whether (checkpoint, precision) is the model this visitor is served, loaded: compared as it is, not as
        a second copy on the shelf (an API compare names both sides; each call loaded the default again)."""
        checkpoint, precision = choice
        if (checkpoint or None) != (self.checkpoint or None) or not self.loaded:
            return False
        served = self.get()
        dtype = str(next(served.model.parameters()).dtype).removeprefix("torch.")
        return (served.precision or DTYPES.get(dtype)) == precision  # (pipeline's names for torch's dtypes)


def _count(counts: dict, key: Any, step: int) -> None:
    """counts[key] += step, the key gone at 0."""
    value = counts.get(key, 0) + step
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


def runnable_precisions(device: str | None) -> list[str]:
    """The precisions a model can be loaded in on this machine ("auto" left out)."""
    runnable = []
    for name in PRECISIONS:
        if name == "auto":
            continue
        try:
            resolve_precision(name, device_for(name, device))
        except PrecisionError:
            continue
        runnable.append(name)
    return runnable


@functools.cache
def playground_class(gr):
    """gr.Blocks with the playground's parts: its predictors, the folders the model picker reads,
    and launch() with the page's CSS and keyboard script (Gradio 6 takes them at launch) and enough
    worker threads for the queue `serve_queue` set up."""

    class Playground(gr.Blocks):
        def __init__(self, predictors: dict[str, LazyPredictor], model_dirs: list[Path], endpoints: dict[str, Any],
                     **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.predictors = predictors
            self.model_dirs = model_dirs
            self.endpoints = endpoints  # API name -> the function behind it, callable from Python
            self.max_threads = 40  # Gradio's default

        async def preprocess_data(self, block_fn, inputs: list[Any], state, explicit_call: bool = False):
            # An API caller's inputs are checked here, each refusal one line to the caller and none in the log
            # (Gradio's own were a 23-30 line traceback each: a flood of bad requests, which never reach a
            # visitor's in-flight cap, wrote megabytes of log a minute).
            if len(inputs) < len(block_fn.inputs):
                names = [getattr(block, "label", None) or type(block).__name__ for block in block_fn.inputs]
                raise shown_error(gr, f"expected {len(names)} inputs ({', '.join(map(str, names))}), got {len(inputs)}")
            # A slider's number sent as text, or null: Gradio's slider would fail comparing it with its bounds,
            # and the caller read only "the upstream app raised an exception"; a text box's value must be text.
            inputs = [text_input(gr, block, numeric_input(gr, block, value))
                      for block, value in zip(block_fn.inputs, inputs)] + list(inputs[len(block_fn.inputs):])
            try:
                return await super().preprocess_data(block_fn, inputs, state, explicit_call)
            except gr.Error as err:  # a choice not in a list, a number out of a slider's bounds: the caller's
                if not err.print_exception:
                    raise
                raise shown_error(gr, str(err.message)) from None

        def launch(self, *args: Any, **kwargs: Any):
            from starlette.middleware import Middleware  # noqa: PLC0415 - Gradio's server brings starlette

            app_kwargs = dict(kwargs.get("app_kwargs") or {})
            app_kwargs["middleware"] = [*app_kwargs.get("middleware", ()), Middleware(McpCallerAddress),
                                     Middleware(McpCallWatch), Middleware(UnknownEndpoint)]
            kwargs["app_kwargs"] = app_kwargs
            kwargs.setdefault("theme", page_theme(gr))
            kwargs.setdefault("css", ui.CSS + PAGE_CSS)
            kwargs.setdefault("head", ui.KEYBOARD_JS)
            kwargs.setdefault("max_threads", self.max_threads)
            return super().launch(*args, **kwargs)

    return Playground


class McpCallerAddress:
    """ASGI middleware: an MCP request's X-Forwarded-For becomes the address the server resolved for its caller.
    Gradio runs a queued MCP tool call by relaying it to its own API through a loopback client with the MCP
    request's headers; uvicorn trusts the loopback and takes the caller's address from that header. Without it
    every MCP caller was 127.0.0.1, one account for the per-address cap (one flood refused everyone else's MCP
    calls: the fresh-clone check, session 46), and with a header of the caller's own making, any address it
    liked. Behind a trusted proxy (a Space), the address the server resolved is the proxy's word, as for every
    other request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and "/mcp" in scope.get("path", ""):
            client = scope.get("client")
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"x-forwarded-for"]
            if client and client[0]:
                headers.append((b"x-forwarded-for", str(client[0]).encode("latin-1", "replace")))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


MCP_CALL_HEADER = b"x-bert-engine-mcp-call"
# An MCP request's id (MCP_CALL_HEADER) -> set once its caller is gone or the request has ended; ended ones are kept
# (the newest MCP_CALLS_KEPT) so that a tool call outliving its request reads "gone", and an id never issued, none
_MCP_CALLS: OrderedDict[str, threading.Event] = OrderedDict()
MCP_CALLS_KEPT = 4096
_MCP_PATH = re.compile(r"/gradio_api/mcp(/http)?/?$")  # the streamable HTTP transport, where a call's POST lasts


class McpCallWatch:
    """ASGI middleware: whether an MCP request's caller is still there, for the tool call it started. Gradio runs a
    queued tool call by relaying it to its own API through one loopback client, whose event stream stays open
    whatever the agent does, so an agent that gave up (a time-out, a cancelled task: its connection closed) left
    the request running to its end or its time limit (41 s of CPU in an outside check). Each MCP POST gets an id
    in a header of its own (Gradio relays every header of the MCP request to the event it submits; one the caller
    sent under that name is dropped) and a watch on its connection; mcp_caller_gone reads it. Gradio's MCP transport
    is stateless with no event store: an answer whose connection has closed reaches nobody (no resuming), and an
    agent's cancel notification arrives on a request of its own that cannot reach the call."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or not _MCP_PATH.search(scope.get("path", "")):
            await self.app(scope, receive, send)  # (the SSE transport's POST to /messages/ is answered 202 at once)
            return
        call, gone, body_read = uuid.uuid4().hex, threading.Event(), asyncio.Event()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != MCP_CALL_HEADER]
        scope = {**scope, "headers": [*headers, (MCP_CALL_HEADER, call.encode())]}

        async def receiving() -> dict:
            message = await receive()
            if message.get("type") == "http.disconnect":
                gone.set()
            elif not message.get("more_body"):
                body_read.set()
            return message

        async def watch() -> None:  # once the body is read, the next message is the disconnect
            await body_read.wait()
            while not gone.is_set():
                if (await receive()).get("type") == "http.disconnect":
                    gone.set()

        _MCP_CALLS[call] = gone
        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, receiving, send)
        finally:
            watcher.cancel()
            gone.set()  # answered or abandoned: what still runs for it reaches nobody
            ended = [key for key, event in _MCP_CALLS.items() if event.is_set()]
            for key in ended[:max(0, len(ended) - MCP_CALLS_KEPT)]:
                _MCP_CALLS.pop(key, None)


def mcp_caller_gone(request: Any) -> bool:
    """Whether the request is an MCP tool call (it carries an id McpCallWatch issued) whose caller's connection has
    closed, or whose MCP request has ended without it. False for any other request, an id never issued included."""
    headers = getattr(request, "headers", None)
    call = headers.get(MCP_CALL_HEADER.decode()) if hasattr(headers, "get") else None
    gone = _MCP_CALLS.get(str(call)) if call else None
    return gone is not None and gone.is_set()


class UnknownEndpoint:
    """ASGI middleware: a call to an endpoint the app does not have (`/gradio_api/call/nosuch`, a `fn_index` no event
    has) is answered 404 with one line naming it, and logged as one line. Gradio's routes raised there: an HTTP 500
    with no reason, and a 40-line traceback in the log per request, which any visitor could repeat."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "POST" and scope.get("path", "").rstrip("/").endswith("/queue/join"):
            receive = await self._refuse_empty_session(scope, receive, send)
            if receive is None:
                return
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as err:
            name = unknown_endpoint(scope.get("path", ""), err)
            if started and name is None and unknown_event_stream(scope.get("path", ""), err):
                # GET /gradio_api/call/<name>/<no such event>: Gradio's stream had sent its error event ("404: Not
                # Found"), then raised (a 78-line traceback per request); the stream just ends here
                logger.info("a call's result asked for an event the app does not have: %s", scope.get("path", "")[:200])
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if name is None or started:
                raise
            logger.info("a call to an endpoint the app does not have: %s", name)
            body = json.dumps({"detail": f"no API endpoint {name} here; /gradio_api/info lists them"}).encode()
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

    _EMPTY_SESSION = re.compile(rb'"session_hash"\s*:\s*""')
    PARSED_BODY_BYTES = 1_000_000

    async def _refuse_empty_session(self, scope: dict, receive: Any, send: Any):
        """A queue join whose session_hash is "": Gradio took it, then failed in its queue (a KeyError of the event's
        id, answered "no API endpoint number <event id>" and logged as a traceback per request). Refused 400 as
        Gradio refuses a missing one; otherwise the receive that replays the body read here (None: refused)."""
        messages, chunks = [], []
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        empty = False
        # parsed whole when small (a key spelt with escapes, "session_h\u0061sh", reads the same), else where the
        # key is written plainly (bare quotes: a key, never inside a JSON string)
        if len(body) <= self.PARSED_BODY_BYTES or self._EMPTY_SESSION.search(body):
            with contextlib.suppress(ValueError, RecursionError):
                parsed = json.loads(body)
                empty = isinstance(parsed, dict) and parsed.get("session_hash") == ""
        if empty:
            logger.info("a queue join with an empty session_hash: refused")
            answer = json.dumps({"detail": "session_hash is empty: give the id of your session (any non-empty text "
                                           "you keep for your calls)"}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
            await send({"type": "http.response.body", "body": answer})
            return None

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()
        return replay


def unknown_endpoint(path: str, err: Exception) -> str | None:
    """The endpoint a request named that Gradio's routes did not find (from the error they raised), in words;
    None when `err` is anything else."""
    if type(err).__name__ == "FnIndexInferError":  # gradio.route_utils: an api_name no event has
        match = re.search(r"API name: (.*)$", str(err))
        return repr((match.group(1) if match else "?")[:100])
    if isinstance(err, KeyError) and path.rstrip("/").endswith("/queue/join"):  # a fn_index no event has
        return f"number {str(err.args[0] if err.args else '?')[:40]}"
    if isinstance(err, KeyError) and "/call/v2/" in path:  # POST /gradio_api/call/v2/<an api_name no event has>
        return repr(path.rstrip("/").rsplit("/", 1)[-1][:100])
    return None


def unknown_event_stream(path: str, err: Exception) -> bool:
    """Whether `err` is Gradio's refusal of a result stream for an event id it does not know, raised after the
    stream began (`GET /gradio_api/call/<name>/<event id>`)."""
    return (isinstance(err, RuntimeError) and "response already started" in str(err)
            and re.search(r"/call/(v2/)?[^/]+/[^/]+/?$", path) is not None)


def text_input(gr, block: Any, value: Any) -> Any:
    """A text box's value: text, or null (its default). A mapping or a list sent by an API caller was classified
    as its Python spelling ("{'a': 1}": POSITIVE 0.70)."""
    if isinstance(block, gr.Textbox) and value is not None and not isinstance(value, str):
        raise shown_error(gr, f"{block.label or 'a text input'}: expected text, got {type(value).__name__} "
                              f"{str(value)[:80]!r}")
    return value


def numeric_input(gr, block: Any, value: Any) -> Any:
    """A value sent for a slider or number box as the component takes it: null is its default, text that
    reads as a finite number is that number; for a checkbox, true or false (null: its default); anything else
    is the caller's error, naming the value."""
    if isinstance(block, gr.Checkbox):  # (an API caller's "yes" or 0 was read as true or false)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):  # (JSON clients may send text)
            return value.strip().lower() == "true"
        if value is None or isinstance(value, bool):
            return block.value if value is None else value
        raise shown_error(gr, f"{block.label or 'a checkbox'}: expected true or false, got {str(value)[:80]!r}")
    if not isinstance(block, (gr.Slider, gr.Number)) or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if value is None:
        return block.value
    try:
        number = float(value) if isinstance(value, str) else None
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        label = block.label or "a number input"
        bounds = f" from {block.minimum:g} to {block.maximum:g}" if isinstance(block, gr.Slider) else ""
        raise shown_error(gr, f"{label}: expected a number{bounds}, got {str(value)[:80]!r}")
    return number


def page_theme(gr):
    """Gradio's default theme with every text at 4.5:1 or more (WCAG AA) in light and dark, as the browser
    test measures from computed styles: white on a darker orange for the primary buttons, the selected
    tab's accent darker (lighter in dark mode: PAGE_CSS), and the subdued text (an input's info line, a slider's ends, card titles)
    darker on light and lighter on dark."""
    return gr.themes.Default().set(
        button_primary_background_fill="*primary_700", button_primary_background_fill_dark="*primary_700",
        button_primary_background_fill_hover="*primary_800", button_primary_background_fill_hover_dark="*primary_800",
        button_primary_text_color="white", button_primary_text_color_dark="white",
        color_accent="*primary_700",
        body_text_color_subdued="*neutral_600", body_text_color_subdued_dark="*neutral_400")


# Requests Gradio hands to the handlers at once, per event. Gradio's queue is first-in first-out and would
# hold a light visitor's request behind every long one (the review: over 295 s behind 12 long requests at
# Gradio's default of 4); above it, each visitor has at most InFlight's 2 in flight and the compute gate
# (bert_engine.runtime.fairness) serves the next forward chunk to whoever used least lately. So the
# queue admits this many and the gate does the queueing.
ADMITTED = 64


def serve_queue(app, concurrency: int | None = None):
    """Put the app's queue in the fairness gate's hands: `concurrency` (default BERT_ENGINE_CONCURRENCY,
    else ADMITTED) requests per event go straight to the handlers, and launch gets enough worker threads
    for them (Gradio runs handlers in a pool of max_threads)."""
    if concurrency is None:
        concurrency = settings.get("BERT_ENGINE_CONCURRENCY")
    if concurrency < 1:
        raise ValueError(f"BERT_ENGINE_CONCURRENCY must be at least 1, got {concurrency}")
    app.queue(default_concurrency_limit=concurrency)
    app.max_threads = concurrency + 16  # Playground.launch passes it on
    return app


def plural(count: int, noun: str) -> str:
    """"1 task", "5 tasks": the subtitle's count in plain English."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def warm_up(predictors: dict[str, LazyPredictor]) -> threading.Thread:
    """Load every task's model in a background thread after start-up, so the first request does not
    wait for (or time out on) a download or a load. A failure is logged; the tab reports it on use."""
    def load_all() -> None:
        for name, predictor in predictors.items():
            try:
                predictor.get()
            except Exception as err:  # shown to the user when the tab is used; here only logged
                logger.warning("warm-up of task %s failed: %s", name, err)

    thread = threading.Thread(target=load_all, name="bert-engine-warm-up", daemon=True)
    thread.start()
    return thread


# The gr.Request of the event being handled (with_request keeps it here while its handler runs).
REQUEST: ContextVar[Any] = ContextVar("playground_request", default=None)


WATCH_SENDER_EVERY_S = 0.5  # how often a running event looks whether its sender's connection is still open


def with_request(gr, function):
    """`function` as an event handler that is also handed the caller's gr.Request (Gradio fills a
    parameter annotated gr.Request: its documented way to tell callers apart; it is no API input), kept
    in REQUEST while the function runs, for current_visitor. A function taking *args or **kwargs, a
    generator or a coroutine is left as it is.

    The handler is a coroutine that runs `function` in a worker thread and sets the request's CALLER_GONE
    (bert_engine.runtime.cancel) when the sender is gone: Gradio cancelled the event (a client's cancel, the
    page's stop) or the sender's event stream closed (a closed tab, a dropped client; `sender_gone`). The
    request then stops within a fraction of a second, freeing the CPU and its visitor's in-flight place. A
    plain function in Gradio's thread could not hear of either: Gradio waited for it to end before it even
    answered the cancel."""
    if function is None or inspect.isgeneratorfunction(function) or inspect.iscoroutinefunction(function):
        return function
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return function
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in signature.parameters.values()):
        return function

    import anyio  # noqa: PLC0415 - Gradio's own dependency; only where a UI is built

    @functools.wraps(function)
    async def handler(request, *args, **kwargs):
        gone = threading.Event()

        def run():
            token, gone_token = REQUEST.set(request), CALLER_GONE.set(gone)
            try:
                return function(*args, **kwargs)
            finally:
                CALLER_GONE.reset(gone_token)
                REQUEST.reset(token)

        work = asyncio.ensure_future(anyio.to_thread.run_sync(run, abandon_on_cancel=True,
                                                              limiter=gradio_limiter(request)))
        try:
            while not (await asyncio.wait({work}, timeout=WATCH_SENDER_EVERY_S))[0]:
                if not gone.is_set() and (sender_gone(request) or mcp_caller_gone(request)
                                          or await connection_closed(request)):
                    logger.info("a request's sender went away; stopping it")
                    gone.set()  # the thread's request stops; its answer (an error) reaches nobody
            return work.result()
        except asyncio.CancelledError:  # Gradio cancelled the event: stop the work it started
            gone.set()
            work.cancel()
            raise

    handler.__signature__ = signature.replace(parameters=[
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=gr.Request),
        *signature.parameters.values()])
    handler.__annotations__ = {"request": gr.Request}  # what Gradio reads to fill it
    handler.__doc__ = one_line_args(function.__doc__)  # what Gradio reads to describe the inputs (API, MCP)
    return handler


def gradio_limiter(request: Any) -> Any:
    """The worker-thread pool Gradio runs plain handlers in (max_threads: serve_queue sizes it for every admitted
    request, beyond anyio's default 40), so a handler run as a coroutine gets the same; None where it cannot be
    read (anyio's default pool)."""
    try:
        return request.request.app.get_blocks().limiter
    except Exception:  # noqa: BLE001 - Gradio's internals: a call outside the queue has none
        return None


def earlier_requests_unfinished(request: Any) -> bool:
    """Whether the session of a queued Gradio event has events it sent before this one that are still in Gradio's
    queue or running (a request a visitor sent a moment earlier, an example's run: one not yet handed to its handler
    is known to Gradio alone). False when this cannot be read (a call outside the queue, another Gradio)."""
    try:
        raw = request.request if request is not None else None
        queue = raw.app.get_blocks()._queue if raw is not None else None
        if queue is None:
            return False
        running = [event for job in queue.active_jobs if job for event in job]
        own = next((event for event in running if getattr(event, "request", None) is raw), None)
        if own is None:
            return False
        queued = [event for waiting in list(queue.event_queue_per_concurrency_id.values()) for event in list(waiting.queue)]
        return any(event is not own and event.session_hash == own.session_hash and event.enqueue_time < own.enqueue_time
                   for event in running + queued)
    except Exception:  # noqa: BLE001 - Gradio's internals: reading them must never fail a request
        return False


def sender_gone(request: Any) -> bool:
    """Whether the sender of a queued Gradio event has gone: every event of the request in Gradio's queue is
    marked no longer alive, which Gradio does when the session's event stream closes (a closed tab, a client
    that dropped its connection). False when this cannot be read (a call outside the queue, another Gradio)."""
    try:
        raw = request.request if request is not None else None
        blocks = raw.app.get_blocks() if raw is not None else None
        jobs = blocks._queue.active_jobs if blocks is not None else ()
        events = [event for job in jobs if job for event in job if getattr(event, "request", None) is raw]
    except Exception:  # noqa: BLE001 - Gradio's internals: reading them must never fail a request
        return False
    return bool(events) and not any(getattr(event, "alive", True) for event in events)


async def connection_closed(request: Any) -> bool:
    """Whether the sender of a direct (unqueued) call, `POST /gradio_api/run/<name>`, has closed its connection: that
    request is the live one, so its own disconnect is read. A queued event's request is its join call, long
    answered, which is what sender_gone reads instead. False when this cannot be read."""
    raw = getattr(request, "request", None) if request is not None else None
    try:
        if raw is None or not re.search(r"/(run|api)/[^/]+/?$", raw.url.path):
            return False
        return bool(await raw.is_disconnected())
    except Exception:  # noqa: BLE001 - the server's internals: reading them must never fail a request
        return False


def one_line_args(doc: str | None) -> str | None:
    """A Google-style docstring with each `Args:` entry on one line: Gradio reads only an entry's first line
    into the API's and the MCP tools' input descriptions, and cut every wrapped one mid-sentence."""
    if not doc:
        return doc
    lines, out, args_indent, entry_indent = inspect.cleandoc(doc).split("\n"), [], None, None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            args_indent, entry_indent = indent, None
        elif args_indent is not None and stripped and indent <= args_indent:
            args_indent = None  # the next section (Returns:, Raises:) or the text after it
        elif args_indent is not None and stripped:
            if entry_indent is None or indent <= entry_indent:
                entry_indent = indent  # an entry's first line: "name: what it is"
            else:
                out[-1] = f"{out[-1]} {stripped}"  # its continuation, joined to it
                continue
        out.append(line)
    return "\n".join(out)


def host_handler(gr, endpoints: dict[str, Any], function, api_name: str | None = None):
    """A tab's event handler as the host serves it (ui.wiring): InputError shown as the UI's message,
    the caller's gr.Request known, and an API endpoint's function named after it (the MCP server names
    each tool after its function; otherwise every tab's would be `run`). `endpoints` collects each
    endpoint's function as a Python caller may call it (app.endpoints: no request argument)."""
    shown = input_errors_shown(gr, function)
    if api_name:
        endpoints[api_name] = shown
    handler = with_request(gr, shown)
    if api_name and handler is not function:
        handler.__name__ = handler.__qualname__ = api_name
    return handler


def publish_json(gr, function, inputs: list[Any], api_name: str, description: str = "", *,
                 registry: Registry | None = None) -> None:
    """A tab's API endpoint and MCP tool `api_name` (ui.wiring's publisher): the run button's inputs and
    handler, answering with JSON text (the task's result and provenance; for All tasks, each task's),
    not the page's components. The button's own event stays the page's (`{api_name}_view`).

    The answer is JSON as it is: a prediction the tab changed into something JSON cannot hold (a tensor,
    a numpy number, NaN) is the task's failure, recorded in `registry`; never a string in its place."""
    def answer(*args, **kwargs):
        answer = json_answer(function(*args, **kwargs))
        try:
            return json.dumps(answer, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as err:
            problem = json_problem(err)
        if isinstance(answer, dict) and ("result" in answer or any(isinstance(v, dict) for v in answer.values())):
            message = f"the tab's answer {problem}"  # a prediction, or All tasks' mapping of them
            if registry is not None and api_name in registry.tasks:
                registry.record_request_failure(api_name, message, stage="tab handler")
            raise shown_error(gr, f"{api_name}: {message}; this is a bug in the task's tab, not in your input")
        try:  # the tab's other outputs, page values (an update, an image): their text where JSON has none
            return json.dumps(answer, ensure_ascii=False, default=str, allow_nan=False)
        except ValueError:
            raise shown_error(gr, f"{api_name}: the tab's answer {problem}; this is a bug in the task's tab, "
                                  "not in your input") from None

    functools.update_wrapper(answer, function)  # the inputs' names and the docstring the tool describes
    answer.__signature__ = inspect.signature(function).replace(return_annotation=str)
    handler = host_handler(gr, {}, answer, api_name)
    described = {"api_description": description} if description else {}
    result = gr.Textbox(visible=False, label="result (JSON)")
    gr.Button(visible=False).click(handler, api_inputs(gr, function, inputs), result, api_name=api_name,
                                   **described)


def api_inputs(gr, function, inputs: list[Any]) -> list[Any]:
    """The endpoint's inputs: the page's, but hidden twins where the page's would mislead an API or MCP caller.
    - A text box the handler needs (a parameter without a default) that the page fills with an example: an
      empty twin. Gradio makes an input with a starting value optional, that value its default, so an agent's
      call that left the text out was answered about the tab's example ("ner" with no text: the entities of
      "Angela Merkel met ...").
    - A slider: a number with the slider's value as its default and no bounds of Gradio's, so that the task's
      own check answers a value out of range, naming the option ("ner: nbest must be an integer in [1, 20], got
      50"; Gradio said "Value 50 is greater than maximum value 20." and logged a traceback)."""
    parameters = list(inspect.signature(function).parameters.values())
    out = []
    for parameter, component in zip(parameters, inputs):
        if (parameter.default is inspect.Parameter.empty and isinstance(component, gr.Textbox)
                and component.value not in (None, "")):
            component = gr.Textbox(visible=False, label=component.label, lines=component.lines)
        elif isinstance(component, gr.Slider):
            component = gr.Number(value=component.value, visible=False, label=component.label)
        out.append(component)
    return out + list(inputs[len(out):])


def json_answer(outputs: Any) -> Any:
    """What the API answers from a tab handler's outputs: the prediction ({"task", "result", "provenance"});
    else a mapping of such predictions, or of a task's "error" or "skipped" message (All tasks); else every
    output that is not the page's HTML."""
    values = outputs if isinstance(outputs, tuple) else (outputs,)
    for value in values:
        if isinstance(value, dict) and {"task", "result", "provenance"} <= set(value):
            return value
    for value in values:
        if isinstance(value, dict) and value and all(isinstance(v, dict) and {"result", "error", "skipped"} & set(v)
                                                     for v in value.values()):
            return value
    return [v for v in values if not (isinstance(v, str) and v.lstrip().startswith("<"))]


def current_visitor() -> str | None:
    """Who the request being served is for (None outside a Gradio event): an MCP client's own session
    when the relayed headers carry its `mcp-session-id`; an MCP tool call without one (Gradio 6.31 relays
    them statelessly through one shared loopback client, whose session several callers may share) is a
    visitor of its own, its address the account; else the Gradio session (a browser tab, a gradio_client)."""
    request = REQUEST.get()
    if request is None:
        return None
    headers = getattr(request, "headers", None) or {}
    mcp_session = headers.get("mcp-session-id") if hasattr(headers, "get") else None
    if mcp_session:
        return f"mcp:{str(mcp_session)[:128]}"
    if hasattr(headers, "get") and headers.get("mcp-protocol-version"):
        # An MCP tool call Gradio relays statelessly through its one loopback client: no identity of the
        # caller survives (the relay's session may be shared by several callers), so each call is its
        # own visitor and the caller's address (current_group) is the account that caps and orders them.
        return _per_call(request, "mcp-call")
    # A call with no Gradio session (a direct POST /gradio_api/run/<name>) is a visitor of its own, its address the
    # account: as "no visitor" (a script's), it changed every visitor's model, read other such callers' last inputs
    # and took no in-flight place (session 58's audit)
    return getattr(request, "session_hash", None) or _per_call(request, "call")


def _per_call(request, kind: str) -> str:
    """An id of `kind` for this one request, the same each time it is asked for during the request."""
    found = getattr(request, "_bert_engine_visitor", None)
    if not isinstance(found, str):
        found = f"{kind}:{uuid.uuid4().hex}"
        with contextlib.suppress(AttributeError, TypeError):  # (a request object that takes no attributes)
            request._bert_engine_visitor = found
    return found


def current_group() -> str | None:
    """Where the request being served comes from: the client's address as the server sees it (uvicorn
    takes it from X-Forwarded-For only when the connection comes from a trusted proxy, as on a Space).
    All of an address's sessions share one in-flight cap and one share of the compute gate."""
    client = getattr(REQUEST.get(), "client", None)
    host = getattr(client, "host", None)
    return f"ip:{str(host)[:64]}" if host else None


class TorchSettings:
    """torch's process-wide settings as the app set them: the thread count every forward pass uses and the
    default dtype new tensors get. A task's code that changes one (torch.set_num_threads(1) in a request: every
    thread started later takes it) would change it for every later request of every task and visitor, and a
    wrong default dtype makes other tasks fail, blamed on them. After each request (in its own thread, where
    torch reads the thread count) they are put back, and the change is the task's recorded failure."""

    def __init__(self) -> None:
        import torch  # noqa: PLC0415 - the app's modules load torch already; kept local like gradio

        self.torch = torch
        self.threads, self.dtype = torch.get_num_threads(), torch.get_default_dtype()

    def start(self) -> None:
        """A request's thread at the app's thread count: torch's count is per thread, and a thread started while
        another request's chunk ran on a half share took that half share (then read as this task's change)."""
        if self.torch.get_num_threads() != self.threads:
            self.torch.set_num_threads(self.threads)

    def restore(self, task: str, registry: Registry) -> None:
        torch = self.torch
        changed = []
        # (while another request's forward chunk runs on its turn's share of the threads, the count is its)
        if torch.get_num_threads() != self.threads and not threads_held():
            changed.append(f"thread count to {torch.get_num_threads()} (was {self.threads})")
            torch.set_num_threads(self.threads)
        if torch.get_default_dtype() != self.dtype:
            changed.append(f"default dtype to {torch.get_default_dtype()} (was {self.dtype})")
            torch.set_default_dtype(self.dtype)
        if changed:
            registry.record_request_failure(task, f"its code changed torch's {' and '.join(changed)} for the whole "
                                                  "process; put back", stage="request")


class StuckTasks:
    """Tasks with a request that still runs after it was cut off and cancelled for STUCK_AFTER_S (a loop
    that catches BaseException, a native call that never returns: Python cannot kill a thread). Such a
    task answers no more requests with that model (a visitor's pick: its files may be the cause) until that
    thread ends, and none at all while MAX_PER_TASK are stuck, so visitors cannot pile up spinning threads
    that slow everyone; the failure is recorded for the Plugins tab. (Keyed by the task alone, one visitor's
    pick turned the task off for every visitor.)"""

    MAX_PER_TASK = 2

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._threads: dict[tuple[str, str | None], int] = {}
        self._lock = threading.Lock()

    def holds(self, task: str, model: str | None = None) -> bool:
        with self._lock:
            return self._threads.get((task, model), 0) > 0 or \
                sum(n for (name, _), n in self._threads.items() if name == task) >= self.MAX_PER_TASK

    def callbacks(self, task: str, model: str | None = None) -> dict[str, Any]:
        """call_with_timeout's on_stuck and on_stopped for one request of `task` with `model` (None: its default)."""
        key = (task, model)

        def on_stuck() -> None:
            with self._lock:
                self._threads[key] = self._threads.get(key, 0) + 1
            self.registry.record_request_failure(
                task, f"a request still ran {STUCK_AFTER_S:g} s after it was cut off (a loop that catches "
                "BaseException, or a call that never returns); the task takes no requests until it ends",
                stage="time limit")

        def on_stopped() -> None:
            with self._lock:
                if self._threads.get(key, 0) > 1:
                    self._threads[key] -= 1
                else:
                    self._threads.pop(key, None)

        return {"on_stuck": on_stuck, "on_stopped": on_stopped}


# What an explanation cut off at the time limit says: trying again cannot help, less work can.
EXPLAIN_CUT_OFF = ("an explanation runs a forward and a backward pass per step: use fewer steps, gradient_x_input "
                   "(one pass), or a shorter input")


def guarded(predict, task: str, registry: Registry, timeout_s: float | None, in_flight: InFlight | None = None,
            stuck: StuckTasks | None = None, cut_off_hint: str | None = None,
            model_of: Callable[[], str | None] | None = None):
    """`predict` with a time limit (cut off and cancelled, see bert_engine.runtime.cancel), and a task's own
    failures turned into a clear message in the UI (recorded for the Plugins tab) instead of a stack
    trace; bad input stays the task's InputError. Contains every BaseException a task can raise
    (SystemExit, KeyboardInterrupt, a native library's panic): the server keeps answering. A task with a
    request that would not stop after its cut-off (`stuck`) is refused until that request ends."""
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    in_flight = in_flight or InFlight()
    stuck = stuck or StuckTasks(registry)
    torch_settings = TorchSettings()  # the process-wide ones a task's code could change for everyone

    def predict_and_put_back(*args, **kwargs):
        torch_settings.start()  # this thread's count as the app set it (a new thread takes the last one set anywhere)
        try:
            return predict(*args, **kwargs)
        finally:  # in the request's own thread: torch's thread count is read per thread
            torch_settings.restore(task, registry)

    def call(*args, **kwargs):
        visitor, group = current_visitor(), current_group()
        model = None
        if model_of is not None:
            with visitor_scope(visitor, group), contextlib.suppress(Exception):  # the visitor's pick in this task
                model = model_of()
        if stuck.holds(task, model):
            registered = registry.tasks.get(task)
            plugin = registered.plugin if registered else task
            if model is not None and not stuck.holds(task, None):  # that model alone: another may be picked
                raise shown_error(gr, public_message(
                    f"{task} with the model you picked is off for now: one of its requests still runs after it was "
                    f"cut off (a bug in plugin {plugin}, or in that model's files); pick another model, or try again "
                    "later. Other models and tasks are not affected."))
            raise shown_error(gr, public_message(
                f"{task} is off for now: one of its requests still runs after it was cut off; this is a bug in "
                f"plugin {plugin}, not in your input. Other tasks are not affected."))
        waited = Waited()
        token = WAITED.set(waited)  # the request's thread adds its time at the compute gate
        try:
            # beyond its in-flight cap a request waits (idle) up to its time limit for a place: fairness.py
            with in_flight.admit(visitor, group, wait_s=timeout_s or DEFAULT_TIMEOUT_S), \
                    visitor_scope(visitor, group), \
                    download_deadline(timeout_s):  # its share of the gate (fairness.py); a model it loads, in time
                return call_with_timeout(predict_and_put_back, timeout_s, *args, what=f"task {task!r}",
                                         **stuck.callbacks(task, model),
                                         **kwargs)
        except (InputError, gr.Error):
            raise
        except TooManyRequests as err:
            message = str(err)
        except RequestCancelled:  # its sender cancelled it or left: stopped, and nobody reads the answer
            logger.info("task %s: a request was cancelled by its sender and stopped", task)
            message = f"{task}: the request was cancelled"
        except (HubError, CheckpointError) as err:  # the model could not be loaded: say which and why
            message = f"{task}: the model could not be loaded: {err}"
        except PredictionTimeout as err:
            # The machine's fault when the request spent a good part of its time waiting at the compute gate
            # for other requests' work: it says "busy" and marks nothing failing. Otherwise the time was its
            # own code's (a hang, a loop), whoever else came by meanwhile: the task's recorded failure.
            busy = bool(timeout_s) and waited.seconds >= timeout_s * BUSY_WAITING_SHARE
            if busy:
                logger.info("task %s: a request was cut off at %g s while the machine was busy (%d others "
                            "running, %.0f s waiting at the gate)", task, timeout_s, in_flight.total(), waited.seconds)
                message = (f"{task}: the machine is busy with other requests and this one did not finish within "
                           f"the {timeout_s:g} s limit ({waited.seconds:.0f} s spent waiting); "
                           + (f"{cut_off_hint}." if cut_off_hint else "try again in a moment, or send a shorter input."))
            elif cut_off_hint:  # most likely the request's own size (many steps over a long input), not a failure
                logger.info("task %s: a request was cut off at %g s (%s)", task, timeout_s, cut_off_hint)
                message = f"{err}: {cut_off_hint}."
            else:
                registry.record_exception(task, err)
                message = f"{err}. The task may be stuck or the machine overloaded; try again later."
        except BaseException as err:  # a bug in a task's code: the app and the other tabs carry on
            message = _task_failure(task, registry, err)
        finally:
            WAITED.reset(token)
            if in_flight.total() == 0:  # nobody else running: hand the freed memory back (serving/memory.py)
                memory.trim(background=True)
        # Raised here, outside the except blocks, so the error carries no __context__: the failed call's
        # frames (and whatever memory they hold, e.g. after a MemoryError) are freed now.
        raise shown_error(gr, public_message(message))

    return call


def _task_failure(task: str, registry: Registry, err: BaseException) -> str:
    failure = registry.record_exception(task, err)  # logs one warning line with the stage
    if not isinstance(err, MemoryError):  # the traceback, for the operator; err itself is not kept in a record
        logger.error("task %s failed at %s", task, failure.stage, exc_info=(type(err), err, err.__traceback__))
    if isinstance(err, MemoryError):
        return f"{task} ran out of memory on this input; try a shorter one. Other tasks are not affected."
    return (f"{task} failed in {failure.stage} ({failure.message}); this is a bug in plugin {failure.plugin}, "
            "not in your input. Other tasks are not affected.")


def gpu_seconds(inputs: Any, loaded: bool = True, limit_s: float | None = DEFAULT_TIMEOUT_S) -> int:
    """The GPU time to ask ZeroGPU for, from the input's size: 5 s, plus 1 s per 4,000 characters
    (about a thousand tokens: a few windows), plus 30 s when the model still has to load; at most the
    request's time limit. Short requests ask for little, so they wait less in ZeroGPU's queue."""
    texts = inputs.values() if isinstance(inputs, dict) else [inputs]
    characters = sum(len(text) for text in texts if isinstance(text, str))
    seconds = 5 + math.ceil(characters / 4000) + (0 if loaded else 30)
    return int(min(seconds, limit_s)) if limit_s else seconds


def on_gpu(function, predictor: LazyPredictor | None = None, limit_s: float | None = DEFAULT_TIMEOUT_S):
    """On a ZeroGPU Space (the `spaces` package, SPACES_ZERO_GPU=true) a prediction runs inside
    `spaces.GPU` with a duration derived from its input (gpu_seconds); elsewhere spaces.GPU returns the
    function as it is. Nothing here touches CUDA: the GPU is attached only inside the call."""
    try:
        import spaces  # noqa: PLC0415 - only where the spaces package is installed
    except ImportError:
        return function

    def duration(inputs: Any = None, *args: Any, **options: Any) -> int:
        return gpu_seconds(inputs, predictor.loaded if predictor is not None else True, limit_s)

    return spaces.GPU(function, duration=duration)


def model_lines(predictors: dict[str, LazyPredictor], statuses: dict[str, Any]) -> list[str]:
    """The model line of every task tab, as the current visitor sees it."""
    with visitor_scope(current_visitor()):
        return [describe(predictors[name]) for name in statuses]


def model_line(predictor: LazyPredictor) -> str:
    with visitor_scope(current_visitor()):
        return describe(predictor)


def describe(predictor: LazyPredictor) -> str:
    """One discreet line: which model the tab uses, and where it runs once loaded."""
    name = predictor.checkpoint or predictor.task.spec.default_checkpoint
    name = shown_model_name(name) if name else "the default backbone (MiniLM)"
    if not predictor.loaded:
        return f"Model: `{name}` (loads on first use)"
    info = predictor.get().provenance()
    head = " · **head not trained**" if info["untrained_head"] else ""
    family = FAMILY_NAMES.get(info["family"], info["family"])
    return f"Model: `{info['model']}` · {family} · {info['device']} · {info['dtype']}{head}"


def allowed_model_dirs() -> list[Path]:
    """Folders the model picker may load local checkpoints from: the starter pack, ./models and ./runs,
    plus those in BERT_ENGINE_MODEL_DIRS (separated by the OS path separator)."""
    extra = [Path(p) for p in settings.get("BERT_ENGINE_MODEL_DIRS")]
    return [STARTER_ROOT, Path.cwd() / "models", Path.cwd() / "runs", *extra]


def model_dir_problems() -> list[str]:
    """What is wrong with each folder BERT_ENGINE_MODEL_DIRS names (one that is missing or not a folder)."""
    problems = []
    for given in settings.get("BERT_ENGINE_MODEL_DIRS"):
        path = Path(given)
        if not path.is_dir():
            why = "is not a folder" if path.exists() else "does not exist"
            problems.append(f"BERT_ENGINE_MODEL_DIRS names {given!r}, which {why}: no model there is listed or loaded")
    return problems


def find_checkpoints(allowed: list[Path], task: str | None = None, depth: int = 3) -> dict[str, str]:
    """The model folders (config.json plus weights or an adapter) in the allowed folders, up to `depth`
    levels down, as {short name shown to visitors: path}; a run's last/ (the resume state) is left out,
    and so is a folder recorded as trained for a task other than `task`."""
    found: dict[str, str] = {}
    for root in allowed:
        root = Path(root)
        if not root.is_dir():
            continue
        for config in sorted(p for level in range(depth + 1) for p in root.glob("*/" * level + "config.json")):
            folder = config.parent
            if folder.name == "last" or not any((folder / f).is_file() for f in WEIGHT_FILES + (ADAPTER_WEIGHTS,)):
                continue
            if not inside_any(folder, allowed):  # a link out of the allowed folders: listed, it could not load
                continue
            if task is not None and recorded_task(folder) not in (None, task):
                continue
            name = short_path(folder) if folder.resolve().is_relative_to(Path.cwd().resolve()) else \
                "/".join(folder.parts[-2:])
            found.setdefault(name, str(folder))
    return dict(sorted(found.items()))


def model_choices(known: dict[str, str], default: str | None) -> list[tuple[str, str]]:
    """A model picker's entries: the task's default first, then the folders found, less the default's own folder
    (listed twice, it read as two models); typing its name still loads it."""
    def same(folder: str) -> bool:
        try:
            return default is not None and Path(folder).resolve() == Path(default).resolve()
        except (OSError, RuntimeError):
            return False

    return [("default (the task's starter model)", ""),
            *[(f"{k} · {family_label(v)}", k) for k, v in known.items() if not same(v)]]


FAMILY_NAMES = {"bert": "BERT", "roberta": "RoBERTa", "albert": "ALBERT", "distilbert": "DistilBERT"}


def family_label(folder: str | Path) -> str:
    """The family a model folder's config.json declares, as people write it ("RoBERTa"); "?" if unreadable."""
    try:
        data = read_json(Path(folder), "config.json")  # inside the folder, capped, a regular file (not a FIFO)
    except (OSError, ValueError):  # CheckpointError is a ValueError
        return "?"
    family = data.get("model_type", "bert") if isinstance(data, dict) else "?"
    return FAMILY_NAMES.get(family, str(family)[:20])


MAX_MODEL_CHOICE = 1024  # characters: a long path or Hub id fits; a file name longer than the OS takes does not


def check_model_choice(value: str, allowed: list[Path], known: dict[str, str] | None = None) -> str | None:
    """What a user typed or picked in the model picker -> the checkpoint to load (None: the task's default).

    A listed name (find_checkpoints) is its folder. A local path (absolute, ~, ./, .., an existing
    path, or one that starts with an allowed folder's name, like runs/...) must resolve, symlinks
    followed, inside one of `allowed`, and exist; anything else is a Hub id, whose form the Hub client
    checks. A mistyped local path is therefore "not found here", never a Hub request.

    Raises:
        InputError: a local path outside the allowed folders (nothing outside them is touched), or
            one that does not exist.
    """
    if not isinstance(value, str):
        raise InputError(f"the model must be a name, a folder or a Hub id, got {type(value).__name__}")
    value = value.strip()
    if not value:
        return None
    if known and value in known:
        value = known[value]
    if len(value) > MAX_MODEL_CHOICE:  # no folder or Hub id is this long; and the message must not echo it all
        raise InputError(f"the model name {value[:60]!r}... has {len(value):,} characters; a folder or a Hub id "
                         f"has at most {MAX_MODEL_CHOICE}")
    if not value.isprintable():  # a NUL byte is no path (the OS refuses it), control characters no Hub id
        raise InputError(f"the model name {value[:80]!r} holds control characters")
    try:
        return _checked_choice(value, allowed)
    except OSError as err:  # a name part longer than the file system takes (ENAMETOOLONG), a loop of links
        raise InputError(f"there is no model folder {value[:200]!r} here ({err.strerror or err})") from None


def _checked_choice(value: str, allowed: list[Path]) -> str:
    if re.match(r"^[a-z][a-z0-9+.-]*://", value, re.IGNORECASE):  # a web address: neither a folder nor a Hub id
        hub = re.match(r"^https?://(?:www\.)?huggingface\.co/([^/?#]+(?:/[^/?#]+)?)/?$", value, re.IGNORECASE)
        hint = f"; for this one, {hub.group(1)!r}" if hub else ""
        raise InputError(f"{value[:200]!r} is a web address; give a Hub id such as owner/name{hint}, or a listed model")
    # Local by its form, or by naming an allowed folder's first part (runs/..., plugins/starter/...); whether a
    # path exists on the server is not asked: "README.md" and "nothing.txt" answer alike (one was "outside the
    # folders", the other a Hub error: which names exist in the working folder could be read off them)
    first = value.replace("\\", "/").split("/")[0]
    local = looks_local(value, probe=False) or first in _first_parts(allowed)
    if not local:
        return value
    if not inside_any(value, allowed):
        raise InputError(f"the local folder {value[:200]!r} is outside the folders models may be loaded from "
                         f"({', '.join(short_path(root) for root in allowed)}); a Hub id has the form owner/name (the "
                         "server's operator can allow another folder with BERT_ENGINE_MODEL_DIRS)")
    resolved, cwd = Path(value).expanduser().resolve(), Path.cwd().resolve()
    if not resolved.is_dir():
        raise InputError(f"there is no model folder {value[:200]!r} here; pick one from the list, or give a Hub id "
                         "such as owner/name")
    # relative to the working folder where possible, so provenance does not show the server's folders
    return str(resolved.relative_to(cwd)) if resolved.is_relative_to(cwd) else str(resolved)


def _first_parts(allowed: list[Path]) -> set[str]:
    """The first part of each allowed folder as a visitor types it: relative to the working folder where it lies
    inside it ("plugins" for plugins/starter), else its own name."""
    cwd, parts = Path.cwd().resolve(), set()
    for root in allowed:
        root = Path(root).expanduser().resolve()
        parts.add(root.relative_to(cwd).parts[0] if root.is_relative_to(cwd) and root != cwd else root.name)
    return parts


def short_path(path: Path | str) -> str:
    """A path as users may see it: relative to the working folder when inside it, else its last two parts."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return "/".join(path.parts[-2:])


def shown_model_name(name: str) -> str:
    """A checkpoint's name as visitors see it (provenance, the model line): a Hub id as is, a local
    folder without the server's folders (see short_path)."""
    return short_path(name) if Path(name).is_absolute() or looks_local(name) else name


def checked_precision(value: Any, precisions: list[str]) -> str:
    """A visitor's precision for a second model: one this machine runs (an API caller can send anything)."""
    if not isinstance(value, str) or value.strip() not in precisions:
        raise InputError(f"precision {str(value)[:20]!r} is not one this machine runs; choose one of "
                         f"{', '.join(precisions)}")
    return value.strip()


@contextlib.contextmanager
def visitor_message():
    """InputErrors raised inside, with the server's folders taken out of their message (public_message)."""
    try:
        yield
    except InputError as err:
        raise InputError(public_message(str(err))) from None


def public_message(message: str) -> str:
    """An error message with the server's folders taken out (they tell a visitor nothing they need): the
    working folder, the home folder and the Hub cache (HF_HOME / HF_HUB_CACHE may lie anywhere)."""
    from huggingface_hub import constants as hub_constants  # noqa: PLC0415 - read at call time (tests move it)

    folders = {str(Path.cwd().resolve()), str(Path.home()), str(Path(hub_constants.HF_HUB_CACHE).resolve())}
    for folder in sorted(folders, key=len, reverse=True):
        message = message.replace(folder + os.sep, "").replace(folder, ".")
    return message


def _build_model_picker(gr, name: str, predictor: LazyPredictor, model_dirs: list[Path],
                        loading=contextlib.nullcontext):
    """The tab's model accordion: a list of the checkpoints found in the allowed folders, or any Hub id
    or allowed folder typed in. The choice is the visitor's own (LazyPredictor.switch), loaded inside
    `loading()` (the visitor's in-flight cap, a download deadline); returns the status line, which the
    app refreshes when a visitor opens the page or the tab."""
    known = find_checkpoints(model_dirs, name)
    with gr.Accordion("Model", open=False):
        with gr.Row():
            choice = gr.Dropdown(choices=model_choices(known, predictor.default or predictor.task.spec.default_checkpoint),
                                 value="", allow_custom_value=True, show_label=False, scale=4,
                                 info="a listed model, or a Hub id such as owner/name", filterable=True)
            load = gr.Button("Load", scale=1)
        status = gr.Markdown(describe(predictor), label="Model status")

    def switch(model: str | None) -> str:
        value = (model or "").strip()
        try:
            if one_call(current_visitor()):  # its choice would last this call alone
                raise InputError("choosing a model needs a session (a browser tab, or gradio_client's Client), which "
                                 "keeps the choice for its later requests; this call has none")
            checkpoint = check_model_choice(value, model_dirs, find_checkpoints(model_dirs, name))
            with visitor_scope(current_visitor()), loading():  # this visitor's model; the others keep theirs
                predictor.switch(checkpoint)
                return describe(predictor)
        except (InputError, TooManyRequests, RequestCancelled) as err:  # (cancelled: its sender left the line)
            message = public_message(str(err))  # (a listed folder's refusal named its whole path on the server)
        except (HubError, CheckpointError, ValueError, OSError) as err:
            message = f"could not load {value or 'the default'}: {public_message(str(err))}"
        # the toast renders HTML: what the visitor typed is shown as text (quotes need no escaping there, and an API
        # caller read them as &#x27;)
        raise shown_error(gr, html.escape(message, quote=False))

    # per browser session; not a documented endpoint (nor an MCP tool, whose calls share one session)
    load.click(with_request(gr, switch), choice, status, api_name=f"{name}_model", api_visibility="undocumented")
    return status


def _build_task_tab(gr, task, predictor: LazyPredictor, registry: Registry, wrap, publish, *,
                    stray: list[str] = ()) -> None:
    """The task's tab, or where its tab would take `stray` endpoints (stray_endpoints), a note saying so."""
    if task.spec.build_tab is None:
        gr.Markdown(f"Task `{task.spec.name}` has no tab; use it through the Python API.")
        return
    if stray:  # found on a scratch build: Gradio would give the host's endpoint of that name a "_1"
        registry.record_failure(PluginFailure(task.plugin, task.plugin_version, "tab", (
            f"task {task.spec.name}: its tab wires API endpoints {stray}, names the playground or another task "
            f"serves; the tab is left out (use ui.wire with api_name={task.spec.name!r}, and "
            "api_visibility='private' for other events)")))
        gr.Markdown(f"**The tab of `{task.spec.name}` (plugin {task.plugin} {task.plugin_version}) is left out:** "
                    f"it would take the endpoints {html.escape(', '.join(stray))}.")
        return

    def named_wrap(fn, api_name):
        return wrap(tab_failures_named(gr, fn, task.spec.name, registry), api_name)

    def named_publish(fn, inputs, api_name, description=""):
        return publish(tab_failures_named(gr, fn, task.spec.name, registry), inputs, api_name, description)

    try:
        with ui.wiring(named_wrap, task.spec.description, publish=named_publish if publish else None):
            task.spec.build_tab(predictor)
    except Exception as err:  # a stranger's tab must not take the app down
        registry.record_failure(PluginFailure(task.plugin, task.plugin_version, "tab",
                                              f"task {task.spec.name}: {type(err).__name__}: {err}",
                                              location=failure_location(err)))
        gr.Markdown(f"**The tab of `{task.spec.name}` (plugin {task.plugin} {task.plugin_version}) "
                    f"failed to build:** `{html.escape(str(err))}`")


def stray_endpoints(gr, task, predictor, registry: Registry) -> list[str]:
    """The API endpoints a task's tab would add under a name the host or another task serves (/plugins,
    /explain, /<task>_why, /ner, ...), read from a scratch build of the tab (Gradio's public API description,
    as the conformance kit reads it). [] when the scratch build fails: the real build records that."""
    if task.spec.build_tab is None:
        return []
    own = {task.spec.name, f"{task.spec.name}_view"}
    taken = HOST_ENDPOINTS | {n for t in registry.tasks.values() for n in (t.spec.name, *t.spec.aliases)}
    try:
        with gr.Blocks() as scratch, ui.wiring(lambda function, api_name: function):
            task.spec.build_tab(predictor)
        names = [name.lstrip("/") for name in scratch.get_api_info()["named_endpoints"]]
    except Exception:  # noqa: BLE001 - a tab that fails to build is recorded by the real build
        return []
    return sorted(n for n in names if n not in own and (n in taken or is_host_endpoint(n)))


def _build_insight(gr, task, predictor: ServedPredictor, model_dirs: list[Path], precisions: list[str]) -> None:
    """Under a task's tab: "Why this answer?" (token attributions of the visitor's last answer, for a task
    that declares `explain`) and "Compare with another model" (the last input through a second model)."""
    name = task.spec.name
    if task.spec.explain is not None:
        with gr.Accordion("Why this answer?", open=False):
            with gr.Row():
                method = gr.Radio([("Integrated Gradients (adds up, slower)", "integrated_gradients"),
                                   ("gradient × input (fast)", "gradient_x_input")], value="integrated_gradients",
                                  label="Method", scale=2)
                steps = gr.Slider(4, 128, value=DEFAULT_STEPS, step=4, label="Steps (Integrated Gradients)", scale=1)
            why_button = gr.Button("Explain my last answer", elem_classes=["be-why-run"])
            why_out = gr.HTML(ui.empty_state("Which words raised or lowered your last answer's scores appears here."),
                              label="Why this answer", elem_classes=["be-why-out"])

        def why(method_value: str, steps_value: float):
            with visitor_scope(current_visitor(), current_group()):
                explained, inputs = predictor.explain(method=method_value, steps=int(steps_value))
            return insight.why_html(explained, inputs)

        # "your last answer" is a browser session's: not documented, not an MCP tool (see /explain for those)
        why_button.click(with_request(gr, input_errors_shown(gr, why)), [method, steps], why_out,
                         api_name=f"{name}_why", api_visibility="undocumented")
    with gr.Accordion("Compare with another model", open=False):
        known = find_checkpoints(model_dirs, name)
        with gr.Row():
            other = gr.Dropdown(choices=model_choices(known, task.spec.default_checkpoint),
                                value="", allow_custom_value=True, label="Model B", filterable=True, scale=3,
                                info="a listed model, or a Hub id; A is this tab's model")
            precision = gr.Radio(precisions, value="int8" if "int8" in precisions else precisions[0],
                                 label="Precision of B", scale=2)
        compare_button = gr.Button("Compare on my last input", elem_classes=["be-compare-run"])
        compare_out = gr.HTML(ui.empty_state("Both models' answers side by side, and where they disagree, appear here."),
                              label="Comparison", elem_classes=["be-compare-out"])

    def compare(model_value: str | None, precision_value: str):
        with visitor_scope(current_visitor(), current_group()), visitor_message():
            checkpoint = check_model_choice(model_value or "", model_dirs, find_checkpoints(model_dirs, name))
            compared, _ = predictor.compare(other=(checkpoint, checked_precision(precision_value, precisions)))
        return insight.compare_html(compared)

    compare_button.click(with_request(gr, input_errors_shown(gr, compare)), [other, precision], compare_out,
                         api_name=f"{name}_compare", api_visibility="undocumented")


def _parse_inputs(task, inputs: str | dict) -> dict[str, Any]:
    """An API caller's inputs: a JSON object keyed by the task's input fields; for a task of one text field,
    text that is not a JSON object is that text (`"a fine film"` for sentiment, as its own endpoint takes it)."""
    one_field = len(task.spec.input_fields) == 1
    if isinstance(inputs, str):
        try:
            parsed = json.loads(inputs)
        except ValueError:
            if one_field:
                return {task.spec.input_fields[0]: inputs}
            raise InputError(f"{task.spec.name}: inputs must be a JSON object such as "
                             f"{json.dumps({f: '...' for f in task.spec.input_fields})}, not plain text "
                             f"(starting {inputs[:40]!r})") from None
        except RecursionError:  # "[[[[..." a hundred thousand deep: the parser's own limit, as the CLI says
            raise InputError(f"{task.spec.name}: inputs are JSON nested too deeply to be an input; send an object "
                             f"keyed by {', '.join(task.spec.input_fields)}") from None
        inputs = {task.spec.input_fields[0]: inputs} if one_field and isinstance(parsed, str) else parsed
    if not isinstance(inputs, dict):
        raise InputError(f"{task.spec.name}: inputs must be a JSON object keyed by "
                         f"{', '.join(task.spec.input_fields)}, got {type(inputs).__name__}")
    fields = task.spec.input_fields + task.spec.optional_fields
    unknown = sorted(str(k) for k in set(inputs) - set(fields))
    if unknown:  # (as `predict --file` refuses them: a misspelt field is not silently an empty one)
        raise InputError(f"{task.spec.name}: unknown field(s) {', '.join(unknown)[:200]}; the task's: {', '.join(fields)}")
    return inputs


def _build_insight_api(gr, registry: Registry, predictors: dict[str, ServedPredictor], endpoints: dict[str, Any],
                       model_dirs: list[Path], precisions: list[str]) -> None:
    """The API endpoints and MCP tools `explain` and `compare`: any task, inputs given in the call (the
    tabs' buttons use the visitor's last input instead). Their components are not shown."""
    names = [n for n, t in registry.tasks.items() if t.spec.explain is not None]
    # "" or a missing precision means these, in the schema and in the call alike
    default_b = "int8" if "int8" in precisions else precisions[0]
    default_a = "fp32" if "fp32" in precisions else precisions[0]

    def task_of(task: str):
        if task not in predictors:
            raise InputError(f"there is no task {task!r}; tasks: {', '.join(predictors)}")
        return registry.tasks[task]

    def explain(task: str, inputs: str, method: str = "integrated_gradients", steps: float = DEFAULT_STEPS):
        """Explain a task's answer: how much each token of the input raised or lowered each of the answer's
        scores (Integrated Gradients over the word embeddings, from a blank text; or gradient x input).

        Args:
            task: the task: TASKS.
            inputs: the task's inputs as a JSON object, e.g. {"text": "..."} or {"question": "...", "context": "..."};
                for a task of one text field, the text itself.
            method: "integrated_gradients" (the attributions add up to the score's change) or "gradient_x_input" (fast).
            steps: Integrated Gradients' steps, 1 to MAX_STEPS (more: closer sums, slower).
        """
        spec = task_of(task)
        if spec.spec.explain is None:
            raise InputError(f"{task}: this task does not say what to explain; tasks that do: {', '.join(names)}")
        checked_method(task, method, steps)  # before the inputs: a bad JSON must not hide a bad method
        with visitor_scope(current_visitor(), current_group()):  # explain() reads a whole float as its integer
            explained, _ = predictors[task].explain(_parse_inputs(spec, inputs), method=method, steps=steps)
        return json.dumps(explained, ensure_ascii=False)  # JSON text: what an MCP client reads

    explain.__doc__ = explain.__doc__.replace("TASKS", ", ".join(names)).replace("MAX_STEPS", str(MAX_STEPS))

    def compare(task: str, inputs: str, model_b: str = "", precision_b: str = "int8", model_a: str = "",
                precision_a: str = "fp32"):
        """Run one input through two models of a task and say where their answers disagree (labels, words,
        answers) and how far their scores differ.

        Args:
            task: the task, e.g. sentiment, ner, qa, fill_mask.
            inputs: the task's inputs as a JSON object, e.g. {"text": "..."}; for a task of one text field, the
                text itself.
            model_b: the second model: a listed model, an allowed folder or a Hub id ("": the task's default).
            precision_b: its precision: fp32, int8 (CPU), bf16 or fp16 where the machine runs them.
            model_a: the first model ("": the task's default).
            precision_a: its precision.
        """
        spec = task_of(task)
        with visitor_scope(current_visitor(), current_group()), visitor_message():
            known = find_checkpoints(model_dirs, task)
            a = (check_model_choice(model_a or "", model_dirs, known), checked_precision(precision_a or default_a, precisions))
            b = (check_model_choice(model_b or "", model_dirs, known), checked_precision(precision_b or default_b, precisions))
            compared, _ = predictors[task].compare(_parse_inputs(spec, inputs), this=a, other=b)
        return json.dumps(compared, ensure_ascii=False)

    with gr.Group(visible=False):
        task = gr.Textbox(label="task")
        inputs = gr.Textbox(label="inputs")
        method = gr.Textbox(label="method", value="integrated_gradients")
        steps = gr.Number(label="steps", value=DEFAULT_STEPS)
        # with their defaults, so the API and MCP schemas list them as optional ("": the task's default model)
        models = [gr.Textbox(label=label, value=value) for label, value in
                  (("model_b", ""), ("precision_b", default_b), ("model_a", ""), ("precision_a", default_a))]
        result = gr.Textbox(label="result (JSON)")
        explain_button, compare_button = gr.Button("explain"), gr.Button("compare")
    explain_button.click(host_handler(gr, endpoints, explain, "explain"), [task, inputs, method, steps], result,
                         api_name="explain")
    compare_button.click(host_handler(gr, endpoints, compare, "compare"), [task, inputs, *models], result,
                         api_name="compare")


def shown_error(gr, message: str):
    """The UI's error message for a visitor, logged as one INFO line: Gradio would print a traceback
    to the console for every refused input (the failures of a task's code are logged where caught)."""
    logger.info("answered with an error: %s", message)
    return gr.Error(message, print_exception=False)


def tab_failures_named(gr, function, task: str, registry: Registry):
    """`function` (a task's tab handler) with an exception of its own code (not the task's InputError, nor a
    message the app already shows) recorded for the Plugins tab at stage "tab handler" and shown in one line that
    names the plugin: a tab's formatting of an answer is the plugin's code as much as its hooks are.
    Generators and coroutines are left as they are."""
    if function is None or inspect.isgeneratorfunction(function) or inspect.iscoroutinefunction(function):
        return function

    @functools.wraps(function)
    def named(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (InputError, gr.Error):
            raise
        except Exception as err:  # noqa: BLE001 - a plugin's tab code: contained, recorded, named
            failure = registry.record_request_failure(task, f"{type(err).__name__}: {err}"[:300], stage="tab handler",
                                                      location=failure_location(err))
            message = (f"{task}: its tab failed ({type(err).__name__}: {str(err)[:200]}); this is a bug in plugin "
                       f"{failure.plugin}, not in your input")
        raise shown_error(gr, html.escape(public_message(message), quote=False))

    return named


def input_errors_shown(gr, function):
    """`function` (a tab's event handler) with the task's InputError shown as the UI's error message
    (Gradio's gr.Error, its text escaped): tabs need not catch it themselves. Generators and
    coroutines are left as they are."""
    if function is None or inspect.isgeneratorfunction(function) or inspect.iscoroutinefunction(function):
        return function

    @functools.wraps(function)
    def shown(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except InputError as err:
            message = html.escape(str(err), quote=False)  # the toast renders HTML; quotes stay readable
        raise shown_error(gr, message)  # outside the except block: no __context__ keeping the call's frames

    return shown


def single_text_tasks(registry: Registry) -> list[str]:
    """The tasks whose only required input is one text (`input_fields` ("text",), other fields optional)."""
    return [name for name, task in registry.tasks.items()
            if [f for f in task.spec.input_fields if f not in task.spec.optional_fields] == ["text"]]


def brief_answer(task, result: Any) -> str:
    """The task's one-line answer (TaskSpec.brief), or its result's JSON cut to 200 characters."""
    if task.spec.brief is not None:
        try:
            return str(task.spec.brief(result))
        except Exception as err:  # a plugin's bug: noted for the Plugins tab, the JSON is shown instead
            logger.warning("task %s: brief failed: %s: %s", task.spec.name, type(err).__name__, err)
    text = json.dumps(result, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:199] + "…"


ALL_TASKS_EXAMPLES = (
    "Tim Cook said the new Apple office in Berlin is a [MASK] place to work, and the staff love it.",
    "The film was a [MASK] disappointment. The plot drags, and not even Meryl Streep can save the script.",
)


def _build_all_tasks_tab(gr, registry: Registry, predictors: dict[str, LazyPredictor], timeout_s: float | None):
    """One text through every single-text task, each answer on its own card, side by side. A task that
    refuses the text (fill-mask without [MASK]) says why on its card; the others still answer. Tasks
    run one after the other within one time limit: those not started by then are skipped, saying so."""
    names = single_text_tasks(registry)
    gr.Markdown("One text, every task that takes a single text: " +
                ", ".join(registry.tasks[n].spec.title for n in names) + ". Add `[MASK]` for fill-mask.")
    text_box = gr.Textbox(label="Text", lines=3, placeholder="Type a sentence; put [MASK] where a word is missing")
    button = ui.run_button(gr, "Run every task")
    cards = gr.HTML(label="Answers")
    details = ui.details(gr)

    def all_tasks(text: str):
        """Run one text through every task that takes a single text; each task's answer in a line, and each task's
        result (or, where it refused the text or was not reached in time, its "error" or "skipped" message).

        Args:
            text: the text (add [MASK] where a word is missing, for fill-mask)
        """
        if not (text or "").strip():
            raise shown_error(gr, "all tasks: the text is empty; type a sentence")
        deadline = time.monotonic() + timeout_s if timeout_s else None
        answers: list[tuple[str, str, str]] = []  # (task title, line, state)
        outputs: dict[str, Any] = {}
        for name in names:
            title = registry.tasks[name].spec.title
            if deadline is not None and time.monotonic() > deadline:
                why = f"skipped: the {timeout_s:g} s limit for all tasks was reached"
                answers.append((title, why, "skipped"))
                outputs[name] = {"task": name, "skipped": why}  # (the API and MCP see every task, as the cards do)
                continue
            try:
                output = predictors[name].predict({"text": text})
            except (InputError, gr.Error) as err:  # the task's own message (bad input, time-out, a bug)
                why = getattr(err, "message", None) or str(err)
                answers.append((title, why, "error"))
                outputs[name] = {"task": name, "error": why}
                continue
            outputs[name] = output
            answers.append((title, brief_answer(registry.tasks[name], output["result"]), "ok"))
        return answer_cards(answers), outputs

    ui.wire(gr, button, all_tasks, [text_box], [cards, details], api_name="all_tasks",
            examples=[[example] for example in ALL_TASKS_EXAMPLES])


def answer_cards(answers: list[tuple[str, str, str]]) -> str:
    """Cards side by side (stacked on a phone): the task's title over its answer, escaped."""
    cards = "".join(f'<div class="be-card be-card-{state}"><div class="be-card-title">{html.escape(title)}</div>'
                    f'<div class="be-card-answer">{html.escape(line)}</div></div>' for title, line, state in answers)
    return f'<div class="be-cards">{cards}</div>'


def plugin_rows(registry: Registry) -> list[list[str]]:
    """The Plugins table: loaded plugins first, then failures with their stage and reason."""
    failed_tabs = {f.plugin for f in registry.failures if f.stage == "tab"}
    rows = [[p.name, p.version, p.source, ", ".join(p.tasks), "tab failed" if p.name in failed_tabs else "loaded", ""]
            for p in registry.plugins]
    for f in registry.failures:
        status = f"failing at request time ({f.stage})" if f.stage in REQUEST_STAGES else f"failed at {f.stage}"
        reason = f.message + (f" [{f.location}]" if f.location else "")
        rows.append([f.plugin, f.version, f.source, "", status, reason])
    return rows


def _build_plugins_tab(gr, registry: Registry, endpoints: dict[str, Any]):
    gr.Markdown("Task plugins: the built-ins and installed packages (entry-point group `bert_engine`). "
                "A plugin that failed to load is listed with its reason, as is a task whose code failed or "
                "hung while answering a request; the others work.")
    table = gr.Dataframe(value=plugin_rows(registry), headers=list(PLUGIN_COLUMNS),
                         interactive=False, wrap=True, label="Plugins", show_label=False)
    refresh = gr.Button("Refresh", size="sm")
    refresh.click(lambda: plugin_rows(registry), None, table, api_visibility="private")

    def plugins() -> str:
        """The task plugins, as JSON text: a list of {plugin, version, source, tasks, status, reason} (loaded
        ones, then failures with their stage and reason)."""
        return json.dumps([dict(zip(PLUGIN_COLUMNS, row)) for row in plugin_rows(registry)], ensure_ascii=False)

    with gr.Group(visible=False):  # the API endpoint and MCP tool: JSON text, as every other tool answers
        listed, ask = gr.Textbox(label="plugins (JSON)"), gr.Button("plugins")
    ask.click(plugins, None, listed, api_name="plugins")  # no visitor state: served as it is
    endpoints["plugins"] = plugins
    return table


PLUGIN_COLUMNS = ("plugin", "version", "source", "tasks", "status", "reason")


MAX_LAYER_INDEX, MAX_HEAD_INDEX = 255, 127  # the sliders' build-time bounds: config.MAX_APPLIED_LAYERS; any head count
MAX_START_TOKEN = 65_536  # runtime.inference's token limit per input


def attention_ranges(predictor: LazyPredictor) -> tuple[int, int]:
    """(layers, heads) of the visitor's model for `predictor`'s task (loads it if need be)."""
    config = predictor.get().model.config
    return int(config.num_hidden_layers), int(config.num_attention_heads)


def _build_attention_tab(gr, registry: Registry, predictors: dict[str, LazyPredictor], loading=contextlib.nullcontext,
                         tab: Any = None):
    """The last input of a task tab (the visitor's own): one head as a heatmap, the layer's heads as a
    grid, and each token's strongest links as text. The sliders span the model's real layers and heads.
    Each drawing runs inside `loading()` (build_app's: the visitor's in-flight place, as a task's request).
    Returns (load event function, its outputs) for the page's load event."""
    gr.Markdown("The attention of **your** last input in a task tab. Pick the tab, a layer and a head; "
                "rows are the tokens attending, columns the tokens they attend to.")
    names = list(registry.tasks)
    with gr.Row():
        task = gr.Dropdown(choices=[(registry.tasks[n].spec.title, n) for n in names],
                           value=names[0] if names else None, label="Last input of", scale=2)
        average = gr.Checkbox(value=False, label="Average the layer's heads", scale=1)
    with gr.Row():
        # Built wide (API clients never fire the page events that narrow them); render names the model's range.
        layer = gr.Slider(0, MAX_LAYER_INDEX, value=0, step=1, label="Layer")
        head = gr.Slider(0, MAX_HEAD_INDEX, value=0, step=1, label="Head")
        start = gr.Slider(0, MAX_START_TOKEN, value=0, step=8, label="From token",
                          info=f"inputs longer than {attention.MAX_TOKENS} tokens are shown a window at a time")
    show = gr.Button("Show attention", variant="primary", elem_classes=[ui.RUN_CLASS])
    caption = gr.Markdown(label="What is shown")
    with gr.Row(equal_height=False):
        heatmap = gr.Image(label="Attention (one head)", show_label=False, type="pil", format="png", interactive=False,
                           buttons=["download", "fullscreen"], scale=3, elem_classes=["attention-image"])
        grid = gr.Image(label="Every head of the layer", show_label=False, type="pil", format="png", interactive=False,
                        buttons=["download", "fullscreen"], scale=2, elem_classes=["attention-image"])
    with gr.Accordion("Strongest links of each token (text, for touch screens)", open=False):
        links = gr.HTML(label="Strongest links")

    def ranges(task_name: str | None, layer_index: Any = 0, head_index: Any = 0):
        """The sliders' real ranges for the visitor's model of that task (unchanged when it cannot load)."""
        if not task_name or task_name not in predictors:
            return gr.skip(), gr.skip()
        try:
            with visitor_scope(current_visitor()):
                layers, heads = attention_ranges(predictors[task_name])
        except Exception as err:  # the task tab says why its model does not load; here the sliders stay
            logger.info("attention tab: no ranges for %s: %s", task_name, err)
            return gr.skip(), gr.skip()
        return (gr.update(maximum=layers - 1, value=min(int(layer_index or 0), layers - 1)),
                gr.update(maximum=heads - 1, value=min(int(head_index or 0), heads - 1)))

    def render(task_name: str | None, layer_index: Any = 0, head_index: Any = 0, mean: bool = False,
               from_token: Any = 0):
        """The attention of the visitor's last input in a task tab, as a heatmap of one head or of the
        mean of a layer's heads, every head of the layer, and each token's strongest links.

        Args:
            task_name: the task tab whose last input to show (e.g. "sentiment").
            layer_index: the layer, from 0.
            head_index: the head, from 0 (ignored when mean is true).
            mean: show the mean of the layer's heads instead of one head.
            from_token: the first token shown when the input is longer than the view.
        """
        if not task_name or task_name not in predictors:
            raise shown_error(gr, f"pick a task tab first; known tabs: {', '.join(predictors)}")
        try:  # a forward pass and two pictures: within the visitor's in-flight places (60 at once ran, 2 allowed)
            with loading():
                return draw(task_name, layer_index, head_index, mean, from_token)
        except (TooManyRequests, RequestCancelled) as err:
            raise shown_error(gr, public_message(str(err))) from None

    def draw(task_name: str, layer_index: Any, head_index: Any, mean: bool, from_token: Any):
        try:
            with visitor_scope(current_visitor()):  # this visitor's own last input, never another's
                tokens, weights = predictors[task_name].attention()
        except InputError as err:
            raise shown_error(gr, str(err)) from None
        num_layers, num_heads = len(weights), weights[0].shape[0]
        for label, value in (("layer", layer_index), ("head", head_index), ("from token", from_token)):
            if not isinstance(ui.whole(value or 0), int):  # (head 2.5 showed head 2)
                raise shown_error(gr, f"{label} must be a whole number, got {value!r}")
        layer_index, head_index = int(layer_index or 0), int(head_index or 0)
        if not 0 <= layer_index < num_layers:
            raise shown_error(gr, f"layer {layer_index} does not exist; the model has layers 0..{num_layers - 1}")
        if not mean and not 0 <= head_index < num_heads:
            raise shown_error(gr, f"head {head_index} does not exist; each layer has heads 0..{num_heads - 1}")
        tokens, weights, notice = attention.cut(tokens, weights, int(from_token or 0))
        matrix = attention.head_matrix(weights, layer_index, None if mean else head_index)
        which = "the mean of its heads" if mean else f"head {head_index} of {num_heads}"
        text = (f"**{registry.tasks[task_name].spec.title}**, your last input: layer {layer_index} of {num_layers}, "
                f"{which}; {len(tokens)} tokens. Darker blue is more attention (each row sums to 100 %). " + notice)
        return (text, attention.heatmap_image(tokens, matrix), attention.head_grid_image(weights, layer_index),
                attention.strongest_links(tokens, matrix))

    def redraw(task_name: str | None, layer_index: Any = 0, head_index: Any = 0, mean: bool = False,
               from_token: Any = 0):
        """A moved slider or the average box redraws at once; before any input there is nothing to redraw."""
        try:
            return render(task_name, layer_index, head_index, mean, from_token)
        except gr.Error:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()

    served_ranges, served_redraw = with_request(gr, ranges), with_request(gr, redraw)  # who asks: current_visitor
    # another task: the picture of the one before goes (it stayed, captioned as the new one, when that had no
    # input), the sliders take the new model's ranges, and the new task's last input is drawn where there is one
    task.change(lambda: ("", None, None, ""), None, [caption, heatmap, grid, links], api_visibility="private").then(
        served_ranges, [task, layer, head], [layer, head], api_visibility="private").then(
        served_redraw, [task, layer, head, average, start], [caption, heatmap, grid, links], api_visibility="private")
    if tab is not None:
        def opened(layer_index: Any = 0, head_index: Any = 0, mean: bool = False, from_token: Any = 0):
            """Opening the tab draws the visitor's last input of the task they last ran (it stayed on its first task,
            "no input yet"; and a new input of the task shown was not drawn until a click)."""
            name = LAST_TASKS.get(current_visitor())
            if name not in predictors:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return gr.update(value=name), *redraw(name, layer_index, head_index, mean, from_token)

        tab.select(with_request(gr, opened), [layer, head, average, start], [task, caption, heatmap, grid, links],
                   api_visibility="private")
    # "your last input" means a browser session's: not documented, and not an MCP tool (MCP calls share a session)
    show.click(with_request(gr, render), [task, layer, head, average, start], [caption, heatmap, grid, links],
               api_name="attention", api_visibility="undocumented")
    for control in (layer, head, start):  # a drag's end, or a number typed in the box (Enter or leaving it)
        control.change(served_redraw, [task, layer, head, average, start], [caption, heatmap, grid, links],
                       api_visibility="private", trigger_mode="always_last")
    average.change(served_redraw, [task, layer, head, average, start], [caption, heatmap, grid, links],
                   api_visibility="private")
    return served_ranges, [task], [layer, head]
