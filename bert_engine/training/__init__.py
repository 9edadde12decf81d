"""Training: TrainConfig, the loop (one for every job), the jobs (fine-tuning a task, pretraining),
pretraining data (pairs, masking) and distillation.
"""


def __getattr__(name: str):
    """`bert_engine.training` was one module (the loop, and the torchrun helpers now in
    runtime.distributed) before the layers of issue 37; its names still resolve here."""
    import importlib  # noqa: PLC0415 - only for a caller of the old path

    for module in ("bert_engine.training.loop", "bert_engine.runtime.distributed"):
        value = getattr(importlib.import_module(module), name, importlib)
        if value is not importlib:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
