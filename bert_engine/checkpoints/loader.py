"""The one call users make: a folder, a Hub id or a LoRA adapter folder in, a `Loaded` record out.

loading.py reads plain checkpoints and lora.py adapters; this module sits above both and picks
between them, then loads the tokenizer and checks that model and tokenizer belong together.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from .. import heads
from ..files import recorded_field
from ..tokenizer import Tokenizer
from .hub import resolve
from .loading import CheckpointError, Loaded, load_model
from .lora import _manifest_task, load_adapter

logger = logging.getLogger(__name__)


def load(name_or_path: str | Path, head: str | nn.Module | None = None, *, labels: list[str] | None = None,
         revision: str | None = None, local_files_only: bool = False, attn_backend: str = "sdpa",
         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", strict: bool = False,
         warn_missing: bool = True, allowed_dirs: list[Path] | None = None, with_tokenizer: bool = True,
         **hub_kwargs) -> Loaded:
    """Model and tokenizer of a checkpoint (folder or Hub id) or of a LoRA adapter folder, checked to
    agree (every token id has an embedding row).

    Args:
        head: None for the bare encoder, a name from heads.HEADS, "auto" (from the checkpoint's
            `architectures`), a head module, or a factory `config -> head module` (task plugins).
        labels: label names for a new classification head (overrides the checkpoint's id2label).
        strict: also raise on unexpected keys and a missing (untrained) head.
        warn_missing: log missing head weights.
        allowed_dirs: where a LoRA adapter's local base_model may lie (None: anywhere); the playground
            passes the folders its model picker allows.
        with_tokenizer: False leaves `tokenizer` None (the checkpoint need not hold tokenizer files).
    Returns:
        A Loaded record: `model` (in eval mode on `device`), `tokenizer`, `checkpoint` (a hub.Resolved,
        for provenance), `report` (missing / unexpected keys), and for an adapter `adapter` and `base`.
        It unpacks as `model, tokenizer = load(...)`.
    Raises:
        hub.HubError: the checkpoint cannot be found or downloaded.
        CheckpointError: a file is unsafe, corrupt, or does not fit (names the file and the tensor),
            or the tokenizer's vocabulary is larger than the embedding table.
        ValueError: config.json holds impossible values.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"the model must be a folder or a Hub id (text), got {type(name_or_path).__name__}")
    if not str(name_or_path).strip():  # "" would be the current folder
        raise ValueError("the model is empty: give a checkpoint folder or a Hub id")
    name_or_path = run_checkpoint(name_or_path)
    resolved = resolve(name_or_path, revision=revision, local_files_only=local_files_only, **hub_kwargs)
    if (resolved.folder / "adapter_config.json").is_file():
        if head is None or head == "auto":
            raise CheckpointError(_adapter_needs_a_head(resolved.folder))
        loaded = load_adapter(resolved, head, attn_backend=attn_backend, dtype=dtype, device=device,
                              local_files_only=local_files_only, allowed_dirs=allowed_dirs, **hub_kwargs)
    else:
        loaded = load_model(resolved, head, labels=labels, attn_backend=attn_backend, dtype=dtype, device=device,
                            strict=strict, warn_missing=warn_missing)
    if with_tokenizer:
        loaded.tokenizer = _matching_tokenizer(loaded)
    return loaded


def run_checkpoint(name_or_path: str | os.PathLike) -> str | os.PathLike:
    """A training run's folder (train_config.json and best/, no checkpoint files of its own) as its best/
    checkpoint, which `bert-engine train` keeps there; any other name as given."""
    run = Path(str(name_or_path))
    if ((run / "train_config.json").is_file() and (run / "best").is_dir() and not (run / "config.json").exists()
            and not (run / "adapter_config.json").exists()):
        logger.info("%s is a training run: loading its best/", name_or_path)
        return str(run / "best")
    return name_or_path


def recorded_task(folder: str | os.PathLike) -> str | None:
    """The task a model folder was made for, where it says: a packed folder's manifest.json, else the training
    run's train_config.json (run_task)."""
    return _manifest_task(Path(str(folder))) or run_task(folder)


def run_task(folder: str | os.PathLike) -> str | None:
    """The task a training run trained (its train_config.json's "task"), for the run's folder or a checkpoint
    inside it (best/, last/); None where there is none."""
    folder = Path(str(folder))
    # the run's folder itself, or the run around one of its checkpoints (nothing above any other folder is read)
    for run in (folder, folder.parent) if folder.name in ("best", "last") else (folder,):
        if not (run / "train_config.json").exists():
            continue
        task = recorded_field(run, "train_config.json", "task")  # inside, capped, a regular file
        return task if isinstance(task, str) and task.isidentifier() else None
    return None


def _adapter_needs_a_head(folder: Path) -> str:
    """The refusal for an adapter folder loaded without a head: which task it is for (its manifest.json,
    when it has one) and the two ways to load it."""
    task = _manifest_task(folder)
    use = (f"`bert-engine predict {task} --model {folder}` (its manifest says task {task!r})" if task
           else "`bert-engine predict TASK --model FOLDER`")
    return (f"{folder}: a LoRA adapter folder needs a head to load: pass --head (one of "
            f"{', '.join(sorted(heads.HEADS))}; in Python, load(folder, head)) matching its task, or run it through "
            f"its task: {use}")


def load_pretrained(name_or_path: str | Path, head: str | nn.Module | None = None, **kwargs) -> nn.Module:
    """Only the model of `load` (the same arguments), for callers with a tokenizer of their own: the
    checkpoint need not hold tokenizer files."""
    return load(name_or_path, head, with_tokenizer=False, **kwargs).model


def load_tokenizer(name_or_path: str | Path, *, revision: str | None = None, local_files_only: bool = False,
                   **hub_kwargs) -> Tokenizer:
    """The checkpoint's tokenizer (tokenizer.json, else vocab.txt)."""
    resolved = resolve(name_or_path, revision=revision, local_files_only=local_files_only, **hub_kwargs)
    return Tokenizer.from_pretrained(resolved.folder)


def _matching_tokenizer(loaded: Loaded) -> Tokenizer:
    """The tokenizer (an adapter without tokenizer files uses its base's), checked against the model."""
    folder = loaded.tokenizer_folder or loaded.checkpoint.folder
    tokenizer = Tokenizer.from_pretrained(folder)
    config = loaded.model.config
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{loaded.checkpoint.folder}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"embedding table has only {config.vocab_size} rows (vocab_size in config.json); they do not belong together"
        )
    positions = config.max_tokens  # RoBERTa's first two positions are not tokens'
    if tokenizer.model_max_length > positions:
        # A tokenizer_config.json may claim 512 for a model trained with fewer positions: tasks take
        # their default length (and windows) from the tokenizer, so it must not exceed the model's.
        logger.info("%s: the tokenizer's model_max_length %d exceeds the model's %d positions; using %d",
                    loaded.checkpoint.folder.name, tokenizer.model_max_length, positions, positions)
        tokenizer.model_max_length = positions
    return tokenizer
