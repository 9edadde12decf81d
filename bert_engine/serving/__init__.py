"""How callers reach a task: `pipeline()` for Python code, and the predictors the playground shares
between visitors (lazy loading, request batching).
"""


def __getattr__(name: str):
    """`bert_engine.serving` was one module (predictors.py) before the layers of issue 37; its names
    (LazyPredictor, BatchingPredictor) still resolve here."""
    import importlib  # noqa: PLC0415 - only for a caller of the old path

    predictors = importlib.import_module(f"{__name__}.predictors")
    try:
        return getattr(predictors, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
