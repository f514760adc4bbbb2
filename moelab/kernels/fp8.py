"""FP8 (e4m3) expert weights with block scales: quantisation, error and DeepSeek-V3 checkpoints.

DeepSeek-V3/R1 and Kimi-K2 store every linear weight as ``torch.float8_e4m3fn`` with one
fp32 scale per 128×128 block, saved next to it as ``<name>.weight_scale_inv``: the
weight is ``w = q · scale_inv`` (the name is historical; the tensor *multiplies*). The
block shape is ``config.quantization_config["weight_block_size"]``. Here:

* :func:`quantize_fp8_blockwise` — fp32/bf16 → e4m3 with block scales
  (``scale = max|w| / 448`` per block, round to nearest even, saturating at ±448);
  :func:`dequantize_fp8_blockwise` is its inverse; :func:`fp8_error` measures it.
* :class:`Fp8Weights` — a stack of per-expert e4m3 matrices with their scales, accepted
  by :func:`~moelab.kernels.packing.pack_experts` (packed intact, no re-quantisation) and
  by :func:`~moelab.kernels.reference.reference_experts`.
* :func:`save_fp8_checkpoint` / :func:`load_fp8_checkpoint` — a model in the DeepSeek-V3
  checkpoint layout (per-expert ``experts.{e}.{gate,up,down}_proj.weight`` in e4m3 plus
  ``weight_scale_inv``; other linear layers likewise, except the router and lm_head).
  Loading keeps the experts' e4m3 bytes and scales for the ``moelab_fp8`` kernels and
  gives the model dequantised weights everywhere else.

Shapes: a weight is ``(..., N, K)`` (N output rows, K the reduction); its scales are
``(..., ceil(N / bn), ceil(K / bk))`` for the block ``(bn, bk)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelab.errors import MoelabError
from moelab.kernels.quant import QuantError, quant_error

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn magnitude."""
DEFAULT_BLOCK: tuple[int, int] = (128, 128)
"""DeepSeek-V3's ``weight_block_size``."""
SCALE_SUFFIX = "_scale_inv"
WEIGHTS_FILE = "model.safetensors"
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def check_block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    """``block`` as a ``(rows, reduction)`` pair of positive multiples of 16, or a MoelabError."""
    try:
        bn, bk = (int(v) for v in block)
    except (TypeError, ValueError):
        raise MoelabError(f"fp8 block {block!r} is not a pair (rows, reduction) such as (128, 128).") from None
    if bn < 16 or bk < 16 or bn % 16 or bk % 16:
        raise MoelabError(
            f"fp8 block {block!r} is not supported; both sides must be positive multiples of 16 "
            "(DeepSeek-V3 uses (128, 128))."
        )
    return bn, bk


def _grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def quantize_fp8_blockwise(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: e4m3fn values of ``w``'s shape and fp32 block scales.

    ``scale_inv = max|w| / 448`` per block (1 for an all-zero block), ``q = w / scale_inv``
    rounded to nearest even and saturated to ±448, so ``q · scale_inv ≈ w``. Partial
    blocks at the edges are allowed (the scale grid rounds up).
    """
    bn, bk = check_block(block)
    if w.dim() < 2:
        raise MoelabError(f"expected a weight of shape (..., N, K); got {tuple(w.shape)}.")
    if not torch.isfinite(w).all():
        raise MoelabError("the weight has inf or NaN values; fp8 block quantisation needs finite weights.")
    *lead, n, k = w.shape
    gn, gk = _grid(n, k, (bn, bk))
    wf = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    blocks = wf.reshape(*lead, gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, gn * bn, gk * bk)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def expand_scales(scale_inv: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-element scales ``(..., n, k)`` from block scales ``(..., ceil(n/bn), ceil(k/bk))``."""
    bn, bk = check_block(block)
    if tuple(scale_inv.shape[-2:]) != _grid(n, k, (bn, bk)):
        raise MoelabError(
            f"scales of shape {tuple(scale_inv.shape)} do not match a ({n}, {k}) weight in "
            f"{bn}x{bk} blocks; expected (..., {_grid(n, k, (bn, bk))[0]}, {_grid(n, k, (bn, bk))[1]})."
        )
    s = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return s[..., :n, :k]


def dequantize_fp8_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """fp32 ``q · scale_inv`` (inverse of :func:`quantize_fp8_blockwise`)."""
    n, k = q.shape[-2:]
    return q.float() * expand_scales(scale_inv, n, k, block)


def fp8_error(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> QuantError:
    """Error of ``w``'s fp8 round trip against ``w`` itself (e.g. the bf16 weights)."""
    return quant_error(dequantize_fp8_blockwise(*quantize_fp8_blockwise(w, block), block), w.float())


@dataclass(frozen=True)
class Fp8Weights:
    """Per-expert e4m3 matrices ``data`` ``(E, N, K)`` with block scales ``(E, ⌈N/bn⌉, ⌈K/bk⌉)``."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        check_block(self.block)
        if self.data.dtype != FP8_DTYPE or self.data.dim() != 3:
            raise MoelabError(
                f"Fp8Weights.data must be a (E, N, K) {FP8_DTYPE} tensor; got {self.data.dtype} "
                f"{tuple(self.data.shape)}. Quantise with Fp8Weights.quantize(w)."
            )
        e, n, k = self.data.shape
        grid = (e, *_grid(n, k, self.block))
        if tuple(self.scale_inv.shape) != grid:
            raise MoelabError(
                f"Fp8Weights.scale_inv has shape {tuple(self.scale_inv.shape)}; expected {grid} for "
                f"{self.block[0]}x{self.block[1]} blocks."
            )

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> Fp8Weights:
        """Quantise an ``(E, N, K)`` float tensor."""
        q, s = quantize_fp8_blockwise(w, block)
        return cls(q, s, tuple(block))  # type: ignore[arg-type]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dim(self) -> int:
        return 3

    def expert(self, x: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``x``'s ``(N, K)`` e4m3 matrix and its scales."""
        return self.data[x], self.scale_inv[x]

    def dequantize(self) -> torch.Tensor:
        """fp32 ``(E, N, K)``."""
        return dequantize_fp8_blockwise(self.data, self.scale_inv, self.block)


# --------------------------------------------------------------------------- stored packs

# module → (parameter key at install time, packed stored e4m3 weights). Weak keys: the pack
# lives as long as the module, and nothing is hidden in the module's __dict__.
_STORED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, Any]] = weakref.WeakKeyDictionary()
_STORED_LOCK = threading.Lock()


def store_fp8_pack(module: torch.nn.Module, key: tuple, packed: Any) -> None:
    """Remember ``module``'s stored e4m3 weights, packed, valid while its parameter key is ``key``."""
    with _STORED_LOCK:
        _STORED[module] = (key, packed)


def stored_fp8_pack(module: torch.nn.Module, key: tuple | None = None) -> Any:
    """The stored-weights pack of ``module`` (``PackedExperts``), or ``None``.

    With ``key`` (the module's current parameter key), ``None`` also when a parameter
    changed since the weights were installed: the parameters are then the truth.
    """
    with _STORED_LOCK:
        hit = _STORED.get(module)
    if hit is None or (key is not None and hit[0] != key):
        return None
    return hit[1]


def forget_fp8_pack(module: torch.nn.Module) -> bool:
    """Drop ``module``'s stored e4m3 pack; whether it had one."""
    with _STORED_LOCK:
        return _STORED.pop(module, None) is not None


# --------------------------------------------------------------------------- checkpoints


def _quantised_linear_names(model: torch.nn.Module) -> set[str]:
    """Linear layers DeepSeek-V3 stores in fp8: every nn.Linear but the router and lm_head."""
    names = set()
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf not in ("gate", "router", "lm_head"):
            names.add(name)
    return names


def _experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")}


def save_fp8_checkpoint(
    model: torch.nn.Module, path: str | Path, block: tuple[int, int] = DEFAULT_BLOCK
) -> Path:
    """Save ``model`` as DeepSeek-V3 does: e4m3 linear weights + ``weight_scale_inv``.

    Experts are written per expert (``<experts>.{e}.gate_proj.weight`` …); the router,
    lm_head, embeddings and norms keep the model's dtype. ``config.json`` gets
    ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": …}``.
    The directory is written under a temporary name and renamed when complete; an
    existing ``path`` is an error.
    """
    from safetensors.torch import save_file

    from moelab.kernels.integration import canonical_experts

    block = check_block(block)
    path = Path(path)
    if path.exists():
        raise MoelabError(f"{path} already exists; choose a new directory for the fp8 checkpoint.")
    tensors: dict[str, torch.Tensor] = {}
    experts = _experts_modules(model)
    fp8_linear = _quantised_linear_names(model)
    with torch.no_grad():
        for prefix, mod in experts.items():
            w = canonical_experts(mod)
            if "gate_bias" in w or w["act"] != "silu":
                raise MoelabError(
                    f"{prefix} ({type(mod).__name__}) has biases or a non-SiLU activation; the "
                    "DeepSeek-V3 fp8 checkpoint layout has neither. Save this model with save_pretrained."
                )
            for proj, t in (("gate_proj", w["gate"]), ("up_proj", w["up"]), ("down_proj", w["down"])):
                q, s = quantize_fp8_blockwise(t, block)
                for e in range(q.shape[0]):
                    tensors[f"{prefix}.{e}.{proj}.weight"] = q[e].contiguous()
                    tensors[f"{prefix}.{e}.{proj}.weight{SCALE_SUFFIX}"] = s[e].contiguous()
        for name, t in model.state_dict().items():
            owner = name.rsplit(".", 1)[0]
            if owner in experts:
                continue
            if owner in fp8_linear and name.endswith(".weight"):
                q, s = quantize_fp8_blockwise(t, block)
                tensors[name], tensors[name + SCALE_SUFFIX] = q, s
            else:
                tensors[name] = t.detach().contiguous()
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved fp8 checkpoint (%d tensors, block %s) to %s", len(tensors), block, path)
    return path


def _checkpoint_block(cfg: dict[str, Any], path: Path) -> tuple[int, int]:
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise MoelabError(
            f"{path}/config.json has quantization_config {qc!r}; expected quant_method 'fp8' with "
            "fmt 'e4m3' (a DeepSeek-V3-style checkpoint). Load other checkpoints with moelab.load."
        )
    return check_block(qc.get("weight_block_size", DEFAULT_BLOCK))


def load_fp8_checkpoint(path: str | Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A model from a DeepSeek-V3-style fp8 checkpoint directory (local files only).

    Non-expert fp8 weights are dequantised to ``dtype``. Each experts module gets its
    dequantised weights as parameters (so every experts implementation runs) *and* its
    original e4m3 bytes and scales packed for the ``moelab_fp8`` kernels, which then use
    them intact (no re-quantisation) until a weight is changed. Reads safetensors only
    (no pickle); ``trust_remote_code`` is off.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise MoelabError(f"{path} is not a checkpoint directory (needs config.json and *.safetensors).")
    cfg = json.loads((path / "config.json").read_text())
    block = _checkpoint_block(cfg, path)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are handled here, not by a quantiser
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    experts = _experts_modules(model)
    per_expert: dict[str, dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = raw.get(name + SCALE_SUFFIX)
        m = _EXPERT_KEY.match(name)
        if m and m["prefix"] in experts:
            if scale is None or t.dtype != FP8_DTYPE:
                raise MoelabError(f"{name} in {path} is not an e4m3 weight with a {SCALE_SUFFIX} tensor.")
            per_expert.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = (t, scale)
        elif scale is not None:
            state[name] = dequantize_fp8_blockwise(t, scale, block).to(dtype)
        else:
            state[name] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    expert_params = {f"{p}.{n}" for p in experts for n, _ in experts[p].named_parameters(recurse=False)}
    if set(missing) - expert_params or unexpected:
        raise MoelabError(
            f"{path} does not match its config: missing {sorted(set(missing) - expert_params)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}."
        )
    for prefix, mod in experts.items():
        _install_fp8_experts(mod, prefix, per_expert.get(prefix, {}), block, path)
    return model.eval()


def _install_fp8_experts(mod: torch.nn.Module, prefix: str, projs: dict, block: tuple[int, int], path: Path) -> None:
    from moelab.kernels.integration import install_fp8

    e = mod.gate_up_proj.shape[0]
    stacks = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        got = projs.get(proj, {})
        if sorted(got) != list(range(e)):
            raise MoelabError(
                f"{path} has {len(got)} of the {e} experts' {prefix}.*.{proj} weights; the checkpoint is incomplete."
            )
        stacks[proj] = Fp8Weights(
            torch.stack([got[x][0] for x in range(e)]), torch.stack([got[x][1].float() for x in range(e)]), block
        )
    install_fp8(mod, stacks["gate_proj"], stacks["up_proj"], stacks["down_proj"])
