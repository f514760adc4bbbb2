"""Both regimes of each ISA path match the reference: the decode kernels (few rows per expert)
and the compute-bound blocked kernels (AVX2: from 8 rows per expert, weights decoded per tile
chunk of 256 along the reduction; AMX: on tiles from 4 (bf16, fp8), 6 (int8) or 8 (int4) rows per
expert, decoded weights streamed per scale block up to 32 rows and decoded per call above (one k-step
ahead of the tile multiplies either way), a reduction tail
that is not a multiple of 32 on AVX-512), over rows per expert across the switch, expert maps
(uniform, skewed, one expert), zero slots (experts without tokens, zero router weights) and
reductions that span several chunks with a ragged last one. The scheduler's per-thread stats
and the FMA-peak probe are sane."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import KernelSpec, moe_experts, pack_experts, reference_experts, supported_isas
from moelab.kernels.build import ISA_CODES, ISAS, load_extension

SPECS = [KernelSpec("fp32"), KernelSpec("bf16"), KernelSpec("int8", 64), KernelSpec("int4", 32),
         KernelSpec("fp8"), KernelSpec("fp8", block=(16, 32))]
SPEC_IDS = ["fp32", "bf16", "int8g64", "int4g32", "fp8b128", "fp8b16x32"]
TOL = {"fp32": 1e-5, "bf16": 2e-3, "int8": 5e-3, "int4": 5e-3, "fp8": 5e-3}
# across the AVX2 and avx512vnni blocked switch (8), their micro-kernels' rows (6, 8) and row block
# (96), AMX's tile switches (4, 6, 8: moe_kernels.h's
# amx_min_rows), its partial last token block (17, 33), its two-block register tile (32) and its
# switch from streamed to per-call weight decode (33)
ROWS_PER_EXPERT = [1, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 24, 33, 100]


@pytest.fixture(params=ISAS)
def isa(request):
    if request.param not in supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path (supported: {supported_isas()})")
    return request.param


def _layer(e: int, h: int, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(gate=torch.randn(e, i, h, generator=g) * 0.1, up=torch.randn(e, i, h, generator=g) * 0.1,
                down=torch.randn(e, h, i, generator=g) * 0.1)


def _routing(kind: str, t: int, e: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) ids and weights. uniform: random top-k; skewed: expert 0 in every row; one: all slots
    on expert 1 (k = 1). Experts e-1 and e-2 never get a token; every third weight is zero."""
    g = torch.Generator().manual_seed(seed)
    live = e - 2
    if kind == "one":
        ids = torch.ones(t, 1, dtype=torch.long)
    elif kind == "skewed":
        rest = torch.rand(t, live - 1, generator=g).argsort(-1)[:, : k - 1] + 1
        ids = torch.cat([torch.zeros(t, 1, dtype=torch.long), rest], 1)
    else:
        ids = torch.rand(t, live, generator=g).argsort(-1)[:, :k]
    wts = torch.rand(ids.shape, generator=g)
    wts.view(-1)[::3] = 0.0
    return ids, wts


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: str, tol: float | None = None) -> None:
    tol = TOL[dtype] if tol is None else tol
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    assert err <= tol, f"relative max error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("rows", ROWS_PER_EXPERT)
def test_one_expert_matches_reference_at_every_rows_per_expert(isa, spec, rows):
    # H = 520: two full 256-long reduction chunks and a ragged one on the blocked path
    w = _layer(4, 520, 48)
    ids, wts = _routing("one", rows, 4, 1)
    x = torch.randn(rows, 520, generator=torch.Generator().manual_seed(1))
    if spec.dtype in ("bf16", "fp8"):
        x = x.to(torch.bfloat16)
    packed = pack_experts(spec=spec, **w)
    _check(moe_experts(x, ids, wts, packed, isa=isa), reference_experts(x, ids, wts, spec=spec, **w), spec.dtype)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("t", [5, 40])
def test_expert_maps_and_zero_slots_match_reference(isa, spec, kind, t):
    e, h, i, k = 8, 300, 80, 3
    w = _layer(e, h, i, seed=2)
    ids, wts = _routing(kind, t, e, k, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    packed = pack_experts(spec=spec, **w)
    _check(moe_experts(x, ids, wts, packed, isa=isa), reference_experts(x, ids, wts, spec=spec, **w), spec.dtype)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("rows", [40, 100])
@pytest.mark.parametrize("h,i", [(64, 11264), (11264, 64)], ids=["long-down", "long-gate-up"])
def test_long_reductions_in_chunks_match_reference(isa, spec, rows, h, i):
    # A tile call with more than 32 rows whose weight tiles and rows outgrow moe_amx.cpp's
    # kL2Budget (1 MiB) runs its reduction in chunks, weight tiles outer: 4 tiles (a task) of an
    # 11264-long reduction are 1.4 MiB in int8 and 2.8 MiB in bf16, so the down projection
    # (long-down) and gate/up (long-gate-up) both split, into chunks whose last one is ragged
    # (40 rows: chunks of 156 steps of 352 in bf16 and fp8, 157 of 176 in int8), with a
    # partial last token block (40) and four token-block pairs (100).
    # Rounding the 11264-long gate/up sums to bf16 (h) puts the reference up to 2.7e-3 (of the
    # output's largest value) from the kernels on every path, so this test holds them to 5e-3; a
    # chunk lost or counted twice is a tenth of the reduction or more.
    w = _layer(3, h, i, seed=7)
    ids, wts = _routing("one", rows, 3, 1)
    x = torch.randn(rows, h, generator=torch.Generator().manual_seed(8))
    if spec.dtype in ("bf16", "fp8"):
        x = x.to(torch.bfloat16)
    packed = pack_experts(spec=spec, **w)
    _check(moe_experts(x, ids, wts, packed, isa=isa), reference_experts(x, ids, wts, spec=spec, **w), spec.dtype,
           tol=max(TOL[spec.dtype], 5e-3))


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("rows", [5, 17])
def test_a_call_does_not_read_what_the_previous_call_left_in_its_reused_buffers(isa, spec, rows):
    # The calling thread keeps a call's panels and stage-1 outputs for its next call, unfilled
    # (moe_op.cpp's Reused). Fill them with a larger call of huge activations (infinite and NaN
    # products), then repeat a call with partial token blocks and a padded reduction (H = 520): its
    # result must be bit for bit what it was before.
    w = _layer(4, 520, 48)
    packed = pack_experts(spec=spec, **w)
    dt = torch.bfloat16 if spec.dtype in ("bf16", "fp8") else torch.float32
    ids, wts = _routing("one", rows, 4, 1)
    x = torch.randn(rows, 520, generator=torch.Generator().manual_seed(1)).to(dt)
    before = moe_experts(x, ids, wts, packed, isa=isa)
    big_ids, big_wts = _routing("one", 2 * rows, 4, 1)
    moe_experts(torch.full((2 * rows, 520), 3e38).to(dt), big_ids, big_wts, packed, isa=isa)
    assert torch.equal(moe_experts(x, ids, wts, packed, isa=isa), before)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_skewed_batch_result_does_not_depend_on_thread_count(isa, dtype):
    w = _layer(8, 256, 96, seed=5)
    ids, wts = _routing("skewed", 48, 8, 3, seed=6)
    x = torch.randn(48, 256).to(torch.bfloat16)
    packed = pack_experts(spec=KernelSpec(dtype), **w)
    one = moe_experts(x, ids, wts, packed, isa=isa, num_threads=1)
    assert torch.equal(one, moe_experts(x, ids, wts, packed, isa=isa, num_threads=2))


def test_last_call_stats_count_tasks_and_per_thread_busy_time():
    w = _layer(8, 64, 96)
    packed = pack_experts(spec=KernelSpec("bf16"), **w)
    ids, wts = _routing("uniform", 20, 8, 2)
    moe_experts(torch.randn(20, 64), ids, wts, packed, num_threads=2)
    st = load_extension().last_call_stats()
    used = int(torch.unique(ids[wts != 0]).numel())  # an expert's slots of weight 0 are not computed
    assert st["tasks"] == [used * packed.ip // packed.slice1, packed.hp // 64 + (packed.hp % 64 > 0)]
    assert len(st["busy1"]) == len(st["busy2"]) == 2
    assert all(b >= 0 for b in st["busy1"] + st["busy2"]) and sum(st["busy1"]) > 0
    assert all(v >= 0 for v in st["wall"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_slots_of_weight_zero_are_not_computed(isa, dtype):
    # The backends' contract (moelab.backends.base): a slot whose weight is exactly 0 is not
    # computed. Expert 3's weights are infinite, so computing it at all (0 * inf) would put NaN in
    # its tokens' outputs; at weight 0 it must leave them as the call without that slot.
    w = _layer(8, 64, 96, seed=3)
    for name in ("gate", "up", "down"):
        w[name][3] = float("inf")
    packed = pack_experts(spec=KernelSpec(dtype), **w)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    ids = torch.tensor([[3, 0], [1, 3], [2, 3], [3, 4], [3, 5], [5, 3]])
    wts = torch.rand(6, 2, generator=g)
    wts[ids == 3] = 0.0
    wts[1] = torch.tensor([0.0, 0.0])  # a token with every slot at weight 0: output 0
    out = moe_experts(x, ids, wts, packed, isa=isa, num_threads=2)
    assert torch.isfinite(out).all()
    st = load_extension().last_call_stats()
    assert st["tasks"][0] == 4 * packed.ip // packed.slice1  # experts 0, 2, 4, 5: not 1 (weight 0), not 3
    keep = ids != 3  # the same call without the weight-0 slots of expert 3 (one slot per token left)
    alone = moe_experts(x, ids[keep].reshape(6, 1), wts[keep].reshape(6, 1), packed, isa=isa, num_threads=2)
    assert torch.equal(out, alone)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_prepared_call_reads_every_routing_dtype_and_layout_as_the_plain_call(isa, dtype):
    # The extension copies the routing itself (int64 / int32 ids, fp32 / bf16 / fp16 weights read
    # directly, anything else converted by ATen first) and a prepared call (op.prepared_call) keeps
    # the layer's tail in C++: both paths must equal the plain call on int64 ids and fp32 weights
    # holding the same values, bit for bit, synchronous and queued on a lane.
    from moelab.kernels.op import prepared_call

    packed = pack_experts(spec=KernelSpec(dtype), **_layer(8, 64, 96, seed=5))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    ids = torch.rand(5, 8, generator=g).argsort(-1)[:, :3]
    wts = torch.rand(5, 3, generator=g).to(torch.bfloat16).to(torch.float64)  # exact in every float type
    wts[2, 1] = 0.0
    emap = torch.tensor([0, 1, -1, 3, 4, 5, 6, 7])
    want = moe_experts(x, ids, wts.float(), packed, isa=isa, num_threads=2, expert_map=emap)
    prep = prepared_call(packed, isa, 2)
    variants = {
        "int64": ids, "int32": ids.int(), "int16 (ATen)": ids.short(), "strided": ids.t().contiguous().t(),
    }
    weights = {"fp32": wts.float(), "bf16": wts.bfloat16(), "fp16": wts.half(), "fp64 (ATen)": wts,
               "strided": wts.float().t().contiguous().t()}
    for iname, i in variants.items():
        for wname, w in weights.items():
            got = prep.forward(x, i, w, emap)
            assert not isinstance(got, str), (iname, wname, got)
            assert torch.equal(got, want), (iname, wname)
            queued = prep.submit(x, i, w, emap.int(), 1).wait()
            assert torch.equal(queued, want), (iname, wname, "submit")
    assert "integer expert ids" in prep.forward(x, ids.float(), wts.float(), None)
    assert "expert_map must hold integers" in prep.forward(x, ids, wts.float(), emap.float())
    assert "expert id 9 out of range" in prep.submit(x, ids.clone().fill_(9), wts.float(), None, 0)


def test_fma_peak_probe_reports_positive_gflops(isa):
    assert load_extension().fma_peak_gflops(ISA_CODES[isa], 1) > 0


FP8_POOLS = {  # which stored bytes a test draws (NaN, 0x7F / 0xFF, is refused at packing)
    "all": lambda b: b & 0x7F != 0x7F,
    "small": lambda b: b & 0x7F != 0x7F and (b & 0x70) == 0,
    "normal": lambda b: 8 <= (b & 0x7F) < 0x7F,
    # the smallest normals (exponent field 1), with a zero or subnormal byte 1 in 64 below
    "mixed": lambda b: 8 <= (b & 0x7F) < 16,
}


@pytest.mark.parametrize("bytes_", list(FP8_POOLS))
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 8, 24])
def test_every_e4m3_byte_decodes_exactly_in_both_regimes(isa, bytes_, rows):
    # Stored e4m3 weights drawn from every byte but NaN ("all"), only from subnormals and
    # the smallest normals ("small": exponent field 0 or 1, so a subnormal decoded as zero or
    # with the normals' implicit bit is a large error, not a rounding one), or only from normal
    # numbers ("normal": every 64-byte line takes the AVX-512 decode's shift path; the other
    # pools send nearly every line to its byte tables). Unit scales.
    from moelab.kernels import Fp8Weights

    e, h, i = 3, 272, 64
    g = torch.Generator().manual_seed(11)
    pool = torch.tensor([b for b in range(256) if FP8_POOLS[bytes_](b)], dtype=torch.uint8)
    fp8 = {}
    for name, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
        q = pool[torch.randint(0, len(pool), shape, generator=g)]
        if bytes_ == "mixed":  # about a third of the lines all normal (shift decode), the rest with a
            # subnormal or zero among normals of the same size (table decode): a test that sent a
            # subnormal to the shift decode would make it 2^-6 (1 + m/8), not 2^-9 m
            sub = torch.tensor([b for b in range(256) if (b & 0x7F) < 8], dtype=torch.uint8)
            spot = torch.rand(shape, generator=g) < 1 / 64
            q = torch.where(spot, sub[torch.randint(0, len(sub), shape, generator=g)], q)
        q = q.view(torch.float8_e4m3fn)
        grid = (e, -(-shape[1] // 16), -(-shape[2] // 16))
        fp8[name] = Fp8Weights(q, torch.ones(grid), (16, 16))
    ids, wts = _routing("one", rows, e, 1)
    x = torch.randn(rows, h, generator=g).to(torch.bfloat16)
    packed = pack_experts(spec=KernelSpec("fp8"), **fp8)
    ref = reference_experts(x, ids, wts, spec=KernelSpec("fp8"), **fp8)
    _check(moe_experts(x, ids, wts, packed, isa=isa), ref, "fp8")
