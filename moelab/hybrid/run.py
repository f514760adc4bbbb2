"""Run a hybrid configuration on prompts and write everything a run produces (``moelab run``).

``OUT/`` holds ``trace/`` (the routing trace, :mod:`moelab.trace`), ``plans.jsonl``,
``events.parquet`` (the timeline), ``summary.json`` and ``config.json``. The directory
is claimed first and appears only when complete.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from moelab._output import reserve_output
from moelab.errors import MoelabError
from moelab.hybrid.config import HybridConfig
from moelab.hybrid.runtime import HybridRun
from moelab.measure import from_samples, machine_load


@torch.no_grad()
def run_prompts(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    config: HybridConfig | dict | str | Path,
    out: str | Path,
    *,
    max_new_tokens: int = 32,
    batch_size: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    model_name: str | None = None,
) -> dict:
    """Greedy-generate on ``prompts`` under ``config`` while recording; returns the summary.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.trace.run import trace_prompts

    res = reserve_output(Path(out), overwrite, what="run directory")
    try:
        run = HybridRun(model, config)
        t0 = time.perf_counter()
        with run:
            # recorded into a temporary directory first: the claim of OUT locks OUT's staging
            # directory, where a second claim (the recorder's own) would wait on it
            trace = trace_prompts(model, tokenizer, prompts, None, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, progress=progress, model_name=model_name,
                                  metadata={"hybrid": run.config.to_dict()})
        wall = time.perf_counter() - t0
        shutil.move(str(trace.path), res.staging / "trace")
        shutil.rmtree(Path(trace.path).parent, ignore_errors=True)
        # tokens generated: one from each prompt's forward, one per real token of each decode forward
        generated = len(prompts) + trace.meta["rows_by_phase"]["decode"] // max(len(run.layers), 1)
        # wall_s includes set-up and prefill; the run's tokens/s (run.summary()) is decode only
        extra = {"wall_s": wall, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                 "generated_tokens": generated, "trace_rows": trace.num_rows, "plans": len(run.plans)}
        run.write(res.staging, extra)
        res.commit()
    except BaseException:
        res.abort()
        raise
    return {**run.summary(), **extra}


def measure_runs(model: Any, tokenizer: Any, prompts: list[str], configs: dict[str, Any], out: str | Path, *,
                 repeat: int = 3, warmup: int = 1, max_new_tokens: int = 8, batch_size: int = 1):
    """Tokens/s of several hybrid configurations as a fair comparison: each configuration runs
    ``warmup`` untimed times, then the configurations take turns ``repeat`` times (A, B, A, B, …:
    no run-order artefact); per configuration the median of the runs' tokens/s (decode tokens
    over decode wall, :func:`moelab.events.decode_rate`), its spread, the load and a ``busy`` flag
    (:mod:`moelab.measure`). Run directories go under ``out/<name>/<i>``; returns a DataFrame.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    import pandas as pd

    if repeat < 1 or warmup < 0:
        raise MoelabError(f"measure_runs needs repeat ≥ 1 and warmup ≥ 0 (got {repeat}, {warmup}).")
    out = Path(out)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    before = machine_load()
    for i in range(warmup + repeat):
        for name, cfg in configs.items():
            d = out / name.replace(" ", "-") / str(i)
            s = run_prompts(model, tokenizer, prompts, cfg, d, max_new_tokens=max_new_tokens, batch_size=batch_size,
                            overwrite=True, progress=False)
            if i >= warmup and s.get("tokens_per_s"):
                rates[name].append(1.0 / s["tokens_per_s"])  # seconds per token: a time to summarise
    rows = []
    for name, secs in rates.items():
        m = from_samples(secs, warmup=warmup, load_before=before)
        rows.append({"config": name, "tokens_per_s": 1.0 / m.median, "spread": m.spread, "runs": len(secs),
                     "load": m.load_after.get("load1"), "busy": m.busy, "why": m.reason})
    return pd.DataFrame(rows)
