"""The simulated executor **online**: ``executor: simulated`` in a :class:`~moelab.hybrid.HybridConfig`.

The model runs as usual (the functional executor's arithmetic); after each forward, its
layer plans are simulated on the configuration's hardware profile with the live model's
shape (:class:`LiveShape`: byte counts measured from the model's own modules) and the
simulated events are appended to the run's event log, on a clock that continues from one
forward to the next. So ``run.events_table()`` / ``run.summary()`` read as the timeline the
same plans would have on that hardware.

Each forward is simulated on its own: copies still in flight at a forward's end do not
delay the next forward (they would on real hardware; offline simulation of the whole
plan list, :func:`moelab.simulate.executor.simulate_plans`, models it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from moelab.errors import MoelabError

log = logging.getLogger(__name__)


def _bytes(module) -> int:
    return 0 if module is None else int(sum(p.numel() * p.element_size() for p in module.parameters()))


def _params(module) -> int:
    return 0 if module is None else int(sum(p.numel() for p in module.parameters()))


@dataclass(frozen=True)
class LiveShape:
    """A ModelShape-like view of a loaded model, with byte counts measured from its modules."""

    name: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate: int
    num_shared_experts: int
    shared_intermediate: int
    dense_intermediate: int
    vocab_size: int
    dtype: str
    attn_bytes: int
    attn_params: int
    kv_bytes_per_token: int
    num_heads: int
    head_dim: int
    expert_bytes_: int
    expert_params_: int
    shared_bytes_: int
    dense_bytes_: int

    @classmethod
    def of(cls, model: Any) -> LiveShape:
        from moelab.adapters import _unwrap, expert_bytes, moe_layers

        model = _unwrap(model)
        layers = moe_layers(model)
        if not layers:
            raise MoelabError("executor 'simulated' needs a MoE model; this one has no MoE layers.")
        cfg = model.config
        decoder = None
        for name, mod in model.named_modules():
            if name.endswith("layers") and hasattr(mod, "__len__") and len(mod) == cfg.num_hidden_layers:
                decoder = mod
                break
        first = layers[0]
        moe_idx = tuple(int(layer.layer_idx) for layer in layers)
        attn = getattr(decoder[0], "self_attn", None) if decoder is not None else None
        dense = [i for i in range(cfg.num_hidden_layers) if i not in moe_idx]
        dense_mlp = getattr(decoder[dense[0]], "mlp", None) if decoder is not None and dense else None
        heads = int(getattr(cfg, "num_attention_heads", 1))
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", heads) or heads)
        elt = next(model.parameters()).element_size()
        e_params = _params(first.experts) // max(first.num_experts, 1)
        dtype = {4: "fp32", 2: "bf16", 1: "int8"}.get(elt, "bf16")
        return cls(
            name=str(getattr(model, "name_or_path", "") or cfg.model_type), num_layers=int(cfg.num_hidden_layers),
            moe_layers=moe_idx, num_experts=int(first.num_experts), top_k=int(first.top_k),
            hidden_size=int(cfg.hidden_size), expert_intermediate=max(e_params // (3 * cfg.hidden_size), 1),
            num_shared_experts=1 if first.shared_experts is not None else 0,
            shared_intermediate=_params(first.shared_experts) // (3 * cfg.hidden_size),
            dense_intermediate=_params(dense_mlp) // (3 * cfg.hidden_size), vocab_size=int(cfg.vocab_size),
            dtype=dtype, attn_bytes=_bytes(attn), attn_params=_params(attn),
            kv_bytes_per_token=2 * kv_heads * head_dim * elt, num_heads=heads, head_dim=head_dim,
            expert_bytes_=max(expert_bytes(layer) for layer in layers), expert_params_=e_params,
            shared_bytes_=_bytes(first.shared_experts) + _bytes(first.shared_gate), dense_bytes_=_bytes(dense_mlp),
        )

    def bytes_per_param(self, dtype: str | None = None) -> float:
        return self.expert_bytes_ / max(self.expert_params_, 1)

    def expert_params(self) -> int:
        return self.expert_params_

    def expert_bytes(self) -> int:
        return self.expert_bytes_

    def expert_flops(self, tokens: int = 1) -> int:
        return 2 * self.expert_params_ * int(tokens)

    def shared_bytes(self) -> int:
        return self.shared_bytes_

    def dense_mlp_bytes(self) -> int:
        return self.dense_bytes_

    def attention_bytes(self, context: int, batch: int = 1) -> float:
        return float(self.attn_bytes + self.kv_bytes_per_token * int(context) * int(batch))

    def attention_flops(self, context: int, batch: int = 1) -> float:
        return 2.0 * self.attn_params * batch + 4.0 * self.num_heads * self.head_dim * int(context) * batch


class SimulatedExecutor:
    """Handlers that simulate each forward's plans and write the events into the run's log."""

    def __init__(self, run: Any) -> None:
        if run.config.hardware is None:
            raise MoelabError("executor 'simulated' needs a hardware profile to simulate on; set hardware: to a "
                              "profile name (moelab.timing.available_profiles()) or a profile YAML file.")
        from moelab.timing import get_profile

        self.run = run
        self.profile = get_profile(run.config.hardware)
        self.shape = LiveShape.of(run.model)
        self.clock_us = 0.0
        self.context = 0
        self._done = 0  # plans already simulated

    def close(self) -> None:
        pass

    def on_forward_end(self, ctx, ok: bool) -> None:
        from moelab.hybrid.events import Event
        from moelab.simulate.executor import simulate_plans

        plans = [p for p in self.run.plans[self._done:] if p.forward == ctx.index]
        self._done = len(self.run.plans)
        if not plans:
            return
        res = simulate_plans(plans, self.shape, self.profile, context=self.context, run=self.run.events.run)
        p0 = plans[0]
        self.context += p0.tokens if p0.phase == "prefill" else 1
        ev = res.events
        if not len(ev):
            return
        t0 = self.clock_us
        rows = [Event(str(r.run), int(r.step), int(r.layer), str(r.lane), str(r.kind), int(r.expert), int(r.tokens),
                      int(r.bytes), float(r.t_start_us) + t0, float(r.t_end_us) + t0, str(r.cause))
                for r in ev.itertuples(index=False)]
        self.clock_us = t0 + float(ev["t_end_us"].max())
        log_ = self.run.events
        with log_._lock:
            log_.events.extend(rows)
