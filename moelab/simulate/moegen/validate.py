"""MoE-Gen's settings on the validation page: predictions from spec sheets, beside on-demand offloading.

One row per (model, machine) of MoE-Gen's evaluation that techniques.md §9 names — Mixtral-8x7B
and DeepSeek-V2-Lite decode on the A5000 and A6000 machines of Table 3 (profiles
``moegen-a5000``, ``moegen-a6000``) — with MoE-Gen's schedule searched
(:func:`~moelab.simulate.moegen.plan_throughput`) and on-demand offloading
(:func:`~moelab.simulate.moegen.on_demand_baseline`) for comparison. techniques.md gives **no**
published MoE-Gen figure, so a row has no error; nothing here is fitted to anything. Each row
states its assumptions and the sensitivity of its prediction to the two rates the paper does not
give: copies at 75 % of PCIe 4.0's theoretical rate (``link_efficiency 0.75``, ProMoE's measured
23.9 of 32 GB/s) and the CPU's memory efficiency ±20 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelab.simulate.moegen.schedule import ASSUMPTIONS
from moelab.simulate.moegen.search import plan_throughput
from moelab.timing.profile import get_profile

#: MoE-Gen's generation setting as moelab assumes it: prompts of 512 tokens, 256 generated.
PROMPT, GENERATE = 512, 256


@dataclass(frozen=True)
class ThroughputCase:
    """One of MoE-Gen's settings: a packaged shape on a profile, decode."""

    name: str
    shape: str
    profile: str
    source: str


CASES: tuple[ThroughputCase, ...] = tuple(
    ThroughputCase(f"moegen-{shape}-{gpu}-decode", shape, f"moegen-{gpu}",
                   f"MoE-Gen §5 / Table 3: {shape} decode throughput on the {gpu.upper()} machine vs on-demand "
                   "offloading (no published figure in techniques.md §9)")
    for gpu in ("a5000", "a6000") for shape in ("mixtral-8x7b", "deepseek-v2-lite"))


def throughput_rows(*, quick: bool = False) -> list[dict]:
    """The validation page's MoE-Gen rows (``group`` ``"predictions"``; ``quick``: no sensitivity runs)."""
    rows = []
    for case in CASES:
        hw = get_profile(case.profile)
        plan = plan_throughput(case.shape, hw, prompt=PROMPT, generate=GENERATE)
        c = plan.best.config
        sens = []
        if not quick:
            for label, hw2 in (("link 75 % of PCIe", hw.with_changes(link_efficiency=0.75)),
                               ("CPU efficiency −20 %", hw.with_changes(cpu_memory_efficiency=0.8 * hw.cpu_memory_efficiency)),
                               ("CPU efficiency +20 %", hw.with_changes(
                                   cpu_memory_efficiency=min(1.0, 1.2 * hw.cpu_memory_efficiency)))):
                sens.append(f"{label}: {plan_throughput(case.shape, hw2, prompt=PROMPT, generate=GENERATE, baseline=False).tokens_per_s:.0f}")
        base = plan.baseline
        rows.append({
            "group": "predictions", "case": case.name, "metric": "decode_tokens_per_s",
            "reference": None if base is None else base.tokens_per_s,
            "reference_kind": "on-demand offloading, simulated" + ("" if base is None else f", B {base.config.batch}"),
            "simulated": plan.tokens_per_s, "prediction": "hardware", "error": None, "error_unit": "",
            "target": "no published figure", "ok": None, "unit": "tokens/s",
            "speedup": plan.speedup, "source": case.source,
            "configuration": (f"B {c.batch}, b_a {c.micro_batch}, b_e {c.expert_batch}, ω {c.cpu_attention:g}, "
                              f"S_Expert {c.expert_slots}, S_Params {c.pinned_experts} experts"
                              + (" + dense" if c.pin_dense else "")),
            "assumed": f"prompt {PROMPT} + generate {GENERATE}; " + "; ".join(ASSUMPTIONS),
            "sensitivity": "; ".join(sens),
        })
    return rows


__all__ = ["CASES", "GENERATE", "PROMPT", "ThroughputCase", "throughput_rows"]
