"""MoE-Gen's throughput schedule on the simulator (moelab.simulate.moegen, techniques.md §7.1).

Longest paths are hand-computed on tiny DAGs; the layer DAG is checked against its definition
(engine sums, buffer edges, what ω moves); the search against the memory limits it must respect,
recomputed here from the shapes' own byte counts."""

from __future__ import annotations

import json
import random

import pytest

from moelab.cli import main
from moelab.errors import MoelabError
from moelab.simulate.moegen import (
    Dag,
    LayerCosts,
    ThroughputConfig,
    layer_busy_us,
    layer_dag,
    max_batch,
    on_demand_baseline,
    plan_throughput,
    schedule_memory,
    step_jobs,
    step_lower_bound_us,
    step_time,
)
from moelab.timing.costs import CostModel
from moelab.timing.memory import MemoryDoesNotFit, kv_bytes
from moelab.timing.profile import get_profile
from moelab.timing.shapes import get_shape


def _lc(shape="mixtral-8x7b", profile="moegen-a5000", **changes) -> LayerCosts:
    hw = get_profile(profile)
    if changes:
        hw = hw.with_changes(**changes)
    return LayerCosts(CostModel.of(get_shape(shape), hw))


# ---------------------------------------------------------------------- the DAG, by hand
def test_longest_path_hand_computed():
    g = Dag()
    a = g.add("copy", "htod", 5.0)
    b = g.add("pre", "gpu", 2.0)
    c = g.add("attn", "gpu", 3.0, [a, b])
    d = g.add("cpu", "cpu", 9.0, [b])           # 2 + 9 = 11
    e = g.add("post", "gpu", 1.0, [c, d])       # max(8, 11) + 1
    assert (g.finish(a), g.finish(b), g.finish(c), g.finish(d), g.finish(e)) == (5.0, 2.0, 8.0, 11.0, 12.0)
    assert g.T == 12.0
    assert [j.name for j in g.critical_path()] == ["pre", "cpu", "post"]


def test_issue_order_serialises_one_engine():
    # two independent jobs on one engine run one after the other; on two engines, together
    g = Dag()
    g.add("x", "gpu", 4.0)
    y = g.add("y", "gpu", 3.0)
    assert g.finish(y) == 7.0
    h = Dag()
    h.add("x", "gpu", 4.0)
    z = h.add("z", "htod", 3.0)
    assert h.finish(z) == 3.0 and h.T == 4.0
    # Wcopy -> Expert chained over two experts: the copies queue on the link, compute overlaps the second copy
    k = Dag()
    c0 = k.add("Wcopy0", "htod", 10.0)
    e0 = k.add("Expert0", "gpu", 4.0, [c0])
    c1 = k.add("Wcopy1", "htod", 10.0)
    e1 = k.add("Expert1", "gpu", 4.0, [c1])
    assert (k.finish(e0), k.finish(c1), k.finish(e1)) == (14.0, 20.0, 24.0)
    # one slot: the second copy waits for the first expert -> 10 + 4 + 10 + 4
    s = Dag()
    c0 = s.add("Wcopy0", "htod", 10.0)
    e0 = s.add("Expert0", "gpu", 4.0, [c0])
    c1 = s.add("Wcopy1", "htod", 10.0, [e0])
    s.add("Expert1", "gpu", 4.0, [c1])
    assert s.T == 28.0


def test_dag_bad_input():
    g = Dag()
    with pytest.raises(MoelabError, match="engine 'tpu'"):
        g.add("j", "tpu", 1.0)
    with pytest.raises(MoelabError, match="cost"):
        g.add("j", "gpu", -1.0)
    with pytest.raises(MoelabError, match="predecessor 3"):
        g.add("j", "gpu", 1.0, [3])


# ---------------------------------------------------------------------- one layer, by hand
class _StubCosts:
    """Round numbers for each job: expert copy 5, expert chunk 2, no shared experts."""

    shared_bytes = router_bytes = router_flops_per_token = 0.0

    def fetch_us(self):
        return 5.0

    def device_us(self, n):
        return 2.0


class _StubLayer(LayerCosts):
    """A layer whose jobs cost round numbers: GPU micro-batch (PreAttn 1, KV HtoD 3, GPUAttn 2, KV DtoH 0.5),
    CPU share (PreAttn 1, Q DtoH 1, CPUAttn 10, O HtoD 1), PostAttn and Router 1, activations 0.25 a copy,
    two active experts of 3 tokens."""

    def __init__(self):
        self.costs, self._memo = _StubCosts(), {}
        self.o_bytes = self.o_params = self.hidden_bytes = 1.0
        self.k_post = 1

    def gpu_us(self, nbytes, flops, kernels):
        return 1.0

    def copy_us(self, nbytes):
        return 0.25

    def micro_batch_us(self, cfg, rows):
        return (1.0, 3.0, 2.0, 0.5)

    def cpu_share_us(self, cfg, rows):
        return (1.0, 1.0, 10.0, 1.0)

    def expert_tokens(self, tokens):
        return 2, 3


def test_layer_longest_path_by_hand():
    cfg = ThroughputConfig(batch=4, micro_batch=2, expert_batch=8, cpu_attention=0.5, expert_slots=1, pin_dense=True)
    g = layer_dag(_StubLayer(), cfg)
    t = {j.name: (j.start_us, j.finish_us) for j in g.jobs}
    # GPU: PreAttn[cpu share] 0-1, PreAttn[0] 1-2; the CPU share: Q 1-2, CPUAttn 2-12; KV HtoD[0] 0-3,
    # GPUAttn[0] 3-5; Wcopy[0] 3-8 behind the KV copy; O HtoD 12-13; PostAttn 13-14; Router 14-15;
    # expert 0: tokens 15-15.25, compute 15.25-17.25; one slot: Wcopy[1] 17.25-22.25; expert 1: 22.5-24.5
    assert t["CPUAttn"] == (2.0, 12.0) and t["GPUAttn[0]"] == (3.0, 5.0) and t["Wcopy[0]"] == (3.0, 8.0)
    assert t["O HtoD[cpu share]"] == (12.0, 13.0) and t["PostAttn"] == (13.0, 14.0) and t["Router"] == (14.0, 15.0)
    assert t["Expert[0][0]"] == (15.25, 17.25) and t["Wcopy[1]"] == (17.25, 22.25)
    assert t["Expert[1][0]"] == (22.5, 24.5) and g.T == 24.75
    # two slots: Wcopy[1] runs 8-13 behind Wcopy[0], the O copy waits for it (13-14), everything 1 later until
    # the experts: tokens 16-16.25, expert 0 16.25-18.25, expert 1 18.25-20.25, its output 20.25-20.5
    g2 = layer_dag(_StubLayer(), ThroughputConfig(batch=4, micro_batch=2, expert_batch=8, cpu_attention=0.5,
                                                  expert_slots=2, pin_dense=True))
    t2 = {j.name: (j.start_us, j.finish_us) for j in g2.jobs}
    assert t2["Wcopy[1]"] == (8.0, 13.0) and t2["Expert[1][0]"] == (18.25, 20.25) and g2.T == 20.5
    # pinning both experts removes the copies: router 14-15, experts 15.25-17.25 and 17.25-19.25 (tokens in
    # 15-15.25 and 15.25-15.5), last output 19.25-19.5
    g3 = layer_dag(_StubLayer(), cfg, pinned=2)
    assert not any(j.name.startswith("Wcopy") for j in g3.jobs) and g3.T == 19.5


# ---------------------------------------------------------------------- one layer against its definition
_CFGS = [ThroughputConfig(batch=300, micro_batch=64, expert_batch=50, cpu_attention=0.3, expert_slots=2),
         ThroughputConfig(batch=257, micro_batch=32, expert_batch=512, cpu_attention=0.0, expert_slots=1),
         ThroughputConfig(batch=100, micro_batch=100, expert_batch=7, cpu_attention=1.0, expert_slots=3,
                          pin_dense=True),
         ThroughputConfig(phase="prefill", batch=4, micro_batch=3, expert_batch=256, prompt=64, generate=0)]


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "deepseek-v2-lite"])
@pytest.mark.parametrize("cfg", _CFGS)
def test_layer_dag_definition(shape, cfg):
    lc = _lc(shape)
    for moe, pinned in ((True, 0), (True, 3), (False, 0)):
        g = layer_dag(lc, cfg, moe=moe, pinned=pinned)
        busy = g.busy_us()
        for eng, v in layer_busy_us(lc, cfg, moe=moe, pinned=pinned).items():
            assert v == pytest.approx(busy[eng], rel=1e-12)
        makespan = g.T
        assert max(busy.values()) <= makespan * (1 + 1e-9) and makespan <= sum(busy.values()) * (1 + 1e-9)
        assert makespan == pytest.approx(layer_dag(lc, cfg, moe=moe, pinned=pinned, record=False).T)
        jobs = {j.name: j for j in g.jobs}
        # every job starts after its predecessors and after the engine's previous job
        for j in g.jobs:
            assert all(g.jobs[p].finish_us <= j.start_us + 1e-9 for p in j.preds)
        # rows: the CPU share plus the GPU micro-batches cover the batch
        rows = sum(j.fields["rows"] for j in g.jobs if j.name.startswith("PreAttn"))
        assert rows == cfg.batch
        assert all(j.fields["rows"] <= cfg.micro_batch for n, j in jobs.items() if n.startswith("GPUAttn["))
        # two KV staging buffers: micro-batch j's copy after GPUAttn j-2
        for n, j in jobs.items():
            if n.startswith("KV HtoD["):
                i = j.fields["micro_batch"]
                if i >= 2:
                    assert j.start_us >= jobs[f"GPUAttn[{i - 2}]"].finish_us - 1e-9
        if moe:
            active, n_e = lc.expert_tokens(cfg.tokens_per_step)
            copies = [j for j in g.jobs if j.name.startswith("Wcopy")]
            assert len(copies) == active - min(pinned, active)
            # S_Expert slots: copy e waits for the last chunk of expert e - slots
            for c in copies:
                e = c.fields["expert"]
                if e >= cfg.expert_slots:
                    last = max(j.finish_us for j in g.jobs if j.name.startswith(f"Expert[{e - cfg.expert_slots}]["))
                    assert c.start_us >= last - 1e-9
            chunks = [j for j in g.jobs if j.name.startswith("Expert[") and j.fields["expert"] == 0
                      and not j.fields.get("pinned")]
            if chunks:
                assert sum(j.fields["rows"] for j in chunks) == n_e
                assert all(j.fields["rows"] <= cfg.expert_batch for j in chunks)


def test_cpu_attention_share_meaning():
    lc = _lc()
    B = 200
    by_w = {}
    for w in (0.0, 0.5, 1.0):
        g = layer_dag(lc, ThroughputConfig(batch=B, micro_batch=32, expert_batch=256, cpu_attention=w))
        names = [j.name for j in g.jobs]
        cpu_rows = sum(j.fields["rows"] for j in g.jobs if j.engine == "cpu")
        kv_rows = sum(j.fields["rows"] for j in g.jobs if j.name.startswith("KV HtoD"))
        assert cpu_rows == round(w * B) and kv_rows == B - round(w * B)
        assert ("CPUAttn" in names) == (w > 0)
        by_w[w] = g.busy_us()
    # ω moves KV reads off the link onto the CPU
    assert by_w[0.0]["cpu"] == 0.0 and by_w[0.5]["cpu"] < by_w[1.0]["cpu"]
    assert by_w[0.0]["htod"] > by_w[0.5]["htod"] > by_w[1.0]["htod"]
    # prefill is GPU-only
    with pytest.raises(MoelabError, match="GPU-only"):
        ThroughputConfig(phase="prefill", batch=2, cpu_attention=0.5)
    g = layer_dag(lc, ThroughputConfig(phase="prefill", batch=2, micro_batch=1, expert_batch=128, prompt=32))
    assert not any(j.name.startswith("KV HtoD") or j.engine == "cpu" for j in g.jobs)


def test_mla_up_projection_charged():
    # DeepSeek-V2-Lite's public config: kv_lora_rank 512, 16 heads, qk_nope 128, qk_rope 64, v_head 128
    lc = _lc("deepseek-v2-lite")
    cfg = ThroughputConfig(batch=4, micro_batch=4, expert_batch=64, prompt=100, generate=0)
    up = 2 * 512 * 16 * (128 + 128)
    core = 2 * 16 * (128 + 64 + 128)
    assert lc.core_flops(cfg, 4) == 4 * 100 * (up + core)
    # more than the shapes' weight-absorbed decode count of the same attention
    s = get_shape("deepseek-v2-lite")
    absorbed = s.attention_flops(100, 4) - s.attention_flops(0, 4)
    assert lc.core_flops(cfg, 4) > absorbed
    # a GQA shape keeps the shapes' count
    g = _lc("mixtral-8x7b")
    m = get_shape("mixtral-8x7b")
    assert g.core_flops(cfg, 4) == m.attention_flops(100, 4) - m.attention_flops(0, 4)


def test_step_time_adds_layers_and_bounds():
    lc = _lc("deepseek-v2-lite")
    cfg = ThroughputConfig(batch=512, micro_batch=64, expert_batch=256, cpu_attention=0.2, pinned_experts=30)
    st = step_time(lc, cfg)
    M = 26
    p, r = divmod(30, M)
    want = ((M - r) * layer_dag(lc, cfg, pinned=p).T + r * layer_dag(lc, cfg, pinned=p + 1).T
            + layer_dag(lc, cfg, moe=False).T + st.lm_head_us)
    assert st.step_us == pytest.approx(want)
    assert st.tokens_per_s == pytest.approx(512 / want * 1e6)
    assert step_lower_bound_us(lc, cfg) <= st.step_us
    jobs = step_jobs(lc, cfg)
    assert max(j.finish_us for j in jobs) == pytest.approx(st.step_us)
    assert {j.fields.get("layer") for j in jobs if j.name != "LMHead"} == set(range(27))


# ---------------------------------------------------------------------- the search and memory
def _fits_by_hand(shape, hw, plan):
    """Eq. 2 from the shape's own bytes, and the GPU pool under its capacity."""
    c = plan.best.config
    ctx = c.prompt + (c.generate if c.phase == "decode" else 0)
    host = shape.total_bytes() + kv_bytes(shape, ctx, c.batch)
    assert host <= hw.host_memory_gb * 1e9
    m = plan.best.memory
    assert m.fits is True and not m.problems
    assert m.gpu.need_bytes <= hw.gpu_memory_gb * 1e9
    assert m.gpu.term("S_Params (experts)").bytes == c.pinned_experts * shape.expert_bytes()


def test_search_results_fit_random_shapes_and_profiles():
    rng = random.Random(7)
    shapes = ["mixtral-8x7b", "deepseek-v2-lite", "olmoe-1b-7b", "qwen3-30b-a3b"]
    checked = 0
    for _ in range(8):
        name = rng.choice(shapes)
        s = get_shape(name)
        hw = get_profile(rng.choice(["moegen-a5000", "moegen-a6000", "hybrimoe-a6000"])).with_changes(
            gpu_memory_gb=rng.choice([12.0, 24.0, 48.0, 80.0]),
            host_memory_gb=float(s.total_bytes() / 1e9 + rng.choice([8, 64, 256])),
            link_bandwidth_gbs=rng.choice([16.0, 31.5, 64.0]))
        try:
            plan = plan_throughput(s, hw, cpu_attention=rng.choice([0.0, 0.5, 1.0]), expert_slots=2,
                                   generate=rng.choice([64, 256]), baseline=False)
        except MemoryDoesNotFit as e:  # a refusal must carry numbers
            assert "GB" in str(e)
            continue
        _fits_by_hand(s, hw, plan)
        assert plan.best.config.batch == max_batch(LayerCosts(CostModel.of(s, hw)), plan.best.config.memory_context)
        checked += 1
    assert checked >= 4


def test_full_search_and_baseline_fit():
    s, hw = get_shape("mixtral-8x7b"), get_profile("moegen-a5000")
    plan = plan_throughput(s, hw, micro_batch=16)
    _fits_by_hand(s, hw, plan)
    # decode fixes B at the host-memory maximum: one more sequence would not fit Eq. 2
    B = plan.best.config.batch
    assert s.total_bytes() + kv_bytes(s, 768, B + 1) > hw.host_memory_gb * 1e9
    base = plan.baseline
    assert base is not None and base.memory.fits is True
    assert base.memory.gpu.term("KV cache (on the GPU)").bytes == pytest.approx(kv_bytes(s, 768, base.config.batch))
    lc = LayerCosts(CostModel.of(s, hw))
    twice = schedule_memory(lc, ThroughputConfig(batch=2 * base.config.batch, micro_batch=2 * base.config.batch,
                                                 expert_batch=base.config.expert_batch, expert_slots=1,
                                                 pin_dense=True), kv_on_gpu=True)
    assert twice.fits is False  # the baseline's batch is the largest power of two that fits
    assert plan.tokens_per_s > base.tokens_per_s
    # the plan's predicted time is the DAG's
    assert plan.best.step.step_us == pytest.approx(step_time(lc, plan.best.config).step_us)
    d = plan.to_dict()
    assert d["best"]["memory"]["fits"] is True and d["assumptions"]


def test_search_beats_every_fitting_candidate_and_bounds_hold():
    # the search's answer is at least as fast as any configuration of its grids that fits (pinning no
    # experts; pinning more never slows a layer), and the bound it prunes with never exceeds a step's time
    s, hw = get_shape("olmoe-1b-7b"), get_profile("moegen-a5000").with_changes(host_memory_gb=40.0)
    lc = LayerCosts(CostModel.of(s, hw))
    plan = plan_throughput(s, hw, expert_slots=2, baseline=False)
    B = plan.best.config.batch
    rng = random.Random(3)
    tried = 0
    for _ in range(60):
        cfg = ThroughputConfig(batch=B, micro_batch=rng.choice([2 ** i for i in range(12) if 2 ** i <= B]),
                               expert_batch=rng.choice([64, 128, 256, 512, 1024]), cpu_attention=rng.randrange(11) / 10,
                               expert_slots=2, pin_dense=rng.random() < 0.5)
        if schedule_memory(lc, cfg).fits is not True:
            continue
        st = step_time(lc, cfg)
        assert plan.tokens_per_s >= st.tokens_per_s * (1 - 1e-12)
        assert step_lower_bound_us(lc, cfg) <= st.step_us * (1 + 1e-12)
        tried += 1
    assert tried >= 20


def test_device_sharing_host_memory_counts_every_term_there():
    # a CPU worker as the device: Eq. 2 and Eq. 3 against one memory
    hw = get_profile("moegen-a5000").with_changes(device_shares_host_memory=True, host_memory_gb=64.0)
    s = get_shape("olmoe-1b-7b")
    plan = plan_throughput(s, hw, expert_slots=1, cpu_attention=0.5)
    m = plan.best.memory
    assert not m.gpu.terms and m.fits is True
    names = {t.name for t in m.host.terms}
    assert {"S_Model", "S_KV-CPU", "S_Expert", "S_IS", "workspace"} <= names
    assert m.host.need_bytes <= 64e9
    # B is the largest at which the smallest configuration fits the one memory
    lc = LayerCosts(CostModel.of(s, hw))
    B = plan.best.config.batch
    assert schedule_memory(lc, ThroughputConfig(batch=B + 1)).fits is False


def test_monotonic_host_memory_and_link():
    s = get_shape("olmoe-1b-7b")
    hw = get_profile("moegen-a5000")
    batches = []
    for host in (40.0, 80.0, 160.0):
        lc = LayerCosts(CostModel.of(s, hw.with_changes(host_memory_gb=host)))
        batches.append(max_batch(lc, 768))
    assert batches == sorted(batches) and batches[0] < batches[-1]
    kw = dict(micro_batch=64, expert_batch=1024, expert_slots=2, baseline=False)
    slow = plan_throughput(s, hw.with_changes(link_bandwidth_gbs=16.0), **kw).tokens_per_s
    fast = plan_throughput(s, hw.with_changes(link_bandwidth_gbs=64.0), **kw).tokens_per_s
    assert fast >= slow
    lo = plan_throughput(s, hw.with_changes(host_memory_gb=40.0), **kw).best.config.batch
    hi = plan_throughput(s, hw.with_changes(host_memory_gb=160.0), **kw).best.config.batch
    assert hi >= lo


def test_refusals_name_the_numbers():
    s = get_shape("mixtral-8x7b")
    with pytest.raises(MemoryDoesNotFit, match=r"93\.4 GB.*50 GB"):
        plan_throughput(s, get_profile("moegen-a5000").with_changes(host_memory_gb=50.0))
    with pytest.raises(MemoryDoesNotFit, match=r"at most \d+ fits host memory"):
        plan_throughput(s, "moegen-a5000", batch=10**6)
    with pytest.raises(MemoryDoesNotFit, match=r"GPU needs .* of moegen-a5000's 1 GB"):
        plan_throughput(s, get_profile("moegen-a5000").with_changes(gpu_memory_gb=1.0), cpu_attention=1.0,
                        expert_slots=1)
    assert on_demand_baseline(s, get_profile("moegen-a5000").with_changes(gpu_memory_gb=1.0)) is None
    with pytest.raises(MoelabError, match="cpu_attention"):
        ThroughputConfig(cpu_attention=1.5)


# ---------------------------------------------------------------------- CLI
def test_cli_throughput_json_and_text(capsys, tmp_path):
    args = ["simulate", "throughput", "--model-shape", "deepseek-v2-lite", "--hardware", "moegen-a6000",
            "--micro-batch", "64", "--expert-batch", "1024", "--cpu-attention", "0", "--expert-slots", "2"]
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["profile"] == "moegen-a6000" and d["best"]["cpu_attention"] == 0.0 and d["best"]["micro_batch"] == 64
    assert d["tokens_per_s"] > 0 and d["best"]["memory"]["fits"] is True and d["baseline"]["tokens_per_s"] > 0
    ev = tmp_path / "ev.parquet"
    assert main([*args, "--events", str(ev)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "on-demand offloading" in out and "assumed:" in out and "wrote one step" in out
    from moelab.timeline import Timeline

    assert Timeline(str(ev)).wall_us == pytest.approx(d["best"]["step_ms"] * 1e3)


def test_cli_throughput_bad_input(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "throughput", "--model-shape", "mixtral-8x7b", "--hardware", "moegen-a5000",
              "--cpu-attention", "1.5"])
    assert "share in [0, 1]" in capsys.readouterr().err
    assert main(["simulate", "throughput", "--model-shape", "mixtral-8x7b", "--hardware", "moegen-a5000",
                 "--set", "host_memory_gb=50"]) == 2
    err = capsys.readouterr().err.strip()
    assert "93.4 GB" in err and "\n" not in err


# ---------------------------------------------------------------------- validation rows
def test_validation_rows_are_predictions_with_assumptions(monkeypatch):
    import moelab.simulate.moegen.validate as v
    from moelab.simulate.validate import format_rows

    assert {(c.shape, c.profile) for c in v.CASES} == {(m, f"moegen-{g}") for m in ("mixtral-8x7b", "deepseek-v2-lite")
                                                       for g in ("a5000", "a6000")}
    monkeypatch.setattr(v, "CASES", (v.ThroughputCase("olmoe-a6000", "olmoe-1b-7b", "moegen-a6000", "test"),))
    rows = v.throughput_rows(quick=True)
    (r,) = rows
    plan = plan_throughput("olmoe-1b-7b", "moegen-a6000", prompt=v.PROMPT, generate=v.GENERATE)
    assert r["simulated"] == pytest.approx(plan.tokens_per_s) and r["reference"] == pytest.approx(
        plan.baseline.tokens_per_s)
    assert r["error"] is None and "prompt 512 + generate 256" in r["assumed"]
    text = format_rows(rows, {"wall_s": 0})
    assert "olmoe-a6000" in text and "no published figure" in text


# ---------------------------------------------------------------------- events and the timeline
def test_schedule_events_draw_on_the_timeline(tmp_path):
    from moelab.events import COLUMNS
    from moelab.simulate.moegen.events import schedule_events
    from moelab.timeline import Timeline

    cfg = ThroughputConfig(batch=64, micro_batch=16, expert_batch=64, cpu_attention=0.5, expert_slots=2,
                           pinned_experts=3)
    lc = _lc("olmoe-1b-7b")
    ev = schedule_events("olmoe-1b-7b", "moegen-a5000", cfg, steps=2)
    assert list(ev.columns) == list(COLUMNS)
    assert set(ev["lane"]) == {"device", "host", "copy-htod", "copy-dtoh"}
    st = step_time(lc, cfg)
    assert ev["t_end_us"].max() == pytest.approx(2 * st.step_us)
    # one event per job of positive cost, per step; micro-batches and expert chunks named in cause
    assert len(ev) == 2 * sum(1 for j in step_jobs(lc, cfg) if j.cost_us > 0)
    assert {"GPUAttn[0]", "CPUAttn", "Wcopy[0]"} <= set(ev["cause"])
    tl = Timeline(ev, name="MoE-Gen (simulated)", tokens=cfg.tokens_per_step * 2)
    assert tl.summary(critical_path=False)["tokens_per_s"] == pytest.approx(st.tokens_per_s)
    assert len(tl.figure().data) > 0
    path = tmp_path / "events.parquet"
    ev.to_parquet(path, index=False)
    assert len(Timeline(str(path))) == len(ev)
