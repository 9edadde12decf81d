"""The plugin author's own tests, using bert_engine's conformance kit."""

from pathlib import Path

from bert_engine.tasks.conformance import assert_task_conforms
from bert_engine.tasks.registry import load_registry

SAMPLE = Path(__file__).parent / "sts_tiny.tsv"  # a few pairs in read_data's format: checks training too


def test_similarity_conforms():
    registry = load_registry(builtins=(), selected={"similarity"}, strict=True)
    assert_task_conforms(registry.task("similarity"), data=SAMPLE)
