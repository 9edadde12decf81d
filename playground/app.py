"""build_app(registry) -> gr.Blocks: one tab per registered task, then Plugins and Attention.

Built once at start-up from the task registry. Models load lazily per task on first use and
stay cached. A task whose tab fails to build gets an error panel in its place, never a blank app.
"""

from __future__ import annotations

import functools
import html
import inspect
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from bert_engine import ui
from bert_engine.cancel import PredictionTimeout, call_with_timeout
from bert_engine.fairness import WAITED, InFlight, TooManyRequests, Waited, visitor_scope
from bert_engine.hookspecs import InputError
from bert_engine.hub import ADAPTER_WEIGHTS, WEIGHT_FILES, HubError
from bert_engine.loading import CheckpointError, inside_any
from bert_engine.lora import looks_local
from bert_engine.precision import pick_device
from bert_engine.precision import resolve as resolve_precision
from bert_engine.registry import REQUEST_STAGES, PluginFailure, Registry, failure_location, load_registry
from bert_engine.serving import BatchingPredictor, LazyPredictor
from plugins.starter import STARTER_ROOT

logger = logging.getLogger(__name__)

MAX_HEATMAP_TOKENS = 96  # larger attention maps are cut to the first tokens, with a notice


# Phones: the tab bar wraps instead of hiding tabs behind an overflow button; wide tables scroll as a whole.
# Phones: Gradio moves the tabs that do not fit into an overflow menu behind a bare "..." button; it
# gets a label, so the other tabs are found. Wide tables and heatmaps scroll inside their own box.
PAGE_CSS = """
.overflow-menu > button::after { content: " More tabs"; font-size: var(--text-md); white-space: nowrap; }
.overflow-menu > button { display: inline-flex; align-items: center; gap: 4px; }
.overflow-dropdown button { display: block; width: 100%; text-align: left; padding: 8px 12px; }
.table-wrap, .attention-wrap { overflow-x: auto; max-width: 100%; }
"""

DEFAULT_TIMEOUT_S = 120.0  # a request a task has not answered by then is cut off with a message


def build_app(registry: Registry | None = None, *, checkpoints: dict[str, str] | None = None,
              device: str | None = None, precision: str = "auto", timeout_s: float | None = DEFAULT_TIMEOUT_S):
    """The playground as a Gradio Blocks app.

    Args:
        registry: the task registry (default: load built-ins and installed plugins).
        checkpoints: task name -> folder or Hub id, overriding each task's default model.
        device: force a device ("cpu", "cuda"); default: CUDA, then MPS, then CPU.
        precision: "auto", "fp32", "bf16", "fp16" or "int8" (bert_engine.precision); checked here
            against the device and CPU, so a precision this machine cannot run fails at start-up
            (PrecisionError) instead of in every tab.
        timeout_s: seconds a prediction may take before the user gets a "cut off" message instead
            (None: no limit). Failures of a task's code show in the Plugins tab.
    """
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built

    resolve_precision(precision, pick_device(device))
    registry = registry or load_registry()
    checkpoints = checkpoints or {}
    model_dirs = allowed_model_dirs()  # a list the picker reads at each use (tests may extend it)
    # Concurrent requests to a one-field task share a forward pass (see BatchingPredictor).
    predictors = {name: BatchingPredictor(task, checkpoints.get(name), device=device, precision=precision,
                                          allowed_dirs=model_dirs, shown_name=shown_model_name)
                  for name, task in registry.tasks.items()}
    in_flight = InFlight()  # per visitor, across the tabs (bert_engine.fairness)
    for name, predictor in predictors.items():
        predictor.predict = guarded(on_gpu(predictor.predict), name, registry, timeout_s, in_flight)
    statuses: dict[str, Any] = {}
    with gr.Blocks(title="bert_engine playground") as app:
        gr.Markdown("# bert_engine playground\nBERT from scratch in PyTorch. "
                    f"{len(registry.tasks)} task(s) from {len(registry.plugins)} plugin(s).")
        for name, task in registry.tasks.items():
            with gr.Tab(task.spec.title, id=name) as tab:
                if task.spec.description:
                    gr.Markdown(task.spec.description)
                statuses[name] = _build_model_picker(gr, name, predictors[name], model_dirs)
                _build_task_tab(gr, task, predictors[name], registry)
            tab.select(functools.partial(model_line, predictors[name]), None, statuses[name],
                       api_visibility="private")
        with gr.Tab("Plugins", id="plugins") as plugins_tab:
            table = _build_plugins_tab(gr, registry)
        # failures since start-up show on opening; not an API endpoint (/plugins is)
        plugins_tab.select(lambda: plugin_rows(registry), None, table, api_visibility="private")
        with gr.Tab("Attention", id="attention"):
            _build_attention_tab(gr, registry, predictors)
        # each visitor's own model line, once the page opens (the warm-up may have loaded the defaults)
        app.load(lambda: model_lines(predictors, statuses), None, list(statuses.values()), api_visibility="private")
    app.predictors = predictors
    app.launch = functools.partial(app.launch, css=ui.CSS + PAGE_CSS, head=ui.KEYBOARD_JS)  # Gradio 6 takes them here
    app.model_dirs = model_dirs
    return app


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


def current_visitor() -> str | None:
    """The Gradio session of the request being served (None outside a Gradio event)."""
    from gradio.context import LocalContext  # noqa: PLC0415 - Gradio loads only where a UI is built

    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None) if request is not None else None


def guarded(predict, task: str, registry: Registry, timeout_s: float | None, in_flight: InFlight | None = None):
    """`predict` with a time limit (cut off and cancelled, see bert_engine.cancel), and a task's own
    failures turned into a clear message in the UI (recorded for the Plugins tab) instead of a stack
    trace; bad input stays the task's InputError. Contains every BaseException a task can raise
    (SystemExit, KeyboardInterrupt, a native library's panic): the server keeps answering."""
    import gradio as gr  # noqa: PLC0415 - Gradio loads only where a UI is built


    in_flight = in_flight or InFlight()

    def call(*args, **kwargs):
        visitor = current_visitor()
        waited = Waited()
        token = WAITED.set(waited)  # the request's thread adds its time at the compute gate
        try:
            with in_flight.admit(visitor), visitor_scope(visitor):  # the visitor's share (fairness.py)
                return call_with_timeout(predict, timeout_s, *args, what=f"task {task!r}", **kwargs)
        except (InputError, gr.Error):
            raise
        except TooManyRequests as err:
            message = str(err)
        except (HubError, CheckpointError) as err:  # the model could not be loaded: say which and why
            message = f"{task}: the model could not be loaded: {err}"
        except PredictionTimeout as err:
            if timeout_s and waited.seconds > timeout_s / 2:  # it waited for other visitors' work, mostly
                logger.info("task %s: a request waited %.0f s of its %g s for the busy machine", task,
                            waited.seconds, timeout_s)
                message = (f"{task}: the machine is busy with other requests ({waited.seconds:.0f} s of the "
                           f"{timeout_s:g} s limit spent waiting); try again in a moment.")
            else:
                registry.record_exception(task, err)
                message = f"{err}. The task may be stuck or the machine overloaded; try again later."
        except BaseException as err:  # a bug in a task's code: the app and the other tabs carry on
            message = _task_failure(task, registry, err)
        finally:
            WAITED.reset(token)
        # Raised here, outside the except blocks, so the error carries no __context__: the failed call's
        # frames (and whatever memory they hold, e.g. after a MemoryError) are freed now.
        raise shown_error(gr, public_message(message))

    return call


def _task_failure(task: str, registry: Registry, err: BaseException) -> str:
    failure = registry.record_exception(task, err)  # logs one warning line with the stage
    if not isinstance(err, MemoryError):  # the traceback, for the operator; err itself is not kept in a record
        logger.error("task %s failed at %s", task, failure.stage, exc_info=(type(err), err, err.__traceback__))
    if isinstance(err, MemoryError):
        return f"{task} ran out of memory on this input; try a shorter one. The other tabs still work."
    return (f"{task} failed in {failure.stage} ({failure.message}); this is a bug in plugin {failure.plugin}, "
            "not in your input. The other tabs still work.")


def on_gpu(function):
    """On a ZeroGPU Space (the `spaces` package is installed) GPU work runs inside `spaces.GPU`;
    elsewhere the function is returned unchanged."""
    try:
        import spaces  # noqa: PLC0415 - only on a ZeroGPU Space
    except ImportError:
        return function
    return spaces.GPU(function)


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
    return f"Model: `{info['model']}` · {info['device']} · {info['dtype']}{head}"


def allowed_model_dirs() -> list[Path]:
    """Folders the model picker may load local checkpoints from: the starter pack, ./models and ./runs,
    plus those in BERT_ENGINE_MODEL_DIRS (separated by the OS path separator)."""
    extra = [Path(p) for p in os.environ.get("BERT_ENGINE_MODEL_DIRS", "").split(os.pathsep) if p.strip()]
    return [STARTER_ROOT, Path.cwd() / "models", Path.cwd() / "runs", *extra]


def recorded_task(folder: Path) -> str | None:
    """The task a model folder was trained for, where it says: a packed folder's manifest.json, or the
    train_config.json of the run whose best/ it is."""
    for record in (folder / "manifest.json", folder.parent / "train_config.json"):
        try:
            task = json.loads(record.read_text(encoding="utf-8")).get("task")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(task, str):
            return task
    return None


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
            if task is not None and recorded_task(folder) not in (None, task):
                continue
            name = short_path(folder) if folder.resolve().is_relative_to(Path.cwd().resolve()) else \
                "/".join(folder.parts[-2:])
            found.setdefault(name, str(folder))
    return dict(sorted(found.items()))


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
    value = value.strip()
    if not value:
        return None
    if known and value in known:
        value = known[value]
    first = value.replace("\\", "/").split("/")[0]
    local = looks_local(value) or first in {Path(root).name for root in allowed} or (Path.cwd() / first).is_dir()
    if not local:
        return value
    if not inside_any(value, allowed):
        raise InputError(f"the local folder {value!r} is outside the folders models may be loaded from "
                         f"({', '.join(short_path(root) for root in allowed)}); set BERT_ENGINE_MODEL_DIRS to allow "
                         "another")
    resolved, cwd = Path(value).expanduser().resolve(), Path.cwd().resolve()
    if not resolved.is_dir():
        raise InputError(f"there is no model folder {value!r} here; pick one from the list, or give a Hub id "
                         "such as owner/name")
    # relative to the working folder where possible, so provenance does not show the server's folders
    return str(resolved.relative_to(cwd)) if resolved.is_relative_to(cwd) else str(resolved)


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


def public_message(message: str) -> str:
    """An error message with the server's folders taken out (they tell a visitor nothing they need)."""
    for folder in sorted({str(Path.cwd().resolve()), str(Path.home())}, key=len, reverse=True):
        message = message.replace(folder + os.sep, "").replace(folder, ".")
    return message


def _build_model_picker(gr, name: str, predictor: LazyPredictor, model_dirs: list[Path]):
    """The tab's model accordion: a list of the checkpoints found in the allowed folders, or any Hub id
    or allowed folder typed in. The choice is the visitor's own (LazyPredictor.switch); returns the
    status line, which the app refreshes when a visitor opens the page or the tab."""
    known = find_checkpoints(model_dirs, name)
    with gr.Accordion("Model", open=False):
        with gr.Row():
            choice = gr.Dropdown(choices=[("default (the task's starter model)", ""), *[(k, k) for k in known]],
                                 value="", allow_custom_value=True, show_label=False, scale=4,
                                 info="a listed model, or a Hub id such as owner/name", filterable=True)
            load = gr.Button("Load", scale=1)
        status = gr.Markdown(describe(predictor))

    def switch(value: str | None) -> str:
        value = (value or "").strip()
        try:
            with visitor_scope(current_visitor()):  # this visitor's model; the others keep theirs
                predictor.switch(check_model_choice(value, model_dirs, find_checkpoints(model_dirs, name)))
                return describe(predictor)
        except InputError as err:
            message = str(err)
        except (HubError, CheckpointError, ValueError, OSError) as err:
            message = f"could not load {value or 'the default'}: {public_message(str(err))}"
        raise shown_error(gr, html.escape(message))  # the toast renders HTML: what the visitor typed is shown as text

    load.click(switch, choice, status, api_name=f"{name}_model")
    return status


def _build_task_tab(gr, task, predictor: LazyPredictor, registry: Registry) -> None:
    if task.spec.build_tab is None:
        gr.Markdown(f"Task `{task.spec.name}` has no tab; use it through the Python API.")
        return
    from gradio.context import get_blocks_context  # noqa: PLC0415 - Gradio loads only where a UI is built

    events = get_blocks_context().fns
    before = set(events)
    try:
        task.spec.build_tab(predictor)
        for key in set(events) - before:  # the tab's own event functions: InputError becomes the UI's message
            events[key].fn = input_errors_shown(gr, events[key].fn)
    except Exception as err:  # a stranger's tab must not take the app down
        registry.record_failure(PluginFailure(task.plugin, task.plugin_version, "tab",
                                              f"task {task.spec.name}: {type(err).__name__}: {err}",
                                              location=failure_location(err)))
        gr.Markdown(f"**The tab of `{task.spec.name}` (plugin {task.plugin} {task.plugin_version}) "
                    f"failed to build:** `{html.escape(str(err))}`")


def shown_error(gr, message: str):
    """The UI's error message for a visitor, logged as one INFO line: Gradio would print a traceback
    to the console for every refused input (the failures of a task's code are logged where caught)."""
    logger.info("answered with an error: %s", message)
    return gr.Error(message, print_exception=False)


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


def _build_plugins_tab(gr, registry: Registry):
    gr.Markdown("Task plugins: the built-ins and installed packages (entry-point group `bert_engine`). "
                "A plugin that failed to load is listed with its reason, as is a task whose code failed or "
                "hung while answering a request; the others work.")
    table = gr.Dataframe(value=plugin_rows(registry), headers=["plugin", "version", "source", "tasks", "status", "reason"],
                         interactive=False, wrap=True)
    refresh = gr.Button("Refresh", size="sm")
    refresh.click(lambda: plugin_rows(registry), None, table, api_name="plugins")
    return table


def attention_html(tokens: list[str], weights, layer: int, head: int | None) -> str:
    """An HTML heatmap of one layer's attention: rows attend (queries) to columns (keys).

    weights: list over layers of (N, T, T) tensors; head None averages the heads.
    """
    matrix = weights[layer].mean(0) if head is None else weights[layer][head]  # (T, T)
    notice = ""
    if len(tokens) > MAX_HEATMAP_TOKENS:
        notice = f"<p>Showing the first {MAX_HEATMAP_TOKENS} of {len(tokens)} tokens.</p>"
        tokens, matrix = tokens[:MAX_HEATMAP_TOKENS], matrix[:MAX_HEATMAP_TOKENS, :MAX_HEATMAP_TOKENS]
    peak = float(matrix.max()) or 1.0
    cells = []
    header = "".join(f'<th class="col">{html.escape(t)}</th>' for t in tokens)
    for i, token in enumerate(tokens):
        row = "".join(
            f'<td title="{html.escape(token)} → {html.escape(tokens[j])}: {float(w):.3f}" '
            f'style="background: rgba(37, 99, 235, {float(w) / peak:.3f})"></td>'
            for j, w in enumerate(matrix[i]))
        cells.append(f"<tr><th>{html.escape(token)}</th>{row}</tr>")
    which = "mean of all heads" if head is None else f"head {head}"
    return (f"<p>Layer {layer}, {which}. Each row is a token attending to the columns; hover a cell for its weight.</p>"
            f"{notice}<div style='overflow:auto'><table class='attention'><tr><th></th>{header}</tr>"
            f"{''.join(cells)}</table></div>"
            "<style>.attention td{width:14px;height:14px;padding:0;border:1px solid #eee}"
            ".attention th{font-size:11px;font-weight:normal;white-space:nowrap;padding:0 4px}"
            ".attention th.col{writing-mode:vertical-rl;transform:rotate(180deg)}</style>")


def _build_attention_tab(gr, registry: Registry, predictors: dict[str, LazyPredictor]) -> None:
    gr.Markdown("The attention of the last input of a task tab: pick the tab, a layer and a head.")
    names = list(registry.tasks)
    with gr.Row():
        task = gr.Dropdown(choices=[(registry.tasks[n].spec.title, n) for n in names],
                           value=names[0] if names else None, label="Last input of")
        layer = gr.Number(value=0, precision=0, minimum=0, label="Layer")
        head = gr.Number(value=0, precision=0, minimum=0, label="Head")
        average = gr.Checkbox(value=False, label="Average heads")
    show = gr.Button("Show attention", variant="primary")
    heatmap = gr.HTML()

    def render(task_name: str | None, layer_index: Any, head_index: Any, mean: bool) -> str:
        if not task_name or task_name not in predictors:
            raise shown_error(gr, "pick a task tab first")
        try:
            with visitor_scope(current_visitor()):  # this visitor's own last input, never another's
                tokens, weights = predictors[task_name].attention()
        except InputError as err:
            raise shown_error(gr, str(err)) from None
        num_layers, num_heads = len(weights), weights[0].shape[0]
        layer_index, head_index = int(layer_index or 0), int(head_index or 0)
        if not 0 <= layer_index < num_layers:
            raise shown_error(gr, f"layer {layer_index} does not exist; the model has layers 0..{num_layers - 1}")
        if not mean and not 0 <= head_index < num_heads:
            raise shown_error(gr, f"head {head_index} does not exist; each layer has heads 0..{num_heads - 1}")
        return attention_html(tokens, weights, layer_index, None if mean else head_index)

    show.click(render, [task, layer, head, average], heatmap, api_name="attention")
