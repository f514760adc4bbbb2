"""``moelab calibrate --out PROFILE``: measure this machine and write a hardware profile for the simulator.

Every timed call is **warm**: ``WARMUP`` untimed calls first (the first calls of a fresh module
were 10^2-10^4× slower: allocation, packing, page faults), then the median of at least ``repeat``
timed calls (cheap ones repeated for ~0.3 s). Fixed per-call costs are not read off one tiny call
but **fitted**: ``time = fixed [+ per expert × experts] + bytes / rate`` by least squares weighted
by 1/time (every point's relative error counts alike) with no negative term, over calls of the
kinds the real executor makes, at sizes from a tiny model's to DeepSeek-V2-Lite's; each point's
residual is kept in the raw measurements and the fit's median and largest residual in the
provenance.

==========================  ===============================================================
measurement                 fields
==========================  ===============================================================
memory read (``sum`` over   ``numa_node_bandwidth_gbs``, ``cpu_memory_bandwidth_gbs``
``memory_mib``, all threads)
host experts calls          ``cpu_call_us`` (the fit's intercept),
(``--host-backend``) on a   ``cpu_dispatch_us`` (per expert), ``cpu_memory_efficiency``
lane thread, bf16, sizes ×  (per-byte rate over the read bandwidth); ``cpu_peak_tflops``
batches 1 and 4             (best FLOP/s, with the kernel table at ``batches``)
device experts calls        ``gpu_call_us`` (the fit's intercept),
(``--device-backend``, the  ``gpu_kernels_per_expert`` (per-expert term, in launches),
CPU worker standing in for  ``gpu_memory_bandwidth_gbs`` (per-byte rate; efficiency 1),
the device) on a lane       ``gpu_peak_tflops``
thread
the control thread's dense  ``gpu_kernels_per_attention`` (intercept, in launches),
work: a transformers        ``gpu_dense_efficiency`` (its per-byte rate over the device
decoder layer at decode     experts' rate)
(norms, attention over a
KV cache, router), hidden ×
context
torch op launch (a 1-elem.  ``gpu_launch_us``
add)
empty task through a lane   ``runtime_call_us`` (the round trip: moelab's executor's
thread (submit → result)    hand-off of one lane call; ``sync_us`` is 0: no device here)
the real executor on a      ``runtime_layer_us`` (its control thread's ``plan`` +
tiny random model           ``dispatch`` events per MoE layer, median)
copy of one expert into a   ``link_bandwidth_gbs`` (large copies), ``link_latency_us``
preallocated pool (as the   (a 4 KiB copy)
real executor's copy lane)
==========================  ===============================================================

Fixed by what this machine is: ``device_shares_host_memory: true`` (no GPU: a CPU worker
stands in for the device, and the simulator has the lanes time-share ``cpu_cores``),
``copy_engines: 1`` (one copy lane), ``numa_nodes`` and ``cpu_cores`` from the OS. Every
field's provenance says ``stated: measured by moelab calibrate on HOST at DATE (...)`` with
what was measured, or ``assumed:`` with why for the two fields it cannot measure
(``decode_layer_time_us`` and ``attention_fraction``, estimated from the fits for a
DeepSeek-V2-Lite layer).

**Trust.** Calibration refuses to start, or to return what it measured, on a busy machine (other
work's load per CPU above :data:`moelab.measure.MAX_LOAD_PER_CPU` before or after, or the timed
series' median spread above :data:`moelab.measure.MAX_SPREAD`); ``allow_busy`` writes every value
flagged ``BUSY MACHINE``. Every value is checked against its physical bounds and every fit for a
dropped (negative) term or a poor R² (:mod:`moelab.simulate.bounds`) before anything is written;
``allow_out_of_bounds`` writes them marked ``OUT OF BOUNDS``. The two ``runtime_*`` fields make the
profile predict *moelab's executor on this machine*; :func:`moelab.simulate.runtime.hardware_only`
gives the hardware alone.

The profile YAML is written atomically (a temporary file renamed into place), and the raw
measurements beside it (``PROFILE.raw.json``: every point, the fits and their residuals, the
load average).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moelab.errors import MoelabError
from moelab.measure import (
    MAX_SPREAD,
    BusyMachineError,
    busy_reason,
    machine_load,
    require_quiet,
    spread_of,
)
from moelab.simulate.bounds import OutOfBoundsError, check_bounds, check_fit, enforce
from moelab.simulate.runtime import measure_executor_overhead
from moelab.timing import parse_profile

log = logging.getLogger(__name__)

HIDDEN, INTER = 2048, 1408  # DeepSeek-V2-Lite's routed expert
TOP_K = 6
CALL_SIZES = ((64, 64), (256, 176), (512, 352), (1024, 704), (2048, 1408))
"""Expert shapes (hidden, intermediate) of the per-call fits: from a bundled tiny model's to
DeepSeek-V2-Lite's, so the fit's fixed cost is pinned by calls whose bytes cost nothing."""
BATCHES = (1, 4, 16, 64)
DTYPES = ("fp32", "bf16")


@dataclass
class CalibrateConfig:
    repeat: int = 5
    experts: int = 16
    """Experts in the measured layer (the decode reads ``TOP_K`` distinct ones per token)."""
    host_backend: str = "moelab"
    device_backend: str = "reference"
    memory_mib: int = 256
    batches: tuple[int, ...] = BATCHES
    dtypes: tuple[str, ...] = DTYPES
    call_sizes: tuple[tuple[int, int], ...] = CALL_SIZES
    """Expert shapes of the host per-call fit."""
    device_call_sizes: tuple[tuple[int, int], ...] = CALL_SIZES
    """Expert shapes of the device per-call fit (the torch reference backend is slow at full size)."""
    call_tokens: tuple[int, ...] = (1, 4)
    """Batches of the per-call fits (more tokens: more distinct experts per call, one token each)."""
    dense_sizes: tuple[int, ...] = (64, 256, 1024)
    """Hidden sizes of the dense-work fit (a transformers decoder layer at decode)."""
    dense_contexts: tuple[int, ...] = (16, 256)
    """Contexts (cached tokens) of the dense-work fit."""

    def quick(self) -> CalibrateConfig:
        """``--quick``'s settings (about half a minute): fewer repeats, batches and dtypes."""
        self.repeat = min(self.repeat, 3)
        self.batches, self.dtypes, self.memory_mib = (), ("bf16",), 128
        return self
    expert_hidden: int = HIDDEN
    expert_intermediate: int = INTER
    """The measured experts' shape (default DeepSeek-V2-Lite's routed expert)."""


WARMUP = 2
"""Untimed calls before every timed series: the first calls of a fresh module or kernel are
10^2-10^4× slower (allocation, packing, page faults, lazy initialisation) and are not what a
decode step pays."""


def _median(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None,
            warmup: int = WARMUP, budget_s: float = 0.0, max_calls: int = 200) -> float:
    """Median seconds of ``fn`` over at least ``repeat`` timed runs after ``warmup`` untimed ones
    (``setup`` untimed before each); cheap calls are repeated until ``budget_s`` of timed calls (at
    most ``max_calls``), so a median of microseconds is not three samples of a busy machine's noise."""
    times: list[float] = []
    try:
        return _timed(fn, repeat, setup, warmup, budget_s, max_calls, times)
    finally:
        if _SERIES is not None and times:
            _SERIES.append(spread_of(times))


#: spreads of the timed series of the calibration under way (``calibrate`` sets and clears it): a
#: loaded machine shows as repeated measurements that disagree
_SERIES: list[float] | None = None


def _timed(fn, repeat, setup, warmup, budget_s, max_calls, times: list[float]) -> float:
    for i in range(warmup + max(repeat, max_calls)):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            if len(times) >= repeat and sum(times) >= budget_s:
                break
    return statistics.median(times)


def _on_lane(measure: Callable[[], object], name: str = "calibrate"):
    """Run ``measure`` on a fresh :class:`moelab.hybrid.real.Lane` thread (where the real
    executor's device and host calls run) and return its result."""
    from moelab.hybrid.events import EventLog
    from moelab.hybrid.lanes import Lane

    lane = Lane(name, EventLog(name), timed=False)
    try:
        return lane.submit(measure, step=0, layer=0, kind="x").result()
    finally:
        lane.close()


def _coef_se(A, b, c) -> list[float]:
    """Standard errors of least-squares coefficients ``c`` of ``A c ≈ b``: σ² (AᵀA)⁻¹ with σ² the
    residual sum of squares over n - p (inf where there are no spare points or AᵀA is singular)."""
    import numpy as np

    n, p = A.shape
    if n <= p:
        return [float("inf")] * p
    sigma2 = float(np.sum((A @ c - b) ** 2)) / (n - p)
    try:
        cov = sigma2 * np.linalg.inv(A.T @ A)
    except np.linalg.LinAlgError:
        return [float("inf")] * p
    return [float(np.sqrt(max(v, 0.0))) for v in np.diag(cov)]


def fit_fixed_per_byte(points: list[dict], x: str = "bytes", y: str = "us",
                       extra: str | None = None) -> dict:
    """Least squares ``y = fixed + us_per_byte × x [+ per_extra × extra]`` over ``points``,
    weighted by ``1 / y`` (the relative error of every point counts alike, so microsecond calls pin
    the fixed cost and the large ones the bandwidth), with no negative coefficient (a term that would
    come out negative is dropped and the rest refitted; ``raw_TERM`` keeps its value,
    ``raw_TERM_se`` its standard error and ``raw_TERM_max_pct`` the most it took off a point, in %
    of that point's time). Returns the coefficients (``fixed_us``,
    ``bytes_per_us``, ``per_extra_us``) and each point's residual (µs and % of the measured time)."""
    import numpy as np

    cols = [np.ones(len(points)), np.array([p[x] for p in points], dtype=np.float64)]
    if extra:
        cols.append(np.array([p[extra] for p in points], dtype=np.float64))
    A = np.column_stack(cols)
    b = np.array([p[y] for p in points], dtype=np.float64)
    w = 1.0 / np.maximum(b, 1e-9)
    keep = list(range(A.shape[1]))
    coef = np.zeros(A.shape[1])
    names = ["fixed", "bytes", "per_extra"][: A.shape[1]]
    dropped: list[str] = []
    raw: dict[str, float] = {}
    while keep:
        c, *_ = np.linalg.lstsq(A[:, keep] * w[:, None], b * w, rcond=None)
        if (c >= 0).all():
            coef[:] = 0.0
            coef[keep] = c
            break
        worst = int(np.argmin(c))
        term = names[keep[worst]]
        dropped.append(term)  # negative: dropped (bounds.check_fit flags it unless a zero within noise)
        raw[f"raw_{term}"] = float(c[worst])
        # what check_fit weighs: the most it took off any point, in % of that point's time, and its
        # standard error (weighted residuals over n - p degrees of freedom)
        raw[f"raw_{term}_max_pct"] = float(np.max(np.abs(c[worst] * A[:, keep[worst]]) / np.maximum(b, 1e-9)) * 100)
        raw[f"raw_{term}_se"] = _coef_se(A[:, keep] * w[:, None], b * w, c)[worst]
        keep.pop(worst)
    pred = A @ coef
    slope = float(coef[1])
    res = [{**p, "fit_us": float(f), "residual_us": float(m - f),
            "residual_pct": float(100 * (f / m - 1)) if m > 0 else 0.0} for p, f, m in zip(points, pred, b)]
    return {"fixed_us": float(coef[0]), "bytes_per_us": (1 / slope) if slope > 0 else float("inf"),
            "us_per_byte": slope, "per_extra_us": float(coef[2]) if extra else 0.0, "points": res,
            "dropped": dropped, **raw,
            "max_abs_residual_pct": max((abs(r["residual_pct"]) for r in res), default=0.0),
            "median_abs_residual_pct": float(np.median([abs(r["residual_pct"]) for r in res])) if res else 0.0}


def _experts(dtype, experts: int, hidden: int = HIDDEN, inter: int = INTER):
    import torch
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    cfg = Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=TOP_K)
    with torch.device("meta"):
        mod = Qwen2MoeExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        shape = getattr(mod, name).shape
        p = torch.empty(shape, dtype=dtype)
        for e in range(experts):
            p[e] = (torch.randn(shape[1:], generator=gen) * 0.02).to(dtype)
        setattr(mod, name, torch.nn.Parameter(p, requires_grad=False))
    return mod


class _Routing:
    """``tokens`` × ``k`` expert ids of ``experts`` and their weights, redrawn per timed call. With
    ``one_row``, every expert of a call gets one token (the tokens' experts are disjoint; needs
    ``experts ≥ tokens × k``), as in a decode step's call, where the per-call fits read their
    per-expert term: CPU BLAS prices a second row very differently from the first (torch's bf16
    matmul of a 64×64 expert on an AVX-512 CPU without BF16: 7 µs for one row, 50 µs for two),
    so calls mixing one- and two-row experts fit no ``fixed + per expert`` line."""

    def __init__(self, tokens: int, experts: int, k: int, seed: int = 0, *, one_row: bool = False) -> None:
        import torch

        if one_row and experts < tokens * k:
            raise MoelabError(f"calibrate: {tokens} tokens × top-{k} with one row per expert need ≥ {tokens * k} "
                              f"experts, got {experts}; raise CalibrateConfig.experts or lower call_tokens.")
        self.t, self.e, self.k, self.one_row = tokens, experts, k, one_row
        self.gen = torch.Generator().manual_seed(seed)
        self.redraw()

    def redraw(self) -> None:
        import torch

        if self.one_row:
            self.ids = torch.randperm(self.e, generator=self.gen)[: self.t * self.k].view(self.t, self.k)
        else:
            self.ids = torch.stack([torch.randperm(self.e, generator=self.gen)[: self.k] for _ in range(self.t)])
        self.w = torch.rand(self.t, self.k, generator=self.gen).softmax(-1)


def _kernel_points(backend_name: str, cfg: CalibrateConfig, tick, batches: tuple[int, ...],
                   repeat: int) -> list[dict]:
    """GB/s and FLOP/s of an experts backend by dtype and batch (distinct experts' bytes / time)."""
    import torch

    from moelab.backends import get_backend

    backend = get_backend(backend_name)
    out = []
    for dname in cfg.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
        mod = _experts(dtype, cfg.experts, cfg.expert_hidden, cfg.expert_intermediate)
        ebytes = sum(p.numel() * p.element_size() for p in mod.parameters()) // cfg.experts
        eparams = 3 * cfg.expert_hidden * cfg.expert_intermediate
        for t in batches:
            r = _Routing(t, cfg.experts, TOP_K, seed=t)
            x = (torch.randn(t, cfg.expert_hidden, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype)
            used: list[int] = []

            def fn(r=r, x=x, used=used, mod=mod):
                used.append(int(torch.unique(r.ids).numel()))
                with torch.no_grad():
                    backend(mod, x, r.ids, r.w)

            sec = _median(fn, repeat, r.redraw)
            distinct = statistics.median(used)
            out.append({"backend": backend_name, "dtype": dname, "batch": t, "seconds": sec,
                        "distinct_experts": distinct, "expert_bytes": ebytes,
                        "gbps": distinct * ebytes / sec / 1e9, "tflops": 2 * eparams * t * TOP_K / sec / 1e12})
            tick()
        del mod
    return out


def _call_points(backend_name: str, sizes, tokens: tuple[int, ...], repeat: int, experts: int,
                 tick=lambda: None, lane: int = 0) -> list[dict]:
    """One experts-backend call (bf16, ``TOP_K`` of ``experts`` experts per token, every expert one
    token as at decode: at least ``tokens × TOP_K`` experts) per size and batch, timed on a lane
    thread as the real executor's device/host lanes call it (a native backend's on the extension's
    C++ lane worker ``lane``: 0 host, 1 device, the executor's own): µs, distinct experts read and
    their bytes."""
    import torch

    from moelab.backends import get_backend
    from moelab.hybrid.lanes import native_lane_ok

    backend = get_backend(backend_name)
    native = native_lane_ok(backend)
    experts = max(experts, max(tokens, default=1) * TOP_K)  # one row per expert (_Routing)
    out = []
    for h, i in sizes:
        mod = _experts(torch.bfloat16, experts, h, i)
        ebytes = sum(p.numel() * p.element_size() for p in mod.parameters()) // experts
        for t in tokens:
            r = _Routing(t, experts, TOP_K, seed=17 * t + h, one_row=True)
            x = (torch.randn(t, h, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16)

            def measure(r=r, x=x, mod=mod):
                # a native backend's calls run on the extension's C++ lane worker, as the real
                # executor queues them, timed by the worker's own clock (its start and end): the
                # hand-off (runtime_call_us) and a waking thread's latency stay out of the call
                used: list[int] = []
                worker: list[float] = []

                def fn():
                    used.append(int(torch.unique(r.ids).numel()))
                    with torch.no_grad():
                        if not native:
                            backend(mod, x, r.ids, r.w)
                            return
                        call = backend.submit(mod, x, r.ids, r.w, None, lane=lane)
                        call.result()
                    _, start, end = call.times_ns()
                    worker.append((end - start) / 1e9)

                sec = _median(fn, repeat, r.redraw, budget_s=0.3)
                return statistics.median(worker[WARMUP:]) if native else sec, statistics.mean(used[WARMUP:])

            sec, distinct = measure() if native else _on_lane(measure)
            out.append({"backend": backend_name, "hidden": h, "intermediate": i, "tokens": t,
                        "distinct": distinct, "bytes": distinct * ebytes, "us": sec * 1e6})
            tick()
        del mod
    return out


def _dense_points(sizes: tuple[int, ...], contexts: tuple[int, ...], repeat: int, tick=lambda: None) -> list[dict]:
    """The control thread's dense work per decoder layer, as the real executor runs it: a
    transformers decoder layer (norms, attention with rotary embeddings over a ``DynamicCache``
    of ``context`` tokens, router; its experts tiny) at decode (one token), bf16, on this thread.
    µs and bytes read (weights + KV cache)."""
    import torch
    from transformers import DynamicCache, Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import (
        Qwen2MoeDecoderLayer,
        Qwen2MoeRotaryEmbedding,
    )

    from moelab.compat import cache_kwargs

    out = []
    for H in sizes:
        heads = max(H // 64, 1)
        cfg = Qwen2MoeConfig(hidden_size=H, num_attention_heads=heads, num_key_value_heads=heads,
                             moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2,
                             num_experts_per_tok=1, num_hidden_layers=1, intermediate_size=8)
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
        torch.manual_seed(0)
        layer = Qwen2MoeDecoderLayer(cfg, 0).to(torch.bfloat16).eval()
        rot = Qwen2MoeRotaryEmbedding(cfg)
        wbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        for ctx in contexts:
            cache = DynamicCache(config=cfg)
            x = torch.randn(1, ctx, H).to(torch.bfloat16)
            pos = torch.arange(ctx)[None]
            x1 = torch.randn(1, 1, H).to(torch.bfloat16)
            p1 = torch.tensor([[ctx]])
            with torch.no_grad():
                layer(x, position_embeddings=rot(x, pos), **cache_kwargs(cache, layer), position_ids=pos, use_cache=True)
                pe = rot(x1, p1)

                def step(layer=layer, x1=x1, pe=pe, cache=cache, p1=p1):
                    with torch.no_grad():
                        layer(x1, position_embeddings=pe, **cache_kwargs(cache, layer), position_ids=p1, use_cache=True)

                sec = _median(step, repeat, budget_s=0.3)
            out.append({"hidden": H, "context": ctx, "bytes": wbytes + 2 * H * 2 * ctx, "weight_bytes": wbytes,
                        "us": sec * 1e6})
            tick()
    return out


def _memory_read_gbps(mib: int, repeat: int) -> float:
    import torch

    a = torch.ones(mib * 2**20 // 4)
    sec = _median(lambda: a.sum(), repeat, budget_s=0.5)
    return a.numel() * 4 / sec / 1e9


def _launch_us(repeat: int) -> float:
    import torch

    a, b = torch.ones(1), torch.ones(1)
    n = 200
    return _median(lambda: [torch.add(a, b) for _ in range(n)], repeat) / n * 1e6


def _lane_roundtrip_us(repeat: int) -> float:
    from moelab.hybrid.events import EventLog
    from moelab.hybrid.lanes import Lane

    lane = Lane("calibrate", EventLog("calibrate"))
    try:
        n = 100
        return _median(lambda: [lane.submit(lambda: None, step=0, layer=0, kind="x").result() for _ in range(n)],
                       repeat) / n * 1e6
    finally:
        lane.close()


def _copy_points(cfg: CalibrateConfig) -> dict:
    """Copy of one expert (gate/up + down, bf16) into a preallocated pool slot, and of 4 KiB."""
    import torch

    mod = _experts(torch.bfloat16, 4, cfg.expert_hidden, cfg.expert_intermediate)
    pool_gu = torch.zeros((2, *mod.gate_up_proj.shape[1:]), dtype=torch.bfloat16)  # touched: no page faults
    pool_dn = torch.zeros((2, *mod.down_proj.shape[1:]), dtype=torch.bfloat16)
    state = {"e": 0}

    def nxt():
        state["e"] = (state["e"] + 1) % 4

    def copy():
        e = state["e"]
        pool_gu[e % 2].copy_(mod.gate_up_proj[e])
        pool_dn[e % 2].copy_(mod.down_proj[e])

    big = _median(copy, cfg.repeat, nxt)
    ebytes = (mod.gate_up_proj[0].numel() + mod.down_proj[0].numel()) * 2
    src, dst = torch.ones(1024), torch.empty(1024)
    small = _median(lambda: dst.copy_(src), cfg.repeat * 10)
    return {"expert_bytes": ebytes, "expert_seconds": big, "small_bytes": 4096, "small_seconds": small}


def _host_memory_gb() -> float:
    """This machine's memory (GB, 10^9 bytes) from /proc/meminfo, or from the page count elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(len(nodes), 1)


def calibrate(cfg: CalibrateConfig | None = None, *, progress: bool = True, allow_busy: bool = False,
              allow_out_of_bounds: bool = False) -> tuple[dict, dict]:
    """Measure this machine; returns (profile file data, raw measurements).

    Refuses (:class:`~moelab.measure.BusyMachineError`) to start, or to return what it measured, when
    other work loads the machine (the load average less this process's own, before and after) or the
    repeated measurements spread more than ``MAX_SPREAD`` (median over the timed series); with
    ``allow_busy`` every field's provenance says BUSY and why. Every value is checked against its
    physical bounds and every fit for a negative term or a poor R² (:mod:`moelab.simulate.bounds`):
    :class:`~moelab.simulate.bounds.OutOfBoundsError` names each, unless ``allow_out_of_bounds``
    (then the provenance says OUT OF BOUNDS).

    Size: long: a sequence of measurements read top to bottom, each a few lines feeding the profile under
    construction; split, the pieces would pass that profile around.
    """
    import torch
    from tqdm.auto import tqdm

    global _SERIES
    cfg = cfg or CalibrateConfig()
    if cfg.repeat < 1:
        raise MoelabError(f"repeat must be ≥ 1, got {cfg.repeat}.")
    load_before, busy_before = require_quiet("calibrate", allow_busy=allow_busy)
    n_calls = len(cfg.call_tokens) * (len(cfg.call_sizes) + len(cfg.device_call_sizes))
    steps = 5 + len(cfg.dtypes) * len(cfg.batches) + n_calls + len(cfg.dense_sizes) * len(cfg.dense_contexts)
    bar = tqdm(total=steps, desc="calibrate", disable=not progress, unit="step")

    def tick(what: str = ""):
        bar.update(1)
        if what:
            bar.set_postfix_str(what)

    _SERIES = []
    try:
        read = _memory_read_gbps(cfg.memory_mib, cfg.repeat)
        tick("memory")
        launch = _launch_us(cfg.repeat)
        tick("launch")
        lane_rt = _lane_roundtrip_us(cfg.repeat)
        tick("lane")
        copy = _copy_points(cfg)
        tick("copy")
        host = (_kernel_points(cfg.host_backend, cfg, lambda: tick("host kernels"), cfg.batches, cfg.repeat)
                if cfg.batches else [])
        host_calls = _call_points(cfg.host_backend, cfg.call_sizes, cfg.call_tokens, cfg.repeat, cfg.experts,
                                  lambda: tick("host calls"))
        # the device stand-in's torch reference backend takes ~0.1 s a call at full size: fewer repeats
        dev_calls = _call_points(cfg.device_backend, cfg.device_call_sizes, cfg.call_tokens,
                                 max(min(cfg.repeat, 3), 1), cfg.experts, lambda: tick("device calls"), lane=1)
        dense = _dense_points(cfg.dense_sizes, cfg.dense_contexts, cfg.repeat, lambda: tick("dense"))
        runtime = measure_executor_overhead(host_backend=cfg.host_backend, device_backend=cfg.device_backend,
                                            steps=max(cfg.repeat, 4))
        tick("executor")
        series = list(_SERIES)
    finally:
        bar.close()
        _SERIES = None
    load_after = machine_load()

    link_gbs = copy["expert_bytes"] / copy["expert_seconds"] / 1e9
    link_lat = max(copy["small_seconds"] * 1e6 - copy["small_bytes"] / (link_gbs * 1e3), 0.0)
    # fixed + per-expert + per-byte fits (least squares over sizes and batches)
    hfit = fit_fixed_per_byte(host_calls, extra="distinct")
    dfit = fit_fixed_per_byte(dev_calls, extra="distinct")
    nfit = fit_fixed_per_byte(dense)
    launch_eff = max(launch, 0.1)
    dev_gbs = max(dfit["bytes_per_us"] / 1e3, 1e-3) if dfit["us_per_byte"] > 0 else 1e3
    host_gbs = hfit["bytes_per_us"] / 1e3 if hfit["us_per_byte"] > 0 else read
    dense_gbs = nfit["bytes_per_us"] / 1e3 if nfit["us_per_byte"] > 0 else dev_gbs
    k_expert = max(int(round(max(dfit["per_extra_us"], 0.0) / launch_eff)), 1)
    k_attn = max(int(round(max(nfit["fixed_us"], 0.0) / launch_eff)), 1)
    # the hardware's fixed cost of a call; the hand-off to the lane thread is moelab's executor's (runtime_call_us)
    gpu_call = max(dfit["fixed_us"], 0.0)
    cpu_call = max(hfit["fixed_us"], 0.0)
    cpu_per_expert = max(hfit["per_extra_us"], 0.0)
    dense_eff = dense_gbs / dev_gbs
    # a kernel cannot read faster than memory: when the fitted experts kernel beats the `sum` read (one
    # noisy microbenchmark; it read 8-27 GB/s across calibrations here), the kernel's rate is the bandwidth
    read_measured = read
    read = max(read, host_gbs if math.isfinite(host_gbs) else read)
    cpu_eff = min(max(host_gbs / read, 0.01), 1.0)

    def flops(r):
        return 2 * 3 * r["hidden"] * r["intermediate"] * r["tokens"] * TOP_K / (r["us"] * 1e-6) / 1e12

    cpu_peak = max([r["tflops"] for r in host] + [flops(r) for r in host_calls])
    if not host:  # --quick: the batch-1 row of the calls stands in for the kernel table
        host = [{"backend": r["backend"], "dtype": "bf16", "batch": r["tokens"], "seconds": r["us"] * 1e-6,
                 "gbps": r["bytes"] / r["us"] / 1e3, "tflops": flops(r)} for r in host_calls
                if (r["hidden"], r["intermediate"]) == (cfg.expert_hidden, cfg.expert_intermediate)]
    dev_peak = max(flops(r) for r in dev_calls)
    # a DeepSeek-V2-Lite-shaped decode layer from the fits: its dense work (a hidden-2048 layer's ~34 MB
    # of non-expert weights) and the top-6 experts in one host call at batch 1
    ebytes = 3 * cfg.expert_hidden * cfg.expert_intermediate * 2
    att_us = max(nfit["fixed_us"], 0.0) + 34e6 / (dense_gbs * 1e3)
    expert_us = cpu_call + TOP_K * (cpu_per_expert + ebytes / (host_gbs * 1e3))
    layer_us = att_us + expert_us
    host_name = socket.gethostname()
    date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%MZ")
    src = (f"measured by moelab calibrate on {host_name} at {date} ({WARMUP} warm-up + {cfg.repeat} timed "
           "calls, median)")

    def stated(value, how):
        return {"value": value, "stated": f"{src}: {how}"}

    def fit_note(f, what):
        return (f"weighted least squares over {len(f['points'])} {what}; residuals: median "
                f"{f['median_abs_residual_pct']:.0f} %, largest {f['max_abs_residual_pct']:.0f} % of a point's time")

    profile = {
        "name": "this-machine",
        "description": f"{host_name}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU "
                       f"(a CPU worker stands in for the device); torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads.",
        "link_bandwidth_gbs": stated(round(link_gbs, 3), "copy of one bf16 DeepSeek-V2-Lite expert into a "
                                                         "preallocated pool slot"),
        "link_latency_us": stated(round(link_lat, 3), "a 4 KiB copy, less its bytes at the link bandwidth"),
        "gpu_memory_bandwidth_gbs": stated(round(dev_gbs, 3), f"per-byte slope of {cfg.device_backend} experts "
                                                              "calls on a lane thread, "
                                                              + fit_note(dfit, "calls (bf16, sizes × batches)")),
        "cpu_memory_bandwidth_gbs": stated(round(read, 3), f"sum over {cfg.memory_mib} MiB fp32, all threads "
                                                           f"({read_measured:.2f} GB/s), or the host experts "
                                                           "kernel's fitted rate where that is higher"),
        "cpu_cores": stated(int(os.cpu_count() or 1), "os.cpu_count()"),
        "decode_layer_time_us": {"value": round(layer_us, 3), "assumed": (
            f"estimated from the fits ({src}): the dense work of a hidden-2048 layer + {TOP_K} host experts "
            "of a DeepSeek-V2-Lite-shaped layer in one call at batch 1, one after the other")},
        "attention_fraction": {"value": round(min(max(att_us / layer_us, 0.0), 1.0), 4), "assumed": (
            "the dense work's share of that estimated layer")},
        "gpu_peak_tflops": stated(round(max(dev_peak, 1e-6), 6), f"{cfg.device_backend} experts calls, best "
                                                                 "FLOP/s"),
        "gpu_memory_efficiency": stated(1.0, "the device bandwidth above is what the kernel reaches"),
        "gpu_compute_efficiency": stated(1.0, "the device peak above is what the kernel reaches"),
        "gpu_dense_efficiency": stated(round(dense_eff, 6), f"per-byte slope of a transformers decoder layer's "
                                                           f"dense work at decode ({dense_gbs:.2f} GB/s, "
                                                           + fit_note(nfit, "points (hidden × context)")
                                                           + ") over the device experts' GB/s"),
        "gpu_launch_us": stated(round(launch, 3), "a 1-element torch.add on the CPU"),
        "gpu_kernels_per_attention": stated(k_attn, f"fixed cost of that decoder layer's dense work "
                                                    f"({nfit['fixed_us']:.0f} µs, the fit's intercept), in launches"),
        "gpu_kernels_per_expert": stated(k_expert, f"per-expert fixed cost of {cfg.device_backend} experts calls "
                                                   f"({dfit['per_extra_us']:.1f} µs, the fit's per-expert term), "
                                                   "in launches"),
        "gpu_call_us": stated(round(gpu_call, 3), f"fixed cost of one {cfg.device_backend} experts call on a lane "
                                                  "thread (the fit's intercept; the hand-off to the lane is "
                                                  "runtime_call_us)"),
        "cpu_peak_tflops": stated(round(max(cpu_peak, 1e-6), 6), f"{cfg.host_backend} experts backend, best "
                                                                 "FLOP/s over dtypes and batches"),
        "cpu_memory_efficiency": stated(round(cpu_eff, 4), f"per-byte slope of {cfg.host_backend} experts calls "
                                                           f"on a lane thread ({host_gbs:.2f} GB/s of {read:.2f}; "
                                                           + fit_note(hfit, "calls (bf16, sizes × batches)")
                                                           + ")"),
        "numa_nodes": stated(_numa_nodes(), "/sys/devices/system/node"),
        "numa_node_bandwidth_gbs": stated(round(read / _numa_nodes(), 3), "the read bandwidth per NUMA node"),
        "cpu_dispatch_us": stated(round(cpu_per_expert, 3), f"per-expert fixed cost of {cfg.host_backend} "
                                                            "experts calls (the fit's per-expert term)"),
        "cpu_call_us": stated(round(cpu_call, 3), f"fixed cost of one {cfg.host_backend} experts call on a lane "
                                                  "thread (the fit's intercept; the hand-off to the lane is "
                                                  "runtime_call_us)"),
        "sync_us": stated(0.0, "no device here: the control thread reads a result from memory; handing results "
                               "between threads is moelab's executor's cost (runtime_call_us)"),
        "copy_engines": stated(1, "the real executor has one copy lane"),
        "device_shares_host_memory": stated(True, "no GPU here: the device lane is a CPU worker"),
        "link_efficiency": stated(1.0, "link_bandwidth_gbs above is what copies reached"),
        "host_memory_gb": stated(round(_host_memory_gb(), 1), "MemTotal of /proc/meminfo"),
        "gpu_memory_gb": stated(round(_host_memory_gb(), 1), "no GPU here: the device lane's experts live in host "
                                                             "memory (MemTotal of /proc/meminfo)"),
        # runtime overhead (calibrated): moelab's executor on this machine, beyond the hardware
        "runtime_layer_us": stated(round(runtime["layer_us"], 3), (
            "the real executor's control-thread plan + dispatch events per MoE layer (median of "
            f"{len(runtime['points'])} layer-steps, spread ±{runtime['spread']:.0%}) on a tiny random model "
            f"({runtime['moe_layers']} MoE layers, hidden 32; host-misses, capacity 0.25, 1 deferred)")),
        "runtime_call_us": stated(round(lane_rt, 3), "round trip of an empty task through a lane thread (the "
                                                     "real executor's Lane: submit, wake-up, result back)"),
    }
    raw = {
        "host": host_name, "date": date, "repeat": cfg.repeat, "warmup": WARMUP, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "memory_read_gbps": read, "launch_us": launch,
        "lane_roundtrip_us": lane_rt, "copy": copy, "host_kernels": host,
        "fits": {"host_call": hfit, "device_call": dfit, "dense": nfit},
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "note": "timings on a machine shared with other work are slower and noisier than on a quiet one",
        "runtime": runtime,
    }
    return _verdicts(profile, raw, series, load_before, load_after, busy_before, allow_busy=allow_busy,
                     allow_out_of_bounds=allow_out_of_bounds)


def _verdicts(profile: dict, raw: dict, series: list[float], load_before: dict, load_after: dict, busy_before: str,
              *, allow_busy: bool, allow_out_of_bounds: bool) -> tuple[dict, dict]:
    """The load, spread and bounds verdicts on a finished calibration: refused (raises) or flagged."""
    spread = statistics.median(series) if series else 0.0
    reasons = [r for r in (busy_before and f"before: {busy_before}", busy_reason(load_after)
                           and f"after: {busy_reason(load_after)}") if r]
    if spread > MAX_SPREAD:
        reasons.append(f"the repeated measurements spread ±{spread:.0%} (median over {len(series)} timed series; "
                       f"> ±{MAX_SPREAD:.0%})")
    busy = "; ".join(reasons)
    raw.update(load_before=load_before, load_after=load_after, series_spread_median=spread, busy=busy)
    if busy and not allow_busy:
        err = BusyMachineError(f"refusing a calibration measured on a busy machine ({busy}); nothing was written. "
                               "Run it on a quiet machine (stop other work), or pass --allow-busy to write it with "
                               "every value flagged.")
        err.raw = raw  # type: ignore[attr-defined]  # what was measured, for the caller to keep aside
        raise err
    violations = check_bounds(profile) + [v for k, f in raw["fits"].items() for v in check_fit(k, f)]
    raw["out_of_bounds"] = [str(v) for v in violations]
    try:
        profile = enforce(profile, violations, allow=allow_out_of_bounds)
    except OutOfBoundsError as e:
        e.raw = raw  # type: ignore[attr-defined]
        raise
    if busy:  # allowed: every figure says so
        log.warning("moelab calibrate: measured on a busy machine (--allow-busy): %s", busy)
        for k, entry in profile.items():
            if isinstance(entry, dict) and "stated" in entry:
                profile[k] = {"value": entry["value"], "stated": f"BUSY MACHINE (--allow-busy: {busy}): "
                                                                 + entry["stated"]}
        profile["description"] = f"BUSY MACHINE when calibrated ({busy}). " + profile["description"]
    return profile, raw


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_profile(profile: dict, raw: dict, out: str | Path, *, overwrite: bool = False,
                  name: str | None = None) -> Path:
    """Write ``profile`` to ``out`` (YAML) and ``raw`` to ``out``'s ``.raw.json`` sibling, atomically;
    the profile is validated by loading it back before it is put in place."""
    import yaml

    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise MoelabError(f"--out {str(out)!r}: give a .yaml file name (e.g. this-machine.yaml).")
    if out.exists() and not overwrite:
        raise MoelabError(f"{str(out)!r} exists; pass --overwrite to replace it or choose another --out.")
    out.parent.mkdir(parents=True, exist_ok=True)
    profile = dict(profile, name=name or out.stem)
    parse_profile(profile, out)  # refuse to write a profile that would not load
    raw_path = out.with_suffix(".raw.json")
    _atomic_write(raw_path, json.dumps(raw, indent=2, default=float) + "\n")
    header = ("# Written by `moelab calibrate`; every number says how it was measured (schema: "
              "moelab.timing.profile).\n")
    _atomic_write(out, header + yaml.safe_dump(profile, sort_keys=False, allow_unicode=True, width=120))
    return out


def format_summary(profile: dict, raw: dict) -> str:
    lines = [f"calibrated {raw['host']} at {raw['date']} ({raw['warmup']} warm-up + {raw['repeat']} timed calls, "
             f"median; {raw['threads']} threads; load average {raw.get('load_average')})",
             f"  memory read {raw['memory_read_gbps']:.2f} GB/s; copy into pool {profile['link_bandwidth_gbs']['value']:.2f} "
             f"GB/s (+{profile['link_latency_us']['value']:.1f} µs); torch op {raw['launch_us']:.2f} µs; "
             f"lane round trip {raw['lane_roundtrip_us']:.1f} µs",
             f"  load: {_load_text(raw.get('load_before'))} before, {_load_text(raw.get('load_after'))} after; "
             f"repeated measurements spread ±{raw.get('series_spread_median', 0):.0%} (median over the series)"
             + (f" — BUSY: {raw['busy']}" if raw.get("busy") else ""),
             "  host experts kernels (GB/s of distinct experts read / TFLOP/s):"]
    for r in raw["host_kernels"]:
        lines.append(f"    {r['backend']:<12} {r['dtype']:<5} batch {r['batch']:>3}: {r['seconds'] * 1e3:8.2f} ms  "
                     f"{r['gbps']:7.2f} GB/s  {r['tflops']:.4f} TFLOP/s")
    for name, f in raw["fits"].items():
        rate = f["bytes_per_us"] / 1e3
        lines.append(f"  fit {name}: {f['fixed_us']:.1f} µs fixed + {f['per_extra_us']:.1f} µs per expert + bytes at "
                     f"{rate:.2f} GB/s; residuals (% of measured): "
                     + ", ".join(f"{p['residual_pct']:+.0f}" for p in f["points"]))
    keys = ("cpu_call_us", "cpu_dispatch_us", "cpu_memory_efficiency", "gpu_call_us", "gpu_kernels_per_expert",
            "gpu_memory_bandwidth_gbs", "gpu_kernels_per_attention", "gpu_dense_efficiency", "decode_layer_time_us")
    lines.append("  fitted: " + ", ".join(f"{k}={profile[k]['value']}" for k in keys))
    lines.append(f"  moelab's executor (runtime overhead): {profile['runtime_layer_us']['value']} µs per MoE layer, "
                 f"{profile['runtime_call_us']['value']} µs per lane call")
    for v in raw.get("out_of_bounds", []):
        lines.append(f"  OUT OF BOUNDS (written with --allow-out-of-bounds): {v}")
    return "\n".join(lines)


def _load_text(load: dict | None) -> str:
    if not load or load.get("load1") is None:
        return "load unknown"
    return (f"load {load['load1']:.1f} on {load['cpus']} CPUs ({load.get('other', load['load1']):.1f} other "
            "work)")


__all__ = ["CalibrateConfig", "calibrate", "format_summary", "write_profile"]
