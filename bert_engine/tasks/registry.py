"""The task registry: built-in and entry-point plugins loaded one at a time, failures recorded.

Built-in task modules (declared by the distribution in the entry-point group `bert_engine.builtins`,
or handed over by the caller) and third-party packages (entry-point group `bert_engine`) go through the
same path: import -> register with pluggy -> call `register_tasks` -> validate each TaskSpec.
Any failure becomes a PluginFailure and one warning line; the other plugins keep loading.
Environment: BERT_ENGINE_PLUGINS=a,b loads only those third-party plugins (empty: built-ins only);
BERT_ENGINE_STRICT_PLUGINS=1 re-raises the first failure, for plugin authors and CI.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pluggy

from .. import settings
from ..hookspecs import PROJECT, PluginError, TaskHooks, TaskSpec, takes_context
from ..runtime.cancel import PredictionTimeout, call_with_timeout, raised_by_call
from ..version import __version__

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bert_engine"
# Where the distribution declares its built-in tasks (pyproject.toml): each entry point is a tuple of
# task modules in tab order. The engine never names the package that holds them; a caller running
# from a source tree that is not installed (app.py on a Space) hands `load_registry` its built-ins.
BUILTIN_GROUP = "bert_engine.builtins"


def builtin_plugins(problems: list[str] | None = None) -> tuple[str, ...]:
    """The built-in task modules the installed distributions declare (BUILTIN_GROUP, entries sorted by
    name); none when nothing is installed. A declaration that fails to load is logged and skipped, and what
    went wrong is added to `problems`."""
    modules: list[str] = []
    for ep in sorted(importlib.metadata.entry_points(group=BUILTIN_GROUP), key=lambda ep: ep.name):
        try:
            declared = ep.load()
        except Exception as err:  # a broken distribution must not stop the others' tasks
            why = f"{ep.value} could not be loaded ({type(err).__name__}: {err}){_shadowed(ep.module)}"
            logger.warning("built-in tasks %s: %s", ep.name, why)
            if problems is not None:
                problems.append(why)
            continue
        if not isinstance(declared, (tuple, list)) or not all(isinstance(m, str) for m in declared):
            logger.warning("built-in tasks %s (%s) must be a tuple of module names, got %r", ep.name, ep.value,
                           type(declared).__name__)
            continue
        modules += [m for m in declared if m not in modules]
    return tuple(modules)


def _shadowed(module: str) -> str:
    """Where the top-level package of `module` is imported from, said when it is not the installed distribution's:
    a folder of the same name in the working directory or on sys.path (a user's own `plugins/`) hides it."""
    import importlib.util  # noqa: PLC0415 - only on this rare path

    top = module.split(".", 1)[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return ""
    where = found and (found.origin or next(iter(found.submodule_search_locations or []), None))
    if not where:
        return ""
    package = Path(where).resolve()
    package = package.parent if package.name == "__init__.py" else package
    if package.parent == Path(__file__).resolve().parents[2]:  # beside bert_engine, as installed (or the source tree)
        return ""
    return (f"; the package {top!r} is imported from {where}: a folder of your own named {top!r} there hides "
            "bert_engine's built-in tasks; rename it or run from another folder")


SLUG = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
# The playground's own endpoints (/plugins, /explain, ...) and the ones it makes per task (/<task>_view, ...):
# a task named so would take the host's endpoint (Gradio gives the later one a "_1" name).
HOST_ENDPOINTS = frozenset({"plugins", "all_tasks", "explain", "compare", "attention"})
HOST_SUFFIXES = ("_view", "_model", "_why", "_compare")

REQUEST_STAGES = ("preprocess", "forward", "postprocess", "explain", "tab handler", "request", "time limit")
IMPORT_TIMEOUT_S = 30.0  # importing a plugin and running its register_tasks hook (BERT_ENGINE_PLUGIN_TIMEOUT)


def is_host_endpoint(name: str) -> bool:
    """Whether the playground serves an endpoint of this name itself (or may, for some task)."""
    return name in HOST_ENDPOINTS or name.endswith(HOST_SUFFIXES)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    version: str
    source: str  # "builtin" or "entry point"
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    version: str
    # "select", "import", "register", "hook", "validate", "duplicate", "tab", or at request time
    # "preprocess", "forward", "postprocess", "explain", "tab handler" (its tab's code answering an event),
    # "request" (elsewhere in its call), "time limit"
    stage: str
    message: str
    source: str = ""              # "builtin" or "entry point" ("" for request-time records)
    location: str | None = None   # "file.py:LINE" of the innermost frame in the plugin's code, when known


@dataclass(frozen=True)
class RegisteredTask:
    """A validated TaskSpec and the plugin that provided it (for provenance)."""

    spec: TaskSpec
    plugin: str
    plugin_version: str

    @functools.cached_property
    def takes_context(self) -> bool:
        """Whether the task's postprocess wants a TaskContext (hookspecs.takes_context)."""
        return takes_context(self.spec.postprocess)


class _Violation(PluginError):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


class UnknownTask(KeyError):
    """No task of that name: a KeyError whose message prints as it reads (a KeyError's own is in quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry:
    """Loaded plugins, their tasks in a stable order, and the plugins that failed."""

    def __init__(self, strict: bool = False, import_timeout_s: float | None = IMPORT_TIMEOUT_S) -> None:
        self.strict = strict
        self.import_timeout_s = import_timeout_s
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(TaskHooks)
        self.tasks: dict[str, RegisteredTask] = {}
        self.plugins: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        self._lock = threading.Lock()

    def task(self, name: str) -> RegisteredTask:
        if name not in self.tasks:
            raise UnknownTask(self.missing(name, f"registered: {', '.join(self.tasks) or 'none'}"))
        return self.tasks[name]

    def missing(self, name: str, known: str) -> str:
        """Why there is no task `name`: the plugins that failed to load, with their reasons, first (a
        plugin whose module is named like the task, e.g. plugins.qa, leads), then what is `known`."""
        loading = [f for f in self.failures if f.stage not in REQUEST_STAGES]
        loading.sort(key=lambda f: f.plugin.rsplit(".", 1)[-1] != name)
        why = "; ".join(f"plugin {f.plugin} failed at {f.stage}: {f.message}" for f in loading)
        return f"no task named {name!r}" + (f" ({why})" if why else "") + f"; {known}"

    MAX_REQUEST_FAILURES = 50

    def record_request_failure(self, task: str, message: str, *, stage: str = "request",
                               location: str | None = None) -> PluginFailure:
        """Note a failure of a task's code while answering a request (it raised or hung) at `stage`,
        so the Plugins tab and `bert-engine plugins --smoke` can show it; the most recent are kept."""
        registered = self.tasks.get(task)
        failure = PluginFailure(registered.plugin if registered else "?", registered.plugin_version if registered else "",
                                stage, f"task {task}: {message}", location=location)
        with self._lock:
            self.failures = [f for f in self.failures if f != failure] + [failure]
            requests = [f for f in self.failures if f.stage in REQUEST_STAGES]
            if len(requests) > self.MAX_REQUEST_FAILURES:
                self.failures.remove(requests[0])
        logger.warning("plugin %s, task %s failed at %s: %s", failure.plugin, task, stage, message)
        return failure

    def record_exception(self, task: str, err: BaseException) -> PluginFailure:
        """`record_request_failure` for an exception a task's request raised: the stage is "time limit"
        for a PredictionTimeout, else the one Predictor noted (inference.request_stage), else "request"."""
        stage = "time limit" if isinstance(err, PredictionTimeout) else getattr(err, "request_stage", None) or "request"
        message = str(err) if isinstance(err, PredictionTimeout) else f"{type(err).__name__}: {err}"
        return self.record_request_failure(task, message, stage=stage, location=failure_location(err))

    def record_failure(self, failure: PluginFailure) -> None:
        with self._lock:
            self.failures.append(failure)
        logger.warning("plugin %s %s failed at %s: %s", failure.plugin, failure.version, failure.stage, failure.message)

    def to_json(self) -> dict[str, Any]:
        return {"plugins": [asdict(p) for p in self.plugins], "failures": [asdict(f) for f in self.failures]}

    def load_plugin(self, name: str, version: str, source: str, load: Callable[[], object]) -> bool:
        """Import one plugin and take its tasks, all or none; a failure is recorded, never raised
        (unless strict). Any BaseException of the plugin's code is contained (SystemExit and
        KeyboardInterrupt included; a real Ctrl-C still stops the process), and importing and
        registering must finish within `import_timeout_s`. Returns whether the plugin loaded."""
        progress = {"stage": "import", "plugin": None}
        try:
            specs = call_with_timeout(self._load_and_register, self.import_timeout_s, name, load, progress,
                                      what=f"plugin {name!r} (import and register_tasks)")
        except BaseException as err:  # any failure of a stranger's code is recorded, not propagated
            if isinstance(err, KeyboardInterrupt) and not raised_by_call(err):
                raise  # Ctrl-C while plugins load: stop, as asked
            if isinstance(err, PredictionTimeout):
                progress["stage"] = progress["stage"] + " (time limit)"
            plugin = progress["plugin"]
            if plugin is not None and self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            stage = getattr(err, "stage", None) if isinstance(err, _Violation) else None
            failure = PluginFailure(name, version, stage or progress["stage"], _message(err), source, failure_location(err))
            self.record_failure(failure)
            if self.strict:
                raise PluginError(f"plugin {name} {version} failed at {failure.stage}: {failure.message}") from err
            return False
        for spec in specs:
            self.tasks[spec.name] = RegisteredTask(spec, name, version)
        self.plugins.append(PluginInfo(name, version, source, tuple(s.name for s in specs)))
        return True

    def _load_and_register(self, name: str, load: Callable[[], object], progress: dict) -> list[TaskSpec]:
        plugin = load()
        progress.update(stage="register", plugin=plugin)
        if self.manager.is_registered(plugin) or self.manager.has_plugin(name):
            raise _Violation("duplicate", f"a plugin named {name!r} is already loaded")
        self.manager.register(plugin, name=name)
        if not any(impl.plugin is plugin for impl in self.manager.hook.register_tasks.get_hookimpls()):
            raise _Violation("register", "implements no bert_engine hook (expected register_tasks)")
        progress["stage"] = "hook"
        specs: list[TaskSpec] = []
        others = [p for p in self.manager.get_plugins() if p is not plugin]
        call = self.manager.subset_hook_caller("register_tasks", remove_plugins=others)
        call(register=lambda spec: specs.append(self._validate(spec, specs)))
        if not specs:
            raise _Violation("validate", "register_tasks registered no task")
        return specs

    def _validate(self, spec: object, pending: list[TaskSpec]) -> TaskSpec:
        if not isinstance(spec, TaskSpec):
            raise _Violation("validate", f"register() expects a TaskSpec, got {type(spec).__name__}")
        problems = []
        if not isinstance(spec.name, str) or not SLUG.match(spec.name):
            problems.append(f"name {spec.name!r} is not a lowercase slug (a-z, 0-9, '_', '-'; max 40)")
        if not isinstance(spec.title, str) or not spec.title.strip():
            problems.append(f"title {spec.title!r} must be a non-empty string")
        for field in ("build_head", "preprocess", "postprocess"):
            if not callable(getattr(spec, field)):
                problems.append(f"{field} must be callable, got {type(getattr(spec, field)).__name__}")
        for field in ("build_tab", "read_data", "training_batch", "loss", "metric", "evaluate", "predict_many",
                      "target_labels", "check_options"):
            value = getattr(spec, field)
            if value is not None and not callable(value):
                problems.append(f"{field} must be callable or None, got {type(value).__name__}")
        fields = spec.input_fields
        if not isinstance(fields, tuple) or not fields or not all(isinstance(f, str) and f.isidentifier() for f in fields):
            problems.append(f"input_fields must be a non-empty tuple of identifiers, got {fields!r}")
        optional = spec.optional_fields
        if not isinstance(optional, tuple) or not all(isinstance(f, str) and f.isidentifier() for f in optional):
            problems.append(f"optional_fields must be a tuple of identifiers, got {optional!r}")
        if not isinstance(spec.options, Mapping) or not all(isinstance(k, str) for k in spec.options):
            problems.append(f"options must be a mapping from names to defaults, got {spec.options!r:.80}")
        tuned = spec.tuned_options
        if not isinstance(tuned, Mapping) or not all(isinstance(k, str) and v in (spec.options or {})
                                                     for k, v in tuned.items()):
            problems.append(f"tuned_options must map metric names to names of options, got {tuned!r:.80}")
        for i, example in enumerate(spec.examples if isinstance(spec.examples, tuple) else ()):
            if not isinstance(example, Mapping) or not set(fields) <= set(example):
                problems.append(f"examples[{i}] must be a mapping with the keys {fields}")
        if not isinstance(spec.examples, tuple):
            problems.append(f"examples must be a tuple, got {type(spec.examples).__name__}")
        if spec.default_checkpoint is not None and not isinstance(spec.default_checkpoint, str):
            problems.append(f"default_checkpoint must be a string or None, got {spec.default_checkpoint!r}")
        labels = spec.labels
        if labels is not None and (not isinstance(labels, tuple) or not labels
                                   or not all(isinstance(label, str) and label for label in labels)
                                   or len(set(labels)) != len(labels)):
            problems.append(f"labels must be None or a non-empty tuple of distinct names, got {labels!r:.80}")
        if spec.best_metric is not None and not isinstance(spec.best_metric, str):
            problems.append(f"best_metric must be a metric's name or None, got {spec.best_metric!r}")
        if not isinstance(spec.aliases, tuple) or not all(isinstance(a, str) and SLUG.match(a) for a in spec.aliases):
            problems.append(f"aliases must be a tuple of lowercase slugs (a-z, 0-9, '_', '-'; max 40), "
                            f"got {spec.aliases!r:.80}")
        elif len(set(spec.aliases)) != len(spec.aliases) or spec.name in spec.aliases:
            problems.append(f"aliases {spec.aliases!r:.80} repeat a name (the task's own, or one another)")
        for hook in ("pipeline_output", "brief", "explain"):
            value = getattr(spec, hook)
            if value is not None and not callable(value):
                problems.append(f"{hook} must be callable or None, got {type(value).__name__}")
        arguments = spec.pipeline_arguments
        if not isinstance(arguments, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in arguments.items()):
            problems.append(f"pipeline_arguments must map argument names to callables, got {arguments!r:.80}")
        if spec.best_metric_goal not in ("max", "min"):
            problems.append(f"best_metric_goal must be 'max' or 'min', got {spec.best_metric_goal!r}")
        host = sorted(n for n in {spec.name, *spec.aliases} if isinstance(n, str) and is_host_endpoint(n))
        if host and isinstance(spec.aliases, tuple):
            problems.append(f"the name(s) {host} are the playground's own endpoints (its {', '.join(sorted(HOST_ENDPOINTS))} "
                            f"and each task's {', '.join('*' + x for x in HOST_SUFFIXES)}); choose another")
        if problems:
            raise _Violation("validate", f"task {spec.name!r}: " + "; ".join(problems))
        names = {spec.name, *spec.aliases}
        taken = sorted(names & {n for t in self.tasks.values() for n in (t.spec.name, *t.spec.aliases)})
        if taken and self.tasks.get(spec.name) is None:
            raise _Violation("duplicate", f"task {spec.name!r}: the name(s) {taken} are already taken by another task")
        owner = self.tasks.get(spec.name)
        if owner is not None or any(s.name == spec.name for s in pending):
            by = f"plugin {owner.plugin!r}" if owner else "the same plugin"
            raise _Violation("duplicate", f"task name {spec.name!r} is already registered by {by}")
        mine = sorted(names & {n for s in pending for n in (s.name, *s.aliases)})
        if mine:
            raise _Violation("duplicate", f"task {spec.name!r}: the name(s) {mine} are already taken by another task "
                                          "of the same plugin")
        # The registry's own copy of the defaults: the plugin's module dict may change later without changing them.
        return dataclasses.replace(spec, options=dict(spec.options))


def _message(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = "; ".join(lines)
    if not isinstance(err, _Violation):  # our own rule violations are the message itself
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text[:500]  # one warning line, whole reason


def failure_location(err: BaseException) -> str | None:
    """'folder/file.py:LINE' of the innermost traceback frame outside bert_engine and the import machinery."""
    tb, found = err.__traceback__, None
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        host = "bert_engine" in path.parts or "playground" in path.parts  # the engine's own checks, not the plugin
        if not host and "importlib" not in path.parts and not path.name.startswith("<"):
            if path.name not in ("threading.py", "contextlib.py") and "pluggy" not in path.parts:
                found = f"{path.parent.name}/{path.name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def load_registry(*, builtins: tuple[str, ...] | None = None, entry_points: bool = True,
                  selected: set[str] | None = None, excluded: set[str] | None = None,
                  strict: bool | None = None) -> Registry:
    """Load built-in task modules, then third-party entry points (sorted by name), each in isolation.

    Args:
        builtins: module names (default builtin_plugins()).
        entry_points: also load the `bert_engine` entry-point group.
        selected: third-party plugin names to load (default: BERT_ENGINE_PLUGINS if set, else all).
        excluded: third-party plugin names not to load (the conformance kit compares one plugin
            against all the others).
        strict: re-raise the first failure (default: BERT_ENGINE_STRICT_PLUGINS).
    """
    timeout = settings.get("BERT_ENGINE_PLUGIN_TIMEOUT") or None
    registry = Registry(strict=settings.get("BERT_ENGINE_STRICT_PLUGINS") if strict is None else strict,
                        import_timeout_s=timeout)
    if builtins is None:
        problems: list[str] = []
        builtins = builtin_plugins(problems)
        if not builtins:  # said where a missing task is explained (Registry.missing), not only logged
            registry.record_failure(PluginFailure(
                "built-in tasks", "", "import", "; ".join(problems) or f"none are installed (entry-point group "
                f"{BUILTIN_GROUP}): install the package (`pip install -e .` in a source tree) or hand "
                "load_registry(builtins=...)", "builtin"))
    for module in builtins:
        short = module.rsplit(".", 1)[-1]
        registry.load_plugin(short, __version__, "builtin", lambda module=module: importlib.import_module(module))
    if not entry_points:
        return registry
    from_setting = selected is None and settings.get("BERT_ENGINE_PLUGINS") is not None
    if from_setting:
        selected = set(settings.get("BERT_ENGINE_PLUGINS"))
    seen: dict[str, str] = {}  # entry-point name -> where the loaded one comes from
    builtin_names = {module.rsplit(".", 1)[-1] for module in builtins}
    installed = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    for ep in installed:
        if (selected is not None and ep.name not in selected) or ep.name in (excluded or ()):
            continue
        version = ep.dist.version if ep.dist is not None else "unknown"
        dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
        origin = f"{dist} {version} ({ep.value})"
        if seen.get(ep.name) == origin:
            continue  # the same distribution found twice on the path (an editable install beside a copy)
        clash = (f"the plugin of {seen[ep.name]}" if ep.name in seen
                 else f"the built-in plugin {ep.name!r}" if ep.name in builtin_names else None)
        if clash is not None:  # named after the distribution, so the Plugins tab says whose package to fix
            registry.record_failure(PluginFailure(
                f"{ep.name} ({dist})", version, "duplicate", f"entry point {ep.name!r} of {origin} "
                f"has the name of {clash}; rename the entry point (only one plugin of a name loads)", "entry point"))
            continue
        seen[ep.name] = origin
        registry.load_plugin(ep.name, version, "entry point", ep.load)
    for name in sorted((selected or set()) - {ep.name for ep in installed}):
        names = ", ".join(ep.name for ep in installed) or "none"
        asked = f"BERT_ENGINE_PLUGINS names {name!r}, which is" if from_setting else f"the plugin {name!r} is"
        registry.record_failure(PluginFailure(name, "", "select", f"{asked} not installed (installed plugins: {names})",
                                              "entry point"))
    return registry
