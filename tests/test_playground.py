"""The playground: tabs from the registry, the Plugins and Attention views, and a real server."""

import socket

import gradio as gr
import pytest
import torch
from gradio_client import Client

from bert_engine.hookspecs import TaskSpec, hookimpl
from bert_engine.registry import Registry, load_registry
from playground import build_app
from playground.app import attention_html, plugin_rows


class BrokenTabPlugin:
    @hookimpl
    def register_tasks(self, register):
        def build_tab(predictor):
            raise RuntimeError("tab exploded")

        register(TaskSpec(name="broken_tab", title="Broken tab", build_head=lambda c: torch.nn.Identity(),
                          preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {},
                          build_tab=build_tab))


@pytest.fixture
def registry(installed_example, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_example))
    registry = load_registry(builtins=())
    registry.load_plugin("broken-tab", "0.0.1", "test", BrokenTabPlugin)
    registry.load_plugin("broken-import", "0.0.2", "test", lambda: __import__("no_such_module_here"))
    return registry


def _tab_labels(app):
    return [block.label for block in app.blocks.values() if isinstance(block, gr.Tab)]


def test_one_tab_per_task_then_plugins_and_attention(registry):
    app = build_app(registry)
    labels = _tab_labels(app)
    assert labels[:2] == ["Similarity", "Broken tab"]
    assert labels[-2:] == ["Plugins", "Attention"]
    assert not any(p.loaded for p in app.predictors.values())  # models load lazily


def test_broken_plugin_and_broken_tab_are_visible_not_fatal(registry):
    app = build_app(registry)
    markdown = " ".join(str(b.value) for b in app.blocks.values() if isinstance(b, gr.Markdown))
    assert "failed to build" in markdown and "tab exploded" in markdown
    rows = plugin_rows(registry)
    assert ["similarity", "0.1.0", "entry point", "similarity", "loaded", ""] in rows
    failed = [r for r in rows if r[0] == "broken-import"][0]
    assert failed[4] == "failed at import" and "no_such_module_here" in failed[5]


def test_attention_html_marks_every_cell_and_caps_long_inputs():
    tokens = ["[CLS]", "hi", "<b>", "[SEP]"]
    weights = [torch.softmax(torch.randn(2, 4, 4), dim=-1)]
    page = attention_html(tokens, weights, layer=0, head=1)
    assert page.count("<td") == 16 and "&lt;b&gt;" in page and "<b>" not in page.split("<table")[1]
    long_tokens = [f"t{i}" for i in range(120)]
    long_page = attention_html(long_tokens, [torch.full((1, 120, 120), 1 / 120)], layer=0, head=None)
    assert "Showing the first 96 of 120 tokens" in long_page and long_page.count("<td") == 96 * 96


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_app_answers_gradio_client(registry):
    app = build_app(registry)
    app.queue(default_concurrency_limit=2)
    port = _free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        label, output = client.predict("A man is playing a guitar.", "Someone plays an instrument.",
                                       api_name="/similarity")
        assert output["task"] == "similarity" and 0.0 <= output["result"]["score"] <= 1.0
        assert output["provenance"]["plugin"] == "similarity" and output["provenance"]["latency_ms"] > 0
        heatmap = client.predict("similarity", 0, 0, True, api_name="/attention")
        assert "[CLS]" in heatmap and "mean of all heads" in heatmap
        with pytest.raises(Exception, match="text_a is empty"):
            client.predict("   ", "text", api_name="/similarity")
        with pytest.raises(Exception, match="layer 9 does not exist"):
            client.predict("similarity", 9, 0, False, api_name="/attention")
    finally:
        app.close()
