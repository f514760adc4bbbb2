"""Benchmark of the native experts kernels against transformers' built-in experts.

Measures, on the machine it runs on: the read (and copy) bandwidth of main memory
(STREAM-like, all threads), then for each expert shape, dtype and token count T the
time of one MoE layer's experts, the achieved weight bandwidth (bytes of the distinct
experts touched / time) as a share of the read bandwidth (probed again, untimed, before each
timed call of that row: the best of those probes), for T ≥ 64 the achieved
GFLOP/s as a share of the machine's measured FMA peak (on the ISA path that ran; on ``amx``
the bf16 tile peak), the
thread imbalance of the kernels' two stages, and the speedup over the fastest of
transformers' ``eager``, ``batched_mm`` and ``grouped_mm`` experts (bf16, same weights;
``batched_mm`` gathers one weight matrix per (token, slot) and is skipped, with the
reason recorded, where that would not fit in memory). Routing is uniform random top-k,
redrawn every repetition so decode reads cold weights.

``prefill=True`` (``moelab bench kernels --prefill``) instead times one DeepSeek-V2-Lite-shaped
layer (2048x1408x64x6) at 512 and 2048 tokens, with uniform routing and with a skewed one
(expert 0 in every token's top-k), against the same built-ins.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moelab.errors import MoelabError, unknown_name
from moelab.kernels.packing import PackedExperts
from moelab.measure import measure, spread_of

logger = logging.getLogger(__name__)

DEFAULT_SHAPES: tuple[str, ...] = ("2048x1408x64x6", "4096x14336x8x2")
DEFAULT_TOKENS: tuple[int, ...] = (1, 4, 16, 64, 256)
DEFAULT_DTYPES: tuple[str, ...] = ("bf16", "int8", "int4", "fp8")
DTYPES: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "fp8")
BASELINES: tuple[str, ...] = ("eager", "batched_mm", "grouped_mm")
PREFILL_SHAPE = "2048x1408x64x6"  # DeepSeek-V2-Lite
PREFILL_TOKENS: tuple[int, ...] = (512, 2048)
GFLOPS_MIN_TOKENS = 64
"""From this many tokens the table reports GFLOP/s against the FMA peak (the compute-bound regime)."""


@dataclass(frozen=True)
class Shape:
    """One MoE layer's expert geometry."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        try:
            h, i, e, k = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise MoelabError(f"shape {text!r} is not HxIxExK (e.g. 2048x1408x64x6).") from None
        if min(h, i, e, k) < 1 or k > e:
            raise MoelabError(f"shape {text!r} needs positive sizes and top-k ≤ experts.")
        return cls(h, i, e, k)

    def __str__(self) -> str:
        return f"{self.hidden}x{self.intermediate}x{self.experts}x{self.top_k}"

    def bf16_bytes_per_expert(self) -> int:
        return 3 * self.hidden * self.intermediate * 2


@dataclass
class BenchConfig:
    """What ``moelab bench kernels`` measures."""

    shapes: Sequence[str] = DEFAULT_SHAPES
    """Expert shapes HxIxExK."""
    tokens: Sequence[int] = DEFAULT_TOKENS
    """Token counts T per layer call."""
    dtypes: Sequence[str] = DEFAULT_DTYPES
    """moelab weight formats (fp32, bf16, int8, int4, fp8)."""
    baselines: Sequence[str] = BASELINES
    """transformers experts implementations to compare against (bf16)."""
    group_size: int = 64
    """Quantisation group size for int8/int4."""
    fp8_block: tuple[int, int] = (128, 128)
    """fp8 scale block (rows, reduction); DeepSeek-V3's checkpoints use 128×128."""
    repeat: int = 5
    """Timed repetitions per point (median reported; fewer for large T)."""
    memory_fraction: float = 0.6
    """Share of available memory the weights may use; E is scaled down beyond it."""
    bandwidth_mib: int = 1024
    """Size of the bandwidth-test buffer."""
    prefill: bool = False
    """Time one DeepSeek-V2-Lite-shaped layer at 512 and 2048 tokens (uniform and skewed routing)
    instead of ``shapes`` × ``tokens``."""


@dataclass
class Row:
    shape: str
    experts_used: int
    dtype: str
    tokens: int
    ms: float
    gbps: float
    pct_read_bw: float
    """``gbps`` as a share of ``read_gbps``, the read bandwidth probed between this row's timed calls."""
    baseline_ms: dict[str, float] = field(default_factory=dict)
    speedup_vs_best: float | None = None
    rel_err_vs_bf16: float | None = None
    spread: float | None = None
    """Relative spread of the repeats around the median ``ms`` (:mod:`moelab.measure`)."""
    isa: str = ""
    """Instruction-set path the kernels ran on."""
    routing: str = "uniform"
    """``uniform`` random top-k, or ``skewed`` (expert 0 in every token's top-k)."""
    gflops: float = 0.0
    """Useful GFLOP/s: 2·3·H·I·T·K / time."""
    pct_peak: float | None = None
    """``gflops`` as a share of the measured FMA peak (T ≥ 64 only)."""
    imbalance: float | None = None
    """max / mean per-thread busy time of the slower-balanced kernel stage (1.0 = perfect)."""
    baseline_skipped: dict[str, str] = field(default_factory=dict)
    """Built-ins not run, with the reason (e.g. memory)."""
    read_gbps: float | None = None
    """Read bandwidth (GB/s, the best of the STREAM-like probes run untimed before each of this row's
    timed calls), which ``pct_read_bw`` divides by: this machine's bandwidth can change by 2x
    between minutes, so the run's opening probe (``machine.read_gbps``) can be far from the
    bandwidth a later row ran at. The probe also evicts the last call's weights from the caches."""
    pct_read_bw_opening: float | None = None
    """``gbps`` as a share of the run's opening probe (``machine.read_gbps``)."""


_BUSY: list[str] = []  # reasons any timing of the current run was flagged busy


def _measure(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None):
    """``repeat`` timed calls after one warm-up (:func:`moelab.measure.measure`); a busy verdict is kept."""

    m = measure(fn, warmup=1, repeat=repeat, setup=setup)
    if m.busy:
        _BUSY.append(m.reason)
    return m


def _median_time(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None) -> float:
    """Median seconds of ``repeat`` timed calls after one warm-up."""
    return _measure(fn, repeat, setup).median


def _probe_array(mib: int) -> torch.Tensor:
    """The read-bandwidth probe's array: ``mib`` MiB of fp32 ones, summed to read it."""
    return torch.ones(mib * 2**20 // 4)


def _read_gbps(a: torch.Tensor, seconds: float) -> float:
    """GB/s of reading ``a`` once in ``seconds``."""
    return a.numel() * a.element_size() / seconds / 1e9


def memory_bandwidth(mib: int = 1024, repeat: int = 5) -> dict[str, Any]:
    """STREAM-like read (``sum``) and copy bandwidth in GB/s, best of ``repeat`` after a warm-up,
    all threads; with the machine's load and whether it made the figure meaningless (``busy``)."""

    a = _probe_array(mib)
    b = torch.empty_like(a)
    read = measure(lambda: a.sum(), warmup=1, repeat=repeat)
    copy = measure(lambda: b.copy_(a), warmup=1, repeat=repeat)
    reasons = [m.reason for m in (read, copy) if m.busy]
    return {"read_gbps": _read_gbps(a, read.best), "copy_gbps": 2 * _read_gbps(a, copy.best),
            "load": read.load_after, "busy": bool(reasons), "busy_reason": "; ".join(reasons)}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def _fit_experts(shape: Shape, dtypes: Sequence[str], fraction: float) -> int:
    """Largest E ≤ shape.experts whose weights (bf16 original + packs) fit the budget."""
    factor = {"fp32": 2.0, "bf16": 1.0, "int8": 0.53, "int4": 0.28, "fp8": 0.51}
    per_expert = shape.bf16_bytes_per_expert() * (1.0 + sum(factor[d] for d in dtypes) + 1.0)  # + temporaries
    budget = _available_bytes() * fraction
    e = int(min(shape.experts, budget // per_expert))
    if e < shape.top_k:
        raise MoelabError(
            f"shape {shape} needs {per_expert * shape.top_k / 2**30:.1f} GiB for even {shape.top_k} experts; "
            "not enough memory. Pass a smaller --shapes."
        )
    return e


def _experts_module(shape: Shape, experts: int) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    cfg = Qwen2MoeConfig(
        hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate, num_experts=experts,
        num_experts_per_tok=shape.top_k,
    )
    with torch.device("meta"):
        mod = Qwen2MoeExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    mod.gate_up_proj = torch.nn.Parameter(torch.empty(mod.gate_up_proj.shape, dtype=torch.bfloat16), requires_grad=False)
    mod.down_proj = torch.nn.Parameter(torch.empty(mod.down_proj.shape, dtype=torch.bfloat16), requires_grad=False)
    for p in (mod.gate_up_proj, mod.down_proj):
        for e in range(experts):  # fill expert by expert to bound the fp32 temporaries
            p.data[e] = (torch.randn(p.shape[1:], generator=gen) * 0.02).to(torch.bfloat16)
    return mod


class _Routing:
    """Random top-k routing for T tokens, redrawn by :meth:`redraw`: uniform, or skewed (expert 0
    in every token's top-k, so one expert holds T of the T·K pairs)."""

    def __init__(self, tokens: int, experts: int, top_k: int, skewed: bool = False) -> None:
        self.t, self.e, self.k, self.skewed = tokens, experts, top_k, skewed
        self.redraw()

    def redraw(self) -> None:
        if self.skewed:
            rest = torch.rand(self.t, self.e - 1).argsort(-1)[:, : self.k - 1] + 1
            self.ids = torch.cat([torch.zeros(self.t, 1, dtype=torch.long), rest], 1)
        else:
            self.ids = torch.rand(self.t, self.e).argsort(-1)[:, : self.k]
        self.w = torch.rand(self.t, self.k).softmax(-1)


#: The layer :func:`call_overhead` times: compute is a few microseconds, the rest is the call's own cost.
OVERHEAD_SHAPE = "64x64x8x2"


def call_overhead(calls: int = 400) -> dict[str, tuple[float, float]]:
    """µs of one batch-1 experts call on a tiny bf16 layer (:data:`OVERHEAD_SHAPE`), median of
    ``calls`` after a warm-up and its relative spread (:func:`moelab.measure.spread_of`), three ways: ``experts call`` (the ``moelab`` backend's ``__call__``,
    what transformers' ``moelab`` experts implementation runs per layer: checks, routing, pack
    lookup, extension), ``lane submit`` (``submit`` then ``result``: the real executor's host lane,
    a C++ worker thread) and ``extension`` (the compiled call alone, its arguments prepared). What a
    decode step pays per MoE layer besides the weights' bytes."""
    import statistics
    import time

    from moelab.backends import get_backend
    from moelab.kernels.op import _args, load_extension

    shape = Shape.parse(OVERHEAD_SHAPE)
    mod = _experts_module(shape, shape.experts)
    r = _Routing(1, shape.experts, shape.top_k)
    x = (torch.randn(1, shape.hidden) * 0.5).to(torch.bfloat16)
    be = get_backend("moelab")
    ext = load_extension()
    args = _args(x, r.ids, r.w, be.packed(mod), None, None)

    def median_us(fn: Callable[[], object]) -> tuple[float, float]:
        for _ in range(max(calls // 8, 1)):
            fn()
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts) / 1e3, spread_of(ts)

    with torch.no_grad():
        return {"experts call": median_us(lambda: be(mod, x, r.ids, r.w)),
                "lane submit": median_us(lambda: be.submit(mod, x, r.ids, r.w).result()),
                "extension": median_us(lambda: ext.moe_forward(*args, expert_map=None))}


def _batched_mm_bytes(shape: Shape, tokens: int) -> int:
    """Transient bytes of transformers' ``batched_mm``: it gathers a bf16 gate_up and a down matrix
    per (token, slot) pair."""
    return tokens * shape.top_k * shape.bf16_bytes_per_expert()


def _imbalance(stats: dict) -> float | None:
    """max / mean busy time over threads, for the worse of the kernels' two stages."""
    worst = None
    for key in ("busy1", "busy2"):
        busy = [b for b in stats.get(key, [])]
        if len(busy) > 1 and sum(busy) > 0:
            v = max(busy) / (sum(busy) / len(busy))
            worst = v if worst is None else max(worst, v)
    return worst


def _bench_shape(shape: Shape, config: BenchConfig, specs: dict, machine: dict, say,
                 tokens: Sequence[int], routings: Sequence[bool] = (False,)) -> list[Row]:
    from moelab.kernels.backend import packed_for

    probe = _probe_array(config.bandwidth_mib)  # before the experts are sized to the memory left
    e = _fit_experts(shape, config.dtypes, config.memory_fraction)
    if e < shape.experts:
        logger.warning("shape %s: using E=%d experts (memory); per-token work is unchanged", shape, e)
    say(f"shape {shape}: building E={e} bf16 experts and packing {', '.join(specs)}")
    mod = _experts_module(shape, e)
    packs = {d: packed_for(mod, spec) for d, spec in specs.items()}
    layer = _Layer(shape, mod, packs, e, probe)
    rows: list[Row] = []
    for t in tokens:
        for skewed in routings:
            rows += _bench_point(layer, config, machine, say, t, skewed)
    return rows


@dataclass
class _Layer:
    """The layer a point is timed on: its transformers module and moelab packs (``experts`` = E used)."""

    shape: Shape
    mod: torch.nn.Module
    packs: dict[str, PackedExperts]
    experts: int
    probe: torch.Tensor
    """The read-bandwidth probe's array (``BenchConfig.bandwidth_mib``), summed before each timed call."""


def _bench_point(layer: _Layer, config: BenchConfig, machine: dict, say, t: int, skewed: bool) -> list[Row]:
    """One (T, routing) point: the built-ins, then every moelab dtype."""
    from moelab.kernels.build import load_extension
    from moelab.kernels.op import moe_experts
    from moelab.kernels.quant import quant_error

    shape, mod, packs, e = layer.shape, layer.mod, layer.packs, layer.experts
    repeat = config.repeat if t <= 16 else max(2, config.repeat // 2)
    r = _Routing(t, e, shape.top_k, skewed)
    x = (torch.randn(t, shape.hidden) * 0.5).to(torch.bfloat16)
    tag = f"T={t}" + (" skewed" if skewed else "")
    base: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for b in config.baselines:
        if b == "batched_mm" and _batched_mm_bytes(shape, t) > 0.5 * _available_bytes():
            skipped[b] = f"needs {_batched_mm_bytes(shape, t) / 2**30:.0f} GiB of gathered weights"
            say(f"  {tag} transformers {b}: skipped ({skipped[b]})")
            continue
        mod.config._experts_implementation = b
        say(f"  {tag} transformers {b}")
        with torch.no_grad():
            base[b] = _median_time(lambda x=x, r=r: mod(x, r.ids, r.w), repeat, r.redraw)
    best = min(base.values()) if base else None
    flops = 2 * 3 * shape.hidden * shape.intermediate * t * shape.top_k
    ext = load_extension()
    rows: list[Row] = []
    for d, packed in packs.items():
        say(f"  {tag} moelab {d}")
        used: list[int] = []
        imb: list[float] = []

        def fn(p: PackedExperts = packed, used: list[int] = used, imb: list[float] = imb, r: _Routing = r,
               x: torch.Tensor = x) -> None:
            used.append(int(torch.unique(r.ids).numel()))
            moe_experts(x, r.ids, r.w, p)
            v = _imbalance(ext.last_call_stats())
            if v is not None:
                imb.append(v)

        probe_s: list[float] = []

        def setup(r: _Routing = r, probe: torch.Tensor = layer.probe, probe_s: list[float] = probe_s) -> None:
            r.redraw()
            probe_s.append(_timed(probe.sum))

        m = _measure(fn, repeat, setup)
        sec = m.median
        read_here = _read_gbps(layer.probe, min(probe_s))
        gbps = sorted(used)[len(used) // 2] * packed.expert_nbytes() / sec / 1e9
        err = None
        if "bf16" in packs and d != "bf16":
            ref = moe_experts(x, r.ids, r.w, packs["bf16"])
            err = quant_error(moe_experts(x, r.ids, r.w, packed), ref).rel_fro
        gflops = flops / sec / 1e9
        peak = machine.get("fma_peak_gflops")
        rows.append(Row(
            shape=str(shape), experts_used=e, dtype=d, tokens=t, ms=sec * 1e3, gbps=gbps,
            pct_read_bw=100 * gbps / read_here, baseline_ms={k: v * 1e3 for k, v in base.items()},
            read_gbps=read_here, pct_read_bw_opening=100 * gbps / machine["read_gbps"],
            speedup_vs_best=(best / sec) if best else None, rel_err_vs_bf16=err, spread=m.spread,
            isa=machine["isa"], routing="skewed" if skewed else "uniform", gflops=gflops,
            pct_peak=100 * gflops / peak if peak and t >= GFLOPS_MIN_TOKENS else None,
            imbalance=sorted(imb)[len(imb) // 2] if imb else None, baseline_skipped=skipped,
        ))
    return rows


def run_bench(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark; returns ``{"machine": {...}, "rows": [...]}``."""
    from moelab.kernels.build import ISA_CODES, active_isa, load_extension
    from moelab.kernels.packing import KernelSpec

    say = progress or (lambda s: logger.info("%s", s))
    for b in config.baselines:
        if b not in BASELINES:
            raise unknown_name("baseline", b, BASELINES)
    shapes = [Shape.parse(s) for s in ([PREFILL_SHAPE] if config.prefill else config.shapes)]
    specs = {  # validates names
        d: KernelSpec(d, config.group_size, block=tuple(config.fp8_block)) for d in config.dtypes
    }
    torch.manual_seed(0)
    say("measuring memory bandwidth")
    _BUSY.clear()
    bw = memory_bandwidth(config.bandwidth_mib)
    isa = active_isa()
    say(f"measuring the FMA peak ({isa}, {torch.get_num_threads()} threads)")
    machine = {
        **bw, "threads": torch.get_num_threads(), "isa": isa,
        "fma_peak_gflops": load_extension().fma_peak_gflops(ISA_CODES[isa], torch.get_num_threads()),
        "torch": torch.__version__, "group_size": config.group_size,
        "fp8_block": list(config.fp8_block), "prefill": config.prefill,
        # what the built-ins may run on: ATen's vectorised kernels and oneDNN's cap (unset: its best,
        # AMX where present); `moelab bench kernels --emulate` sets both with moelab's own path
        "builtin_isa": {"aten": torch.backends.cpu.get_cpu_capability(),
                        "onednn_max": os.environ.get("ONEDNN_MAX_CPU_ISA", "")},
    }
    say(f"timing a tiny layer's call ({OVERHEAD_SHAPE}, batch 1)")
    machine["call_overhead_us"] = call_overhead()
    rows: list[Row] = []
    for shape in shapes:
        if config.prefill:
            rows += _bench_shape(shape, config, specs, machine, say, PREFILL_TOKENS, (False, True))
        else:
            rows += _bench_shape(shape, config, specs, machine, say, config.tokens)
    reasons = sorted(set(_BUSY + ([bw["busy_reason"]] if bw["busy"] else [])))
    machine.update(busy=bool(reasons), busy_reason=(reasons[0] + (f" (and {len(reasons) - 1} more timings flagged)"
                                                                 if len(reasons) > 1 else "")) if reasons else "")
    return {"machine": machine, "rows": [asdict(r) for r in rows]}


def format_table(result: dict) -> str:
    """The human-readable table of :func:`run_bench`'s result."""
    m = result["machine"]
    lines = [
        f"read bandwidth {m['read_gbps']:.1f} GB/s, copy {m['copy_gbps']:.1f} GB/s; "
        f"{m['threads']} threads; ISA {m['isa']}"
        + (f" ({'AMX bf16 tile' if m['isa'] == 'amx' else 'FMA'} peak {m['fma_peak_gflops']:.0f} GFLOP/s)"
           if m.get("fma_peak_gflops") else "")
        + f"; torch {m['torch']}; int group {m['group_size']}"
        + (f"; fp8 block {m['fp8_block'][0]}x{m['fp8_block'][1]}" if "fp8_block" in m else "")
        + (f"; built-ins on ATen {b['aten']}, oneDNN " + (f"capped at {b['onednn_max']}" if b["onednn_max"]
                                                         else "uncapped (AMX where present)")
           if (b := m.get("builtin_isa")) else ""),
        (f"machine load {m['load']['load1']:.1f} on {m['load']['cpus']} CPUs when measured"
         + (f", {m['load']['own']:.1f} of it this bench" if m["load"].get("own") is not None else ""))
        if m.get("load", {}).get("load1") is not None else "machine load unknown",
    ]
    if m.get("call_overhead_us"):
        lines.append(f"per-call cost on a {OVERHEAD_SHAPE} bf16 layer, batch 1 (median µs ± spread): "
                     + ", ".join(f"{k} {us:.1f} ±{sp:.0%}" for k, (us, sp) in m["call_overhead_us"].items()))
    if m.get("busy"):
        lines.append(f"WARNING — measured on a busy machine, figures are not meaningful: {m['busy_reason']}")
    base_names = sorted({k for r in result["rows"] for k in (*r["baseline_ms"], *r.get("baseline_skipped", {}))})
    skew = any(r.get("routing", "uniform") != "uniform" for r in result["rows"])
    head = f"{'shape HxIxExK':<17}{'E':>4} {'dtype':<6}{'T':>5}" + (f"{'route':>8}" if skew else "")
    head += f"{'ms':>10}{'±':>5}{'GB/s':>8}{'%read':>7}{'GFLOP/s':>9}{'%peak':>7}{'imbal':>7}"
    head += "".join(f"{b + ' ms':>15}" for b in base_names) + f"{'speedup':>9}{'err vs bf16':>13}"
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        s = f"{r['shape']:<17}{r['experts_used']:>4} {r['dtype']:<6}{r['tokens']:>5}"
        s += f"{r.get('routing', 'uniform'):>8}" if skew else ""
        s += f"{r['ms']:>10.3f}"
        s += f"{r['spread']:>4.0%} " if r.get("spread") is not None else f"{'':>5}"
        s += f"{r['gbps']:>8.1f}{r['pct_read_bw']:>6.0f}%"
        s += f"{r['gflops']:>9.1f}" if r.get("gflops") else f"{'':>9}"
        s += f"{r['pct_peak']:>6.0f}%" if r.get("pct_peak") is not None else f"{'':>7}"
        s += f"{r['imbalance']:>7.2f}" if r.get("imbalance") is not None else f"{'':>7}"
        s += "".join(f"{r['baseline_ms'][b]:>15.3f}" if b in r["baseline_ms"] else f"{'skipped':>15}"
                     for b in base_names)
        s += f"{r['speedup_vs_best']:>8.2f}x" if r["speedup_vs_best"] else f"{'':>9}"
        s += f"{r['rel_err_vs_bf16']:>13.2e}" if r["rel_err_vs_bf16"] is not None else f"{'':>13}"
        lines.append(s)
    skipped = sorted({f"{b} at T={r['tokens']} ({why})" for r in result["rows"]
                      for b, why in r.get("baseline_skipped", {}).items()})
    if skipped:
        lines.append("built-ins skipped: " + "; ".join(skipped))
    lines.append("ms = median of the repeats, ± its spread; %read = GB/s / the read bandwidth probed between that "
                 "row's timed calls (best of its probes; the header's is the run's opening probe); "
                 "speedup = fastest transformers built-in (bf16) that ran / moelab; %peak = GFLOP/s / measured "
                 "FMA peak (T ≥ 64); imbal = max/mean per-thread busy time of the worse kernel stage; "
                 "err = relative Frobenius error of the layer output vs moelab bf16.")
    return "\n".join(lines)
