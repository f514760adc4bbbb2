"""Canaries for a transformers release moelab misreads: each fails when decode steps are taken
for prompts (transformers 5.24 renamed the KV cache argument; moelab read only the old name and
reported "deferral changes nothing", traces with no decode rows and identical sweep cells).

These are end-to-end on purpose: they check what a user sees, not the function that broke.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moelab
from moelab.loading import load
from moelab.models.bundled import bundled_models
from moelab.policies import ExpertDeferral

BUNDLED_MODELS = sorted(bundled_models())


@pytest.fixture(scope="module", params=BUNDLED_MODELS)
def bundled(request):
    model, tok = load(request.param)
    return request.param, model, tok


def _generate(model, tok, n: int = 6):
    enc = tok(["12+7=", "3*4+5="], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    return torch.stack(out.logits, 1)  # (B, n, V): the prompt's last logits, then one per decode step


def test_deferral_in_generate_changes_decode_logits_and_plans_decode_steps(bundled):
    name, model, tok = bundled
    plain = _generate(model, tok)
    with ExpertDeferral(model, 1, min_immediate=0):  # the default phase: decode only
        deferred = _generate(model, tok)
    # the prompt forward is untouched (decode-only policy), every later step is a decode step
    torch.testing.assert_close(deferred[:, 0], plain[:, 0], atol=0, rtol=0)
    assert (deferred[:, 1:] - plain[:, 1:]).abs().max() > 1e-4, f"{name}: deferral changed no decode logit"

    with moelab.hybrid(model, {"cache": {"capacity": 0}, "routing": {"deferred": 1, "min_immediate": 0}}) as run:
        _generate(model, tok, n=4)
    phases = [p.phase for p in run.plans]
    assert phases.count("decode") == 3 * len({p.layer for p in run.plans}), phases
    assert any(p.deferred for p in run.plans if p.phase == "decode")


def test_a_trace_of_generate_has_decode_rows_and_continues_its_sequences(bundled, tmp_path):
    name, model, tok = bundled
    with moelab.record(model, tmp_path / "t") as rec:
        _generate(model, tok, n=4)
    t = rec.trace
    phase, seq, step = t.column("phase"), t.column("seq"), t.column("step")
    assert set(seq.tolist()) == {0, 1}, f"{name}: every generated token started a new sequence"
    assert (phase == "decode").sum() == 2 * 3 * t.num_moe_layers
    assert set(step[phase == "decode"].tolist()) == {1, 2, 3}


SWEEP = """\
name: canary
models: [moelab-tiny-qwen2moe]
policies:
  - none
  - {policy: deferral, min_immediate: 0, grid: {deferred: [1]}}
  - {policy: skipping, min_kept: 0, grid: {skipped: [1]}}
tasks:
  - {task: arith, limit: 3}
eval: {max_gen_toks: 6}
hardware: [ktransformers-a100]
retries: 0
"""


@pytest.mark.slow
def test_a_sweeps_deferral_and_skipping_cells_differ(tmp_path: Path):
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SWEEP)
    spec = load_spec(spec_path)
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert (summary.done, summary.failed) == (3, {})
    statuses = collect(spec, tmp_path / "store")
    lat = {x.cell.policy: x.record["latency"]["ktransformers-a100"] for x in statuses}
    answers = {x.cell.policy: x.record["score"] for x in statuses}
    assert len(answers) == 3
    assert {v["tokens_per_s_basis"] for v in lat.values()} == {"decode"}
    tps = {k: round(v["tokens_per_s"], 6) for k, v in lat.items()}
    assert len(set(tps.values())) == 3, f"deferral, skipping and none simulate alike: {tps}"
