"""``moelab demo``: trace a model on a few prompts and write the HTML report."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def run_demo(
    out: str | Path = "report.html",
    *,
    model: str | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = 24,
    quick: bool = False,
    sections: list[str] | None = None,
    allow_code_execution: bool = False,
) -> Path:
    """Load ``model`` (default: the bundled DeepSeek/Qwen2-style model), trace it, write the report."""
    from moelab.loading import load
    from moelab.models.bundled import default_model_name
    from moelab.report import ReportContext, build_report, check_sections
    from moelab.trace.run import trace_prompts

    check_sections(sections)
    name = model or default_model_name()
    mdl, tok = load(name)
    if prompts is None:
        prompts = _default_prompts(quick)
    # The trace and the sections' scratch files live only as long as the report takes to build.
    with tempfile.TemporaryDirectory(prefix="moelab-demo-") as tmp:
        workdir = Path(tmp)
        log.info("tracing %s on %d prompts", name, len(prompts))
        trace = trace_prompts(mdl, tok, prompts, workdir / "trace", max_new_tokens=max_new_tokens, model_name=name)
        ctx = ReportContext(
            model=mdl,
            tokenizer=tok,
            model_name=name,
            trace=trace,
            workdir=workdir,
            quick=quick,
            extras={"allow_code_execution": allow_code_execution},
        )
        return build_report(ctx, out, sections=sections)


def _default_prompts(quick: bool) -> list[str]:
    from moelab.prompts import prompt_sources, task_prompts

    n = 2 if quick else 4
    prompts: list[str] = []
    for task in ("arith", "pycode"):
        if task in prompt_sources():
            prompts += task_prompts(task, n)
    return prompts or task_prompts("demo", 2 * n)
