"""Experts backends: every backend against transformers' eager maths on masked routing.

The reference here is independent of moelab's backends: the experts class's own eager
forward (transformers' code) with the slots whose expert is not here set to weight 0.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import moelab.kernels  # noqa: F401  (registers the moelab experts implementations)
from moelab.backends import BACKENDS, ExpertsBackend, get_backend, require_cpu
from moelab.backends.reference import ReferenceBackend
from moelab.errors import MoelabError
from moelab.kernels import moe_experts, reference_experts
from moelab.kernels.backend import KernelBackend, packed_for
from moelab.kernels.integration import IMPLEMENTATIONS, canonical_experts, resolve_spec
from moelab.models.tiny import FAMILIES, build_tiny

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_BACKENDS = ["reference", "eager", "batched_mm", "grouped_mm"]
KERNEL_BACKENDS = ["moelab", "moelab_bf16", "moelab_int8", "moelab_int4_g32", "moelab_fp8"]
# max |out - ref| / max |ref|, as tests/test_kernels_parity.py (kernels vs their numerics' reference)
KERNEL_TOL = {"fp32": 1e-5, "bf16": 2e-3, "int8": 5e-3, "int4": 5e-3, "fp8": 5e-3}
# fp16 outputs: both round an fp32 result to fp16, and a 1-ulp flip is ~5e-4 of the largest value
OUT_FLOOR = {"fp16": 1e-3}
# transformers' batched/grouped matmuls vs its eager loop: same maths, other summation order
BUILTIN_TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-3}


@functools.cache
def _experts(family: str, dtype: str) -> torch.nn.Module:
    model = build_tiny(family, seed=0, dtype=torch.float32).eval()
    mod = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    mod = copy.deepcopy(mod).to(DTYPES[dtype])
    if family == "gpt_oss":  # larger gate/up values exercise the SwiGLU clamps
        with torch.no_grad():
            mod.gate_up_proj.mul_(20)
    return mod.requires_grad_(False)


def _eager(module, x, idx, w):
    fwd = type(module).forward
    with torch.no_grad():
        return getattr(fwd, "__wrapped__", fwd)(module, x, idx, w)


def _routing(module, t: int, k: int, dtype: torch.dtype, seed: int, zero_slot: bool):
    e = module.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).to(dtype)
    if zero_slot:
        w[0, -1] = 0.0  # a padding slot: exactly 0, not computed
    x = torch.randn(t, module.down_proj.shape[2 if module.is_transposed else 1], generator=g).to(dtype)
    return x, idx, w


def _maps(e: int) -> dict[str, torch.Tensor | None]:
    half = torch.arange(e)
    half[1::2] = -1
    return {"none": None, "half": half, "all": torch.full((e,), -1, dtype=torch.long)}


def _masked(idx, w, expert_map):
    """The routing the reference runs: slots whose expert is not here get weight 0."""
    if expert_map is None:
        return idx, w
    here = expert_map[idx] >= 0
    return idx, torch.where(here, w, torch.zeros_like(w))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)


def _cases(module, dtype: str):
    for t in (1, 5):
        for k in (1, 4):
            for zero_slot in (False, True):
                if zero_slot and k == 1 and t == 1:
                    continue
                x, idx, w = _routing(module, t, k, DTYPES[dtype], seed=t * 10 + k, zero_slot=zero_slot)
                for map_name, expert_map in _maps(module.gate_up_proj.shape[0]).items():
                    yield f"T{t} K{k} zero={zero_slot} map={map_name}", x, idx, w, expert_map


# ---------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_torch_backends_match_eager_on_masked_routing(family, backend):
    be = get_backend(backend)
    for dtype in DTYPES:
        module = _experts(family, dtype)
        for case, x, idx, w, expert_map in _cases(module, dtype):
            ref = _eager(module, x, *_masked(idx, w, expert_map))
            out = be(module, x, idx, w, expert_map)
            assert out.shape == ref.shape and out.dtype == ref.dtype, case
            if expert_map is not None and not bool((expert_map >= 0).any()):
                assert torch.equal(out, torch.zeros_like(out)), case
            if backend in ("reference", "eager"):
                skipped = expert_map is not None or bool((w == 0).any())
                if dtype != "fp32" or not skipped:
                    # same operations, same rows: bit for bit
                    assert torch.equal(out, ref), f"{dtype} {case}: {_rel(out, ref):.2e}"
                else:  # fewer rows per expert: CPU BLAS may pick another fp32 kernel (an ulp)
                    assert _rel(out, ref) <= 1e-6, f"{dtype} {case}: {_rel(out, ref):.2e}"
            else:
                assert _rel(out, ref) <= BUILTIN_TOL[dtype], f"{dtype} {case}: {_rel(out, ref):.2e}"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_backends_match_their_reference_and_skip_slots_exactly(family, backend):
    be = get_backend(backend)
    for dtype in DTYPES:
        module = _experts(family, dtype)
        spec = resolve_spec(module, be.spec)
        canon = canonical_experts(module)
        packed = be.packed(module)
        for case, x, idx, w, expert_map in _cases(module, dtype):
            out = be(module, x, idx, w, expert_map)
            midx, mw = _masked(idx, w, expert_map)
            ref = reference_experts(x, midx, mw, spec=spec, **canon)
            assert out.shape == ref.shape and out.dtype == x.dtype, case
            tol = max(KERNEL_TOL[spec.dtype], OUT_FLOOR.get(dtype, 0.0))
            assert _rel(out, ref) <= tol, f"{dtype} {spec.dtype} {case}: {_rel(out, ref):.2e} > {tol:.0e}"
            # skipping a slot is exactly computing it with weight 0
            assert torch.equal(out, moe_experts(x, midx, mw, packed)), f"{dtype} {case}"


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_a_compacted_module_with_a_local_expert_map_equals_the_full_module(family):
    full = _experts(family, "fp32")
    keep = [2, 5, 7]
    local = copy.deepcopy(full)
    for name, p in list(full.named_parameters(recurse=False)):
        setattr(local, name, torch.nn.Parameter(p.detach()[keep].clone(), requires_grad=False))
    local.num_experts = len(keep)
    on_full = torch.full((8,), -1, dtype=torch.long)
    on_full[keep] = torch.tensor(keep)
    on_local = torch.full((8,), -1, dtype=torch.long)
    on_local[keep] = torch.arange(len(keep))
    x, idx, w = _routing(full, 5, 4, torch.float32, seed=3, zero_slot=True)
    for name in [*TORCH_BACKENDS, "moelab", "moelab_int4"]:
        be = get_backend(name)
        a, b = be(full, x, idx, w, on_full), be(local, x, idx, w, on_local)
        assert _rel(b, a) <= 1e-6, name


def test_set_experts_implementation_runs_the_registered_backend_instance():
    model = build_tiny("qwen3_moe", seed=0).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    model.set_experts_implementation("moelab_int4")
    with torch.no_grad():
        model(ids)
    exps = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    be = get_backend("moelab_int4")
    assert all(be.cached(m) for m in exps)
    assert packed_for(exps[0], be.spec) is next(iter(be.cached(exps[0]).values()))
    assert not any(k.startswith("_moelab") for m in exps for k in m.__dict__)


def test_packs_belong_to_the_backend_and_die_with_the_module():
    import gc

    be = KernelBackend(None, "private")
    module = copy.deepcopy(_experts("mixtral", "fp32"))
    be.packed(module)
    assert len(be.cached(module)) == 1 and get_backend("moelab").cached(module) == {}
    del module
    gc.collect()
    assert len(be._packs) == 0


# ---------------------------------------------------------------------------------- registry
def test_registry_names_every_backend_and_suggests_close_names():
    assert set(BACKENDS.names()) == {*TORCH_BACKENDS, *IMPLEMENTATIONS}
    for name in BACKENDS.names():
        be = get_backend(name)
        assert isinstance(be, ExpertsBackend) and be.name == name
    assert isinstance(get_backend("reference"), ReferenceBackend)
    with pytest.raises(MoelabError, match="moelab_int4"):
        get_backend("moelab_in4")
    with pytest.raises(MoelabError, match="already registered"):
        BACKENDS.register("reference", ReferenceBackend())


# ---------------------------------------------------------------------------------- bad input
def test_bad_expert_maps_and_ids_are_refused_with_the_value():
    module = _experts("mixtral", "fp32")
    x, idx, w = _routing(module, 3, 2, torch.float32, seed=0, zero_slot=False)
    be = get_backend("reference")
    too_big, too_small = torch.arange(8), torch.arange(8)
    too_big[3], too_small[3] = 8, -2
    with pytest.raises(MoelabError, match=r"values in \[0, 8\].*\[0, 8\) for a module holding 8"):
        be(module, x, idx, w, too_big)
    with pytest.raises(MoelabError, match=r"values in \[-2, 7\]"):
        be(module, x, idx, w, too_small)
    with pytest.raises(MoelabError, match="integer"):
        be(module, x, idx, w, torch.zeros(8))
    with pytest.raises(MoelabError, match="expert map's length"):
        be(module, x, idx, w, torch.arange(4))
    with pytest.raises(MoelabError, match="not a 1-D tensor"):  # was an AttributeError
        be(module, x, idx, w, list(range(8)))
    with pytest.raises(MoelabError, match=r"expected \(T, 32\)"):
        be(module, x[:, :5], idx, w)
    with pytest.raises(MoelabError, match=r"\(T, K\)"):
        be(module, x, idx, w[:, :1])


def test_cpu_kernels_refuse_tensors_on_other_devices_with_the_fix():
    # No CUDA here: meta tensors take the same path (any non-CPU device is refused before
    # the kernels see it); the real-CUDA test is below.
    module = _experts("mixtral", "fp32")
    x, idx, w = _routing(module, 3, 2, torch.float32, seed=0, zero_slot=False)
    be = get_backend("moelab_int4")
    with pytest.raises(MoelabError, match=r"hidden_states is on meta.*get_backend\('reference'\)"):
        be(module, x.to("meta"), idx, w)
    with pytest.raises(MoelabError, match=r"MixtralExperts.gate_up_proj is on meta"):
        be(copy.deepcopy(module).to("meta"), x, idx, w)
    with pytest.raises(MoelabError, match=r"expert_map is on meta"):
        be(module, x, idx, w, torch.arange(8, device="meta"))
    with pytest.raises(MoelabError, match=r"x is on meta.*CPU"):
        require_cpu("moelab", x=torch.empty(1, device="meta"))
    require_cpu("moelab", x=torch.empty(1), y=None)  # CPU tensors pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_torch_backends_run_on_cuda_and_the_kernels_refuse_it():
    module = _experts("gpt_oss", "fp32")
    x, idx, w = _routing(module, 5, 4, torch.float32, seed=1, zero_slot=True)
    expert_map = _maps(8)["half"]
    ref = get_backend("reference")(module, x, idx, w, expert_map)
    gpu = copy.deepcopy(module).cuda()
    for name in TORCH_BACKENDS:
        out = get_backend(name)(gpu, x.cuda(), idx.cuda(), w.cuda(), expert_map.cuda())
        assert out.device.type == "cuda"
        assert _rel(out.cpu(), ref) <= 1e-4, name
    with pytest.raises(MoelabError, match="is on cuda"):
        get_backend("moelab")(gpu, x.cuda(), idx.cuda(), w.cuda())


# ------------------------------------------------------------------ the per-call checks' fast paths
def _route_both_ways(monkeypatch, module, x, idx, w, expert_map=None):
    """route() with its list path (every call here is small) and with its torch path (forced)."""
    import moelab.backends.base as base

    small = base.route(module, x, idx, w, expert_map)
    monkeypatch.setattr(base, "_SMALL", -1)
    large = base.route(module, x, idx, w, expert_map)
    monkeypatch.undo()
    return small, large


@pytest.mark.parametrize("special", ["none", "zero", "negative zero", "nan"])
def test_route_reads_small_and_large_calls_alike(monkeypatch, special):
    module = _experts("mixtral", "fp32")
    x, idx, w = _routing(module, 3, 2, torch.float32, seed=0, zero_slot=False)
    value = {"none": None, "zero": 0.0, "negative zero": -0.0, "nan": float("nan")}[special]
    if value is not None:
        w[1, 0] = value
    small, large = _route_both_ways(monkeypatch, module, x, idx, w)
    # from the definition: a slot runs where its weight is not 0 (NaN is not 0, -0.0 is)
    want = torch.tensor([[not (i == 1 and j == 0 and special in ("zero", "negative zero")) for j in range(2)]
                         for i in range(3)])
    for r in (small, large):
        assert torch.equal(r.active, want)
        assert r.all_active == bool(want.all())
        assert torch.equal(r.index, idx)
    half = _maps(8)["half"]
    small, large = _route_both_ways(monkeypatch, module, x, idx, w, half)
    assert torch.equal(small.active, large.active) and small.all_active == large.all_active


@pytest.mark.parametrize("force_torch", [False, True])
def test_route_names_out_of_range_ids_on_either_path(monkeypatch, force_torch):
    import moelab.backends.base as base

    if force_torch:
        monkeypatch.setattr(base, "_SMALL", -1)
    module = _experts("mixtral", "fp32")
    x, idx, w = _routing(module, 3, 2, torch.float32, seed=0, zero_slot=False)
    bad = idx.clone()
    bad[2, 1] = 8
    with pytest.raises(MoelabError, match=r"expert ids in \[\d, 8\]; expected \[0, 8\)"):
        base.route(module, x, bad, w, None)
    bad[2, 1] = -3
    with pytest.raises(MoelabError, match=r"expert ids in \[-3, \d\]"):
        base.route(module, x, bad, w, None)


def test_the_device_check_reads_stacks_that_are_not_parameters():
    """The fast device check covers parameters; a stack held as a buffer or a plain attribute
    is still checked (by the full check) and refused off the CPU."""
    be = get_backend("moelab")
    x, idx, w = _routing(_experts("mixtral", "fp32"), 3, 2, torch.float32, seed=0, zero_slot=False)
    for how in ("buffer", "attribute"):
        module = copy.deepcopy(_experts("mixtral", "fp32"))
        down = module.down_proj.detach().to("meta")
        del module.down_proj
        if how == "buffer":
            module.register_buffer("down_proj", down)
        else:
            object.__setattr__(module, "down_proj", down)
        with pytest.raises(MoelabError, match=r"MixtralExperts.down_proj is on meta"):
            be.check_devices(module, {"hidden_states": x, "top_k_index": idx, "top_k_weights": w})
    be.check_devices(_experts("mixtral", "fp32"), {"hidden_states": x, "top_k_index": idx, "top_k_weights": w,
                                                    "expert_map": None})  # all on the CPU: passes


def test_the_pack_key_lists_what_named_parameters_lists():
    from moelab.kernels.integration import cache_key

    module = copy.deepcopy(_experts("mixtral", "fp32"))
    module.register_parameter("nothing", None)
    module.register_parameter("again", module.gate_up_proj)  # one parameter under two names
    want = tuple((n, p.data_ptr(), p._version, p.dtype, tuple(p.shape))
                 for n, p in module.named_parameters(recurse=False))
    assert cache_key(module) == want and len(want) == 2
    with torch.no_grad():
        module.down_proj.add_(1)  # in place: the version moves, so the key does
    assert cache_key(module) != want


def test_supported_paths_follow_the_detected_features(monkeypatch):
    from moelab.kernels import build

    best = build.supported_isas()
    assert build.supported_isas() is best  # worked out once
    monkeypatch.setattr(build, "_features", frozenset())
    assert build.supported_isas() == ("portable",)
    monkeypatch.undo()
    assert build.supported_isas() == best


@pytest.mark.parametrize("backend", ["moelab", "moelab_int8"])
def test_a_prepared_kernel_call_equals_the_checked_one_and_still_refuses_bad_input(backend):
    # A kernel backend checks a module's first call in full (route) and keeps its arguments; the
    # module's next calls skip the torch-side checks and apply the expert map in the kernel. Both
    # must give the same bits, and the prepared path must still refuse bad routing by value.
    module = copy.deepcopy(_experts("mixtral", "fp32"))
    be = KernelBackend(get_backend(backend).spec, backend)
    x, idx, w = _routing(module, 5, 2, torch.float32, seed=3, zero_slot=True)
    for name, expert_map in _maps(8).items():
        be.forget(module)
        first = be(module, x, idx, w, expert_map)  # full checks, then prepared
        # (no expert here: zeros before any pack, so nothing to prepare)
        assert (module in be._calls) == (name != "all"), name
        assert torch.equal(be(module, x, idx, w, expert_map), first), name
        assert torch.equal(be.submit(module, x, idx, w, expert_map).result(), first), name
    bad = idx.clone()
    bad[1, 0] = 8
    with pytest.raises(MoelabError, match=r"expert id 8 out of range \[0, 8\)"):
        be(module, x, bad, w)
    with pytest.raises(MoelabError, match=r"expert_map entry 9 out of range \[-1, 8\)"):
        be(module, x, idx, w, torch.tensor([0, 1, 2, 3, 4, 5, 6, 9]))
    with pytest.raises(MoelabError, match="integer expert ids"):
        be(module, x, idx.float(), w)
    with pytest.raises(MoelabError, match="expected an integer tensor"):
        be(module, x, idx, w, torch.arange(8.0))
    with pytest.raises(MoelabError, match="not a 1-D tensor"):
        be(module, x, idx, w, torch.arange(8).reshape(2, 4))
    with pytest.raises(MoelabError, match=r"expected \(T, 32\)"):
        be(module, x[:, :5], idx, w)
    with pytest.raises(MoelabError, match="not a 1-D tensor"):
        be(module, x, idx, w, list(range(8)))
    assert torch.equal(be(module, x, idx, w), be(module, x, idx, w))  # still usable after the errors
