"""``moelab calibrate --out PROFILE``: measure this machine and write a hardware profile for the simulator.

What is measured (each a median of ``repeat`` timed runs after a warm-up), and the profile
fields it sets:

==========================  ===============================================================
measurement                 fields
==========================  ===============================================================
memory read (``sum`` over   ``numa_node_bandwidth_gbs``, ``cpu_memory_bandwidth_gbs``
256 MiB, all threads)
host experts kernel         ``cpu_memory_efficiency`` (GB/s of the distinct experts read at
(``--host-backend``, the    batch 1, bf16, over the read bandwidth), ``cpu_peak_tflops``
native kernels by default)  (best FLOP/s over the batches); per dtype (fp32, bf16) × batch
                            (1, 4, 16, 64), on DeepSeek-V2-Lite-shaped experts
device experts kernel       ``gpu_memory_bandwidth_gbs`` (its GB/s at batch 1, bf16;
(``--device-backend``, the  efficiency 1: the figure is already what the kernel reaches),
reference backend: the CPU  ``gpu_peak_tflops`` (best FLOP/s), ``gpu_kernels_per_expert``
worker standing in for the  (its fixed cost on a tiny expert, in launches)
device)
torch op launch (a 1-elem.  ``gpu_launch_us``
add)
attention (projections +    ``gpu_kernels_per_attention`` (a tiny attention's time, in
SDPA over a KV cache, by    launches), ``gpu_dense_efficiency`` (the real attention's weight
context)                    read — intercept of time vs context less that fixed cost —
                            against the device kernel's rate)
empty task through a lane   ``cpu_dispatch_us`` and ``sync_us`` (half the round trip each:
thread (submit → result)    the hand-off and the notification back)
copy of one expert into a   ``link_bandwidth_gbs`` (large copies), ``link_latency_us``
preallocated pool (as the   (a 4 KiB copy)
real executor's copy lane)
==========================  ===============================================================

Fixed by what this machine is: ``device_shares_host_memory: true`` (no GPU: a CPU worker
stands in for the device), ``copy_engines: 1`` (one copy lane), ``numa_nodes`` and
``cpu_cores`` from the OS. Every field's provenance says ``stated: measured by moelab
calibrate on HOST at DATE (N repeats, median)`` with what was measured, or ``assumed:`` with
why for the two fields it cannot measure (``decode_layer_time_us`` and
``attention_fraction``, estimated from the measured kernels for a DeepSeek-V2-Lite layer).

The profile YAML is written atomically (a temporary file renamed into place), and the raw
measurements beside it (``PROFILE.raw.json``).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
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

log = logging.getLogger(__name__)

HIDDEN, INTER = 2048, 1408  # DeepSeek-V2-Lite's routed expert
TOP_K = 6
BATCHES = (1, 4, 16, 64)
DTYPES = ("fp32", "bf16")
CONTEXTS = (64, 512, 2048, 4096)


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
    contexts: tuple[int, ...] = CONTEXTS
    device_batches: tuple[int, ...] = (1, 16)
    """The device stand-in's backend (torch reference, slow) is measured at fewer batches."""
    attention_hidden: int = 1024
    expert_hidden: int = HIDDEN
    expert_intermediate: int = INTER
    """The measured experts' shape (default DeepSeek-V2-Lite's routed expert)."""


def _median(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up (``setup`` untimed before each)."""
    times = []
    for _ in range(repeat + 1):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


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
    def __init__(self, tokens: int, experts: int, k: int, seed: int = 0) -> None:
        import torch

        self.t, self.e, self.k = tokens, experts, k
        self.gen = torch.Generator().manual_seed(seed)
        self.redraw()

    def redraw(self) -> None:
        import torch

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


def _tiny_expert_call(backend_name: str, repeat: int) -> float:
    """Seconds of one call of a 1-expert layer with 64×64 weights (its fixed cost)."""
    import torch

    from moelab.backends import get_backend

    backend = get_backend(backend_name)
    mod = _experts(torch.float32, 2, hidden=64, inter=64)
    x = torch.randn(1, 64)
    ids = torch.zeros(1, 1, dtype=torch.long)
    w = torch.ones(1, 1)
    with torch.no_grad():
        return _median(lambda: backend(mod, x, ids, w), repeat * 10)


def _memory_read_gbps(mib: int, repeat: int) -> float:
    import torch

    a = torch.ones(mib * 2**20 // 4)
    sec = _median(lambda: a.sum(), repeat)
    return a.numel() * 4 / sec / 1e9


def _launch_us(repeat: int) -> float:
    import torch

    a, b = torch.ones(1), torch.ones(1)
    n = 200
    return _median(lambda: [torch.add(a, b) for _ in range(n)], repeat) / n * 1e6


def _attention_points(cfg: CalibrateConfig, tick, hidden: int, contexts: tuple[int, ...]) -> tuple[list[dict], int]:
    """Decode-step attention time by context: q/k/v/o projections (``hidden``, heads of up to 128,
    bf16) and SDPA over a KV cache of ``context`` tokens."""
    import torch

    hd = min(128, hidden)
    H, heads = hidden, max(hidden // hd, 1)
    gen = torch.Generator().manual_seed(0)
    wq, wk, wv, wo = ((torch.randn(H, H, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(4))
    weight_bytes = 4 * H * H * 2
    x = torch.randn(1, 1, H, generator=gen).to(torch.bfloat16)
    out = []
    for ctx in contexts:
        k = torch.randn(1, heads, ctx, hd, generator=gen).to(torch.bfloat16)
        v = torch.randn(1, heads, ctx, hd, generator=gen).to(torch.bfloat16)

        def step(k=k, v=v):
            with torch.no_grad():
                q = (x @ wq).view(1, 1, heads, hd).transpose(1, 2)
                kn = (x @ wk).view(1, 1, heads, hd).transpose(1, 2)
                vn = (x @ wv).view(1, 1, heads, hd).transpose(1, 2)
                kk = torch.cat([k, kn], 2)
                vv = torch.cat([v, vn], 2)
                a = torch.nn.functional.scaled_dot_product_attention(q, kk, vv)
                return a.transpose(1, 2).reshape(1, 1, H) @ wo

        sec = _median(step, cfg.repeat)
        out.append({"hidden": H, "context": ctx, "seconds": sec, "kv_bytes": 2 * heads * hd * 2 * ctx,
                    "weight_bytes": weight_bytes})
        tick()
    return out, weight_bytes


def _lane_roundtrip_us(repeat: int) -> float:
    from moelab.hybrid.events import EventLog
    from moelab.hybrid.real import Lane

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


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(len(nodes), 1)


def calibrate(cfg: CalibrateConfig | None = None, *, progress: bool = True) -> tuple[dict, dict]:
    """Measure this machine; returns (profile file data, raw measurements)."""
    import torch
    from tqdm.auto import tqdm

    cfg = cfg or CalibrateConfig()
    if cfg.repeat < 1:
        raise MoelabError(f"repeat must be ≥ 1, got {cfg.repeat}.")
    steps = 5 + len(cfg.dtypes) * (len(cfg.batches) + len(cfg.device_batches)) + len(cfg.contexts) + 2
    bar = tqdm(total=steps, desc="calibrate", disable=not progress, unit="step")

    def tick(what: str = ""):
        bar.update(1)
        if what:
            bar.set_postfix_str(what)

    try:
        read = _memory_read_gbps(cfg.memory_mib, cfg.repeat)
        tick("memory")
        launch = _launch_us(cfg.repeat)
        tick("launch")
        lane_rt = _lane_roundtrip_us(cfg.repeat)
        tick("lane")
        copy = _copy_points(cfg)
        tick("copy")
        host = _kernel_points(cfg.host_backend, cfg, lambda: tick("host kernels"), cfg.batches, cfg.repeat)
        # the device stand-in's torch reference backend takes ~0.1-1 s a call: at most 3 repeats
        device = _kernel_points(cfg.device_backend, cfg, lambda: tick("device kernels"), cfg.device_batches,
                                min(cfg.repeat, 3))
        tiny_dev = _tiny_expert_call(cfg.device_backend, cfg.repeat)
        tick("overheads")
        attn, attn_weight_bytes = _attention_points(cfg, lambda: tick("attention"), cfg.attention_hidden,
                                                    cfg.contexts)
        # a tiny attention (weights of 128 KiB, short contexts): its time is the fixed cost
        tiny_attn, _ = _attention_points(cfg, lambda: tick("attention"), 128, (1, 2))
    finally:
        bar.close()

    def pick(rows, dtype, batch):
        for r in rows:
            if r["dtype"] == dtype and r["batch"] == batch:
                return r
        return rows[0]

    dref = "bf16" if "bf16" in cfg.dtypes else cfg.dtypes[0]
    bref = min(cfg.batches)
    host1, dev1 = pick(host, dref, bref), pick(device, dref, bref)
    link_gbs = copy["expert_bytes"] / copy["expert_seconds"] / 1e9
    link_lat = max(copy["small_seconds"] * 1e6 - copy["small_bytes"] / (link_gbs * 1e3), 0.0)
    dev_gbs = dev1["gbps"]
    # attention: least-squares line through (context, µs); intercept less the weights' read = fixed cost
    xs = [a["context"] for a in attn]
    ys = [a["seconds"] * 1e6 for a in attn]
    slope, intercept = (statistics.linear_regression(xs, ys) if len(xs) > 1 else (0.0, ys[0]))
    launch_eff = max(launch, 0.1)
    fixed_attn = min(a["seconds"] for a in tiny_attn) * 1e6
    k_attn = max(int(round(fixed_attn / launch_eff)), 1)
    # dense efficiency: the weights' read time of the real attention, against an expert kernel's rate
    read_us = max(intercept - k_attn * launch, 1e-3)
    dense_eff = (attn_weight_bytes / (dev_gbs * 1e3)) / read_us
    k_expert = max(int(round(tiny_dev * 1e6 / launch_eff)), 1)
    cpu_eff = min(max(host1["gbps"] / read, 0.01), 1.0)
    cpu_peak = max(r["tflops"] for r in host)
    dev_peak = max(r["tflops"] for r in device)
    # a DeepSeek-V2-Lite-shaped decode layer from the measured kernels: attention at context 512 and
    # top-6 experts on the host at batch 1
    att512 = intercept + slope * 512
    expert_us = host1["seconds"] * 1e6 * TOP_K / max(host1["distinct_experts"], 1)
    layer_us = att512 + expert_us
    host_name = socket.gethostname()
    date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%MZ")
    src = f"measured by moelab calibrate on {host_name} at {date} ({cfg.repeat} repeats, median)"

    def stated(value, how):
        return {"value": value, "stated": f"{src}: {how}"}

    profile = {
        "name": "this-machine",
        "description": f"{host_name}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU "
                       f"(a CPU worker stands in for the device); torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads.",
        "link_bandwidth_gbs": stated(round(link_gbs, 3), "copy of one bf16 DeepSeek-V2-Lite expert into a "
                                                         "preallocated pool slot"),
        "link_latency_us": stated(round(link_lat, 3), "a 4 KiB copy, less its bytes at the link bandwidth"),
        "gpu_memory_bandwidth_gbs": stated(round(dev_gbs, 3), f"{cfg.device_backend} experts backend, {dref}, "
                                                              f"batch {bref}, distinct experts' bytes / time"),
        "cpu_memory_bandwidth_gbs": stated(round(read, 3), f"sum over {cfg.memory_mib} MiB fp32, all threads"),
        "cpu_cores": stated(int(os.cpu_count() or 1), "os.cpu_count()"),
        # (the fields below fit the roofline of moelab.simulate.executor to the points above)
        "decode_layer_time_us": {"value": round(layer_us, 3), "assumed": (
            f"estimated from the measured kernels ({src}): attention at context 512 + {TOP_K} host experts "
            "at batch 1 of a DeepSeek-V2-Lite-shaped layer, run one after the other")},
        "attention_fraction": {"value": round(min(max(att512 / layer_us, 0.0), 1.0), 4), "assumed": (
            "the attention's share of that estimated layer")},
        "gpu_peak_tflops": stated(round(max(dev_peak, 1e-6), 6), f"{cfg.device_backend} experts backend, best "
                                                                 "FLOP/s over dtypes and batches"),
        "gpu_memory_efficiency": stated(1.0, "the device bandwidth above is what the kernel reaches"),
        "gpu_compute_efficiency": stated(1.0, "the device peak above is what the kernel reaches"),
        "gpu_dense_efficiency": stated(round(dense_eff, 6), f"bf16 attention of hidden {cfg.attention_hidden}: "
                                                           f"its weights ({attn_weight_bytes} B) read in "
                                                           f"{read_us:.1f} µs (intercept of time vs context less "
                                                           "the fixed cost) against the device kernel's GB/s"),
        "gpu_launch_us": stated(round(launch, 3), "a 1-element torch.add on the CPU"),
        "gpu_kernels_per_attention": stated(k_attn, f"a tiny attention (hidden 128) takes {fixed_attn:.1f} µs, "
                                                    "in launches"),
        "gpu_kernels_per_expert": stated(k_expert, f"a 64×64 one-expert call of {cfg.device_backend} "
                                                   f"({tiny_dev * 1e6:.1f} µs), in launches"),
        "cpu_peak_tflops": stated(round(max(cpu_peak, 1e-6), 6), f"{cfg.host_backend} experts backend, best "
                                                                 "FLOP/s over dtypes and batches"),
        "cpu_memory_efficiency": stated(round(cpu_eff, 4), f"{cfg.host_backend} experts backend, {dref}, batch "
                                                           f"{bref}: {host1['gbps']:.2f} GB/s of {read:.2f}"),
        "numa_nodes": stated(_numa_nodes(), "/sys/devices/system/node"),
        "numa_node_bandwidth_gbs": stated(round(read / _numa_nodes(), 3), "the read bandwidth per NUMA node"),
        "cpu_dispatch_us": stated(round(lane_rt / 2, 3), "half the round trip of an empty task through a lane "
                                                         "thread (moelab.hybrid.real.Lane)"),
        "sync_us": stated(round(lane_rt / 2, 3), "the other half of that round trip (the result back)"),
        "copy_engines": stated(1, "the real executor has one copy lane"),
        "device_shares_host_memory": stated(True, "no GPU here: the device lane is a CPU worker"),
    }
    raw = {
        "host": host_name, "date": date, "repeat": cfg.repeat, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "memory_read_gbps": read, "launch_us": launch,
        "lane_roundtrip_us": lane_rt, "copy": copy, "host_kernels": host, "device_kernels": device,
        "device_tiny_call_us": tiny_dev * 1e6, "attention": attn, "tiny_attention": tiny_attn,
        "attention_fit_us": {"intercept": intercept, "per_context_token": slope},
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "note": "timings on a machine shared with other work are slower and noisier than on a quiet one",
    }
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

    from moelab.timing import parse_profile

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
    lines = [f"calibrated {raw['host']} at {raw['date']} ({raw['repeat']} repeats, median; {raw['threads']} threads)",
             f"  memory read {raw['memory_read_gbps']:.2f} GB/s; copy into pool {profile['link_bandwidth_gbs']['value']:.2f} "
             f"GB/s (+{profile['link_latency_us']['value']:.1f} µs); torch op {raw['launch_us']:.2f} µs; "
             f"lane round trip {raw['lane_roundtrip_us']:.1f} µs",
             "  experts kernels (GB/s of distinct experts read / TFLOP/s):"]
    for group in ("host_kernels", "device_kernels"):
        for r in raw[group]:
            lines.append(f"    {r['backend']:<10} {r['dtype']:<5} batch {r['batch']:>3}: {r['seconds'] * 1e3:8.2f} ms  "
                         f"{r['gbps']:7.2f} GB/s  {r['tflops']:.4f} TFLOP/s")
    fit = raw["attention_fit_us"]
    lines.append(f"  attention: {fit['intercept']:.1f} µs + {fit['per_context_token'] * 1e3:.2f} ns per context "
                 "token (" + ", ".join(f"{a['context']}: {a['seconds'] * 1e6:.0f} µs" for a in raw["attention"]) + ")")
    keys = ("cpu_memory_efficiency", "cpu_peak_tflops", "gpu_memory_bandwidth_gbs", "gpu_dense_efficiency",
            "gpu_kernels_per_attention",
            "gpu_kernels_per_expert", "cpu_dispatch_us")
    lines.append("  fitted: " + ", ".join(f"{k}={profile[k]['value']}" for k in keys))
    return "\n".join(lines)


__all__ = ["CalibrateConfig", "calibrate", "format_summary", "write_profile"]
