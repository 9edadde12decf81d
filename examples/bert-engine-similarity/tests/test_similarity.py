"""The plugin author's own tests, using bert_engine's conformance kit."""

from bert_engine.conformance import assert_task_conforms
from bert_engine.registry import load_registry


def test_similarity_conforms():
    registry = load_registry(builtins=(), selected={"similarity"}, strict=True)
    assert_task_conforms(registry.task("similarity"))
