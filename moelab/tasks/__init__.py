"""Synthetic tasks that moelab generates itself, in the formats of real benchmarks.

``arith`` is GSM8K-format (``question``, ``answer`` with ``<<a+b=c>>`` annotations and a
final ``#### N``); ``pycode`` is HumanEval-format (``task_id``, ``prompt``,
``canonical_solution``, ``test``, ``entry_point``). Generation is deterministic in the
seed and the splits never share a question/prompt text::

    from moelab.tasks import generate, TASKS
    test = generate("arith", "test")          # 200 examples, seed 0
    train = generate("pycode", "train", n=5000, seed=0)

Default sizes per split (``n=None``): ``DEFAULT_SIZES``.

Prompt formats the bundled models were trained on (zero-shot; use these in eval tasks):

* arith: context ``"Question: {question}\\nAnswer:"``, target ``" " + answer``, the model
  then emits its end-of-sequence token;
* pycode: context ``prompt``, target ``canonical_solution``, then end-of-sequence.
"""

from __future__ import annotations

from typing import Any

from moelab.tasks import arith, pycode
from moelab.tasks._registry import (
    SPLITS,
    TASK_SPECS,
    Split,
    TaskSpec,
    generate,
    get_task,
    register_task,
    split_of,
    task_names,
)

#: Examples per split when ``generate(..., n=None)``.
DEFAULT_SIZES: dict[str, dict[str, int]] = {
    "arith": {"train": 20000, "validation": 200, "test": 200},
    "pycode": {"train": 10000, "validation": 100, "test": 164},
}

register_task(
    TaskSpec(
        name="arith",
        sample=arith.sample,
        key_field="question",
        default_sizes=DEFAULT_SIZES["arith"],
        description="multi-step arithmetic word problems, GSM8K format",
        context_target=lambda ex: (f"Question: {ex['question']}\nAnswer:", " " + ex["answer"]),
    )
)
register_task(
    TaskSpec(
        name="pycode",
        sample=pycode.sample,
        key_field="prompt",
        default_sizes=DEFAULT_SIZES["pycode"],
        finalize=pycode.finalize,
        description="Python function completion, HumanEval format",
    )
)

#: Names of the registered synthetic tasks.
TASKS: tuple[str, ...] = task_names()


def prompt_and_target(name: str, example: dict[str, Any]) -> tuple[str, str]:
    """The (context, target) texts of ``example`` in the format the bundled models know."""
    spec = get_task(name)
    if spec.context_target is not None:
        return spec.context_target(example)
    return example["prompt"], example["canonical_solution"]


__all__ = [
    "DEFAULT_SIZES",
    "TASK_SPECS",
    "SPLITS",
    "TASKS",
    "Split",
    "TaskSpec",
    "generate",
    "get_task",
    "prompt_and_target",
    "register_task",
    "split_of",
]
