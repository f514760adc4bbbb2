"""Run a predictor online, inside a model's forward pass (what a prefetcher does).

>>> def on_prediction(source, target, experts):      # experts: (T, m) int64, best first
...     prefetch(target, experts)
>>> with attach(model, predictor, on_prediction):
...     model.generate(**inputs, max_new_tokens=16)

Layer-wise predictors are called from a forward hook on MoE layer ``l``'s router with its
input (the router input the trace records); iteration-wise and static ones are called once
per forward from the token ids, before layer 0, for every source layer. Hooks are removed
on exit, also on exceptions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from moelab.predictors.base import Predictor

Callback = Callable[[int, int, np.ndarray], None]


@contextmanager
def attach(model: Any, predictor: Predictor, callback: Callback, *, m: int | None = None) -> Iterator[None]:
    """Call ``callback(source_layer, target_layer, predicted)`` during every forward of ``model``."""
    from moelab.adapters import model_fingerprint, moe_layers

    predictor.check_model(model_fingerprint(model), getattr(model, "name_or_path", type(model).__name__))
    if not predictor.online:
        from moelab.errors import MoelabError

        raise MoelabError(f"the {predictor.kind!r} predictor works only offline (it needs the future routing).")
    layers = moe_layers(model)
    sources = predictor.source_layers()
    state: dict[str, Any] = {"ids": None, "depth": 0}
    hooks = []

    def pre_forward(module, args, kwargs):
        state["depth"] += 1
        if state["depth"] > 1:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["ids"] = None if ids is None else ids.detach().reshape(-1).cpu().numpy()
        if predictor.timing != "layer" and state["ids"] is not None:
            for s in sources:
                callback(s, s + predictor.distance, predictor.predict(s, token_ids=state["ids"], m=m))
        return None

    def post_forward(module, args, output):
        state["depth"] -= 1

    def router_hook(source: int):
        def hook(module, args, output):
            if state["depth"] != 1 or not args:
                return
            hidden = args[0].detach().reshape(-1, args[0].shape[-1])
            ids = state["ids"] if state["ids"] is not None and len(state["ids"]) == len(hidden) else None
            callback(source, source + predictor.distance, predictor.predict(source, hidden=hidden, token_ids=ids, m=m))

        return hook

    try:
        hooks.append(model.register_forward_pre_hook(pre_forward, with_kwargs=True))
        hooks.append(model.register_forward_hook(post_forward, always_call=True))
        if predictor.timing == "layer":
            for s in sources:
                hooks.append(layers[s].router.register_forward_hook(router_hook(s)))
        yield
    finally:
        for h in hooks:
            h.remove()
