"""Hostile or broken plugins cannot take the process down, hang it, or keep the CPU, a lock or memory.

Each test is one attack from the hardening review: BaseExceptions (SystemExit, KeyboardInterrupt, a
native panic's BaseException) at import, in the hook and at request time; a plugin that loops or
sleeps forever; a MemoryError whose frames would keep gigabytes alive.
"""

import json
import threading
import time
import weakref

import gradio as gr
import pytest
import torch
from conftest import assert_cpu_goes_quiet, install_dist

from bert_engine.cli import main as cli_main
from bert_engine.hookspecs import TaskSpec, hookimpl
from bert_engine.tasks.conformance import tiny_predictor
from bert_engine.tasks.registry import Registry, load_registry
from playground.app import guarded


class PanicLike(BaseException):
    """What pyo3 raises for a Rust panic (tokenizers' PanicException derives from BaseException)."""


GOOD = """
    import torch
    from bert_engine.hookspecs import TaskSpec, hookimpl

    @hookimpl
    def register_tasks(register):
        register(TaskSpec(name="good", title="Good", build_head=lambda c: torch.nn.Identity(),
                          preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {}))
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    install_dist(folder, "good-plugin", GOOD)
    return folder


@pytest.mark.parametrize("statement, stage, message", [
    ("raise SystemExit(3)", "import", "SystemExit: 3"),
    ("raise KeyboardInterrupt('from the plugin')", "import", "KeyboardInterrupt: from the plugin"),
    ("import os; os._exit", "register", "implements no bert_engine hook"),
])
def test_base_exceptions_at_import_are_recorded_and_the_others_load(site, statement, stage, message):
    install_dist(site, "hostile", statement + "\n")
    registry = load_registry(builtins=())
    assert [p.name for p in registry.plugins] == ["good-plugin"]
    (failure,) = registry.failures
    assert (failure.plugin, failure.stage, failure.source) == ("hostile", stage, "entry point")
    assert failure.message.startswith(message)
    assert not failure.message.startswith("_Violation")


@pytest.mark.parametrize("raise_it", ["raise SystemExit(1)", "raise KeyboardInterrupt", "raise GeneratorExit"])
def test_base_exceptions_in_the_hook_are_recorded_with_file_and_line(site, raise_it):
    install_dist(site, "hostile", f"""
        from bert_engine.hookspecs import hookimpl

        @hookimpl
        def register_tasks(register):
            {raise_it}
    """)
    registry = load_registry(builtins=())
    (failure,) = registry.failures
    assert failure.stage == "hook" and failure.location == "site/hostile.py:6"
    assert [p.name for p in registry.plugins] == ["good-plugin"]


def test_a_plugin_that_hangs_at_import_is_cut_off_and_stops_using_the_cpu(site, monkeypatch):
    install_dist(site, "spinner", "while True:\n    pass\n")
    monkeypatch.setenv("BERT_ENGINE_PLUGIN_TIMEOUT", "1")
    start = time.monotonic()
    registry = load_registry(builtins=())
    assert time.monotonic() - start < 10
    (failure,) = registry.failures
    assert failure.stage == "import (time limit)" and "did not finish within 1 s" in failure.message
    assert [p.name for p in registry.plugins] == ["good-plugin"]
    assert_cpu_goes_quiet()


def test_plugins_command_exits_1_with_a_failure_and_names_an_uninstalled_selection(site, monkeypatch, capsys):
    install_dist(site, "hostile", "raise SystemExit(0)\n")
    assert cli_main(["plugins"]) == 1
    monkeypatch.setenv("BERT_ENGINE_PLUGINS", "good-plugin,not-installed")
    registry = load_registry(builtins=())
    (failure,) = registry.failures
    assert failure.stage == "select"
    assert "BERT_ENGINE_PLUGINS names 'not-installed', which is not installed" in failure.message
    assert "good-plugin" in failure.message and "hostile" in failure.message
    monkeypatch.delenv("BERT_ENGINE_PLUGINS")  # asked for by name (`bert-engine plugin check nosuch`): no setting named
    (failure,) = load_registry(builtins=(), selected={"nosuch"}).failures
    assert failure.message.startswith("the plugin 'nosuch' is not installed (installed plugins: ")


SLOPPY = """
    import math, os, subprocess, sys
    import torch
    from bert_engine.hookspecs import TaskSpec, hookimpl
    from bert_engine.runtime.inference import predict_texts

    print("sloppy prints at import")

    def pre(inputs, tokenizer, **options):
        if os.environ.get("SLOPPY") == "value":
            raise ValueError("pre boom")
        if os.environ.get("SLOPPY") == "none":
            return None
        text = inputs["text"]
        inputs["text"], inputs["extra"] = "MUTATED", 1  # the caller's dict, were it handed over
        return tokenizer(text)

    def answer():
        mode = os.environ.get("SLOPPY")
        if mode == "nan":
            return {"score": math.nan}
        if mode == "set":
            return {"labels": {"a"}}
        if mode == "raise":
            raise RuntimeError("post boom")
        return {"ok": True}

    def post(output, batch, **options):
        print("sloppy prints in postprocess")
        if os.environ.get("SLOPPY") == "raw":  # past print(): straight to file descriptor 1, and a child process
            os.write(1, b"sloppy writes to fd 1\\n")
            subprocess.run([sys.executable, "-c", "print('sloppy child prints')"], check=True)
        rows = len(batch)
        return [answer() for _ in range(rows)] if rows > 1 else answer()  # a batch: one result per row

    def head(config):
        if os.environ.get("SLOPPY") == "head":
            raise RuntimeError("head boom")
        if os.environ.get("SLOPPY") == "head-value":
            raise ValueError("head value boom")
        return torch.nn.Identity()

    @hookimpl
    def register_tasks(register):
        print("sloppy prints in its hook")
        register(TaskSpec(name="sloppy", title="Sloppy", build_head=head,
                          preprocess=pre, postprocess=post, predict_many=predict_texts))  # files: batched
"""


@pytest.mark.parametrize("mode, message", [
    ("nan", "task sloppy failed in postprocess (ResultNotJSON: sloppy: the result holds NaN or infinity"),
    ("set", "task sloppy failed in postprocess (ResultNotJSON: sloppy: the result is not JSON data (Object of type set"),
    ("raise", "task sloppy failed in postprocess (RuntimeError: post boom)"),
    ("value", "task sloppy failed in preprocess (ValueError: pre boom)"),  # not the user's input error (exit 2)
    ("none", "task sloppy failed in preprocess (PluginError: sloppy: preprocess returned NoneType, not the Batch"),
    ("head", "task sloppy failed in build_head (RuntimeError: head boom)"),  # was a traceback
    ("head-value", "task sloppy failed in build_head (ValueError: head value boom)"),  # was exit 2, as for bad input
])
def test_the_cli_says_in_one_line_which_plugin_failed_where(site, monkeypatch, capsys, mode, message):
    install_dist(site, "sloppy", SLOPPY)
    monkeypatch.setenv("SLOPPY", mode)
    assert cli_main(["predict", "sloppy", "-i", "text=hello"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = [x for x in err.splitlines() if x.startswith("bert-engine predict: error:")]
    assert message in line and line.endswith("this is a bug in plugin sloppy, not in your input")
    assert "Traceback" not in err


def test_a_plugin_that_prints_cannot_break_the_clis_json(site, monkeypatch, capsys, tmp_path):
    install_dist(site, "sloppy", SLOPPY)
    assert cli_main(["plugins"]) == 0
    out, err = capsys.readouterr()
    assert "sloppy" in [p["name"] for p in json.loads(out)["plugins"]]  # stdout is the JSON alone
    assert "sloppy prints at import" in err and "sloppy prints in its hook" in err
    assert cli_main(["predict", "sloppy", "-i", "text=hello"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["result"] == {"ok": True} and "sloppy prints in postprocess" in err
    lines = tmp_path / "in.txt"
    lines.write_text("one\ntwo\n")
    monkeypatch.setenv("SLOPPY", "nan")
    assert cli_main(["predict", "sloppy", "--file", str(lines)]) == 1  # every line failed, each says why
    out, _ = capsys.readouterr()
    answers = [json.loads(x) for x in out.splitlines()]
    assert [a["line"] for a in answers] == [1, 2]
    assert all("the result holds NaN or infinity" in a["error"] and "bug in plugin sloppy" in a["error"]
               for a in answers)
    monkeypatch.setenv("SLOPPY", "raise")  # an exception: each line says so too, the file is read to its end
    assert cli_main(["predict", "sloppy", "--file", str(lines)]) == 1
    answers = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [a["line"] for a in answers] == [1, 2]
    assert all("task sloppy failed in postprocess (RuntimeError: post boom)" in a["error"] for a in answers)


def test_a_plugin_cannot_change_the_callers_inputs(site):
    from bert_engine import pipeline
    from bert_engine.runtime.inference import Predictor

    install_dist(site, "sloppy", SLOPPY)
    task = load_registry(builtins=()).task("sloppy")
    inputs = {"text": "hello"}
    Predictor.load(task).predict(inputs)
    assert inputs == {"text": "hello"}
    pipeline("sloppy")(inputs)
    assert inputs == {"text": "hello"}


# -- request time ----------------------------------------------------------------------------------

FREED: list = []
RELEASE = threading.Event()  # ends the catch-all loop below


def _postprocess(behaviour):
    def post(output, batch, **options):
        if behaviour == "system-exit":
            raise SystemExit(2)
        if behaviour == "keyboard":
            raise KeyboardInterrupt
        if behaviour == "panic":
            raise PanicLike("a Rust panic")
        if behaviour == "spin":
            while True:  # a pure-Python loop that also swallows ordinary exceptions
                try:
                    sum(range(1000))
                except Exception:
                    pass  # the attack: swallow whatever reaches it
        if behaviour == "spin-catch-all":
            # a careless loop whose `except BaseException` takes every cancellation. A cancellation can also land
            # on the loop's own test or its jump back, outside the `try` (a flaky run of the test below: the loop
            # ended, the task answered again); the outer loop takes those too, so only RELEASE ends it
            while not RELEASE.is_set():
                try:
                    while not RELEASE.is_set():
                        try:
                            sum(range(1000))
                        except BaseException:
                            continue  # the careless part: the cancellation is taken, and the loop goes round again
                except BaseException:
                    continue
        if behaviour == "sleep":
            time.sleep(30)
        if behaviour == "memory":
            big = torch.ones(50_000_000)  # 200 MB held by this frame
            FREED.append(weakref.ref(big))
            raise MemoryError
        return {"ok": True}
    return post


def _serve(behaviour, timeout_s=1.0):
    """A registered task with that postprocess on a tiny model, behind the playground's guard."""
    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            register(TaskSpec(name="hostile", title="Hostile", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=_postprocess(behaviour)))

    registry = Registry()
    assert registry.load_plugin("hostile-plugin", "0.1", "test", lambda: Plugin())
    predictor = tiny_predictor(registry.task("hostile"))
    return registry, predictor, guarded(predictor.predict, "hostile", registry, timeout_s)


@pytest.mark.parametrize("behaviour, message", [
    ("system-exit", "SystemExit: 2"),
    ("keyboard", "KeyboardInterrupt"),
    ("panic", "PanicLike: a Rust panic"),
])
def test_base_exceptions_at_request_time_become_a_message_and_a_record(behaviour, message):
    registry, predictor, call = _serve(behaviour)
    with pytest.raises(gr.Error, match=f"hostile failed in postprocess \\(task hostile: {message}"):
        call({"text": "hello"})
    (failure,) = registry.failures
    assert failure.stage == "postprocess" and failure.location.startswith("security/test_hostile_plugins.py:")
    # the same model still runs: the failed request released its lock
    rows = predictor.forward_rows(predictor.tokenizer("hello").model_inputs())
    assert rows.last_hidden_state.shape[0] == 1


@pytest.mark.parametrize("behaviour", ["spin", "sleep"])
def test_a_cut_off_request_frees_its_model_and_the_cpu(behaviour):
    registry, predictor, call = _serve(behaviour, timeout_s=0.5)
    with pytest.raises(gr.Error, match="did not finish within 0.5 s and was cut off"):
        call({"text": "hello"})
    assert registry.failures[-1].stage == "time limit"
    # The next request gets the model: the cut-off one let go of its lock, or was made to give it up.
    start = time.monotonic()
    predictor.forward_rows(predictor.tokenizer("hello").model_inputs())  # takes the model's lock
    waited = time.monotonic() - start
    assert waited < 5, f"the model's lock was held {waited:.1f} s after the time limit"
    if behaviour == "spin":
        assert_cpu_goes_quiet()


def test_a_request_that_will_not_stop_takes_its_task_off_until_it_ends(monkeypatch):
    """A loop catching BaseException survives every cancellation (Python cannot kill a thread): once it has
    outlived STUCK_AFTER_S, its task refuses further requests, so visitors cannot pile up spinning threads,
    and answers again when the thread ends."""
    from bert_engine.runtime import cancel

    monkeypatch.setattr(cancel, "STUCK_AFTER_S", 0.5)
    monkeypatch.setattr(cancel, "WATCH_STUCK_EVERY_S", 0.1)
    RELEASE.clear()
    registry, _, call = _serve("spin-catch-all", timeout_s=0.3)
    try:
        with pytest.raises(gr.Error, match="did not finish within 0.3 s and was cut off"):
            call({"text": "hello"})
        deadline = time.monotonic() + 10
        while not any("still ran" in f.message for f in registry.failures) and time.monotonic() < deadline:
            time.sleep(0.05)
        (stuck,) = [f for f in registry.failures if "still ran" in f.message]
        assert stuck.stage == "time limit" and stuck.plugin == "hostile-plugin"
        started = time.monotonic()
        with pytest.raises(gr.Error, match="hostile is off for now: one of its requests still runs after it was "
                                           "cut off; this is a bug in plugin hostile-plugin"):
            call({"text": "hello"})
        assert time.monotonic() - started < 0.2  # refused at once, no second thread started
    finally:
        RELEASE.set()  # the loop ends; the task answers again
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert call({"text": "hello"})["result"] == {"ok": True}
            break
        except gr.Error:
            time.sleep(0.1)
    else:
        pytest.fail("the task stayed off after its stuck request ended")


def test_a_request_stuck_with_a_picked_model_turns_off_that_model_not_the_task(monkeypatch):
    """Keyed by the task alone, one visitor's request stuck with the model they picked (its files the likely cause)
    turned the task off for every visitor until it ended (session 57's list): now that model alone is off, and the
    whole task only once StuckTasks.MAX_PER_TASK requests are stuck (picking model after model piles up no more)."""
    from bert_engine.runtime import cancel
    from playground.app import StuckTasks

    monkeypatch.setattr(cancel, "STUCK_AFTER_S", 0.5)
    monkeypatch.setattr(cancel, "WATCH_STUCK_EVERY_S", 0.1)
    RELEASE.clear()
    spin = _postprocess("spin-catch-all")

    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            register(TaskSpec(name="hostile", title="Hostile", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]),
                              postprocess=lambda o, b, **k: spin(o, b, **k) if picked["model"] else {"ok": True}))

    picked = {"model": None}
    registry = Registry()
    assert registry.load_plugin("hostile-plugin", "0.1", "test", lambda: Plugin())
    predictor = tiny_predictor(registry.task("hostile"))
    stuck = StuckTasks(registry)
    call = guarded(predictor.predict, "hostile", registry, 0.3, stuck=stuck, model_of=lambda: picked["model"])

    def stuck_threads(count):
        deadline = time.monotonic() + 10
        while sum("still ran" in f.message for f in registry.failures) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    try:
        picked["model"] = "owner/odd-model"
        with pytest.raises(gr.Error, match="cut off"):
            call({"text": "hello"})
        stuck_threads(1)
        with pytest.raises(gr.Error, match="hostile with the model you picked is off for now: .* pick another model"):
            call({"text": "hello"})
        picked["model"] = None
        assert call({"text": "hello"})["result"] == {"ok": True}  # everyone else's model still answers
        picked["model"] = "owner/another-odd-model"
        with pytest.raises(gr.Error, match="cut off"):
            call({"text": "hello"})
        stuck_threads(2)
        picked["model"] = None  # two stuck: the task is off for every model
        with pytest.raises(gr.Error, match="hostile is off for now: one of its requests still runs"):
            call({"text": "hello"})
    finally:
        RELEASE.set()
    deadline = time.monotonic() + 5
    while stuck.holds("hostile", None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stuck.holds("hostile", None) and not stuck.holds("hostile", "owner/odd-model")


def test_memory_of_a_failed_request_is_released():
    FREED.clear()
    _, _, call = _serve("memory", timeout_s=60.0)  # not a time-limit test: 200 MB may take over 1 s on a busy machine
    with pytest.raises(gr.Error, match="ran out of memory on this input") as caught:
        call({"text": "hello"})
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert FREED and FREED[0]() is None, "the 200 MB tensor of the failed call is still alive (without a gc pass)"


def test_a_task_that_changes_a_default_in_place_cannot_carry_one_request_into_the_next():
    """A list default appended to by preprocess: each request starts from the declared default, so one
    visitor's request never reaches another's (the defaults are copied per request)."""
    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            def pre(inputs, tokenizer, *, tags):
                tags.append(inputs["text"])  # careless: the default list itself
                return tokenizer(inputs["text"])

            register(TaskSpec(name="appends", title="Appends", build_head=lambda c: torch.nn.Identity(),
                              options={"tags": ["a"]}, preprocess=pre,
                              postprocess=lambda output, batch, *, tags: {"tags": list(tags)}))

    registry = Registry()
    assert registry.load_plugin("appends", "0.1", "test", lambda: Plugin())
    predictor = tiny_predictor(registry.task("appends"))
    assert [predictor.predict({"text": t})["result"]["tags"] for t in ("x", "y")] == [["a", "x"], ["a", "y"]]
    assert registry.task("appends").spec.options == {"tags": ["a"]}


def test_a_task_changing_torchs_process_settings_is_put_back_and_named(monkeypatch):
    """torch.set_num_threads and set_default_dtype are process-wide: one request of one task would slow
    or break every later request of every task. The playground puts them back and records the task."""
    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            def post(output, batch, **options):
                torch.set_num_threads(1)
                torch.set_default_dtype(torch.float64)
                return {"ok": True}

            register(TaskSpec(name="global", title="Global", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=post))

    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    registry = Registry()
    assert registry.load_plugin("global-plugin", "0.1", "test", lambda: Plugin())
    predictor = tiny_predictor(registry.task("global"))
    call = guarded(predictor.predict, "global", registry, 30.0)
    try:
        assert call({"text": "hello"})["result"] == {"ok": True}
        seen = []  # a thread started now (as the next request's is) takes torch's process-wide count
        reader = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        reader.start()
        reader.join()
        assert (seen[0], torch.get_default_dtype()) == (threads, dtype)
        (failure,) = registry.failures
        assert failure.plugin == "global-plugin" and "changed torch's thread count to 1" in failure.message
        assert "default dtype to torch.float64" in failure.message
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


def test_writes_past_print_cannot_break_the_clis_json(site, tmp_path):
    """A write to file descriptor 1 or a child process's output: stdout is still the CLI's JSON alone."""
    import os
    import subprocess
    import sys

    install_dist(site, "sloppy", SLOPPY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), "SLOPPY": "raw"}
    done = subprocess.run([sys.executable, "-m", "bert_engine", "predict", "sloppy", "-i", "text=hello"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["result"] == {"ok": True}
    assert "sloppy writes to fd 1" in done.stderr and "sloppy child prints" in done.stderr
