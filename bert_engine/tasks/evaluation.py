"""A task's labelled examples read from files (one file, a glob of shards, or a comma-separated list)
and its metrics over them through a Predictor: the generic "predict, then score" or the task's own
`evaluate`. Training evaluates with it between steps; `bert-engine eval`, `pack` and the conformance
kit call it directly.
"""

from __future__ import annotations

import glob
from itertools import chain, islice
from pathlib import Path
from typing import Any

from ..hookspecs import TaskSpec
from ..progress import progress_bar
from ..runtime.distributed import Distributed, gather_objects
from ..runtime.inference import can_batch


def evaluate_task(spec: TaskSpec, predictor, examples: list, *, rank: int = 0, world: int = 1,
                  progress: bool = False, **options) -> dict[str, Any]:
    """The task's metrics on (inputs, target) examples: its own `evaluate` if it has one, else
    predictions (batched where the task can) scored by its `metric`. Sharded over ranks and gathered."""
    if spec.evaluate is not None:  # the task's own evaluation runs on the first rank only
        return spec.evaluate(predictor, examples, progress=progress, **options) if rank == 0 else {}
    if spec.metric is None:
        raise ValueError(f"task {spec.name!r} declares neither metric nor evaluate; it cannot be evaluated")
    mine = list(range(rank, len(examples), world))
    inputs = [examples[i][0] for i in mine]
    if can_batch(spec, inputs):
        field = spec.input_fields[0]
        results = spec.predict_many(predictor, [x[field] for x in inputs], progress=progress, **options)
    else:
        results = [predictor.predict(x, **options)["result"] for x in progress_bar(inputs, disable=not progress,
                                                                            desc=spec.name, unit="example")]
    gathered = gather_objects(list(zip(mine, results)), Distributed(rank, world))
    ordered = sorted((pair for part in gathered for pair in part), key=lambda pair: pair[0])
    return spec.metric([r for _, r in ordered], [examples[i][1] for i, _ in ordered])


def data_files(path: str) -> list[str]:
    """`path` itself; for a glob pattern that names no file as such ("train-*.json"), the files it
    matches in sorted order, so several shards train as one set; for a comma-separated list that names
    no file as such ("books/,wiki.valid.tokens"), each part in turn (itself a path or a pattern), so
    sources of one format mix."""
    text = str(path)
    if "," in text and not Path(text).exists():
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise ValueError(f"{text!r}: names no file")
        return [file for part in parts for file in data_files(part)]
    if any(c in text for c in "*?[") and not Path(text).exists():
        files = sorted(glob.glob(text))
        if not files:
            raise ValueError(f"{text}: no file matches this pattern")
        return files
    return [path]


def read_examples(spec: TaskSpec, path: str, split: str, limit: int | None) -> list:
    """The task's examples from `path`; every way a reader can fail on a bad file is a ValueError
    naming the file (a binary file, a reader's own KeyError), not a traceback from inside the task."""
    try:
        return list(islice(chain.from_iterable(spec.read_data(p, split) for p in data_files(path)), limit))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start} is {err.object[err.start:err.start + 1]!r}); "
                         f"task {spec.name!r} reads text files") from None
    except IsADirectoryError as err:  # a folder reads as text files for pretraining and fill-mask, not here
        raise ValueError(f"{err.filename or path}: is a folder; task {spec.name!r} reads its data from a file (or a "
                         "glob pattern of files, or a comma-separated list)") from None
    except (ValueError, OSError):
        raise
    except Exception as err:  # noqa: BLE001 - a third-party reader's failure on this file
        raise ValueError(f"{path}: task {spec.name!r} could not read its {split!r} split "
                         f"({type(err).__name__}: {err})") from None
