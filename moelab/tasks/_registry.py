"""The task-generator registry and the split machinery shared by every synthetic task.

A task generator is a function ``sample(rng) -> dict`` that draws one random example.
Splits never overlap by construction: every example has a *key* (its question or
prompt text) and the key's SHA-256 bucket decides the one split it may appear in
(``SPLIT_FRACTIONS``). ``generate`` rejection-samples until it has ``n`` distinct
examples of the requested split, so any seed and any ``n`` keep the splits disjoint.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from moelab.errors import MoelabError, unknown_name
from moelab.registry import Registry

Split = Literal["train", "validation", "test"]
SPLITS: tuple[Split, ...] = ("train", "validation", "test")

#: Share of the key space (in 1/1000) owned by each split, in ``SPLITS`` order.
SPLIT_FRACTIONS: dict[str, int] = {"train": 900, "validation": 50, "test": 50}

#: How many draws per requested example before concluding the task space is exhausted.
_MAX_DRAWS_PER_EXAMPLE = 200


@dataclass(frozen=True)
class TaskSpec:
    """A registered synthetic task."""

    name: str
    """Registry name, e.g. ``"arith"``."""
    sample: Callable[[random.Random], dict[str, Any]]
    """Draws one example (without ``task_id``-style numbering) from ``rng``."""
    key_field: str
    """The field whose text identifies an example (dedupe and split assignment)."""
    default_sizes: dict[str, int]
    """Number of examples ``generate`` returns per split when ``n`` is None."""
    finalize: Callable[[dict[str, Any], str, int], dict[str, Any]] | None = None
    """Optional ``(example, split, index) -> example`` hook, e.g. to number task ids."""
    description: str = ""
    """One line for listings."""
    context_target: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    """``example -> (context, target)``: the texts the task is trained and evaluated with;
    None: HumanEval's ``(prompt, canonical_solution)``."""


#: The synthetic tasks by name (:class:`TaskSpec` instances).
TASK_SPECS: Registry[TaskSpec] = Registry("task", base=TaskSpec, instances=True)


def register_task(spec: TaskSpec, *, overwrite: bool = False) -> TaskSpec:
    """Add ``spec`` to the registry (by its name) and return it.

    A different spec under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    if not isinstance(spec, TaskSpec):
        raise MoelabError(f"register_task expects a TaskSpec, got {spec!r}.")
    TASK_SPECS.register(spec.name, spec, overwrite=overwrite, stacklevel=2)
    return spec


def get_task(name: str) -> TaskSpec:
    """The registered task ``name``; unknown names raise with a suggestion."""
    return TASK_SPECS.get(name)


def task_names() -> tuple[str, ...]:
    """Names of the registered tasks, sorted."""
    return tuple(sorted(TASK_SPECS.names()))


def split_of(key: str) -> Split:
    """The one split an example with this key text belongs to (stable across runs)."""
    bucket = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 1000
    edge = 0
    for split in SPLITS:
        edge += SPLIT_FRACTIONS[split]
        if bucket < edge:
            return split
    return SPLITS[-1]  # pragma: no cover - fractions sum to 1000


def generate(name: str, split: Split, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct examples of task ``name`` from ``split``, deterministic in ``seed``.

    ``n=None`` gives the task's default size for the split (see ``TaskSpec.default_sizes``).
    The same ``(name, split, n, seed)`` always returns the same list; a shorter ``n``
    returns a prefix of a longer one. No key text appears in two splits.
    """
    spec = get_task(name)
    if split not in SPLITS:
        raise unknown_name("split", split, SPLITS)
    if n is None:
        n = spec.default_sizes[split]
    if not isinstance(n, int) or n < 0:
        raise MoelabError(f"n={n!r} for task {name!r}: expected a non-negative integer or None.")
    rng = random.Random(f"moelab-task:{name}:{split}:{seed}")
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    draws = 0
    while len(out) < n:
        draws += 1
        if draws > _MAX_DRAWS_PER_EXAMPLE * max(n, 10):
            raise MoelabError(
                f"task {name!r} split {split!r}: found only {len(out)} distinct examples after "
                f"{draws - 1} draws, expected n={n}; ask for fewer examples."
            )
        ex = spec.sample(rng)
        key = ex[spec.key_field]
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        if spec.finalize is not None:
            ex = spec.finalize(ex, split, len(out))
        out.append(ex)
    return out
