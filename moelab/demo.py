"""``moelab demo``: trace a model on a few prompts and write the HTML report."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

from moelab.prompts import prompt_sources, task_prompts
from moelab.report import ReportContext, build_report, check_sections

log = logging.getLogger(__name__)

TINY_PARAMS = 50_000_000
"""Models below this many parameters run the demo's model work on one thread: on a small CPU
model more threads only add synchronisation (and on a shared machine, contention)."""


def run_demo(
    out: str | Path = "report.html",
    *,
    model: str | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = 24,
    quick: bool = False,
    sections: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    allow_code_execution: bool = False,
    threads: int | None = None,
):
    """Load ``model`` (default: the bundled DeepSeek/Qwen2-style model), trace it, write the report.

    Returns the :class:`moelab.report.Report` (its ``path`` and each section's outcome; a
    section that failed is an error box in the file and is listed in ``report.failed``).
    ``threads``: torch threads for the model work (default 1 for models under 50 M
    parameters, else torch's default); benchmarks of the machine use all threads.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    import torch

    from moelab.loading import load
    from moelab.models.bundled import default_model_name
    from moelab.trace.run import trace_prompts

    check_sections(sections, skip)
    name = model or default_model_name()
    mdl, tok = load(name)
    if prompts is None:
        prompts = _default_prompts(quick)
    default_threads = torch.get_num_threads()
    if threads is None:
        threads = 1 if sum(p.numel() for p in mdl.parameters()) < TINY_PARAMS else default_threads
    torch.set_num_threads(threads)
    try:
        # The trace and the sections' scratch files live only as long as the report takes to build.
        with tempfile.TemporaryDirectory(prefix="moelab-demo-") as tmp:
            workdir = Path(tmp)
            log.info("tracing %s on %d prompts (%d torch threads)", name, len(prompts), threads)
            trace = trace_prompts(mdl, tok, prompts, workdir / "trace", max_new_tokens=max_new_tokens,
                                  model_name=name)
            ctx = ReportContext(
                model=mdl,
                tokenizer=tok,
                model_name=name,
                trace=trace,
                workdir=workdir,
                quick=quick,
                extras={"allow_code_execution": allow_code_execution, "threads": default_threads},
            )
            return build_report(ctx, out, sections=sections, skip=skip)
    finally:
        torch.set_num_threads(default_threads)


def _default_prompts(quick: bool) -> list[str]:
    n = 2 if quick else 4
    prompts: list[str] = []
    for task in ("arith", "pycode"):
        if task in prompt_sources():
            prompts += task_prompts(task, n)
    return prompts or task_prompts("demo", 2 * n)
