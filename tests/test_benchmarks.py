"""The benchmark scripts still run (tiny shapes, one repeat): their figures are in benchmarks/README.md."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import train_step
from bert_engine.runtime.fast import onednn_int8_available

SST = Path(__file__).parent / "fixtures" / "sst_tiny.tsv"


def test_train_step_on_real_batches_times_the_padding_free_engine_beside_the_padded_one(tmp_path):
    out = tmp_path / "step.json"
    train_step.main(["--device", "cpu", "--model", "minilm", "--shape", "4x32", "--objective", "classify",
                     "--data", str(SST), "--batches", "2", "--repeats", "1", "--json", str(out)])
    rows = {row["impl"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"engine", "engine, padded", "transformers"}
    assert rows["transformers"]["speedup"] == 1 and all(row["ms"] > 0 for row in rows.values())
    assert "sentences, padded" in rows["engine"]["shape"]


def test_real_batches_draw_whole_sentences_padded_to_each_batch_longest():
    batches = train_step.real_batches(str(SST), count=3, batch=4, tokens=16)
    assert len(batches) == 3
    for batch in batches:
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape == (4, int(lengths.max())) and int(lengths.max()) <= 16


@pytest.mark.skipif(not onednn_int8_available(), reason="this torch build has no oneDNN int8 matmul")
def test_int8_rotation_benchmark_times_fp32_and_int8_with_and_without_rotation(tmp_path):
    from benchmarks import int8_rotation

    out = tmp_path / "rotation.json"
    int8_rotation.main(["--task", "sentiment", "--shapes", "1x8", "--blocks", "4,16", "--repeats", "1",
                        "--json", str(out)])
    rows = {row["model"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp32", "int8, no rotation", "int8, rotation 4", "int8, rotation 16"}
    assert rows["fp32"]["vs_fp32"] == 1 and all(row["ms"] > 0 and row["shape"] == "1x8" for row in rows.values())


def test_single_request_benchmark_splits_a_request_into_forward_and_the_rest(tmp_path):
    from benchmarks import single_request

    out = tmp_path / "single.json"
    single_request.main(["--tasks", "sentiment", "--data", str(SST), "--items", "4", "--repeats", "1",
                         "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["task"] == "sentiment" and row["items"] == 4
    # both timed (the forward is timed apart from the request, so on a loaded machine either may read
    # slower: which is larger is the benchmark's figure, not something a test can hold)
    assert row["forward_p50_ms"] > 0 and row["request_p50_ms"] > 0
    assert row["outside_ms"] == pytest.approx(row["request_p50_ms"] - row["forward_p50_ms"], abs=0.02)


def test_bounds_times_the_issue_rate_the_read_rate_and_a_forward_against_its_floors(tmp_path, monkeypatch):
    from benchmarks import bounds

    monkeypatch.setattr(bounds, "STEPS", 200_000)
    monkeypatch.setattr(bounds, "READ_MB", 8)
    out = tmp_path / "bounds.json"
    bounds.main(["--lengths", "1,8", "--rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    limits = result["bounds"]
    assert limits["fma256_gflops"]["one_thread"] > 0 and limits["read_gbps"]["all_threads"] > 0
    assert [row["tokens"] for row in result["rows"]] == [1, 8]
    for row in result["rows"]:  # the floor is the larger of the two, and the forward's ratio to it is recorded
        assert row["floor_ms"] == max(row["weights_floor_ms"], row["fma_floor_ms"]) > 0
        assert row["over_floor"] == pytest.approx(row["forward_ms"] / row["floor_ms"], rel=0.02)
    for bad in (["--lengths", "0,4"], ["--rounds", "0"], ["--lengths", "513"]):  # refused before any timing
        with pytest.raises(SystemExit):
            bounds.main(bad)


def test_bounds_counts_a_layers_flops_and_weights():
    from types import SimpleNamespace

    from benchmarks.bounds import forward_costs

    config = SimpleNamespace(hidden_size=384, intermediate_size=1536, num_hidden_layers=6)
    flops, weight_bytes = forward_costs(config, 10)
    weights = 6 * (4 * 384 * 384 + 2 * 384 * 1536)  # qkv, out, up, down
    assert weight_bytes == 4 * weights and flops == 2 * 10 * weights + 6 * 4 * 10 * 10 * 384


def test_int8_fused_benchmark_times_both_int8_models_in_turn(tmp_path):
    from benchmarks import int8_fused
    from bert_engine.runtime.fast import onednn_int8_available

    if not onednn_int8_available():
        pytest.skip("no oneDNN int8 in this torch")
    out = tmp_path / "fused.json"
    result = int8_fused.main(["--shapes", "1x8", "--rounds", "1", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row == result["rows"][0] and row["shape"] == "1x8" and row["rows"] == 8
    assert row["eager_ms"] > 0 and row["fused_ms"] > 0 and row["max_abs_diff"] == 0.0  # 8 rows: the eager quantiser
    assert "command" in json.loads(out.read_text())  # the file says how it was made


def test_onednn_graph_benchmark_times_each_variant_in_its_own_process(tmp_path):
    """The tried-and-not-shipped TorchScript + oneDNN Graph path (benchmarks/README.md): each variant in a
    process of its own, the fused outputs within float rounding of the eager layers'."""
    from benchmarks import onednn_graph

    out = tmp_path / "graph.json"
    result = onednn_graph.main(["--lengths", "6,9", "--calls", "3", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"] and [r["length"] for r in rows] == [6, 9]
    assert all(r["eager_ms"] > 0 and r["onednn_graph_ms"] > 0 and r["fused_max_abs_diff"] < 1e-3 for r in rows)
    assert result["fused_back_to_a_seen_length_ms"] > 0


def test_profile_kinds_put_each_sides_operators_into_the_same_kinds_of_work():
    from benchmarks.profile_ops import by_kind, kind_of

    # the engine's (torch) and ONNX Runtime's names for the same work land in the same kind
    assert kind_of("mkldnn::_linear_pointwise") == kind_of("MatMul") == kind_of("aten::addmm") == "matmuls"
    assert kind_of("onednn::qlinear_pointwise") == kind_of("MatMulIntegerToFloat") == "matmuls"
    assert kind_of("DynamicQuantizeMatMul") == kind_of("quantized::linear_dynamic") == "matmuls"
    assert kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == kind_of("Attention") == "attention"
    assert kind_of("aten::native_layer_norm") == kind_of("SkipLayerNormalization") == "LayerNorm and residual adds"
    assert kind_of("DynamicQuantizeLinear") == kind_of("aten::round_") == "activation quantisation"
    assert kind_of("aten::embedding") == kind_of("EmbedLayerNormalization") != "matmuls"
    assert kind_of("aten::gelu") == kind_of("BiasGelu") == "GELU and other element-wise"
    assert kind_of("aten::view") == "other (views, reshapes, dispatch)"
    kinds = by_kind({"MatMul": 2.0, "Attention": 1.0, "aten::view": 0.5})
    assert kinds["matmuls + attention"] == 3.0 and kinds["other (views, reshapes, dispatch)"] == 0.5


def test_profile_ops_profiles_onnx_runtime_beside_the_engine(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from benchmarks import profile_ops

    out = tmp_path / "profile.json"
    profile_ops.main(["--shape", "1x16", "--repeats", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    ort = "onnxruntime (fp32)"
    assert set(result["wall_ms"]) == {"engine (fp32, packed)", "engine (plain nn.Linear)", "transformers", ort}
    kinds = {row["kind"]: row for row in result["kinds"]}
    # ONNX Runtime's profile was read: its fused graph's matmuls and attention both took time
    assert kinds["matmuls"][ort] > 0 and kinds["attention"][ort] > 0 and kinds["profiled total"][ort] > 0
    assert {row["op"] for row in result["ops"] if row["impl"] == ort} >= {"MatMul", "Attention"}


def test_int8_kernels_benchmark_times_each_int8_kernel_beside_fp32(tmp_path):
    from benchmarks import int8_kernels
    from bert_engine.runtime.fast import fbgemm_int8_available, tiled_int8_available

    if not (onednn_int8_available() or fbgemm_int8_available()):
        pytest.skip("no int8 matmul in this torch")
    out = tmp_path / "kernels.json"
    result = int8_kernels.main(["--shapes", "1x4", "--rounds", "1", "--no-onnx", "--json", str(out)])
    rows = {row["impl"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows == {row["impl"]: row for row in result["rows"]} and "engine fp32" in rows
    int8 = [name for name in rows if name.startswith("engine int8")]
    assert len(int8) == onednn_int8_available() + fbgemm_int8_available() + tiled_int8_available()
    # each kernel's model really is int8: close to fp32, not equal to it
    assert all(0 < rows[name]["max_abs_diff"] < 0.5 and rows[name]["vs_engine_fp32"] > 0 for name in int8)
    assert rows["engine fp32"]["max_abs_diff"] < 1e-4


def test_int8_agreement_benchmark_scores_each_int8_kernel_against_fp32(tmp_path):
    from benchmarks import int8_agreement
    from bert_engine.runtime.fast import fbgemm_int8_available, tiled_int8_available

    if not (onednn_int8_available() or fbgemm_int8_available()):
        pytest.skip("no int8 matmul in this torch")
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "dev.tsv").write_text(SST.read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "agreement.json"
    result = int8_agreement.main(["--tasks", "sentiment", "--limit", "6", "--data", str(tmp_path), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"]
    assert [r["int8_kernel"] for r in rows] == [k for k, ok in (("onednn", onednn_int8_available()),
                                                                ("fbgemm", fbgemm_int8_available()),
                                                                ("tiled", tiled_int8_available())) if ok]
    assert all(r["task"] == "sentiment" and r["items"] == 6 and 0 <= r["identical"] <= 100 for r in rows)
    assert all(r["met"] == (r["identical"] >= 99.0) for r in rows)
    with pytest.raises(SystemExit, match="unknown"):
        int8_agreement.main(["--tasks", "translation"])
    with pytest.raises(SystemExit, match=r"--kernels: \['mkl'\] unknown"):
        int8_agreement.main(["--kernels", "mkl"])


def test_fp32_kernels_benchmark_times_a_whole_forward_with_each_kernel(tmp_path):
    from benchmarks import fp32_kernels
    from bert_engine.runtime import native

    out = tmp_path / "fp32.json"
    result = fp32_kernels.main(["--shapes", "1x4,2x8", "--rounds", "1", "--no-onnx", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and saved["command"].startswith("python")
    kernels = ["packed", "plain"] + (["tiled"] if native.library() is not None else []) + ["auto"]
    assert [r["kernels"] for r in saved["rows"]] == kernels * 2
    assert all(r["max_abs_diff"] < 1e-4 and r["vs_packed"] > 0 for r in saved["rows"])
    assert set(saved["auto_chose"]) - {"attention"} == {"qkv", "out", "up", "down"}  # (and the attention's choice)
    assert saved["tiled_kernel"] == (native.unavailable() or "available")


def test_native_ab_times_the_kernels_at_a_revision_beside_the_working_trees(tmp_path):
    from benchmarks import native_ab
    from bert_engine.runtime import native

    root = Path(native.__file__).resolve().parents[2]
    git = shutil.which("git")
    readable = git is not None and subprocess.run([git, "-C", str(root), "rev-parse", "HEAD"],
                                                  capture_output=True).returncode == 0
    if native.library() is None or not readable:
        pytest.skip(f"needs the kernels and a git checkout git can read: {native.unavailable() or 'not one here'}")
    out, ours = tmp_path / "ab.json", native.library()
    result = native_ab.main(["--base", "HEAD", "--shapes", "1x5,2x9", "--rounds", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and [r["shape"] for r in saved["rows"]] == ["1x5", "2x9"]
    assert all(r["max_abs_diff"] < 1e-4 and r["speedup"] > 0 and r["working_tree_vs_packed"] > 0 for r in saved["rows"])
    assert native.library() is ours  # the working tree's library is put back
    with pytest.raises(SystemExit, match="no-such-revision"):
        native_ab.main(["--base", "no-such-revision", "--shapes", "1x5", "--rounds", "1"])


def test_a_merged_workloads_run_replaces_only_what_it_measured(tmp_path):
    from benchmarks.workloads import merged

    earlier = {"command": "python -m benchmarks.workloads --modes batched,single", "machine": {"cpu": "EPYC"},
               "peers": {"transformers": "4.57"},
               "rows": [{"task": t, "mode": m, "impl": i, "s": 1.0} for t in ("sentiment", "ner")
                        for m in ("batched", "single") for i in ("engine", "onnxruntime")]}
    path = tmp_path / "workloads.json"
    path.write_text(json.dumps(earlier))
    now = {"machine": {"cpu": "EPYC"}, "rows": [{"task": "ner", "mode": "single", "impl": i, "s": 0.5}
                                                 for i in ("engine", "onnxruntime")]}
    result = merged(path, now)
    assert [(r["task"], r["mode"], r["s"]) for r in result["rows"] if r["impl"] == "engine"] == [
        ("sentiment", "batched", 1.0), ("sentiment", "single", 1.0), ("ner", "batched", 1.0), ("ner", "single", 0.5)]
    kept = [r for r in result["rows"] if r["s"] == 1.0]
    assert len(kept) == 6 and all(r["from"] == {"command": earlier["command"], "cpu": "EPYC"} for r in kept)
    assert all("from" not in r for r in result["rows"] if r["s"] == 0.5) and result["peers"] == earlier["peers"]
    assert merged(tmp_path / "none.json", now) is now


def test_workload_speed_ups_pair_each_engine_row_with_the_peer_at_its_precision():
    from benchmarks.workloads import compare

    def row(impl, precision, s):
        return {"task": "qa", "mode": "batched", "impl": impl, "precision": precision, "s": s}

    gpu = [row("engine", "fp32", 1.0), row("transformers", "fp32", 2.0), row("engine", "bf16", 0.5),
           row("transformers", "bf16", 0.25)]
    compare(gpu)
    assert gpu[0]["vs_transformers"] == 2.0 and gpu[2]["vs_transformers"] == 0.5  # bf16 against bf16, not fp32
    cpu = [row("engine", "fp32", 1.0), row("onnxruntime", "fp32", 1.5), row("engine", "int8", 0.5)]
    compare(cpu)
    assert cpu[0]["vs_onnxruntime"] == 1.5 and cpu[2]["vs_onnxruntime"] == 3.0  # int8 against the fp32 peer


def test_the_workloads_name_missing_data_and_unknown_tasks_in_one_line(tmp_path, capsys):
    from benchmarks import workloads

    with pytest.raises(SystemExit) as stop:
        workloads.main(["--data", str(tmp_path), "--tasks", "sentiment,qa"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(tmp_path / "sst2" / "dev.tsv") in err and "dev-v1.1.json" in err and "--data" in err
    with pytest.raises(SystemExit):
        workloads.main(["--tasks", "sentimnet"])
    assert "unknown sentimnet" in capsys.readouterr().err


def test_a_visitors_requests_go_to_the_engine_and_the_peers_in_turns(monkeypatch):
    """With peers, the single mode takes turns of VISITOR_TURN requests (who goes first rotating), so each
    contender answers every request once a round on its own clock, and a slow spell falls on all alike."""
    from benchmarks import workloads
    from benchmarks.peers import CONTENDERS

    monkeypatch.setattr(workloads, "PAUSE_S", 0.0)
    calls = []

    class Peer:
        def ask(self, op, contender, index):
            assert op == "one"
            calls.append((contender, index))
            return {"seconds": 0.5, "prediction": f"{contender} {index}"}

    def single(item):
        calls.append(("engine", item["i"]))
        return f"engine {item['i']}"

    items = [{"i": i} for i in range(workloads.VISITOR_TURN + 3)]
    latencies, answers = {}, {}
    times = workloads.visitors_in_turn(single, Peer(), items, 2, latencies, answers)
    names = ("engine", *CONTENDERS)
    assert set(times) == set(names) and all(len(t) == 2 for t in times.values())
    assert [times[name][0] for name in CONTENDERS] == [0.5 * len(items)] * len(CONTENDERS)
    assert all(answers[name] == [f"{name} {i}" for i in range(len(items))] for name in names)
    assert all(len(latencies[name]) == len(items) for name in names)
    turn = workloads.VISITOR_TURN
    assert [calls[0][0], calls[turn * len(names)][0]] == ["engine", names[1]]  # who goes first rotates
    assert calls[:turn] == [("engine", i) for i in range(turn)]  # a turn: that many requests of one contender
    assert len(calls) == 3 * len(items) * len(names)  # a warm-up round and two timed ones


def _stat(folder: Path, pid: int, parent: int, utime: int, stime: int, name: str = "python") -> None:
    (folder / str(pid)).mkdir()
    fields = ["S", str(parent), *["0"] * 9, str(utime), str(stime), *["0"] * 10]  # state, ppid, ..., utime, stime
    (folder / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(fields)}\n")


def test_a_benchmark_counts_the_processes_it_started_as_its_own_work(tmp_path):
    """own_cpu_seconds: this process, then its children and their children from the process table (a peer's
    server, an app under load); not a process of someone else's, whatever its name holds."""
    import os

    from benchmarks.common import own_cpu_seconds

    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    empty = tmp_path / "empty"
    empty.mkdir()
    table = tmp_path / "proc"
    table.mkdir()
    _stat(table, me, 1, 5000, 5000)  # our own entry: counted by process_time, not again
    _stat(table, 900001, me, 30, 10, name="peer) (server")  # a child, its name holding ") ("
    _stat(table, 900002, 900001, 7, 3)  # its child
    _stat(table, 900003, 1, 4000, 4000)  # someone else's
    (table / "900004").mkdir()  # gone while read: skipped
    (table / "self").mkdir()
    extra = own_cpu_seconds(str(table)) - own_cpu_seconds(str(empty))
    assert extra == pytest.approx(50 / tick, abs=0.02)
    assert own_cpu_seconds(str(tmp_path / "missing")) >= 0  # no process table: this process's own alone


def test_a_spinning_child_is_the_benchmarks_work_and_the_record_says_how_busy_the_machine_was(tmp_path, capsys,
                                                                                              monkeypatch):
    import sys
    import time

    from benchmarks import common

    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before, deadline = common.own_cpu_seconds(), time.monotonic() + 20
        # the child's spinning, counted as ours (within 20 s: on 2 busy cores it may get a share of one)
        while common.own_cpu_seconds() - before <= 0.5 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert common.own_cpu_seconds() - before > 0.5
    finally:
        child.kill()
        child.wait()
    for share, said in ((0.41, True), (0.02, False), (None, False)):
        monkeypatch.setattr(common, "_others_share", lambda share=share: share)
        payload = {"machine": {"cpu": "x"}, "rows": []}
        common.write_json(tmp_path / "out.json", payload)
        written = json.loads((tmp_path / "out.json").read_text())
        assert written["machine"]["others_cpu_share"] == share
        out = capsys.readouterr().out
        assert ("other work took 41 % of this machine's CPUs" in out) is said, out
    from benchmarks.report import _machine

    shown = _machine({"machine": {"cpu": "Xeon", "threads": 2, "torch": "2.13.0", "others_cpu_share": 0.031}})
    assert shown.endswith("other work 3 % of the CPUs during the run")
    assert "other work" not in _machine({"machine": {"cpu": "Xeon", "threads": 2, "torch": "2.13.0"}})


def test_the_contention_benchmark_times_both_settings_in_turn_beside_spinning_processes(tmp_path, monkeypatch):
    """benchmarks.contention: each load level's spinners start and are gone after, both settings answer every
    request alike, and the caller's BERT_ENGINE_SHARE_CPUS is put back."""
    import os

    from benchmarks import contention

    monkeypatch.setattr(contention, "DATA", tmp_path / "no data")  # the tasks' own examples, as in CI
    monkeypatch.setenv("BERT_ENGINE_SHARE_CPUS", "1")
    spawned = []
    real = contention._spinners

    def spinners(count):
        started = real(count)
        spawned.extend(started)
        return started

    monkeypatch.setattr(contention, "_spinners", spinners)
    out = tmp_path / "contention.json"
    contention.main(["--tasks", "sentiment", "--requests", "4", "--loads", "0,1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["task"], r["busy_processes"], r["requests"]) for r in rows] == [("sentiment", 0, 4), ("sentiment", 1, 4)]
    assert all(r["identical"] == 100.0 and r["on_p50_ms"] > 0 and r["off_mean_ms"] > 0 for r in rows)
    assert len(spawned) == 1 and spawned[0].poll() is not None  # the spinner was stopped
    assert os.environ["BERT_ENGINE_SHARE_CPUS"] == "1"
    with pytest.raises(SystemExit):
        contention.main(["--loads", "-1"])


def test_the_summary_peers_glue_chooses_the_engines_sentences_with_transformers_as_the_encoder(tmp_path):
    """benchmarks/summary_reference.py (what the workloads run as the summary task's transformers and ONNX Runtime
    contenders: no pipeline extracts sentences) is plugins/summary.py's default around another encoder: on the
    starter's merged folder, with transformers' BertModel, it picks what the engine picks."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.summary_reference import SummaryReference, torch_encoder
    from benchmarks.workloads import merged_folder
    from bert_engine.runtime.inference import Predictor, predict_texts
    from bert_engine.tasks.registry import load_registry
    from plugins.summary import read_data

    task = load_registry(entry_points=False).task("summary")
    if task.spec.default_checkpoint is None:
        pytest.skip("no summary starter model packed")
    folder = merged_folder("summary", tmp_path)
    engine = Predictor.load(task, str(folder))
    texts = [inputs["text"] for inputs, _ in read_data(Path(__file__).parent / "fixtures" / "bbc_tiny.jsonl", "all")]
    model = transformers.BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
    reference = SummaryReference(folder, torch_encoder(model, rows=2), engine.check_options({}))
    ours = predict_texts(engine, texts, batch_size=2)
    theirs = reference.many(texts, documents=2)
    assert [r["selected"] for r in theirs] == [r["selected"] for r in ours] and all(r["mode"] == "hybrid" for r in theirs)
    for a, b in zip(ours, theirs):
        assert [s["score"] for s in b["sentences"]] == pytest.approx([s["score"] for s in a["sentences"]], abs=1e-4)


def test_summary_passes_splits_a_visitors_request_on_test_split_articles(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks import summary_passes
    from bert_engine.tasks.registry import load_registry
    from plugins.summary import read_data, split_of

    if load_registry(entry_points=False).task("summary").spec.default_checkpoint is None:
        pytest.skip("no summary starter model packed")
    articles = [inputs["text"] for inputs, _ in read_data(Path(__file__).parent / "fixtures" / "bbc_tiny.jsonl", "all")]
    ids = [i for i in (f"doc{n}" for n in range(200)) if split_of(i) == "test"][:2]
    data = tmp_path / "bbc.jsonl"
    data.write_text("".join(json.dumps({"id": i, "article": a, "summary": a.split(".")[0] + "."}) + "\n"
                            for i, a in zip(ids, articles)))
    out = tmp_path / "passes.json"
    summary_passes.main(["--articles", "2", "--rounds", "1", "--data", str(data), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["articles"] == 2 and all(v["median"] > 0 for v in result["ms"].values())
    assert result["rows"]["sentences, padded"] >= result["rows"]["sentences, real tokens"] > 0


def test_qa_host_times_each_step_around_the_forward_on_squad_questions(tmp_path, capsys):
    from benchmarks import qa_host

    out = tmp_path / "host.json"
    qa_host.main(["--questions", "6", "--rounds", "1", "--data", str(Path(__file__).parent / "fixtures" / "squad_tiny.json"),
                  "--json", str(out), "--profile", "5"])
    result = json.loads(out.read_text())
    assert result["questions"] == 3 and result["machine"]["cpu_class"]  # all the fixture holds
    assert set(result["ms_per_question"]) == {"preprocess, one at a time", "preprocess, all at once", "postprocess",
                                              "forward passes", "predict_many"}
    assert all(ms > 0 for ms in result["ms_per_question"].values())
    profile = result["profile"]  # the costliest functions by own time, first the costliest
    assert len(profile) == 5 and all(row["calls"] >= 1 and row["cumulative_ms"] >= row["own_ms"] >= 0 for row in profile)
    assert [row["own_ms"] for row in profile] == sorted((row["own_ms"] for row in profile), reverse=True)
    assert profile[0]["own_ms"] > 0
    with pytest.raises(SystemExit):
        qa_host.main(["--data", str(tmp_path / "missing.json")])
    fixture = str(Path(__file__).parent / "fixtures" / "squad_tiny.json")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            qa_host.main(["--device", "cuda", "--data", fixture])
    for bad in (["--device", "tpu"], ["--precision", "xyz"], ["--model", str(tmp_path / "nope")]):
        with pytest.raises(SystemExit):  # parser.error: one line, no traceback
            qa_host.main([*bad, "--data", fixture])
    assert "xyz" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(path.stem for path in (Path(__file__).parents[1] / "benchmarks").glob("*.py")
                                        if "__main__" in path.read_text() and path.stem != "common"))
def test_every_benchmark_answers_help_without_running(name, capsys):
    """benchmarks/README lists each command; `--help` says what it takes and runs nothing (request_costs had no
    parser: --help ran the whole benchmark for 30 s)."""
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
