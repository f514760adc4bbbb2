"""Report section: the native expert kernels' weight bandwidth against the machine's.

Runs a small :func:`moelab.kernels.bench.run_bench` (one expert shape, decode-sized token
counts, every weight format) and draws the achieved GB/s of the distinct experts' weights
read per call beside the machine's measured read bandwidth (a memory-bound decode layer
cannot beat it).
"""

from __future__ import annotations

import html
from contextlib import contextmanager

from moelab.errors import MoelabError
from moelab.measure import machine_load
from moelab.report import ReportContext, Section, SectionUnavailable, html_table, register_section

#: (shape HxIxExK, token counts, dtypes, bandwidth buffer MiB) — full and quick.
FULL = ("1024x1024x8x4", (1, 4, 16), ("bf16", "int8", "int4", "fp8"), 256)
QUICK = ("1024x704x8x4", (1, 4), ("bf16", "int4"), 128)


#: Bytes per weight of each format relative to bf16, scales included (as in ``moelab.kernels.bench``).
_FORMAT_FACTOR = {"fp32": 2.0, "bf16": 1.0, "int8": 0.53, "int4": 0.28, "fp8": 0.51}


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache in bytes (Linux sysfs), or None where it cannot be read."""
    from pathlib import Path

    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        try:
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]])
        except (ValueError, KeyError):
            continue
    return max(sizes) if sizes else None


@contextmanager
def torch_threads(n: int | None):
    """Run with ``n`` torch/OpenMP threads (None: unchanged), restoring the count after."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_threads(default: int | None) -> tuple[int | None, str]:
    """Threads for the bench and a sentence saying why: all of them (``default``) on a quiet
    machine; one where other work's load (the load average less this process's own,
    :func:`moelab.measure.machine_load`) already fills the CPUs, because OpenMP threads that
    wait at every barrier for a descheduled sibling measure the other load, not the kernel."""

    m = machine_load()
    cpus, load = m["cpus"], m["load1"]
    other = m.get("other", load)
    if load is None:  # pragma: no cover - platforms without a load average
        return default, "Numbers move with other load on a shared machine."
    if other >= cpus and (default or cpus) > 1:
        return 1, (f"The machine was busy (load average {load:.1f} on {cpus} CPUs, {other:.1f} of it other work), "
                   "so both the kernels and the bandwidth were measured on 1 thread; on a quiet machine all threads "
                   "are used.")
    return default, (f"Load average {load:.1f} on {cpus} CPUs when measured ({other:.1f} of it other work); numbers "
                     "move with other load.")


def kernels_section(ctx: ReportContext) -> Section:
    try:
        from moelab.kernels.build import load_extension

        load_extension()
    except (ImportError, MoelabError) as exc:
        raise SectionUnavailable(f"moelab's native kernels cannot be built here: {exc}") from exc
    from moelab.kernels.bench import BenchConfig, run_bench

    shape, tokens, dtypes, mib = QUICK if ctx.quick else FULL
    cfg = BenchConfig(shapes=(shape,), tokens=tokens, dtypes=dtypes, baselines=(), repeat=3, bandwidth_mib=mib)
    threads, busy = bench_threads(ctx.extras.get("threads"))
    with torch_threads(threads):
        result = run_bench(cfg)
    m, rows = result["machine"], result["rows"]
    from moelab.kernels.bench import Shape

    sh = Shape.parse(shape)
    llc = last_level_cache_bytes()
    sizes = {d: rows[0]["experts_used"] * sh.bf16_bytes_per_expert() * _FORMAT_FACTOR[d] for d in dtypes}
    cached = [d for d, b in sizes.items() if llc and b < 2 * llc]
    cache_note = (
        " All of a format's weights: " + ", ".join(f"{d} ≈ {b / 2**20:.0f} MiB" for d, b in sizes.items())
        + (f"; the last-level cache holds {llc / 2**20:.0f} MiB, so {', '.join(cached)} can be served partly from "
           "cache and exceed the DRAM line (a demo-sized layer; real layers are far larger)." if cached else ".")
    )
    flagged = bool(m.get("busy"))
    # a share of a read bandwidth measured under load means nothing (it reached 467 % on a busy machine)
    table = [{"dtype": r["dtype"], "tokens T": r["tokens"], "ms": r["ms"], "GB/s": r["gbps"],
              "% of read bw": "busy" if flagged else r["pct_read_bw"]} for r in rows]
    if flagged:
        busy += (f" <b class='err'>Measured on a busy machine ({html.escape(m['busy_reason'])}): the figures are not "
                 "meaningful and the share of read bandwidth is not shown; rerun on a quiet machine.</b>")
    intro = (
        f"<p>One MoE layer's experts of shape {shape} (hidden × intermediate × experts × top-k; "
        f"{rows[0]['experts_used']} experts built), uniform random routing redrawn every call so weights are "
        f"read cold; GB/s = bytes of the distinct experts touched / median time. Machine: read "
        f"{m['read_gbps']:.1f} GB/s, copy {m['copy_gbps']:.1f} GB/s (STREAM-like, {m['threads']} threads), "
        f"ISA {m['isa']}. <code>moelab bench kernels --shapes {shape} --tokens {','.join(map(str, tokens))}"
        f"</code> measures more.{cache_note} {busy}</p>"
        + html_table(table, floatfmt="{:.2f}")
    )
    return Section(html=intro, figures=[bandwidth_figure(result, shape)])


def bandwidth_figure(result: dict, shape: str):
    import plotly.graph_objects as go

    m = result["machine"]
    fig = go.Figure()
    for dtype in dict.fromkeys(r["dtype"] for r in result["rows"]):
        rs = [r for r in result["rows"] if r["dtype"] == dtype]
        fig.add_trace(go.Scatter(
            x=[r["tokens"] for r in rs], y=[r["gbps"] for r in rs], mode="lines+markers", name=f"moelab {dtype}",
            customdata=[[r["ms"], r["pct_read_bw"]] for r in rs],
            hovertemplate="T=%{x}: %{y:.1f} GB/s, %{customdata[0]:.3f} ms, %{customdata[1]:.0f}% of read"
                          "<extra>" + dtype + "</extra>",
        ))
    for key, label, dash in (("read_gbps", "machine read bandwidth", "dash"), ("copy_gbps", "machine copy", "dot")):
        fig.add_hline(y=m[key], line_dash=dash, line_color="black" if key == "read_gbps" else "gray",
                      annotation_text=f"{label} {m[key]:.1f} GB/s", annotation_position="top left")
    fig.update_layout(
        title=f"Native expert kernels: weight bandwidth vs the machine's ({shape}, {m['threads']} threads)"
              + (" — MEASURED ON A BUSY MACHINE" if m.get("busy") else ""),
        xaxis={"title": "tokens per layer call (T)", "type": "log"},
        yaxis={"title": "weight bandwidth (GB/s)", "rangemode": "tozero"},
        legend_title="kernel",
    )
    return fig


register_section(
    "kernels", kernels_section, order=110, title="Native kernels: bandwidth vs the machine",
    read="At decode sizes (small T) an expert layer is memory-bound, so a kernel is as good as its share of "
         "the dashed read-bandwidth line; quantised formats move fewer bytes and finish sooner, and at larger "
         "T compute takes over and GB/s falls.",
)
