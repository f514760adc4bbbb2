"""transformers integration: set_experts_implementation("moelab…") on every family."""

from __future__ import annotations

import pytest
import torch

import moelab.kernels  # noqa: F401  (registers the implementations)
from moelab.backends import get_backend
from moelab.errors import MoelabError
from moelab.kernels import force_isa, supported_isas
from moelab.kernels.backend import clear_packed
from moelab.kernels.integration import IMPLEMENTATIONS, canonical_experts
from moelab.models.tiny import FAMILIES, build_tiny


def _logits(model, ids, impl):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


def _ids(model, seed=0):
    return torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


@pytest.mark.parametrize("family", FAMILIES)
def test_moelab_logits_match_eager_for_every_family(family):
    model = build_tiny(family, seed=0, dtype=torch.float32).eval()
    ids = _ids(model)
    eager = _logits(model, ids, "eager")
    torch.testing.assert_close(_logits(model, ids, "moelab"), eager, atol=1e-4, rtol=1e-4)
    for impl in ("moelab_int8", "moelab_int4"):
        q = _logits(model, ids, impl)
        assert torch.isfinite(q).all()
        rel = (q - eager).norm() / eager.norm()
        assert rel < (0.02 if impl == "moelab_int8" else 0.2), f"{impl}: relative error {rel:.3f}"


# moelab_fp8 vs the bf16 model's eager logits: relative Frobenius error (docs/reference/fp8.md).
# Measured 0.5-1.3 % on the tiny families, 2.5 % on gpt_oss (clamped SwiGLU amplifies it).
FP8_LOGITS_TOL = 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_moelab_fp8_logits_are_within_fp8_tolerance_of_bf16_on_every_isa(family):
    model = build_tiny(family, seed=0, dtype=torch.bfloat16).eval()
    ids = _ids(model)
    ref = _logits(model, ids, "eager")
    outs = {}
    for isa in supported_isas():
        with force_isa(isa):
            outs[isa] = _logits(model, ids, "moelab_fp8")
        rel = ((outs[isa] - ref).norm() / ref.norm()).item()
        assert torch.isfinite(outs[isa]).all() and rel < FP8_LOGITS_TOL, f"{isa}: relative error {rel:.4f}"
    first = next(iter(outs.values()))
    for isa, out in outs.items():  # the paths agree far more closely than fp8 with bf16
        torch.testing.assert_close(out, first, atol=2e-2, rtol=2e-2, msg=lambda m, isa=isa: f"{isa}: {m}")


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_moelab_bf16_model_matches_eager_within_bf16_tolerance(family):
    model = build_tiny(family, seed=0, dtype=torch.bfloat16).eval()
    ids = _ids(model)
    out = _logits(model, ids, "moelab")
    assert out.dtype == torch.float32  # .float() above; the model ran in bf16
    torch.testing.assert_close(out, _logits(model, ids, "eager"), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fallback_paths_match_eager_end_to_end(family):
    model = build_tiny(family, seed=1, dtype=torch.float32).eval()
    ids = _ids(model, 1)
    eager = _logits(model, ids, "eager")
    for isa in ("avx2", "portable"):
        if isa not in supported_isas():
            pytest.skip(f"this CPU cannot run the {isa} path")
        with force_isa(isa):
            torch.testing.assert_close(_logits(model, ids, "moelab"), eager, atol=1e-4, rtol=1e-4)


def test_pack_is_cached_and_invalidated_when_weights_or_dtype_change():
    model = build_tiny("mixtral", seed=0).eval()
    ids = _ids(model)
    _logits(model, ids, "moelab")
    exp = _experts(model)[0]
    backend = get_backend("moelab")  # the instance set_experts_implementation("moelab") runs
    assert not any(k.startswith("_moelab") for k in exp.__dict__)  # the backend owns the packs
    packed = next(iter(backend.cached(exp).values()))
    _logits(model, ids, "moelab")
    assert next(iter(backend.cached(exp).values())) is packed  # reused
    with torch.no_grad():
        exp.down_proj.mul_(2.0)  # in-place change bumps the version counter
    doubled = _logits(model, ids, "moelab")
    assert next(iter(backend.cached(exp).values())) is not packed
    torch.testing.assert_close(doubled, _logits(model, ids, "eager"), atol=1e-4, rtol=1e-4)
    model.to(torch.bfloat16)
    _logits(model, ids, "moelab")
    specs = {s.dtype for s in backend.cached(exp)}
    assert "bf16" in specs
    assert clear_packed(model) == len(_experts(model))
    assert backend.cached(exp) == {}


def test_all_quantised_names_are_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name in IMPLEMENTATIONS:
        assert name in ALL_EXPERTS_FUNCTIONS


def test_unsupported_activation_is_refused_with_the_reason():
    model = build_tiny("mixtral", seed=0)
    exp = _experts(model)[0]
    exp.act_fn = torch.nn.GELU()
    with pytest.raises(MoelabError, match="GELU"):
        canonical_experts(exp)
    exp.has_gate = False
    with pytest.raises(MoelabError, match="has_gate=False"):
        canonical_experts(exp)
