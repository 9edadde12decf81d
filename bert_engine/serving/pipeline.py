"""`pipeline(task)`: any registered task as a callable, shaped like the transformers pipelines.

    >>> from bert_engine import pipeline
    >>> classify = pipeline("sentiment")                    # or "sentiment-analysis", "text-classification"
    >>> classify("A gorgeous, witty, seductive movie.")
    [{'label': 'POSITIVE', 'score': 0.998}]
    >>> pipeline("qa")(question="Who wrote it?", context="Moby-Dick was written by Herman Melville.")
    {'score': 0.94, 'start': 25, 'end': 40, 'answer': 'Herman Melville'}

One input, a list (batched, length-sorted where the task can), or any other iterable (a generator of
results, `batch_size` inputs at a time). Options are the task's (the CLI's `-o`, the tab's controls),
given when the pipeline is made or per call. A task with `TaskSpec.pipeline_output` answers in the
transformers shape of its kind; `raw=True`, or a task without it, gives the engine's full result.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

from ..hookspecs import InputError, check_int
from ..runtime.inference import Predictor, can_batch, check_task_options
from ..tasks.registry import RegisteredTask, Registry, UnknownTask, load_registry


def find_task(registry: Registry, name: str) -> RegisteredTask:
    """A task by its name or one of its aliases (e.g. "ner" or "token-classification")."""
    if name in registry.tasks:
        return registry.tasks[name]
    for task in registry.tasks.values():
        if name in task.spec.aliases:
            return task
    known = sorted(set(registry.tasks) | {a for t in registry.tasks.values() for a in t.spec.aliases})
    raise UnknownTask(registry.missing(name, f"known: {', '.join(known)}"))


class Pipeline:
    """A loaded task; call it on inputs (see the module docstring)."""

    def __init__(self, predictor: Predictor, *, raw: bool = False, batch_size: int = 32, called_as: str | None = None,
                 **options: Any) -> None:
        _check_arguments(raw=raw, batch_size=batch_size)
        self.predictor, self.raw, self.batch_size = predictor, raw, batch_size
        self.task = predictor.task
        self.called_as = called_as  # the task name it was made under (transformers' "summarization", say)
        self.options = predictor.check_options(translated(self.task.spec, options, called_as))  # unknown ones: named

    def __call__(self, inputs: Any = None, /, *more: Any, raw: bool | None = None, **kwargs: Any) -> Any:
        """Answer one input (a text, a mapping of the task's fields, or for a pair task a (first, second)
        tuple), a list of them, or an iterable (streamed); `raw` (default: the pipeline's) gives the
        engine's {"task", "result", "provenance"} instead of the transformers-shaped answer."""
        if more:  # qa("Who?", "Bob lives in London."), as transformers v4 took it: said how, not Python's signature error
            fields = self.task.spec.input_fields + self.task.spec.optional_fields
            pair = f"a ({', '.join(fields[:2])}) tuple, or " if len(fields) >= 2 else ""
            raise TypeError(f"{self.task.spec.name}: give one input, not {1 + len(more)} positional arguments: "
                            f"{pair}{', '.join(f'{f}=...' for f in fields)} as keywords, or a list of inputs")
        if raw is not None:
            _check_arguments(raw=raw)
        raw = self.raw if raw is None else raw
        size = kwargs.pop("batch_size", None)  # per call, as transformers takes it; else the pipeline's
        if size is not None:
            _check_arguments(batch_size=size)
        spec = self.task.spec
        fields = spec.input_fields + spec.optional_fields
        by_field = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        options = self.predictor.check_options({**self.options, **translated(spec, kwargs, self.called_as)})
        if by_field:
            first = spec.input_fields[0]
            if (isinstance(inputs, (str, list)) and first not in by_field and len(spec.input_fields) == 1
                    and set(by_field) <= set(spec.optional_fields)):
                by_field = {first: inputs, **by_field}  # clf("a text", text_pair="another"), as transformers reads it
            elif inputs is not None:
                raise TypeError(f"{spec.name}: give the inputs either positionally or as {', '.join(fields)}=, not "
                                f"both (got a positional input and {', '.join(f'{k}=' for k in by_field)})")
            inputs = _from_fields(spec.name, by_field)
        if isinstance(inputs, (str, Mapping)) or self._is_pair(inputs):
            output = self.predictor.predict(self._item(inputs), **options)
            return output if raw else self._shape(output["result"], options, single=True)
        if isinstance(inputs, (bytes, bytearray, memoryview)):  # iterable, as numbers: not a stream of texts
            raise TypeError(f"{spec.name}: expected text, got {type(inputs).__name__}; decode it first "
                            "(e.g. data.decode('utf-8'))")
        if isinstance(inputs, tuple) and len(fields) >= 2 and inputs and all(isinstance(v, str) for v in inputs):
            # (2 texts: one input's two fields; 3 were a batch of three: the same call, read two ways)
            raise TypeError(f"{spec.name}: a tuple of texts is one input's ({', '.join(fields[:2])}), so it holds two; "
                            f"got {len(inputs)}. Give many inputs as a list")
        if isinstance(inputs, (list, tuple)):
            return self._many(list(inputs), options, raw, size)
        if isinstance(inputs, Iterable):
            return self._stream(iter(inputs), options, raw, size)
        raise TypeError(f"{spec.name}: expected a text, a mapping of {', '.join(fields)}, a list or an iterable of "
                        f"them, got {type(inputs).__name__}")

    def _is_pair(self, value: Any) -> bool:
        """A (first, second) tuple of texts for a task with two text fields (sentiment's text, text_pair;
        QA's question, context): one input, not a batch of two."""
        fields = self.task.spec.input_fields + self.task.spec.optional_fields
        return isinstance(value, tuple) and len(value) == 2 and len(fields) >= 2 and all(isinstance(v, str) for v in value)

    def _item(self, value: Any) -> Mapping[str, Any]:
        if isinstance(value, str):
            needed = self.task.spec.input_fields
            if len(needed) > 1:  # (a 3-tuple of texts for QA is a batch of three such texts, not one input)
                raise InputError(f"{self.task.spec.name}: a text alone gives only {needed[0]}; the task needs "
                                 f"{', '.join(needed)}: give a mapping of them, or a ({', '.join(needed)}) tuple")
            return {needed[0]: value}
        if self._is_pair(value):
            fields = self.task.spec.input_fields + self.task.spec.optional_fields
            return {fields[0]: value[0], fields[1]: value[1]}
        if isinstance(value, Mapping):
            fields = self.task.spec.input_fields + self.task.spec.optional_fields
            unknown = sorted(str(k) for k in value if k not in fields)
            if unknown:  # (a misspelt field was dropped unread; `predict --file` and the API refuse it too)
                raise InputError(f"{self.task.spec.name}: unknown field(s) {', '.join(unknown)[:200]}; the task's: "
                                 f"{', '.join(fields)}")
            return value
        raise TypeError(f"{self.task.spec.name}: each input must be a text or a mapping of "
                        f"{', '.join(self.task.spec.input_fields)}, got {type(value).__name__}")

    def _many(self, values: list, options: Mapping[str, Any], raw: bool = False,
              batch_size: int | None = None) -> list[Any]:
        """Answers for a list, in order. A bad input raises InputError.at its place in `values`, whichever
        check finds it (its type, the predictor's checks, the task's preprocess), so a stream can name it."""
        spec = self.task.spec
        items = []
        for i, value in enumerate(values):
            with self._at(i, not_text=True):
                items.append(self._item(value))
                self.predictor.check_inputs(items[-1], {})
        if items and can_batch(spec, items):
            field = spec.input_fields[0]
            started = time.perf_counter()
            sized = {"batch_size": batch_size or self.batch_size} if _takes_batch_size(spec.predict_many) else {}
            results = spec.predict_many(self.predictor, [i[field] for i in items], **sized, **options)
            each_ms = 1000 * (time.perf_counter() - started) / len(items)  # the batch's time, shared out
            outputs = [{"task": spec.name, "result": r, "provenance": self.predictor.provenance(each_ms)}
                       for r in results]
        else:
            outputs = []
            for i, item in enumerate(items):
                with self._at(i):  # checked above; `options` are merged with the defaults already (__call__)
                    outputs.append(self.predictor.predict_checked(item, options))
        return outputs if raw else [self._shape(o["result"], options, single=False) for o in outputs]

    @contextlib.contextmanager
    def _at(self, position: int, not_text: bool = False):
        """An InputError about one input (with `not_text`, also _item's TypeError: the input is not a text or a
        mapping) as InputError.at its position."""
        name = self.task.spec.name
        try:
            yield
        except InputError as err:
            if err.position is not None:
                raise
            raise InputError.at(name, position, str(err).removeprefix(f"{name}: ")) from None
        except TypeError as err:
            if not not_text:
                raise
            raise InputError.at(name, position, str(err).removeprefix(f"{name}: ")) from None

    def _stream(self, values: Iterator, options: Mapping[str, Any], raw: bool = False,
                batch_size: int | None = None) -> Iterator[Any]:
        """Answers in order, a chunk of `batch_size` at a time; a bad input ends the stream with its error
        (numbered within the stream) after the answers of every input before it."""
        done = 0
        while chunk := list(islice(values, batch_size or self.batch_size)):
            try:
                answers = self._many(chunk, options, raw, batch_size)
            except InputError as err:  # numbered within the chunk: renumber within the stream
                if err.position is None:
                    raise
                if err.position:  # the good inputs before it, answered before the error
                    yield from self._many(chunk[:err.position], options, raw, batch_size)
                raise InputError.at(self.task.spec.name, done + err.position, err.detail) from None
            yield from answers
            done += len(chunk)

    def _shape(self, result: Any, options: Mapping[str, Any], *, single: bool) -> Any:
        shape = self.task.spec.pipeline_output
        return result if shape is None else shape(result, options, single)


def _takes_batch_size(predict_many) -> bool:
    """Whether a task's predict_many takes `batch_size` (predict_texts does; a plugin's own may not)."""
    try:
        return "batch_size" in inspect.signature(predict_many).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


MAX_BATCH_SIZE = 4096


def _check_arguments(**arguments: Any) -> None:
    """pipeline()'s own arguments: `raw` and `compile` true or false, `batch_size` an integer in [1, MAX_BATCH_SIZE]
    (InputError naming the argument and the value; "yes" is not taken for True, nor 2.5 for a batch)."""
    for name, value in arguments.items():
        if name == "batch_size":
            check_int("pipeline", name, value, 1, MAX_BATCH_SIZE)
        elif not isinstance(value, bool):
            raise InputError(f"pipeline: {name} must be True or False, got {value!r:.80}")


# Arguments of transformers' pipelines no built-in task takes, with what bert_engine does instead: refused naming
# it (an "unknown option" alone left a port guessing). A task that has an option of the same name reads its own.
NOT_TAKEN = {
    "ignore_labels": "the answer lists every entity and never the tokens outside them ('O'); to leave out a type, "
                     "drop the answers whose 'entity_group' is it",
    "return_text": "an extractive summary answers its chosen sentences as text (and their places)",
    "return_tensors": "answers are JSON-ready values, not tensors",
    "clean_up_tokenization_spaces": "answers quote the input's own text, spaces as written",
    "min_length": "an extractive summary picks whole sentences: ask for how many with its options",
    "generate_kwargs": "no task generates text: the summary picks sentences",
    "tokenizer_kwargs": "the model's own tokenizer runs with the task's length options (max_length)",
    "align_to_words": "answers are spans of whole word pieces mapped back to the text's characters",
    "num_workers": "inputs are batched in this process (batch_size=)",
    "trust_remote_code": "no code is loaded from a checkpoint: the engine's own model runs it",
    "use_fast": "the tokenizer is `tokenizers`' (fast) one",
    "framework": "the engine runs PyTorch",
    "device_map": "the model loads on one device: give device=",
    "model_kwargs": "pipeline() takes the model's settings as its own arguments (precision=, device=)",
    "tokenizer": "the model's folder (model=) holds its tokenizer, which is the one that runs",
    "feature_extractor": "the tasks read text only",
    "image_processor": "the tasks read text only",
    "token": "a Hub token is read from the environment (HF_TOKEN) or `hf auth login`",
    "padding": "rows are padded as the engine batches them, and no padding changes an answer: leave it out",
}


# NOT_TAKEN arguments given a value that asks for what bert_engine does anyway: taken and dropped (transformers'
# own default passed explicitly, `ignore_labels=["O"]`, must not break a port).
AS_THE_ENGINE_DOES = {"ignore_labels": lambda value: isinstance(value, (list, tuple)) and set(value) == {"O"},
                      "trust_remote_code": lambda value: value is False,
                      "use_fast": lambda value: value is True,
                      "framework": lambda value: value == "pt",
                      "tokenizer": lambda value: value is None,
                      # rows are padded as the engine batches them and masked: no padding changes an answer
                      "padding": lambda value: value in (True, False, "longest", "max_length", "do_not_pad")}


# Arguments that mean something else in the transformers pipeline of that name than in the task's own options:
# refused where the pipeline was made under transformers' name, since code written for it means transformers'.
MEANS_ELSE = {("summarization", "max_length"): (
    "in transformers' summarization it is the generated summary's length, but an extractive summary picks whole "
    "sentences: ask for num_sentences= or ratio= (this task's own max_length, its rows' token window of 32-512, "
    "is taken under pipeline('summary'))")}


def translated(spec, options: Mapping[str, Any], called_as: str | None = None) -> dict[str, Any]:
    """`options` with the transformers pipeline's arguments the task knows under other names
    (TaskSpec.pipeline_arguments) turned into its own options. Other names pass through (the task's checks
    refuse the unknown ones, naming them).

    Raises:
        InputError: two arguments that set one option to different values (`handle_impossible_answer=False`
            beside `no_answer="cautious"`), naming both, rather than one silently winning; an argument that
            means another thing in transformers' pipeline of the name `called_as` (MEANS_ELSE)."""
    for name in options:
        if (called_as, name) in MEANS_ELSE:
            raise InputError(f"{spec.name}: {name}= {MEANS_ELSE[called_as, name]}")
    arguments = spec.pipeline_arguments
    options = {name: value for name, value in options.items()
               if not (name in AS_THE_ENGINE_DOES and name not in arguments and name not in spec.options
                       and AS_THE_ENGINE_DOES[name](value))}
    for name in options:
        if name == "padding" and name not in arguments and name not in spec.options:  # (taken, with those values)
            raise InputError(f"{spec.name}: padding= takes True, False, 'longest', 'max_length' or 'do_not_pad', got "
                             f"{options[name]!r:.80}; {NOT_TAKEN[name].split(':')[0]}")
        if name in NOT_TAKEN and name not in arguments and name not in spec.options:
            raise InputError(f"{spec.name}: {name}= is an argument of transformers' pipelines that bert_engine does "
                             f"not take: {NOT_TAKEN[name]}")
    if unknown := [name for name in options if name not in arguments and name not in spec.options]:
        # (the task's check would name its own options only: the transformers arguments it reads are known too)
        known = [*spec.options, *(name for name in arguments if name not in spec.options)]
        raise InputError(f"{spec.name}: unknown option(s) {', '.join(unknown)}; known: {', '.join(known) or 'none'}")
    chosen: dict[str, Any] = {}
    said_by: dict[str, str] = {}  # option -> the argument that set it first, in the caller's order
    for name, value in options.items():
        for option, setting in (arguments[name](value) if name in arguments else {name: value}).items():
            if option in chosen and chosen[option] != setting:
                raise InputError(f"{spec.name}: {said_by[option]} and {name}={value!r:.80} ask for different "
                                 f"{option!r}; give one of them")
            chosen[option], said_by[option] = setting, said_by.get(option, f"{name}={value!r:.80}")
    return chosen


DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "auto"}


def _precision_of(options: dict[str, Any], precision: str) -> str:
    """`precision`, or what transformers' `dtype=` / `torch_dtype=` (removed from `options`) ask for: torch.float32,
    torch.bfloat16, torch.float16, their names, or "auto".

    Raises:
        TypeError: a dtype the engine does not run, or one beside a different precision=."""
    given = [(name, options.pop(name)) for name in ("dtype", "torch_dtype") if name in options]
    said = f"precision={precision!r}"
    for name, value in given:
        key = str(value).removeprefix("torch.") if value is not None else "auto"
        if key not in DTYPES:
            raise TypeError(f"{name}={value!r} is not a dtype the engine runs: give torch.float32, torch.bfloat16, "
                            "torch.float16 or 'auto' (or precision='int8' for int8)")
        if precision not in ("auto", DTYPES[key]):
            raise TypeError(f"{said} and {name}={value!r} ask for different precisions; give one")
        if DTYPES[key] != "auto":
            precision, said = DTYPES[key], f"{name}={value!r}"
    return precision


def _from_fields(task: str, by_field: Mapping[str, Any]) -> Any:
    """question="...", context="..." -> one mapping; lists of equal length -> a list of mappings; a text beside
    lists goes with each of their rows (one question over several contexts, as transformers reads it).

    Raises:
        TypeError: a field's value is neither a text nor a list of them (bytes: decode them first), as for
            a positional input that is not text.
        InputError: lists of different lengths, or None beside a list."""
    for field, value in by_field.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"{task}: input {field!r} is {type(value).__name__}, not text; decode it first "
                            "(e.g. data.decode('utf-8'))")
        if value is not None and not isinstance(value, (str, list, tuple)):
            raise TypeError(f"{task}: input {field!r} must be a text or a list of texts, got {type(value).__name__}")
    values = list(by_field.values())
    if all(isinstance(v, str) or v is None for v in values):
        return dict(by_field)
    lengths = {len(v) for v in values if isinstance(v, (list, tuple))}
    if len(lengths) == 1 and all(v is not None for v in values):
        rows = lengths.pop()
        columns = [v if isinstance(v, (list, tuple)) else [v] * rows for v in values]
        return [dict(zip(by_field, row)) for row in zip(*columns)]
    shapes = ", ".join(f"{k}: {'a text' if isinstance(v, str) else 'None' if v is None else f'a list of {len(v)}'}"
                       for k, v in by_field.items())
    raise InputError(f"{task}: give each of {', '.join(by_field)} as a text, or as lists of the same length (a text "
                     f"beside them goes with each row; got {shapes})")


def pipeline(task: str | None = None, model: str | None = None, *, revision: str | None = None, device: str | None = None,
             precision: str = "auto", compile: bool = False, raw: bool = False, batch_size: int = 32,
             registry: Registry | None = None, **options: Any) -> Pipeline:
    """Load `task` (a registered task's name or alias; built-in or a plugin's) with `model` (a folder,
    a Hub id or an adapter; default: the task's starter model) and return it as a callable. Without `task`, a
    local model folder's own record of its task (a packed manifest.json, a run's train_config.json) names it.
    `revision`: a Hub id's branch, tag or commit (default: main; a local folder has none, and a warning says
    it is not used). `precision` and `compile` as Predictor.load takes them (compile=True with int8: fused
    input quantisers on long inputs; without a C++ compiler it runs uncompiled and says so).

    Raises:
        KeyError: no such task (the message lists the known names).
        InputError: an option the task does not have.
        hub.HubError, CheckpointError: the model cannot be loaded.
    """
    _check_arguments(compile=compile, raw=raw, batch_size=batch_size)
    if task is None:  # as transformers' pipeline(model=...): the task a local model folder says it was made for
        from ..checkpoints.loader import recorded_task  # noqa: PLC0415

        task = recorded_task(model) if model is not None and Path(str(model)).is_dir() else None
        if task is None:
            raise TypeError("pipeline() needs a task (e.g. pipeline('sentiment')): "
                            + (f"the folder {model!r} does not say which (no manifest.json or train_config.json "
                               "naming one)" if model is not None and Path(str(model)).is_dir() else
                               "only a local model folder that records its task can stand without one"))
    precision = _precision_of(options, precision)
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise TypeError(f"revision must be a Hub branch, tag or commit (text), got {revision!r}")
    registered = find_task(registry or load_registry(), task)
    check_task_options(registered.spec, translated(registered.spec, options, task))  # fails before the model loads
    where = {"revision": revision} if revision is not None else {}
    return Pipeline(Predictor.load(registered, model, device=device, precision=precision, compile=compile, **where),
                    raw=raw, batch_size=batch_size, called_as=task, **options)
