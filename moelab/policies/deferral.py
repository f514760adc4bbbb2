"""Expert Deferral (KTransformers §4): run the lowest-weight routed experts one MoE layer late.

For each token the top-k routed experts of MoE layer k, ordered by router weight, are
split into I *immediate* and D *deferred* experts. The deferred experts are computed on
layer k's MoE input, and their weighted sum is added to the output of MoE layer k+1, so
layer k+1's attention does not see them and layer k+2 does::

    O_k = I_k + S_k(I_k) + R_{k-1}^def(I_{k-1}) + R_k^imm(I_k)

The last MoE layer never defers, shared experts are never deferred, and ``D = 0``
reproduces the model bit for bit.

>>> with moelab.ExpertDeferral(model, deferred=2):          # decode steps only (default)
...     out = model.generate(**inputs, max_new_tokens=32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from moelab.adapters import MoELayer
from moelab.errors import MoelabError
from moelab.forward.plan import demote_lowest_rows, small_tensor
from moelab.policies.base import (
    DEFERRED,
    IMMEDIATE,
    PerLayer,
    PolicyPhase,
    RoutingPolicy,
    SlotPlan,
    layer_label,
    resolve_per_layer,
)

BatchRule = Literal["per_token", "union"]
_PHASES = ("decode", "all")
_RULES = ("per_token", "union")


@dataclass
class DeferralConfig:
    """Settings of :class:`ExpertDeferral`. Give ``deferred`` or ``immediate``, not both."""

    deferred: PerLayer | None = None
    """D, deferred experts per token: one int for all MoE layers, a list with one value per
    MoE layer, or ``{moe layer ordinal: D}`` (other layers 0). A global value leaves the
    last MoE layer at 0; an explicit per-layer value there is an error."""
    immediate: PerLayer | None = None
    """I, immediate experts per token (D = top-k − I per layer, so layers whose top-k
    differ are handled); a global I ≥ a layer's top-k means no deferral in that layer."""
    phase: PolicyPhase = "decode"
    """``decode``: defer in decode steps only (prefill tokens cover nearly all experts
    anyway); ``all``: in prefill forwards too."""
    min_immediate: int = 2
    """Guard: a setting that leaves fewer immediate experts in any layer raises
    :class:`~moelab.errors.MoelabError` when the policy is applied (an error, not a
    warning). Set 0 to sweep every D up to top-k (the paper's Figure 13 does)."""
    batch_rule: BatchRule = "per_token"
    """``per_token``: each token defers its own D lowest-weight experts. ``union`` (the
    KTransformers implementation's rule): an expert immediate for any real token of the
    forward's batch is immediate for every token that selected it, so tokens may defer
    fewer than D experts; with one token per forward both rules agree."""

    def __post_init__(self) -> None:
        if (self.deferred is None) == (self.immediate is None):
            raise MoelabError(
                f"ExpertDeferral needs exactly one of deferred= or immediate=; got deferred={self.deferred!r}, "
                f"immediate={self.immediate!r}."
            )
        if self.phase not in _PHASES:
            raise MoelabError(f"phase={self.phase!r}: expected one of {', '.join(_PHASES)}.")
        if self.batch_rule not in _RULES:
            raise MoelabError(f"batch_rule={self.batch_rule!r}: expected one of {', '.join(_RULES)}.")
        if isinstance(self.min_immediate, bool) or not isinstance(self.min_immediate, int) or self.min_immediate < 0:
            raise MoelabError(f"min_immediate={self.min_immediate!r}: expected an integer ≥ 0.")


class ExpertDeferral(RoutingPolicy):
    """Expert Deferral on ``model`` as a reversible context manager (see the module docstring).

    ``ExpertDeferral(model, 2)`` or ``ExpertDeferral(model, immediate=6)``; keywords are
    :class:`DeferralConfig` fields, or pass ``config=``.
    """

    kind: ClassVar[str] = "deferral"
    config_class: ClassVar[type] = DeferralConfig

    def __init__(self, model: Any, deferred: PerLayer | None = None, *, config: DeferralConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model)
        if config is not None and (deferred is not None or kwargs):
            raise MoelabError("pass either config= or settings (deferred=, immediate=, ...), not both.")
        self.config = config or DeferralConfig(deferred=deferred, **kwargs)

    def _resolve(self, layers: list[MoELayer]) -> None:
        cfg = self.config
        last = len(layers) - 1
        if cfg.immediate is not None:
            imm = resolve_per_layer(cfg.immediate, layers, "immediate")
            explicit = not isinstance(cfg.immediate, int)
            deferred = []
            for layer, i in zip(layers, imm):
                if explicit and i > layer.top_k:
                    raise MoelabError(
                        f"immediate={i} for {layer_label(layer)}: a layer cannot have more immediate experts "
                        f"than its top-k; use 0..{layer.top_k}."
                    )
                deferred.append(max(layer.top_k - i, 0))
            if explicit and imm[last] < layers[last].top_k:
                raise MoelabError(
                    f"immediate={imm[last]} for the last {layer_label(layers[last])}: the last MoE layer never "
                    f"defers; set its immediate count to its top-k ({layers[last].top_k})."
                )
            deferred[last] = 0
        else:
            deferred = resolve_per_layer(cfg.deferred, layers, "deferred")
            if not isinstance(cfg.deferred, int) and deferred[last] != 0:
                raise MoelabError(
                    f"deferred={deferred[last]} for the last {layer_label(layers[last])}: the last MoE layer never "
                    "defers (nothing follows it to add the deferred output to); set it to 0."
                )
            deferred[last] = 0
        for layer, d in zip(layers, deferred):
            if d == 0:
                continue
            if d > layer.top_k:
                raise MoelabError(
                    f"deferred={d} for {layer_label(layer)}: a token has only {layer.top_k} routed experts there; "
                    f"use 0..{max(layer.top_k - cfg.min_immediate, 0)}."
                )
            if layer.top_k - d < cfg.min_immediate:
                raise MoelabError(
                    f"deferred={d} for {layer_label(layer)} leaves {layer.top_k - d} immediate expert(s), below "
                    f"min_immediate={cfg.min_immediate}; use deferred ≤ {max(layer.top_k - cfg.min_immediate, 0)} "
                    f"there, or lower min_immediate (min_immediate=0 allows any D ≤ top-k)."
                )
        self.deferred_: list[int] = deferred

    def _plan(self, plan: SlotPlan) -> None:
        d = self.deferred_[plan.layer.index]
        if d == 0:
            return
        if plan.small:
            return self._plan_small(plan, d)
        immediate = plan.state == IMMEDIATE
        n = immediate.sum(1)
        count = torch.clamp(torch.minimum(torch.full_like(n, d), n - self.config.min_immediate), min=0)
        plan.demote_lowest(count, IMMEDIATE, DEFERRED)
        if self.config.batch_rule == "union":
            chosen = (plan.state == IMMEDIATE) & plan.valid[:, None]
            union = torch.unique(plan.experts[chosen])
            promote = (plan.state == DEFERRED) & torch.isin(plan.experts, union)
            plan.state = torch.where(promote, torch.full_like(plan.state, IMMEDIATE), plan.state)

    def _plan_small(self, plan: SlotPlan, d: int) -> None:
        """:meth:`_plan` on lists for a decode-sized plan (:attr:`SlotPlan.small`): the same slots move."""
        state = plan.state.tolist()
        union = self.config.batch_rule == "union"
        defer_rows(state, plan.weights.float().tolist(), d, self.config.min_immediate,
                   plan.experts.tolist() if union else None, plan.valid.tolist() if union else None)
        plan.state = small_tensor(state, plan.state.dtype)


def defer_rows(state: list[list[int]], weights: list[list[float]], d: int, min_immediate: int,
               union_ids: list[list[int]] | None = None, valid: list[bool] | None = None) -> None:
    """Expert Deferral's edit of one layer's slot states on lists, in place (what
    :meth:`ExpertDeferral._plan` does to a plan's tensors): per token, the ``min(d, n − min_immediate)``
    lowest-weight of its ``n`` immediate slots become deferred; with ``union_ids`` (the rows' expert
    ids: the ``union`` batch rule) a deferred slot whose expert is immediate for any real token
    (``valid``; every row when None) runs immediately again. The hybrid planner's reference path
    runs this where the run hands it the deferral (:meth:`moelab.hybrid.planner.Planner.defer_with`).
    ``d = 0`` changes nothing (no union pass either), as the policy in a layer that does not defer."""
    if d <= 0:
        return
    counts = [max(min(d, sum(s == IMMEDIATE for s in row) - min_immediate), 0) for row in state]
    demote_lowest_rows(state, weights, counts, IMMEDIATE, DEFERRED)
    if union_ids is None:
        return
    rows = valid if valid is not None else [True] * len(state)
    union = {e for srow, erow, v in zip(state, union_ids, rows, strict=True) if v
             for s, e in zip(srow, erow, strict=True) if s == IMMEDIATE}
    for srow, erow in zip(state, union_ids, strict=True):
        for j, (s, e) in enumerate(zip(srow, erow, strict=True)):
            if s == DEFERRED and e in union:
                srow[j] = IMMEDIATE
