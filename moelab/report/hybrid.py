"""Report section: a hybrid CPU/GPU run on the real executor, drawn as a timeline.

Generates a few tokens of the demo model under ``moelab.hybrid(model, cfg)`` with
``executor: real`` (device, host and copy lanes running concurrently, measured
timestamps) and draws its events with :mod:`moelab.timeline` (one row per lane, bars
coloured by the expert's fate, copy→compute flows, the critical path of a step), with the
Timeline's summary (busy % per lane, host/device overlap, stalls by cause, critical path,
tokens/s) computed from the events alone.
"""

from __future__ import annotations

import html

import moelab
from moelab.prompts import task_prompts
from moelab.report import ReportContext, Section, html_table, load_text, register_section

#: The demo's hybrid configuration: a quarter of each layer's experts resident (LRU), misses placed by
#: the greedy HybriMoE-style rule on a PCIe 4 cost model, two experts per token deferred.
CONFIG = {
    "cache": {"capacity": 0.25, "policy": "lru"},
    "placement": "greedy-hss",
    "hardware": "pcie4-x16",
    "routing": {"deferred": 2, "min_immediate": 1},
    "executor": "real",
    "host_backend": "moelab",
}
SHOW_STEPS = 4
"""The figure draws the first forwards (prefill and decode steps) event by event."""


def hybrid_section(ctx: ReportContext) -> Section:
    from moelab.adapters import moe_layers
    from moelab.timeline import Timeline

    cfg = dict(CONFIG)
    try:
        from moelab.kernels.build import load_extension

        load_extension()
    except Exception:  # noqa: BLE001 - no compiler: the host lane runs the reference experts
        cfg["host_backend"] = "reference"
    top_k = min(layer.top_k for layer in moe_layers(ctx.model))
    cfg["routing"] = {"deferred": min(2, top_k - 1), "min_immediate": 1} if top_k >= 2 else {"deferred": 0}
    n_prompts, new = (2, 4) if ctx.quick else (4, 8)
    tok = ctx.tokenizer
    enc = tok(task_prompts("arith", n_prompts), return_tensors="pt", padding=True, padding_side="left")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with moelab.hybrid(ctx.model, cfg) as run:
        out = ctx.model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=pad)
    events = run.events_table()
    generated = int((out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0])
    tl = Timeline(events, name="real executor", tokens=generated)
    s = tl.summary()
    kinds = events.groupby("kind").size().to_dict()
    fates = ", ".join(f"{k} {v}" for k, v in s["fates"].items() if v)
    intro = (
        f"<p><code>moelab.hybrid(model, {html.escape(repr(cfg))})</code>, greedy generation of {new} tokens "
        f"for {n_prompts} arith prompts: {len(events)} events in {s['wall_us'] / 1e6:.2f} s "
        f"({s['tokens_per_s'] or 0:.1f} generated tokens/s in this one run, {html.escape(load_text())}: a "
        "description of this timeline, not a benchmark — <code>moelab.hybrid.run.measure_runs</code> compares "
        "configurations with warm-up, turns and the median of repeats), host/device overlap "
        f"{s['overlap_pct']:.1f} % of the host lanes' busy time; experts' fates: {html.escape(fates)}. "
        "On this CPU-only machine the device lane is a CPU worker standing in for a GPU (it shares the cores), "
        "so the timeline shows the plan's concurrency, not a GPU's speed. The summary is "
        "<code>moelab.timeline.Timeline(events).summary()</code>, computed from the events alone.</p>"
        + html_table(summary_rows(tl, s), floatfmt="{:.1f}")
        + "<p>events by kind: " + ", ".join(f"{html.escape(k)} {v}" for k, v in sorted(kinds.items())) + "</p>"
    )
    steps = tl.steps
    fig = tl.figure(steps=(steps[0], steps[min(len(steps), SHOW_STEPS) - 1]) if steps else None,
                    critical_path=steps[min(len(steps), SHOW_STEPS) - 1] if steps else None,
                    title=f"Hybrid run on the real executor ({ctx.model_name})")
    fig.update_yaxes(title_text="lane", row=1, col=1)
    if "xaxis2" in fig.layout:  # a counter row below: the lanes' row shares its time axis
        fig.update_xaxes(title_text="ms", title_standoff=0, row=1, col=1)
    return Section(html=intro, figures=[fig])


def summary_rows(tl, s: dict | None = None) -> list[dict]:
    """Per lane: busy % and events; then the control thread's stalls by cause and the mean
    critical path of a step (``s``: the :class:`moelab.timeline.Timeline` summary)."""
    s = tl.summary() if s is None else s
    ev = tl.events
    rows = [{"lane / figure": lane, "value": float(pct), "unit": "% busy", "events": int((ev["lane"] == lane).sum())}
            for lane, pct in s["busy_pct"].items()]
    rows += [{"lane / figure": f"stall: {cause}", "value": us / 1e3, "unit": "ms", "events": ""}
             for cause, us in s["stall_us"].items()]
    if s.get("critical_path_us") is not None:
        rows.append({"lane / figure": "critical path per step", "value": s["critical_path_us"] / 1e3, "unit": "ms",
                     "events": f"{100 * s['critical_path_share']:.0f} % of the step"})
    return rows


register_section(
    "hybrid", hybrid_section, order=120, title="Hybrid CPU/GPU run: timeline",
    read="One row per lane (control thread, device, copy engine, host): bars are coloured by each expert's fate "
         "(hit, miss computed on the host, miss fetched, deferred), gaps and grey waits on the control row are the "
         "model waiting for experts, host bars overlapping the next layer's control work are deferred experts "
         "hidden behind it, thin lines join a copy to the compute it feeds and the black chain is one step's "
         "critical path; the table gives each lane's busy share and the control thread's stalls by cause.")
