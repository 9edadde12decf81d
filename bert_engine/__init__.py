"""bert_engine: BERT written from scratch in PyTorch, loading Hugging Face checkpoints.

    >>> from bert_engine import load
    >>> loaded = load("path/to/checkpoint-or-hub-id")   # a Loaded record; it unpacks as model, tokenizer
    >>> out = loaded.model(**loaded.tokenizer(["Hello world"]).model_inputs())

The names below load on first use (PEP 562), so `bert-engine --help` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "PRESETS": "config", "BertConfig": "config", "HEADS": "heads", "BertWithHead": "heads", "HubError": "hub",
    "default_backbone": "hub", "resolve": "hub", "load": "loader", "load_pretrained": "loader",
    "load_tokenizer": "loader", "CheckpointError": "loading", "Loaded": "loading", "save_pretrained": "loading",
    "BertModel": "model", "EncoderOutput": "model", "Pipeline": "pipeline", "pipeline": "pipeline",
    "Batch": "tokenizer", "Tokenizer": "tokenizer",
}
__all__ = [
    "PRESETS", "BertConfig", "HEADS", "BertWithHead", "HubError", "default_backbone", "resolve", "load", "load_pretrained",
    "load_tokenizer", "CheckpointError", "Loaded", "save_pretrained", "BertModel", "EncoderOutput", "Pipeline",
    "pipeline", "Batch", "Tokenizer",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ below imports on first use
    from .config import PRESETS, BertConfig
    from .heads import HEADS, BertWithHead
    from .hub import HubError, default_backbone, resolve
    from .loader import load, load_pretrained, load_tokenizer
    from .loading import CheckpointError, Loaded, save_pretrained
    from .model import BertModel, EncoderOutput
    from .pipeline import Pipeline, pipeline
    from .tokenizer import Batch, Tokenizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bert_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
