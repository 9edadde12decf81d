"""bert_engine/settings.py: every BERT_ENGINE_* variable is declared there, read only through it, checked,
and documented in docs/settings.md."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_engine import settings

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for folder in ("bert_engine", "plugins", "playground") for p in (ROOT / folder).rglob("*.py")] + [ROOT / "app.py"]


def test_every_variable_the_code_names_is_declared_and_read_only_through_settings():
    for path in CODE:
        text = path.read_text(encoding="utf-8")
        for name in set(re.findall(r"BERT_ENGINE_[A-Z0-9_]+", text)):
            assert name in settings.SETTINGS, f"{path.relative_to(ROOT)} names {name}, which settings.py does not declare"
        if path.name != "settings.py":
            assert not re.search(r"environ(?:\.get)?\s*[\[(]\s*[\"']BERT_ENGINE_", text), path.relative_to(ROOT)


def test_docs_settings_md_is_the_table():
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert settings.table() in text and text.count("| variable |") == 1  # the one table, nothing else mangled
    assert len(text) < 2 * len(settings.table()) + 2000
    assert "docs/settings.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_values_are_converted_and_bad_ones_named(monkeypatch):
    assert settings.get("BERT_ENGINE_TIMEOUT") == 120.0 and settings.get("BERT_ENGINE_MCP") is True
    monkeypatch.setenv("BERT_ENGINE_TIMEOUT", "30")
    monkeypatch.setenv("BERT_ENGINE_MCP", "off")
    monkeypatch.setenv("BERT_ENGINE_PLUGINS", "a, b,")
    assert settings.get("BERT_ENGINE_TIMEOUT") == 30.0 and settings.get("BERT_ENGINE_MCP") is False
    assert settings.get("BERT_ENGINE_PLUGINS") == {"a", "b"}
    for name, value, message in (("BERT_ENGINE_TIMEOUT", "soon", "must be a number, got 'soon'"),
                                 ("BERT_ENGINE_MAX_IN_FLIGHT", "-1", "must not be negative"),
                                 ("BERT_ENGINE_MCP", "maybe", "must be 1/0")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} {message}"):
            settings.get(name)


def test_the_cli_reads_the_precision_setting(monkeypatch, capsys):
    from bert_engine.cli import main

    monkeypatch.setenv("BERT_ENGINE_PRECISION", "fp99")
    assert main(["predict", "sentiment", "--input", "text=a fine film"]) == 2  # the setting reached the command: refused
    assert "fp99" in capsys.readouterr().err


def test_the_defaults_the_readme_states_are_the_settings_defaults():
    """README.md names settings with their defaults ("`BERT_ENGINE_TIMEOUT` (default 120 s)"): each stated
    number is the table's default, so a changed default cannot leave the README behind."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stated = {}
    for number, name in re.findall(r"(\d[\d,.]*)\s+(?:[\w.]+\s+){0,8}?\(`(BERT_ENGINE_\w+)`\)", readme):
        stated[name] = number
    for name, number in re.findall(r"`(BERT_ENGINE_\w+)` \((?:default )?(\d[\d,.]*)", readme):
        stated[name] = number
    assert len(stated) >= 4, stated
    for name, number in stated.items():
        default = settings.SETTINGS[name].default
        assert float(number.replace(",", "")) == float(default), (name, number, default)


def test_the_app_refuses_to_start_on_a_bad_value_naming_it(monkeypatch):
    """Not every request failing later, blamed on a task's plugin: one line and exit 2 before anything loads."""
    import subprocess
    import sys

    monkeypatch.setenv("BERT_ENGINE_MAX_GFLOP", "nan")
    with pytest.raises(ValueError, match="BERT_ENGINE_MAX_GFLOP must be a finite number, got 'nan'"):
        settings.check_all()
    env = {**os.environ, "BERT_ENGINE_MAX_GFLOP": "abc", "GRADIO_SERVER_PORT": "1"}
    done = subprocess.run([sys.executable, "app.py"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "ERROR app: BERT_ENGINE_MAX_GFLOP must be a number, got 'abc'" in done.stderr.splitlines()
    monkeypatch.delenv("BERT_ENGINE_MAX_GFLOP")
    # 0 requests at once (the app built, then aborted: its models still loading) and a port Gradio reads at its
    # import (a traceback there): one line each, before anything loads
    for name, value, said in (("BERT_ENGINE_CONCURRENCY", "0", "BERT_ENGINE_CONCURRENCY must be at least 1, got '0'"),
                              ("GRADIO_SERVER_PORT", "abc", "GRADIO_SERVER_PORT must be a port number from 1 to "
                                                            "65535, got 'abc'")):
        done = subprocess.run([sys.executable, "app.py"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "GRADIO_SERVER_PORT": "1", name: value})
        assert done.returncode == 2 and "Traceback" not in done.stderr and f"ERROR app: {said}" in done.stderr, \
            done.stderr[-1500:]


def test_the_app_refuses_a_taken_port_and_a_missing_device_in_one_line():
    """An outside test: a port already in use was Gradio's traceback, then a native abort (exit 134), and
    BERT_ENGINE_DEVICE=cuda on a CPU build of torch a 15-line traceback; one line each now, exit 2, before any
    model loads."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "app.py"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1"})
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR") or "Traceback" in line]
    assert done.returncode == 2 and errors == [
        f"ERROR app: port {port} on 127.0.0.1 is in use (GRADIO_SERVER_PORT): stop what listens there or set "
        "GRADIO_SERVER_PORT to another port"], done.stderr[-1500:]
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, "app.py"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "GRADIO_SERVER_PORT": "1", "BERT_ENGINE_DEVICE": "cuda"})
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-1500:]
        assert "ERROR app: BERT_ENGINE_DEVICE: device 'cuda': " in done.stderr


@pytest.mark.parametrize("missing", ["PIL", "gradio"])
def test_the_app_without_the_playgrounds_packages_says_which_extra_to_install(missing):
    """`pip install bert-engine` leaves out Gradio and Pillow: `python app.py` ended in a ModuleNotFoundError
    traceback; one line naming the missing package and the extra, exit 2. Gradio too, which the playground
    imports only when it builds the UI (without it, the traceback came from there)."""
    import subprocess
    import sys

    script = (f"import runpy, sys; sys.modules[{missing!r}] = None; sys.argv = ['app.py']; "
              "runpy.run_path('app.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "GRADIO_SERVER_PORT": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-1500:]
    assert (f"ERROR app: the playground needs {missing}, which is not installed: pip install "
            "'bert-engine[playground]' (or -r requirements.txt)") in done.stderr
