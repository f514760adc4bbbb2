"""What a cache simulation reports: :class:`CacheResult` (one run) and :class:`CacheSweep` (many)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class CacheResult:
    """Hit rates and traffic of one (policy, capacity, scope[, prefetch]) replay."""

    policy: str
    """Registry name of the policy."""
    capacity: float | int
    """Capacity as requested: a fraction of the experts (float) or a count (int)."""
    scope: str
    """``layer`` (per-MoE-layer slots) or ``global`` (one pool)."""
    slots: list[int]
    """Resolved slots per partition (one per MoE layer, or one)."""
    capacity_fraction: float
    """Total slots / total routed experts."""
    accesses: int
    """Expert accesses replayed."""
    hits: int
    """Accesses that found the expert cached."""
    evictions: int
    """Experts evicted (by demand misses and by prefetches)."""
    transfers: int
    """Experts moved into the cache (demand insertions + prefetches)."""
    expert_bytes: int
    """Bytes of one expert (1 when unknown: ``bytes_moved`` then counts experts, like ``transfers``)."""
    layer_accesses: list[int]
    """Accesses per MoE layer."""
    layer_hits: list[int]
    """Hits per MoE layer."""
    phase_accesses: dict[str, int]
    """Accesses per phase (``prefill`` / ``decode``)."""
    phase_hits: dict[str, int]
    """Hits per phase."""
    prefetch: str | None = None
    """Prefetch setting (``"oracle d=1 budget=4/layer"``: 4 transfers per MoE layer; ``/forward``:
    per forward pass) or None."""
    prefetched: int = 0
    """Experts inserted by prefetch."""
    prefetch_hits: int = 0
    """Demand hits on experts brought in by prefetch (first use)."""
    wasted_prefetches: int = 0
    """Prefetched experts evicted before use or never used."""
    backend: str = "fast"
    """``fast`` (compiled kernel) or ``reference`` (pure Python)."""
    model: str | None = None
    """Model name of the trace."""
    insertion: str = "always"
    """Insertion rule replayed: ``always`` (every miss inserted) or ``protect-step``."""
    replay: str = "forward"
    """Access order replayed: ``forward`` (one group per forward and layer) or ``sequence``."""
    hit: np.ndarray | None = field(default=None, repr=False)
    """(n,) uint8 hit flag per access (not serialised)."""

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def bytes_moved(self) -> int:
        return self.transfers * self.expert_bytes

    @property
    def prefetch_bytes(self) -> int:
        """Extra bytes moved by prefetching."""
        return self.prefetched * self.expert_bytes

    @property
    def layer_hit_rate(self) -> np.ndarray:
        acc = np.asarray(self.layer_accesses, dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(self.layer_hits, dtype=float) / acc

    @property
    def phase_hit_rate(self) -> dict[str, float]:
        return {p: (self.phase_hits[p] / a if a else float("nan")) for p, a in self.phase_accesses.items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("hit")
        d.update(
            misses=self.misses,
            hit_rate=self.hit_rate,
            bytes_moved=self.bytes_moved,
            prefetch_bytes=self.prefetch_bytes,
            layer_hit_rate=[None if np.isnan(x) else float(x) for x in self.layer_hit_rate],
            phase_hit_rate=self.phase_hit_rate,
        )
        return d

    def summary(self) -> str:
        s = (
            f"{self.policy:<7} {self.scope:<6} cap={_cap(self.capacity):>6} hit={self.hit_rate:7.2%} "
            f"misses={self.misses} moved={self.transfers} experts ({self.bytes_moved} bytes)"
        )
        if self.prefetch:
            s += f" [{self.prefetch}: prefetched={self.prefetched} hits={self.prefetch_hits} wasted={self.wasted_prefetches}]"
        return s


def _cap(c: float | int) -> str:
    return f"{c:.1%}" if isinstance(c, float) else str(c)


@dataclass
class CacheSweep:
    """The results of a sweep over policies × capacities × scopes (× prefetch)."""

    results: list[CacheResult]

    def __iter__(self):
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def to_frame(self):
        """One row per result: policy, capacity, scope, prefetch, hit_rate, misses, bytes, ..."""
        import pandas as pd

        rows = []
        for r in self.results:
            rows.append(
                dict(
                    policy=r.policy,
                    capacity=r.capacity,
                    capacity_fraction=r.capacity_fraction,
                    scope=r.scope,
                    prefetch=r.prefetch or "none",
                    hit_rate=r.hit_rate,
                    hits=r.hits,
                    misses=r.misses,
                    evictions=r.evictions,
                    transfers=r.transfers,
                    bytes_moved=r.bytes_moved,
                    prefetched=r.prefetched,
                    prefetch_hits=r.prefetch_hits,
                    wasted_prefetches=r.wasted_prefetches,
                    **{f"{p}_hit_rate": v for p, v in r.phase_hit_rate.items()},
                )
            )
        return pd.DataFrame(rows)

    def layer_frame(self):
        """Long format: one row per (result, MoE layer) with the layer's hit rate."""
        import pandas as pd

        rows = []
        for r in self.results:
            for ly, (a, h) in enumerate(zip(r.layer_accesses, r.layer_hits)):
                rows.append(
                    dict(
                        policy=r.policy,
                        capacity_fraction=r.capacity_fraction,
                        scope=r.scope,
                        prefetch=r.prefetch or "none",
                        layer=ly,
                        accesses=a,
                        hit_rate=h / a if a else float("nan"),
                    )
                )
        return pd.DataFrame(rows)

    def belady_gap(self, bound: str = "belady"):
        """Per (capacity, scope, prefetch): each policy's hit rate minus the ``bound`` policy's
        (no prefetch): ``belady`` (MIN, bounds policies that insert every miss) or
        ``belady-bypass`` (bounds every policy)."""
        df = self.to_frame()
        bel = df[(df.policy == bound) & (df.prefetch == "none")][["capacity_fraction", "scope", "hit_rate"]]
        bel = bel.rename(columns={"hit_rate": "belady_hit_rate"})
        out = df.merge(bel, on=["capacity_fraction", "scope"], how="left")
        out["gap_to_belady"] = out["hit_rate"] - out["belady_hit_rate"]
        return out
