"""The whole plugin contract: the pluggy markers, the hook specs, and the TaskSpec a plugin registers.

A task plugin is a module or object with `@hookimpl def register_tasks(register)`; it calls
`register(TaskSpec(...))` once per task. pluggy checks argument names, not types, so the typed
part of the contract is the TaskSpec, validated by the host when it is registered (tasks/registry.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import pluggy

from .errors import InputError as InputError  # the plugin contract's error (plugins import it from here)

if TYPE_CHECKING:  # annotations only: a plugin importing the contract does not load torch through it
    from torch import Tensor

    from .config import BertConfig
    from .model import EncoderOutput
    from .tokenizer import Batch, Tokenizer

PROJECT = "bert_engine"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def check_int(task: str, name: str, value: Any, low: int, high: int) -> None:
    """Raise InputError naming the option and value unless `value` is an integer (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InputError(f"{task}: {name} must be an integer in [{low}, {high}], got {value!r}")


def length_option(task: str, name: str, value: Any, preferred: int, low: int, tokenizer: Any) -> int:
    """A token-length option: None means `preferred`, capped at what the model takes (the tokenizer's
    model_max_length); an explicit value must be an integer in [low, model_max_length]."""
    if value is None:
        value = min(preferred, tokenizer.model_max_length)
    check_int(task, name, value, min(low, tokenizer.model_max_length), tokenizer.model_max_length)
    return value


# -- the typed contract: what each TaskSpec callable receives and returns ------------------------------

class TaskHead(Protocol):
    """A task's head: an nn.Module whose forward takes the encoder's output. Optional attributes the
    host reads (all documented in docs/plugins.md):

    - `labels` (tuple of names, id order): for a task that predicts labels (see TaskSpec.labels);
    - `kind`: a heads.HEADS name whose checkpoint weights this head loads (e.g. "sequence", "mlm");
    - `needs_pooler` (default True): whether the encoder keeps its pooler;
    - `tie_to(word_embeddings)`: called once, for a decoder sharing the input embeddings;
    - `optional_parameters`: name prefixes a checkpoint may lack without marking the head untrained.
    """

    def __call__(self, encoded: EncoderOutput) -> Any: ...


class BuildHead(Protocol):
    """BertConfig (sizes, and labels when the checkpoint has them) -> the head module."""

    def __call__(self, config: BertConfig) -> TaskHead: ...


class Preprocess(Protocol):
    """(inputs keyed by input_fields, tokenizer, every option as a keyword) -> Batch; raises
    InputError on bad input. Keep what postprocessing needs in `batch.meta`."""

    def __call__(self, inputs: Mapping[str, Any], tokenizer: Tokenizer, **options: Any) -> Batch: ...


class Postprocess(Protocol):
    """(the head's output, the batch, every option as a keyword) -> a JSON-friendly result. A
    postprocess that declares a `context` parameter also gets a TaskContext."""

    def __call__(self, output: Any, batch: Batch, **options: Any) -> Any: ...


@dataclass(frozen=True)
class TaskContext:
    """What a postprocess may need beyond the model's output, handed to it as `context=`.

    tokenizer: the model's tokenizer (to re-tokenise, or read special token ids).
    encode: model inputs (input_ids, attention_mask, token_type_ids, and e.g. output_hidden_states)
        -> the encoder's output, for tasks that re-run the encoder on edited inputs (fill-mask's beam
        search, the summary's fallback); chunked like every forward, on the model's device.
    labels: the head's label names in id order (`head.labels`: the checkpoint's id2label when it has
        one), None for a head without labels. Name predictions by it: a checkpoint may order its
        labels differently from the task's declared default.
    check_work: check_work(rows, length, what) raises InputError, naming `what`, where `rows` more rows of
        `length` tokens through the encoder would take the request past its work limit
        (BERT_ENGINE_MAX_GFLOP): call it before a search of many passes, so the request is refused before
        any of them runs (each `encode` is checked and charged anyway, and refused where it would pass the
        limit). None outside a request.
    """

    tokenizer: Tokenizer
    encode: Callable[[Mapping[str, Any]], EncoderOutput]
    labels: tuple[str, ...] | None = None
    check_work: Callable[..., None] | None = None


def takes_keyword(function: Callable[..., Any] | None, name: str) -> bool:
    """Whether `function` declares a parameter `name` (the host passes optional arguments only to
    the hooks that ask for them, e.g. `labels=` to training_batch and loss)."""
    try:
        return function is not None and name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def takes_context(postprocess: Callable[..., Any]) -> bool:
    """Whether a postprocess declares a `context` parameter (then the host passes a TaskContext)."""
    try:
        return "context" in inspect.signature(postprocess).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


@dataclass(frozen=True)
class ExplainTarget:
    """One number of a shown prediction that "why this answer" explains (TaskSpec.explain).

    name: what it is, as a visitor reads it ("POSITIVE", "Paris (LOC)", "start of the answer").
    score: the head's output over rows that all hold row `row` of the input's batch (the host varies
        their word embeddings) -> one differentiable value per row, shape (rows,): e.g. the predicted
        label's probability. The attributions of the input's tokens sum to score(input) - score(baseline).
    what: the unit of the score in a few words ("probability", "logit gap").
    row: which row (window) of the batch holds what is explained; the attributions cover its tokens.
    """

    name: str
    score: Callable[[Any], Tensor]
    what: str = "probability"
    row: int = 0


class PluginError(RuntimeError):
    """A plugin broke the contract (import failure, hook raised, invalid or duplicate TaskSpec)."""


@dataclass(frozen=True)
class TaskSpec:
    """One downstream task. Inputs are dicts keyed by `input_fields`; results must be JSON-friendly.

    Required:
        name: slug, unique across plugins: the tab id, the API name and the CLI name ("sentiment").
        title: label shown on the tab.
        build_head: BertConfig -> head module; the head's forward takes an EncoderOutput.
        preprocess: (inputs, tokenizer, **options) -> tokenizer.Batch; raises InputError on bad input.
            Keep what postprocessing needs (offsets, windows, texts) in the Batch (`batch.meta`).
        postprocess: (head output, batch, **options) -> JSON-friendly result; declare a `context`
            parameter to get a TaskContext (tokenizer, encode) for re-running the encoder.
    Optional:
        build_tab: (predictor) -> None; adds Gradio components inside the open Blocks/Tab.
        input_fields: names of the text inputs, e.g. ("text",) or ("question", "context").
        optional_fields: text inputs that may be absent or None (e.g. a second text, "text_pair").
        options: option name -> default value, passed to preprocess/postprocess as keywords.
        check_options: (options: a read-only mapping of every option, the caller's over the defaults)
            -> None; raises InputError naming a bad value. Called when a pipeline is made and before
            each request, so a bad value fails where it is written, not at the first call. Check
            here what needs no tokenizer; preprocess still checks the rest. None: preprocess checks all.
        examples: example inputs (dicts keyed by `input_fields`).
        default_checkpoint: folder or Hub id of the model used when none is configured;
            None means the engine's default backbone with a freshly initialised head.
        read_data: (path, split) -> iterable of (inputs, target) pairs, for training and evaluation.
        training_batch: (examples: list of (inputs, target), tokenizer, generator) -> (Batch, targets
            for `loss`): targets aligned to the batch's rows and tokens; `generator` (a seeded
            torch.Generator) drives any randomness such as masking. Without it, inputs are
            preprocessed with the default options and the targets passed to `loss` as read. Declare
            a `labels` parameter to get the head's label names in id order (the checkpoint's).
        loss: (head output, targets) -> scalar tensor (the mean over the batch); `labels=` as above.
        metric: (results: list of postprocess results, targets: list as read) -> {name: number}.
        evaluate: (predictor, examples: list of (inputs, target), progress, **options) -> metrics;
            replaces the generic "predict every example, then `metric`" evaluation (masked-token
            accuracy needs its own masking; a summary table adds baselines).
        predict_many: (predictor, texts: list[str], **options) -> results in order; a batched path
            (length-sorted, dynamically padded) for files and lists. Without it, inputs run one by one.
        labels: the label names a new head gets on a checkpoint without any (config.id2label empty),
            for a task that predicts labels. Its head must then expose them as `head.labels`, in id
            order; on a checkpoint with id2label, the head takes the checkpoint's. None: no labels.
        target_labels: (target as read) -> the labels it uses, as ids (positions in head.labels) or
            names; the trainer checks them against the head before training starts.
        best_metric: the metric (a key of `metric`'s or `evaluate`'s result) that picks the best
            checkpoint during training, and best_metric_goal whether higher ("max") or lower ("min")
            is better. None: the first of f1, accuracy, rouge2, ... the evaluation reports.
        aliases: other names `bert_engine.pipeline` accepts (e.g. transformers' "token-classification").
        pipeline_output: (result, options, single) -> the result in the shape of the transformers
            pipeline of this kind of task (`single`: the caller passed one input, not a list), so code
            written for that pipeline ports by changing the import. None: the engine's result as is.
        pipeline_arguments: argument name -> (value -> the task's options it means): the keyword arguments of
            that transformers pipeline the task reads under other names (sentiment's function_to_apply is its
            `function`), or that need nothing of it (truncation=True); raise InputError for a value it
            cannot honour, naming what it does instead. `bert_engine.pipeline` translates them where the
            pipeline is made and per call; two that set one option differently are refused, naming both. One
            named as a task option reads the value given under that name (sentiment's top_k=None: every
            label, as transformers reads it; left out, the option keeps its default).
        brief: (result) -> one short line of plain text, the answer at a glance ("POSITIVE 98 %"):
            the playground's "All tasks" tab shows it beside the other tasks' answers. None: the
            result's JSON, shortened.
        explain: (result, batch, **options) -> a list of ExplainTarget: the numbers of `result` that
            "why this answer" explains (the predicted label's probability, an entity's, an answer's
            start and end); declare a `context` parameter to get the TaskContext (the head's labels). The host computes token attributions for each (Integrated Gradients or
            gradient x input over the word embeddings: bert_engine.runtime.explain) in the playground,
            the API and MCP. None: the task has no "why" view.
        tuned_options: metric name -> option name: a value the evaluation tunes on held-out data
            (QA's "default_threshold", sentiment's "tuned_temperature") that `bert-engine pack` makes
            the packed model's default for that option (an entry of `options`).
    """

    name: str
    title: str
    build_head: BuildHead
    preprocess: Preprocess
    postprocess: Postprocess
    build_tab: Callable[[Any], None] | None = None  # (predictor) -> None
    input_fields: tuple[str, ...] = ("text",)
    optional_fields: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    check_options: Callable[[Mapping[str, Any]], None] | None = None
    examples: tuple[Mapping[str, Any], ...] = ()
    description: str = ""
    default_checkpoint: str | None = None
    read_data: Callable[[str, str], Iterable[tuple[Mapping[str, Any], Any]]] | None = None
    training_batch: Callable[..., tuple[Batch, Any]] | None = None  # (examples, tokenizer, *, generator, **options)
    loss: Callable[[Any, Any], Tensor] | None = None
    metric: Callable[[list[Any], list[Any]], Mapping[str, Any]] | None = None
    evaluate: Callable[..., Mapping[str, Any]] | None = None  # (predictor, examples, *, progress, **options)
    predict_many: Callable[..., list[Any]] | None = None  # (predictor, texts, *, progress, **options)
    labels: tuple[str, ...] | None = None
    target_labels: Callable[[Any], Iterable[int | str]] | None = None
    best_metric: str | None = None
    best_metric_goal: Literal["max", "min"] = "max"
    aliases: tuple[str, ...] = ()
    pipeline_output: Callable[[Any, Mapping[str, Any], bool], Any] | None = None
    pipeline_arguments: Mapping[str, Callable[[Any], Mapping[str, Any]]] = field(default_factory=dict)
    brief: Callable[[Any], str] | None = None
    tuned_options: Mapping[str, str] = field(default_factory=dict)
    explain: Callable[..., Iterable[ExplainTarget]] | None = None  # (result, batch, **options)


class TaskHooks:
    """Hook specifications; see docs/plugins.md for a worked example of each."""

    @hookspec
    def register_tasks(self, register: Callable[[TaskSpec], None]) -> None:
        """Called once per plugin when the registry loads it; register each of the plugin's tasks.

        Args:
            register: call it with one TaskSpec per task; it raises PluginError for an invalid
                spec or a name another plugin already registered.

        Example:
            @hookimpl
            def register_tasks(register):
                register(TaskSpec(name="similarity", title="Similarity", build_head=..., preprocess=..., postprocess=...))
        """
