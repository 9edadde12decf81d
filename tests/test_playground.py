"""The playground: tabs from the registry, the Plugins and Attention views, and a real server."""

import contextlib
import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import gradio as gr
import pytest
import torch
from gradio_client import Client

from bert_engine import ui
from bert_engine.hookspecs import TaskSpec, hookimpl
from bert_engine.tasks.registry import load_registry
from playground import attention, build_app
from playground.app import gpu_seconds, plugin_rows, single_text_tasks


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
    registry = load_registry()
    registry.load_plugin("broken-tab", "0.0.1", "test", BrokenTabPlugin)
    registry.load_plugin("broken-import", "0.0.2", "test", lambda: __import__("no_such_module_here"))
    return registry


def _tab_labels(app):
    return [block.label for block in app.blocks.values() if isinstance(block, gr.Tab)]


def test_one_tab_per_task_then_plugins_and_attention(registry):
    app = build_app(registry)
    labels = _tab_labels(app)
    assert labels[:7] == ["Sentiment", "Named entities", "Question answering", "Summary", "Fill-mask", "Similarity",
                          "Broken tab"]
    assert labels[-3:] == ["All tasks", "Plugins", "Attention"]
    assert not any(p.loaded for p in app.predictors.values())  # models load lazily


def test_broken_plugin_and_broken_tab_are_visible_not_fatal(registry):
    app = build_app(registry)
    markdown = " ".join(str(b.value) for b in app.blocks.values() if isinstance(b, gr.Markdown))
    assert "failed to build" in markdown and "tab exploded" in markdown
    rows = plugin_rows(registry)
    assert ["similarity", "0.1.0", "entry point", "similarity", "loaded", ""] in rows
    failed = [r for r in rows if r[0] == "broken-import"][0]
    assert failed[4] == "failed at import" and "no_such_module_here" in failed[5]
    assert failed[2] == "test"  # where the failed plugin came from (the fixture loads it as "test")
    tab = [r for r in rows if r[0] == "broken-tab"]
    assert tab[0][4] == "tab failed"  # not "loaded"
    assert tab[1][4] == "failed at tab" and "RuntimeError: tab exploded" in tab[1][5]


def test_attention_pictures_follow_the_input_and_links_read_as_text():
    tokens = ["[CLS]", "hi", "<b>", "[SEP]"]
    weights = [torch.softmax(torch.randn(12, 4, 4), dim=-1) for _ in range(2)]
    matrix = attention.head_matrix(weights, 1, 3)
    assert torch.equal(matrix, weights[1][3]) and torch.allclose(attention.head_matrix(weights, 0, None),
                                                                 weights[0].mean(0))
    small = attention.heatmap_image(tokens, matrix)
    long_tokens = [f"token{i}" for i in range(120)]
    cut_tokens, cut_weights, notice = attention.cut(long_tokens, [torch.full((12, 120, 120), 1 / 120)])
    assert len(cut_tokens) == 48 and cut_weights[0].shape == (12, 48, 48) and "tokens 0-47 of 120" in notice
    later, _, notice = attention.cut(long_tokens, [torch.full((12, 120, 120), 1 / 120)], start=100)
    assert later[0] == "token72" and "tokens 72-119 of 120" in notice  # the window stays inside the input
    big = attention.heatmap_image(cut_tokens, cut_weights[0][0])
    assert small.width < big.width <= 800 and big.height <= 800  # cells shrink as the input grows
    corner = small.crop((small.width - attention.BUTTONS_PX + 2, 0, small.width, small.height // 2))
    assert corner.getextrema() == ((255, 255), (255, 255), (255, 255))  # under the image's buttons: no label
    assert attention.PLOT_PX // attention.MAX_TOKENS >= 13  # labels of 11 px or more at the most tokens shown
    grid = attention.head_grid_image(cut_weights, 0)
    assert grid.width <= 700 and grid.height <= 700  # 12 heads, 4 to a row
    links = attention.strongest_links(tokens, matrix)
    assert links.count("<tr>") == 5 and "&lt;b&gt;" in links and "<b>" not in links.split("<tbody>")[1]
    assert re.search(r"\d+ %", links)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(app, **kwargs) -> int:
    """app.launch on a free loopback port, returned. Gradio gives its new server about 2.5 s to answer its own
    check of the port; on a machine busy with the rest of the suite that check once timed out ("localhost is
    not accessible"), so such a launch is tried again, three times at most."""
    for attempt in range(3):
        port = _free_port()
        try:
            app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **kwargs)
            return port
        except ValueError as err:
            if "localhost is not accessible" not in str(err) or attempt == 2:
                raise
            app.close()
    raise AssertionError("unreachable")


@pytest.fixture
def served(registry):
    app = build_app(registry)
    app.queue(default_concurrency_limit=2)
    port = _launch(app)
    try:
        yield app, f"http://127.0.0.1:{port}/"
    finally:
        app.close()


def _labels(bars: dict) -> set[str]:
    """The labels of the sentiment tab's Label as the page event answers it: the tab returns the component (its
    title says when a long text was read only in part), which reaches a client as an update holding the value."""
    return {c["label"] for c in (bars["value"] if bars.get("__type__") == "update" else bars)["confidences"]}


def test_every_task_endpoint_answers_through_gradio_client(served):
    """`/<task>` (the documented API and the MCP tool) answers JSON text: the result and its provenance;
    `/<task>_view` is the tab's own event, answering with the page's components."""
    app, url = served
    client = Client(url, verbose=False)
    answer = json.loads(client.predict("A gorgeous, witty movie.", "", "truncate", api_name="/sentiment"))
    assert answer["task"] == "sentiment" and answer["result"]["label"] == "POSITIVE" and answer["provenance"]["model"]
    answer = json.loads(client.predict("Who wrote it?", "Moby-Dick was written by Herman Melville.", 2, api_name="/qa"))
    assert answer["result"]["answer"] == "Herman Melville"
    with pytest.raises(Exception, match="nbest must be an integer in \\[1, 20\\], got 2.5"):  # not read as 2
        client.predict("Angela Merkel visited Paris.", True, 2.5, "model", api_name="/ner")
    assert json.loads(client.predict("Angela Merkel visited Paris.", True, 2.0, "model", api_name="/ner"))["result"]
    with pytest.raises(Exception, match="expected true or false, got 'yes'"):  # (was read as true)
        client.predict("Angela Merkel visited Paris.", "yes", 2, "model", api_name="/ner")
    assert json.loads(client.predict("Angela Merkel visited Paris.", "false", 2, "model", api_name="/ner"))["result"][
        "constrained"] is False  # (JSON clients may send the word)
    # a slider's number sent as text or null (an API or MCP caller): read as the number or the default, and
    # anything else is named (Gradio's slider had failed with "the upstream Gradio app has raised an exception")
    assert json.loads(client.predict("Who wrote it?", "Moby-Dick was written by Herman Melville.", "2",
                                     api_name="/qa"))["result"]["answers"][1]
    assert json.loads(client.predict("Who wrote it?", "Moby-Dick was written by Herman Melville.", None,
                                     api_name="/qa"))["result"]["answer"] == "Herman Melville"
    with pytest.raises(Exception, match="Candidates \\(top-k\\): expected a number, got 'many'"):
        client.predict("Who wrote it?", "Moby-Dick was written by Herman Melville.", "many", api_name="/qa")
    # a number past the page's slider is the task's to judge, and its refusal names the option (Gradio's said
    # "Value 50 is greater than maximum value 20.", naming nothing, and logged a traceback)
    with pytest.raises(Exception, match="ner: nbest must be an integer in \\[1, 20\\], got 50"):
        client.predict("Angela Merkel visited Paris.", True, 50, api_name="/ner")
    assert len(json.loads(client.predict("Who wrote it?", "Moby-Dick was written by Herman Melville.", 12,
                                         api_name="/qa"))["result"]["answers"]) >= 1  # the task takes up to 50
    every = json.loads(client.predict("Angela Merkel visited Paris.", api_name="/all_tasks"))
    assert {"sentiment", "ner", "summary"} <= set(every) and every["ner"]["result"]["entities"]
    assert "has no [MASK] token" in every["fill_mask"]["error"]  # a task that refused the text says so, as its card
    label, output = client.predict("A man is playing a guitar.", "Someone plays an instrument.", api_name="/similarity_view")
    assert output["task"] == "similarity" and 0.0 <= output["result"]["score"] <= 1.0
    assert output["provenance"]["plugin"] == "similarity" and output["provenance"]["latency_ms"] > 0
    bars, output = client.predict("A gorgeous, witty movie.", "", "truncate", api_name="/sentiment_view")
    assert output["task"] == "sentiment" and _labels(bars) == {"NEGATIVE", "POSITIVE"}
    view, candidates, output = client.predict("Who wrote it?", "Moby-Dick was written by Herman Melville.", 2, "eager",
                                              api_name="/qa_view")  # an undocumented endpoint: every input given
    assert output["task"] == "qa" and candidates.count('class="be-bar"') == 2  # two answers, as bars
    assert "sure the text does not say it (this setting says “no answer” above" in candidates  # the decision
    assert "Answer: <b>" in view and '<mark class="be-mark qa-answer"' in view
    view, output = client.predict("The capital of France is [MASK].", 3, "independent", "", api_name="/fill_mask_view")
    assert output["task"] == "fill_mask" and view.count('class="be-bar"') == 3
    html, words, paths, transitions, output = client.predict("Tim Cook visited Berlin.", True, 2, "model",
                                                             api_name="/ner_view")
    assert output["task"] == "ner" and [row[0] for row in words["data"]] == ["Tim", "Cook", "visited", "Berlin", "."]
    assert len(paths["headers"]) == 3 and transitions.count("<tr>") == 10  # word + 2 paths; header + 9 tags
    assert [row[0] for row in paths["data"]] == ["Tim", "Cook", "visited", "Berlin", "."]  # lined up with the words
    # "Read capital letters": the starter was trained with them, so "model" is "on"; "off" is another input
    results = {choice: client.predict("Tim Cook visited Berlin.", True, 2, choice, api_name="/ner_view")[-1]["result"]
               for choice in ("model", "on", "off")}
    assert results["model"] == results["on"] != results["off"]
    assert all(float(row[3].rstrip(" %<")) <= 100 for row in words["data"])  # probabilities never above 1
    summary, html, dropped, output = client.predict("One short line. " * 3 + "A much longer sentence follows here.",
                                                    "1 sentence", 4, "auto", api_name="/summary_view")
    assert output["task"] == "summary" and summary == "A much longer sentence follows here."
    assert 'class="sentence chosen"' in html
    caption, heatmap, grid, links = client.predict("similarity", 0, 0, True, 0, api_name="/attention")
    assert "mean of its heads" in caption and "[CLS]" in links
    assert Path(heatmap).suffix == ".png" and Path(grid).suffix == ".png"
    cards, outputs = client.predict("Angela Merkel visited Paris.", api_name="/all_tasks_view")
    assert set(outputs) == {"sentiment", "ner", "summary", "broken_tab", "fill_mask"}
    assert "Angela Merkel (PER" in cards and "has no [MASK] token" in cards  # fill-mask refused it: its card says why
    assert "has no [MASK] token" in outputs["fill_mask"]["error"] and "result" not in outputs["fill_mask"]  # and the JSON


def test_the_api_names_every_input_and_output_and_has_one_endpoint_per_task(served):
    """What gradio_client and the MCP server see: one endpoint per task named after it, the other
    inputs optional, every output named; the model picker and the attention view are per browser
    session and stay out of the documented API."""
    app, url = served
    info = Client(url, verbose=False).view_api(return_format="dict", print_info=False)
    endpoints = info["named_endpoints"]
    tasks = [name for name in app.predictors if name != "broken_tab"]
    assert set(endpoints) == {f"/{name}" for name in tasks} | {"/all_tasks", "/plugins", "/explain", "/compare"}
    assert not info["unnamed_endpoints"]
    required = {name: [p["parameter_name"] for p in e["parameters"] if not p["parameter_has_default"]]
                for name, e in endpoints.items()}
    assert required["/sentiment"] == required["/fill_mask"] == ["text"]  # no pair, no targets
    unnamed = {name: [r["label"] for r in e["returns"] if not r["label"] or r["label"].startswith("value_")]
               for name, e in endpoints.items()}
    assert not any(unnamed.values()), unnamed


def test_every_task_is_an_mcp_tool_answering_a_real_mcp_client(registry):
    import asyncio

    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    app = build_app(registry)
    app.queue(default_concurrency_limit=2)
    port = _launch(app, mcp_server=True)

    async def session_calls():
        async with streamable_http_client(f"http://127.0.0.1:{port}/gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = {tool.name: tool for tool in (await session.list_tools()).tools}
                answer = await session.call_tool("sentiment", {"text": "A gorgeous, witty, seductive movie."})
                refused = await session.call_tool("ner", {"text": "   "})
                explained = await session.call_tool("explain", {
                    "task": "sentiment", "inputs": json.dumps({"text": "A gorgeous, witty movie."}), "steps": 8})
                plugins = await session.call_tool("plugins", {})
                return tools, answer, refused, explained, plugins

    try:
        tools, answer, refused, explained, plugins = asyncio.run(session_calls())
    finally:
        app.close()
    tasks = {name for name in app.predictors if name != "broken_tab"}
    assert tasks | {"all_tasks", "plugins", "explain", "compare"} == set(tools)
    assert "sequence-classification" in tools["sentiment"].description  # the task's own description
    assert tools["sentiment"].inputSchema["required"] == ["text"]
    for name in tasks:  # every task's tool: task-named inputs, each described
        properties = tools[name].inputSchema["properties"]
        assert not any(key.endswith("_value") for key in properties), (name, list(properties))
        assert all(p.get("description") for p in properties.values()), (name, properties)
    assert set(tools["qa"].inputSchema["properties"]) == {"question", "context", "top_k", "no_answer"}
    assert set(tools["compare"].inputSchema.get("required", [])) <= {"task", "inputs"}  # "" models: the defaults
    for name in ("explain", "compare"):  # the why and compare tools: every input described
        properties = tools[name].inputSchema["properties"]
        assert {"task", "inputs"} <= set(properties) and all(p.get("description") for p in properties.values())
    # ... in full: Gradio reads an `Args:` entry's first line only, and wrapped ones reached MCP clients cut
    # mid-sentence ("for a task of one text field, the"; "cautious (when in"); each is one line now (one_line_args)
    for name in tasks | {"explain", "compare"}:
        for key, schema in tools[name].inputSchema["properties"].items():
            assert schema["description"].rstrip().endswith((".", ")", '"')), (name, key, schema["description"])
    assert tools["compare"].inputSchema["properties"]["inputs"]["description"].endswith("the text itself.")
    why = json.loads(" ".join(part.text for part in explained.content if part.type == "text"))
    assert not explained.isError and why["targets"][0]["name"] == "POSITIVE" and why["steps"] == 8
    text = " ".join(part.text for part in answer.content if part.type == "text")
    assert not answer.isError and json.loads(text)["result"]["label"] == "POSITIVE"  # JSON, not the page's HTML
    assert refused.isError and "the text is empty" in " ".join(p.text for p in refused.content if p.type == "text")
    listed = json.loads(" ".join(part.text for part in plugins.content if part.type == "text"))  # JSON, not a repr
    assert not plugins.isError and {"sentiment", "qa"} <= {row["plugin"] for row in listed}


def test_all_tasks_takes_the_single_text_tasks(registry):
    assert single_text_tasks(registry) == ["sentiment", "ner", "summary", "fill_mask", "broken_tab"]


def test_the_gpu_time_asked_of_zerogpu_follows_the_input():
    assert gpu_seconds({"text": "short"}) == 6
    assert gpu_seconds({"question": "Who?", "context": "x" * 39_996}) == 15  # 10 s more for ~10k tokens
    assert gpu_seconds({"text": "short"}, loaded=False) == 36  # the model still has to load
    assert gpu_seconds({"text": "x" * 10_000_000}, limit_s=120) == 120  # never past the request's limit


def test_the_app_imports_and_answers_with_spaces_installed_without_touching_cuda(tmp_path):
    """The real `spaces` package (ZeroGPU's decorator) off a Space: the app imports, builds and answers on
    the CPU, and CUDA is never initialised (ZeroGPU attaches a GPU only inside the decorated call)."""
    import subprocess
    import sys

    pytest.importorskip("spaces")
    script = (
        "import torch, importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('space_app', 'app.py')\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "import spaces; from playground import build_app\n"
        "app = build_app()\n"
        "out = app.predictors['sentiment'].predict({'text': 'A gorgeous, witty, seductive movie.'})\n"
        "assert out['result']['label'] == 'POSITIVE', out\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok', out['provenance']['device'])\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["ok", "cpu"]


def test_bad_input_is_a_message_not_a_stack_trace(served):
    app, url = served
    client = Client(url, verbose=False)
    with pytest.raises(Exception, match="text_a is empty"):
        client.predict("   ", "text", api_name="/similarity")
    with pytest.raises(Exception, match="has no \\[MASK\\] token"):
        client.predict("no mask here", 3, "independent", "", api_name="/fill_mask")
    with pytest.raises(Exception, match="the context is empty"):
        client.predict("Who?", "", 1, api_name="/qa")
    with pytest.raises(Exception, match="ner: the text is empty"):
        client.predict(" ", True, 3, api_name="/ner")
    with pytest.raises(Exception, match="summary: the document is empty"):
        client.predict("", "3 sentences", 4, "auto", api_name="/summary")
    with pytest.raises(Exception, match="no input yet"):  # the failed QA call left no input to show
        client.predict("qa", 0, 0, False, 0, api_name="/attention")


def _raw_call(url: str, endpoint: str, data: list) -> tuple[str, dict]:
    """POST through Gradio's HTTP API as any client may (JSON can carry lone surrogates, which
    gradio_client cannot send), then read the event stream: (event, its data)."""
    body = json.dumps({"data": data}).encode()  # ensure_ascii: "\\ud800" travels as an escape
    request = urllib.request.Request(f"{url}gradio_api/call{endpoint}", body, {"Content-Type": "application/json"})
    event_id = json.load(urllib.request.urlopen(request, timeout=30))["event_id"]
    stream = urllib.request.urlopen(f"{url}gradio_api/call{endpoint}/{event_id}", timeout=60).read().decode()
    # (a slow answer comes after one or more heartbeats: "event: heartbeat" / "data: null")
    events = re.findall(r"event: (\w+)\ndata:(.*)", stream)
    event, data = next((e, d) for e, d in events if e != "heartbeat")
    return event, json.loads(data)


def test_lone_surrogates_over_raw_http_get_a_message_naming_them(served, registry):
    """Every task endpoint, with a lone surrogate in each text field: a clear error, never {"error": null}."""
    app, url = served
    info = json.load(urllib.request.urlopen(f"{url}gradio_api/info", timeout=30))["named_endpoints"]
    tasks = {e for e in info if e.lstrip("/") in registry.tasks}
    assert tasks, info.keys()
    for endpoint in sorted(tasks):
        data = ["a \ud800 text. [MASK] more." if p["type"].get("type") == "string" and "enum" not in p["type"]
                else p["parameter_default"] for p in info[endpoint]["parameters"]]
        event, payload = _raw_call(url, endpoint, data)
        assert event == "error" and "lone surrogate '\\ud800'" in payload["error"], (endpoint, payload)


def test_the_attention_view_shows_each_visitor_only_their_own_input(served):
    """Two browser sessions on one server: neither sees the other's text in the attention view."""
    app, url = served
    alice, bob = Client(url, verbose=False), Client(url, verbose=False)
    alice.predict("alice wrote a private diary entry", "", "truncate", api_name="/sentiment")
    with pytest.raises(Exception, match="no input yet"):
        bob.predict("sentiment", 0, 0, True, 0, api_name="/attention")
    bob.predict("bob's shopping list", "", "truncate", api_name="/sentiment")
    assert "diary" not in bob.predict("sentiment", 0, 0, True, 0, api_name="/attention")[3]  # the links as text
    assert "diary" in alice.predict("sentiment", 0, 0, True, 0, api_name="/attention")[3]
    # the model's whole range through the API (MiniLM: 6 layers of 12 heads), and a clear refusal past it
    caption = alice.predict("sentiment", 5, 11, False, 0, api_name="/attention")[0]
    assert "layer 5 of 6, head 11 of 12" in caption and "Sentiment" in caption
    with pytest.raises(Exception, match=r"layer 6 does not exist; the model has layers 0\.\.5"):
        alice.predict("sentiment", 6, 0, False, 0, api_name="/attention")


def test_a_refused_input_is_one_log_line_not_a_traceback(served, capfd, caplog):
    import logging

    app, url = served
    client = Client(url, verbose=False)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="playground.app"), pytest.raises(Exception, match="the text is empty"):
        client.predict("   ", "", "truncate", api_name="/sentiment")
    assert "Traceback" not in capfd.readouterr().err
    lines = [r.getMessage() for r in caplog.records if "the text is empty" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("answered with an error: sentiment: the text is empty"), lines
    # what Gradio itself refused before any handler ran (a value missing, a choice not offered) was a 23-30 line
    # traceback in the log each, and a mapping sent for a text was classified as its Python spelling
    for data, said in ((["hi"], "expected 3 inputs \\(Text, "), ([{"a": 1}, "", "truncate"], "Text: expected text, got dict"),
                       (["hi", "", "bogus"], "bogus")):
        event, payload = _raw_call(url, "/sentiment", data)
        assert event == "error" and re.search(said, payload["error"] or ""), (data, payload)
    assert "Traceback" not in capfd.readouterr().err


def test_model_picker_switches_and_reports_errors(served, tmp_path):
    from conftest import reference_checkpoint

    app, url = served
    client = Client(url, verbose=False)
    for outside in ("/no/such/folder", "/etc", "../../../etc/passwd", str(tmp_path)):
        with pytest.raises(Exception, match="is outside the folders models may be loaded from"):
            client.predict(outside, api_name="/sentiment_model")
    with pytest.raises(Exception, match="could not load owner/missing-model"):  # a Hub id: tried, and named
        client.predict("owner/missing-model", api_name="/sentiment_model")
    app.model_dirs.append(tmp_path)
    folder = reference_checkpoint(tmp_path / "stars", "BertForSequenceClassification",
                                  id2label={i: f"{i + 1} stars" for i in range(5)})
    status = client.predict(str(folder), api_name="/sentiment_model")
    shown = f"{tmp_path.name}/stars"  # outside the working folder: without the server's folders
    assert f"`{shown}`" in status and "head not trained" not in status
    bars, output = client.predict("Great value.", "", "truncate", api_name="/sentiment_view")
    assert _labels(bars) == {f"{i + 1} stars" for i in range(5)}
    assert output["provenance"]["model"] == shown


def test_a_hub_model_picked_in_the_app_downloads_within_the_request_time_limit(registry, fake_hub, tmp_path,
                                                                              monkeypatch, tiny_tokenizer):
    """A visitor types a Hub id whose server sends a byte every 0.2 s (no read ever times out): the load is
    stopped by the app's request limit (not BERT_ENGINE_DOWNLOAD_TIMEOUT's half hour) and said so."""
    import huggingface_hub.constants as hub_constants

    from bert_engine import PRESETS, BertWithHead, save_pretrained

    monkeypatch.setattr(hub_constants, "ENDPOINT", fake_hub.endpoint)  # what HF_ENDPOINT sets at import
    monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        fake_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_hub.repos[("owner/slow", "main")] = save_pretrained(
        BertWithHead(PRESETS["tiny"].with_labels(["neg", "pos"]), "sequence").eval(), tmp_path / "slow", tiny_tokenizer)
    fake_hub.faults["model.safetensors"] = "trickle"
    app = build_app(registry, timeout_s=3)
    app.queue(default_concurrency_limit=8)
    port = _launch(app)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        started = time.monotonic()
        with pytest.raises(Exception, match="downloading .*model.safetensors.* of .*owner/slow.* ran past its time limit"):
            client.predict("owner/slow", api_name="/sentiment_model")
        assert time.monotonic() - started < 15
        # one session's loads are requests: 2 run, 2 wait for a place, the rest are refused at once
        jobs = [client.submit("owner/slow", api_name="/sentiment_model") for _ in range(6)]
        errors = []
        for job in jobs:
            with pytest.raises(Exception) as caught:
                job.result(timeout=30)
            errors.append(str(caught.value))
        assert sum("wait for their answers before sending more" in e for e in errors) >= 2, errors
    finally:
        app.close()


def test_a_fifo_or_huge_manifest_in_the_model_folders_does_not_stall_the_picker(tmp_path):
    """Files a folder says about itself (manifest.json, config.json, train_config.json) are read as metadata:
    inside the folder, size-capped, regular files only; a FIFO, which blocks when opened, is skipped."""
    import os

    from conftest import reference_checkpoint

    from playground.app import family_label, find_checkpoints

    folder = reference_checkpoint(tmp_path / "models" / "evil", "BertForSequenceClassification")
    os.mkfifo(folder / "manifest.json")
    huge = reference_checkpoint(tmp_path / "models" / "big" / "best", "BertForSequenceClassification")
    with open(huge.parent / "train_config.json", "wb") as handle:  # 5 MB, sparse: over the 4 MB metadata cap
        handle.truncate(5 * 2**20)
    done = {}
    worker = threading.Thread(target=lambda: done.update(found=find_checkpoints([tmp_path / "models"], "sentiment"),
                                                         family=family_label(folder)), daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the picker's scan blocked on a FIFO"
    assert set(done["found"].values()) == {str(folder), str(huge)} and done["family"] == "BERT"
    os.unlink(folder / "config.json")
    os.mkfifo(folder / "config.json")
    assert family_label(folder) == "?"


def test_a_visitors_model_choice_is_theirs_alone(served, tmp_path):
    """Two sessions: one switches the sentiment model; the other keeps the default, and its model line
    and answers never show the first one's choice."""
    from conftest import reference_checkpoint

    app, url = served
    app.model_dirs.append(tmp_path)
    folder = reference_checkpoint(tmp_path / "stars", "BertForSequenceClassification",
                                  id2label={i: f"{i + 1} stars" for i in range(5)})
    alice, bob = Client(url, verbose=False), Client(url, verbose=False)
    default_labels = _labels(bob.predict("Great value.", "", "truncate", api_name="/sentiment_view")[0])
    alice.predict(str(folder), api_name="/sentiment_model")
    stars = {f"{i + 1} stars" for i in range(5)}
    assert _labels(alice.predict("Great value.", "", "truncate", api_name="/sentiment_view")[0]) == stars
    bars, output = bob.predict("Great value.", "", "truncate", api_name="/sentiment_view")
    assert _labels(bars) == default_labels != stars
    assert "stars" not in output["provenance"]["model"]
    alice.predict("", api_name="/sentiment_model")  # back to the default: for alice only, as before
    assert _labels(alice.predict("Fine.", "", "truncate", api_name="/sentiment_view")[0]) == default_labels


def test_a_web_address_in_the_model_picker_is_answered_with_the_hub_id_to_type():
    """A visitor pasting the Hub page's address was told it was a local folder outside the allowed ones, and to set
    the server's BERT_ENGINE_MODEL_DIRS (the browser audit)."""
    from bert_engine.hookspecs import InputError
    from playground.app import check_model_choice

    with pytest.raises(InputError, match="is a web address; give a Hub id such as owner/name; for this one, "
                                         "'google/bert_uncased_L-2_H-128_A-2'"):
        check_model_choice("https://huggingface.co/google/bert_uncased_L-2_H-128_A-2", [Path("models")])
    with pytest.raises(InputError, match="'ftp://x/y' is a web address"):
        check_model_choice("ftp://x/y", [Path("models")])


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    from bert_engine.hookspecs import InputError
    from playground.app import check_model_choice, find_checkpoints

    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    (runs / "sst2" / "best").mkdir(parents=True)
    (runs / "sst2" / "best" / "config.json").write_text("{}")
    (runs / "sst2" / "best" / "model.safetensors").write_bytes(b"")
    (runs / "sst2" / "train_config.json").write_text('{"task": "sentiment"}')
    (runs / "sst2" / "last").mkdir()  # resume state: never listed
    (runs / "sst2" / "last" / "config.json").write_text("{}")
    (runs / "sst2" / "last" / "model.safetensors").write_bytes(b"")
    assert find_checkpoints([runs], "sentiment") == {"runs/sst2/best": str(runs / "sst2" / "best")}
    assert find_checkpoints([runs], "ner") == {}  # trained for another task
    outside = tmp_path / "elsewhere" / "model"  # a link from an allowed folder to one outside: not listed (it cannot load)
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    (outside / "model.safetensors").write_bytes(b"")
    (runs / "linked").symlink_to(outside)
    assert list(find_checkpoints([runs], "sentiment")) == ["runs/sst2/best"]
    assert check_model_choice("runs/sst2/best", [runs]) == "runs/sst2/best"
    for typo in ("runs/sst3", "runs/sst2/bset"):
        with pytest.raises(InputError, match="there is no model folder"):
            check_model_choice(typo, [runs])
    # what exists in the working folder outside the allowed ones is not asked: a file there and a name that is
    # nowhere are both Hub ids (one was "outside the folders", the other a Hub error: a visitor could tell them apart)
    (tmp_path / "secret.txt").write_text("x")
    (tmp_path / "private").mkdir()
    assert check_model_choice("secret.txt", [runs]) == "secret.txt"
    assert check_model_choice("nothing.txt", [runs]) == "nothing.txt"
    assert check_model_choice("private/x", [runs]) == "private/x" == check_model_choice("nowhere/x", [runs]).replace(
        "nowhere", "private")


def test_visitors_models_are_shared_and_bounded(tmp_path):
    """Visitors who pick the same checkpoint share one loaded model; at most max_models besides the
    default stay loaded, and a visitor whose model was unloaded gets it back on their next request."""
    from conftest import reference_checkpoint

    from bert_engine.runtime.fairness import visitor_scope
    from bert_engine.serving.predictors import LazyPredictor

    task = load_registry(entry_points=False).task("sentiment")
    folders = [str(reference_checkpoint(tmp_path / f"m{i}", "BertForSequenceClassification",
                                        id2label={j: f"m{i}-{j}" for j in range(2)})) for i in range(3)]
    predictor = LazyPredictor(task, folders[0], max_models=1)
    with visitor_scope("a"):
        first = predictor.switch(folders[1])
    with visitor_scope("b"):
        assert predictor.switch(folders[1]) is first  # shared, not loaded twice
    with visitor_scope("c"):
        predictor.switch(folders[2])  # unloads folders[1], least recently used
    assert list(predictor._models) == [folders[2]]
    with visitor_scope("a"):
        assert predictor.checkpoint == folders[1] and not predictor.loaded
        labels = predictor.predict({"text": "fine"})["result"]["labels"]
        assert {row["label"] for row in labels} == {"m1-0", "m1-1"}  # reloaded for a
    with visitor_scope("nobody-chose"):
        assert predictor.checkpoint == folders[0]
    assert len(predictor._models) == 1


def test_local_paths_resolve_inside_the_allowed_folders_only(tmp_path):
    from bert_engine.hookspecs import InputError
    from playground.app import check_model_choice, short_path

    allowed, outside = tmp_path / "models", tmp_path / "secret"
    (allowed / "good").mkdir(parents=True)
    outside.mkdir()
    (allowed / "escape").symlink_to(outside, target_is_directory=True)
    assert check_model_choice("  ", [allowed]) is None
    assert check_model_choice("owner/name", [allowed]) == "owner/name"  # a Hub id
    assert check_model_choice(str(allowed / "good"), [allowed]) == str((allowed / "good").resolve())  # outside cwd
    assert short_path(allowed / "good") == f"{allowed.name}/good"  # what a visitor is shown
    for bad in (str(outside), str(allowed / "escape"), str(allowed / "good" / ".." / ".." / "secret"), "~/.ssh",
                "../secret", "./x"):
        with pytest.raises(InputError, match="outside the folders"):
            check_model_choice(bad, [allowed])
    # what the OS refuses (a NUL byte, a name part over 255 bytes) or no name is (100,000 characters) is an
    # InputError too, and its message does not echo the whole value
    for hostile, message in ((f"{allowed}/\x00x", "holds control characters"), ("x" * 100_000, "has 100,000 characters"),
                             (f"{allowed}/{'y' * 300}", "there is no model folder")):
        with pytest.raises(InputError, match=message) as caught:
            check_model_choice(hostile, [allowed])
        assert len(str(caught.value)) < 600


def _event(app, api_name):
    """The function behind an API endpoint, to call a tab directly."""
    return app.endpoints[api_name]


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory):
    from conftest import reference_checkpoint

    root = tmp_path_factory.mktemp("tiny-app")
    checkpoints = {
        "sentiment": reference_checkpoint(root / "sentiment", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}),
        "qa": reference_checkpoint(root / "qa", "BertForQuestionAnswering"),
        "fill_mask": reference_checkpoint(root / "mlm", "BertForMaskedLM"),
        "ner": reference_checkpoint(root / "ner", "BertForTokenClassification",
                                    id2label={0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}),
    }
    return build_app(load_registry(entry_points=False), checkpoints={k: str(v) for k, v in checkpoints.items()})


def test_tab_functions_called_directly_with_tiny_models(tiny_app):
    bars, output = _event(tiny_app, "sentiment")("Great film.", "", "truncate")
    assert {c["label"] for c in bars.value["confidences"]} == {"NEG", "POS"} and bars.label == "Labels"
    assert output["provenance"]["untrained_head"] is False
    # a text longer than the model reads, truncated: said where the answer is (the browser audit found it only in
    # the closed details' JSON); with windows, all of it is read and the label says nothing more
    from plugins.sentiment import TRUNCATED_LABEL

    long_text = "A fine and moving film. " * 300
    bars, output = _event(tiny_app, "sentiment")(long_text, "", "truncate")
    assert output["result"]["long_input"]["truncated"] and bars.label == TRUNCATED_LABEL
    bars, output = _event(tiny_app, "sentiment")(long_text, "", "windows")
    assert not output["result"]["long_input"]["truncated"] and bars.label == "Labels"
    # the model lies outside the working folder: a visitor sees its last two parts, not the server's folders
    assert output["provenance"]["model"].endswith("/sentiment") and not output["provenance"]["model"].startswith("/")
    view, candidates, output = _event(tiny_app, "qa")("Who wrote it?", "It was written by Herman Melville.", 2)
    answer = output["result"]["answers"][0]
    assert 'qa-answer" style="' in view and f">{answer['answer']}</bdi><sup" in view
    assert candidates.count('class="be-bar"') == len(output["result"]["answers"]) == 2
    view, _, output = _event(tiny_app, "qa")("Who wrote it?", "It was written by Herman Melville.", 2, "never")
    assert not output["result"]["no_answer"]["predicted"] and "Answer: <b>" in view  # the "no answer" choice
    with pytest.raises(gr.Error, match="no_answer must be one of eager, balanced, cautious, never"):
        _event(tiny_app, "qa")("Who wrote it?", "It was written by Herman Melville.", 2, "sometimes")
    view, output = _event(tiny_app, "fill_mask")("I [MASK] to the [MASK].", 2, "joint", "")
    assert output["result"]["mode"] == "joint" and "All masks together" in view and view.count('class="be-bar"') == 2
    html, words, paths, transitions, output = _event(tiny_app, "ner")("Anna lives in Rome.", False, 3)
    assert output["result"]["constrained"] is False and len(words) == 5 and len(paths["headers"]) == 1 + 3
    assert [row[0] for row in paths["data"]] == ["Anna", "lives", "in", "Rome", "."]  # n-best lined up with words
    assert ("No entities found" in html) == (not output["result"]["entities"])  # an empty result says so
    assert [e["text"] for e in output["result"]["entities"]] == [
        text for text in ("Anna", "lives", "in", "Rome", ".") if f">{text}</bdi><sup" in html]
    summary, html, dropped, output = _event(tiny_app, "summary")("Tiny. Also tiny.", "half of the document", 3,
                                                                 "centroid")
    assert output["result"]["summary"] == "" and "min_words=3" in summary and len(dropped) == 2
    with pytest.raises(gr.Error, match="the text is empty"):
        _event(tiny_app, "sentiment")("", "", "truncate")
    with pytest.raises(gr.Error, match="has 1,000,001 characters; the limit is 1,000,000"):
        _event(tiny_app, "sentiment")("x" * 1_000_001, "", "truncate")


def test_warm_up_loads_every_model_in_the_background(tiny_app):
    from bert_engine.serving.predictors import LazyPredictor
    from playground.app import warm_up

    fresh = {name: LazyPredictor(p.task, p.checkpoint) for name, p in tiny_app.predictors.items()}
    assert not any(p.loaded for p in fresh.values())
    warm_up(fresh).join(timeout=120)
    assert all(p.loaded for p in fresh.values())


def test_concurrent_requests_share_a_batch_and_bad_input_stays_alone():
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from conftest import reference_checkpoint

    from bert_engine.hookspecs import InputError
    from bert_engine.runtime.inference import Predictor
    from bert_engine.serving.predictors import BatchingPredictor

    folder = reference_checkpoint(Path(tempfile.mkdtemp()), "BertForSequenceClassification",
                                  id2label={0: "NEG", 1: "POS"})
    task = load_registry(entry_points=False).task("sentiment")
    batcher = BatchingPredictor(task, str(folder), max_batch=8, max_wait_ms=200)
    plain = Predictor.load(task, str(folder))
    texts = [f"review number {i}: {'great' if i % 2 else 'awful'} film" + " really" * i for i in range(7)] + ["   "]
    from bert_engine.runtime.fairness import visitor_scope

    def as_visitor(visitor, text):
        with visitor_scope(visitor):
            return batcher.predict({"text": text})

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(as_visitor, f"visitor {i}", text) for i, text in enumerate(texts)]
    outputs = []
    for text, future in zip(texts, futures):
        if not text.strip():
            with pytest.raises(InputError, match="empty"):
                future.result()
            continue
        outputs.append(future.result())
        expected = plain.predict({"text": text})["result"]
        got = outputs[-1]["result"]
        assert got["label"] == expected["label"] and got["score"] == pytest.approx(expected["score"], abs=1e-5)
    assert max(o["provenance"]["batch_size"] for o in outputs) > 1
    # each visitor's attention view shows their own input of the shared pass, and nobody else's
    for i, text in enumerate(texts[:-1]):
        with visitor_scope(f"visitor {i}"):
            tokens, _ = batcher.attention()
        assert tokens == plain.tokenizer.convert_ids_to_tokens(plain.tokenizer([text]).input_ids[0].tolist())


def _visitors_at_once(batcher, requests: dict[str, str]) -> dict:
    """Each visitor's request sent at the same moment from a thread of its own: visitor -> output or error."""
    from concurrent.futures import ThreadPoolExecutor

    from bert_engine.runtime.fairness import visitor_scope

    start = threading.Barrier(len(requests))

    def send(visitor, text):
        with visitor_scope(visitor):
            start.wait()
            try:
                return batcher.predict({"text": text})
            except BaseException as err:  # noqa: BLE001 - the test reads what each visitor got
                return err

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {visitor: pool.submit(send, visitor, text) for visitor, text in requests.items()}
    return {visitor: future.result() for visitor, future in futures.items()}


def test_a_long_request_shares_no_pass_and_a_cut_off_first_request_leaves_the_others_answered(monkeypatch):
    """Requests of different visitors shared one pass whatever their length (session 58's audit): a visitor's
    short text waited ~10 s for another's 2,000 sentences, and when the pass's first request was cancelled, the
    others failed with "cut off by another request's time limit" and the task was marked failing."""
    import tempfile

    from conftest import reference_checkpoint

    import bert_engine.serving.predictors as predictors
    from bert_engine.runtime.cancel import Cancelled
    from bert_engine.serving.predictors import BatchingPredictor

    folder = reference_checkpoint(Path(tempfile.mkdtemp()), "BertForSequenceClassification",
                                  id2label={0: "NEG", 1: "POS"})
    task = load_registry(entry_points=False).task("sentiment")
    batcher = BatchingPredictor(task, str(folder), max_batch=8, max_wait_ms=300)
    long = "A long and winding review of a film that goes on. " * 40  # ~480 tokens: more than a shared pass takes
    got = _visitors_at_once(batcher, {"long": long, "short": "a fine film", "also short": "an awful film"})
    assert got["long"]["provenance"]["batch_size"] == 1
    assert got["short"]["provenance"]["batch_size"] == got["also short"]["provenance"]["batch_size"] == 2
    # the shared pass is cut off in the thread that runs it (its request cancelled): the others are answered alone
    plain = predictors.predict_in_batches

    def cut_off(*args, **kwargs):
        raise Cancelled()

    monkeypatch.setattr(predictors, "predict_in_batches", cut_off)
    got = _visitors_at_once(batcher, {f"visitor {i}": f"film number {i} was fine" for i in range(3)})
    cut = [v for v, out in got.items() if isinstance(out, BaseException)]
    assert len(cut) == 1 and isinstance(got[cut[0]], Cancelled), got  # the one whose thread ran the pass
    assert all(out["provenance"]["batch_size"] == 1 and out["result"]["label"] in ("NEG", "POS")
               for v, out in got.items() if v not in cut)
    monkeypatch.setattr(predictors, "predict_in_batches", plain)
    # cut off while it waited for others to join: the group it led is not left pending for later requests to join
    waits = {"n": 0}
    plain_wait = batcher._cond.wait_for

    def cancelled_while_waiting(*args, **kwargs):
        waits["n"] += 1
        if waits["n"] == 1:
            raise Cancelled()
        return plain_wait(*args, **kwargs)

    monkeypatch.setattr(batcher._cond, "wait_for", cancelled_while_waiting)
    got = _visitors_at_once(batcher, {f"visitor {i}": f"film number {i} was awful" for i in range(3)})
    assert sum(isinstance(out, Cancelled) for out in got.values()) == 1
    assert all(out["result"]["label"] for out in got.values() if not isinstance(out, BaseException))
    later = batcher.predict({"text": "a later film"})  # nothing left pending under these options
    assert later["result"]["label"] and not batcher._pending


RELEASE = __import__("threading").Event()  # lets the hung test prediction finish at the end


class FailingAtRequestPlugin:
    """Two tasks whose code breaks only when a request comes: one raises, one hangs."""

    @hookimpl
    def register_tasks(self, register):
        def explode(output, batch, **options):
            raise RuntimeError("postprocess exploded")

        def hang(output, batch, **options):
            RELEASE.wait(60)
            return {"late": True}

        for name, post in (("explodes", explode), ("hangs", hang)):
            register(TaskSpec(name=name, title=name.title(), build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=post))


def test_a_task_that_raises_or_hangs_at_request_time_is_cut_off_and_listed(tmp_path):
    from conftest import reference_checkpoint

    registry = load_registry(entry_points=False)
    registry.load_plugin("fails-late", "0.1", "test", FailingAtRequestPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}))
    app = build_app(registry, checkpoints={"explodes": tiny, "hangs": tiny, "sentiment": tiny}, timeout_s=3)
    for name in ("explodes", "hangs", "sentiment"):  # loaded first: a first load alone (torch's warm-up) took 3 s
        app.predictors[name].get()
    try:
        with pytest.raises(gr.Error, match="postprocess exploded.*bug in plugin fails-late.*Other tasks are not affected"):
            app.predictors["explodes"].predict({"text": "hello"})
        with pytest.raises(gr.Error, match="task 'hangs' did not finish within 3 s and was cut off"):
            app.predictors["hangs"].predict({"text": "hello"})
        # the app is still up: another tab answers, and bad input is still the user's message
        assert app.predictors["sentiment"].predict({"text": "fine"})["result"]["label"] in {"NEG", "POS"}
        with pytest.raises(Exception, match="empty"):
            app.predictors["sentiment"].predict({"text": " "})
        rows = [r for r in plugin_rows(registry) if r[4].startswith("failing at request time")]
        assert [(r[0], r[4]) for r in rows] == [("fails-late", "failing at request time (postprocess)"),
                                                ("fails-late", "failing at request time (time limit)")]
        assert "RuntimeError: postprocess exploded" in rows[0][5] and "[tests/test_playground.py:" in rows[0][5]
        assert "cut off" in rows[1][5]
        table = json.loads(app.endpoints["plugins"]())  # JSON text, as every API endpoint and MCP tool answers
        assert len([r for r in table if r["status"].startswith("failing at request time")]) == 2
        assert set(table[0]) == {"plugin", "version", "source", "tasks", "status", "reason"}
    finally:
        RELEASE.set()


class SloppyResultsPlugin:
    """Tasks answering what JSON cannot hold: NaN, a set, a numpy number."""

    @hookimpl
    def register_tasks(self, register):
        import numpy as np

        answers = {"nan": {"score": float("nan")}, "set": {"labels": {"a"}}, "numpy": {"score": np.float32(0.5)}}
        for name, answer in answers.items():
            register(TaskSpec(name=f"gives-{name}", title=name, build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]),
                              postprocess=lambda output, batch, answer=answer, **o: answer))


def test_a_result_json_cannot_hold_is_the_tasks_failure_not_a_string_or_a_nan(tmp_path):
    """The API answers JSON text: a NaN would make it unparseable (a browser's JSON.parse, an MCP client),
    and a numpy number or set was silently turned into a string. Each is the plugin's recorded failure."""
    from conftest import reference_checkpoint

    registry = load_registry(entry_points=False)
    registry.load_plugin("sloppy", "0.1", "test", SloppyResultsPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}))
    names = ("gives-nan", "gives-set", "gives-numpy")
    app = build_app(registry, checkpoints=dict.fromkeys(names, tiny))
    for name, why in zip(names, ("holds NaN or infinity", "not JSON data \\(Object of type set",
                                 "not JSON data \\(Object of type float32")):
        with pytest.raises(gr.Error, match=f"{name} failed in postprocess .*{why}.*bug in plugin sloppy"):
            app.predictors[name].predict({"text": "hello"})
    stages = {f.message.split(":")[0]: f.stage for f in registry.failures}
    assert stages == {f"task {name}": "postprocess" for name in names}


def test_a_request_cut_off_while_waiting_for_others_is_not_the_plugins_fault(tmp_path):
    """The gate is busy with another visitor's work past the time limit: the visitor is told the machine
    is busy, and the plugin is not listed as failing."""
    import threading

    from conftest import reference_checkpoint

    from bert_engine.runtime.fairness import GATE

    folder = reference_checkpoint(tmp_path / "sst", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"})
    registry = load_registry(entry_points=False)
    app = build_app(registry, checkpoints={"sentiment": str(folder)}, timeout_s=3.0)  # wide enough that a loaded machine still spends most of it waiting
    run = _event(app, "sentiment")
    run("warm up the model", "", "truncate")
    holding, release = threading.Event(), threading.Event()

    def busy():
        with GATE.turn(1, key="someone else"):
            holding.set()
            release.wait(10)

    worker = threading.Thread(target=busy)
    worker.start()
    holding.wait(10)
    try:
        with pytest.raises(gr.Error, match="the machine is busy with other requests"):
            run("a fine film", "", "truncate")
    finally:
        release.set()
        worker.join(10)
    assert not [f for f in registry.failures if "sentiment" in f.message]
    assert run("a fine film", "", "truncate")[1]["task"] == "sentiment"  # and it answers once the gate frees


def test_the_api_has_one_endpoint_per_task_and_optional_inputs_are_optional():
    registry = load_registry(entry_points=False)
    endpoints = build_app(registry).get_api_info()["named_endpoints"]
    expected = {f"/{name}" for name in registry.tasks} | {"/plugins", "/all_tasks", "/explain", "/compare"}
    assert set(endpoints) == expected  # no stray /lambda; the per-session model picker and attention undocumented
    for name, field in (("sentiment", "text_pair"), ("fill_mask", "targets")):
        parameters = {p["parameter_name"]: p for p in endpoints[f"/{name}"]["parameters"]}
        assert parameters[field]["parameter_has_default"], (name, field)
    # and the texts a task needs are required, though the page starts them at an example: an agent that left one
    # out was answered about the example (MCP's schema gave it as the default)
    for name, fields in (("sentiment", ["text"]), ("ner", ["text"]), ("qa", ["question", "context"]),
                         ("summary", ["text"]), ("fill_mask", ["text"])):
        parameters = {p["parameter_name"]: p for p in endpoints[f"/{name}"]["parameters"]}
        assert [f for f in fields if parameters[f]["parameter_has_default"]] == [], name
    # the host's own endpoints name their inputs as the docs ask of plugins: after the task's fields
    assert [p["parameter_name"] for p in endpoints["/all_tasks"]["parameters"]] == ["text"]


class SlowWhenAskedPlugin:
    """A task whose preprocess blocks while the text says "slow" (a long legal request), until released."""

    release = threading.Event()
    waiting = 0
    counting = threading.Lock()  # `waiting += 1` from many request threads can lose a count without it

    @hookimpl
    def register_tasks(self, register):
        def preprocess(inputs, tokenizer, **options):
            if "slow" in inputs["text"]:
                with SlowWhenAskedPlugin.counting:
                    SlowWhenAskedPlugin.waiting += 1
                SlowWhenAskedPlugin.release.wait(60)
            return tokenizer(inputs["text"])

        def build_tab(predictor):
            text, out = gr.Textbox(label="Text"), gr.JSON(label="Result")

            def run(text: str):
                """Answer.

                Args:
                    text: the text.
                """
                return predictor.predict({"text": text})

            ui.wire(gr, gr.Button(), run, [text], [out], api_name="slowtask")

        register(TaskSpec(name="slowtask", title="Slow task", build_head=lambda c: torch.nn.Identity(),
                          preprocess=preprocess, postprocess=lambda output, batch, **o: {"ok": True},
                          input_fields=("text",), build_tab=build_tab))


def test_gradios_queue_never_holds_a_light_request_behind_long_ones(tmp_path):
    """Six sessions each hold a long request of one event (Gradio's old default let 4 through, then
    queued first-in first-out); a seventh session's light request of the same event answers at once:
    the queue admits what the fairness gate orders (serve_queue)."""
    from conftest import reference_checkpoint

    from playground.app import ADMITTED, serve_queue

    registry = load_registry(entry_points=False)
    registry.load_plugin("slow", "0.1", "test", SlowWhenAskedPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertModel"))
    app = serve_queue(build_app(registry, checkpoints={"slowtask": tiny}, timeout_s=60))
    assert ADMITTED >= 32
    port = _launch(app)
    url = f"http://127.0.0.1:{port}/"
    SlowWhenAskedPlugin.waiting = 0
    SlowWhenAskedPlugin.release.clear()
    try:
        long_ones = [Client(url, verbose=False).submit(f"slow request {i}", api_name="/slowtask") for i in range(6)]
        _wait = time.monotonic() + 30
        while SlowWhenAskedPlugin.waiting < 6:
            assert time.monotonic() < _wait, f"only {SlowWhenAskedPlugin.waiting} long requests reached the handler"
            time.sleep(0.05)
        started = time.monotonic()
        light = Client(url, verbose=False).submit("light", api_name="/slowtask")
        assert json.loads(light.result(timeout=20))["result"] == {"ok": True}  # the API answers JSON text
        assert time.monotonic() - started < 10 and not any(job.done() for job in long_ones)
    finally:
        SlowWhenAskedPlugin.release.set()
        app.close()


def test_every_request_the_queue_admits_reaches_its_handler_beyond_anyios_default_pool(tmp_path, monkeypatch):
    """The handlers run each request in a worker thread of Gradio's pool (max_threads, sized by serve_queue for
    every admitted request), not anyio's default pool of 40: 44 visitors' long requests all reach the task."""
    from conftest import reference_checkpoint

    from playground.app import serve_queue

    monkeypatch.setenv("BERT_ENGINE_MAX_IN_FLIGHT_PER_IP", "100")  # every caller here is 127.0.0.1
    registry = load_registry(entry_points=False)
    registry.load_plugin("slow", "0.1", "test", SlowWhenAskedPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertModel"))
    app = serve_queue(build_app(registry, checkpoints={"slowtask": tiny}, timeout_s=60))
    app.predictors["slowtask"].get()
    port = _launch(app)
    url = f"http://127.0.0.1:{port}/"
    SlowWhenAskedPlugin.waiting = 0
    SlowWhenAskedPlugin.release.clear()
    try:
        for i in range(44):  # each call its own session: its own visitor
            body = json.dumps({"data": [f"slow request {i}"]}).encode()
            request = urllib.request.Request(f"{url}gradio_api/call/slowtask", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=30).read()
        deadline = time.monotonic() + 60
        while SlowWhenAskedPlugin.waiting < 44 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert SlowWhenAskedPlugin.waiting == 44, f"only {SlowWhenAskedPlugin.waiting} of 44 reached the handler"
    finally:
        SlowWhenAskedPlugin.release.set()
        app.close()


def test_one_session_sending_four_at_once_gets_two_running_two_waiting_and_four_answers(tmp_path):
    """A client that sends more than its in-flight cap at once (issue 36's attacker sends 4) is not
    refused and left to resend: the two beyond the cap wait, idle, and run as places free."""
    from conftest import reference_checkpoint

    from playground.app import serve_queue

    registry = load_registry(entry_points=False)
    registry.load_plugin("slow", "0.1", "test", SlowWhenAskedPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertModel"))
    app = serve_queue(build_app(registry, checkpoints={"slowtask": tiny}, timeout_s=60))
    port = _launch(app)
    SlowWhenAskedPlugin.waiting = 0
    SlowWhenAskedPlugin.release.clear()
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)  # one session
        jobs = [client.submit(f"slow request {i}", api_name="/slowtask") for i in range(4)]
        deadline = time.monotonic() + 30
        while SlowWhenAskedPlugin.waiting < 2:
            assert time.monotonic() < deadline, f"only {SlowWhenAskedPlugin.waiting} requests reached the handler"
            time.sleep(0.05)
        time.sleep(1.0)  # time for a third to start, were the cap not kept
        assert SlowWhenAskedPlugin.waiting == 2 and not any(job.done() for job in jobs)  # 2 run, 2 wait (not refused)
        SlowWhenAskedPlugin.release.set()
        answers = [json.loads(job.result(timeout=60))["result"] for job in jobs]
    finally:
        SlowWhenAskedPlugin.release.set()
        app.close()
    assert answers == [{"ok": True}] * 4 and SlowWhenAskedPlugin.waiting == 4


def test_each_mcp_session_is_its_own_visitor(tmp_path):
    """Eight MCP sessions, one slow request each: all are admitted (before, every MCP call was one
    visitor with 2 requests in flight, and 6 of the 8 were refused at once)."""
    import asyncio

    from conftest import reference_checkpoint
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from playground.app import serve_queue

    registry = load_registry(entry_points=False)
    registry.load_plugin("slow", "0.1", "test", SlowWhenAskedPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertModel"))
    app = serve_queue(build_app(registry, checkpoints={"slowtask": tiny}, timeout_s=60))
    port = _launch(app, mcp_server=True)
    SlowWhenAskedPlugin.waiting = 0
    SlowWhenAskedPlugin.release.clear()

    async def one(i: int):
        async with streamable_http_client(f"http://127.0.0.1:{port}/gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await session.call_tool("slowtask", {"text": f"slow call {i}"})

    async def all_eight():
        calls = [asyncio.create_task(one(i)) for i in range(8)]
        deadline = time.monotonic() + 60
        while SlowWhenAskedPlugin.waiting < 8 and not any(c.done() for c in calls):
            assert time.monotonic() < deadline, f"only {SlowWhenAskedPlugin.waiting} of 8 reached the task"
            await asyncio.sleep(0.05)
        SlowWhenAskedPlugin.release.set()
        return await asyncio.gather(*calls)

    try:
        results = asyncio.run(all_eight())
    finally:
        SlowWhenAskedPlugin.release.set()
        app.close()
    texts = [" ".join(p.text for p in r.content if p.type == "text") for r in results]
    assert not any(r.isError for r in results), texts
    assert SlowWhenAskedPlugin.waiting == 8


def _outward_address() -> str | None:
    """This machine's address on its outward interface (no packet is sent), or None where it has only loopback."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_an_mcp_call_is_accounted_to_its_callers_address_not_a_header_it_sends(monkeypatch):
    """Gradio relays a queued MCP tool call through a loopback client with the caller's headers, and the server
    trusts the loopback's X-Forwarded-For: every MCP caller was one address (127.0.0.1: one flood refused
    everyone's MCP calls), and a caller sending its own header was any address it liked. Now the relay carries
    the address the server resolved for the MCP request: a caller from outside loopback (here this machine's
    outward address: loopback is a trusted proxy) is accounted to its own address, whatever header it sends."""
    import asyncio

    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    import playground.app as playground_app
    from playground.app import serve_queue

    outward = _outward_address()
    if outward is None:
        pytest.skip("this machine has no address outside loopback to call from")
    seen = []
    real = playground_app.current_group
    monkeypatch.setattr(playground_app, "current_group", lambda: seen.append(real()) or seen[-1])
    app = serve_queue(build_app(load_registry(entry_points=False)))
    port = _free_port()
    app.launch(server_name="0.0.0.0", server_port=port, prevent_thread_lock=True, quiet=True, mcp_server=True)

    async def call(headers: dict):
        client = httpx.AsyncClient(headers=headers, timeout=120)
        async with streamable_http_client(f"http://{outward}:{port}/gradio_api/mcp/", http_client=client) as (
                read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await session.call_tool("sentiment", {"text": "a fine film"})

    try:
        results = [asyncio.run(call(headers)) for headers in ({}, {"X-Forwarded-For": "203.0.113.9"})]
    finally:
        app.close()
    assert not any(r.isError for r in results)
    assert seen == [f"ip:{outward}"] * 2, seen  # not 127.0.0.1 (the relay's), not the header's 203.0.113.9


def test_the_subtitle_counts_in_plain_english(registry):
    from playground.app import plural

    assert plural(1, "task") == "1 task" and plural(5, "task") == "5 tasks"
    app = build_app(registry)
    subtitle = next(str(b.value) for b in app.blocks.values() if isinstance(b, gr.Markdown))
    assert "(s)" not in subtitle and f"{len(registry.tasks)} tasks." in subtitle


def test_a_hang_in_a_tasks_own_code_is_its_failure_whoever_else_came_by(tmp_path):
    """Two visitors' requests of a task that hangs in its own code, side by side: neither waited at the
    compute gate for the other's work, so the time was the task's own: each is told it was cut off (not that
    the machine was busy) and the task is listed. Waiting at the gate is "busy": the test above."""
    from types import SimpleNamespace

    from conftest import reference_checkpoint

    from playground.app import REQUEST

    registry = load_registry(entry_points=False)
    registry.load_plugin("fails-late", "0.1", "test", FailingAtRequestPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}))
    app = build_app(registry, checkpoints={"hangs": tiny}, timeout_s=3)
    app.predictors["hangs"].get()  # loaded first: the two requests' time is the task's, not a model load's
    errors = {}
    together = threading.Barrier(2)

    def visit(name: str) -> None:
        REQUEST.set(SimpleNamespace(session_hash=name, headers={}))  # what with_request keeps for a visitor's event
        together.wait(10)
        try:
            app.predictors["hangs"].predict({"text": "hello"})
        except gr.Error as err:
            errors[name] = str(err)

    RELEASE.clear()  # another test may have released the hanging task
    threads = [threading.Thread(target=visit, args=(f"visitor-{i}",)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        RELEASE.set()
    assert len(errors) == 2 and all("did not finish within 3 s and was cut off" in e for e in errors.values()), errors
    assert [f.plugin for f in registry.failures if f.stage == "time limit"] == ["fails-late"]  # one record, kept once


def test_every_html_answer_says_what_will_appear_before_the_first_run(registry):
    app = build_app(registry)
    labels = {"Candidates", "Entities", "Answer in its context", "Document with chosen sentences"}
    found = {b.label: str(b.value) for b in app.blocks.values() if isinstance(b, gr.HTML) and b.label in labels}
    assert set(found) == labels
    assert all('class="be-empty"' in value and "appear" in value for value in found.values()), found


def test_why_clicked_while_the_answer_is_on_its_way_explains_that_answer(served, monkeypatch):
    """An example clicked, then "Why this answer?" at once (a browser test under load did it): the explanation
    waits for the visitor's answer still being computed, or still waiting for an in-flight place behind another
    of theirs, and explains it, not "no answer yet" or the answer before it (an outside check: 3 of 4)."""
    from bert_engine.serving.predictors import BatchingPredictor

    app, url = served
    answering, release = threading.Event(), threading.Event()
    plain = BatchingPredictor.predict

    def slow(self, inputs, **options):
        if "slow" in inputs.get("text", ""):
            answering.set()
            assert release.wait(30)
        return plain(self, inputs, **options)

    monkeypatch.setattr(BatchingPredictor, "predict", slow)
    visitor = Client(url, verbose=False)
    answer = visitor.submit("A luminous, tender film.", "", "truncate", api_name="/sentiment")
    time.sleep(0.3)  # (it is under way: the slow one below waits here for nothing)
    answering.clear()
    answer = visitor.submit("A luminous, tender, slow film.", "", "truncate", api_name="/sentiment")
    assert answering.wait(30)
    why = visitor.submit("gradient_x_input", 8, api_name="/sentiment_why")
    time.sleep(1.5)  # the explanation has started and finds the answer still on its way
    assert not why.done(), why.exception()
    release.set()
    assert json.loads(answer.result(timeout=60))["result"]["label"] == "POSITIVE"
    explained = why.result(timeout=60)
    assert "slow" in explained and 'class="be-mark"' in explained

    # "why" sent as soon as the server has the answer's request (the fresh-clone check sent it with no pause: 2 of
    # 3 said "no answer yet"): Gradio may hand "why" to its handler before the answer reaches the task, so "why"
    # first waits for what the session sent before it. (gradio_client's submit() joins the queue in a thread of its
    # own, so a call made right after it may reach the server first: then there is nothing before it to wait for;
    # that was the fresh-clone check's 2 of 3. Once the answer has joined, the code before the session wait passed
    # too: the hand-over it covers, from Gradio's queue to the answer's handler, is short.)
    from gradio_client.utils import Status

    for text in ("A witty, gorgeous film.", "A dull, tedious mess."):
        answering.clear()
        release.set()
        job = visitor.submit(text, "", "truncate", api_name="/sentiment")
        while job.status().code in (Status.STARTING, Status.JOINING_QUEUE) and not job.done():
            time.sleep(0.002)
        explained = visitor.predict("gradient_x_input", 8, api_name="/sentiment_why")
        words = re.sub(r"<[^>]+>", " ", explained)
        assert ("witty" if "witty" in text else "dull") in words, words[:600]

    # one in-flight place (the cap at 1): the next answer waits in line behind a slow one, "why" after both
    release.clear()
    monkeypatch.setenv("BERT_ENGINE_MAX_IN_FLIGHT", "1")
    answering.clear()
    release.clear()
    first = visitor.submit("A slow and solemn film.", "", "truncate", api_name="/sentiment")
    assert answering.wait(30)
    second = visitor.submit("A bright, joyful romp.", "", "truncate", api_name="/sentiment")
    time.sleep(1.0)  # the second waits for the place the first holds
    why = visitor.submit("gradient_x_input", 8, api_name="/sentiment_why")
    time.sleep(1.5)
    assert not why.done(), why.exception()
    release.set()
    first.result(timeout=60), second.result(timeout=60)
    explained = why.result(timeout=60)
    import html as html_module
    words = re.sub(r"<[^>]+>", " ", html_module.unescape(explained))
    assert "bright" in words and "solemn" not in words, words[:1500]


def test_why_and_compare_explain_the_visitors_own_last_answer(served, registry):
    """The tab's buttons explain and compare the visitor's own last answer (another visitor has none
    yet); the documented /explain and /compare take the inputs in the call."""
    app, url = served
    visitor, stranger = Client(url, verbose=False), Client(url, verbose=False)
    visitor.predict("A gorgeous, witty, seductive movie.", "", "truncate", api_name="/sentiment")
    why = visitor.predict("integrated_gradients", 16, api_name="/sentiment_why")
    assert "POSITIVE: probability" in why and 'class="be-mark"' in why and "gorgeous" in why
    assert "they add up" in why
    fast = visitor.predict("gradient_x_input", 16, api_name="/sentiment_why")
    assert "gradient x input" in fast
    with pytest.raises(Exception, match="no answer yet in the Sentiment tab"):
        stranger.predict("integrated_gradients", 16, api_name="/sentiment_why")
    compared = visitor.predict("", "int8", api_name="/sentiment_compare")
    assert "float32" in compared and "int8" in compared and "They agree" in compared
    explained = json.loads(stranger.predict("ner", json.dumps({"text": "Tim Cook visited Berlin."}),
                                            "integrated_gradients", 16, api_name="/explain"))
    assert [t["name"] for t in explained["targets"]] == ["Tim Cook (PER)", "Berlin (LOC)"]
    tokens = explained["rows"][0]["tokens"]
    assert tokens[0]["token"] == "[CLS]" and explained["targets"][0]["attributions"][0] == 0.0  # specials kept
    plain = json.loads(stranger.predict("ner", "Tim Cook visited Berlin.", "integrated_gradients", 16,
                                        api_name="/explain"))  # one text field: plain text is that text
    assert [t["name"] for t in plain["targets"]] == ["Tim Cook (PER)", "Berlin (LOC)"]
    with pytest.raises(Exception, match=r"qa: inputs must be a JSON object such as .*, not plain text "
                                        r"\(starting 'Who wrote it\?'\)"):
        stranger.predict("qa", "Who wrote it?", "integrated_gradients", 16, api_name="/explain")
    deep = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion: the caller's error, named
    with pytest.raises(Exception, match="inputs are JSON nested too deeply to be an input"):
        stranger.predict("sentiment", deep, "integrated_gradients", 8, api_name="/explain")
    with pytest.raises(Exception, match="inputs are JSON nested too deeply to be an input"):
        stranger.predict("sentiment", deep, "", "int8", "", "fp32", api_name="/compare")
    with pytest.raises(Exception, match=r"unknown field\(s\) evil; the task's: question, context"):
        stranger.predict("qa", json.dumps({"question": "Who?", "context": "Bob is.", "evil": 1}), "", "int8", "",
                         "fp32", api_name="/compare")
    with pytest.raises(Exception, match=r"unknown field\(s\) top_k; the task's: text, text_pair"):
        stranger.predict("sentiment", json.dumps({"text": "good", "top_k": -1}), "integrated_gradients", 8,
                         api_name="/explain")
    with pytest.raises(Exception, match="does not say what to explain"):
        stranger.predict("similarity", json.dumps({"text": "a", "text_pair": "b"}), "integrated_gradients", 8,
                         api_name="/explain")
    compared = json.loads(stranger.predict("qa", json.dumps({"question": "Who wrote it?", "context": "Moby-Dick was "
                                                             "written by Herman Melville."}), "", "int8", "", "fp32",
                                           api_name="/compare"))
    assert compared["a"]["precision"] == "float32" and compared["b"]["precision"] == "int8"
    assert compared["agree"] == (not compared["disagreements"]) and "Melville" in compared["a"]["brief"]
    # a third-party task (the example plugin declares no explain) is compared all the same
    pair = json.dumps({"text_a": "A man plays guitar.", "text_b": "Someone makes music."})
    compared = json.loads(stranger.predict("similarity", pair, "", "int8", "", "fp32", api_name="/compare"))
    assert compared["task"] == "similarity" and compared["b"]["precision"] == "int8" and compared["a"]["brief"]
    # a precision this machine does not run, or a model that cannot load, is the caller's error: the plugin is
    # not recorded as failing in the public Plugins tab (a typo once put sentiment there as "failing")
    failures = len(registry.failures)
    with pytest.raises(Exception, match="precision 'zz' is not one this machine runs") as caught:
        stranger.predict("sentiment", json.dumps({"text": "ok"}), "", "zz", "", "fp32", api_name="/compare")
    assert "bug in plugin" not in str(caught.value)
    with pytest.raises(Exception, match="could not load") as caught:
        stranger.predict("sentiment", json.dumps({"text": "ok"}), "owner/not-here", "fp32", "", "fp32",
                         api_name="/compare")
    assert "bug in plugin" not in str(caught.value) and "local_files_only" not in str(caught.value)
    assert len(registry.failures) == failures


def test_why_and_compare_answer_for_every_built_in_task(served):
    """Through the documented /explain and /compare (and so the MCP tools), each built-in task's first
    example: attributions for what its answer shows, and the starter in fp32 beside it in int8."""
    import plugins

    app, url = served
    client = Client(url, verbose=False)
    for name in (module.rsplit(".", 1)[1] for module in plugins.BUILTIN):  # each built-in module is its task
        example = json.dumps(dict(app.predictors[name].task.spec.examples[0]))
        explained = json.loads(client.predict(name, example, "gradient_x_input", 1, api_name="/explain"))
        assert explained["targets"] and explained["method"] == "gradient_x_input", name
        tokens = explained["rows"][0]["tokens"]
        assert all(len(t["attributions"]) == len(tokens) for t in explained["targets"] if t["row"] == 0), name
        compared = json.loads(client.predict(name, example, "", "int8", "", "fp32", api_name="/compare"))
        assert compared["a"]["precision"] == "float32" and compared["b"]["precision"] == "int8", name
        assert compared["a"]["brief"] and compared["agree"] == (not compared["disagreements"]), name


def _tab_plugin(name: str, wire_tab):
    """A plugin whose task `name` has a tab of a Text box, a JSON result and a run button, which
    `wire_tab(predictor, text, out, button)` connects."""
    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            def build_tab(predictor):
                text, out = gr.Textbox(label="Text"), gr.JSON(label="Result")
                wire_tab(predictor, text, out, ui.run_button(gr, "Run"))

            register(TaskSpec(name=name, title=name.title(), build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {"ok": True},
                              build_tab=build_tab))

    return Plugin


def _grab_endpoints(predictor, text, out, button):
    """Extra events under names the host serves, beside the task's own."""
    ui.wire(gr, button, lambda t: predictor.predict({"text": t}), [text], [out], api_name="grabber")
    button.click(lambda t: {"grabbed": t}, text, out, api_name="plugins")
    ui.wire(gr, button, lambda t: {"grabbed": t}, [text], [out], api_name="explain")


def test_a_tab_cannot_take_the_hosts_endpoints():
    """Gradio names a second event of a taken name `<name>_1`: a plugin's tab wiring /plugins or /explain
    before the host had moved the host's own endpoints. Such a tab is left out (a scratch build finds its
    endpoints first), and listed."""
    registry = load_registry(entry_points=False)
    assert registry.load_plugin("grabber", "0.1", "test", _tab_plugin("grabber", _grab_endpoints))
    app = build_app(registry)
    endpoints = app.get_api_info()["named_endpoints"]
    assert {"/plugins", "/explain"} <= set(endpoints) and "/grabber" not in endpoints
    assert not [e for e in endpoints if e.endswith("_1")]
    assert any(row["plugin"] == "grabber" for row in json.loads(app.endpoints["plugins"]()))  # the host's table
    (failure,) = [f for f in registry.failures if f.plugin == "grabber"]
    assert failure.stage == "tab" and "wires API endpoints ['explain', 'plugins']" in failure.message


@pytest.mark.parametrize("name", ["plugins", "explain", "all_tasks", "sentiment_view", "mine_why"])
def test_a_task_may_not_be_named_like_the_hosts_endpoints(name):
    registry = load_registry(entry_points=False)

    class Plugin:
        @hookimpl
        def register_tasks(self, register):
            register(TaskSpec(name=name, title="X", build_head=lambda c: torch.nn.Identity(),
                              preprocess=lambda i, t, **o: t(i["text"]), postprocess=lambda o, b, **k: {}))

    assert not registry.load_plugin("hosty", "0.1", "test", Plugin)
    assert "are the playground's own endpoints" in registry.failures[-1].message


def _add_a_numpy_number(predictor, text, out, button):
    """The tab adds a numpy number to the prediction it shows (the API endpoint answers it)."""
    import numpy as np

    def run(t):
        output = predictor.predict({"text": t})
        return {**output, "result": {**output["result"], "extra": np.float32(1.5)}}

    ui.wire(gr, button, run, [text], [out], api_name="tabby")


@contextlib.contextmanager
def _tabby_served(tmp_path, wire_tab):
    """The "tabby" task (a tiny sentiment model, its tab wired by `wire_tab`) served on loopback: yields (registry,
    a client); the task's recorded failures are read from the registry after."""
    from conftest import reference_checkpoint

    registry = load_registry(entry_points=False)
    assert registry.load_plugin("tabby", "0.1", "test", _tab_plugin("tabby", wire_tab))
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}))
    app = build_app(registry, checkpoints={"tabby": tiny})
    port = _launch(app)
    try:
        yield registry, Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        app.close()


def test_a_value_the_tab_adds_that_json_cannot_hold_is_the_tabs_recorded_failure(tmp_path):
    """The API had answered the numpy number as the string "1.5" (json's default=str), recording nothing."""
    with _tabby_served(tmp_path, _add_a_numpy_number) as (registry, client):
        with pytest.raises(Exception, match="tabby: the tab's answer is not JSON data \\(Object of type float32"):
            client.predict("hello", api_name="/tabby")
    (failure,) = [f for f in registry.failures if f.plugin == "tabby"]
    assert failure.stage == "tab handler" and "float32" in failure.message


def _read_a_missing_field(predictor, text, out, button):
    """The tab reads a field its task's result does not have (a plugin author's slip)."""
    def run(t):
        return predictor.predict({"text": t})["result"]["no_such_field"]

    ui.wire(gr, button, run, [text], [out], api_name="tabby")


def test_an_exception_in_a_tabs_own_handler_names_the_plugin_and_is_recorded(tmp_path):
    """The API and MCP answered Gradio's generic "the upstream Gradio app has raised an exception" and the Plugins
    tab showed nothing (the session-52 plugin audit): the tab's handler is the plugin's code too."""
    with _tabby_served(tmp_path, _read_a_missing_field) as (registry, client):
        for api_name in ("/tabby", "/tabby_view"):  # the API and MCP tool, and the page's own event
            with pytest.raises(Exception, match=r"tabby: its tab failed \(KeyError: .*no_such_field.*\); this is a "
                                                "bug in plugin tabby, not in your input"):
                client.predict("hello", api_name=api_name)
    (failure,) = [f for f in registry.failures if f.plugin == "tabby"]
    assert failure.stage == "tab handler" and "no_such_field" in failure.message


def test_results_json_cannot_hold_are_named_for_what_they_are():
    from bert_engine.runtime.inference import ResultNotJSON, check_json_result

    loop: dict = {}
    loop["self"] = loop
    for result, problem in ((loop, "refers to itself"), ({"s": float("inf")}, "holds NaN or infinity"),
                            ({1: "a", "1": "b"}, "has a key that is not text (1)"),
                            ({"a": [{"b": {2: 0}}]}, "has a key that is not text (2)")):
        with pytest.raises(ResultNotJSON, match=f"task: the result {re.escape(problem)}"):
            check_json_result("task", result)
    assert check_json_result("task", {"a": [1, "x", None, {"b": 2.5}]}) == {"a": [1, "x", None, {"b": 2.5}]}


def test_the_model_picker_lists_the_default_once(tmp_path):
    """The picker listed "default (the task's starter model)" and the starter's own folder beside it: one model
    twice. The default's folder is left out of the list (typing its name still loads it)."""
    from playground.app import model_choices

    starter = tmp_path / "starter"
    other = tmp_path / "mine"
    for folder in (starter, other):
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "bert"}')
    choices = model_choices({"starter": str(starter), "mine": str(other)}, str(starter))
    assert choices == [("default (the task's starter model)", ""), ("mine · BERT", "mine")]
    assert len(model_choices({"mine": str(other)}, None)) == 2


def test_a_visitors_error_names_no_server_folder_not_even_the_hub_cache(monkeypatch):
    """A Hub model's refusal names files in its cache snapshot; the cache may lie outside the home folder
    (HF_HOME=/srv/...): the visitor sees the repository's part of the path only."""
    import huggingface_hub.constants as hub_constants

    from playground.app import public_message

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", "/srv/hf-cache/hub")
    shown = public_message("/srv/hf-cache/hub/models--owner--x/snapshots/abc/config.json: model_type 'gpt2' ...")
    assert shown == "models--owner--x/snapshots/abc/config.json: model_type 'gpt2' ..." and "/srv" not in shown


def test_one_line_args_joins_each_wrapped_entry():
    """Gradio reads an `Args:` entry's first line only (the real MCP client test checks the served tools)."""
    from playground.app import one_line_args

    assert one_line_args("Do.\n\n    Args:\n        a: one\n            two.\n        b: three.\n\n    Returns:\n"
                         "        x\n") == "Do.\n\nArgs:\n    a: one two.\n    b: three.\n\nReturns:\n    x"
    assert one_line_args(None) is None and one_line_args("") == ""


SPINS = {"count": 0, "stopped": 0}


class SpinningPlugin:
    """A task whose postprocess runs a Python loop for up to 60 s, counting its rounds (a long request)."""

    @hookimpl
    def register_tasks(self, register):
        def spin(output, batch, **options):
            end = time.monotonic() + 60
            try:
                while time.monotonic() < end and not RELEASE.is_set():
                    SPINS["count"] += 1
                    time.sleep(0.002)
            except BaseException:
                SPINS["stopped"] += 1
                raise
            return {"spun": True}

        def build_tab(predictor):
            text, button, out = gr.Textbox(label="Text"), ui.run_button(gr, "Spin"), gr.JSON()

            def run(text: str):
                """Spin a while.

                Args:
                    text: anything.
                """
                return predictor.predict({"text": text})

            ui.wire(gr, button, run, [text], [out], api_name="spins")

        register(TaskSpec(name="spins", title="Spins", build_head=lambda c: torch.nn.Identity(),
                          preprocess=lambda i, t, **o: t(i["text"]), postprocess=spin, build_tab=build_tab))


def _spinning_until(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _stopped_spinning(stops_before: int) -> bool:
    """The spinning request was stopped (its loop saw the cancellation) and counts no more rounds."""
    if not _spinning_until(lambda: SPINS["stopped"] > stops_before, 10):
        return False
    count = SPINS["count"]
    time.sleep(0.5)
    return SPINS["count"] == count


def _spinning_app(tmp_path, **launch):
    """A served app with the spinning task, its model loaded, RELEASE cleared: (app, port)."""
    from conftest import reference_checkpoint

    registry = load_registry(entry_points=False)
    registry.load_plugin("spinning", "0.1", "test", SpinningPlugin)
    tiny = str(reference_checkpoint(tmp_path / "tiny", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}))
    app = build_app(registry, checkpoints={"spins": tiny}, timeout_s=60)
    app.predictors["spins"].get()
    app.queue(default_concurrency_limit=4)
    port = _launch(app, **launch)
    RELEASE.clear()
    return app, port


def test_a_request_whose_visitor_cancels_or_leaves_stops_at_once(tmp_path, monkeypatch):
    """A visitor's long request that they cancel (gradio_client's job.cancel(), the page's stop) or walk away
    from (the event stream closed) stops within a second or two, freeing the CPU and their in-flight place;
    it ran on to its end or its time limit (an outside check: 85 s of CPU after a cancel)."""
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.5")  # how often Gradio looks whether a stream closed
    monkeypatch.setenv("BERT_ENGINE_MAX_IN_FLIGHT", "1")
    app, port = _spinning_app(tmp_path)
    url = f"http://127.0.0.1:{port}/"
    try:
        client = Client(url, verbose=False)
        stops = SPINS["stopped"]
        started = SPINS["count"]
        job = client.submit("hello", api_name="/spins")
        assert _spinning_until(lambda: SPINS["count"] > started + 20), "the request never started"
        job.cancel()
        assert _stopped_spinning(stops), "the cancelled request ran on"
        # its place is free: the same visitor's next request runs (the cap is 1)
        stops = SPINS["stopped"]
        started = SPINS["count"]
        job = client.submit("hello again", api_name="/spins")
        assert _spinning_until(lambda: SPINS["count"] > started + 20), "the next request did not start"
        job.cancel()
        assert _stopped_spinning(stops)

        # A raw HTTP caller that reads its event stream a moment and closes the connection
        stops = SPINS["stopped"]
        started = SPINS["count"]
        body = json.dumps({"data": ["left"]}).encode()
        request = urllib.request.Request(f"{url}gradio_api/call/spins", body, {"Content-Type": "application/json"})
        event_id = json.load(urllib.request.urlopen(request, timeout=30))["event_id"]
        stream = urllib.request.urlopen(f"{url}gradio_api/call/spins/{event_id}", timeout=30)
        assert _spinning_until(lambda: SPINS["count"] > started + 20), "the raw request never started"
        stream.close()
        assert _stopped_spinning(stops), "the request ran on after its sender left"

        # A direct call (POST /gradio_api/run/<name>, no queue) whose caller closes the connection
        stops = SPINS["stopped"]
        started = SPINS["count"]
        body = json.dumps({"data": ["direct"]}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            raw.sendall(b"POST /gradio_api/run/spins HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert _spinning_until(lambda: SPINS["count"] > started + 20), "the direct call never started"
        assert _stopped_spinning(stops), "the direct call ran on after its caller closed the connection"
    finally:
        RELEASE.set()
        app.close()


def test_an_mcp_tool_call_whose_agent_leaves_stops_at_once(tmp_path, monkeypatch):
    """An agent that gives up on a tool call (its MCP request's connection closed: a time-out, a cancelled task)
    stops the request within a second or two. Gradio relays the call through its own loopback client, whose
    stream never closes, so the request ran on to its end or its time limit (41 s of CPU in an outside check)."""
    import asyncio

    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    app, port = _spinning_app(tmp_path, mcp_server=True)

    async def spinning_call(session, text: str, started: int):
        """The spins tool called in a task of its own, once it spins (its rounds counted past `started`)."""
        call = asyncio.create_task(session.call_tool("spins", {"text": text}))
        deadline = time.monotonic() + 30
        while SPINS["count"] < started + 20 and not call.done():
            assert time.monotonic() < deadline, "the tool call never started"
            await asyncio.sleep(0.05)
        assert not call.done(), call.result()
        return call

    async def call_and_leave():
        started = SPINS["count"]
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=60)) as http:
            async with streamable_http_client(f"http://127.0.0.1:{port}/gradio_api/mcp/", http_client=http) as (
                    read, write, _):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    call = await spinning_call(session, "spin for an agent", started)
                    call.cancel()  # the agent gives up
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
        # leaving the blocks closes the agent's connections

    async def call_over_sse():  # the older SSE transport: the call's POST is answered 202 at once, the answer
        from mcp.client.sse import sse_client  # comes on the stream; the call must run on (the outside check:
                                                # every SSE call was cancelled by a first version of the watch)
        started = SPINS["count"]
        async with sse_client(f"http://127.0.0.1:{port}/gradio_api/mcp/sse") as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                call = await spinning_call(session, "spin over sse", started)
                await asyncio.sleep(1.5)
                assert not call.done(), call.result()
                RELEASE.set()
                return await call

    try:
        stops = SPINS["stopped"]
        asyncio.run(call_and_leave())
        assert _stopped_spinning(stops), "the tool call ran on after its agent left"
        result = asyncio.run(call_over_sse())
        assert not result.isError and "spun" in " ".join(p.text for p in result.content if p.type == "text")
        assert SPINS["stopped"] == stops + 1
        # a header a caller makes up under the watch's name is nobody's call: the request runs as any other
        RELEASE.clear()
        forged = Client(f"http://127.0.0.1:{port}/", verbose=False, headers={"x-bert-engine-mcp-call": "0" * 32})
        job = forged.submit("forged", api_name="/spins")
        started = SPINS["count"]
        assert _spinning_until(lambda: SPINS["count"] > started + 20)
        time.sleep(1.5)
        assert not job.done() and SPINS["stopped"] == stops + 1
        RELEASE.set()
        assert json.loads(job.result(timeout=30))["result"] == {"spun": True}
    finally:
        RELEASE.set()
        app.close()


def _run(url: str, name: str, data: list) -> tuple[int, object]:
    """POST /gradio_api/run/<name> (a direct call, no Gradio session): (HTTP status, its JSON body)."""
    request = urllib.request.Request(f"{url}gradio_api/run/{name}", json.dumps({"data": data}).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_a_call_without_a_session_is_a_visitor_of_its_own(served):
    """A direct POST /gradio_api/run/<name> carries no Gradio session: it ran as "no visitor", a script's
    identity, so one such call changed the model of every visitor, and another read its last input through
    /attention and "why" (session 58's audit; also no in-flight place was counted). Each is now a visitor of its
    own, its address the account."""
    from playground.app import REQUEST, current_visitor

    app, url = served
    visitor = Client(url, verbose=False)

    def model_of_visitor():
        return json.loads(visitor.predict("fine", "", "truncate", api_name="/sentiment"))["provenance"]["model"]

    model = model_of_visitor()
    status, body = _run(url, "sentiment_model", ["plugins/starter/ner"])
    assert status >= 400 and "choosing a model needs a session" in json.dumps(body), (status, body)
    status, body = _run(url, "sentiment", ["my secret zebra text", "", "truncate"])
    assert status == 200, body
    status, body = _run(url, "attention", ["sentiment", 0, 0, False, 0])  # another caller: nothing of the first's
    assert "zebra" not in json.dumps(body) and status >= 400, (status, body)
    assert "a call without a session has no last input" in json.dumps(body)  # (not "run a prediction there first")
    # nothing is kept for a call of its own: 270 of them pushed a session's last input out (session 58's re-audit)
    assert app.predictors["sentiment"]._last and not any(str(who).startswith("call:")
                                                          for who in [*app.predictors["sentiment"]._last,
                                                                      *app.predictors["sentiment"]._asked])
    assert model_of_visitor() == model

    class Bare:  # a request as Gradio makes it for a direct call: no session
        session_hash, headers = None, {}

    request = Bare()
    token = REQUEST.set(request)
    try:
        first = current_visitor()
        assert first.startswith("call:") and current_visitor() == first  # the same all through its request
    finally:
        REQUEST.reset(token)
    token = REQUEST.set(Bare())
    try:
        assert current_visitor() != first  # the next call is another visitor
    finally:
        REQUEST.reset(token)


def test_drawing_attention_takes_an_in_flight_place(registry, monkeypatch):
    """/attention ran a forward pass and drew two pictures outside every cap: one session ran 58 of 60 calls at once
    where its requests are capped at 2 (session 58's audit). A drawing is admitted as a task's request is: with the
    session's one place held by its own request still running, the drawing is refused by the real cap."""
    from bert_engine.serving.predictors import BatchingPredictor

    monkeypatch.setenv("BERT_ENGINE_MAX_IN_FLIGHT", "1")
    monkeypatch.setenv("BERT_ENGINE_MAX_WAITING", "0")
    running, release = threading.Event(), threading.Event()
    plain = BatchingPredictor.predict

    def held(self, inputs, **options):  # the workload, not the cap: a request of the session that takes its time
        if "hold" in inputs.get("text", ""):
            running.set()
            assert release.wait(60)
        return plain(self, inputs, **options)

    monkeypatch.setattr(BatchingPredictor, "predict", held)
    app = build_app(registry)
    app.queue(default_concurrency_limit=4)
    port = _launch(app)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        client.predict("fine", "", "truncate", api_name="/sentiment")
        caption = client.predict("sentiment", 0, 0, False, 0, api_name="/attention")[0]
        assert "your last input" in caption  # a place free: drawn
        job = client.submit("hold this one", "", "truncate", api_name="/sentiment")
        assert running.wait(60)
        with pytest.raises(Exception, match="you already have 1 request"):
            client.predict("sentiment", 0, 0, False, 0, api_name="/attention")
        release.set()
        assert json.loads(job.result(timeout=60))["result"]["label"]
    finally:
        release.set()
        app.close()


def test_a_call_to_an_endpoint_the_app_does_not_have_is_a_404_naming_it(served, caplog):
    """Gradio's routes raised on an unknown api_name or fn_index: HTTP 500 with no reason, and a traceback of
    about 40 lines in the log per request, which any visitor could repeat."""
    app, url = served
    calls = (("gradio_api/call/nosuch", {"data": ["x"]}, "no API endpoint 'nosuch' here"),
             ("gradio_api/run/nosuch", {"data": ["x"]}, "no API endpoint 'nosuch' here"),
             ("gradio_api/call/v2/nosuch", {"data": ["x"]}, "no API endpoint 'nosuch' here"),
             ("gradio_api/queue/join", {"data": ["x"], "fn_index": 9999, "session_hash": "s"},
              "no API endpoint number 9999 here"))
    with caplog.at_level("INFO"):
        for path, body, message in calls:
            request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 404 and message in json.load(refused.value)["detail"], path
        # the result stream of an event the app does not have: Gradio's error event, then the stream ends
        stream = urllib.request.urlopen(f"{url}gradio_api/call/sentiment/no-such-event", timeout=30).read().decode()
        assert stream.startswith("event: error") and "Not Found" in stream, stream
        # a queue join with an empty session_hash: refused as Gradio refuses a missing one (it was answered "no API
        # endpoint number <an event id>" for an endpoint the app has, and logged a traceback; session 58's audit)
        fn_index = json.load(urllib.request.urlopen(f"{url}config", timeout=30))["dependencies"][0]["id"]
        request = urllib.request.Request(f"{url}gradio_api/queue/join", json.dumps(
            {"data": [], "fn_index": fn_index, "session_hash": ""}).encode(), {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400 and "session_hash is empty" in json.load(refused.value)["detail"]
        # the key spelt with an escape reads the same; a body that is no object is Gradio's to refuse (it was a 500
        # with a traceback from this check: session 58's re-audit)
        for body, code in (('{"data": [], "fn_index": ' + str(fn_index) + ', "session_h\\u0061sh": ""}', 400),
                           ('[{"session_hash": ""}]', 422)):
            request = urllib.request.Request(f"{url}gradio_api/queue/join", body.encode(),
                                             {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == code, (body, refused.value.code)
    assert not [r for r in caplog.records if r.levelno >= 40 or r.exc_info], [r.getMessage() for r in caplog.records]
    assert sum("an endpoint the app does not have" in r.getMessage() for r in caplog.records) == 4
    assert sum("an event the app does not have" in r.getMessage() for r in caplog.records) == 1
    assert Client(url, verbose=False).predict("fine", "", "truncate", api_name="/sentiment")  # the app still answers
    # a direct call that stays connected is answered (the handler reads whether its connection closed)
    request = urllib.request.Request(f"{url}gradio_api/run/sentiment", json.dumps({"data": ["fine", "", "truncate"]}).encode(),
                                     {"Content-Type": "application/json"})
    assert json.loads(json.load(urllib.request.urlopen(request, timeout=60))["data"][0])["result"]["label"]


def test_model_loads_per_address_are_limited_per_minute(monkeypatch):
    """A model picked or compared that is not in memory costs seconds of CPU no FLOP count or gate turn holds:
    compare calls that rotated tasks reloaded two models each (~3 s of CPU for 0.1 s of counted work) and slowed
    every other visitor (session 58's audit). An address may cause BERT_ENGINE_MODEL_LOADS_PER_MINUTE loads."""
    import tempfile

    from conftest import reference_checkpoint

    from bert_engine.runtime.fairness import TooManyRequests, visitor_scope
    from bert_engine.serving import predictors
    from bert_engine.serving.predictors import LoadBudget, ModelShelf

    root = Path(tempfile.mkdtemp())
    folders = [str(reference_checkpoint(root / f"m{i}", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"}))
               for i in range(3)]
    task = load_registry(entry_points=False).task("sentiment")
    monkeypatch.setenv("BERT_ENGINE_MODEL_LOADS_PER_MINUTE", "2")
    monkeypatch.setattr(predictors.LOADS, "_loads", {})
    shelf = ModelShelf(max_models=1)
    with visitor_scope("visitor a", "ip:10.0.0.1"):
        shelf.get(task, folders[0], "fp32")
        shelf.get(task, folders[1], "fp32")  # (the first leaves the shelf: one model at a time)
        assert shelf.get(task, folders[1], "fp32")  # in memory: costs nothing
        with pytest.raises(TooManyRequests, match="2 models not in memory were loaded for your address in the last "
                                                  "minute.*can be asked again in \\d+ s"):
            shelf.get(task, folders[2], "fp32")
    with visitor_scope("visitor b", "ip:10.0.0.2"):  # another address has its own minute
        shelf.get(task, folders[2], "fp32")
    shelf.get(task, folders[0], "fp32")  # outside a visitor (start-up, a script): not counted
    budget = LoadBudget()
    monkeypatch.setattr(budget, "WINDOW_S", 0.2)
    with visitor_scope("visitor c", "ip:10.0.0.3"):
        budget.charge("x")
        budget.charge("x")
        with pytest.raises(TooManyRequests):
            budget.charge("x")
        budget.charge("x", refuse=False)  # a reload of a model chosen before: counted, never refused
        assert len(budget._loads["ip:10.0.0.3"]) == 3
        time.sleep(0.25)
        budget.charge("x")  # the window has passed


def test_a_model_folder_setting_that_names_no_folder_is_said_at_start(tmp_path, monkeypatch):
    """BERT_ENGINE_MODEL_DIRS=/nonexistent started the app without a word (session 58's fresh-clone trial)."""
    import os

    from playground.app import model_dir_problems

    afile = tmp_path / "a-file"
    afile.write_text("x")
    monkeypatch.setenv("BERT_ENGINE_MODEL_DIRS", os.pathsep.join([str(tmp_path), str(tmp_path / "nope"), str(afile)]))
    assert model_dir_problems() == [
        f"BERT_ENGINE_MODEL_DIRS names {str(tmp_path / 'nope')!r}, which does not exist: no model there is listed or "
        "loaded", f"BERT_ENGINE_MODEL_DIRS names {str(afile)!r}, which is not a folder: no model there is listed or loaded"]


def test_why_reads_the_request_sent_last_not_the_one_that_finished_last():
    """Two requests of one visitor in flight, the earlier one finishing later (a CI run under load: "why" explained
    the earlier text): the views keep the request sent last."""
    from bert_engine.runtime.fairness import visitor_scope
    from bert_engine.serving.predictors import LazyPredictor

    task = load_registry(entry_points=False).task("sentiment")
    lazy = LazyPredictor(task, "plugins/starter/sentiment")
    with visitor_scope("visitor a"):
        lazy.remember_request({"text": "sent second"}, {}, sent=8)
        lazy.remember_request({"text": "sent first, finished last"}, {}, sent=7)
        assert lazy.last_request()[0] == {"text": "sent second"}
        lazy.remember_request({"text": "sent third"}, {}, sent=9)
        assert lazy.last_request()[0] == {"text": "sent third"}
        lazy.remember_request({"text": "no order known"}, {})  # (outside the app: the last kept, as before)
        assert lazy.last_request()[0] == {"text": "no order known"}
