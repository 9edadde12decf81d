"""The built-in tasks' offline starter models: plugins/starter/<task>/ (built by
scripts/build_starter_pack.sh). They are package data, so a wheel or a plain `pip install` carries them
next to this file; a task without one falls back to the backbone with a fresh head."""

from __future__ import annotations

from pathlib import Path

STARTER_ROOT = Path(__file__).resolve().parent


def starter_checkpoint(task: str) -> str | None:
    """The starter folder of `task` when it holds a packed model, else None."""
    folder = STARTER_ROOT / task
    return str(folder) if (folder / "adapter_config.json").is_file() else None
