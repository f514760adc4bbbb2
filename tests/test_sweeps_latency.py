"""Accuracy × simulated latency: an eval cell plans and simulates its own routing trace on the
spec's hardware profiles; the numbers equal a direct plan_routing + simulate_plans of the
recorded trace, the inputs enter the cell hash, bad input is refused at spec load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moelab.errors import MoelabError

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ["ktransformers-a100", "h100-pcie5-ddr5"]

SPEC = """\
name: lat
models: [tiny-random-mixtral]
policies:
  - none
  - {policy: deferral, min_immediate: 0, grid: {deferred: [1]}}
tasks:
  - {task: arith, limit: 2}
eval: {max_gen_toks: 4}
hardware: [ktransformers-a100, h100-pcie5-ddr5]
simulate:
  model_shape: {shape: mixtral-8x7b, num_layers: 4}
artifacts: {trace: true}
retries: 0
"""
FP = {"tiny-random-mixtral": "f" * 16}


def _write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _direct(trace_dir: Path, policy: str, settings: dict, profile: str) -> dict:
    """The latency of a recorded trace, derived here from plan_routing and simulate_plans alone:
    each prefill starts a sequence simulated from context 0; decode tokens over decode time."""
    import dataclasses

    from moelab.hybrid.config import HybridConfig
    from moelab.hybrid.offline import plan_routing, routing_from_trace, trace_shape
    from moelab.policies import DeferralConfig, ExpertDeferral
    from moelab.simulate import get_shape, simulate_plans
    from moelab.trace import open_trace

    base = get_shape("mixtral-8x7b")
    shape = dataclasses.replace(base, num_layers=4, moe_layers=(0, 1, 2, 3))
    tr = open_trace(trace_dir)
    ts = trace_shape(tr)
    cfg = HybridConfig.from_dict({"cache": {"capacity": 0}, "placement": "host-misses", "hardware": profile})
    pols = [ExpertDeferral(None, config=DeferralConfig(**settings))] if policy == "deferral" else []
    plans = plan_routing(routing_from_trace(tr), cfg, num_experts=ts["num_experts"], top_k=ts["top_k"],
                         expert_bytes=shape.expert_bytes(), shape=shape,
                         routing_policies=pols)
    starts = [i for i, p in enumerate(plans) if p.phase == "prefill" and (i == 0 or plans[i - 1].forward != p.forward)]
    dec_t = dec_n = pre_t = steps = 0.0
    for a, b in zip(starts, [*starts[1:], len(plans)]):
        fw = simulate_plans(plans[a:b], shape, profile).forwards
        d = fw[fw["phase"] == "decode"]
        dec_t += float((d["end_us"] - d["start_us"]).sum())
        dec_n += float(d["tokens"].sum())
        steps += len(d)
        p = fw[fw["phase"] == "prefill"]
        pre_t += float((p["end_us"] - p["start_us"]).sum())
    return {"tokens_per_s": dec_n / (dec_t / 1e6), "decode_step_ms": dec_t / steps / 1e3, "prefill_ms": pre_t / 1e3,
            "sequences": len(starts)}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    tmp = tmp_path_factory.mktemp("lat")
    spec = load_spec(_write(tmp, SPEC))
    store = tmp / "store"
    summary = run_sweep(spec, store=store, threads=1, progress=False)
    assert (summary.done, summary.failed) == (2, {})
    return spec, store, collect(spec, store)


@pytest.mark.slow
def test_cell_latency_equals_a_direct_plan_and_simulation_of_its_trace(swept):
    spec, store, statuses = swept
    for x in statuses:
        rec = x.record
        assert x.state == "done" and set(rec["latency"]) == set(PROFILES)
        for profile in PROFILES:
            got = rec["latency"][profile]
            want = _direct(store / rec["trace_path"], x.cell.policy, x.cell.settings, profile)
            for k, v in want.items():
                assert got[k] == pytest.approx(v, rel=1e-9), (x.cell.policy, profile, k)
            assert got["tokens_per_s_basis"] == "decode" and got["sequences"] == 2
            s = got["settings"]
            assert s["profile"]["name"] == profile and s["profile_provenance"] and s["moelab"]
            assert s["hybrid"]["cache"]["capacity"] == 0 and s["routing_policy"]["name"] == x.cell.policy
        # the profiles differ, so must the figures
        assert rec["latency"][PROFILES[0]]["tokens_per_s"] != rec["latency"][PROFILES[1]]["tokens_per_s"]
    deferral = next(x for x in statuses if x.cell.policy == "deferral").record["latency"][PROFILES[0]]
    assert any(k.startswith("host") for k in deferral["busy_pct"]) and deferral["overlap_pct"] > 0


@pytest.mark.slow
def test_latency_without_stored_trace_and_the_report(swept, tmp_path):
    """Artifacts off: the cell records its trace in a temporary folder; the same figures."""
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect, markdown_latency, write_html
    from moelab.sweeps.spec import load_spec

    spec0, _, statuses0 = swept
    spec = load_spec(_write(tmp_path, SPEC.replace("artifacts: {trace: true}\n", "")))
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert summary.done == 2
    statuses = collect(spec, tmp_path / "store")
    for a, b in zip(statuses, statuses0):
        assert a.record["trace_path"] is None
        for p in PROFILES:
            assert a.record["latency"][p]["tokens_per_s"] == b.record["latency"][p]["tokens_per_s"]
    page = write_html(spec0, statuses0, tmp_path / "r.html").read_text()
    for p in PROFILES:
        assert f"Accuracy vs simulated tokens/s · {p}" in page
    assert "Pareto front" in page and "<th>Pareto</th>" in page and "No simulated latency" not in page
    md = markdown_latency(statuses0)
    assert md.count("| tiny-random-mixtral · arith") == 4 and "simulated on ktransformers-a100" in md
    from moelab.sweeps.report import table_rows

    assert all(isinstance(r["tokens/s ktransformers-a100"], float) for r in table_rows(statuses0))


def test_latency_inputs_enter_the_cell_hash(tmp_path):
    from moelab.sweeps.spec import expand, load_spec

    cells = expand(load_spec(_write(tmp_path, SPEC)), FP)
    no_hw = SPEC.replace("hardware: [ktransformers-a100, h100-pcie5-ddr5]\n", "").replace(
        "simulate:\n  model_shape: {shape: mixtral-8x7b, num_layers: 4}\n", "")
    variants = {
        "no hardware": no_hw,
        "one profile": SPEC.replace("[ktransformers-a100, h100-pcie5-ddr5]", "[ktransformers-a100]"),
        "shape": SPEC.replace("num_layers: 4}", "num_layers: 4, dtype: fp8}"),
        "hybrid": SPEC.replace("simulate:\n", "simulate:\n  hybrid: {cache: {capacity: 0}, placement: fetch-misses}\n"),
    }
    for what, text in variants.items():
        other = expand(load_spec(_write(tmp_path, text, f"{what}.yaml")), FP)
        assert not {c.hash for c in other} & {c.hash for c in cells}, what
    # the default hybrid written out is the same cell
    same = SPEC.replace("simulate:\n", "simulate:\n  hybrid: {cache: {capacity: 0}, placement: host-misses}\n")
    assert [c.hash for c in expand(load_spec(_write(tmp_path, same, "same.yaml")), FP)] == [c.hash for c in cells]
    # a profile's numbers, not just its name: a profile file, then the same file with one value changed
    import yaml

    src = ROOT / "moelab" / "timing" / "profiles" / "h100-pcie5-ddr5.yaml"
    d = yaml.safe_load(src.read_text())
    d["name"] = "faster-host"
    hashes = []
    for bw in (100.0, 200.0):
        d["numa_node_bandwidth_gbs"]["value"] = bw
        (tmp_path / "hw.yaml").write_text(yaml.safe_dump(d))
        hashes.append({c.hash for c in expand(load_spec(_write(tmp_path, SPEC.replace("h100-pcie5-ddr5]", "hw.yaml]"),
                                                                "f.yaml")), FP)})
    a, b = hashes
    assert not a & b


@pytest.mark.parametrize("old, new, message", [
    ("[ktransformers-a100, h100", "[ktransformers-a10, h100",
     r":9: unknown hardware profile 'ktransformers-a10'.*'ktransformers-a100'"),
    ("{shape: mixtral-8x7b,", "{shape: mixtral-8x7, ", r":11: .*mixtral-8x7b"),
    ("num_layers: 4}", "num_layer: 4}", r":11: model_shape: unknown field 'num_layer'.*'num_layers'"),
    ("simulate:\n  model_shape: {shape: mixtral-8x7b, num_layers: 4}",
     "simulate:\n  model_shape: {tiny-random-mixtrl: mixtral-8x7b}",
     r":11: model_shape names model 'tiny-random-mixtrl'.*'tiny-random-mixtral'"),
    ("simulate:\n", "simulate:\n  hybrid: {placment: host-misses}\n", r":11: .*unknown key 'placment'.*'placement'"),
    ("simulate:\n", "simulate:\n  hybird: {}\n", r":11: unknown key 'hybird' in simulate.*'hybrid'"),
    ("hardware: [ktransformers-a100, h100-pcie5-ddr5]\n", "",
     r":10: simulate: settings but no hardware: profiles"),
])
def test_bad_latency_input_is_refused_at_spec_load(tmp_path, old, new, message):
    from moelab.sweeps.spec import load_spec

    assert old in SPEC
    with pytest.raises(MoelabError, match=message):
        load_spec(_write(tmp_path, SPEC.replace(old, new)))


@pytest.mark.slow
def test_a_shape_whose_experts_differ_fails_the_cell_in_one_line(tmp_path):
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    spec = load_spec(_write(tmp_path, SPEC.replace("{shape: mixtral-8x7b, num_layers: 4}", "qwen2-57b-a14b")
                            .replace("  - {policy: deferral, min_immediate: 0, grid: {deferred: [1]}}\n", "")))
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert summary.done == 0 and len(summary.failed) == 1
    (x,) = collect(spec, tmp_path / "store")
    assert x.state == "failed"
    assert "model tiny-random-mixtral has 4 MoE layers of [8] experts" in x.error and "qwen2-57b-a14b" in x.error


def test_shipped_latency_spec_loads():
    from moelab.sweeps.latency import resolve_shape
    from moelab.sweeps.spec import expand, load_spec

    spec = load_spec(ROOT / "evals" / "sweeps" / "deferral_vs_skipping_latency.yaml")
    assert spec.hardware == PROFILES
    cells = expand(spec, {m.name: "0" * 16 for m in spec.models})
    for c in cells:
        shape = resolve_shape(c.simulate["model_shape"])
        assert (shape.num_experts, shape.top_k, shape.num_moe_layers) == {
            "moelab-tiny-mixtral": (8, 2, 4), "moelab-tiny-qwen2moe": (32, 8, 6)}[c.model]


def test_a_deferred_slot_is_simulated_once():
    """The planner lists a deferred expert among the layer's host experts too; the simulator runs
    it once, as deferred work (it was costed twice: deferral came out slower than no deferral)."""
    from moelab.hybrid.offline import ForwardRouting, plan_routing
    from moelab.policies import DeferralConfig, ExpertDeferral
    from moelab.simulate import get_shape, simulate_plans

    L = 2
    shape = get_shape("mixtral-8x7b")
    import dataclasses

    shape = dataclasses.replace(shape, num_layers=L, moe_layers=(0, 1))
    rout = [ForwardRouting(f, f, "decode", 1, [np.array([[0, 1]], np.int64)] * L,
                           [np.array([[0.6, 0.4]], np.float32)] * L) for f in range(2)]
    out = {}
    for d in (0, 1):
        pols = [ExpertDeferral(None, config=DeferralConfig(deferred=d, min_immediate=0))] if d else []
        plans = plan_routing(rout, {"cache": {"capacity": 0}, "placement": "host-misses"}, num_experts=[8] * L,
                             top_k=[2] * L, expert_bytes=shape.expert_bytes(), routing_policies=pols)
        if d:
            assert plans[0].deferred == [(1, 1)] and (1, 1) in plans[0].host  # the planner's convention
        res = simulate_plans(plans, shape, "ktransformers-a100")
        ev = res.events
        kinds = ev[ev["kind"].isin(["expert-host", "expert-deferred"])]
        assert len(kinds) == 2 * L * 2  # 2 slots per layer and forward, each run once
        assert (kinds["kind"] == "expert-deferred").sum() == (2 if d else 0)
        out[d] = res.summary()["decode_tokens_per_s"]
    # deferral never defers in the last MoE layer; the experts 0 and 1 live on different NUMA nodes:
    # the same work on the same lanes, so no slower
    assert out[1] >= out[0] * 0.999


# --------------------------------------------------------------------------- MoE-Gen throughput as the speed axis
THROUGHPUT_SPEC = """\
name: thr
models: [tiny-random-mixtral]
policies:
  - none
  - {policy: skipping, min_kept: 0, grid: {skipped: [1]}}
tasks:
  - {task: arith, limit: 2}
eval: {max_gen_toks: 4}
hardware: [moegen-a5000]
simulate:
  model_shape: {shape: mixtral-8x7b, num_layers: 4}
  schedule: moegen
  prompt: 256
  generate: 64
retries: 0
"""


@pytest.mark.slow
def test_throughput_schedule_is_the_moegen_search_at_the_cells_own_slots_per_token(tmp_path):
    """Each cell's speed is plan_throughput of its shape at the routed experts its own decode plans
    ran per token (the top-k unmodified; fewer when skipping), and the report labels the axis."""
    import dataclasses

    from moelab.simulate import get_shape
    from moelab.simulate.moegen import plan_throughput
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect, markdown_latency, write_html
    from moelab.sweeps.spec import load_spec

    spec = load_spec(_write(tmp_path, THROUGHPUT_SPEC))
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert (summary.done, summary.failed) == (2, {})
    statuses = collect(spec, tmp_path / "store")
    shape = dataclasses.replace(get_shape("mixtral-8x7b"), num_layers=4, moe_layers=(0, 1, 2, 3))
    figs = {x.cell.policy: x.record["latency"]["moegen-a5000"] for x in statuses}
    assert figs["none"]["slots_per_token"] == pytest.approx(2.0)  # top-2, nothing dropped
    assert 1.0 <= figs["skipping"]["slots_per_token"] < 2.0
    for f in figs.values():
        want = plan_throughput(shape, "moegen-a5000", prompt=256, generate=64, slots_per_token=f["slots_per_token"])
        assert f["tokens_per_s"] == pytest.approx(want.tokens_per_s, rel=1e-12)
        assert f["tokens_per_s_basis"] == "moegen" and f["settings"]["schedule"]["name"] == "moegen"
        assert f["configuration"]["batch"] == want.best.config.batch
    assert figs["skipping"]["tokens_per_s"] > figs["none"]["tokens_per_s"]  # fewer expert tokens per step
    page = write_html(spec, statuses, tmp_path / "r.html").read_text()
    assert "Accuracy vs simulated throughput tokens/s (MoE-Gen, best batch) · moegen-a5000" in page
    assert "MoE-Gen, best batch" in markdown_latency(statuses)


def test_throughput_schedule_enters_the_hash_and_bad_values_are_refused(tmp_path):
    from moelab.sweeps.spec import expand, load_spec

    cells = {c.hash for c in expand(load_spec(_write(tmp_path, THROUGHPUT_SPEC)), FP)}
    per_seq = THROUGHPUT_SPEC.replace("  schedule: moegen\n  prompt: 256\n  generate: 64\n", "")
    longer = THROUGHPUT_SPEC.replace("generate: 64", "generate: 128")
    for i, text in enumerate((per_seq, longer)):
        assert not cells & {c.hash for c in expand(load_spec(_write(tmp_path, text, f"v{i}.yaml")), FP)}
    for old, new, message in [
        ("schedule: moegen", "schedule: moegn", r"schedule 'moegn'.*'moegen'"),
        ("prompt: 256", "prompt: 0", r"prompt=0: expected a positive number"),
        ("  schedule: moegen\n", "", r"prompt/generate are the throughput schedule's lengths"),
    ]:
        with pytest.raises(MoelabError, match=message):
            load_spec(_write(tmp_path, THROUGHPUT_SPEC.replace(old, new), "bad.yaml"))
