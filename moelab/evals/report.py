"""The accuracy section of the ``moelab demo`` report: a small, fast lm-eval run.

It scores ``arith`` (and ``pycode`` only when code execution was allowed; the demo never
runs generated code without the opt-in) on a few documents and shows the numbers and a
few answers. The report section itself, ``"accuracy"``, is :mod:`moelab.report.accuracy`.
"""

from __future__ import annotations

import html
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from moelab.stats import degenerate, wilson_interval

logger = logging.getLogger(__name__)

def report_section(
    model: Any,
    tokenizer: Any,
    limit: int = 10,
    *,
    tasks: tuple[str, ...] = ("arith",),
    allow_code_execution: bool = False,
    examples: int = 3,
    max_gen_toks: int | None = None,
    workdir: str | Path | None = None,
) -> str:
    """HTML for the accuracy of ``model`` on the first ``limit`` documents of ``tasks``.

    A table of the metrics and the first ``examples`` answers of each task. Small limits
    give rough numbers (the stderr column says how rough).
    """
    from moelab.evals.api import evaluate

    with tempfile.TemporaryDirectory(prefix="moelab-acc-", dir=workdir) as tmp:
        out = Path(tmp) / "eval"
        result = evaluate(
            model,
            tokenizer,
            tasks=list(tasks),
            limit=limit,
            allow_code_execution=allow_code_execution,
            max_gen_toks=max_gen_toks,
            log_samples_dir=out,
        )
        samples = {t: _read_samples(out / f"samples_{t}.jsonl", examples) for t in result.tasks}
    rows = []
    for t in result.tasks.values():
        for key, value in t.metrics.items():
            se = t.stderr.get(key)
            rows.append(
                "<tr>"
                + "".join(
                    f"<td>{html.escape(str(c))}</td>"
                    for c in (
                        t.task,
                        key,
                        f"{value:.3f}",
                        _se_text(value, se, t.n_docs),
                        t.n_docs,
                    )
                )
                + "</tr>"
            )
    parts = [
        "<p>lm-eval, greedy decoding, 0-shot, on the first "
        f"{limit} test documents of each task (moelab eval --tasks {','.join(result.tasks)} "
        f"--limit {limit}). Small samples: read the ± column.</p>",
        "<table><tr><th>task</th><th>metric</th><th>value</th><th>stderr</th><th>n</th></tr>"
        + "".join(rows)
        + "</table>",
    ]
    if not allow_code_execution and "pycode" not in result.tasks:
        parts.append(
            "<p>pycode (generated code, run in a sandbox) is not scored here without the "
            "code-execution opt-in: <code>moelab eval --tasks pycode --allow-code-execution</code>.</p>"
        )
    for task, rows_ in samples.items():
        for s in rows_:
            prompt, answer = _prompt_and_answer(s)
            parts.append(
                f"<details><summary>{html.escape(task)} #{s.get('doc_id')}: "
                f"{html.escape(_score_text(s))}</summary><pre>{html.escape(prompt[-600:])}"
                f"<b>{html.escape(answer)}</b></pre></details>"
            )
    return "\n".join(parts)


def _read_samples(path: Path, n: int) -> list[dict]:
    if not path.is_file() or n <= 0:
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


def _prompt_and_answer(sample: dict) -> tuple[str, str]:
    """(prompt, raw model answer) of an lm-eval sample record (``arguments``: [[context, gen_kwargs]])."""
    args, resps = sample.get("arguments"), sample.get("resps")
    prompt = args[0][0] if args and isinstance(args[0], (list, tuple)) and args[0] else ""
    answer = resps[0][0] if resps and isinstance(resps[0], (list, tuple)) and resps[0] else ""
    return str(prompt), str(answer)


def _score_text(sample: dict) -> str:
    for key in ("exact_match", "pass@1"):
        if key in sample:
            return f"{key} = {sample[key]}"
    return ""


def _se_text(value: float, se: float | None, n: int) -> str:
    """``± 0.105``; at a score of 0 or 1 (stderr 0) also the Wilson 95 % interval."""

    if se is None:
        return ""
    text = f"± {se:.3f}"
    if degenerate(value, se):
        lo, hi = wilson_interval(value, n)
        text += f" (Wilson 95% CI {lo:.3f}–{hi:.3f})"
    return text
