"""``moelab bench throughput``: MoE-Gen's module-batched decode measured on this machine beside its simulation.

For each model and each point of a small grid (accumulated batch ``B``, attention micro-batch
``b_a``, expert chunk ``b_e``) the bench

* runs :class:`~moelab.hybrid.throughput.ModuleBatchedDecoder` on ``B`` random prompts of one
  length (``prompt`` tokens, no padding) for ``steps`` decode steps, ``repeats`` times after one
  warm-up run: tokens/s is ``B × steps`` over the decode's wall time (prefill excluded), the
  median of the repeats with their spread and the machine's load (:func:`moelab.measure.from_samples`);
* simulates the same configuration (:func:`~moelab.simulate.moegen.real.simulated_step`: MoE-Gen's DAG
  with ``ω = 0``, every expert and dense module resident and no copies — the CPU stand-in makes
  none) for the shape read off the live model (:meth:`ModelShape.from_model`) on a calibrated
  profile of this machine (``profile``: a ``moelab calibrate --out`` file; default: calibrated now
  with ``--quick`` settings, :func:`moelab.simulate.validate.profile_or_calibrated`), and prints the
  ratio measured / simulated tokens/s (the issue's target: within 1.25× either way);
* measures the plain model's batched greedy decode of the same prompts for reference;
* breaks one step down by module (attention, router, shared experts, routed experts, dense MLP, LM
  head): ms per step from the last repeat's events against the simulated jobs' ms, so a missed
  target says where the time went.

On a GPU (``device="cuda"``, ``moelab bench throughput --device cuda``) each point runs
:class:`~moelab.hybrid.throughput_offload.OffloadedDecoder` instead — weights and KV in host memory,
copied over the link as MoE-Gen copies them, ``expert_slots`` slots in ``S_Expert`` and
``pinned_experts`` resident — against the simulation of that configuration on ``profile`` (a preset
or file describing the GPU box; default :data:`DEFAULT_GPU_PROFILE`) with every copy at the
profile's link rates, and the plain model's decode with the whole model on the GPU.

Models: a bundled name (``moelab-tiny-mixtral``, ``moelab-tiny-qwen2moe``) or ``v2-lite:N`` —
:func:`moelab.hybrid.bench.realistic_model` with ``N`` MoE layers (DeepSeek-V2-Lite's MoE shapes,
bf16, random weights, tiny attention).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moelab.errors import MoelabError
from moelab.hybrid.events import EventLog
from moelab.hybrid.throughput import ModuleBatchedDecoder, plain_generate
from moelab.hybrid.throughput_offload import OffloadedDecoder
from moelab.measure import Measurement, from_samples, machine_load
from moelab.simulate.moegen.real import (
    InPlaceCosts,
    offloaded_config,
    real_config,
    simulated_offloaded_step,
    simulated_step,
)
from moelab.simulate.moegen.schedule import LayerCosts, step_jobs
from moelab.simulate.validate import profile_or_calibrated
from moelab.timing.costs import CostModel
from moelab.timing.profile import get_profile
from moelab.timing.shapes import ModelShape

log = logging.getLogger(__name__)

DEFAULT_MODELS: tuple[str, ...] = ("moelab-tiny-mixtral", "v2-lite:2")
DEFAULT_BATCHES: tuple[int, ...] = (8, 32)
DEFAULT_MICRO_BATCHES: tuple[int, ...] = (4, 32)
"""``b_a`` values; each is clipped to ``B`` (so ``B`` itself is one choice at every ``B`` ≤ 32)."""
DEFAULT_EXPERT_BATCHES: tuple[int, ...] = (2, 64)
TARGET_RATIO = 1.25
DEFAULT_GPU_PROFILE = "h100-pcie5-ddr5"

#: the modules of the per-step breakdown, by the real events' cause prefix and the simulated jobs' module
MODULES: tuple[str, ...] = ("attention", "router", "shared-experts", "experts", "dense-mlp", "lm-head")
_CAUSE_MODULE = {"Attention": "attention", "Router": "router", "Shared": "shared-experts", "Expert": "experts",
                 "DenseMLP": "dense-mlp", "LMHead": "lm-head"}


def load_model(spec: str):
    """(model, label) of a bench model spec: a bundled model name or ``v2-lite:N``."""
    if spec.startswith("v2-lite:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise MoelabError(f"model {spec!r}: expected v2-lite:N with N ≥ 1 MoE layers (e.g. v2-lite:2).")
        from moelab.hybrid.bench import realistic_model

        return realistic_model(n), f"v2-lite-shaped x{n} (bf16)"
    from moelab.loading import load

    model, _ = load(spec)
    return model, spec


def _prompts(model, batch: int, prompt: int) -> torch.Tensor:
    V = int(model.config.vocab_size)
    return torch.randint(3, max(4, min(V, 250)), (batch, prompt), generator=torch.Generator().manual_seed(batch))


def real_breakdown(events: EventLog, steps: int) -> dict[str, float]:
    """ms per decode step spent in each module (:data:`MODULES`), summed from the events' spans, and
    ``expert_chunks``: routed-expert chunks per step."""
    out = dict.fromkeys(MODULES, 0.0)
    chunks = 0
    for e in events.events:
        mod = _CAUSE_MODULE.get(e.cause.split("[", 1)[0])
        if mod:
            out[mod] += (e.t_end_us - e.t_start_us) / 1e3
        chunks += e.kind == "expert-device"
    out = {k: v / max(steps, 1) for k, v in out.items()}
    out["expert_chunks"] = chunks / max(steps, 1)
    return out


def sim_breakdown(model_shape, profile, cfg, *, in_place: bool = True) -> dict[str, float]:
    """ms per step of each module's GPU jobs in the simulated step (``in_place``: copy jobs cost 0, the
    CPU stand-in's correspondence), and ``expert_chunks``: routed-expert chunks per step (uniform routing)."""
    lc = LayerCosts(CostModel.of(model_shape, profile))
    if in_place:
        lc = InPlaceCosts(lc)
    out = dict.fromkeys(MODULES, 0.0)
    out["expert_chunks"] = 0.0
    for j in step_jobs(lc, cfg):
        if j.engine != "gpu":
            continue
        mod = j.fields.get("module")
        if mod in MODULES:
            out[mod] += j.cost_us / 1e3
        out["expert_chunks"] += mod == "experts"
    return out


def measure_point(model, ids: torch.Tensor, micro_batch: int, expert_batch: int, steps: int,
                  repeats: int, label: str = "model", *, offload: dict[str, Any] | None = None
                  ) -> tuple[Measurement, EventLog, dict[str, int]]:
    """Decode seconds of ``repeats`` module-batched runs after one warm-up (median, spread, load), the
    last repeat's events (run ``moegen-real|offloaded LABEL B.. b_a.. b_e..``) and its device bytes by buffer
    (``{}`` in place). ``offload``: the :class:`OffloadedDecoder` keywords (``device``,
    ``expert_slots``, ``pinned_experts``), None for the in-place decoder."""
    def make(run: str):
        if offload is None:
            return ModuleBatchedDecoder(model, micro_batch, expert_batch, run=run)
        return OffloadedDecoder(model, micro_batch, expert_batch, run=run, **offload)

    load_before = machine_load()
    run = f"moegen-{'real' if offload is None else 'offloaded'} {label} B{ids.shape[0]} b_a{micro_batch} b_e{expert_batch}"
    dec = make(run)  # the offloaded decoder is built (its host copies pinned) once per point
    dec.generate(ids, min(steps, 2), keep_logits=False)  # warm-up
    samples = []
    for _ in range(repeats):
        if offload is None:
            dec = make(run)
        else:
            dec.log.events.clear()  # the last repeat's events only
        samples.append(dec.generate(ids, steps, keep_logits=False).decode_s)
    nbytes = dec.device_bytes if offload is not None else {}
    return from_samples(samples, load_before=load_before), dec.log, nbytes


def measure_plain(model, ids: torch.Tensor, steps: int, repeats: int) -> Measurement:
    load_before = machine_load()
    plain_generate(model, ids, min(steps, 2), keep_logits=False)
    return from_samples([plain_generate(model, ids, steps, keep_logits=False).decode_s for _ in range(repeats)],
                        load_before=load_before)


def run_bench(models: Sequence[str] = DEFAULT_MODELS, *, batches: Sequence[int] = DEFAULT_BATCHES,
              micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
              expert_batches: Sequence[int] = DEFAULT_EXPERT_BATCHES, prompt: int = 16, steps: int = 8,
              repeats: int = 5, profile: Any = None, allow_busy: bool = False, keep_events: bool = False,
              threads: int | None = None, progress: Callable[[str], None] | None = None, device: str = "cpu",
              expert_slots: int = 2, pinned_experts: int = 0, pin_dense: bool = False) -> dict[str, Any]:
    """Measured vs simulated tokens/s for every (model, ``B``, ``b_a``, ``b_e``) (see the module
    docstring). Returns ``{"rows": [...], "plain": [...], "profile": path, ...}``; with ``keep_events``
    each row carries its last repeat's :class:`EventLog` under ``"events"``. ``threads``: torch's
    intra-op threads for the calibration and every run (default: as set); on a shared machine
    whose other work takes the cores, more threads than free cores stall every parallel region.
    ``device``: ``"cpu"`` (the in-place decoder, a calibrated profile of this machine) or a CUDA
    device (the offloaded decoder with ``expert_slots``, ``pinned_experts`` and ``pin_dense``, simulated on
    ``profile`` or :data:`DEFAULT_GPU_PROFILE`, the plain model on the GPU).

    Size: the bench's grid (models, three batch axes), its run settings and its outputs are the CLI's
    options one to one; the body checks them, calibrates, and loops over the grid.
    """
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise MoelabError(f"threads={threads!r}: expected an integer ≥ 1 (torch intra-op threads).")
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run_bench(models, batches=batches, micro_batches=micro_batches, expert_batches=expert_batches,
                             prompt=prompt, steps=steps, repeats=repeats, profile=profile, allow_busy=allow_busy,
                             keep_events=keep_events, progress=progress, device=device,
                             expert_slots=expert_slots, pinned_experts=pinned_experts, pin_dense=pin_dense)
        finally:
            torch.set_num_threads(before)
    for name, v in (("prompt", prompt), ("steps", steps), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MoelabError(f"{name}={v!r}: expected an integer ≥ 1.")
    for name, vals in (("batches", batches), ("micro_batches", micro_batches), ("expert_batches", expert_batches)):
        if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
            raise MoelabError(f"{name}={list(vals)!r}: expected one or more integers ≥ 1.")
    gpu = str(device) != "cpu"
    offload = {"device": device, "expert_slots": expert_slots, "pinned_experts": pinned_experts,
               "pin_dense": pin_dense} if gpu else None
    if gpu:
        if not torch.cuda.is_available():
            raise MoelabError(f"device={device!r}: this machine has no CUDA GPU; the bench on the CPU is device='cpu'.")
        prof, path = get_profile(profile or DEFAULT_GPU_PROFILE), str(profile or DEFAULT_GPU_PROFILE)
    else:
        prof, path = profile_or_calibrated(profile, allow_busy=allow_busy, progress=progress)
    rows, plain = [], []
    for spec in models:
        model, label = load_model(spec)
        shape = ModelShape.from_model(model, name=label)
        plain_model = copy.deepcopy(model).to(device) if gpu else model
        for B in batches:
            ids = _prompts(model, B, prompt)
            if progress:
                progress(f"{label}: plain batched decode, B {B} ...")
            pm = measure_plain(plain_model, ids.to(device) if gpu else ids, steps, repeats)
            plain.append({"model": label, "batch": B, "measurement": pm, "tokens_per_s": B * steps / pm.median})
            for ba in sorted({min(v, B) for v in micro_batches}):
                for be in sorted(set(expert_batches)):
                    if progress:
                        progress(f"{label}: B {B}, b_a {ba}, b_e {be} ...")
                    m, events, nbytes = measure_point(model, ids, ba, be, steps, repeats, label, offload=offload)
                    if gpu:
                        cfg = offloaded_config(shape, B, ba, be, prompt, steps, expert_slots, pinned_experts, pin_dense)
                        st, mem = simulated_offloaded_step(shape, prof, cfg)
                    else:
                        st, mem = simulated_step(shape, prof, B, ba, be, prompt, steps)
                        cfg = real_config(shape, B, ba, be, prompt, steps)
                    tps = B * steps / m.median
                    row = {"model": label, "batch": B, "micro_batch": ba, "expert_batch": be, "prompt": prompt,
                           "steps": steps, "measurement": m, "tokens_per_s": tps,
                           "sim_tokens_per_s": st.tokens_per_s, "ratio": tps / st.tokens_per_s,
                           "plain_tokens_per_s": plain[-1]["tokens_per_s"],
                           "real_ms": real_breakdown(events, steps),
                           "sim_ms": sim_breakdown(shape, prof, cfg, in_place=not gpu),
                           "sim_step_ms": st.step_us / 1e3, "real_step_ms": m.median / steps * 1e3,
                           "memory_fits": mem.fits, "device_bytes": nbytes}
                    if keep_events:
                        row["events"] = events
                    rows.append(row)
        del model, plain_model
    return {"rows": rows, "plain": plain, "profile": path, "target_ratio": TARGET_RATIO,
            "threads": torch.get_num_threads(), "device": str(device), "expert_slots": expert_slots,
            "pinned_experts": pinned_experts, "pin_dense": pin_dense}


def _stat(m: Measurement) -> str:
    load = m.load_after.get("load1")
    text = f"±{m.spread:.0%}, load {load:.1f}" if load is not None else f"±{m.spread:.0%}"
    return text + (" BUSY" if m.busy else "") + (" unstable" if m.unstable else "")


def format_result(result: dict[str, Any]) -> str:
    """The bench's table: measured and simulated tokens/s, their ratio, the plain decode; then each
    point's per-module ms per step, real vs simulated."""
    where = ("CPU worker as the device: no KV or weight copies" if result.get("device", "cpu") == "cpu" else
             f"on {result['device']}: weights and KV in host memory, {result['expert_slots']} S_Expert slots, "
             f"{result['pinned_experts']} experts pinned" + (", dense modules pinned" if result.get("pin_dense") else ""))
    lines = [f"MoE-Gen module-batched decode on this machine ({result['threads']} torch threads; {where}) vs its "
             f"simulation on {result['profile']}",
             "(tokens/s = B × steps / decode wall time, median of the repeats; ratio = measured / simulated; target "
             f"within {result['target_ratio']:g}x either way)",
             f"  {'model':28} {'B':>3} {'b_a':>3} {'b_e':>3}  {'measured tok/s':>14} {'spread, load':>18}  "
             f"{'simulated':>9}  {'ratio':>5}  {'plain tok/s':>11}"]
    for r in result["rows"]:
        ok = 1 / result["target_ratio"] <= r["ratio"] <= result["target_ratio"]
        lines.append(f"  {r['model'][:28]:28} {r['batch']:>3} {r['micro_batch']:>3} {r['expert_batch']:>3}  "
                     f"{r['tokens_per_s']:14.1f} {_stat(r['measurement']):>18}  {r['sim_tokens_per_s']:9.1f}  "
                     f"{r['ratio']:5.2f}{'' if ok else '!'}  {r['plain_tokens_per_s']:11.1f}")
    lines.append("per-module ms per decode step, measured (last repeat's events) / simulated:")
    lines.append(f"  {'model':28} {'B':>3} {'b_a':>3} {'b_e':>3}  " + "  ".join(f"{m:>15}" for m in MODULES)
                 + f"  {'step':>15}  {'expert chunks':>13}")
    for r in result["rows"]:
        cells = "  ".join(f"{r['real_ms'][m]:7.2f}/{r['sim_ms'][m]:<7.2f}" for m in MODULES)
        lines.append(f"  {r['model'][:28]:28} {r['batch']:>3} {r['micro_batch']:>3} {r['expert_batch']:>3}  {cells}"
                     f"  {r['real_step_ms']:7.2f}/{r['sim_step_ms']:<7.2f}  "
                     f"{r['real_ms']['expert_chunks']:6.0f}/{r['sim_ms']['expert_chunks']:<6.0f}")
    if any(r.get("device_bytes") for r in result["rows"]):
        lines.append("device memory by MoE-Gen buffer, MiB (the decoder's own buffers):")
        for r in result["rows"]:
            cells = "  ".join(f"{k} {v / 2**20:.1f}" for k, v in r["device_bytes"].items())
            lines.append(f"  {r['model'][:28]:28} {r['batch']:>3} {r['micro_batch']:>3} {r['expert_batch']:>3}  {cells}")
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` without live objects (measurements as dicts, no event logs)."""
    def clean(r):
        return {k: (v.to_dict() if isinstance(v, Measurement) else v) for k, v in r.items() if k != "events"}

    return {**result, "rows": [clean(r) for r in result["rows"]], "plain": [clean(r) for r in result["plain"]]}


__all__ = ["DEFAULT_BATCHES", "DEFAULT_GPU_PROFILE", "DEFAULT_EXPERT_BATCHES", "DEFAULT_MICRO_BATCHES", "DEFAULT_MODELS", "MODULES",
           "TARGET_RATIO", "format_result", "load_model", "measure_plain", "measure_point", "real_breakdown",
           "run_bench", "sim_breakdown", "to_json"]
