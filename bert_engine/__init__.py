"""bert_engine: BERT written from scratch in PyTorch, loading Hugging Face checkpoints.

    >>> from bert_engine import load
    >>> loaded = load("path/to/checkpoint-or-hub-id")   # a Loaded record; it unpacks as model, tokenizer
    >>> out = loaded.model(**loaded.tokenizer(["Hello world"]).model_inputs())
"""

__version__ = "0.1.0"  # before the imports: registry.py records it as the built-in plugins' version

from .config import PRESETS, BertConfig
from .heads import HEADS, BertWithHead
from .hub import HubError, default_backbone, resolve
from .loader import load, load_pretrained, load_tokenizer
from .loading import CheckpointError, Loaded, save_pretrained
from .model import BertModel, EncoderOutput
from .pipeline import Pipeline, pipeline
from .tokenizer import Batch, Tokenizer

__all__ = [
    "PRESETS", "BertConfig", "HEADS", "BertWithHead", "HubError", "default_backbone", "resolve", "CheckpointError", "Loaded", "load",
    "load_pretrained", "load_tokenizer", "Pipeline", "pipeline", "save_pretrained", "BertModel", "EncoderOutput", "Batch", "Tokenizer",
]
