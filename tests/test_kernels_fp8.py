"""FP8 (e4m3, block-scaled) utilities, packing and DeepSeek-V3-style checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

import moelab.kernels  # noqa: F401  (registers the implementations)
from moelab.errors import MoelabError
from moelab.kernels import (
    Fp8Weights,
    KernelSpec,
    dequantize_fp8_blockwise,
    force_isa,
    fp8_error,
    load_fp8_checkpoint,
    pack_experts,
    quantize_fp8_blockwise,
    save_fp8_checkpoint,
    supported_isas,
)
from moelab.kernels.backend import packed_for
from moelab.kernels.fp8 import FP8_MAX, stored_fp8_pack
from moelab.models.tiny import build_tiny


def _finite_e4m3() -> torch.Tensor:
    """Every finite e4m3fn value, sorted (the two NaN bytes left out)."""
    b = torch.arange(256, dtype=torch.uint8)
    b = b[(b & 0x7F) != 0x7F]
    return b.view(torch.float8_e4m3fn).float().unique()


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_quantize_rounds_to_the_nearest_e4m3_value_and_saturates(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 150, 200, generator=g) * torch.logspace(-4, 2, 200)  # wide dynamic range
    q, s = quantize_fp8_blockwise(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (3, -(-150 // block[0]), -(-200 // block[1])) and s.dtype == torch.float32
    scaled = w / dequantize_fp8_blockwise(torch.ones_like(w).to(torch.float8_e4m3fn), s, block)
    grid = _finite_e4m3()
    nearest = (scaled.unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.equal((scaled - q.float()).abs(), nearest)  # no other e4m3 value is closer
    assert q.float().abs().amax() == FP8_MAX  # each block's max maps to ±448
    # saturating: a value whose scaled magnitude exceeds 448 clamps instead of becoming NaN
    q2, _ = quantize_fp8_blockwise(torch.tensor([[1e30, -1e30] + [1.0] * 14] * 16), (16, 16))
    assert q2.float()[0, :2].tolist() == [FP8_MAX, -FP8_MAX] and not q2.float().isnan().any()


@pytest.mark.parametrize("shape", [(256, 256), (100, 70), (7, 300), (1408, 2048)])
@pytest.mark.parametrize("block", [(128, 128), (16, 16)])
def test_fp8_error_against_bf16_is_measured_per_shape(shape, block):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    err = fp8_error(w, block)
    # e4m3 keeps 3 mantissa bits: ~2.6 % relative RMS error on Gaussian weights, whatever the shape
    assert 0.015 < err.rel_fro < 0.035 and err.cosine > 0.9995
    assert fp8_error(w, block).rel_fro == err.rel_fro  # deterministic
    zero = fp8_error(torch.zeros(32, 32), (16, 16))  # all-zero blocks: scale 1, exact
    assert zero.max_abs == 0.0


def test_bad_blocks_nan_bytes_and_unscaled_fp8_tensors_are_refused():
    with pytest.raises(MoelabError, match="multiples of 16"):
        KernelSpec("fp8", block=(128, 100))
    with pytest.raises(MoelabError, match="not a pair"):
        quantize_fp8_blockwise(torch.randn(4, 4), "128")  # type: ignore[arg-type]
    with pytest.raises(MoelabError, match="inf or NaN"):
        quantize_fp8_blockwise(torch.tensor([[float("nan")] * 16] * 16), (16, 16))
    e, i, h = 2, 32, 48
    ws = {n: Fp8Weights.quantize(torch.randn(s), (16, 16)) for n, s in
          (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i)))}
    ws["up"].data.view(torch.uint8)[1, 3, 5] = 0x7F
    with pytest.raises(MoelabError, match="NaN bytes"):
        pack_experts(spec=KernelSpec("fp8"), **ws)
    with pytest.raises(MoelabError, match="scale_inv has shape"):
        Fp8Weights(ws["gate"].data, torch.ones(e, 1, 1), (16, 16))
    with pytest.raises(MoelabError, match="no scales"):
        pack_experts(ws["gate"].data, ws["gate"].data, ws["down"].data, KernelSpec("fp8"))
    with pytest.raises(MoelabError, match="only be packed with KernelSpec"):
        pack_experts(spec=KernelSpec("int8"), **ws)


def test_packed_fp8_is_one_byte_per_weight_with_a_scale_per_tile_and_block():
    e, h, i = 4, 256, 128
    g = torch.Generator().manual_seed(2)
    w = {n: torch.randn(s, generator=g) for n, s in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i)))}
    packed = pack_experts(spec=KernelSpec("fp8", block=(128, 128)), **w)
    assert packed.w1.data_ptr() % 64 == 0 and packed.w2.data_ptr() % 64 == 0
    assert packed.w1.numel() + packed.w2.numel() == e * 3 * h * i  # no padding at these sizes
    # one fp32 scale per (16-row tile, 128-long block): (2I/16)(H/128) + (H/16)(I/128) per expert
    assert packed.s1.numel() + packed.s2.numel() == e * ((2 * i // 16) * (h // 128) + (h // 16) * (i // 128))
    # the e4m3 bytes are the quantiser's, moved not changed: the same multiset per expert matrix
    q, _ = quantize_fp8_blockwise(w["down"], (128, 128))
    got = packed.w2.view(e, -1).sort(-1).values
    assert torch.equal(got, q.view(torch.uint8).reshape(e, -1).sort(-1).values)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    model = build_tiny("deepseek_v3", seed=0, dtype=torch.bfloat16, hidden_size=64, moe_intermediate_size=48)
    path = save_fp8_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "dsv3-fp8", block=(32, 16))
    return model, path


def test_deepseek_v3_checkpoint_is_saved_in_e4m3_with_weight_scale_inv(fp8_checkpoint):
    from safetensors import safe_open

    model, path = fp8_checkpoint
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [32, 16]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn
        assert f.get_tensor(name + "_scale_inv").shape == (64 // 32, 48 // 16)
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv" in keys
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in keys and "lm_head.weight_scale_inv" not in keys
    with pytest.raises(MoelabError, match="already exists"):
        save_fp8_checkpoint(model, path)


def test_deepseek_v3_fp8_checkpoint_runs_intact_on_every_isa(fp8_checkpoint):
    from safetensors import safe_open

    original, path = fp8_checkpoint
    model = load_fp8_checkpoint(path)
    exp = model.model.layers[1].mlp.experts
    intact = stored_fp8_pack(exp)
    assert intact is not None and not any(k.startswith("_moelab") for k in exp.__dict__)
    assert intact.spec.block == (32, 16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # the stored bytes, not re-quantised
        stored = {p: Fp8Weights(
            torch.stack([f.get_tensor(f"model.layers.1.mlp.experts.{x}.{p}.weight") for x in range(8)]),
            torch.stack([f.get_tensor(f"model.layers.1.mlp.experts.{x}.{p}.weight_scale_inv") for x in range(8)]),
            (32, 16)) for p in ("gate_proj", "up_proj", "down_proj")}
    again = pack_experts(stored["gate_proj"], stored["up_proj"], stored["down_proj"], KernelSpec("fp8"))
    assert torch.equal(intact.w1, again.w1) and torch.equal(intact.s2, again.s2)
    assert packed_for(exp, KernelSpec("fp8")) is intact
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(ids).logits.float()  # dequantised weights, bf16
        original.set_experts_implementation("eager")
        bf16 = original(ids).logits.float()
        for isa in supported_isas():
            with force_isa(isa):
                model.set_experts_implementation("moelab_fp8")
                fp8 = model(ids).logits.float()
            assert ((fp8 - eager).norm() / eager.norm()).item() < 0.02, isa  # same weights
            assert ((fp8 - bf16).norm() / bf16.norm()).item() < 0.05, isa  # FP8 tolerance
    with torch.no_grad():
        exp.down_proj.mul_(2.0)  # a changed weight: repacked from the parameters, not the bytes
    assert packed_for(exp, KernelSpec("fp8")) is not intact


def test_loading_a_checkpoint_that_is_not_fp8_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(MoelabError, match="quant_method 'fp8'"):
        load_fp8_checkpoint(tmp_path)


def test_bench_kernels_accepts_fp8_and_reports_its_bandwidth():
    from moelab.cli import build_parser
    from moelab.kernels.bench import BenchConfig, format_table, run_bench

    args = build_parser().parse_args(["bench", "kernels", "--dtypes", "bf16", "fp8", "--baselines"])
    assert args.dtypes == ["bf16", "fp8"]
    cfg = BenchConfig(shapes=["256x128x4x2"], tokens=[1], dtypes=args.dtypes, baselines=[], repeat=1,
                      bandwidth_mib=16)
    result = run_bench(cfg)
    fp8 = next(r for r in result["rows"] if r["dtype"] == "fp8")
    assert fp8["gbps"] > 0 and fp8["pct_read_bw"] > 0 and 0 < fp8["rel_err_vs_bf16"] < 0.1
    assert result["machine"]["fp8_block"] == [128, 128] and "fp8 block 128x128" in format_table(result)
    # the per-call cost line: each way of calling a tiny layer, in µs
    cost = result["machine"]["call_overhead_us"]
    assert set(cost) == {"experts call", "lane submit", "extension"}
    assert all(us > 0 and sp >= 0 for us, sp in cost.values())
    assert "per-call cost on a 64x64x8x2 bf16 layer" in format_table(result)
