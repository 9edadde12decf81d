"""bert_engine: BERT written from scratch in PyTorch, loading Hugging Face checkpoints.

    >>> from bert_engine import load
    >>> loaded = load("path/to/checkpoint-or-hub-id")   # a Loaded record; it unpacks as model, tokenizer
    >>> out = loaded.model(**loaded.tokenizer(["Hello world"]).model_inputs())

The names below load on first use (PEP 562), so `bert-engine --help` does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from .version import __version__  # noqa: F401 - the package's version, as always

_EXPORTS = {
    "PRESETS": "config", "BertConfig": "config", "HEADS": "heads", "BertWithHead": "heads",
    "HubError": "checkpoints.hub", "default_backbone": "checkpoints.hub", "resolve": "checkpoints.hub",
    "load": "checkpoints.loader", "load_pretrained": "checkpoints.loader", "load_tokenizer": "checkpoints.loader",
    "CheckpointError": "checkpoints.loading", "Loaded": "checkpoints.loading", "save_pretrained": "checkpoints.loading",
    "BertModel": "model", "EncoderOutput": "model", "Pipeline": "serving.pipeline", "pipeline": "serving.pipeline",
    "Batch": "tokenizer", "Tokenizer": "tokenizer", "InputError": "errors",
}
__all__ = [
    "PRESETS", "BertConfig", "HEADS", "BertWithHead", "HubError", "default_backbone", "resolve", "load", "load_pretrained",
    "load_tokenizer", "CheckpointError", "Loaded", "save_pretrained", "BertModel", "EncoderOutput", "Pipeline",
    "pipeline", "Batch", "Tokenizer", "InputError",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ below imports on first use
    from .checkpoints.hub import HubError, default_backbone, resolve
    from .checkpoints.loader import load, load_pretrained, load_tokenizer
    from .checkpoints.loading import CheckpointError, Loaded, save_pretrained
    from .config import PRESETS, BertConfig
    from .errors import InputError
    from .heads import HEADS, BertWithHead
    from .model import BertModel, EncoderOutput
    from .serving.pipeline import Pipeline, pipeline
    from .tokenizer import Batch, Tokenizer


# Where each module lived before the package was split into layers (issue 37) -> where it is now.
# `import bert_engine.registry` and the like keep working: the old name is the same module object.
MOVED = {
    "hub": "checkpoints.hub", "loading": "checkpoints.loading",
    "loader": "checkpoints.loader", "lora": "checkpoints.lora",
    "precision": "runtime.precision", "fast": "runtime.fast", "cancel": "runtime.cancel",
    "fairness": "runtime.fairness", "inference": "runtime.inference",
    "registry": "tasks.registry", "conformance": "tasks.conformance",
    "train_config": "training.train_config", "pretraining": "training.pretraining", "jobs": "training.jobs",
    "distill": "training.distill", "publish": "shipping.publish",
}
# (`bert_engine.pipeline` is the function above, as it always was; the old `bert_engine.serving` and
# `bert_engine.training` modules are now packages whose names still resolve: see their __init__.)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `bert_engine.<old name>` (MOVED) and answers with the module at its new path."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module: Any) -> None:
        pass  # already imported by create_module


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bert_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
