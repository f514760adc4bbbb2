"""Prompt sources for recording traces: ``--prompts FILE`` or ``--task NAME``.

A task name resolves through a registry: ``demo`` (a few built-in prompts) is always
there, and the synthetic tasks of :mod:`moelab.tasks` (``arith``, ``pycode``) are
added on first lookup, as the contexts they are evaluated with
(``Question: {question}\\nAnswer:`` for arith). Register more with :func:`register_prompt_source`.
Prompts from a file are used verbatim; a ``.jsonl`` file can hold newlines (``"\\n"``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from moelab import tasks
from moelab.errors import MoelabError
from moelab.registry import Registry

DEMO_PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
    "The capital of France is",
    "A train travels 60 km in 1 hour. How far does it travel in 3 hours?",
    "def reverse(s):\n    \"\"\"Return the string s reversed.\"\"\"\n",
    "Once upon a time, there was a",
]

PromptSource = Callable[[int | None], list[str]]
"""``source(limit) -> prompts``: at most ``limit`` prompt strings (all of them for None)."""


def _demo_prompts(limit: int | None) -> list[str]:
    return DEMO_PROMPTS[:limit] if limit else list(DEMO_PROMPTS)


def _load_task_sources() -> None:
    # the synthetic tasks of moelab.tasks, as the contexts they are evaluated with
    for name in tasks.task_names():
        if name not in PROMPT_SOURCES:
            PROMPT_SOURCES.register(name, _task_prompts(name))


#: Prompt sources by name (``--task NAME``): callables ``(limit) -> list[str]``.
PROMPT_SOURCES: Registry[PromptSource] = Registry("prompt source", check=callable, loader=_load_task_sources)


def register_prompt_source(name: str, fn: PromptSource, *, overwrite: bool = False) -> None:
    """Make ``--task name`` yield ``fn(limit)`` (a list of prompt strings).

    A different source under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    PROMPT_SOURCES.register(name, fn, overwrite=overwrite, stacklevel=2)


register_prompt_source("demo", _demo_prompts)


def _task_prompts(name: str) -> PromptSource:
    def source(limit: int | None) -> list[str]:
        # the context the task is evaluated (and the bundled models were trained) with,
        # e.g. "Question: ...\nAnswer:" for arith, not the bare question
        docs = tasks.generate(name, "test", n=limit)
        return [tasks.prompt_and_target(name, d)[0] for d in docs]

    return source


def prompt_sources() -> list[str]:
    """Names usable with ``--task``."""
    _load_task_sources()  # tasks registered since the first lookup too
    return sorted(PROMPT_SOURCES.names())


def task_prompts(name: str, limit: int | None = None) -> list[str]:
    """The prompts of task ``name`` (at most ``limit``)."""
    _load_task_sources()
    prompts = PROMPT_SOURCES.get(name)(limit)
    return prompts[:limit] if limit else prompts


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a file: ``.jsonl`` (field ``prompt``, ``question`` or ``text``) or one per line.

    Each prompt is fed to the model verbatim. A plain text file cannot hold a prompt with a
    newline; a ``.jsonl`` file can (``{"prompt": "Question: ...\\nAnswer:"}``).
    """
    p = Path(path)
    if not p.is_file():
        raise MoelabError(f"prompts file {str(p)!r} does not exist; pass a text file (one prompt per line) or .jsonl.")
    try:
        content = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MoelabError(
            f"prompts file {str(p)!r} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
            "save it as UTF-8."
        ) from None
    prompts: list[str] = []
    if p.suffix == ".jsonl":
        for i, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MoelabError(f"{p}:{i} is not valid JSON ({exc.msg}).") from None
            text = next((obj[k] for k in ("prompt", "question", "text") if isinstance(obj, dict) and k in obj), None)
            if not isinstance(text, str):
                raise MoelabError(f"{p}:{i} has no 'prompt', 'question' or 'text' string field.")
            prompts.append(text)
    else:
        prompts = [line for line in content.splitlines() if line.strip()]
    if not prompts:
        raise MoelabError(f"prompts file {str(p)!r} holds no prompts.")
    return prompts[:limit] if limit else prompts
