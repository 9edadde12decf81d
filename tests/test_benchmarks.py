"""The benchmark scripts still run (tiny shapes, one repeat): their figures are in benchmarks/README.md."""

import json
from pathlib import Path

import pytest

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
