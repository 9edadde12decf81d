"""Serving one task to many callers: load the model on first use, merge concurrent requests into one
forward pass, and (runtime/cancel.py) cut off a request that runs past its time limit.

The Predictor (runtime/inference.py) runs one model for one task; these wrap it for the playground.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import settings
from ..checkpoints.hub import HubError
from ..checkpoints.loading import CheckpointError
from ..hookspecs import InputError
from ..runtime.cancel import PredictionTimeout
from ..runtime.fairness import GATE, GROUP, VISITOR, TooManyRequests, one_call, visitor_scope
from ..runtime.inference import LastInput, Predictor, can_batch, predict_in_batches
from ..tasks.registry import RegisteredTask

logger = logging.getLogger(__name__)


class LoadBudget:
    """The model loads each address (fairness.GROUP) may cause in a minute: BERT_ENGINE_MODEL_LOADS_PER_MINUTE. A
    load (a visitor's pick, a model to compare with) costs seconds of CPU that no FLOP count and no gate turn holds:
    compare calls rotating tasks reloaded two models each time, ~3 s of CPU per call for 0.1 s of counted work, and
    other visitors' requests ran 3x slower beside them (session 58's audit). Loads outside a visitor (start-up, a
    script) are not counted; a model already in memory costs nothing."""

    WINDOW_S = 60.0
    MAX_ADDRESSES = 4096  # addresses remembered; the ones idle past the window go first

    def __init__(self) -> None:
        self._loads: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def charge(self, what: str, *, refuse: bool = True) -> None:
        """Count one load of `what` for the current address, or raise TooManyRequests (nothing counted) where it is
        over the limit and `refuse` (a reload of a model a visitor chose before, pushed out of memory by others'
        picks, is counted but never refused: the visitor asked for nothing new)."""
        group, limit = GROUP.get(), settings.get("BERT_ENGINE_MODEL_LOADS_PER_MINUTE")
        if group is None or limit <= 0:
            return
        now = time.monotonic()
        with self._lock:
            times = self._loads.setdefault(group, deque())
            while times and now - times[0] >= self.WINDOW_S:
                times.popleft()
            if len(times) >= limit and refuse:
                wait = self.WINDOW_S - (now - times[0])
                raise TooManyRequests(
                    f"{len(times)} models not in memory were loaded for your address in the last minute, the most it "
                    f"may ask for (BERT_ENGINE_MODEL_LOADS_PER_MINUTE); loading {what} can be asked again in "
                    f"{max(1, round(wait))} s, or use a model already loaded")
            times.append(now)
            if len(self._loads) > self.MAX_ADDRESSES:
                for key in [k for k, v in self._loads.items() if not v or now - v[-1] >= self.WINDOW_S]:
                    del self._loads[key]


LOADS = LoadBudget()  # one per process, as the compute gate


class LazyPredictor:
    """A Predictor that loads its model on first use (thread-safe), so an app starts without loading any,
    and lets each visitor pick their own model.

    Has Predictor's interface (`predict`, `provenance`), and serves it: every forward waits at the
    fairness gate (fairness.GATE), and each visitor's last input is kept here for the attention view
    (`last`, `attention`), never another's. `loaded` says whether the model the current visitor uses
    is in memory. A load failure (HubError, CheckpointError)
    propagates to the caller to show, and the load is tried again on the next call.

    Visitors (bert_engine.fairness.VISITOR) choose with `switch`: the choice is theirs alone, and
    the default model stays for everyone else. Models are shared by every visitor who chose the same
    checkpoint; at most `max_models` besides the default stay loaded (least recently used goes, and
    is loaded again for whoever still uses it), and at most `max_visitors` choices are remembered.
    Outside a visitor (a script, the CLI) `switch` changes the default itself.
    """

    def __init__(self, task: RegisteredTask, checkpoint: str | None = None, *,
                 shown_name: Callable[[str], str] | None = None, max_models: int = 2, max_visitors: int = 1024,
                 **load_kwargs: Any) -> None:
        """`shown_name` turns the checkpoint's name into the one provenance shows (a server hides its
        folders); the default shows it as given."""
        self.task = task
        self.default = checkpoint
        self.shown_name = shown_name or str
        self.load_kwargs = load_kwargs
        self.max_models, self.max_visitors = max_models, max_visitors
        self._predictor: Predictor | None = None  # the default model
        self._models: OrderedDict[str, Predictor] = OrderedDict()  # visitors' other choices, least recent first
        self._choices: OrderedDict[str, str] = OrderedDict()  # visitor -> their checkpoint, least recent first
        self._loading: dict[str | None, threading.Lock] = {}  # a lock per checkpoint being loaded
        self._last: OrderedDict[str | None, tuple[Predictor, LastInput]] = OrderedDict()  # visitor -> last input
        self._asked: OrderedDict[str | None, tuple[dict[str, Any], dict[str, Any]] | None] = OrderedDict()
        self._asked_sent: dict[str | None, int] = {}  # visitor -> when their kept request was sent (remember_request)
        self._lock = threading.Lock()  # guards the dictionaries above; never held while loading

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint the current visitor uses (None: the task's default)."""
        visitor = VISITOR.get()
        with self._lock:
            return self._choices.get(visitor, self.default) if visitor is not None else self.default

    @property
    def loaded(self) -> bool:
        checkpoint = self.checkpoint
        return self._predictor is not None if checkpoint == self.default else checkpoint in self._models

    def switch(self, checkpoint: str | None) -> Predictor:
        """Use another checkpoint (None: the task's default): for the current visitor only, or for
        everyone outside a visitor. On failure nothing changes."""
        checkpoint = checkpoint or None
        visitor = VISITOR.get()
        if visitor is None:
            predictor = self._load(checkpoint)
            with self._lock:
                self.default, self._predictor = checkpoint, predictor
                self._models.pop(checkpoint, None)
            return predictor
        predictor = self._model(checkpoint, choosing=True)  # loads first: a failure leaves the choice as it was
        with self._lock:
            if checkpoint == self.default:
                self._choices.pop(visitor, None)
            else:
                self._choices[visitor] = checkpoint
                self._choices.move_to_end(visitor)
                while len(self._choices) > self.max_visitors:
                    self._choices.popitem(last=False)
        return predictor

    def _load(self, checkpoint: str | None, choosing: bool = False) -> Predictor:
        if checkpoint != self.default:  # (the default, once loaded, stays: no visitor can make it load again)
            LOADS.charge(self.shown_name(checkpoint) if checkpoint else "the default model", refuse=choosing)
        logger.info("loading the model of task %s%s", self.task.spec.name,
                    f" ({self.shown_name(checkpoint)})" if checkpoint else "")
        predictor = Predictor.load(self.task, checkpoint, **self.load_kwargs)
        predictor.model_id = self.shown_name(predictor.model_id)
        predictor.gate = GATE  # a served model shares the machine through the gate
        return predictor

    def _cached(self, checkpoint: str | None) -> Predictor | None:
        """The loaded model of `checkpoint`, marked as just used (call with the lock held)."""
        if checkpoint == self.default:
            return self._predictor
        if checkpoint in self._models:
            self._models.move_to_end(checkpoint)
        return self._models.get(checkpoint)

    def _model(self, checkpoint: str | None, choosing: bool = False) -> Predictor:
        """The model of `checkpoint`, loading it once however many ask at the same time; a load holds
        only that checkpoint's lock, so visitors of other models are not kept waiting."""
        with self._lock:
            found = self._cached(checkpoint)
            if found is not None:
                return found
            loading = self._loading.setdefault(checkpoint, threading.Lock())
        with loading:
            with self._lock:
                found = self._cached(checkpoint)
                if found is not None:
                    return found
            try:
                predictor = self._load(checkpoint, choosing)
            finally:
                with self._lock:
                    self._loading.pop(checkpoint, None)  # also after a failure: names tried stay bounded
            with self._lock:
                if checkpoint == self.default:
                    self._predictor = predictor
                    return predictor
                self._models[checkpoint] = predictor
                while len(self._models) > self.max_models:
                    evicted, _ = self._models.popitem(last=False)
                    logger.info("task %s: unloaded %s (least recently used)", self.task.spec.name,
                                self.shown_name(evicted))
            return predictor

    def get(self) -> Predictor:
        """The current visitor's model, loaded on first use."""
        return self._model(self.checkpoint)

    def predict(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        predictor = self.get()
        return predictor.predict_checked(inputs, predictor.check_inputs(inputs, options),
                                         on_batch=self.remembering(predictor))

    MAX_REMEMBERED = 256  # visitors whose last input the attention view keeps

    def remembering(self, predictor: Predictor, visitor: str | None | object = ...):
        """on_batch for `predictor`: keep a row of the batch as `visitor`'s last input (default: the
        current VISITOR, read when the batch is answered)."""
        def remember(batch, row: int, *_item: int) -> None:
            who = VISITOR.get() if visitor is ... else visitor
            if one_call(who):  # nobody can read it later, and it would push out a session's
                return
            with self._lock:
                self._last[who] = (predictor, LastInput.of(batch, row, predictor.tokenizer))
                self._last.move_to_end(who)
                while len(self._last) > self.MAX_REMEMBERED:
                    self._last.popitem(last=False)
        return remember

    def attention(self) -> tuple[list[str], list[torch.Tensor]]:
        """The current visitor's last input in this task and every layer's attention over it, from
        the model that answered it."""
        with self._lock:
            found = self._last.get(VISITOR.get())
        if found is None:
            if one_call(VISITOR.get()):
                raise InputError("a call without a session has no last input: a browser tab or gradio_client's "
                                 "Client keeps one per session")
            raise InputError(f"no input yet in the {self.task.spec.title} tab: run a prediction there first")
        predictor, last = found
        return predictor.attention(last)

    MAX_REMEMBERED_CHARS = 100_000  # a longer request is not kept for "why" and "compare" (they say so)

    def remember_request(self, inputs: Mapping[str, Any], options: Mapping[str, Any], sent: int | None = None) -> None:
        """Keep the current visitor's last answered request (inputs and the options they gave) in this task,
        for the views that re-run it ("why this answer", "compare"); one per visitor, the latest 256. With
        `sent` (the order requests were sent in), an answer that comes after a later-sent one's is not kept over it:
        the views explain the request sent last, not the one that happened to finish last."""
        size = sum(len(v) for v in inputs.values() if isinstance(v, str))
        kept = (dict(inputs), dict(options)) if size <= self.MAX_REMEMBERED_CHARS else None
        if one_call(VISITOR.get()):  # (as remembering)
            return
        with self._lock:
            who = VISITOR.get()
            if sent is not None:
                if sent < self._asked_sent.get(who, -1):
                    return
                self._asked_sent[who] = sent
                while len(self._asked_sent) > self.MAX_REMEMBERED:
                    self._asked_sent.pop(next(iter(self._asked_sent)))
            self._asked[who] = kept
            self._asked.move_to_end(who)
            while len(self._asked) > self.MAX_REMEMBERED:
                self._asked.popitem(last=False)

    def last_request(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The current visitor's last answered request in this task: (inputs, options).

        Raises:
            InputError: none yet, or it was too long to keep."""
        with self._lock:
            if VISITOR.get() not in self._asked:
                raise InputError(f"no answer yet in the {self.task.spec.title} tab: run a prediction there first")
            found = self._asked[VISITOR.get()]
        if found is None:
            raise InputError(f"your last {self.task.spec.title} input was longer than {self.MAX_REMEMBERED_CHARS:,} "
                             "characters, too long to explain or compare here; try a shorter one")
        return found

    @property
    def last(self) -> LastInput | None:
        """The current visitor's last input in this task (None before their first)."""
        with self._lock:
            found = self._last.get(VISITOR.get())
        return found[1] if found is not None else None

    def provenance(self) -> dict[str, Any]:
        return self.get().provenance()


class BatchingPredictor(LazyPredictor):
    """A LazyPredictor that merges concurrent requests into one batched forward pass.

    For one-field tasks with a batched path (`predict_many`): a short request (at most SHARED_MAX_TOKENS
    tokens) waits up to `max_wait_ms` for others with the same options, then the first of them runs the
    whole group through `predict_in_batches`. Requests of different visitors share a pass, so only short
    ones do: a visitor's request waits for at most `max_batch` - 1 other short rows, never for another's
    long text (a long one runs alone, its work taking turns at the fairness gate). A bad input never
    fails its neighbours: inputs are checked one by one first, and if the group still raises InputError
    each request is run alone for its own answer. When the first request is cut off or cancelled, the
    others run alone, each in its own thread (under its own time limit), not failed with it.
    Results carry `provenance.batch_size` (how many requests shared the pass).
    """

    SHARED_MAX_TOKENS = 128  # the longest request that shares a pass (tokens, special ones left out)

    def __init__(self, task: RegisteredTask, checkpoint: str | None = None, *, max_batch: int = 16,
                 max_wait_ms: float = 10.0, **load_kwargs: Any) -> None:
        super().__init__(task, checkpoint, **load_kwargs)
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._cond = threading.Condition()

    def predict(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        predictor = self.get()
        merged = predictor.check_inputs(inputs, options)
        field = self.task.spec.input_fields[0]
        if not can_batch(self.task.spec, [inputs]) or not self._short(predictor, inputs.get(field)):
            return self._alone(predictor, inputs, merged)  # nothing to share, or too long to make others wait for
        key = f"{id(predictor)}:" + json.dumps(merged, sort_keys=True, default=str)  # one model, one set of options
        request = {"inputs": dict(inputs), "visitor": VISITOR.get(), "group": GROUP.get(), "done": False,
                   "output": None, "error": None}
        with self._cond:
            group = self._pending.setdefault(key, [])
            group.append(request)
            leader = len(group) == 1
            if len(group) >= self.max_batch:
                self._cond.notify_all()
        if leader:
            taken = None
            try:
                with self._cond:
                    self._cond.wait_for(lambda: len(self._pending.get(key, ())) >= self.max_batch,
                                        timeout=self.max_wait)
                    taken = self._pending.pop(key)
                self._run_group(predictor, taken, options)
            finally:
                with self._cond:
                    # Cut off or cancelled while it waited for others: the group it leads would be left pending,
                    # its members (and every later request with these options, joining it) waiting for nobody
                    if taken is None and (stale := self._pending.get(key)) and stale[0] is request:
                        del self._pending[key]
                        for other in stale[1:]:
                            other["error"], other["done"] = _LEADER_STOPPED, True
                    self._cond.notify_all()
        with self._cond:
            while not request["done"]:  # short waits: this request's own cancellation reaches it
                self._cond.wait(0.1)
        if request["error"] is _LEADER_STOPPED:  # the pass was cut off with its first request: run this one alone
            return self._alone(predictor, inputs, merged)
        if request["error"] is not None:
            raise request["error"]
        return request["output"]

    def _short(self, predictor: Predictor, text: Any) -> bool:
        """Whether `text` is a non-empty text of at most SHARED_MAX_TOKENS tokens (a long one is not tokenised)."""
        if not isinstance(text, str) or not text.strip() or len(text) > 16 * self.SHARED_MAX_TOKENS:
            return False
        try:
            return len(predictor.tokenizer.tokenize(text)) <= self.SHARED_MAX_TOKENS
        except Exception:  # the tokenizer refuses it: predict_checked says why, alone
            return False

    def _alone(self, predictor: Predictor, inputs: Mapping[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
        output = predictor.predict_checked(inputs, checked, on_batch=self.remembering(predictor))
        output["provenance"]["batch_size"] = 1
        return output

    def _run_group(self, predictor: Predictor, group: list[dict[str, Any]], options: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            if len(group) == 1:
                self._run_alone(predictor, group, options)
                return
            # checked once in predict; tokenised once, each visitor's row kept for their attention view
            results = predict_in_batches(predictor, [r["inputs"] for r in group], batch_size=len(group),
                                         on_batch=lambda batch, row, i: self.remembering(
                                             predictor, group[i]["visitor"])(batch, row), checked=True,
                                         **predictor.check_options(options))
            latency_ms = (time.perf_counter() - start) * 1000
            for request, result in zip(group, results):
                provenance = {**predictor.provenance(latency_ms), "batch_size": len(group)}
                request["output"] = {"task": self.task.spec.name, "result": result, "provenance": provenance}
        except InputError:
            self._run_alone(predictor, group, options)  # one bad input: everyone gets their own answer
        except Exception as err:
            for request in group:
                request["error"] = err
        finally:
            for k, request in enumerate(group):
                if request["output"] is None and request["error"] is None:  # the pass was cut off (Cancelled)
                    # (the first request's own cut-off reaches its caller as it is; the others run alone)
                    request["error"] = _LEADER_STOPPED if k else PredictionTimeout("the shared pass was cut off")
                request["done"] = True

    def _run_alone(self, predictor: Predictor, group: list[dict[str, Any]], options: dict[str, Any]) -> None:
        for request in group:
            try:
                with visitor_scope(request["visitor"], request["group"]):  # its compute and attention view are its own
                    checked = predictor.check_inputs(request["inputs"], options)
                    output = predictor.predict_checked(request["inputs"], checked, on_batch=self.remembering(predictor))
                output["provenance"]["batch_size"] = 1
                request["output"] = output
            except Exception as err:  # handed to that request's own caller
                request["error"] = err


# A shared pass's requests but the first, when the first was cut off or cancelled during it: each runs alone.
_LEADER_STOPPED = PredictionTimeout("the shared pass was cut off with the request that ran it")


class ModelShelf:
    """Models loaded beside the served ones (to compare two models on one input): shared by every
    visitor (a model is only read), keyed by (task, checkpoint, precision), at most `max_models` at once
    (the least recently used goes). Loads hold only their own key's lock."""

    def __init__(self, *, max_models: int = 2, shown_name: Callable[[str], str] | None = None,
                 **load_kwargs: Any) -> None:
        self.max_models = max_models
        self.shown_name = shown_name or str
        self.load_kwargs = load_kwargs
        self._models: OrderedDict[tuple[str, str | None, str], Predictor] = OrderedDict()
        self._loading: dict[tuple[str, str | None, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, task: RegisteredTask, checkpoint: str | None, precision: str) -> Predictor:
        """The model of `task` from `checkpoint` (None: the task's default) in `precision`, loaded once."""
        key = (task.spec.name, checkpoint, precision)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                if key in self._models:
                    return self._models[key]
            shown = self.shown_name(checkpoint) if checkpoint else "the default model"
            LOADS.charge(f"{shown} ({precision})")
            try:
                logger.info("loading %s (%s) of task %s to compare", shown, precision, task.spec.name)
                predictor = Predictor.load(task, checkpoint, precision=precision, **self.load_kwargs)
            except (HubError, CheckpointError, ValueError, OSError) as err:  # the visitor's choice, not a plugin's bug
                raise InputError(f"could not load {shown} in {precision}: {err}") from None
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            predictor.model_id = self.shown_name(predictor.model_id)
            predictor.gate = GATE
            with self._lock:
                self._models[key] = predictor
                while len(self._models) > self.max_models:
                    self._models.popitem(last=False)
            return predictor
