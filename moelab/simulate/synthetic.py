"""Synthetic routing for models with no trace, with statistics fitted from a recorded one.

:func:`fit_routing_stats` measures four statistics of a routing source (a recorded
:class:`~moelab.trace.reader.RoutingTrace`, a trace path, or :class:`ForwardRouting` objects),
per MoE layer, on decode tokens:

* **skew** — the exponent ``s`` of a Zipf popularity ``p_r ∝ r^-s`` over expert ranks, sampled
  top-k without replacement (Plackett–Luce / Gumbel top-k), whose sorted selection shares match
  the observed ones at the same number of tokens (so sampling noise is not mistaken for skew);
* **reuse** — the probability that an expert a sequence used at decode step t is used again at
  t+1 in the same layer (``|S_t ∩ S_{t+1}| / K``), and its chance level (independent tokens with
  the same popularity: ``Σ π_e² / K``, π the per-token inclusion frequencies);
* **adjacent** — how predictable layer l's experts are from layer l−1's for the same token: the
  fraction of ``S_l`` in the top-K of the naive-Bayes score
  ``log P(e') + Σ_{e ∈ S_{l−1}} log(P(e' | e) / P(e'))`` (frequencies estimated on the other
  half of the sequences, 2-fold, shrunk towards popularity by 8 pseudo-uses), and its chance
  level (the top-K experts by popularity, also cross-fitted). A predictor learnt from
  co-occurrences improves with data, so this one is measured on random subsamples of a fixed
  size, ~100 uses per expert (``100 E / K`` tokens), averaged over up to 8 of them; a source
  with fewer tokens underestimates it (logged);
* **weights** — the mean top-k weight profile (each row's weights as fractions of their sum,
  descending), the mean row sum and the log-normal spread of the fractions.

:func:`synthetic_routing` generates routing with these statistics for any
:class:`~moelab.timing.shapes.ModelShape`, as a seeded Markov model over tokens and layers:
per sequence, token and MoE layer the K experts are the Gumbel top-K of the logits

    log p_l(e)  +  alpha_l · [e ∈ S_{t−1, l}]  +  beta_l · [e ∈ succ_l(S_{t, l−1})]

— the layer's Zipf popularity (experts assigned to ranks at random per layer), a bonus for
the experts this sequence used at the previous step in this layer (reuse), and one for the
successors of the experts this token used in the previous layer (adjacency; ``succ_l`` maps the
r-th most popular expert of layer l−1 to the r-th of layer l, so the bonus keeps popularity in
place). The order of the K experts (their weight rank) is the order of their perturbed logits.
The token's weights are drawn from the weight profile independently of which experts they go
to. ``alpha``, ``beta`` and the exponent are calibrated layer by layer on pilot runs with common
random numbers (bisection on the bonuses, secant steps on the exponent) so that the generated
statistics, measured as above, match the targets; in a deep target stretched from a shallow
source, layers deep in a run of alike layers start from their predecessor's values. Limits: a
layer cannot reuse less than it inherits by copying from a previous layer with high reuse (its
reuse bonus is then 0 and the reuse comes out above the target); calibration costs pilot runs
(seconds for tens of experts; minutes for DeepSeek-V3's 256 × 58 on a busy 2-core machine;
cached per process).

Rescaling to another E, K or number of layers (:meth:`RoutingStats.for_shape`), documented
because a synthetic run is only as good as this assumption:

* the Zipf exponent is kept (a scale-free popularity law over the new number of experts);
* reuse and adjacency keep their **lift over chance**, ``(x − chance) / (1 − chance)``: the
  fraction of slots that repeat (or follow the previous layer) beyond what popularity alone
  gives; the chance levels are recomputed for the target E, K and skew;
* target layer j takes the statistics of source layer ``round(j (L−1) / (L'−1))`` (same
  relative depth; target layers after the first that map to source layer 0, which has no
  previous layer, take source layer 1's adjacency);
* the weight profile is interpolated over the relative rank ``k / (K−1)`` and renormalised.

With the same E, K and layers the statistics are used as measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.routing import ForwardRouting
from moelab.timing.shapes import ModelShape, get_shape

log = logging.getLogger(__name__)


def _one_blas_thread():
    """The matrices here are small: BLAS threads only contend (10× slower on a busy machine)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn brings it
        return contextlib.nullcontext()
    return threadpool_limits(1)



# ---------------------------------------------------------------------- the statistics
@dataclass(frozen=True)
class RoutingStats:
    """Routing statistics per MoE layer (see the module docstring for the definitions)."""

    num_experts: int
    top_k: int
    skew: tuple[float, ...]
    reuse: tuple[float, ...]
    reuse_chance: tuple[float, ...]
    adjacent: tuple[float, ...]
    """Layer l from layer l−1; entry 0 (no previous layer) is NaN."""
    adjacent_chance: tuple[float, ...]
    weight_profile: tuple[float, ...]
    weight_sum: float = 1.0
    weight_spread: float = 0.0
    tokens: int = 0
    """Decode tokens the statistics were measured on (per layer)."""
    source: str = ""

    def __post_init__(self) -> None:
        L = len(self.skew)
        if L < 1:
            raise MoelabError("routing statistics need at least one MoE layer.")
        for name in ("reuse", "reuse_chance", "adjacent", "adjacent_chance"):
            if len(getattr(self, name)) != L:
                raise MoelabError(f"routing statistics: {name} has {len(getattr(self, name))} layers, skew has {L}.")
        if len(self.weight_profile) != self.top_k:
            raise MoelabError(
                f"routing statistics: weight_profile has {len(self.weight_profile)} ranks, top_k is {self.top_k}."
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise MoelabError(f"routing statistics: top_k {self.top_k} must be in 1..num_experts ({self.num_experts}).")

    @property
    def num_layers(self) -> int:
        return len(self.skew)

    @property
    def reuse_lift(self) -> tuple[float, ...]:
        return tuple(_lift(x, c) for x, c in zip(self.reuse, self.reuse_chance))

    @property
    def adjacent_lift(self) -> tuple[float, ...]:
        return tuple(_lift(x, c) for x, c in zip(self.adjacent, self.adjacent_chance))

    def table(self):
        """A pandas DataFrame, one row per MoE layer."""
        import pandas as pd

        return pd.DataFrame({
            "moe_layer": range(self.num_layers),
            "zipf_s": self.skew,
            "reuse": self.reuse,
            "reuse_chance": self.reuse_chance,
            "reuse_lift": self.reuse_lift,
            "adjacent": self.adjacent,
            "adjacent_chance": self.adjacent_chance,
            "adjacent_lift": self.adjacent_lift,
        })

    def __str__(self) -> str:
        head = (f"routing statistics of {self.source or 'a routing source'}: E={self.num_experts}, "
                f"K={self.top_k}, {self.num_layers} MoE layers, {self.tokens} decode tokens")
        rows = ["layer  zipf_s  reuse (chance, lift)      adjacent (chance, lift)"]
        for i in range(self.num_layers):
            adj = ("     —" if math.isnan(self.adjacent[i]) else
                   f"{self.adjacent[i]:6.3f} ({self.adjacent_chance[i]:.3f}, {self.adjacent_lift[i]:+.3f})")
            rows.append(f"{i:5d}  {self.skew[i]:6.3f}  {self.reuse[i]:6.3f} ({self.reuse_chance[i]:.3f}, "
                        f"{self.reuse_lift[i]:+.3f})   {adj}")
        prof = " ".join(f"{w:.3f}" for w in self.weight_profile)
        tail = (f"top-k weight profile (fractions of the row sum, descending): {prof}; mean row sum "
                f"{self.weight_sum:.3f}, log-spread {self.weight_spread:.3f}")
        return "\n".join([head, *rows, tail])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingStats:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MoelabError(f"routing statistics: unknown fields {unknown}; expected {sorted(known)}.")
        kw = {k: tuple(float(x) for x in v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**kw)

    @classmethod
    def from_lifts(cls, num_experts: int, top_k: int, skew: Sequence[float], reuse_lift: Sequence[float],
                   adjacent_lift: Sequence[float], weight_profile: Sequence[float] | None = None, *,
                   weight_sum: float = 1.0, weight_spread: float = 0.0, seed: int = 0,
                   source: str = "chosen by hand") -> RoutingStats:
        """Statistics stated by hand (what-if studies): the Zipf exponent and the reuse and
        adjacency lifts per layer (adjacent_lift[0] is ignored); chance levels are those of the
        Zipf popularity at this E and K.

        Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
        command), so a call names only what it changes; a settings object would be one more thing to build.
        """
        L = len(skew)
        if len(reuse_lift) != L or len(adjacent_lift) != L:
            raise MoelabError(f"from_lifts: skew, reuse_lift and adjacent_lift need one value per layer "
                              f"(got {L}, {len(reuse_lift)}, {len(adjacent_lift)}).")
        for name, xs in (("reuse_lift", reuse_lift), ("adjacent_lift", list(adjacent_lift)[1:])):
            bad = [x for x in xs if not 0.0 <= x < 1.0]
            if bad:
                raise MoelabError(f"from_lifts: {name} values {bad} are outside [0, 1).")
        rc, ac = [], []
        for s in skew:
            pi = _pl_inclusion(float(s), num_experts, top_k, seed)
            rc.append(float(np.sum(pi**2) / top_k))
            ac.append(float(np.sort(pi)[::-1][:top_k].sum() / top_k))
        reuse = [c + x * (1 - c) for c, x in zip(rc, reuse_lift)]
        adj = [float("nan")] + [c + x * (1 - c) for c, x in zip(ac[1:], list(adjacent_lift)[1:])]
        ac[0] = float("nan")
        profile = _rescale_profile(weight_profile if weight_profile is not None else [1.0] * top_k, top_k)
        return cls(num_experts=num_experts, top_k=top_k, skew=tuple(float(x) for x in skew), reuse=tuple(reuse),
                   reuse_chance=tuple(rc), adjacent=tuple(adj), adjacent_chance=tuple(ac),
                   weight_profile=profile, weight_sum=weight_sum, weight_spread=weight_spread, source=source)

    # ------------------------------------------------------------------ rescaling
    def for_shape(self, num_experts: int, top_k: int, num_layers: int, *, seed: int = 0) -> RoutingStats:
        """These statistics carried to E, K and MoE layers of another model (module docstring)."""
        if not 1 <= top_k <= num_experts:
            raise MoelabError(f"top_k {top_k} must be in 1..num_experts ({num_experts}).")
        if num_layers < 1:
            raise MoelabError(f"num_layers must be ≥ 1, got {num_layers}.")
        same_ek = num_experts == self.num_experts and top_k == self.top_k
        if same_ek and num_layers == self.num_layers:
            return self
        src = _layer_map(self.num_layers, num_layers)
        skew = tuple(self.skew[j] for j in src)
        if same_ek:
            pick = lambda xs: tuple(xs[j] for j in src)  # noqa: E731
            reuse, reuse_c = pick(self.reuse), pick(self.reuse_chance)
            adj, adj_c = list(pick(self.adjacent)), list(pick(self.adjacent_chance))
            if self.num_layers > 1:  # as below: layers mapped to source layer 0 take layer 1's
                for n, j in enumerate(src):
                    if n and j == 0:
                        adj[n], adj_c[n] = self.adjacent[1], self.adjacent_chance[1]
        else:
            reuse, reuse_c, adj, adj_c = [], [], [], []
            for n, (j, s) in enumerate(zip(src, skew)):
                pi = _pl_inclusion(s, num_experts, top_k, seed)
                rc = float(np.sum(pi**2) / top_k)
                ac = float(np.sort(pi)[::-1][:top_k].sum() / top_k)
                reuse_c.append(rc)
                reuse.append(rc + self.reuse_lift[j] * (1 - rc))
                adj_c.append(ac)
                # a target layer after the first that maps to source layer 0 (which has no
                # previous layer) takes source layer 1's adjacency
                lift = self.adjacent_lift[1 if n and j == 0 and self.num_layers > 1 else j]
                adj.append(ac + (lift if not math.isnan(lift) else 0.0) * (1 - ac))
        adj[0] = adj_c[0] = float("nan")
        if num_layers > 1 and math.isnan(adj[1]):  # the source had one layer: no adjacency measured
            adj[1:] = adj_c[1:]
        return RoutingStats(
            num_experts=num_experts, top_k=top_k, skew=skew, reuse=tuple(reuse), reuse_chance=tuple(reuse_c),
            adjacent=tuple(adj), adjacent_chance=tuple(adj_c),
            weight_profile=_rescale_profile(self.weight_profile, top_k), weight_sum=self.weight_sum,
            weight_spread=self.weight_spread, tokens=self.tokens,
            source=f"{self.source or 'statistics'} rescaled to E={num_experts}, K={top_k}, {num_layers} layers",
        )


def _lift(x: float, chance: float) -> float:
    if math.isnan(x) or math.isnan(chance):
        return float("nan")
    return (x - chance) / (1 - chance) if chance < 1 else 0.0


def _layer_map(src: int, dst: int) -> list[int]:
    if dst == 1:
        return [0]
    return [int(round(j * (src - 1) / (dst - 1))) for j in range(dst)]


def _rescale_profile(profile: Sequence[float], k: int) -> tuple[float, ...]:
    p = np.asarray(profile, dtype=float)
    if len(p) == k:
        return tuple(float(x) for x in p)
    if len(p) == 1:
        out = np.full(k, 1.0 / k)
    else:
        out = np.interp(np.linspace(0, 1, k), np.linspace(0, 1, len(p)), p)
    return tuple(float(x) for x in out / out.sum())


# ---------------------------------------------------------------------- Zipf / Plackett–Luce helpers
def _zipf_logp(s: float, E: int) -> np.ndarray:
    """Log-popularity by rank (rank 0 the most popular)."""
    lp = -s * np.log(np.arange(1, E + 1, dtype=np.float64))
    return lp - np.logaddexp.reduce(lp)


def _topk_counts(logits: np.ndarray, K: int) -> np.ndarray:
    """Per column, how many rows have it in their top-K (rows: draws)."""
    top = np.argpartition(-logits, K - 1, axis=1)[:, :K]
    return np.bincount(top.ravel(), minlength=logits.shape[1])


#: Zipf exponents at which the Plackett–Luce inclusion probabilities are tabulated.
_S_GRID = np.linspace(0.0, 6.0, 61)


@functools.lru_cache(maxsize=32)
def _inclusion_table(E: int, K: int) -> np.ndarray:
    """(len(_S_GRID), E): per-token inclusion probabilities by popularity rank of Gumbel-top-K
    draws from Zipf(s), one row per grid exponent (common random numbers: smooth in s)."""
    rng = np.random.default_rng(0x5F1)
    draws = int(np.clip(100_000 // E, 1000, 4000))
    g = rng.gumbel(size=(draws, E))
    ranks = np.log(np.arange(1, E + 1, dtype=np.float64))
    table = np.stack([_topk_counts(-s * ranks[None] + g, K) / draws for s in _S_GRID])
    return -np.sort(-table, axis=1)  # by rank: monotone (MC noise aside)


def _pl_inclusion(s: float, E: int, K: int, seed: int = 0) -> np.ndarray:
    """Per-token inclusion probabilities (sum K) of Gumbel-top-K draws from Zipf(s), by rank."""
    table = _inclusion_table(E, K)
    x = float(np.clip(s, _S_GRID[0], _S_GRID[-1])) / (_S_GRID[1] - _S_GRID[0])
    i = min(int(x), len(_S_GRID) - 2)
    f = x - i
    return (1 - f) * table[i] + f * table[i + 1]


def _fit_zipf(counts: np.ndarray, K: int, n_tokens: int, seed: int = 0,
              bracket: tuple[float, float] = (0.0, 6.0)) -> float:
    """The Zipf exponent whose Gumbel-top-K draws, at the same number of tokens, give sorted
    selection shares closest (least squares) to the observed ``counts``. The expected sorted
    shares at N tokens are those of binomial counts ``Binomial(N, π_r)`` around the tabulated
    inclusion probabilities, sorted (so sampling noise is not mistaken for skew)."""
    E = len(counts)
    if n_tokens < 1 or K >= E:
        return 0.0
    obs = np.sort(counts)[::-1] / counts.sum()
    z = np.random.default_rng(seed).standard_normal((32, E))  # common random numbers
    N = float(n_tokens)

    def err(s: float) -> float:
        pi = _pl_inclusion(s, E, K)
        c = np.maximum(N * pi + np.sqrt(N * pi * (1 - np.minimum(pi, 1.0))) * z, 0.0)
        c = -np.sort(-c, axis=1)
        shares = (c / np.maximum(c.sum(1, keepdims=True), 1e-12)).mean(0)
        return float(np.sum((shares - obs) ** 2))

    lo, hi = bracket
    invphi = (math.sqrt(5) - 1) / 2
    a, b = hi - invphi * (hi - lo), lo + invphi * (hi - lo)
    fa, fb = err(a), err(b)
    for _ in range(40):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - invphi * (hi - lo)
            fa = err(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + invphi * (hi - lo)
            fb = err(b)
        if hi - lo < 2e-3:
            break
    s = (lo + hi) / 2
    return s if bracket[0] > 0 or err(s) <= err(0.0) else 0.0


# ---------------------------------------------------------------------- measuring
@dataclass
class _Table:
    """Decode routing as flat arrays: one row per (token, MoE layer)."""

    seq: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    ids: np.ndarray  # (rows, K) int
    weights: np.ndarray  # (rows, K) float
    num_experts: int
    num_layers: int
    source: str
    pos: np.ndarray | None = None
    """Position of each row's token in its sequence (None: the step; decode has one token per step)."""

    def token_key(self) -> np.ndarray:
        """A key unique per token and shared by its rows in every layer: (sequence, position)."""
        return self.seq * (1 << 32) + (self.pos if self.pos is not None else self.step)


def _table_from_trace(trace) -> _Table:
    phase = trace.column("phase")
    rows = phase == "decode"
    if not rows.any():
        log.warning("trace %s has no decode tokens; fitting routing statistics on its prompt tokens", trace.path)
        rows = np.ones(len(phase), dtype=bool)
    if len(set(trace.num_experts_per_layer)) > 1 or len(set(trace.top_k_per_layer)) > 1:
        raise MoelabError(f"trace {str(trace.path)!r}: MoE layers differ in E or top-k; synthetic routing "
                          "assumes alike layers.")
    return _Table(
        seq=trace.column("seq")[rows].astype(np.int64),
        step=trace.column("step")[rows].astype(np.int64),
        layer=trace.column("moe_layer")[rows].astype(np.int64),
        ids=trace.experts_array()[rows].astype(np.int64),
        weights=trace.weights_array()[rows].astype(np.float64),
        num_experts=trace.num_experts,
        num_layers=trace.num_moe_layers,
        source=str(trace.meta["model"].get("name") or trace.path) + f" trace {trace.path}",
        pos=trace.column("pos")[rows].astype(np.int64),
    )


def _table_from_forwards(forwards: Iterable[Any], num_experts: int | None) -> _Table:
    seq, step, layer, ids, weights = [], [], [], [], []
    L = K = None
    E_seen = 0
    for f in forwards:
        if f.phase != "decode":
            continue
        if L is None:
            L, K = len(f.ids), f.ids[0].shape[1]
        if len(f.ids) != L or any(x.shape[1] != K for x in f.ids):
            raise MoelabError(f"forward {f.forward}: {len(f.ids)} MoE layers of top-k "
                              f"{sorted({x.shape[1] for x in f.ids})}, expected {L} layers of top-k {K}.")
        for li in range(L):
            seq.append(np.arange(f.tokens))
            step.append(np.full(f.tokens, f.step))
            layer.append(np.full(f.tokens, li))
            ids.append(np.asarray(f.ids[li][: f.tokens], dtype=np.int64))
            weights.append(np.asarray(f.weights[li][: f.tokens], dtype=np.float64))
            E_seen = max(E_seen, int(ids[-1].max(initial=-1)) + 1)
    if L is None:
        raise MoelabError("the routing source has no decode forwards; give at least two decode steps.")
    return _Table(np.concatenate(seq), np.concatenate(step), np.concatenate(layer), np.concatenate(ids),
                  np.concatenate(weights), int(num_experts or E_seen), L, "forward routing")


def _membership(ids: np.ndarray, E: int) -> np.ndarray:
    m = np.zeros((len(ids), E), dtype=bool)
    rows = np.broadcast_to(np.arange(len(ids))[:, None], ids.shape)
    ok = ids >= 0
    m[rows[ok], ids[ok]] = True
    return m


def _reuse(seq: np.ndarray, step: np.ndarray, member: np.ndarray, K: int) -> float:
    order = np.lexsort((step, seq))
    s, t, m = seq[order], step[order], member[order]
    nxt = (s[1:] == s[:-1]) & (t[1:] == t[:-1] + 1)
    if not nxt.any():
        return float("nan")
    return float((m[1:][nxt] & m[:-1][nxt]).sum(1).mean() / K)


#: Pseudo-uses of the popularity prior in the conditional frequencies of the adjacency predictor.
_PRIOR = 8.0


def _adjacent(prev: np.ndarray, cur: np.ndarray, folds: np.ndarray, K: int) -> tuple[float, float]:
    """(hit rate of the conditional predictor, hit rate of the popularity predictor), 2-fold."""
    hits, chance, n = 0.0, 0.0, 0
    for f in (0, 1):
        train, test = folds != f, folds == f
        if not train.any() or not test.any():
            continue
        P, C = prev[train].astype(np.float64), cur[train].astype(np.float64)
        pop = C.mean(0)
        # P(e' in S_l | e in S_{l-1}), shrunk towards popularity with a prior of _PRIOR uses
        cond = (P.T @ C + _PRIOR * pop[None]) / (P.sum(0) + _PRIOR)[:, None]
        # naive Bayes: log P(e') + Σ_{e ∈ S_{l-1}} log(P(e' | e) / P(e'))
        logpop = np.log(np.maximum(pop, 1e-12))
        pmi = np.log(np.maximum(cond, 1e-12)) - logpop[None]
        score = logpop[None] + prev[test].astype(np.float64) @ pmi
        pred = np.argpartition(-score, K - 1, axis=1)[:, :K]
        truth = cur[test]
        hits += np.take_along_axis(truth, pred, axis=1).sum()
        chance += truth[:, np.argsort(-pop, kind="stable")[:K]].sum()
        n += int(test.sum())
    if n == 0:
        return float("nan"), float("nan")
    return hits / (n * K), chance / (n * K)


#: The adjacency statistic is measured on subsamples of ``_ADJ_USES × E / K`` tokens (each
#: expert used ~100 times): a predictor learnt from co-occurrences gets better with more tokens,
#: so the statistic is defined at one data size per expert, whatever the source's size.
_ADJ_USES = 100
_ADJ_SUBSAMPLES = 8


def _adjacent_at_reference(prev: np.ndarray, cur: np.ndarray, folds: np.ndarray, K: int,
                           seed: int) -> tuple[float, float]:
    """:func:`_adjacent` averaged over up to 8 disjoint random subsamples of the reference size
    (all tokens when there are fewer; the statistic is then underestimated — logged)."""
    n, E = prev.shape
    ref = int(math.ceil(_ADJ_USES * E / K))
    if n < ref:
        log.info("adjacency measured on %d tokens, fewer than the reference %d (E=%d, K=%d): "
                 "it is underestimated", n, ref, E, K)
        return _adjacent(prev, cur, folds, K)
    order = np.random.default_rng(seed).permutation(n)
    out = [_adjacent(prev[rows], cur[rows], folds[rows], K)
           for rows in (np.sort(order[i * ref:(i + 1) * ref]) for i in range(min(_ADJ_SUBSAMPLES, n // ref)))]
    return float(np.mean([h for h, _ in out])), float(np.mean([c for _, c in out]))


def _measure(t: _Table, seed: int = 0, *, fit_skew: bool = True) -> RoutingStats:
    E, L = t.num_experts, t.num_layers
    K = t.ids.shape[1]
    skew, reuse, reuse_c, adj, adj_c = [], [], [], [], []
    members: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    for li in range(L):
        r = t.layer == li
        m = _membership(t.ids[r], E)
        n = int(r.sum())
        pi = m.sum(0) / max(n, 1)
        skew.append(_fit_zipf(m.sum(0), K, n, seed + li) if fit_skew else float("nan"))
        reuse.append(_reuse(t.seq[r], t.step[r], m, K))
        reuse_c.append(float(np.sum(pi**2) / K))
        key = t.token_key()[r]  # (sequence, position): prompt forwards hold many tokens per step
        order = np.argsort(key, kind="stable")
        members.append(m[order])
        keys.append(key[order])
    adj.append(float("nan"))
    adj_c.append(float("nan"))
    for li in range(1, L):
        common, a, b = np.intersect1d(keys[li - 1], keys[li], assume_unique=True, return_indices=True)
        seqs = common >> 32
        folds = (np.unique(seqs, return_inverse=True)[1] % 2) if len(np.unique(seqs)) > 1 else (
            np.arange(len(common)) % 2)
        h, c = _adjacent_at_reference(members[li - 1][a], members[li][b], folds, K, seed + li)
        adj.append(h)
        adj_c.append(c)
    w = np.abs(t.weights)
    sums = w.sum(1)
    ok = sums > 0
    frac = np.sort(w[ok] / sums[ok, None], axis=1)[:, ::-1]
    profile = frac.mean(0) if len(frac) else np.full(K, 1.0 / K)
    with np.errstate(divide="ignore"):
        logf = np.log(np.where(frac > 0, frac, np.nan) / profile[None])
    spread = float(np.nanmean(np.nanstd(logf, axis=0))) if len(frac) > 1 else 0.0
    return RoutingStats(
        num_experts=E, top_k=K, skew=tuple(skew), reuse=tuple(reuse), reuse_chance=tuple(reuse_c),
        adjacent=tuple(adj), adjacent_chance=tuple(adj_c), weight_profile=tuple(float(x) for x in profile),
        weight_sum=float(sums[ok].mean()) if ok.any() else 1.0,
        weight_spread=0.0 if math.isnan(spread) else spread,
        tokens=int((t.layer == 0).sum()), source=t.source,
    )


def fit_routing_stats(source: Any, *, num_experts: int | None = None, seed: int = 0) -> RoutingStats:
    """Measure :class:`RoutingStats` of ``source``: a :class:`~moelab.trace.reader.RoutingTrace`,
    a trace directory, or an iterable of :class:`ForwardRouting` (decode forwards; sequence =
    row of the forward). ``num_experts`` is needed for forwards that do not use every expert."""
    from moelab.trace.reader import RoutingTrace, open_trace

    if isinstance(source, (str, Path)):
        source = open_trace(source)
    table = _table_from_trace(source) if isinstance(source, RoutingTrace) else _table_from_forwards(source, num_experts)
    if len(np.unique(table.step)) < 2:
        log.warning("%s has fewer than two decode steps: reuse across steps cannot be measured", table.source)
    with _one_blas_thread():
        return _measure(table, seed)


# ---------------------------------------------------------------------- generating
class _Generator:
    """The logit-bias Markov model (module docstring), vectorised over rows (sequences)."""

    def __init__(self, E: int, K: int, skew: Sequence[float], alpha: np.ndarray, beta: np.ndarray,
                 stats: RoutingStats, rng: np.random.Generator, layout_seed: int) -> None:
        self.E, self.K, self.L = E, K, len(skew)
        self.rng = rng
        self.alpha, self.beta = np.asarray(alpha, dtype=float), np.asarray(beta, dtype=float)
        self.stats = stats
        # expert → popularity rank, fresh per layer (from the seed alone, so that calibration
        # pilots and the final run share it); the successor map is rank-preserving
        layout = np.random.default_rng([layout_seed, 0x5EED])
        self.rank_to_expert = np.stack([layout.permutation(E) for _ in range(self.L)])
        self.logp = np.empty((self.L, E))
        self.succ = np.zeros((self.L, E), dtype=np.int64)
        for li, s in enumerate(skew):
            self.logp[li, self.rank_to_expert[li]] = _zipf_logp(float(s), E)
            if li:
                self.succ[li, self.rank_to_expert[li - 1]] = self.rank_to_expert[li]

    def token(self, n: int, li: int, prev_same: np.ndarray | None, prev_layer: np.ndarray | None) -> np.ndarray:
        """(n, K) ids of one token per row in layer ``li`` (descending weight), given the rows'
        previous token in this layer and this token in the previous layer (None: none)."""
        logits = self.logp[li][None] + self.rng.gumbel(size=(n, self.E))
        if prev_same is not None and self.alpha[li]:
            logits += self.alpha[li] * _membership(prev_same, self.E)
        if prev_layer is not None and self.beta[li]:
            logits += self.beta[li] * _membership(self.succ[li][prev_layer], self.E)
        top = np.argpartition(-logits, self.K - 1, axis=1)[:, : self.K]
        order = np.argsort(-np.take_along_axis(logits, top, axis=1), axis=1)
        return np.take_along_axis(top, order, axis=1).astype(np.int64)

    def weights(self, n: int) -> np.ndarray:
        prof = np.asarray(self.stats.weight_profile, dtype=np.float64)
        sd = self.stats.weight_spread
        w = prof[None] * np.exp(sd * self.rng.standard_normal((n, self.K)) - sd * sd / 2)
        w = np.sort(w / w.sum(1, keepdims=True), axis=1)[:, ::-1] * self.stats.weight_sum
        return np.ascontiguousarray(w, dtype=np.float32)

    def run(self, steps: int, batch: int, prompt_len: int):
        """Yield (phase, step, ids per layer) forwards: a prompt, then decode steps."""
        last: list[np.ndarray | None] = [None] * self.L
        if prompt_len:
            cols: list[list[np.ndarray]] = [[] for _ in range(self.L)]
            for _ in range(prompt_len):
                prev = None
                for li in range(self.L):
                    ids = self.token(batch, li, last[li], prev)
                    cols[li].append(ids)
                    last[li] = prev = ids
            # rows of the prompt forward: sequence-major (seq 0's tokens, then seq 1's, ...)
            yield "prefill", 0, [np.stack(c, axis=1).reshape(batch * prompt_len, self.K) for c in cols]
        for t in range(1, steps + 1):
            prev = None
            out = []
            for li in range(self.L):
                ids = self.token(batch, li, last[li], prev)
                out.append(ids)
                last[li] = prev = ids
            yield "decode", t, out


def _lifts(stats: RoutingStats) -> tuple[np.ndarray, np.ndarray]:
    rl = np.nan_to_num(np.asarray(stats.reuse_lift, dtype=float), nan=0.0)
    al = np.nan_to_num(np.asarray(stats.adjacent_lift, dtype=float), nan=0.0)
    return rl, al


#: Largest logit bonus the calibration tries (a bonus of 12 nats makes a copy all but certain).
_MAX_BONUS = 12.0


def _calibrate(stats: RoutingStats, seed: int, *, reuse_params: Sequence[bool] | None = None,
               iterations: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, the Zipf exponent and the logit bonuses (alpha: previous step, beta: previous
    layer's successors) that reproduce ``stats``' skew and reuse/adjacency lifts.

    Layer by layer on one pilot (layer l's routing depends only on its own previous step and on
    layer l−1, which is already calibrated and kept): bisection on one bonus at a time (each
    lift grows with its own bonus; the reuse bonus, then the adjacency bonus), then fixed-point
    (secant) steps on the exponent with the bonuses fixed; then all three again, the bonuses in
    narrower brackets. ``reuse_params[l]``: layer l takes layer l−1's parameters without a search
    (deep inside a run of layers carrying the same statistics, where the chain has settled)."""
    E, K, L = stats.num_experts, stats.top_k, stats.num_layers
    want_r, want_a = _lifts(stats)
    want_s = np.asarray(stats.skew, dtype=float)
    reuse_params = list(reuse_params or [False] * L)
    # pilot tokens: up to 8 adjacency reference subsamples (_ADJ_USES uses per expert each), at
    # least 2048 tokens for the reuse estimate, at most 8192
    batch = 64
    steps = int(np.clip(_ADJ_SUBSAMPLES * _ADJ_USES * E // K, 2048, 8192)) // batch
    skew, alpha, beta = want_s.copy(), np.zeros(L), np.zeros(L)
    seq = np.repeat(np.arange(batch)[None], steps, 0).ravel()
    step = np.repeat(np.arange(steps), batch)
    folds = seq % 2
    prev_col: list[np.ndarray] | None = None  # layer l−1's pilot ids per step
    prev_m: np.ndarray | None = None

    # the reuse search needs only 2048 tokens: a shorter prefix of the same pilot
    short = min(steps, 2048 // batch)
    n_short = short * batch

    def pilot(li: int, n_steps: int = steps) -> tuple[list[np.ndarray], np.ndarray]:
        # common random numbers: every pilot of a layer draws the same noise (a short pilot is a
        # prefix of the long one), so the measured lifts move smoothly with the bonuses and the
        # bisection is not misled by noise
        gen = _Generator(E, K, skew, alpha, beta, stats, np.random.default_rng([seed, li]), seed)
        col, last = [], None
        for t in range(n_steps):
            last = gen.token(batch, li, last, prev_col[t] if prev_col is not None else None)
            col.append(last)
        return col, _membership(np.concatenate(col), E)

    def fix_skew(li: int, n_iter: int, n_steps: int) -> None:
        """Secant steps on (exponent → fitted exponent), the bonuses fixed."""
        last: tuple[float, float] | None = None
        for _ in range(n_iter):
            _, m = pilot(li, n_steps)
            got_s = _fit_zipf(m.sum(0), K, len(m), seed + li, (max(0.0, skew[li] - 1.0), skew[li] + 1.0))
            slope = 1.0
            if last is not None and abs(skew[li] - last[0]) > 1e-3:
                slope = float(np.clip((got_s - last[1]) / (skew[li] - last[0]), 0.2, 2.0))
            last = (skew[li], got_s)
            skew[li] = float(np.clip(skew[li] + (want_s[li] - got_s) / slope, 0.0, 6.0))

    from tqdm.auto import tqdm

    bar = tqdm(total=L, desc="calibrating synthetic routing", unit="layer", leave=False,
               disable=L * E < 2048)
    for li in range(L):
        if li and reuse_params[li]:
            # the bonuses of the predecessor; the exponent re-corrected (copies along a run of
            # alike layers would otherwise drift the popularity)
            alpha[li], beta[li], skew[li] = alpha[li - 1], beta[li - 1], skew[li - 1]
            if want_s[li] > 0:
                fix_skew(li, 4, short)
            prev_col, prev_m = pilot(li)
            bar.update()
            continue
        # the reuse bonus, the adjacency bonus, the exponent (bonuses fixed), then the three
        # again, the bonuses in narrower brackets (each lift grows with its own bonus)
        for rnd, n_iter in enumerate((iterations, iterations, 4, iterations // 2, iterations // 2, 2)):
            if rnd in (2, 5):
                if want_s[li] > 0:
                    fix_skew(li, n_iter, steps)
                continue
            which = "alpha" if rnd in (0, 3) else "beta"
            want = want_r[li] if which == "alpha" else want_a[li]
            vec = alpha if which == "alpha" else beta
            if want <= 0 or (which == "beta" and prev_m is None):
                vec[li] = 0.0
                continue
            lo, hi = (0.0, _MAX_BONUS) if rnd < 2 else (0.5 * vec[li], 1.5 * vec[li] + 0.25)
            for i in range(n_iter):
                vec[li] = (lo + hi) / 2
                _, m = pilot(li, short if which == "alpha" else steps)
                if which == "alpha":
                    got = _lift(_reuse(seq[:n_short], step[:n_short], m, K), float(np.sum(m.mean(0) ** 2) / K))
                else:
                    got = _lift(*_adjacent_at_reference(prev_m, m, folds, K, seed + li))
                if got < want:
                    lo = vec[li]
                else:
                    hi = vec[li]
                if abs(got - want) < 0.003 and i >= 3:
                    break
            vec[li] = (lo + hi) / 2
        prev_col, prev_m = pilot(li)
        bar.update()
    bar.close()
    return skew, alpha, beta


#: Calibrations of this process, by (statistics, E, K, layers, seed): a grid of simulations over
#: one synthetic workload calibrates once.
_CALIBRATIONS: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

#: Bumped whenever the generator or the calibration changes (old files are then ignored).
CALIBRATION_VERSION = 1


def calibration_cache_dir() -> Path | None:
    """Where calibrations are kept between processes: ``$MOELAB_SYNTHETIC_CACHE`` (empty: off),
    else ``~/.cache/moelab/synthetic``."""
    import os

    env = os.environ.get("MOELAB_SYNTHETIC_CACHE")
    if env is not None:
        return Path(env) if env else None
    return Path.home() / ".cache" / "moelab" / "synthetic"


def _calibration_file(key: tuple) -> Path | None:
    import hashlib

    root = calibration_cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(json.dumps([CALIBRATION_VERSION, *key]).encode()).hexdigest()[:24]
    return root / f"calibration-{digest}.npz"


def _load_calibration(key: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    path = _calibration_file(key)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            out = (z["skew"], z["alpha"], z["beta"])
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed
        log.warning("ignoring unreadable synthetic-routing calibration %s", path)
        return None
    if any(len(x) != key[3] for x in out):
        return None
    return tuple(np.asarray(x, dtype=float) for x in out)  # type: ignore[return-value]


def _save_calibration(key: tuple, value: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Atomic: a temporary file in the same directory, renamed into place."""
    import os
    import tempfile

    path = _calibration_file(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, skew=value[0], alpha=value[1], beta=value[2])
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:  # a read-only home: calibrate again next time
        log.info("could not keep the synthetic-routing calibration at %s (%s)", path, e)


#: Share of the router's probability mass on the top-k experts when the statistics cannot say
#: (their weights were renormalised to sum to 1). Assumed: a middle value; softmax routers of
#: Mixtral/DeepSeek-class models put roughly 0.3-0.7 of their mass on the top-k at decode.
TOPK_MASS = 0.5


def router_scores(ids: np.ndarray, weights: np.ndarray, logp: np.ndarray, rng: np.random.Generator,
                  mass: float = TOPK_MASS) -> np.ndarray:
    """(n, E) float32 router probabilities consistent with a synthetic top-k: ``ids`` (n, K) are
    exactly the top-k of each row, in order, with probabilities in the ratio of ``weights`` and
    ``mass`` of the total (raised where needed so that the k-th stays above every other expert);
    the rest is the softmax of the layer's popularity logits ``logp`` (E,) plus unit normal noise
    over the other experts, flattened towards uniform only as far as needed to keep them below
    the k-th. Score-reading caches (``mrs``) then see popular experts score higher when not chosen,
    as they do on a real router."""
    ids = np.asarray(ids, dtype=np.int64)
    n, K = ids.shape
    E = int(logp.shape[0])
    frac = np.asarray(weights, dtype=np.float64)[:, :K]
    frac = frac / frac.sum(1, keepdims=True)
    rows = np.arange(n)[:, None]
    if E == K:
        out = np.zeros((n, E))
        out[rows, ids] = frac
        return out.astype(np.float32)
    u = 1.0 / (E - K)
    floor = 1.0 / (1.0 + (E - K) * frac[:, -1])  # the mass at which the k-th equals an even spread of the rest
    m = np.minimum(np.maximum(float(mass), floor + 1e-3 * (1 - floor)), 1 - 1e-9)
    p_sel = m[:, None] * frac
    z = logp[None, :] + rng.standard_normal((n, E))
    z[rows, ids] = -np.inf
    q = np.exp(z - z.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    t = p_sel[:, -1] / (1 - m) * (1 - 1e-6)  # the largest share of the rest that stays below the k-th
    a = q.max(1)
    mix = np.where(a > t, (a - t) / np.maximum(a - u, 1e-300), 0.0)[:, None]
    rest = (1 - mix) * q + mix * u
    rest[rows, ids] = 0.0
    out = rest * (1 - m)[:, None]
    out[rows, ids] = p_sel
    return out.astype(np.float32)


def synthetic_routing(shape: Any, stats: RoutingStats, steps: int = 64, batch: int = 1, prompt_len: int = 0,
                      seed: int = 0, *, calibrate: bool = True, scores: bool = False) -> list[ForwardRouting]:
    """Routing of ``batch`` sequences for ``shape`` (a :class:`ModelShape` or a name): a prompt
    forward of ``prompt_len`` tokens per sequence (if > 0), then ``steps`` decode forwards,
    with ``stats`` carried to the shape's E, K and MoE layers (:meth:`RoutingStats.for_shape`).
    A prompt's tokens follow the same chain position by position (the statistics are fitted on
    decode tokens; a prompt's own are not). Deterministic for a seed (calibrations are cached
    in the process and on disk: :func:`calibration_cache_dir`). ``calibrate=False`` skips the
    pilot runs and uses a rough
    lift → bonus guess (reuse and adjacency then miss their targets; for quick experiments).
    ``scores=True`` adds router probabilities (:func:`router_scores`; the top-k mass is the
    statistics' mean weight sum when below 1, else :data:`TOPK_MASS`) for score-reading caches
    such as ``mrs``, from a separate random stream (the ids and weights do not change)."""

    if not isinstance(shape, ModelShape):
        shape = get_shape(shape)
    for name, v, low in (("steps", steps, 0), ("batch", batch, 1), ("prompt_len", prompt_len, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise MoelabError(f"synthetic_routing: {name} is {v!r}, expected an integer ≥ {low}.")
    if not isinstance(stats, RoutingStats):
        raise MoelabError(f"synthetic_routing: stats must be RoutingStats (fit_routing_stats(trace)), got "
                          f"{type(stats).__name__}.")
    E, K, L = shape.num_experts, shape.top_k, shape.num_moe_layers
    target = stats.for_shape(E, K, L, seed=seed)
    if calibrate:
        # deep inside a run of target layers that carry one source layer's statistics, a layer
        # takes its predecessor's parameters (58 DeepSeek-V3 layers from 6 source layers: ~12
        # searches)
        key = (json.dumps(stats.to_dict(), sort_keys=True, default=str), E, K, L, seed)
        if key not in _CALIBRATIONS:
            found = _load_calibration(key)
            if found is None:
                src = _layer_map(stats.num_layers, L)
                same = [j >= 2 and src[j] == src[j - 1] == src[j - 2] for j in range(L)]
                with _one_blas_thread():
                    found = _calibrate(target, seed, reuse_params=same)
                _save_calibration(key, found)
            _CALIBRATIONS[key] = found
            while len(_CALIBRATIONS) > 32:
                _CALIBRATIONS.pop(next(iter(_CALIBRATIONS)))
        skew, alpha, beta = (x.copy() for x in _CALIBRATIONS[key])
    else:  # the lifts as logit bonuses: a rough first guess
        skew = np.asarray(target.skew, dtype=float)
        alpha, beta = (-np.log1p(-np.clip(x, 0, 0.99)) * 4 for x in _lifts(target))
    gen = _Generator(E, K, skew, alpha, beta, target, np.random.default_rng(seed), seed)
    score_rng = np.random.default_rng([seed, 0x5C0E])
    mass = float(target.weight_sum) if 0 < target.weight_sum < 0.999 else TOPK_MASS
    out = []
    for i, (phase, step, ids) in enumerate(gen.run(steps, batch, prompt_len)):
        n = len(ids[0])
        weights = [gen.weights(n) for _ in ids]
        sc = ([router_scores(x, w, gen.logp[li], score_rng, mass) for li, (x, w) in enumerate(zip(ids, weights))]
              if scores else None)
        out.append(ForwardRouting(forward=i, step=step, phase=phase, tokens=n, ids=ids, weights=weights, scores=sc))
    return out


# ---------------------------------------------------------------------- bad input
def check_trace_shape(trace: Any, shape: Any) -> None:
    """Raise one line if ``trace``'s experts / top-k / MoE layers do not match ``shape``."""
    E, K, L = trace.num_experts, trace.top_k, trace.num_moe_layers
    name = trace.meta["model"].get("name") or str(trace.path)
    if (shape.num_experts, shape.top_k, shape.num_moe_layers) != (E, K, L):
        raise MoelabError(
            f"trace {str(trace.path)!r} ({name}: E={E}, top-k {K}, {L} MoE layers) does not match model shape "
            f"{shape.name!r} (E={shape.num_experts}, top-k {shape.top_k}, {shape.num_moe_layers} MoE layers); "
            "use --synthetic (routing fitted from this trace) or the model shape the trace was recorded on."
        )





__all__ = ["TOPK_MASS", "ForwardRouting", "RoutingStats", "check_trace_shape", "fit_routing_stats", "main",
           "router_scores", "synthetic_routing"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moelab.simulate.synthetic TRACE [--shape NAME] [--json]``: print the routing
    statistics fitted from a trace (and, with ``--shape``, carried to that model's E, K, layers)."""
    import argparse


    ap = argparse.ArgumentParser(prog="python -m moelab.simulate.synthetic", description=main.__doc__)
    ap.add_argument("trace", help="a recorded trace directory (moelab trace ... --out DIR)")
    ap.add_argument("--shape", help="also show the statistics carried to this model shape (e.g. deepseek-v3)")
    ap.add_argument("--json", action="store_true", help="print the statistics as JSON")
    args = ap.parse_args(argv)
    try:
        stats = fit_routing_stats(args.trace)
        if args.shape:
            shape = get_shape(args.shape)
            stats = stats.for_shape(shape.num_experts, shape.top_k, shape.num_moe_layers)
    except MoelabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats.to_dict(), default=str) if args.json else stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
