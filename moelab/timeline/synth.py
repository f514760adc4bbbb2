"""Synthetic events with the structure of a hybrid decode, for benchmarks and tests of the timeline.

:func:`synthetic_events` lays out a DeepSeek-V3-like decode (58 MoE layers, 8 routed experts per
token) on the lanes of a GPU box: ``control`` (attention and router, then a wait for the layer's
experts), ``device`` (hits, prefetch hits, fetched misses after their copy), ``copy0`` (demand
copies and evictions), ``copy1`` (prefetches), ``host0``/``host1`` (misses computed on the CPU) and
deferred experts on ``host0`` overlapping the next layer's attention, merged at the next layer.
Durations are plausible, not measured: this is a load generator, not a simulation.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.events import COLUMNS

EXPERT_BYTES = 44_040_192  # DeepSeek-V3 routed expert in fp8: 3 × 7168 × 2048 bytes


def synthetic_events(*, steps: int | None = None, events: int | None = None, layers: int = 58, top_k: int = 8,
                     deferred: int = 2, seed: int = 0, run: str = "synthetic",
                     fates: tuple[float, float, float, float] = (0.62, 0.12, 0.04, 0.22)) -> pd.DataFrame:
    """An events table of ``steps`` decode steps (or about ``events`` events); ``fates`` are the
    probabilities of hit, prefetch-hit, miss-fetch and miss-host for each non-deferred slot.

    Size: long: the events of one synthetic step, lane by lane, in the order they happen.
    """
    if steps is None:
        p = np.asarray(fates) / np.sum(fates)
        slots = top_k - 0.8 * deferred  # slots not deferred, on average
        per_step = layers * (2 + top_k + 2 * slots * (p[1] + p[2])) - 2 * slots * p[1]  # layer 0: no prefetch
        steps = max(1, int(np.ceil((events or 100_000) / per_step)) + 1)  # at least ``events``, about
    rng = np.random.default_rng(seed)
    B, K = steps * layers, top_k
    step = np.repeat(np.arange(steps), layers)
    layer = np.tile(np.arange(layers), steps)
    dense = rng.uniform(25, 45, B)  # attention + router on the device, launched by the control thread
    expert = np.argsort(rng.random((B, 256)), axis=1)[:, :K]
    fate = rng.choice(4, size=(B, K), p=np.asarray(fates) / np.sum(fates))  # 0 hit 1 pf-hit 2 fetch 3 host
    is_def = np.zeros((B, K), dtype=bool)
    if deferred:
        is_def[:, K - deferred:] = rng.random((B, 1)) < 0.8
    fate = np.where(is_def, 4, fate)
    dev_d = rng.uniform(8, 16, (B, K))
    host_d = rng.uniform(90, 160, (B, K))
    copy_d = rng.uniform(1300, 1900, (B, K))  # 44 MB over PCIe 4
    # deferred work of block b runs on host0 from block b's end; the next block's host work queues behind it
    def_len = np.where(fate == 4, host_d, 0).sum(1)
    carry = np.r_[0.0, def_len[:-1]]  # merged at the next layer (the last layer's: at the next step's first)
    # relative times inside a block (0 = the block's start)
    t_copy = np.full(B, 0.0) + dense
    t_dev = dense.copy()
    t_host = [np.maximum(dense, carry), dense.copy()]
    rel = np.zeros((B, K, 2))
    lanes = np.empty((B, K), dtype=object)
    cp_rel = np.full((B, K, 2), np.nan)
    for j in range(K):
        f = fate[:, j]
        fetch = f == 2
        cp_rel[fetch, j, 0] = t_copy[fetch]
        t_copy = np.where(fetch, t_copy + copy_d[:, j], t_copy)
        cp_rel[fetch, j, 1] = t_copy[fetch]
        on_dev = f <= 2
        s = np.where(fetch, np.maximum(t_dev, t_copy), t_dev)
        rel[:, j, 0] = np.where(on_dev, s, rel[:, j, 0])
        rel[:, j, 1] = np.where(on_dev, s + dev_d[:, j], rel[:, j, 1])
        t_dev = np.where(on_dev, s + dev_d[:, j], t_dev)
        lanes[on_dev, j] = "device"
        for h in (0, 1):
            m = (f == 3) & ((j % 2) == h)
            rel[m, j, 0] = t_host[h][m]
            rel[m, j, 1] = t_host[h][m] + host_d[m, j]
            t_host[h] = np.where(m, t_host[h] + host_d[:, j], t_host[h])
            lanes[m, j] = f"host{h}"
    end = np.maximum.reduce([t_dev, t_host[0], t_host[1], dense + 3])
    gap = rng.uniform(2, 6, B)
    T = np.r_[0.0, np.cumsum(end + gap)[:-1]]
    # deferred experts: sequential on host0 from the block's end
    t_d = end.copy()
    for j in range(K):
        m = fate[:, j] == 4
        rel[m, j, 0] = t_d[m]
        rel[m, j, 1] = t_d[m] + host_d[m, j]
        t_d = np.where(m, t_d + host_d[:, j], t_d)
        lanes[m, j] = "host0"
    parts = []

    def add(mask_b, lane, kind, t0, t1, *, e=-1, tok=0, nbytes=0, cause="", lay=None, stp=None):
        """Size: the event rows' columns, one keyword each.
        """
        n = len(t0)
        sel = (lambda a: a[mask_b]) if mask_b is not None else (lambda a: a)
        parts.append(pd.DataFrame({
            "step": sel(step) if stp is None else stp, "layer": sel(layer) if lay is None else lay,
            "lane": np.full(n, lane, dtype=object) if isinstance(lane, str) else lane, "kind": kind,
            "expert": e if not np.isscalar(e) else np.full(n, e), "tokens": tok if not np.isscalar(tok)
            else np.full(n, tok), "bytes": nbytes if not np.isscalar(nbytes) else np.full(n, nbytes),
            "t_start_us": t0, "t_end_us": t1, "cause": cause}))

    add(None, "control", "dense", T, T + dense, cause="attention+router")
    add(None, "control", "wait", T + dense, T + end, cause="lanes")
    names = np.array(["hit", "prefetch-hit", "miss-fetch", "miss-host", "deferred"], dtype=object)
    kinds = np.array(["expert-device"] * 3 + ["expert-host", "expert-deferred"], dtype=object)
    bi, ji = np.nonzero(np.ones((B, K), dtype=bool))
    f = fate[bi, ji]
    add(bi, lanes[bi, ji], kinds[f], T[bi] + rel[bi, ji, 0], T[bi] + rel[bi, ji, 1], e=expert[bi, ji], tok=1,
        nbytes=EXPERT_BYTES, cause=names[f])
    fb, fj = np.nonzero(fate == 2)
    add(fb, "copy0", "transfer-demand", T[fb] + cp_rel[fb, fj, 0], T[fb] + cp_rel[fb, fj, 1], e=expert[fb, fj],
        nbytes=EXPERT_BYTES, cause="demand")
    add(fb, "copy0", "evict", T[fb] + cp_rel[fb, fj, 0], T[fb] + cp_rel[fb, fj, 0], e=(expert[fb, fj] + 1) % 256,
        nbytes=EXPERT_BYTES, cause="evict")
    # prefetches for block b run on copy1 before it starts (issued while layer l-1 computes)
    pb, pj = np.nonzero((fate == 1) & (layer[:, None] > 0))
    order = np.lexsort((pj, pb))
    pb, pj = pb[order], pj[order]
    rank = pj.copy()
    if pb.size:
        first = np.r_[True, pb[1:] != pb[:-1]]
        idx = np.arange(pb.size)
        rank = idx - np.maximum.accumulate(np.where(first, idx, 0))
    dur = copy_d[pb, pj] * 0.4  # a prefetch of a layer ahead (a partial copy: the hot part)
    n_b = np.bincount(pb, minlength=B)[pb]
    p0 = T[pb] - (n_b - rank) * 760.0  # back to back on copy1, the last one done as the layer starts
    add(pb, "copy1", "transfer-prefetch", p0, p0 + dur, e=expert[pb, pj], nbytes=EXPERT_BYTES, cause="prefetch")
    add(pb, "copy1", "evict", p0, p0, e=(expert[pb, pj] + 7) % 256, nbytes=EXPERT_BYTES, cause="evict")
    df = pd.concat(parts, ignore_index=True)
    df.insert(0, "run", run)
    df = df[list(COLUMNS)]
    return df.sort_values("t_start_us", kind="stable").reset_index(drop=True)
