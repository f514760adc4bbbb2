"""What-if grids and ``moelab simulate validate`` (moelab.simulate.whatif, moelab.simulate.validate)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from moelab.cli import main
from moelab.errors import MoelabError
from moelab.simulate.synthetic import RoutingStats
from moelab.simulate.whatif import cells, format_table, parse_grid, whatif


def _stats(E=8, K=2, L=2):
    return RoutingStats.from_lifts(E, K, [1.0] * L, [0.3] * L, [0.0] + [0.2] * (L - 1), [1.0 / (k + 1) for k in range(K)])


# ---------------------------------------------------------------------- the grid
def test_grid_expands_to_the_product_with_defaults():
    g = parse_grid(["capacity=0.1,0.25,0.5", "deferral=0,2,3,4", "placement=host-misses,greedy-hss"])
    cs = cells(g)
    assert len(cs) == 3 * 4 * 2
    assert cs[0] == {"capacity": 0.1, "deferral": 0, "placement": "host-misses", "policy": "lru", "skipping": 0,
                     "min_immediate": 2, "prefetch": "none", "select": "impact", "chunks": 1}
    assert {c["capacity"] for c in cs} == {0.1, 0.25, 0.5}
    assert parse_grid(["capacity=2e"])["capacity"] == [2]  # a count of experts
    assert len(cells(parse_grid([]))) == 1  # every axis at its default


@pytest.mark.parametrize("item, match", [
    (["capacty=0.1"], "capacity"),            # closest name
    (["capacity="], "no cells"),
    (["deferral=two"], "whole number"),
    (["placement=host-miss"], "host-misses"),
    (["policy=lruu"], "lru"),
    (["capacity"], "AXIS=V1"),
    (["capacity=-1"], "a fraction must be in"),
    (["capacity=1"], r"capacity='1' is ambiguous \(one expert per layer, or all\?\); give a count .* `e` "
                     r"\(capacity=1e, 8e\) or a fraction .* `%` or a decimal point \(capacity=25%, 0.25, 1.0 = all\)"),
    (["capacity=150%"], r"a fraction must be in \[0, 1\].*capacity=2e"),
    (["capacity=0e"], "not a capacity"),
    (["prefetch=orcale"], "Did you mean 'oracle'"),
])
def test_grid_errors_are_one_line(item, match):
    with pytest.raises(MoelabError, match=match) as e:
        parse_grid(item)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, value", [("1e", 1), ("8E", 8), ("25%", 0.25), ("0.25", 0.25), ("1.0", 1.0),
                                         ("100%", 1.0), ("0", 0), ("0%", 0.0), ("0.0", 0.0)])
def test_capacity_carries_its_unit(text, value):
    (v,) = parse_grid([f"capacity={text}"])["capacity"]
    assert v == value and type(v) is type(value)


# ---------------------------------------------------------------------- cells and the oracle bound
def test_oracle_bounds_every_cell():
    df = whatif("olmoe-1b-7b", "pcie4-x16", synthetic=True, stats=_stats(64, 8, 16), steps=3, warmup=3,
                context=256, grid={"capacity": [0.25, 0.5], "deferral": [0, 2], "placement": ["host-misses",
                                                                                           "fetch-misses"]})
    assert len(df) == 8
    assert (df["tokens_per_s"] > 0).all()
    for _, r in df.iterrows():
        assert r["oracle_tokens_per_s"] >= r["tokens_per_s"] * (1 - 1e-9), r.to_dict()
    for c in ("stall_copy_s", "stall_host_s", "stall_device_s", "stall_deferred_s", "oracle_variant"):
        assert c in df.columns
    assert df.attrs["cells"] == 8 and df.attrs["wall_s"] > 0
    # fetch-misses copies every miss: the copy engine holds the control thread up more than host-misses
    fm = df[df["placement"] == "fetch-misses"]["stall_copy_s"].sum()
    hm = df[df["placement"] == "host-misses"]["stall_copy_s"].sum()
    assert fm > hm


def test_grid_select_and_chunks_reach_the_planner_and_the_simulator(monkeypatch):
    """The ``select`` axis picks the planner's prefetch rule (``order``: ProMoE's, the proposal within
    the budget; ``impact``: HybriMoE's, within the lead time) and ``chunks`` the simulator's copy
    chunks (ProMoE's yielding copies), cell by cell."""
    import moelab.simulate.executor as ex

    seen = []
    real = ex.simulate_plans

    def spy(plans, *args, copy_chunks=1, **kw):
        seen.append((copy_chunks, sum(t.priority == "prefetch" for p in plans for t in p.transfers)))
        return real(plans, *args, copy_chunks=copy_chunks, **kw)

    monkeypatch.setattr(ex, "simulate_plans", spy)
    df = whatif("mixtral-8x7b", "pcie4-x16", synthetic=True, stats=_stats(8, 2, 32), steps=2, warmup=1,
                oracle=False, check_memory=False, grid={"capacity": [0.5], "placement": ["fetch-misses"], "prefetch": ["oracle"],
                                    "select": ["order", "impact"], "chunks": [1, 3]})
    assert df[["select", "chunks"]].values.tolist() == [["order", 1], ["order", 3], ["impact", 1], ["impact", 3]]
    assert [c for c, _ in seen] == [1, 3, 1, 3]
    assert seen[0][1] == seen[1][1] > 0  # order prefetches the oracle's experts; chunking does not change the plans


def test_module_is_callable_as_the_api():
    import moelab.simulate

    df = moelab.simulate.whatif("mixtral-8x7b", "pcie4-x16", synthetic=True, stats=_stats(8, 2, 32), steps=1,
                                warmup=0, oracle=False, grid={"capacity": [1]})
    assert len(df) == 1 and "oracle_tokens_per_s" not in df.columns


def test_trace_whose_experts_do_not_match_the_shape(tmp_path):
    from moelab.simulate.whatif import load_routing
    from moelab.timing.shapes import get_shape

    class Trace:  # what check_trace_shape reads of a RoutingTrace
        num_experts, top_k, num_moe_layers, path = 8, 2, 4, tmp_path
        meta = {"model": {"name": "moelab-tiny-mixtral"}}

    with pytest.raises(MoelabError, match=r"E=8.*deepseek-v3.*E=256.*--synthetic") as e:
        load_routing(get_shape("deepseek-v3"), trace=Trace())
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- CLI
def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--grid" in out and "--synthetic" in out and "validate" in out
    with pytest.raises(SystemExit):
        main(["simulate", "validate", "--help"])
    assert "--profile" in capsys.readouterr().out


@pytest.mark.parametrize("args, match", [
    (["--model-shape", "deepseek-v9", "--hardware", "pcie4-x16", "--synthetic"], "deepseek-v3"),
    (["--model-shape", "deepseek-v3", "--hardware", "pcie4-x17", "--synthetic"], "pcie4-x16"),
    (["--model-shape", "deepseek-v3", "--hardware", "pcie4-x16"], "--synthetic"),
    (["--model-shape", "deepseek-v3", "--hardware", "pcie4-x16", "--synthetic", "--grid", "deferral="], "no cells"),
])
def test_cli_bad_input_is_one_line(args, match, capsys):
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err


def test_cli_grid_prints_cells_and_wall_time(tmp_path, capsys, monkeypatch):
    import moelab.simulate.whatif  # noqa: F401

    mod = sys.modules["moelab.simulate.whatif"]
    monkeypatch.setattr(mod, "default_routing_stats", lambda *a, **k: _stats(8, 2, 4))
    out_csv = tmp_path / "grid.csv"
    assert main(["simulate", "--model-shape", "mixtral-8x7b", "--hardware", "rtx4090-desktop", "--synthetic",
                 "--steps", "2", "--warmup", "1", "--grid", "capacity=1e", "placement=host-misses,greedy-hss", "--csv",
                 str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert "routing statistics assumed" in out and "tok/s" in out and "oracle bound" in out
    assert "2 cells + oracle bounds in" in out
    assert out_csv.read_text().count("\n") == 3


# ---------------------------------------------------------------------- validate
def test_validate_quick_prints_every_row_with_an_error(capsys, monkeypatch):
    import moelab.simulate.whatif  # noqa: F401
    from moelab.simulate.validate_cases import validation_cases

    # statistics given (not recorded from the bundled model: that takes half a minute on 2 cores)
    monkeypatch.setattr(sys.modules["moelab.simulate.whatif"], "default_routing_stats", lambda *a, **k: _stats(8, 2, 4))

    assert main(["simulate", "validate", "--quick", "--papers-only"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["case", "metric", "published/measured", "simulated", "error"]
    for case in validation_cases():
        row = next(x for x in lines if x.startswith(case.name + " "))
        assert ("pts" in row) or ("%" in row)
    assert "sensitivity" in out and "±20 %" in out


@pytest.mark.slow
def test_validate_machine_rows_from_the_real_runs_plans():
    from moelab.simulate.validate import format_rows, machine_rows

    rows, info = machine_rows("pcie4-x16", quick=True, allow_busy=True)  # the format, not the figures
    assert {r["metric"] for r in rows} == {"decode step ms", "host busy %"}
    assert all(r["reference"] > 0 or r["metric"] == "host busy %" for r in rows)
    text = format_rows(rows, info)
    assert "median |error|" in text and "moelab-tiny-mixtral cap 0.25 defer 1" in text
    # a measured step time is a median of steps with its spread and the load (moelab.measure)
    steps = [r for r in rows if r["metric"] == "decode step ms"]
    assert all(r["spread"] >= 0 and "load1" in r["load"] for r in steps)
    assert "the median of 3 decode steps after 1 warm-up (spread ±" in text and "load average" in text


def test_grid_over_a_recorded_trace(tmp_path):
    import moelab
    from moelab.trace.run import trace_prompts

    model, tok = moelab.load("moelab-tiny-mixtral")
    trace = trace_prompts(model, tok, ["def add(a, b):"], tmp_path / "t", max_new_tokens=6, progress=False)
    shape = moelab.simulate.ModelShape.from_model(model)
    df = whatif(shape, "pcie4-x16", trace=trace.path, steps=3, warmup=2,
                grid=["capacity=0.25,0.5", "deferral=0,1", "min_immediate=1"])
    assert len(df) == 4 and (df["tokens_per_s"] > 0).all()
    import re

    n = int(re.search(r"\((\d+) decode forwards\)", df.attrs["routing_source"]).group(1))
    assert 1 <= n <= 5  # at most warmup + steps of the trace's decode forwards (generation may stop early)
    assert (df["oracle_tokens_per_s"] >= df["tokens_per_s"] * (1 - 1e-9)).all()


# ---------------------------------------------------------------------- memory, profiles, new axes
def test_cells_that_do_not_fit_are_refused_with_the_numbers_not_simulated():
    from moelab.timing import get_profile

    hw = get_profile("rtx4090-desktop")  # 24 GB: Mixtral BF16 at 2 slots per layer needs 26.9 GB
    df = whatif("mixtral-8x7b", hw, synthetic=True, stats=_stats(8, 2, 32), steps=1, warmup=1, oracle=False,
                grid=["capacity=1e,25%"])
    ok, no = df.iloc[0], df.iloc[1]
    assert ok["fits"] and ok["refused"] == "" and ok["tokens_per_s"] > 0
    assert not no["fits"] and no["tokens_per_s"] != no["tokens_per_s"]  # NaN: not simulated
    assert no["refused"].startswith("25 % of mixtral-8x7b's BF16 experts is 22.5 GB on a 24 GB GPU")
    assert "Fix: a capacity of at most 1e" in no["refused"]
    assert list(df["capacity"]) == [1, 0.25] and df.attrs["refused"] == 1
    table = format_table(df)
    assert "refused" in table and "refused (1 cell: capacity=0.25" in table
    # check_memory=False simulates it anyway
    forced = whatif("mixtral-8x7b", hw, synthetic=True, stats=_stats(8, 2, 32), steps=1, warmup=1, oracle=False,
                    grid=["capacity=25%"], check_memory=False)
    assert forced.iloc[0]["tokens_per_s"] > 0 and not forced.iloc[0]["fits"]


def test_a_grid_where_nothing_fits_is_refused_before_any_routing_is_made():
    from moelab.timing.memory import MemoryDoesNotFit

    with pytest.raises(MemoryDoesNotFit, match=r"^25 % of deepseek-v3's BF16 experts is 327 GB on an 80 GB GPU"):
        whatif("deepseek-v3", "h100-pcie5-ddr5", synthetic=True, stats="not read", grid=["capacity=25%"])


def test_prefetch_axis_and_static_policy_run_and_prefetch_without_a_cache_is_refused():
    df = whatif("mixtral-8x7b", "rtx4090-desktop", synthetic=True, stats=_stats(8, 2, 32), steps=2, warmup=2,
                oracle=False, grid=["capacity=0,1e", "prefetch=none,oracle", "policy=lru,static"])
    assert len(df) == 8
    zero_pf = df[(df["capacity"] == 0) & (df["prefetch"] == "oracle")]
    assert (zero_pf["refused"].str.contains("prefetch needs a device cache")).all()
    ran = df[df["refused"] == ""]
    assert len(ran) == 6 and (ran["tokens_per_s"] > 0).all()


def test_static_pins_the_warm_up_steps_most_used_experts():
    from moelab.routing import ForwardRouting
    from moelab.simulate.whatif import static_counts
    from moelab.timing import get_shape

    shape = get_shape("mixtral-8x7b")
    fw = [ForwardRouting(i, i, "decode", 1, [np.array([[i % 2, 3]])] * 32, [np.array([[0.6, 0.4]])] * 32)
          for i in range(4)]
    counts, note = static_counts(fw, shape, warmup=2)
    assert counts[:8].tolist() == [1, 1, 0, 2, 0, 0, 0, 0] and counts.sum() == 2 * 2 * 32
    assert "2 warm-up decode forwards" in note


def test_cli_set_and_numa_reach_the_grid(capsys, monkeypatch):
    mod = sys.modules["moelab.simulate.whatif"]
    monkeypatch.setattr(mod, "default_routing_stats", lambda *a, **k: _stats(8, 2, 4))
    seen = {}
    real = mod.whatif

    def spy(shape, hw, **kw):
        seen["hw"] = hw
        return real(shape, hw, **kw)

    monkeypatch.setattr(mod, "whatif", spy)
    assert main(["simulate", "--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5-ddr5", "--synthetic",
                 "--steps", "1", "--warmup", "1", "--no-oracle", "--grid", "capacity=1e", "--set",
                 "link_efficiency=0.5", "--set", "gpu_memory_gb=94", "--numa", "pooled"]) == 0
    out = capsys.readouterr().out
    hw = seen["hw"]
    assert hw.link.bandwidth_gbs == 25.0 and hw.gpu_memory_gb == 94.0
    assert (hw.numa_nodes, hw.numa_node_bandwidth_gbs) == (1, 921.6)
    assert "--set link_efficiency=0.5" in out and "NUMA pooled" in out
    assert main(["simulate", "--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5-ddr5", "--synthetic",
                 "--set", "cpu_cores=many"]) == 2
    assert "expected a whole number" in capsys.readouterr().err


def test_validate_set_changes_the_given_profile_through_a_file(monkeypatch, tmp_path):
    import moelab.simulate.validate as v
    from moelab.timing import load_profile

    seen = {}

    def fake(*, profile, quick, machine, progress, **_):
        seen["hw"] = load_profile(profile)  # a path validate can print, holding the change
        return [], {"wall_s": 0.0}

    monkeypatch.setattr(v, "run_validation", fake)
    monkeypatch.setattr(v, "format_rows", lambda rows, info: "")
    assert main(["simulate", "validate", "--profile", "h100-pcie5-ddr5", "--set", "cpu_cores=16"]) == 0
    assert seen["hw"].cpu_cores == 16 and seen["hw"].provenance["cpu_cores"].startswith("assumed: --set")
    assert seen["hw"].numa_nodes == 2  # the rest is the given profile's
