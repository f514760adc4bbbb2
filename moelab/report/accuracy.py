"""The report's accuracy section: the unmodified model scored by lm-eval on a few documents
(:func:`moelab.evals.report.report_section`), the baseline every routing change is measured against."""

from __future__ import annotations

from moelab.evals.report import report_section
from moelab.report import Section, register_section

#: Report order: after the routing sections.
ORDER = 80


def accuracy_section(ctx):
    """Report section (``moelab.report`` registry): accuracy on a few arith documents."""
    limit = 3 if ctx.quick else 20
    body = report_section(
        ctx.model,
        ctx.tokenizer,
        limit=limit,
        allow_code_execution=bool(ctx.extras.get("allow_code_execution", False)),
        tasks=("arith", "pycode") if ctx.extras.get("allow_code_execution") else ("arith",),
        workdir=ctx.workdir,
    )
    return Section(title="Accuracy (lm-eval)", html=body)


def _register() -> None:
    register_section(
        "accuracy", accuracy_section, order=ORDER, title="Accuracy (lm-eval)",
        read="The unmodified model's scores with their standard errors (small samples: read the ± column); "
             "they are the baseline every routing change is measured against.",
    )


_register()
