"""The ``schedule`` sweep kind: shapes × profiles × a schedule's settings, each cell the schedule's
own answer (checked against a direct call), refusals that name the spec line, memory refusals as
failed cells, and resumption."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.errors import MoelabError

SPEC = """\
name: sched
kind: schedule
schedule: moegen
shapes: [mixtral-8x7b]
hardware: [moegen-a5000, moegen-a6000]
grid: {cpu_attention: [0.0, 1.0]}
settings: {prompt: 256, generate: 64, expert_slots: 2}
retries: 0
"""


def _write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_cells_are_the_schedules_own_answers_and_resume(tmp_path):
    from moelab.simulate.moegen import plan_throughput
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect, table_rows
    from moelab.sweeps.spec import load_spec

    spec = load_spec(_write(tmp_path, SPEC))
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert (summary.done, summary.failed) == (4, {})
    statuses = collect(spec, tmp_path / "store")
    seen = set()
    for x in statuses:
        c = x.cell
        want = plan_throughput(c.shape, c.profile, prompt=256, generate=64, expert_slots=2,
                               cpu_attention=c.point["cpu_attention"])
        assert x.record["score"] == pytest.approx(want.tokens_per_s, rel=1e-12)
        assert x.record["metrics"]["best"]["cpu_attention"] == c.point["cpu_attention"]
        assert x.record["metrics"]["best"]["expert_slots"] == 2
        seen.add((c.profile, c.point["cpu_attention"]))
    assert len(seen) == 4
    rows = table_rows(statuses)
    assert len(rows) == 4 and {r["schedule"] for r in rows} == {"moegen"}
    again = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert again.done == 0 and again.skipped == 4  # every cell already complete


def test_a_configuration_that_does_not_fit_fails_its_cell_with_the_numbers(tmp_path):
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    text = SPEC.replace("grid: {cpu_attention: [0.0, 1.0]}", "grid: {batch: [100000000]}").replace(
        "[moegen-a5000, moegen-a6000]", "[moegen-a5000]")
    spec = load_spec(_write(tmp_path, text))
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert summary.done == 0 and len(summary.failed) == 1
    (x,) = collect(spec, tmp_path / "store")
    assert x.state == "failed" and "GB" in x.error and "batch of at most" in x.error


def test_profile_numbers_and_settings_enter_the_hash(tmp_path):
    from moelab.sweeps.kinds import get_kind
    from moelab.sweeps.spec import load_spec

    def hashes(text: str, name: str) -> set[str]:
        spec = load_spec(_write(tmp_path, text, name))
        return {c.hash for c in get_kind("schedule").expand(spec, None)}

    base = hashes(SPEC, "spec.yaml")
    assert len(base) == 4 and hashes(SPEC, "same.yaml") == base
    for i, text in enumerate((SPEC.replace("prompt: 256", "prompt: 512"),
                              SPEC.replace("expert_slots: 2", "expert_slots: 4"),
                              SPEC.replace("[0.0, 1.0]", "[0.5]"))):
        assert not base & hashes(text, f"v{i}.yaml")


@pytest.mark.parametrize("old, new, message", [
    ("schedule: moegen", "schedule: moegn", r":3: unknown schedule 'moegn'.*'moegen'"),
    ("[mixtral-8x7b]", "[mixtral-8x7]", r":4: .*mixtral-8x7b"),
    ("[moegen-a5000, moegen-a6000]", "[moegen-a500]", r":5: unknown hardware profile 'moegen-a500'"),
    ("{cpu_attention:", "{cpu_atention:", r":6: unknown key 'cpu_atention'.*'cpu_attention'"),
    ("expert_slots: 2}", "expert_slots: 2, cpu_attention: 1.0}", r"cpu_attention both in grid and settings"),
])
def test_bad_specs_are_refused_with_their_line(tmp_path, old, new, message):
    from moelab.sweeps.spec import load_spec

    assert old in SPEC
    with pytest.raises(MoelabError, match=message):
        load_spec(_write(tmp_path, SPEC.replace(old, new)))


def test_prefill_cells_are_the_slp_prediction(tmp_path):
    from moelab.simulate.prefill import PrefillConfig, prefill
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect, table_rows
    from moelab.sweeps.spec import load_spec
    from moelab.timing.shapes import get_shape

    text = """\
name: pre
kind: schedule
schedule: prefill
shapes: [deepseek-v2-lite]
hardware: [osdi26-5090]
grid: {prompt_tokens: [2048, 16384], path: [slp, hybrid]}
settings: {crossover: false}
retries: 0
"""
    spec = load_spec(_write(tmp_path, text))
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert (summary.done, summary.failed) == (4, {})
    statuses = collect(spec, tmp_path / "store")
    for x in statuses:
        p = x.cell.point
        want = prefill(get_shape("deepseek-v2-lite"), "osdi26-5090",
                       PrefillConfig(prompt_tokens=p["prompt_tokens"], path=p["path"], crossover=False))
        assert x.record["score"] == pytest.approx(want.tokens_per_s, rel=1e-12)
        assert x.record["metrics"]["path"] == p["path"]
    assert {r["path"] for r in table_rows(statuses)} == {"slp", "hybrid"}


def test_the_common_keys_mean_the_same_in_every_kind(tmp_path):
    """name, store, retries, description: one base for every kind's spec; ``store`` is relative
    to the spec file, the default ``runs/sweeps/<name>``."""
    from moelab.sweeps.schedule_kind import ScheduleSweepSpec
    from moelab.sweeps.spec import SpecBase, SweepSpec, load_spec
    from moelab.sweeps.trace_kinds import TraceSweepSpec

    assert all(issubclass(c, SpecBase) for c in (SweepSpec, TraceSweepSpec, ScheduleSweepSpec))
    spec = load_spec(_write(tmp_path, SPEC.replace("retries: 0", "retries: 3\nstore: out\ndescription: a grid")))
    assert isinstance(spec, ScheduleSweepSpec)
    assert (spec.name, spec.retries, spec.description) == ("sched", 3, "a grid")
    assert spec.store_path() == tmp_path.resolve() / "out"
    assert load_spec(_write(tmp_path, SPEC)).store_path() == Path("runs") / "sweeps" / "sched"
    eval_spec = SweepSpec("e", models=[], policies=[], tasks=[], store="x", source=str(tmp_path / "s.yaml"))
    assert eval_spec.store_path() == tmp_path.resolve() / "x" and eval_spec.retries == 1
