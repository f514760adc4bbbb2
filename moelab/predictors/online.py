"""Run a predictor online, inside a model's forward pass (what a prefetcher does).

>>> def on_prediction(source, target, experts):      # experts: (n, m) int64, best first
...     prefetch(target, experts)
>>> with attach(model, predictor, on_prediction):
...     model.generate(**inputs, max_new_tokens=16)

The predictor is a set of handlers on the model's one forward context
(:mod:`moelab.forward`, level ``PREFETCH``). Layer-wise predictors are called at the
``router`` point of MoE layer ``l`` with its input (the router input the trace
records); iteration-wise and static ones are called once per forward from the token
ids, at the ``forward`` point (before layer 0), for every source layer. Only the
forward's real tokens are predicted for — padding rows never reach the predictor — so
``experts`` has one row per real token, in row-major order. Handlers are removed on
exit, also on exceptions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from moelab.errors import MoelabError

if TYPE_CHECKING:
    from moelab.predictors.base import Predictor

Callback = Callable[[int, int, np.ndarray], None]


def router_inputs(ctx: Any, call: Any) -> tuple[Any, np.ndarray | None] | None:
    """What a layer-wise predictor reads at the ``router`` point of an MoE layer: the real
    tokens' router inputs (T, H) (padding rows dropped) and their token ids (None when the
    forward has none, or they do not line up with the router's rows); None when the router
    saw no input or no real token. One place for every online caller: :func:`attach` and the
    hybrid runtime's prefetch (:class:`moelab.hybrid.runtime.HybridRun`)."""
    hidden = call.hidden
    if hidden is None:
        return None
    hidden = hidden.reshape(-1, hidden.shape[-1])
    valid = ctx.valid(hidden.device)
    if valid is not None and valid.numel() == hidden.shape[0]:
        hidden = hidden[valid]
    if hidden.shape[0] == 0:
        return None
    ids = None
    if ctx.inputs.input_ids is not None:
        ids = ctx.real_token_ids
        ids = ids if len(ids) == hidden.shape[0] else None
    return hidden, ids


@contextmanager
def attach(model: Any, predictor: Predictor, callback: Callback, *, m: int | None = None) -> Iterator[None]:
    """Call ``callback(source_layer, target_layer, predicted)`` during every forward of ``model``."""
    from moelab.adapters import model_fingerprint
    from moelab.forward import Order, forward_hooks

    predictor.check_model(model_fingerprint(model), getattr(model, "name_or_path", type(model).__name__))
    if not predictor.online:
        raise MoelabError(f"the {predictor.kind!r} predictor works only offline (it needs the future routing).")
    sources = predictor.source_layers()
    mgr = forward_hooks(model)

    def on_forward(ctx) -> None:
        if ctx.inputs.input_ids is None:
            return
        ids = ctx.real_token_ids
        if len(ids) == 0:
            return
        for s in sources:
            callback(s, s + predictor.distance, predictor.predict(s, token_ids=ids, m=m))

    def on_router(ctx, layer, call) -> None:
        got = router_inputs(ctx, call)
        if got is not None:
            s = layer.index
            callback(s, s + predictor.distance, predictor.predict(s, hidden=got[0], token_ids=got[1], m=m))

    handles = []
    try:
        if predictor.timing == "layer":
            handles.append(mgr.add("router", on_router, order=Order.PREFETCH, layers=sources, name="online predictor"))
        else:
            handles.append(mgr.add("forward", on_forward, order=Order.PREFETCH, name="online predictor"))
        yield
    finally:
        for h in handles:
            h.remove()
