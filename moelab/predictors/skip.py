"""Skip-based prediction (layer-wise, from Mixtral-offloading).

Feed MoE layer l's router input to MoE layer l+d's own router module: exact family
semantics (softmax/sigmoid scoring, DeepSeek grouped and bias-corrected top-k, ...).
Works where adjacent hidden states are similar; fails on routers sensitive to small
input changes. No training; ``fit`` takes the routers from the model and checks that it
is the model the trace was recorded from.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import torch

from moelab.compat import router_outputs
from moelab.errors import MoelabError
from moelab.predictors.base import Predictor, TraceData
from moelab.predictors.protocol import to_cpu_tensor, to_numpy
from moelab.predictors.registry import register_predictor

log = logging.getLogger(__name__)


def resolve_model(name: str, fingerprint: str, model: Any = None):
    """``model`` if given, else ``moelab.load(name)``; either way its fingerprint must match."""
    from moelab.adapters import model_fingerprint

    if model is None:
        from moelab.loading import load

        try:
            model, _ = load(name)
        except MoelabError as exc:
            raise MoelabError(
                f"this predictor needs the model's routers and could not load model {name!r} by name ({exc}); "
                "pass model=<the model> (CLI: --model PATH)."
            ) from None
    got = model_fingerprint(model)
    if got != fingerprint:
        raise MoelabError(
            f"model mismatch: the trace/predictor belongs to model {name!r} (fingerprint {fingerprint}), but the "
            f"model given is {getattr(model, 'name_or_path', type(model).__name__)!r} (fingerprint {got}); "
            "pass the model the trace was recorded from."
        )
    return model


@register_predictor("skip")
class SkipPredictor(Predictor):
    """Layer l's router input through layer l+d's router. Learned state: ``routers_`` (copies
    of the model's router modules, one per MoE layer) and ``scoring_``."""

    needs_hidden = True
    needs_model = True

    def __init__(self, distance: int = 1) -> None:
        self.distance = distance

    def _fit(self, data: TraceData, model: Any) -> None:
        self._take_routers(resolve_model(self.model_name_, self.model_fingerprint_, model))

    def _take_routers(self, model) -> None:
        from moelab.adapters import moe_layers

        layers = moe_layers(model)
        self.routers_ = [copy.deepcopy(layer.router).eval() for layer in layers]
        self.scoring_ = [layer.spec.scoring for layer in layers]

    @torch.inference_mode()
    def _scores(self, layer, hidden, token_ids, n):
        from moelab.adapters import make_routing

        target = layer + self.distance
        router = self.routers_[target]
        w = router.weight
        logits, weights, experts = router_outputs(router(to_cpu_tensor(hidden).to(device=w.device, dtype=w.dtype)))
        r = make_routing(logits, weights, experts, self.scoring_[target])
        scores = to_numpy(r.scores.clamp(0.0, 1.0), np.float32).copy()
        chosen = to_numpy(r.experts, np.int64)
        K = chosen.shape[1]
        rows = np.arange(len(chosen))[:, None]
        scores[rows, chosen] = 2.0 + (K - np.arange(K))[None, :]  # the router's exact top-k first
        return scores

    def _state(self):
        tensors = {}
        for i, router in enumerate(self.routers_):
            for k, v in router.state_dict().items():
                tensors[f"router.{i}.{k}"] = v.detach().float().cpu().numpy()
        return tensors, {"scoring": self.scoring_}

    def _load_state(self, tensors, extra, model):
        self._take_routers(resolve_model(self.model_name_, self.model_fingerprint_, model))
        for i, router in enumerate(self.routers_):
            prefix = f"router.{i}."
            state = {k[len(prefix):]: torch.from_numpy(v) for k, v in tensors.items() if k.startswith(prefix)}
            own = router.state_dict()
            state = {k: v.to(own[k].dtype) for k, v in state.items() if k in own}
            router.load_state_dict(state, strict=True)
