"""Capture and patch tensors at named points of a model's forward pass.

>>> with moelab.attribution.capture(model, points=("resid_post", "router_logits")) as cap:
...     model(**batch)
>>> cap.get("resid_post", layer=3).shape              # (B, S, H) of the last forward
>>> with moelab.attribution.patch(model, "moe_out", lambda t, ctx, layer: t * 0, layers=[3]):
...     model(**batch)                                 # MoE layer 3's block output zeroed

Points (per MoE layer; :mod:`moelab.forward.points` installs every hook):

================  ==============================================================  =========
point             tensor                                                          patchable
================  ==============================================================  =========
``resid_pre``     the residual stream entering the MoE sublayer (B, S, H)         no
``moe_in``        the MoE block's input, after the post-attention norm (B, S, H)  yes
``router_logits`` the router's logits (B, S, E)                                   no
``experts_out``   the routed experts' output, deferred sums included (B, S, H)    yes
``moe_out``       the MoE block's output, shared experts included (B, S, H)       yes
``resid_post``    the decoder layer's output, the stream after the block (B, S, H) yes
================  ==============================================================  =========

Both are reversible context managers: on exit (or an exception) every handler goes and
the model is exactly as before (no hook, no attribute left).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from moelab.errors import MoelabError, unknown_name
from moelab.forward import Order, forward_hooks

#: Capture/patch point → (forward point it rides on, patchable).
POINTS: dict[str, tuple[str, bool]] = {
    "resid_pre": ("resid_pre", False),
    "moe_in": ("moe_in", True),
    "router_logits": ("router", False),
    "experts_out": ("output", True),
    "moe_out": ("moe_out", True),
    "resid_post": ("resid_post", True),
}
#: Patches run after the components that compute the value and before the observers.
PATCH_ORDER = Order.OBSERVE - 100

PatchFn = Callable[[torch.Tensor, Any, Any], "torch.Tensor | None"]


def _check_point(point: str, *, patch: bool = False) -> str:
    if point not in POINTS:
        raise unknown_name("capture point", point, POINTS)
    if patch and not POINTS[point][1]:
        can = [p for p, (_, ok) in POINTS.items() if ok]
        raise MoelabError(f"point {point!r} can be captured but not patched; patchable points: {', '.join(can)}.")
    return point


def _as_bsx(t: torch.Tensor, ctx: Any) -> torch.Tensor:
    """A per-token tensor as (B, S, ...): the experts and router see the tokens flattened."""
    if t.dim() >= 3 or t.shape[0] != ctx.batch * ctx.seq_len:
        return t
    return t.reshape(ctx.batch, ctx.seq_len, *t.shape[1:])


class Capture:
    """Tensors captured at named points, per forward (see :func:`capture`)."""

    def __init__(self, points: tuple[str, ...], device: str | torch.device | None, dtype: torch.dtype | None) -> None:
        self.points = points
        self.device = device
        self.dtype = dtype
        self.by_forward: list[dict[tuple[str, int], torch.Tensor]] = []
        """One mapping per captured forward: (point, MoE layer) → tensor."""

    @property
    def forwards(self) -> int:
        return len(self.by_forward)

    def _keep(self, point: str, layer: int, t: torch.Tensor, ctx: Any) -> None:
        t = _as_bsx(t.detach(), ctx)
        if self.device is not None or self.dtype is not None:
            t = t.to(device=self.device, dtype=self.dtype, copy=True)
        else:
            t = t.clone()
        self.by_forward[-1][(point, layer)] = t

    def get(self, point: str, layer: int, forward: int = -1) -> torch.Tensor:
        """The tensor of ``point`` at MoE layer ``layer`` in the ``forward``-th captured forward."""
        _check_point(point)
        if point not in self.points:
            raise MoelabError(f"point {point!r} was not captured; captured: {', '.join(self.points)}.")
        if not self.by_forward:
            raise MoelabError("nothing was captured: no forward ran inside the capture block.")
        got = self.by_forward[forward].get((point, layer))
        if got is None:
            raise MoelabError(f"nothing captured at {point!r}, MoE layer {layer} in forward {forward}.")
        return got

    def layers(self, point: str, forward: int = -1) -> list[int]:
        return sorted(layer for p, layer in self.by_forward[forward] if p == point) if self.by_forward else []

    def __repr__(self) -> str:
        return f"Capture(points={self.points}, forwards={self.forwards})"


@contextlib.contextmanager
def capture(model: Any, points: Iterable[str] = ("resid_post",), *, layers: Iterable[int] | None = None,
            device: str | torch.device | None = "cpu", dtype: torch.dtype | None = torch.float32
            ) -> Iterator[Capture]:
    """Capture tensors at ``points`` (MoE layers ``layers``, default all) while the block runs.

    Tensors are copied to ``device`` as ``dtype`` (None, None: clones where they are); the
    context manager yields a :class:`Capture` (``cap.get(point, layer, forward=-1)``).
    """
    pts = tuple(_check_point(p) for p in points)
    cap = Capture(pts, device, dtype)
    mgr = forward_hooks(model)
    handles = []
    want = None if layers is None else list(layers)

    def on_forward(ctx):
        cap.by_forward.append({})

    def observer(point: str, fp: str):
        if fp == "router":
            return lambda ctx, layer, call: cap._keep(point, layer.index, call.logits, ctx)
        if fp == "output":
            return lambda ctx, layer, call, out: cap._keep(point, layer.index, out, ctx)
        return lambda ctx, layer, t: cap._keep(point, layer.index, t, ctx)

    try:
        handles.append(mgr.add("forward", on_forward, order=Order.ROUTING - 50, name="attribution capture"))
        for p in pts:
            fp = POINTS[p][0]
            handles.append(mgr.add(fp, observer(p, fp), order=Order.OBSERVE + 50, name=f"capture {p}", layers=want))
        yield cap
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def patch(model: Any, point: str, fn: PatchFn, *, layers: Iterable[int] | None = None) -> Iterator[None]:
    """Replace the tensor at ``point`` with ``fn(tensor, ctx, layer)`` (None keeps it) while the
    block runs. ``tensor`` is (B, S, ...) as in :func:`capture`; return the same shape."""
    _check_point(point, patch=True)
    fp = POINTS[point][0]
    mgr = forward_hooks(model)

    def shaped(t, ctx, layer):
        new = fn(_as_bsx(t, ctx), ctx, layer)
        if new is None:
            return None
        if tuple(new.shape) != tuple(_as_bsx(t, ctx).shape):
            raise MoelabError(f"patch at {point!r}, MoE layer {layer.index}: fn returned shape {tuple(new.shape)}, "
                              f"expected {tuple(_as_bsx(t, ctx).shape)}.")
        return new.reshape(t.shape).to(t.dtype)

    def on_output(ctx, layer, call, out):
        return shaped(out, ctx, layer)

    def on_stream(ctx, layer, t):
        return shaped(t, ctx, layer)

    handler = on_output if fp == "output" else on_stream
    handle = mgr.add(fp, handler, order=PATCH_ORDER, name=f"patch {point}", layers=None if layers is None else list(layers))
    try:
        yield
    finally:
        handle.remove()
