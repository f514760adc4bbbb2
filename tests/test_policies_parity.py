"""Deferral and skipping against an independent, slow reference written from the equations.

The reference replaces each MoE block's forward (inside the test only) by a hand-written
loop over tokens and their routed experts, one expert at a time, computed from the
fused weight tensors:

    MoE_k(x) = S_k(x) + Σ_{immediate e} w_e E_e(x) + R_{k-1}^def        (deferred of layer k-1)
    R_k^def  = Σ_{deferred e} w_e E_e(x)                                  (added at MoE layer k+1)

It uses the model's own router (routing is the family's, not the policy's business) and
none of moelab's policy code.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from moelab.adapters import moe_layers
from moelab.compat import cache_kwargs, output_cache, router_outputs
from moelab.models.tiny import FAMILIES, build_tiny
from moelab.policies import ExpertDeferral, ExpertSkipping

TOL = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}

_MODELS: dict = {}


def tiny(family: str, dtype: torch.dtype = torch.float32):
    key = (family, dtype)
    if key not in _MODELS:
        _MODELS[key] = build_tiny(family, seed=0, dtype=dtype)
    return _MODELS[key]


# ---------------------------------------------------------------------------- reference
def expert_forward(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """E_e(x) for one expert, from the fused weights (x: (1, H))."""
    if hasattr(experts, "gate_up_proj_bias"):  # gpt_oss: transposed, interleaved, biased, clamped SwiGLU
        gu = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(max=experts.limit)
        up = up.clamp(min=-experts.limit, max=experts.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))
        return act @ experts.down_proj[e] + experts.down_proj_bias[e]
    gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
    return (experts.act_fn(gate) * up) @ experts.down_proj[e].T


@dataclass
class RefSettings:
    deferred: list[int] = field(default_factory=list)  # per MoE layer
    skipped: list[int] = field(default_factory=list)
    renormalize: bool = False
    union: bool = False


class Reference:
    """Swap every MoE block's forward for the slow reference while active."""

    def __init__(self, model, settings: RefSettings | None):
        self.model = model
        self.layers = moe_layers(model)
        self.settings = settings  # None: the unmodified formula
        self.valid: torch.Tensor | None = None  # (T,) real tokens, for the union rule
        self.pending: torch.Tensor | None = None

    @contextlib.contextmanager
    def active(self, apply: bool, valid: torch.Tensor | None = None):
        self.pending, self.valid = None, valid
        for layer in self.layers:
            layer.block.forward = self._block_forward(layer, apply)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.block.forward
            self.pending = None

    def _block_forward(self, layer, apply: bool):
        def forward(hidden_states):
            out = self._moe(layer, hidden_states, apply)
            return (out, None) if layer.adapter.block_returns_tuple else out

        return forward

    @torch.no_grad()
    def _moe(self, layer, x: torch.Tensor, apply: bool) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        T = h.shape[0]
        _, w, idx = router_outputs(layer.router(h))  # either order transformers 5.x emits
        w = w.reshape(T, -1)
        idx = idx.reshape(T, -1)
        K = idx.shape[1]
        s = self.settings if apply else None
        d = s.deferred[layer.index] if s and s.deferred else 0
        skip = s.skipped[layer.index] if s and s.skipped else 0
        order = [sorted(range(K), key=lambda j, t=t: (-float(w[t, j]), j)) for t in range(T)]
        union: set[int] = set()
        if s is not None and s.union:
            for t in range(T):
                if self.valid is None or bool(self.valid[t]):
                    union |= {int(idx[t, j]) for j in order[t][: K - d]}
        now = torch.zeros(T, shape[-1], dtype=torch.float32)
        late = torch.zeros(T, shape[-1], dtype=torch.float32)
        for t in range(T):
            kept = order[t][: K - skip]
            scale = 1.0
            if skip and s.renormalize:
                scale = float(w[t].float().sum()) / float(w[t, kept].float().sum())
            for rank, j in enumerate(kept):
                e = int(idx[t, j])
                y = expert_forward(layer.experts, e, h[t : t + 1]).float() * float(w[t, j]) * scale
                deferred = rank >= K - d and not (s.union and e in union)
                (late if deferred else now)[t] += y[0]
        if layer.shared_experts is not None:
            sh = layer.shared_experts(h).float()
            if layer.shared_gate is not None:
                sh = torch.sigmoid(layer.shared_gate(h).float()) * sh
            now += sh
        if self.pending is not None:
            now += self.pending
        self.pending = late if d else None
        return now.to(x.dtype).reshape(shape)


# ---------------------------------------------------------------------------- helpers
def batch(B: int, S: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    if B > 1:  # left padding in row 1
        mask[1, :2] = 0
        ids[1, :2] = 0
    return ids, mask


@torch.no_grad()
def run(model, ids, mask, phase: str, ctx_policy, ref: Reference | None):
    """Logits of a prefill forward, or of one decode step after a (policy-free) prefill."""
    policy_cm = ctx_policy if ctx_policy is not None else contextlib.nullcontext()
    if phase == "prefill":
        ref_cm = ref.active(True, mask.reshape(-1).bool()) if ref else contextlib.nullcontext()
        with policy_cm, ref_cm:
            return model(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=1)
    ref_cm = ref.active(True, torch.ones(ids.shape[0], dtype=torch.bool)) if ref else contextlib.nullcontext()
    with policy_cm, ref_cm:
        return model(nxt, attention_mask=mask2, **cache_kwargs(output_cache(out))).logits


def real(logits, mask, phase):
    return logits[mask.bool()] if phase == "prefill" else logits


def deferral_setting(model):
    layers = moe_layers(model)
    k = layers[0].top_k
    d = k // 2  # top-4: D=2 (I=2); top-2: D=1 (I=1, needs min_immediate=1)
    return d, [d] * (len(layers) - 1) + [0]


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_reproduces_unmodified_model(family):
    model = tiny(family)
    ids, mask = batch(3)
    expected = run(model, ids, mask, "prefill", None, None)
    got = run(model, ids, mask, "prefill", None, Reference(model, None))
    torch.testing.assert_close(real(got, mask, "prefill"), real(expected, mask, "prefill"), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("family", FAMILIES)
def test_deferral_matches_reference(family, phase, B, dtype):
    model = tiny(family, dtype)
    ids, mask = batch(B)
    d, per_layer = deferral_setting(model)
    policy = ExpertDeferral(model, d, min_immediate=1, phase="all" if phase == "prefill" else "decode")
    got = run(model, ids, mask, phase, policy, None)
    want = run(model, ids, mask, phase, None, Reference(model, RefSettings(deferred=per_layer)))
    torch.testing.assert_close(real(got, mask, phase).float(), real(want, mask, phase).float(), **TOL[dtype])
    if dtype == torch.float32:  # the comparison must be able to fail: deferral moves the logits far more
        base = run(model, ids, mask, phase, None, None)
        effect = (real(base, mask, phase) - real(got, mask, phase)).abs().max()
        error = (real(want, mask, phase) - real(got, mask, phase)).abs().max()
        assert effect > 20 * error, f"deferral effect {effect:.2e} vs reference error {error:.2e}"


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("family", FAMILIES)
def test_skipping_matches_reference(family, phase, renormalize):
    model = tiny(family)
    ids, mask = batch(3)
    k = moe_layers(model)[0].top_k
    s = k // 2
    n = len(moe_layers(model))
    policy = ExpertSkipping(model, s, renormalize=renormalize, phase="all" if phase == "prefill" else "decode")
    got = run(model, ids, mask, phase, policy, None)
    ref = Reference(model, RefSettings(skipped=[s] * n, renormalize=renormalize))
    want = run(model, ids, mask, phase, None, ref)
    torch.testing.assert_close(real(got, mask, phase), real(want, mask, phase), **TOL[torch.float32])


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss", "olmoe"])
def test_union_rule_matches_reference(family):
    model = tiny(family)
    ids, mask = batch(3)
    d, per_layer = deferral_setting(model)
    policy = ExpertDeferral(model, d, phase="all", batch_rule="union", min_immediate=1)
    got = run(model, ids, mask, "prefill", policy, None)
    want = run(model, ids, mask, "prefill", None, Reference(model, RefSettings(deferred=per_layer, union=True)))
    torch.testing.assert_close(real(got, mask, "prefill"), real(want, mask, "prefill"), **TOL[torch.float32])
    per_token = run(model, ids, mask, "prefill", ExpertDeferral(model, d, phase="all", min_immediate=1), None)
    assert not torch.allclose(per_token, got), "the union rule should differ from per-token deferral on a batch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_zero_deferred_or_skipped_is_bit_exact(family, dtype):
    model = tiny(family, dtype)
    ids, mask = batch(3)
    for phase in ("prefill", "decode"):
        base = run(model, ids, mask, phase, None, None)
        for policy in (
            ExpertDeferral(model, 0, phase="all"),
            ExpertSkipping(model, 0, phase="all"),
            ExpertDeferral(model, immediate=moe_layers(model)[0].top_k, phase="all"),
        ):
            got = run(model, ids, mask, phase, policy, None)
            assert torch.equal(got, base), f"{type(policy).__name__} with nothing to do changed {phase} logits"
