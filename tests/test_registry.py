"""The registry: plugins from modules and installed entry points, each failure kind recorded."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import install_dist

from bert_engine import hookspecs
from bert_engine.cli import main as cli_main
from bert_engine.hookspecs import InputError, PluginError, TaskSpec, hookimpl
from bert_engine.tasks.conformance import check_task, tiny_predictor
from bert_engine.tasks.registry import Registry, load_registry

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


class LengthHead(torch.nn.Module):
    """A real (tiny) head: one score per sequence from the [CLS] vector."""

    needs_pooler = False

    def __init__(self, config):
        super().__init__()
        self.score = torch.nn.Linear(config.hidden_size, 1)

    def forward(self, encoded):
        return torch.sigmoid(self.score(encoded.last_hidden_state[:, 0])).squeeze(-1)


def _preprocess(inputs, tokenizer, **options):
    if not inputs["text"].strip():
        raise InputError("text is empty")
    batch = tokenizer(inputs["text"])
    batch.meta["text"] = inputs["text"]
    return batch


def _spec(name="toy", **changes):
    values = dict(name=name, title="Toy", build_head=LengthHead, preprocess=_preprocess,
                  postprocess=lambda out, batch, **o: {"score": float(out[0])})
    values.update(changes)
    return TaskSpec(**values)


class ToyPlugin:
    def __init__(self, *specs):
        self.specs = specs or (_spec(),)

    @hookimpl
    def register_tasks(self, register):
        for spec in self.specs:
            register(spec)


def _load(registry, name, plugin):
    return registry.load_plugin(name, "1.0", "test", lambda: plugin)


def test_in_test_plugin_registers_a_task():
    registry = Registry()
    assert _load(registry, "toy", ToyPlugin())
    assert list(registry.tasks) == ["toy"]
    assert registry.plugins[0].tasks == ("toy",) and registry.failures == []


def _raise(error):
    raise error


@pytest.mark.parametrize(
    ("plugin", "stage", "message"),
    [
        (lambda: _raise(ImportError("No module named 'missing_dependency'")), "import", "missing_dependency"),
        (lambda: object(), "register", "implements no bert_engine hook"),
        (lambda: ToyPlugin(_spec(name="Bad Name!")), "validate", "name 'Bad Name!' is not a lowercase slug"),
        (lambda: ToyPlugin(_spec(preprocess="not callable")), "validate", "preprocess must be callable, got str"),
        (lambda: ToyPlugin(_spec(examples=({"wrong": "key"},))), "validate", "examples[0] must be a mapping"),
        (lambda: ToyPlugin(_spec(), _spec()), "duplicate", "task name 'toy' is already registered by the same plugin"),
        (lambda: ToyPlugin(_spec(name="")), "validate", "name '' is not a lowercase slug"),
        (lambda: ToyPlugin(_spec(tuned_options={"best_t": "no_such_option"})), "validate",
         "tuned_options must map metric names to names of options"),
    ],
    ids=["import", "no-hook", "bad-slug", "not-callable", "bad-example", "dup-in-plugin", "empty-name", "bad-tuned"],
)
def test_each_failure_kind_is_recorded_and_the_rest_keep_loading(plugin, stage, message, caplog):
    registry = Registry()
    with caplog.at_level(logging.WARNING):
        assert not registry.load_plugin("broken", "0.1", "test", lambda: plugin() if callable(plugin) else plugin)
    assert _load(registry, "good", ToyPlugin(_spec(name="good")))
    failure = registry.failures[0]
    assert (failure.plugin, failure.version, failure.stage) == ("broken", "0.1", stage)
    assert message in failure.message
    assert list(registry.tasks) == ["good"]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


class RaisingPlugin:
    @hookimpl
    def register_tasks(self, register):
        raise RuntimeError("plugin exploded")


class NotASpecPlugin:
    @hookimpl
    def register_tasks(self, register):
        register({"name": "dict-instead"})


class WrongArgumentPlugin:
    @hookimpl
    def register_tasks(self, registry_typo):  # misnamed argument: pluggy refuses it at registration
        return None


@pytest.mark.parametrize(
    ("plugin", "stage", "message"),
    [
        (RaisingPlugin(), "hook", "RuntimeError: plugin exploded"),
        (NotASpecPlugin(), "validate", "register() expects a TaskSpec, got dict"),
        (WrongArgumentPlugin(), "register", "registry_typo"),
    ],
)
def test_hook_failures(plugin, stage, message):
    registry = Registry()
    assert not _load(registry, "broken", plugin)
    assert registry.failures[0].stage == stage and message in registry.failures[0].message
    assert not registry.manager.get_plugins()  # a failed plugin is unregistered, nothing half-loaded


def test_duplicate_task_name_across_plugins_fails_the_second():
    registry = Registry()
    assert _load(registry, "first", ToyPlugin())
    assert not _load(registry, "second", ToyPlugin())
    assert registry.failures[0].stage == "duplicate"
    assert "already registered by plugin 'first'" in registry.failures[0].message
    assert registry.tasks["toy"].plugin == "first"


def test_strict_mode_reraises(monkeypatch):
    monkeypatch.setenv("BERT_ENGINE_STRICT_PLUGINS", "1")
    registry = load_registry(builtins=(), entry_points=False)
    with pytest.raises(PluginError, match="plugin broken 1.0 failed at hook: RuntimeError: plugin exploded"):
        _load(registry, "broken", RaisingPlugin())


def test_hooks_are_called_with_keywords_so_new_arguments_stay_optional():
    # pluggy passes only the arguments an implementation names: a plugin written against an
    # older, smaller signature keeps working when the host adds an argument.
    registry = Registry()
    _load(registry, "toy", ToyPlugin())
    impl = registry.manager.hook.register_tasks.get_hookimpls()[0]
    assert impl.argnames == ("register",)


def test_provenance_and_conformance_of_an_in_test_task():
    registry = Registry()
    _load(registry, "toy", ToyPlugin())
    predictor = tiny_predictor(registry.task("toy"))
    output = predictor.predict({"text": "hello there"})
    assert set(output["provenance"]) >= {"plugin", "plugin_version", "task", "model", "revision", "device", "latency_ms"}
    assert output["provenance"]["plugin"] == "toy" and output["provenance"]["device"] == "cpu"
    assert check_task(registry.task("toy"), predictor, build_tab=False) == []
    with pytest.raises(InputError, match="unknown option"):
        predictor.predict({"text": "x"}, top_k=3)
    with pytest.raises(InputError, match="input 'text' is missing; the task reads text"):
        predictor.predict({})


def test_conformance_kit_names_an_out_of_range_span():
    bad = _spec(name="badspan", postprocess=lambda out, batch, **o: {
        "entities": [{"start": 0, "end": len(batch.meta["text"]) + 5, "word": batch.meta["text"]}]})
    registry = Registry()
    _load(registry, "badspan", ToyPlugin(bad))
    violations = check_task(registry.task("badspan"), build_tab=False)
    assert violations and {v.rule for v in violations} == {"span"}
    assert "is outside 0 <= start < end <=" in violations[0].message


def test_conformance_kit_names_probabilities_labels_and_crashes():
    bad = _spec(name="badprob", postprocess=lambda out, batch, **o: {
        "labels": [{"label": "yes", "score": 0.7}, {"label": "no", "score": 0.7}], "probability": 1.5})
    crash = _spec(name="crash", preprocess=lambda inputs, tokenizer, **o: inputs["text"][1000000])
    registry = Registry()
    _load(registry, "bad", ToyPlugin(bad, crash))
    rules = {v.rule for v in check_task(registry.task("badprob"), build_tab=False)}
    assert rules == {"probability", "distribution"}
    crashes = check_task(registry.task("crash"), build_tab=False)
    assert crashes and all(v.rule == "input-error" and "IndexError" in v.message for v in crashes)


# -- third-party packages through entry points ---------------------------------------------------------

@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


GOOD_PLUGIN = """
    import torch
    from bert_engine.hookspecs import TaskSpec, hookimpl

    @hookimpl
    def register_tasks(register):
        register(TaskSpec(name="{task}", title="Good", build_head=lambda c: torch.nn.Identity(),
                          preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {{}}))
"""


def test_entry_points_load_in_isolation_and_env_selects(site, monkeypatch):
    install_dist(site, "good-one", GOOD_PLUGIN.format(task="good_one"))
    install_dist(site, "good-two", GOOD_PLUGIN.format(task="good_two"))
    install_dist(site, "broken-import", "import this_module_does_not_exist\n")
    install_dist(site, "broken-hook", """
        from bert_engine.hookspecs import hookimpl
        @hookimpl
        def register_tasks(register):
            raise ValueError("boom")
    """)
    registry = load_registry(builtins=())
    names = {p.name: p for p in registry.plugins}
    assert {"good-one", "good-two"} <= set(names) and names["good-one"].version == "0.3"
    assert names["good-one"].source == "entry point"
    failures = {f.plugin: f for f in registry.failures}
    assert failures["broken-import"].stage == "import" and "this_module_does_not_exist" in failures["broken-import"].message
    assert failures["broken-hook"].stage == "hook" and failures["broken-hook"].version == "0.3"

    monkeypatch.setenv("BERT_ENGINE_PLUGINS", "good-two")
    assert [p.name for p in load_registry(builtins=()).plugins] == ["good-two"]
    monkeypatch.setenv("BERT_ENGINE_PLUGINS", "")
    assert load_registry(builtins=()).plugins == []


def test_cli_plugins_prints_json(site, capsys):
    install_dist(site, "good-one", GOOD_PLUGIN.format(task="good_one"))
    install_dist(site, "broken-import", "import this_module_does_not_exist\n")
    assert cli_main(["plugins"]) == 1  # a failed plugin fails the command, and the JSON still lists everything
    report = json.loads(capsys.readouterr().out)
    assert {"name": "good-one", "version": "0.3", "source": "entry point", "tasks": ["good_one"]} in report["plugins"]
    assert any(f["plugin"] == "broken-import" and f["stage"] == "import" for f in report["failures"])


def test_cli_plugin_check_fails_naming_the_rule(site, capsys):
    install_dist(site, "outofrange", """
        import torch
        from bert_engine.hookspecs import TaskSpec, hookimpl

        @hookimpl
        def register_tasks(register):
            register(TaskSpec(name="outofrange", title="Bad spans", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]),
                              postprocess=lambda o, b, **k: {"spans": [{"start": 3, "end": 2, "word": ""}]}))
    """)
    assert cli_main(["plugin", "check", "outofrange"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert any("span: result.spans[0]: start=3, end=2" in v for v in report["tasks"]["outofrange"]["violations"])


def test_installed_example_plugin_appears_with_its_tab(installed_example, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_example))
    registry = load_registry(builtins=())
    assert "similarity" in registry.tasks
    info = next(p for p in registry.plugins if p.name == "similarity")
    assert info.version == "0.1.0" and info.tasks == ("similarity",)
    task = registry.task("similarity")
    assert check_task(task, data=FIXTURES / "sts_tiny.tsv") == []  # its tab and training side too


def test_installed_example_plugin_gives_real_similarities(installed_example, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_example))
    from bert_engine.runtime.inference import Predictor

    predictor = Predictor.load(load_registry(builtins=()).task("similarity"))
    close = predictor.predict({"text_a": "A man is playing a guitar.", "text_b": "Someone plays an instrument."})
    far = predictor.predict({"text_a": "A man is playing a guitar.", "text_b": "The stock market fell sharply."})
    assert close["result"]["cosine"] > far["result"]["cosine"] + 0.2
    assert close["provenance"]["plugin_version"] == "0.1.0"
    # the figures README.md states for this pair, called through the app's API
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stated = re.search(r'api_name="/similarity"\)` answers cosine (\d\.\d+), score (\d\.\d+)', readme)
    assert stated and (f"{close['result']['cosine']:.3f}", f"{close['result']['score']:.3f}") == stated.groups()


def test_every_hook_is_documented_and_exercised():
    docs = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py"))
    hooks = [name for name in vars(hookspecs.TaskHooks) if not name.startswith("_")]
    assert hooks == ["register_tasks"]
    for name in hooks:
        import inspect

        params = [p for p in inspect.signature(getattr(hookspecs.TaskHooks, name)).parameters if p != "self"]
        assert f"## `{name}({', '.join(params)})`" in docs, f"docs/plugins.md lacks a section for {name}"
        assert f"def {name}(" in tests, f"no test implements the hook {name}"


def test_cli_plugins_smoke_runs_every_task_and_names_the_failing_one(site, capsys, monkeypatch):
    from conftest import reference_checkpoint

    tiny = reference_checkpoint(site / "tiny", "BertForSequenceClassification")
    install_dist(site, "late-failure", f"""
        import torch
        from bert_engine.hookspecs import TaskSpec, hookimpl

        def post(output, batch, **options):
            raise ValueError("broken at request time")

        @hookimpl
        def register_tasks(register):
            register(TaskSpec(name="late", title="Late", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=post,
                              default_checkpoint={str(tiny)!r}, examples=({{"text": "hi"}},)))
    """)
    install_dist(site, "good-one", GOOD_PLUGIN.format(task="good_one"))
    monkeypatch.setattr("plugins.BUILTIN", ())
    assert cli_main(["plugins", "--smoke", "--timeout", "30"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["smoke"]["late"] == "task late: ValueError: broken at request time"  # stage and file:line below
    assert report["smoke"]["good_one"] in ("ok", "no examples to run")
    assert {"plugin": "late-failure", "version": "0.3", "stage": "postprocess", "source": "",
            "message": "task late: ValueError: broken at request time",
            "location": "site/late_failure.py:6"} in report["failures"]


def test_plugin_check_names_a_task_name_another_plugin_owns(site, capsys):
    """Alone the plugin works; beside the built-ins the registry would refuse it whole."""
    install_dist(site, "clash", GOOD_PLUGIN.format(task="sentiment"))
    assert cli_main(["plugin", "check", "clash"]) == 1
    report = json.loads(capsys.readouterr().out)
    violations = report["tasks"]["sentiment"]["violations"]
    assert any("name: task name 'sentiment' is already registered by plugin 'sentiment'" in v for v in violations)


def test_plugin_check_with_data_checks_training(site, tmp_path, capsys):
    install_dist(site, "brokenloss", """
        import torch
        from bert_engine.hookspecs import TaskSpec, hookimpl

        def read_data(path, split):
            for line in open(path):
                yield {"text": line.strip()}, 1

        @hookimpl
        def register_tasks(register):
            register(TaskSpec(name="brokenloss", title="Broken loss", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {},
                              read_data=read_data, loss=lambda output, targets: torch.tensor(float("nan"))))
    """)
    data = tmp_path / "lines.txt"
    data.write_text("one line\nanother line\n")
    assert cli_main(["plugin", "check", "brokenloss"]) == 0  # without data the training side is not checked...
    assert json.loads(capsys.readouterr().out)["tasks"]["brokenloss"]["training"].startswith("not checked")
    assert cli_main(["plugin", "check", "brokenloss", "--data", str(data)]) == 1  # ...with it, it is
    violations = json.loads(capsys.readouterr().out)["tasks"]["brokenloss"]["violations"]
    assert any("training: loss must be a finite scalar tensor" in v for v in violations), violations


def test_without_installed_built_ins_a_missing_task_says_why(monkeypatch):
    """A source tree run without `pip install`: the registry finds no `bert_engine.builtins` entry point
    and says so where a missing task is explained, instead of a bare "no task named"."""
    import importlib.metadata

    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: () if kw.get("group") == "bert_engine.builtins" else real(**kw))
    registry = load_registry(entry_points=False)
    assert registry.tasks == {}
    message = registry.missing("sentiment", "known: none")
    assert "none are installed (entry-point group bert_engine.builtins)" in message and "pip install -e ." in message


def test_two_distributions_with_one_entry_point_name_load_one_and_record_the_other(site):
    install_dist(site, "twin-one", GOOD_PLUGIN.format(task="twin_one"), entry_point="twin")
    install_dist(site, "twin-two", GOOD_PLUGIN.format(task="twin_two"), entry_point="twin")
    registry = load_registry(builtins=())
    (loaded,) = [p for p in registry.plugins if p.name == "twin"]
    (failure,) = registry.failures  # was: the second dropped without a word
    other = "twin-two" if loaded.tasks == ("twin_one",) else "twin-one"
    assert failure.stage == "duplicate" and failure.plugin == f"twin ({other})"
    assert f"entry point 'twin' of {other} 0.3" in failure.message and "has the name of the plugin of twin-" in failure.message


def test_checking_a_built_in_plugin_says_nothing_about_entry_points(site, capsys, caplog):
    """With no entry point of its name installed, `plugin check sentiment` had warned that BERT_ENGINE_PLUGINS
    named an uninstalled plugin (the clash check selected it among the entry points)."""
    assert cli_main(["plugin", "check", "sentiment"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert "not installed" not in caplog.text


def test_an_entry_point_named_like_a_built_in_is_refused_naming_its_distribution(site, capsys):
    install_dist(site, "evil-three", GOOD_PLUGIN.format(task="twin_three"), entry_point="sentiment")
    registry = load_registry()
    (failure,) = [f for f in registry.failures if f.stage == "duplicate"]
    assert failure.plugin == "sentiment (evil-three)" and "the built-in plugin 'sentiment'" in failure.message
    assert "twin_three" not in registry.tasks and "sentiment" in registry.tasks  # the built-in stays
    assert cli_main(["plugin", "check", "sentiment"]) == 1  # was: ok, having checked the built-in
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["failures"][0]["plugin"] == "sentiment (evil-three)"


@pytest.mark.parametrize("specs, message", [
    ((_spec("aa"), _spec("bb", aliases=("aa",))), "task 'bb': the name(s) ['aa'] are already taken by another task "
                                                  "of the same plugin"),
    ((_spec("dd", aliases=("x",)), _spec("ee", aliases=("x",))), "the name(s) ['x'] are already taken"),
    ((_spec("ff", aliases=("Hello World!",)),), "aliases must be a tuple of lowercase slugs"),
    ((_spec("gg", aliases=("g", "g")),), "repeat a name"),
    ((_spec("hh", aliases=("hh",)),), "repeat a name"),
])
def test_aliases_are_checked_within_one_plugin_too(specs, message):
    registry = Registry()
    assert not _load(registry, "aliased", ToyPlugin(*specs))
    (failure,) = registry.failures
    assert message in failure.message and not registry.tasks


def test_the_registry_keeps_its_own_copy_of_a_tasks_defaults():
    defaults = {"top_k": 3}
    registry = Registry()
    assert _load(registry, "toy", ToyPlugin(_spec(options=defaults)))
    defaults.clear()  # the plugin's module dict, changed later (a careless OPTIONS.update or clear)
    assert registry.task("toy").spec.options == {"top_k": 3}


def test_the_kit_reports_a_head_that_cannot_be_built(site, capsys):
    install_dist(site, "nohead", """
        import torch
        from bert_engine.hookspecs import TaskSpec, hookimpl

        def head(config):
            raise RuntimeError("head boom")

        @hookimpl
        def register_tasks(register):
            register(TaskSpec(name="nohead", title="No head", build_head=head,
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {}))
    """)
    assert cli_main(["plugin", "check", "nohead"]) == 1  # was: a traceback, no JSON
    report = json.loads(capsys.readouterr().out)
    assert report["tasks"]["nohead"]["violations"] == [
        "[nohead] build_head: crash: build_head raised RuntimeError: head boom (on the tiny model's config)"]


@pytest.mark.parametrize("arguments, message", [
    ({"truncation": "yes"}, "pipeline_arguments must map argument names to callables"),
    (["truncation"], "pipeline_arguments must map argument names to callables"),
])
def test_pipeline_arguments_are_callables(arguments, message):
    registry = Registry()
    assert not _load(registry, "ported", ToyPlugin(_spec(options={"top_k": 3}, pipeline_arguments=arguments)))
    (failure,) = registry.failures
    assert message in failure.message and not registry.tasks


def test_cli_plugin_check_of_a_name_no_plugin_has_is_the_callers_error(capsys):
    """A typo (`plugin check sentimnet`) was a failed check, exit 1, like a broken plugin: now one line naming
    the plugins there are, exit 2."""
    assert cli_main(["plugin", "check", "sentimnet"]) == 2
    err = capsys.readouterr().err
    assert "no plugin named 'sentimnet' is installed; plugins: " in err and "sentiment" in err


def test_a_folder_named_plugins_where_python_runs_is_named_as_what_hides_the_built_in_tasks(tmp_path):
    """The built-in tasks live in a top-level package `plugins`; a user's own `plugins/` in the working directory
    is imported first. Before, the error said "none are installed ... install the package", which it was."""
    import subprocess
    import sys

    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "__init__.py").write_text("")
    done = subprocess.run([sys.executable, "-c", "from bert_engine import pipeline; pipeline('sentiment')"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "a folder of your own named 'plugins' there hides bert_engine's built-in tasks" in done.stderr, done.stderr
    assert str(tmp_path / "plugins") in done.stderr and "none are installed" not in done.stderr
