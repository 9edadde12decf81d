"""Reading files from a checkpoint folder safely: nothing outside the folder is opened, whichever
link points there, and a file read whole (a config, a manifest, a tokenizer) is size-capped first.

A leaf module (it imports nothing of the package), so both checkpoints/loading.py and tokenizer.py can use it.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, unsafe, or does not fit the model; names the file."""


def inside_any(path: str | Path, roots) -> bool:
    """Whether `path`, resolved (symlinks and .. followed), lies inside one of `roots` (resolved too)."""
    resolved = Path(path).expanduser().resolve()
    return any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots)


def contained(folder: Path, name: str) -> Path:
    """`folder / name`, refused unless it resolves (symlinks and .. followed) inside the checkpoint:
    the folder itself, or for a Hub cache snapshot its repository's cache (whose files link to blobs).
    The path returned keeps the file's own name (a Hub cache's blob has none: no suffix to read it by,
    no name for a message).

    Raises:
        CheckpointError: naming the file, not where it points.
    """
    folder = Path(folder).resolve()
    root = folder.parent.parent if folder.parent.name == "snapshots" else folder
    if not inside_any(folder / name, [root]):
        raise CheckpointError(f"{folder.name}/{name}: points outside the checkpoint folder; refused")
    return folder / name


MAX_METADATA_BYTES = 4 * 2**20  # config.json, adapter_config.json, manifest.json: kilobytes in practice
MAX_TOKENIZER_BYTES = 64 * 2**20  # tokenizer.json of a 250,000-token vocabulary: about 17 MB


def metadata_file(folder: Path, name: str, limit: int = MAX_METADATA_BYTES) -> Path:
    """`folder / name` for a file read whole (a config, a manifest, a tokenizer), refused before it is
    read where it points outside the checkpoint (see `contained`) or is larger than `limit` bytes.

    Raises:
        CheckpointError: naming the file and its size, or saying it is not a regular file (a FIFO or a
            device would block or never end when read).
    """
    path = contained(folder, name)
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{Path(folder).name}/{name}: not a regular file; refused unread")
    size = info.st_size
    if size > limit:
        raise CheckpointError(f"{Path(folder).name}/{name}: {size:,} bytes; a file of this kind over "
                              f"{limit:,} bytes is refused unread")
    return path


def read_json(folder: Path, name: str, limit: int = MAX_METADATA_BYTES):
    """`folder / name` parsed as JSON, read through `metadata_file` (inside the checkpoint, a regular file,
    at most `limit` bytes).

    Raises:
        CheckpointError: as metadata_file, or the file is not valid JSON (naming it).
        FileNotFoundError: there is no such file.
    """
    path = metadata_file(folder, name, limit)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{Path(folder).name}/{name}: not valid JSON ({type(err).__name__})") from None


def recorded_field(folder: Path, name: str, key: str):
    """`key` of the JSON object in `folder / name` (a manifest's "task"), or None where the file is absent,
    unsafe, unreadable or not an object: for what a folder says about itself, never worth a failure."""
    try:
        data = read_json(folder, name)
    except (CheckpointError, OSError):
        return None
    return data.get(key) if isinstance(data, dict) else None


MAX_SHARDS = 128  # a BERT-sized model in shards of the Hub's default 5 GB: one; of 100 MB: a dozen


def weight_files(path: Path) -> list[Path]:
    """The files a weights path stands for: itself, or for an index .json its shards (each checked
    to lie inside the checkpoint; at most MAX_SHARDS).

    Raises:
        CheckpointError: an index that is not JSON with a weight_map of string names, a shard outside,
            or more shards than MAX_SHARDS.
    """
    if not path.name.endswith(".index.json"):
        return [path]
    try:
        shards = sorted(set(json.loads(metadata_file(path.parent, path.name).read_text(encoding="utf-8"))
                            ["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CheckpointError(f"{path.name}: not a valid checkpoint index ({type(err).__name__})") from None
    if not all(isinstance(shard, str) for shard in shards):
        raise CheckpointError(f"{path.name}: shard names must be strings")
    if len(shards) > MAX_SHARDS:
        raise CheckpointError(f"{path.name}: names {len(shards):,} shard files; at most {MAX_SHARDS} are read")
    return [contained(path.parent, shard) for shard in shards]
