"""``moelab.hybrid(model, config)``: a running hybrid CPU/GPU model built from one configuration.

>>> with moelab.hybrid(model, {"cache": {"capacity": 0.25, "policy": "mrs"},
...                            "placement": "greedy-hss", "hardware": "pcie4-x16",
...                            "routing": {"deferred": 2}}) as run:
...     model.generate(**inputs, max_new_tokens=32)
>>> run.plan_table()          # one row per (forward, MoE layer): what ran where, what moved, why

The planner is one model-free object (:class:`moelab.hybrid.planner.Planner`, the same one
:func:`moelab.hybrid.offline.plan_routing` runs over recorded routing) driven by thin
handlers on the model's one forward context (:mod:`moelab.forward`), which hand it each
layer's routing as lists. At every MoE layer of every forward it asks the components in a
fixed order:

1. routing policy (level ``ROUTING``): deferral and skipping edit the layer's slot plan,
   with exactly the semantics of :mod:`moelab.policies` (they *are* those policies);
2. cache (level ``PLACEMENT``): the experts the layer needs — the union over the
   forward's real tokens of the slots that run now or deferred, in descending router
   weight (ties: lower id) — are served by the expert cache: hits, misses, and on
   insertion the victim;
3. placement: each miss runs on the host or is fetched to the device
   (:mod:`moelab.hybrid.placement`);
4. prefetch: a predictor, called at the ``router`` point of layer ``l`` with its router
   input, proposes experts for layer ``l + d`` (the forward's real tokens' predictions
   merged by :func:`moelab.predictors.protocol.union_predictions`: most tokens first, then
   best rank, then lower id); they are inserted as speculative cache entries within the
   budget after layer ``l``'s own accesses (low priority: a layer's demand accesses always
   come first).

The resulting :class:`LayerPlan` is plain data and is kept (``run.plans``) and written
by :meth:`HybridRun.save`. The *functional* executor computes each layer's exact output:
placement decides where work would run and what moves, not the arithmetic, so with no
deferral or skipping the logits equal the unmodified model's bit for bit (with the
model's own experts implementation on both sides).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab import __version__
from moelab._output import reserve_output
from moelab.caches.activation import is_activation
from moelab.caches.prefetch import routing_rule
from moelab.errors import MoelabError
from moelab.events import decode_rate
from moelab.forward import (
    ExpertsCall,
    ForwardContext,
    Handle,
    Order,
    RouterCall,
    forward_hooks,
)
from moelab.hybrid.config import HybridConfig
from moelab.hybrid.events import EventLog
from moelab.hybrid.executors import get_executor
from moelab.hybrid.offline import warm_start_from_trace
from moelab.hybrid.placement import get_placement
from moelab.hybrid.planner import LayerPlan, Planner, Transfer
from moelab.predictors.online import router_inputs
from moelab.timing.shapes import ModelShape

log = logging.getLogger(__name__)


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as numpy: its own memory for a CPU tensor outside autograd (one call),
    else a host copy."""
    try:
        return t.numpy()
    except (RuntimeError, TypeError):  # on a device, or needs grad
        return t.numpy(force=True)


def _weights_array(weights: torch.Tensor, T: int) -> np.ndarray:
    """(T, K) router weights as the compiled planner reads them: float32 as they are, bfloat16 as
    their bit patterns (uint16: no conversion), any other dtype converted to float32."""
    if weights.dtype == torch.bfloat16:
        weights = weights.view(torch.uint16)
    elif weights.dtype != torch.float32:
        weights = weights.float()
    return _host_array(weights.reshape(T, -1))


def _as_config(config: HybridConfig | dict | str | Path | None) -> HybridConfig:
    if config is None:
        return HybridConfig()
    if isinstance(config, HybridConfig):
        return config
    if isinstance(config, dict):
        return HybridConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return HybridConfig.from_yaml(config)
    raise MoelabError(f"config must be a HybridConfig, a dict or a YAML path, got {type(config).__name__}.")


_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def active_hybrid(model: Any) -> HybridRun | None:
    """The hybrid run applied to ``model`` now, if any."""
    from moelab.adapters import _unwrap

    return _ACTIVE.get(_unwrap(model))


class HybridRun:
    """A hybrid configuration applied to a model; a reversible context manager."""

    def __init__(self, model: Any, config: HybridConfig | dict | str | Path | None = None) -> None:
        from moelab.adapters import _unwrap

        self.model = _unwrap(model)
        self.config = _as_config(config)
        self.plans: list[LayerPlan] = []
        self.events = EventLog("unapplied")  # a fresh log with the run's id on every apply()
        self.forwards: list[dict[str, Any]] = []
        """Per forward of the run: ``step``, ``phase``, ``tokens`` generated, measured ``wall_us``."""
        self.timing_reset()
        self._handles: list[Handle] = []
        self._policies: list = []
        self._plan_later: Any = None
        self._later: list[tuple] = []
        self.active_ = False

    def timing_reset(self) -> None:
        """Zero the planner's own time counters (``self.timing``: ns in the planner and the predictor).

        Set ``self.planner_samples = []`` to also keep the ns of every decode-step layer plan
        (``moelab bench hybrid`` reports their median, robust to a shared machine's stalls)."""
        self.timing = {"planner_ns": 0, "predictor_ns": 0, "plans": 0}
        self.planner_samples: list[int] | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> HybridRun:
        return self.apply()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.remove()
        return False

    def apply(self) -> HybridRun:
        if self.active_:
            raise MoelabError("this hybrid run is already applied; exit it first or create another.")
        if _ACTIVE.get(self.model) is not None:
            raise MoelabError("another hybrid configuration is applied to this model; exit it first.")
        from moelab.adapters import expert_bytes, moe_layers

        cfg = self.config
        self.layers = moe_layers(self.model)
        self.expert_bytes = [expert_bytes(layer) for layer in self.layers]
        costed = get_placement(cfg.placement).needs_cost_model or cfg.hardware is not None
        shape = ModelShape.from_model(self.model) if costed else None
        num_experts, top_k = [ly.num_experts for ly in self.layers], [ly.top_k for ly in self.layers]
        warm: dict = {}
        if cfg.cache.capacity != 0 and (cfg.cache.warm != "empty" or cfg.cache.warm_from is not None):
            warm = warm_start_from_trace(cfg, num_experts=num_experts, top_k=top_k, expert_bytes=self.expert_bytes,
                                         shape=shape)
        self.planner = Planner.build(cfg, num_experts=num_experts, top_k=top_k, expert_bytes=self.expert_bytes,
                                     shape=shape, **warm)
        self.cache, self.placement, self.cost = self.planner.cache, self.planner.placement, self.planner.cost
        self._needs_scores = self.cache is not None and bool(self.cache.needs_scores)
        self.predictor = self._load_predictor()
        self._warn_if_never_filled()
        try:
            self._apply_routing()
            mgr = forward_hooks(self.model)
            if self.predictor is not None:
                self._handles.append(mgr.add("router", self._on_router_predict, order=Order.PREFETCH,
                                             layers=self.predictor.source_layers(), name="hybrid prefetch"))
            if self.cache is not None and self.cache.needs_scores:
                self._handles.append(mgr.add("router", self._on_router_scores, order=Order.CACHE,
                                             name="hybrid cache scores"))
            planner = mgr.add("plan", self._on_plan, order=Order.PLACEMENT, name="hybrid planner")
            self._handles.append(planner)
            self._planner_handle, self._plan_order, self._planner_last = planner, None, False
            self._hand_over_deferral(planner)
            self._install_executor(mgr)
        except BaseException:
            self.remove()
            raise
        _ACTIVE[self.model] = self
        self.active_ = True
        return self

    def _warn_if_never_filled(self) -> None:
        """Warn when the device cache can never hold an expert: empty at the start, every miss run on
        the host (``host-misses``), host misses not copied in (``admission: placement``) and no
        prefetch to insert any. Such a run computes everything on the host whatever its capacity."""
        cfg = self.config
        if (self.cache is None or self.predictor is not None or cfg.placement != "host-misses"
                or cfg.cache.admission == "all" or cfg.cache.warm != "empty"):
            return
        log.warning(
            "hybrid run: cache.capacity=%s under placement host-misses starts empty and never fills (a miss "
            "the host computes is not copied in: cache.admission placement), so every expert runs on the "
            "host. Warm it (cache.warm: frequency with cache.warm_from: a routing trace of this model), set "
            "cache.admission: all, add a prefetch predictor, or use a placement that fetches misses "
            "(fetch-misses, greedy-hss).", cfg.cache.capacity)

    def _on_forward_start(self, ctx: ForwardContext) -> None:
        ctx.scratch["hybrid-forward-t0"] = time.perf_counter_ns()

    def _on_forward_done(self, ctx: ForwardContext, ok: bool) -> None:
        t0 = ctx.scratch.get("hybrid-forward-t0")
        if not ok or t0 is None:
            return
        m = ctx.mask_cpu
        real = int(m.sum()) if m is not None else ctx.tokens
        # a prompt forward generates one token per row; a decode forward one per real row
        self.forwards.append({"step": ctx.index, "phase": ctx.phase, "tokens": real if ctx.phase == "decode" else ctx.batch,
                              "wall_us": (time.perf_counter_ns() - t0) / 1e3})

    def _install_executor(self, mgr) -> None:
        import uuid

        cfg = self.config
        self.events = EventLog(uuid.uuid4().hex[:12])
        self.forwards = []
        self._handles.append(mgr.add("forward", self._on_forward_start, order=Order.ROUTING - 10, name="hybrid clock"))
        self._handles.append(mgr.add("forward_end", self._on_forward_done, order=Order.OBSERVE + 10,
                                     name="hybrid clock"))
        self.device_ = cfg.resolved_device()
        self._executor = get_executor(cfg.executor).create(self)
        self._handles.extend(self._executor.install(mgr))
        # an executor that can compute a layer before its plan (see plan_pending), where nothing but the
        # cache decides: no routing policy edits the slots, no predictor proposes, no router scores feed it
        later = getattr(self._executor, "plan_later", None)
        self._plan_later = later if (later is not None and not self._policies and self.predictor is None
                                     and not self._needs_scores) else None

    def remove(self) -> None:
        if _ACTIVE.get(self.model) is self:
            del _ACTIVE[self.model]
        self._later.clear()
        self._plan_later = None
        ex = getattr(self, "_executor", None)
        if ex is not None:
            ex.close()
            self._executor = None
        while self._handles:
            self._handles.pop().remove()
        while self._policies:
            self._policies.pop().remove()
        self.active_ = False

    # ------------------------------------------------------------------ set-up
    def _load_predictor(self):
        p = self.config.prefetch
        if p.predictor is None:
            return None
        if self.cache is None:
            raise MoelabError("prefetch needs a device cache to prefetch into; set cache.capacity > 0.")
        from moelab.adapters import model_fingerprint
        from moelab.predictors import load_predictor

        rule = routing_rule(p.predictor)
        if is_activation(p.predictor):
            rule = "activation"
        if rule is not None:
            why = ("reads the routing of the layer it prefetches for, which a live run knows only after it"
                   if rule == "same" else "is implemented by the offline planner only")
            raise MoelabError(
                f"prefetch predictor {p.predictor!r} works only offline (it {why}): use it with "
                "moelab.hybrid.offline.plan_routing, `moelab cache simulate` or `moelab simulate`; a live run "
                "needs a saved predictor (`moelab predict fit ... --out DIR`, then prefetch: {predictor: DIR}).")
        pred = load_predictor(p.predictor, model=self.model)
        pred.check_model(model_fingerprint(self.model), getattr(self.model, "name_or_path", ""))
        if not pred.online:
            raise MoelabError(f"the {pred.kind!r} predictor works only offline; it cannot drive a prefetch.")
        if pred.distance != p.distance:
            raise MoelabError(
                f"prefetch.distance={p.distance} but the predictor at {p.predictor!r} predicts distance "
                f"{pred.distance}; set prefetch.distance: {pred.distance}."
            )
        return pred

    def _apply_routing(self) -> None:
        from moelab.policies import ExpertDeferral, ExpertSkipping

        r = self.config.routing
        if (skipping := r.skipping()) is not None:
            self._policies.append(ExpertSkipping(self.model, config=skipping).apply())
        if (deferral := r.deferral()) is not None:
            self._policies.append(ExpertDeferral(self.model, config=deferral).apply())

    def _hand_over_deferral(self, planner: Any) -> None:
        """With the compiled planner, the run's own Expert Deferral is made in the planner's call
        (:meth:`moelab.hybrid.planner.Planner.defer_with`) instead of by the policy runtime: the
        same edit (``tests/test_planner_compiled.py``), without a Python pass over the slots per
        MoE layer. The runtime hands it over only where nothing runs between the two handlers."""
        from moelab.policies import ExpertDeferral
        from moelab.policies.runtime import runtime_for

        policy = next((p for p in self._policies if isinstance(p, ExpertDeferral)), None)
        if policy is None or self.planner.path != "compiled":
            return
        self.planner.defer_with(policy.deferred_, policy.config.min_immediate, policy.config.batch_rule == "union")
        runtime_for(self.model, create=False).hand_over(policy, planner)

    # ------------------------------------------------------------------ handlers
    def _on_router_scores(self, ctx: ForwardContext, layer, call: RouterCall) -> None:
        ctx.scratch[("hybrid-logits", layer.index)] = call.logits

    def _on_router_predict(self, ctx: ForwardContext, layer, call: RouterCall) -> None:
        t0 = time.perf_counter_ns()
        try:
            self._predict(ctx, layer, call)
        finally:
            self.timing["predictor_ns"] += time.perf_counter_ns() - t0

    def _predict(self, ctx: ForwardContext, layer, call: RouterCall) -> None:
        got = router_inputs(ctx, call)  # the real tokens' router inputs and ids, as moelab.predictors.online reads them
        if got is None:
            return
        proposal = self.predictor.predict_union(layer.index, hidden=got[0], token_ids=got[1], m=self.config.prefetch.m)
        # the compiled planner reads the array itself; the reference, a list
        ctx.scratch[("hybrid-prefetch", layer.index + self.predictor.distance)] = \
            proposal if self.planner.path == "compiled" else proposal.tolist()

    def _on_plan(self, ctx: ForwardContext, layer, call: ExpertsCall) -> None:
        t0 = time.perf_counter_ns()
        try:
            if self._plan_later is not None and call._plan is None and call.pending is None and \
                    ctx.mask_cpu is None and self._last_plan_handler():
                got = self._plan_later(ctx, layer, call)
                if got is not None:  # the executor computes this layer without its plan: made at the forward's end
                    self._later.append((ctx, layer, *got))
                    return
            if self._later:  # a plan made now comes after the ones still waiting
                self._make_pending()
            if self.planner.path == "compiled":
                if not self._plan_layer_native(ctx, layer, call):
                    self._plan_layer_arrays(ctx, layer, call)
            else:
                self._plan_layer(ctx, layer, call)
        finally:
            dt = time.perf_counter_ns() - t0
            self.timing["planner_ns"] += dt
            self.timing["plans"] += 1
            if self.planner_samples is not None and ctx.phase == "decode":
                self.planner_samples.append(dt)

    def _plan_layer(self, ctx: ForwardContext, layer, call: ExpertsCall) -> None:
        # a thin adapter: the layer's routing for the real tokens, then the one planner
        # (moelab.hybrid.planner), the same object offline planning runs; as arrays for its
        # compiled path, as Python lists for the reference (a decode step has a few values, for
        # which list code beats numpy's per-call cost)
        plan = call._plan
        if call.pending is not None:  # handed over only to the compiled path; made here as the policy would
            call.pending._plan(plan)
            call.pending = None
        experts = call.experts
        K = experts.shape[-1]
        ids = (experts if experts.dim() == 2 else experts.reshape(-1, K)).tolist()
        # the weights order only a union of several tokens' experts: one token's keep router order
        w = (plan.weights if plan is not None else call.weights).reshape(-1, K).float().tolist() \
            if len(ids) > 1 else None
        state = None
        if plan is not None:
            st = plan.state
            state = (st if st.dim() == 2 else st.reshape(-1, K)).tolist()
        mask = ctx.mask_cpu
        valid = mask.reshape(-1) if mask is not None and mask.size == len(ids) else None
        if valid is not None:
            keep = valid.tolist()
            ids = [r for r, k in zip(ids, keep, strict=True) if k]
            w = [r for r, k in zip(w, keep, strict=True) if k] if w is not None else None
            state = [r for r, k in zip(state, keep, strict=True) if k] if state is not None else None
        scores = self._scores(ctx, layer, valid) if self.cache is not None else None
        self._plan_with(ctx, layer, ids, w, state, scores)

    def _plan_layer_native(self, ctx: ForwardContext, layer, call: ExpertsCall) -> bool:
        """:meth:`_plan_layer_arrays` through the compiled planner's native entry
        (:mod:`moelab.hybrid._entry`), which reads the call's own tensors: no numpy views, no
        dispatcher. False, with nothing changed, where it does not take them as they are (padding
        rows, another dtype or device, a plan larger than the planner's buffers, no entry): the
        caller then plans through :meth:`_plan_layer_arrays`."""
        compiled = self.planner._compiled
        experts = call.experts
        # (routing on a device: the entry reads host memory only, and nothing is computed first)
        if compiled._native is None or ctx.mask_cpu is not None or not experts.is_cpu:
            return False
        plan, scratch = call._plan, ctx.scratch
        if plan is None:
            wt, state, defer = call.weights, None, False
        else:
            wt, state, defer = plan.weights, plan.state, call.pending is not None
        scores = None
        if self._needs_scores:
            logits = scratch.get(("hybrid-logits", layer.index))
            scores = None if logits is None else self._softmax(layer, logits, host=False)
        key = None
        proposal = None
        if self.predictor is not None:
            key = ("hybrid-prefetch", layer.index + self.predictor.distance)
            proposal = scratch.get(key)
        lp = compiled.plan_tensors(ctx.index, ctx.step, ctx.phase, layer.index, experts, wt, state, scores, proposal,
                                   defer)
        if lp is None:
            return False
        if defer:  # made in the planner's call, on the plan's own state
            call.pending = None
        scratch.pop(("hybrid-logits", layer.index), None)
        if key is not None:
            scratch.pop(key, None)
        self.plans.append(lp)
        scratch[("hybrid-plan", layer.index)] = lp
        if plan is not None and self._last_plan_handler():  # the compacted routing for the seam (plan.split)
            plan.split = compiled.split(layer.index, experts, wt, wt.dtype == torch.bfloat16)
        return True

    def _plan_layer_arrays(self, ctx: ForwardContext, layer, call: ExpertsCall) -> None:
        """:meth:`_plan_layer` for the compiled planner: the routing as numpy views of the call's
        own CPU tensors (``Tensor.numpy()``: no copy, no Python lists; the planner reads them
        during the call and keeps nothing of them), as few torch and numpy calls as a decode step
        allows: each costs microseconds, several times more between a forward's layers (cold
        caches) than in a loop. Padding rows are left out by a (copying) row selection."""
        plan = call._plan
        experts = call.experts
        if experts.dim() != 2:
            experts = experts.reshape(-1, experts.shape[-1])
        ids = _host_array(experts)
        T = ids.shape[0]
        mask = ctx.mask_cpu  # None when every token is real
        valid = mask.reshape(-1) if mask is not None and mask.size == T else None
        rows = None if valid is None or valid.all() else valid
        if rows is not None:
            ids = ids[rows]
        pending, defer = call.pending, False
        if pending is not None:  # the deferral handed to the planner: made in its call on the plan's own state
            call.pending = None
            if rows is None and plan.state.is_cpu:
                defer = True
            else:  # a row selection or a device tensor would be a copy: the policy edits the plan itself
                pending._plan(plan)
        wt = plan.weights if plan is not None else call.weights
        # the planner compacts the plan's immediate and deferred routing for the seam (plan.split)
        # where the plan is its own (all rows, CPU) and nothing edits it after the planner
        split = plan is not None and rows is None and experts is call.experts and plan.state.is_cpu and \
            experts.dtype == torch.int64 and (wt.dtype == torch.float32 or wt.dtype == torch.bfloat16) and \
            self._last_plan_handler()
        w = None
        if T > 1 or defer or split:  # the weights order a union of several tokens' experts, deferral, the split
            w = _weights_array(wt, T)
            if rows is not None:
                w = w[rows]
        state = None
        if plan is not None:
            st = plan.state
            state = _host_array(st if st.dim() == 2 else st.reshape(T, -1))
            if rows is not None:
                state = state[rows]
        scores = self._scores(ctx, layer, valid) if self._needs_scores else None
        self._plan_with(ctx, layer, ids, w, state, scores, defer)
        if split:
            plan.split = self.planner._compiled.split(layer.index, experts, wt, wt.dtype == torch.bfloat16)

    def _last_plan_handler(self) -> bool:
        """Whether the planner's hook is the last ``plan`` handler (re-checked when the handlers change)."""
        order = self._planner_handle.manager._fns["plan"]
        if order is not self._plan_order:
            self._plan_order = order
            self._planner_last = bool(order) and order[-1] is self._planner_handle
        return self._planner_last

    def plan_pending(self, drop: bool = False) -> None:
        """Make the plans an executor let wait (``plan_later``), in the order of their layers.

        An executor may compute a layer before its plan exists where no routing can change what
        the plan decides (:meth:`moelab.hybrid.cuda.CudaExecutor.plan_later`: every expert of every
        layer resident on the GPU, so every access is a hit and nothing moves). Its hook then
        returns the layer's routing as host tensors being filled asynchronously (the weights None
        for one token, whose plan does not read them), an object whose
        ``synchronize()`` waits for them, and a function that receives the plan (and checks it is
        what the compute assumed); the plans are made here from that routing, by the same planner
        calls in the same order as :meth:`_on_plan` would have made them, so the run's plans, cache
        statistics and device events are the synchronous run's. The executor calls this at the
        forward's end; a plan made synchronously makes the waiting ones first. ``drop``: forget
        them (a failed forward: its waiting layers are left unplanned). Every plan is made even if
        a ``received`` check raises; the first such error is raised after the last plan.
        """
        t0 = time.perf_counter_ns()
        try:
            self._make_pending(drop)
        finally:  # (counted in ``plans`` by _on_plan; the time is the planner's too)
            self.timing["planner_ns"] += time.perf_counter_ns() - t0

    def _make_pending(self, drop: bool = False) -> None:
        """:meth:`plan_pending` without its timing (for a caller that times itself: _on_plan)."""
        later, self._later = self._later, []
        if drop:
            return
        error = None
        for ctx, layer, ids, w, ready, received in later:
            ready.synchronize()
            T = ids.shape[0]
            if self.planner.path == "compiled":
                self._plan_with(ctx, layer, _host_array(ids), _weights_array(w, T) if T > 1 else None, None, None)
            else:
                self._plan_with(ctx, layer, ids.tolist(), w.float().tolist() if T > 1 else None, None, None)
            try:
                received(self.plans[-1])
            except Exception as e:  # noqa: BLE001 - the rest are still planned, then the first error raised
                error = error or e
        if error is not None:
            raise error

    def _plan_with(self, ctx: ForwardContext, layer, ids, w, state, scores, defer: bool = False) -> None:
        """Plan the layer from its routing (lists or arrays) and the prefetch proposal waiting for it."""
        proposal = None
        if self.predictor is not None:
            proposal = ctx.scratch.pop(("hybrid-prefetch", layer.index + self.predictor.distance), None)
        lp = self.planner.plan_layer(ctx.index, ctx.step, ctx.phase, layer.index, ids, w, state, scores, proposal,
                                     defer)
        self.plans.append(lp)
        ctx.scratch[("hybrid-plan", layer.index)] = lp

    def _scores(self, ctx: ForwardContext, layer, valid: np.ndarray | None) -> np.ndarray | None:
        logits = ctx.scratch.pop(("hybrid-logits", layer.index), None)
        if logits is None:
            return None
        if logits.dim() != 2:
            logits = logits.reshape(-1, logits.shape[-1])
        if valid is not None and logits.shape[0] == valid.size and not valid.all():
            logits = logits[torch.from_numpy(valid).to(logits.device)]
        return self._softmax(layer, logits)

    @staticmethod
    def _softmax(layer, logits: torch.Tensor, host: bool = True):
        """(tokens, E) float32 router scores of ``logits`` (numpy with ``host``, else the tensor)."""
        if logits.dim() != 2:
            logits = logits.reshape(-1, logits.shape[-1])
        # few torch calls: each costs microseconds on a decode step's tiny tensors (softmax's dtype
        # converts first: the same values as .float() then softmax)
        s = torch.softmax(logits, -1, dtype=torch.float32) if layer.spec.scoring == "softmax" else \
            torch.sigmoid(logits if logits.dtype == torch.float32 else logits.float())
        return _host_array(s) if host else s

    # ------------------------------------------------------------------ results
    def plan_table(self):
        """One row per (forward, MoE layer) plan, as a pandas DataFrame."""
        import pandas as pd

        rows = []
        for p in self.plans:
            d = asdict(p)
            d["transfers"] = [(t["layer"], t["expert"], t["bytes"], t["priority"]) for t in d["transfers"]]
            rows.append(d)
        return pd.DataFrame(rows)

    def events_table(self):
        """The run's events (the timeline) as a pandas DataFrame; see :mod:`moelab.hybrid.events`."""
        return self.events.table().to_pandas()

    def __repr__(self) -> str:
        c = self.config
        cache = f"cache {c.cache.policy} {c.cache.capacity}" if c.cache.capacity else "no device cache"
        state = "applied" if self.active_ else "not applied"
        return (f"HybridRun({type(self.model).__name__}: {cache}, placement {c.placement}, executor {c.executor}; "
                f"{state}; {len(self.plans)} layer plans, {len(self.events.events)} events)")

    def summary(self) -> dict:
        """Lane busy %, host/device overlap % and wall time from the events, and the run's
        tokens/s (:func:`moelab.events.decode_rate`: decode tokens over decode wall)."""
        from moelab.hybrid.events import summarize

        df = self.events_table()
        return {**summarize(df), **decode_rate(df, self.forwards), "forwards": list(self.forwards),
                "lanes": bool(len(df))}

    def save(self, out: str | Path, *, overwrite: bool = False) -> Path:
        """Write the run into a new directory ``out``, atomically (complete or absent); see :meth:`write`."""

        res = reserve_output(Path(out), overwrite, what="hybrid run directory")
        try:
            self.write(res.staging)
            res.commit()
        except BaseException:
            res.abort()
            raise
        return Path(out)

    def write(self, directory: str | Path, summary: dict[str, Any] | None = None) -> None:
        """Write ``plans.jsonl`` (one plan per line), ``events.parquet`` (the timeline),
        ``summary.json`` (:meth:`summary`, plus ``summary``'s entries) and ``config.json`` (settings
        and versions) into ``directory``."""
        import json
        import platform

        import pyarrow.parquet as pq
        import transformers

        d = Path(directory)
        with open(d / "plans.jsonl", "w") as f:
            for p in self.plans:
                f.write(json.dumps(asdict(p)) + "\n")
        pq.write_table(self.events.table(), d / "events.parquet")
        (d / "summary.json").write_text(json.dumps({**self.summary(), **(summary or {})}, indent=2))
        (d / "config.json").write_text(json.dumps({
            "config": self.config.to_dict(),
            "device": getattr(self, "device_", self.config.resolved_device()),
            "run": self.events.run,
            "versions": {"moelab": __version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()},
        }, indent=2))


__all__ = ["HybridRun", "LayerPlan", "Transfer", "active_hybrid", "hybrid"]


def hybrid(model: Any, config: HybridConfig | dict | str | Path | None = None) -> HybridRun:
    """A :class:`HybridRun` of ``model`` under ``config`` (use it as a context manager)."""
    return HybridRun(model, config)
