"""Accuracy scoring with lm-eval: local synthetic tasks and offline GSM8K / HumanEval.

::

    import moelab
    from moelab import evals

    model, tok = moelab.load("tiny-random-mixtral")
    result = evals.evaluate(model, tok, tasks=["arith", "pycode"], limit=20,
                            allow_code_execution=True)
    print(result.table())

Tasks: ``evals.eval_task_names()``; the lm-eval YAMLs live in ``evals/``
(``moelab.resource_dir("evals")``). Generated code runs only in
:mod:`moelab.evals.sandbox`, and only with ``allow_code_execution=True``.
lm-eval is imported lazily, when something is scored.
"""

from __future__ import annotations

from moelab._lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "evaluate": "moelab.evals.api",
    "compare_policies": "moelab.evals.compare",
    "PolicyComparison": "moelab.evals.compare",
    "versions": "moelab.evals.api",
    "EvalConfig": "moelab.evals.results",
    "EvalResult": "moelab.evals.results",
    "TaskResult": "moelab.evals.results",
    "EvalTask": "moelab.evals.registry",
    "EVAL_TASKS": "moelab.evals.registry",
    "eval_task_names": "moelab.evals.registry",
    "get_eval_task": "moelab.evals.registry",
    "register_eval_task": "moelab.evals.registry",
    "estimate_pass_at_k": "moelab.evals.metrics",
    "SandboxConfig": "moelab.evals.sandbox",
    "ExecResult": "moelab.evals.sandbox",
    "run_program": "moelab.evals.sandbox",
    "run_tests": "moelab.evals.sandbox",
    "available_isolation": "moelab.evals.sandbox",
    "SandboxUnavailable": "moelab.evals.sandbox",
    "report_section": "moelab.evals.report",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
