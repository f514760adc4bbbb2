"""Atomic training checkpoints: write to a temporary file, then rename over the old one.

Checkpoints are read with ``torch.load(weights_only=True)``: tensors, dicts, lists and
plain numbers only, so a planted ``checkpoint.pt`` cannot run code on ``--resume``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from moelab.errors import MoelabError

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
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MoelabError(
            f"checkpoint {str(path)!r} cannot be loaded safely ({first[:200]}); it holds objects other "
            "than tensors and plain data, or is corrupt. Delete it and train again without --resume."
        ) from None
    return state
