"""Every native kernel path matches the plain-torch reference over a grid of shapes."""

from __future__ import annotations

import threading

import pytest
import torch

from moelab.kernels import (
    Fp8Weights,
    KernelSpec,
    moe_experts,
    pack_experts,
    reference_experts,
    supported_isas,
)
from moelab.kernels.build import ISAS

# E experts, H hidden, I intermediate, K top-k, T tokens; odd sizes included.
SHAPES = [
    (8, 32, 64, 2, 1),
    (8, 33, 45, 1, 7),
    (16, 130, 70, 8, 64),
    (6, 64, 96, 3, 17),
    (4, 47, 129, 4, 33),
]
SPECS = [KernelSpec("fp32"), KernelSpec("bf16"), KernelSpec("int8", 32), KernelSpec("int8", 128),
         KernelSpec("int4", 64), KernelSpec("int4", 128), KernelSpec("fp8"), KernelSpec("fp8", block=(16, 32))]
SPEC_IDS = [f"{s.dtype}b{s.block[0]}x{s.block[1]}" if s.dtype == "fp8" else f"{s.dtype}g{s.group_size}"
            for s in SPECS]
# max |kernel - reference| / max |reference| (fp8: bf16 activations and h, so a 1-ulp bf16
# flip of h from a different summation order shows; a layout or scale bug gives O(1))
TOL = {"fp32": 1e-5, "bf16": 2e-3, "int8": 5e-3, "int4": 5e-3, "fp8": 5e-3}


def _isa_params():
    out = []
    for isa in ISAS:
        out.append(pytest.param(isa, id=isa))
    return out


@pytest.fixture(params=_isa_params())
def isa(request):
    if request.param not in supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path (supported: {supported_isas()})")
    return request.param


def _layer(e: int, h: int, i: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = dict(
        gate=torch.randn(e, i, h, generator=g) * 0.1,
        up=torch.randn(e, i, h, generator=g) * 0.1,
        down=torch.randn(e, h, i, generator=g) * 0.1,
    )
    if bias:
        w.update(gate_bias=torch.randn(e, i, generator=g) * 0.1, up_bias=torch.randn(e, i, generator=g) * 0.1,
                 down_bias=torch.randn(e, h, generator=g) * 0.1)
    return w


def _routing(t: int, e: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    assert err <= TOL[dtype], f"relative max error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("shape", SHAPES, ids=[f"E{e}H{h}I{i}K{k}T{t}" for e, h, i, k, t in SHAPES])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_kernel_matches_reference_silu(isa, shape, spec):
    e, h, i, k, t = shape
    w = _layer(e, h, i, bias=False)
    ids, wts = _routing(t, e, k)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1))
    if spec.dtype in ("bf16", "fp8"):
        x = x.to(torch.bfloat16)
    packed = pack_experts(spec=spec, **w)
    _check(moe_experts(x, ids, wts, packed, isa=isa), reference_experts(x, ids, wts, spec=spec, **w), spec.dtype)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_kernel_matches_reference_gpt_oss_clamped_swiglu_with_biases(isa, spec):
    e, h, i, k, t = 8, 40, 36, 4, 9
    w = _layer(e, h, i, bias=True)
    w = {n: v * 30 if n in ("gate", "up") else v for n, v in w.items()}  # exercise the clamps
    ids, wts = _routing(t, e, k)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2))
    kw = dict(act="gpt_oss", alpha=1.702, limit=7.0)
    packed = pack_experts(spec=spec, **w, **kw)
    ref = reference_experts(x, ids, wts, spec=spec, **w, **kw)
    _check(moe_experts(x, ids, wts, packed, isa=isa), ref, spec.dtype)


@pytest.mark.parametrize("act", ["silu", "gpt_oss"])
def test_a_nan_token_stays_nan_and_alone(isa, act):
    # a NaN in one token's hidden state reaches that token's output (the clamps of gpt_oss's
    # SwiGLU must not turn it into the limit) and no other token's
    e, h, i, t = 4, 64, 64, 6
    w = _layer(e, h, i, bias=act == "gpt_oss")
    kw = dict(act="gpt_oss", alpha=1.702, limit=7.0) if act == "gpt_oss" else {}
    packed = pack_experts(spec=KernelSpec("fp32"), **w, **kw)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3))
    x[2, 5] = float("nan")
    ids = torch.zeros(t, 1, dtype=torch.long)
    out = moe_experts(x, ids, torch.ones(t, 1), packed, isa=isa)
    assert out[2].isnan().all()
    assert torch.isfinite(out[[0, 1, 3, 4, 5]]).all()


def test_all_tokens_on_one_expert_and_empty_experts(isa):
    e, h, i, t = 16, 48, 80, 40
    w = _layer(e, h, i, bias=False)
    ids = torch.full((t, 1), 5)
    wts = torch.rand(t, 1)
    x = torch.randn(t, h)
    for spec in (KernelSpec("fp32"), KernelSpec("int4", 32), KernelSpec("fp8", block=(32, 16))):
        packed = pack_experts(spec=spec, **w)
        _check(moe_experts(x, ids, wts, packed, isa=isa), reference_experts(x, ids, wts, spec=spec, **w), spec.dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_zero_tokens_give_an_empty_output(dtype):
    w = _layer(4, 32, 32, bias=False)
    packed = pack_experts(spec=KernelSpec(dtype), **w)
    out = moe_experts(torch.empty(0, 32), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), packed)
    assert out.shape == (0, 32)


@pytest.mark.parametrize("block", [(128, 128), (16, 48)])
def test_stored_fp8_weights_run_intact_and_match_the_dequantising_reference(isa, block):
    # Weights already in e4m3 (as a checkpoint stores them), with scales of both signs of
    # magnitude and subnormal bytes: packed without re-quantisation.
    e, h, i, k, t = 6, 100, 70, 3, 21
    g = torch.Generator().manual_seed(3)
    fp8 = {}
    for name, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
        q = (torch.randn(shape, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        q.view(torch.uint8)[..., 0] = torch.randint(0, 8, q.shape[:-1], dtype=torch.uint8, generator=g)  # subnormals
        grid = (e, -(-shape[1] // block[0]), -(-shape[2] // block[1]))
        fp8[name] = Fp8Weights(q, torch.rand(grid, generator=g) * 1e-3 + 1e-5, block)
    ids, wts = _routing(t, e, k)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    packed = pack_experts(spec=KernelSpec("fp8"), **fp8)
    assert packed.spec.block == block  # the stored block, not the spec's default
    _check(moe_experts(x, ids, wts, packed, isa=isa), reference_experts(x, ids, wts, spec=KernelSpec("fp8"), **fp8),
           "fp8")


def test_result_does_not_depend_on_thread_count():
    w = _layer(8, 64, 96, bias=False)
    ids, wts = _routing(30, 8, 3)
    x = torch.randn(30, 64)
    packed = pack_experts(spec=KernelSpec("int8", 32), **w)
    one = moe_experts(x, ids, wts, packed, num_threads=1)
    two = moe_experts(x, ids, wts, packed, num_threads=2)
    assert torch.equal(one, two)


def test_concurrent_calls_from_python_threads_are_correct():
    w = _layer(8, 64, 96, bias=False)
    packed = pack_experts(spec=KernelSpec("fp32"), **w)
    ids, wts = _routing(12, 8, 2)
    x = torch.randn(12, 64)
    expected = moe_experts(x, ids, wts, packed)
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: results.append(moe_experts(x, ids, wts, packed))) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 4 and all(torch.equal(r, expected) for r in results)


def test_out_of_range_expert_id_is_an_error():
    w = _layer(4, 32, 32, bias=False)
    packed = pack_experts(spec=KernelSpec("fp32"), **w)
    with pytest.raises(RuntimeError, match="out of range"):
        moe_experts(torch.randn(2, 32), torch.tensor([[0], [4]]), torch.ones(2, 1), packed)
