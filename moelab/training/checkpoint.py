"""Atomic training checkpoints: write to a temporary file, then rename over the old one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(state: dict[str, Any], directory: Path) -> Path:
    """Write ``state`` to ``directory/checkpoint.pt`` atomically (never a half-written file)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CHECKPOINT_NAME
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The state saved in ``directory``, or None if there is no checkpoint."""
    path = directory / CHECKPOINT_NAME
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
