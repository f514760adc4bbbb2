"""Documents for the lm-eval tasks: local GSM8K/HumanEval copies and moelab's synthetic tasks.

GSM8K and HumanEval are not part of moelab; their location is given per call (the
``gsm8k_dir`` / ``humaneval_path`` arguments, or lm-eval ``--metadata``) or by the
environment variables :data:`GSM8K_ENV` / :data:`HUMANEVAL_ENV`:

* ``MOELAB_GSM8K_DIR``: a directory with ``test.jsonl`` and ``train.jsonl`` (the
  ``openai/gsm8k`` "main" configuration, one ``{"question", "answer"}`` per line);
* ``MOELAB_HUMANEVAL_DIR``: a directory with ``HumanEval.jsonl.gz`` (or ``HumanEval.jsonl``),
  or the file itself.

The ``load_*`` functions are the ``custom_dataset`` loaders of the task YAMLs in
``evals/``; lm-eval calls them with the task's metadata as keyword arguments.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import Any

from moelab.errors import MoelabError

logger = logging.getLogger(__name__)

#: Environment variable naming the directory of the local GSM8K copy.
GSM8K_ENV = "MOELAB_GSM8K_DIR"
#: Environment variable naming the local HumanEval copy (directory or ``.jsonl[.gz]`` file).
HUMANEVAL_ENV = "MOELAB_HUMANEVAL_DIR"
GSM8K_FILES = ("test.jsonl", "train.jsonl")
HUMANEVAL_FILES = ("HumanEval.jsonl.gz", "HumanEval.jsonl")
#: Training examples of a synthetic task kept as the few-shot pool (a prefix of the split).
FEWSHOT_POOL = 1000


def _given(path: str | os.PathLike | None, env: str) -> tuple[Path | None, str]:
    if path:
        return Path(path).expanduser(), "the given path"
    value = os.environ.get(env)
    if value:
        return Path(value).expanduser(), f"${env}"
    return None, ""


def resolve_gsm8k_dir(path: str | os.PathLike | None = None) -> Path:
    """The GSM8K directory from ``path`` or ``$MOELAB_GSM8K_DIR``; checked for its two files."""
    where, source = _given(path, GSM8K_ENV)
    how = (
        f"set {GSM8K_ENV}=<dir> or pass --gsm8k-dir <dir> (Python: gsm8k_dir=...) naming a "
        f"directory with {' and '.join(GSM8K_FILES)} (the openai/gsm8k 'main' configuration)"
    )
    if where is None:
        raise MoelabError(f"task 'gsm8k' needs a local copy of GSM8K and none was given: {how}.")
    missing = [f for f in GSM8K_FILES if not (where / f).is_file()]
    if missing:
        raise MoelabError(
            f"GSM8K directory {str(where)!r} (from {source}) lacks {', '.join(missing)}; {how}."
        )
    return where


def resolve_humaneval_file(path: str | os.PathLike | None = None) -> Path:
    """The HumanEval file from ``path`` or ``$MOELAB_HUMANEVAL_DIR`` (a directory or the file)."""
    where, source = _given(path, HUMANEVAL_ENV)
    how = (
        f"set {HUMANEVAL_ENV}=<dir> or pass --humaneval-dir <dir> (Python: humaneval_path=...) "
        f"naming a directory with {' or '.join(HUMANEVAL_FILES)}, or the file itself"
    )
    if where is None:
        raise MoelabError(
            f"task 'humaneval' needs a local copy of HumanEval and none was given: {how}."
        )
    if where.is_file():
        return where
    for name in HUMANEVAL_FILES:
        if (where / name).is_file():
            return where / name
    raise MoelabError(f"no HumanEval file at {str(where)!r} (from {source}); {how}.")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (gzip-compressed if it ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            return [json.loads(line) for line in f if line.strip()]
        except json.JSONDecodeError as exc:
            raise MoelabError(f"{str(path)!r} is not valid JSON lines: {exc}") from None


def _dataset_dict(splits: dict[str, list[dict[str, Any]]]):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def load_gsm8k(gsm8k_dir: str | None = None, **_: Any):
    """lm-eval ``custom_dataset``: GSM8K ``train`` and ``test`` from the local copy."""
    where = resolve_gsm8k_dir(gsm8k_dir)
    return _dataset_dict(
        {split: read_jsonl(where / f"{split}.jsonl") for split in ("train", "test")}
    )


def load_humaneval(humaneval_path: str | None = None, **_: Any):
    """lm-eval ``custom_dataset``: HumanEval ``test`` (164 problems) from the local copy."""
    return _dataset_dict({"test": read_jsonl(resolve_humaneval_file(humaneval_path))})


def load_synthetic(task: str, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The splits of a synthetic moelab task (the train split cut to the few-shot pool)."""
    from moelab.tasks import generate

    return {
        "train": generate(task, "train", n=FEWSHOT_POOL, seed=seed),
        "validation": generate(task, "validation", seed=seed),
        "test": generate(task, "test", seed=seed),
    }


def load_arith(task_seed: int = 0, **_: Any):
    """lm-eval ``custom_dataset``: the synthetic ``arith`` task (GSM8K format)."""
    return _dataset_dict(load_synthetic("arith", seed=int(task_seed)))


def load_pycode(task_seed: int = 0, **_: Any):
    """lm-eval ``custom_dataset``: the synthetic ``pycode`` task (HumanEval format)."""
    return _dataset_dict(load_synthetic("pycode", seed=int(task_seed)))
