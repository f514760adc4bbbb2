"""Expert Skipping: the baseline deferral is compared with — drop the S lowest-weight experts.

For each token, the S routed experts with the lowest router weights are not computed at
all; optionally the remaining weights are rescaled to the total weight of the token's
original top-k (``renormalize``), which is 1 for renormalising routers and keeps
DeepSeek's ``routed_scaling_factor``. Shared experts are never skipped.

>>> with moelab.ExpertSkipping(model, skipped=2, renormalize=True):
...     out = model.generate(**inputs, max_new_tokens=32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moelab.adapters import MoELayer
from moelab.errors import MoelabError
from moelab.policies.base import (
    DROPPED,
    PerLayer,
    PolicyPhase,
    RoutingPolicy,
    SlotPlan,
    layer_label,
    resolve_per_layer,
)

_PHASES = ("decode", "all")


@dataclass
class SkippingConfig:
    """Settings of :class:`ExpertSkipping`."""

    skipped: PerLayer = 0
    """S, experts skipped per token: one int for all MoE layers, a list with one value per
    MoE layer, or ``{moe layer ordinal: S}`` (other layers 0)."""
    renormalize: bool = False
    """Rescale the kept experts' weights so they sum to the token's original top-k total."""
    phase: PolicyPhase = "decode"
    """``decode``: skip in decode steps only (as deferral does by default); ``all``: in
    prefill forwards too."""
    last_layer: bool = True
    """Whether a global S applies to the last MoE layer too (deferral never acts there;
    set False to compare both on the same layers)."""
    min_kept: int = 1
    """Guard: a setting that keeps fewer routed experts in any layer raises
    :class:`~moelab.errors.MoelabError` when applied. 0 allows skipping all routed
    experts (only shared experts remain; the paper's Figure 13 goes that far)."""

    def __post_init__(self) -> None:
        if self.phase not in _PHASES:
            raise MoelabError(f"phase={self.phase!r}: expected one of {', '.join(_PHASES)}.")
        if isinstance(self.min_kept, bool) or not isinstance(self.min_kept, int) or self.min_kept < 0:
            raise MoelabError(f"min_kept={self.min_kept!r}: expected an integer ≥ 0.")


class ExpertSkipping(RoutingPolicy):
    """Expert Skipping on ``model`` as a reversible context manager (see the module docstring)."""

    kind: ClassVar[str] = "skipping"
    config_class: ClassVar[type] = SkippingConfig

    def __init__(self, model: Any, skipped: PerLayer | None = None, *, config: SkippingConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model)
        if config is not None and (skipped is not None or kwargs):
            raise MoelabError("pass either config= or settings (skipped=, renormalize=, ...), not both.")
        if config is None:
            config = SkippingConfig(**({"skipped": skipped} if skipped is not None else {}), **kwargs)
        self.config = config

    def _resolve(self, layers: list[MoELayer]) -> None:
        cfg = self.config
        skipped = resolve_per_layer(cfg.skipped, layers, "skipped")
        if isinstance(cfg.skipped, int) and not cfg.last_layer:
            skipped[-1] = 0
        for layer, s in zip(layers, skipped):
            if s and layer.top_k - s < cfg.min_kept:
                raise MoelabError(
                    f"skipped={s} for {layer_label(layer)} keeps {max(layer.top_k - s, 0)} routed expert(s), below "
                    f"min_kept={cfg.min_kept}; use skipped ≤ {max(layer.top_k - cfg.min_kept, 0)} there, or lower "
                    "min_kept (min_kept=0 allows skipping every routed expert)."
                )
        self.skipped_: list[int] = [min(s, layer.top_k) for layer, s in zip(layers, skipped)]

    def _plan(self, plan: SlotPlan) -> None:
        s = self.skipped_[plan.layer.index]
        if s == 0:
            return
        among = plan.state != DROPPED
        n = among.sum(1, keepdim=True)
        count = torch.clamp(torch.minimum(torch.full_like(n, s), n - self.config.min_kept), min=0)
        drop = among & (plan.rank(among) >= n - count)
        if not bool(drop.any()):
            return
        if self.config.renormalize:
            w = plan.weights.float()
            before = (w * among).sum(1, keepdim=True)
            after = (w * (among & ~drop)).sum(1, keepdim=True)
            scale = torch.where(after > 0, before / after.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
            plan.weights = (w * scale).to(plan.weights.dtype)
            plan.weights_changed = True
        plan.state = torch.where(drop, torch.full_like(plan.state, DROPPED), plan.state)
