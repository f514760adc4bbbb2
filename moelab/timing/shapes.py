"""Model shapes without weights: what the simulator needs to know about an MoE model.

A :class:`ModelShape` holds the numbers of a model's ``config.json`` that decide bytes and
FLOPs (layers, experts, top-k, hidden and intermediate sizes, attention kind, vocabulary)
and derives from them what a step costs: bytes of one routed expert in a dtype, FLOPs,
attention weights + KV cache read per step, shared experts, dense layers, the LM head.

* :func:`get_shape` — a packaged shape by name (``deepseek-v3``; the Hub id
  ``deepseek-ai/DeepSeek-V3`` works too), or a ``config.json`` path; unknown names get the
  closest names. :data:`SHAPES` is the :class:`~moelab.registry.Registry` behind it.
* :meth:`ModelShape.from_hf_config` — any Hugging Face config (path, dict or
  ``PretrainedConfig``) of the ten families moelab supports.
* :meth:`ModelShape.from_model` — a live model (the MoE structure is read off its modules).

The catalog lives in ``moelab/timing/shape_configs/*.json``: each file holds the model's
Hub id and the keys of its public ``config.json`` verbatim (plus the published parameter
counts the tests check against), so a shape is always ``from_hf_config(catalog config)``.

Counting conventions (all exact for the modules transformers builds; the tests compare
:meth:`ModelShape.total_params` with ``sum(p.numel())`` of a built model of every family):

* a routed expert is gate + up + down (``3 × H × I``; gpt-oss adds its biases);
* DeepSeek's ``n_shared_experts`` shared experts each have ``moe_intermediate_size``;
  Qwen's single shared expert has ``shared_expert_intermediate_size`` (+ a 1×H gate);
* DeepSeek MLA caches ``kv_lora_rank + qk_rope_head_dim`` values per token and layer (the
  compressed cache of DeepSeek's and KTransformers' inference; transformers itself caches
  the decompressed keys and values); GQA caches ``2 × kv_heads × head_dim``; sliding-window
  layers cache at most the window; linear-attention layers (Qwen3-Next) hold a fixed state;
* the multi-token-prediction layer of DeepSeek-V3 (``num_nextn_predict_layers``) is not
  counted (it is not part of the 671 B the model card quotes, nor of ordinary decoding).

Bytes per parameter by dtype (:data:`DTYPES`): ``bf16``/``fp16`` 2, ``fp32`` 4, ``fp8``
1 + one fp32 scale per 128×128 block (DeepSeek-V3's ``weight_block_size``), ``int8``/
``int4`` 1/0.5 + one fp32 scale per group of 64 along the reduction (moelab's kernels),
``mxfp4`` 0.5 + one byte per 32 (gpt-oss's expert format). Norms, biases, the router and
embeddings stay in the activation dtype (bf16 unless the shape's dtype is fp32/fp16).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moelab.errors import MoelabError, did_you_mean, unknown_name
from moelab.registry import Registry

log = logging.getLogger(__name__)

Attention = Literal["gqa", "mla"]


@dataclass(frozen=True)
class DtypeSpec:
    """Storage of a weight matrix in one dtype: ``bits`` per value plus block/group scales."""

    name: str
    bits: int
    scale_bytes: int = 0
    """Bytes of one scale (0: no scales)."""
    block: tuple[int, int] | None = None
    """(rows, reduction) block one scale covers (fp8); None with ``group`` or no scales."""
    group: int | None = None
    """Values along the reduction dimension one scale covers (int8/int4/mxfp4)."""

    def matrix_bytes(self, rows: int, cols: int, count: int = 1) -> int:
        """Bytes of ``count`` matrices of ``rows`` outputs × ``cols`` reduction, scales included."""
        values = rows * cols * self.bits // 8
        if self.block is not None:
            scales = math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1])
        elif self.group is not None:
            scales = rows * math.ceil(cols / self.group)
        else:
            scales = 0
        return count * (values + scales * self.scale_bytes)


#: Weight dtypes a shape can be costed in.
DTYPES: dict[str, DtypeSpec] = {
    "fp32": DtypeSpec("fp32", 32),
    "bf16": DtypeSpec("bf16", 16),
    "fp16": DtypeSpec("fp16", 16),
    "fp8": DtypeSpec("fp8", 8, scale_bytes=4, block=(128, 128)),
    "int8": DtypeSpec("int8", 8, scale_bytes=4, group=64),
    "int4": DtypeSpec("int4", 4, scale_bytes=4, group=64),
    "mxfp4": DtypeSpec("mxfp4", 4, scale_bytes=1, group=32),
}

_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def check_dtype(dtype: str, what: str = "dtype") -> str:
    if dtype not in DTYPES:
        raise MoelabError(
            f"{what} {dtype!r} is not known.{did_you_mean(str(dtype), DTYPES)} Expected one of: "
            f"{', '.join(DTYPES)}."
        )
    return dtype


@dataclass(frozen=True, repr=False)
class ModelShape:
    """The weight-free shape of an MoE language model (see the module docstring).

    Shape legend: H ``hidden_size``, F ``expert_intermediate``, E ``num_experts``,
    K ``top_k``, L ``num_layers`` decoder layers of which ``moe_layers`` are MoE.
    """

    name: str
    num_layers: int
    moe_layers: tuple[int, ...]
    """Decoder-layer indices of the MoE layers; the others have a dense MLP."""
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate: int
    num_shared_experts: int = 0
    shared_intermediate: int = 0
    """Intermediate size of ONE shared expert (DeepSeek: moe_intermediate_size each)."""
    dense_intermediate: int = 0
    """Intermediate size of the dense-layer MLP (0 if every layer is MoE)."""
    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    dtype: str = "bf16"
    """Weight dtype of every linear layer (attention, shared experts, dense MLPs)."""
    expert_dtype: str | None = None
    """Routed experts' dtype when it differs from ``dtype`` (gpt-oss: mxfp4); None = dtype."""
    kv_dtype: str = "bf16"
    # ---- attention
    attention: Attention = "gqa"
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    q_lora_rank: int = 0
    """MLA query low-rank (0: a plain q_proj, as DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: Literal["none", "qkv", "all"] = "none"
    qk_norm: Literal["none", "head", "full"] = "none"
    """Qwen3: RMSNorm over head_dim; OLMoE: over all heads."""
    attention_gate: bool = False
    """Qwen3-Next: q_proj also produces a sigmoid output gate (2 × heads × head_dim outputs)."""
    attention_sinks: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    """Decoder layers whose attention sees at most ``sliding_window`` tokens."""
    linear_layers: tuple[int, ...] = ()
    """Decoder layers with linear attention (Qwen3-Next Gated DeltaNet) instead of softmax."""
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # ---- small parts
    router_bias: bool = False
    expert_bias: bool = False
    shared_gate: bool = False
    norm_bias: bool = False
    model_type: str = ""
    source: str = field(default="", compare=False)
    """Where the numbers come from (a Hub id and file, a path, or a live model)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Provenance that does not change costs (native dtype, published counts, notes)."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        # per-layer terms that do not depend on the context, computed once (the simulator asks
        # for one step's attention cost per forward: recomputing every layer's matrices made that
        # the largest share of a simulation's time)
        object.__setattr__(self, "_memo", {})
        where = f"model shape {self.name!r}"
        for f in ("num_layers", "num_experts", "top_k", "hidden_size", "expert_intermediate", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MoelabError(f"{where}: {f} is {v!r}, expected a positive integer; fix the config.")
        if self.top_k > self.num_experts:
            raise MoelabError(f"{where}: top_k {self.top_k} exceeds num_experts {self.num_experts}; fix the config.")
        if not self.moe_layers:
            raise MoelabError(f"{where}: no MoE layers; moelab's simulator needs a Mixture-of-Experts model.")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if bad or list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise MoelabError(
                f"{where}: moe_layers {list(self.moe_layers)} must be increasing indices in 0..{self.num_layers - 1}."
            )
        check_dtype(self.dtype)
        check_dtype(self.kv_dtype, "kv_dtype")
        if self.expert_dtype is not None:
            check_dtype(self.expert_dtype, "expert_dtype")
        if self.attention not in ("gqa", "mla"):
            raise MoelabError(f"{where}: attention {self.attention!r}, expected 'gqa' or 'mla'.")
        if self.attention == "mla" and (self.kv_lora_rank < 1 or self.v_head_dim < 1):
            raise MoelabError(f"{where}: MLA attention needs kv_lora_rank and v_head_dim > 0.")
        if self.num_shared_experts and self.shared_intermediate < 1:
            raise MoelabError(f"{where}: {self.num_shared_experts} shared experts of intermediate size 0.")
        if len(self.moe_layers) < self.num_layers and self.dense_intermediate < 1:
            raise MoelabError(
                f"{where}: {self.num_layers - len(self.moe_layers)} dense layers but dense_intermediate is 0."
            )

    # ------------------------------------------------------------------ basics
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    @property
    def experts_dtype(self) -> str:
        """The routed experts' dtype (``expert_dtype`` or ``dtype``)."""
        return self.expert_dtype or self.dtype

    @property
    def _act(self) -> DtypeSpec:
        """Dtype of norms, biases, router and embeddings (activation precision)."""
        return DTYPES[self.dtype if self.dtype in ("fp32", "fp16") else "bf16"]

    def bytes_per_param(self, dtype: str | None = None) -> float:
        """Average bytes per routed-expert parameter in ``dtype`` (default: the experts' dtype),
        scales included."""
        spec = DTYPES[check_dtype(dtype or self.experts_dtype)]
        return self._expert_bytes_in(spec) / self.expert_params()

    def with_dtype(self, dtype: str, *, experts: str | None = None, kv: str | None = None) -> ModelShape:
        """This shape with weights in ``dtype`` (routed experts in ``experts`` if given)."""
        check_dtype(dtype)
        return dataclasses.replace(
            self, dtype=dtype, expert_dtype=check_dtype(experts, "expert dtype") if experts else None,
            kv_dtype=check_dtype(kv, "kv dtype") if kv else self.kv_dtype,
        )

    # ------------------------------------------------------------------ routed experts
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down; biases if the family has them)."""
        H, F = self.hidden_size, self.expert_intermediate
        return 3 * H * F + (2 * F + H if self.expert_bias else 0)

    def _expert_bytes_in(self, spec: DtypeSpec) -> int:
        H, F = self.hidden_size, self.expert_intermediate
        b = spec.matrix_bytes(F, H, 2) + spec.matrix_bytes(H, F)
        if self.expert_bias:
            b += (2 * F + H) * self._act.bits // 8
        return b

    def expert_bytes(self, dtype: str | None = None) -> int:
        """Bytes of one routed expert in ``dtype`` (default: the experts' dtype), scales included."""
        return self._expert_bytes_in(DTYPES[check_dtype(dtype or self.experts_dtype)])

    def expert_flops(self, tokens: int = 1) -> int:
        """FLOPs of one routed expert over ``tokens`` tokens (2 × params × tokens)."""
        return 2 * self.expert_params() * int(tokens)

    # ------------------------------------------------------------------ shared experts, dense MLPs
    def shared_params(self) -> int:
        """Parameters of all shared experts of one MoE layer (their gate included)."""
        p = self.num_shared_experts * 3 * self.hidden_size * self.shared_intermediate
        return p + (self.hidden_size if self.shared_gate and self.num_shared_experts else 0)

    def shared_bytes(self) -> int:
        if not self.num_shared_experts:
            return 0
        H, S = self.hidden_size, self.shared_intermediate
        spec = DTYPES[self.dtype]
        b = self.num_shared_experts * (spec.matrix_bytes(S, H, 2) + spec.matrix_bytes(H, S))
        return b + (H * self._act.bits // 8 if self.shared_gate else 0)

    def shared_flops(self, tokens: int = 1) -> int:
        return 2 * self.shared_params() * int(tokens)

    def dense_mlp_params(self) -> int:
        """Parameters of one dense layer's MLP (0 if the model has none)."""
        return 3 * self.hidden_size * self.dense_intermediate if self.dense_layers else 0

    def dense_mlp_bytes(self) -> int:
        if not self.dense_layers:
            return 0
        H, D = self.hidden_size, self.dense_intermediate
        spec = DTYPES[self.dtype]
        return spec.matrix_bytes(D, H, 2) + spec.matrix_bytes(H, D)

    def dense_mlp_flops(self, tokens: int = 1) -> int:
        return 2 * self.dense_mlp_params() * int(tokens)

    def router_params(self) -> int:
        return self.num_experts * self.hidden_size + (self.num_experts if self.router_bias else 0)

    def router_bytes(self) -> int:
        return self.router_params() * self._act.bits // 8

    # ------------------------------------------------------------------ attention
    def _attn_matrices(self, layer: int) -> tuple[list[tuple[int, int]], int]:
        """(rows, cols) of the attention's linear weights in decoder layer ``layer``, and its
        other parameters (norms, biases, sinks, conv, ...)."""
        key = ("attn", layer)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._attn_matrices_of(layer)
        return hit

    def _layer_terms(self, prefill: bool = False) -> list[tuple[int, bool, int, int, int, bool]]:
        """Per decoder layer: (KV values per token, sliding?, recurrent state values, projection
        FLOPs per row, attention-core FLOPs per attended position and row (0: linear), linear?);
        ``prefill``: MLA's core in its up-projected prefill form (see :meth:`attention_flops`)."""
        terms = self._memo.get(("terms", prefill))
        if terms is None:
            terms = []
            for i in range(self.num_layers):
                mats, _ = self._attn_matrices(i)
                linear = i in self.linear_layers
                if linear:
                    core = 0
                elif self.attention == "mla":
                    per_pos = (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim if prefill
                               else self.kv_lora_rank + self.qk_rope_head_dim + self.kv_lora_rank)
                    core = 2 * self.num_heads * per_pos
                else:
                    core = 4 * self.num_heads * self.head_dim
                terms.append((self.kv_values_per_token(i), i in self.sliding_layers and bool(self.sliding_window),
                              self._state_values(i), 2 * sum(r * c for r, c in mats), core, linear))
            self._memo[("terms", prefill)] = terms
        return terms

    def _attn_matrices_of(self, layer: int) -> tuple[list[tuple[int, int]], int]:
        H = self.hidden_size
        if layer in self.linear_layers:
            kd = self.linear_key_heads * self.linear_key_head_dim
            vd = self.linear_value_heads * self.linear_value_head_dim
            nv = self.linear_value_heads
            mats = [(2 * kd + 2 * vd, H), (2 * nv, H), (H, vd)]
            other = (2 * kd + vd) * self.linear_conv_kernel + 2 * nv + self.linear_value_head_dim
            return mats, other
        nh = self.num_heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            mats = []
            other = self.kv_lora_rank
            if self.q_lora_rank:
                mats += [(self.q_lora_rank, H), (nh * qk, self.q_lora_rank)]
                other += self.q_lora_rank
            else:
                mats.append((nh * qk, H))
            mats += [
                (self.kv_lora_rank + self.qk_rope_head_dim, H),
                (nh * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                (H, nh * self.v_head_dim),
            ]
            return mats, other
        q = nh * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        mats = [((2 if self.attention_gate else 1) * q, H), (kv, H), (kv, H), (H, q)]
        other = 0
        if self.attention_bias in ("qkv", "all"):
            other += q + 2 * kv + (H if self.attention_bias == "all" else 0)
        if self.qk_norm == "head":
            other += 2 * self.head_dim
        elif self.qk_norm == "full":
            other += q + kv
        if self.attention_sinks:
            other += nh
        return mats, other

    def _mean_over_layers(self, fn, layer: int | None) -> float:
        if layer is not None:
            return fn(layer)
        return sum(fn(i) for i in range(self.num_layers)) / self.num_layers

    def attention_params(self, layer: int | None = None) -> float:
        """Parameters of one layer's attention (``layer=None``: the mean over decoder layers)."""

        def one(i: int) -> int:
            mats, other = self._attn_matrices(i)
            return sum(r * c for r, c in mats) + other

        return self._mean_over_layers(one, layer)

    def attention_weight_bytes(self, layer: int | None = None) -> float:
        spec, act = DTYPES[self.dtype], self._act

        def one(i: int) -> int:
            mats, other = self._attn_matrices(i)
            return sum(spec.matrix_bytes(r, c) for r, c in mats) + other * act.bits // 8

        return self._mean_over_layers(one, layer)

    def kv_values_per_token(self, layer: int | None = None) -> float:
        """KV-cache values one token adds in one layer (0 in linear-attention layers)."""

        def one(i: int) -> int:
            if i in self.linear_layers:
                return 0
            if self.attention == "mla":
                return self.kv_lora_rank + self.qk_rope_head_dim
            return 2 * self.num_kv_heads * self.head_dim

        return self._mean_over_layers(one, layer)

    def kv_bytes_per_token(self, layer: int | None = None) -> float:
        """KV-cache bytes per token and layer (``layer=None``: mean over decoder layers)."""
        return self.kv_values_per_token(layer) * DTYPES[self.kv_dtype].bits / 8

    def _attended(self, i: int, context: int) -> int:
        if i in self.sliding_layers and self.sliding_window:
            return min(int(context), self.sliding_window)
        return int(context)

    def _state_values(self, i: int) -> int:
        """Recurrent state of a linear-attention layer (per sequence): the delta-rule matrix
        per value head plus the convolution window."""
        if i not in self.linear_layers:
            return 0
        kd = self.linear_key_heads * self.linear_key_head_dim
        vd = self.linear_value_heads * self.linear_value_head_dim
        return (self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
                + (2 * kd + vd) * max(self.linear_conv_kernel - 1, 0))

    def _sums(self, prefill: bool = False) -> tuple[int, int, int, int, int, int, int]:
        """Sums over decoder layers of the per-layer terms: KV values per token (full, sliding),
        state values, projection FLOPs, core FLOPs per position (full, sliding), linear layers."""
        sums = self._memo.get(("sums", prefill))
        if sums is None:
            t = self._layer_terms(prefill)
            sums = self._memo[("sums", prefill)] = (
                sum(x[0] for x in t if not x[1]), sum(x[0] for x in t if x[1]), sum(x[2] for x in t),
                sum(x[3] for x in t), sum(x[4] for x in t if not x[1] and not x[5]),
                sum(x[4] for x in t if x[1] and not x[5]), sum(1 for x in t if x[5]))
        return sums

    def kv_cache_bytes(self, context: int, batch: int = 1, layer: int | None = None) -> float:
        """Bytes of KV cache (or linear-attention state) one step reads in one layer."""
        kvb = DTYPES[self.kv_dtype].bits / 8
        terms = self._layer_terms()
        c, w = int(context), self.sliding_window
        if layer is None:  # the mean over layers in closed form (integers until the last step)
            kv_full, kv_slide, state = self._sums()[:3]
            return (kv_full * c + kv_slide * (min(c, w) if w else c) + state) * kvb * int(batch) / self.num_layers

        def one(i: int) -> float:
            kv, sliding, state = terms[i][:3]
            return (kv * (min(c, w) if sliding else c) + state) * kvb * int(batch)

        return self._mean_over_layers(one, layer)

    def attention_bytes(self, context: int, batch: int = 1, layer: int | None = None) -> float:
        """Bytes one decode step reads in one layer's attention: its weights plus the KV cache
        of ``batch`` sequences of ``context`` tokens (``layer=None``: mean over layers)."""
        key = ("weight_bytes", layer)
        wb = self._memo.get(key)
        if wb is None:
            wb = self._memo[key] = self.attention_weight_bytes(layer)
        return wb + self.kv_cache_bytes(context, batch, layer)

    def attention_flops(self, context: int, batch: int = 1, layer: int | None = None, *,
                        prefill: bool = False) -> float:
        """FLOPs of one layer's attention for ``batch`` rows at ``context``: projections (2 ×
        weights × batch) plus scores and values. MLA is counted in its weight-absorbed decode form
        (each head attends over kv_lora_rank + rope values and reads values of kv_lora_rank), or
        with ``prefill=True`` in the form prefill kernels run (keys and values up-projected per
        head: scores over qk_nope + qk_rope, values of v_head_dim); linear attention updates its
        state (≈ 4 × state)."""
        terms = self._layer_terms(prefill)
        c, w = int(context), self.sliding_window
        linear_core = 4 * self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        if layer is None:  # the mean over layers in closed form (integers until the last step)
            _, _, _, proj, core_full, core_slide, n_linear = self._sums(prefill)
            total = proj + core_full * c + core_slide * (min(c, w) if w else c) + n_linear * linear_core
            return total * int(batch) / self.num_layers

        def one(i: int) -> float:
            _, sliding, _, proj, core, linear = terms[i]
            if linear:
                return (proj + linear_core) * int(batch)
            return (proj + core * (min(c, w) if sliding else c)) * int(batch)

        return self._mean_over_layers(one, layer)

    # ------------------------------------------------------------------ embeddings, totals
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_bytes(self) -> int:
        return DTYPES[self.dtype if self.dtype in ("fp32", "fp16") else "bf16"].matrix_bytes(
            self.vocab_size, self.hidden_size)

    def lm_head_flops(self, tokens: int = 1) -> int:
        return 2 * self.lm_head_params() * int(tokens)

    def _norms_per_layer(self) -> int:
        return 2 * self.hidden_size * (2 if self.norm_bias else 1)

    def total_params(self) -> int:
        """Every parameter of the model (as ``sum(p.numel() for p in model.parameters())``)."""
        L, M = self.num_layers, self.num_moe_layers
        attn = sum(self.attention_params(i) for i in range(L))
        moe = M * (self.num_experts * self.expert_params() + self.shared_params() + self.router_params())
        dense = (L - M) * self.dense_mlp_params()
        embed = self.embedding_params() + (0 if self.tie_word_embeddings else self.lm_head_params())
        final_norm = self.hidden_size * (2 if self.norm_bias else 1)
        return int(attn + moe + dense + embed + final_norm + L * self._norms_per_layer())

    def active_params(self, *, include_embedding: bool = True) -> int:
        """Parameters one token uses: all but the E − K unselected routed experts per MoE layer.

        ``include_embedding=False`` leaves out the input embedding table (a lookup, not a
        matmul), the convention of DeepSeek's and OpenAI's published "active" counts; Mistral,
        Qwen and OLMoE count it.
        """
        n = self.total_params() - self.num_moe_layers * (self.num_experts - self.top_k) * self.expert_params()
        if not include_embedding and not self.tie_word_embeddings:
            n -= self.embedding_params()
        return int(n)

    def total_bytes(self) -> int:
        """Bytes of all weights in this shape's dtypes."""
        L, M = self.num_layers, self.num_moe_layers
        act = self._act.bits // 8
        attn = sum(self.attention_weight_bytes(i) for i in range(L))
        moe = M * (self.num_experts * self.expert_bytes() + self.shared_bytes() + self.router_bytes())
        dense = (L - M) * self.dense_mlp_bytes()
        embed = self.embedding_params() * act + (0 if self.tie_word_embeddings else self.lm_head_bytes())
        norms = (self.hidden_size * (2 if self.norm_bias else 1) + L * self._norms_per_layer()) * act
        return int(attn + moe + dense + embed + norms)

    def summary(self) -> dict[str, Any]:
        """The main numbers, for tables and logs."""
        return {
            "name": self.name,
            "layers": self.num_layers,
            "moe_layers": self.num_moe_layers,
            "experts": self.num_experts,
            "top_k": self.top_k,
            "shared": self.num_shared_experts,
            "hidden": self.hidden_size,
            "expert_intermediate": self.expert_intermediate,
            "attention": self.attention,
            "dtype": self.dtype if self.expert_dtype is None else f"{self.dtype}/experts {self.expert_dtype}",
            "total_params_b": round(self.total_params() / 1e9, 2),
            "active_params_b": round(self.active_params() / 1e9, 2),
            "expert_mib": round(self.expert_bytes() / 2**20, 2),
            "kv_bytes_per_token_layer": self.kv_bytes_per_token(),
        }

    def __repr__(self) -> str:
        return (f"ModelShape({self.name!r}, layers={self.num_layers}, moe_layers={self.num_moe_layers}, "
                f"E={self.num_experts}, K={self.top_k}, H={self.hidden_size}, F={self.expert_intermediate}, "
                f"{self.attention}, {self.dtype})")

    def __str__(self) -> str:
        s = self.summary()
        return (
            f"{s['name']}: {s['layers']} layers ({s['moe_layers']} MoE), E={s['experts']} top-{s['top_k']}"
            f" + {s['shared']} shared, H={s['hidden']}, I={s['expert_intermediate']}, {s['attention']},"
            f" {s['dtype']}; {s['total_params_b']} B params ({s['active_params_b']} B active),"
            f" {s['expert_mib']} MiB per expert"
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None, dtype: str | None = None) -> ModelShape:
        """The shape of a Hugging Face config: a ``config.json`` path (or its directory), a dict
        of its keys, or a ``PretrainedConfig``. ``dtype`` defaults to the config's
        ``torch_dtype``/``dtype`` (fp8 when it carries an fp8 ``quantization_config``)."""
        return _from_config(config, name=name, dtype=dtype)

    @classmethod
    def from_model(cls, model: Any, *, name: str | None = None) -> ModelShape:
        """The shape of a live model: the MoE structure (MoE layer indices, E, top-k, expert,
        shared and dense intermediate sizes, dtype) is read off its modules; attention and
        vocabulary come from ``model.config``."""
        return _from_model(model, name=name)


# ---------------------------------------------------------------------- config parsing
_MISSING = object()

#: Per family: (key for E, key for the routed intermediate, how dense layers are chosen).
_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {}, "granitemoe": {}, "phimoe": {"norm_bias": True, "fixed_top_k": 2},
    "olmoe": {"qk_norm": "full"},
    "gpt_oss": {"attention_bias": "all", "sinks": True, "router_bias": True, "expert_bias": True},
    "qwen2_moe": {"moe_intermediate": True, "qwen_layers": True, "shared": "qwen", "qkv_bias_key": "qkv_bias"},
    "qwen3_moe": {"moe_intermediate": True, "qwen_layers": True, "qk_norm": "head"},
    "qwen3_next": {"moe_intermediate": True, "qwen_layers": True, "shared": "qwen", "qk_norm": "head",
                   "attention_gate": True},
    "deepseek_v2": {"moe_intermediate": True, "deepseek_layers": True, "shared": "deepseek", "mla": True},
    "deepseek_v3": {"moe_intermediate": True, "deepseek_layers": True, "shared": "deepseek", "mla": True},
}


class _Cfg:
    """Uniform key access over a dict or a PretrainedConfig (attribute_map aware)."""

    def __init__(self, cfg: Any, where: str) -> None:
        self.cfg, self.where = cfg, where
        self.is_dict = isinstance(cfg, dict)

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        for k in keys:
            if self.is_dict:
                if k in self.cfg and self.cfg[k] is not None:
                    return self.cfg[k]
            else:
                v = getattr(self.cfg, k, None)
                if v is not None:
                    return v
        if default is _MISSING:
            raise MoelabError(
                f"{self.where}: missing {' / '.join(repr(k) for k in keys)}; a Hugging Face MoE config "
                "(config.json) has it — pass the model's full config."
            )
        return default

    def int(self, *keys: str, default: Any = _MISSING) -> int:
        v = self.get(*keys, default=default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise MoelabError(f"{self.where}: {keys[0]} is {v!r}, expected an integer.")
        return int(v)


def _load_config_arg(config: Any) -> tuple[Any, str]:
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise MoelabError(f"no Hugging Face config at {str(config)!r}; give a config.json file, "
                              "a model directory holding one, or a packaged shape name.")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MoelabError(f"{str(path)!r} is not valid JSON ({e}); give a model's config.json.") from None
        if not isinstance(data, dict):
            raise MoelabError(f"{str(path)!r} holds a JSON {type(data).__name__}, expected a config object.")
        return data, str(path)
    if isinstance(config, dict):
        return config, "config dict"
    if hasattr(config, "model_type") and hasattr(config, "to_dict"):
        return config, f"{type(config).__name__}"
    raise MoelabError(f"expected a config.json path, a dict or a transformers PretrainedConfig, got {type(config).__name__}.")


def _config_dtype(c: _Cfg) -> str:
    q = c.get("quantization_config", default=None)
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "fp8":
        return "fp8"
    raw = c.get("dtype", "torch_dtype", default="bfloat16")
    raw = str(raw).replace("torch.", "")
    return _TORCH_DTYPES.get(raw, "bf16")


def _from_config(config: Any, *, name: str | None, dtype: str | None) -> ModelShape:
    """Size: long: one branch per model family's config keys, a table read top to bottom.
    """
    from moelab.adapters.families import BUILTIN_ADAPTERS

    cfg, where = _load_config_arg(config)
    c = _Cfg(cfg, where)
    model_type = c.get("model_type", default=None)
    families = [a.model_type for a in BUILTIN_ADAPTERS]
    if model_type not in _FAMILIES and model_type not in families:
        raise MoelabError(
            f"{where}: model_type {model_type!r} is not a supported MoE family.{did_you_mean(str(model_type), families)} "
            f"Supported: {', '.join(families)}."
        )
    fam = _FAMILIES.get(model_type, {})
    L = c.int("num_hidden_layers")
    H = c.int("hidden_size")
    E = c.int("n_routed_experts", "num_local_experts", "num_experts")
    K = int(fam.get("fixed_top_k") or c.int("num_experts_per_tok", "experts_per_token", "top_k"))
    inter = c.int("intermediate_size", default=0)
    F = c.int("moe_intermediate_size") if fam.get("moe_intermediate") else inter
    if fam.get("deepseek_layers"):
        first = c.int("first_k_dense_replace", default=0)
        freq = c.int("moe_layer_freq", default=1)
        moe = tuple(i for i in range(L) if i >= first and i % freq == 0)
    elif fam.get("qwen_layers"):
        only = set(c.get("mlp_only_layers", default=[]) or [])
        step = c.int("decoder_sparse_step", default=1)
        moe = tuple(i for i in range(L) if i not in only and (i + 1) % step == 0)
    else:
        moe = tuple(range(L))
    shared_n = shared_i = 0
    shared_gate = False
    if fam.get("shared") == "deepseek":
        shared_n = c.int("n_shared_experts", default=0)
        shared_i = F if shared_n else 0
    elif fam.get("shared") == "qwen":
        shared_i = c.int("shared_expert_intermediate_size", default=0)
        shared_n = 1 if shared_i else 0
        shared_gate = bool(shared_n)
    heads = c.int("num_attention_heads")
    kw: dict[str, Any] = {}
    if fam.get("mla"):
        kw.update(
            attention="mla", num_kv_heads=c.int("num_key_value_heads", default=heads),
            q_lora_rank=c.int("q_lora_rank", default=0), kv_lora_rank=c.int("kv_lora_rank"),
            qk_nope_head_dim=c.int("qk_nope_head_dim"), qk_rope_head_dim=c.int("qk_rope_head_dim"),
            v_head_dim=c.int("v_head_dim"),
            head_dim=c.int("qk_nope_head_dim") + c.int("qk_rope_head_dim"),
        )
    else:
        kw.update(attention="gqa", num_kv_heads=c.int("num_key_value_heads", default=heads),
                  head_dim=c.int("head_dim", default=H // heads))
    if "qkv_bias_key" in fam:
        kw["attention_bias"] = "qkv" if c.get("qkv_bias", default=True) else "none"
    elif fam.get("attention_bias"):
        kw["attention_bias"] = "all" if c.get("attention_bias", default=True) else "none"
    elif c.get("attention_bias", default=False) and not fam.get("mla"):
        kw["attention_bias"] = "all"
    layer_types = list(c.get("layer_types", default=[]) or [])
    sliding = c.get("sliding_window", default=None)
    if model_type == "gpt_oss" and layer_types:
        kw["sliding_layers"] = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        kw["sliding_window"] = int(sliding) if sliding else None
    elif model_type in ("mixtral", "phimoe") and sliding:
        kw["sliding_layers"] = tuple(range(L))
        kw["sliding_window"] = int(sliding)
    if model_type == "qwen3_next":
        if not layer_types:
            interval = c.int("full_attention_interval", default=4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
        kw.update(
            linear_layers=tuple(i for i, t in enumerate(layer_types) if t == "linear_attention"),
            linear_key_heads=c.int("linear_num_key_heads"), linear_value_heads=c.int("linear_num_value_heads"),
            linear_key_head_dim=c.int("linear_key_head_dim"), linear_value_head_dim=c.int("linear_value_head_dim"),
            linear_conv_kernel=c.int("linear_conv_kernel_dim"),
        )
    native = _config_dtype(c)
    expert_dtype = None
    q = c.get("quantization_config", default=None)
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "mxfp4" and dtype is None:
        expert_dtype = "mxfp4"
    if name is None:
        name = str(c.get("_name_or_path", "name_or_path", default="") or model_type)
    return ModelShape(
        name=name,
        num_layers=L,
        moe_layers=moe,
        num_experts=E,
        top_k=K,
        hidden_size=H,
        expert_intermediate=F,
        num_shared_experts=shared_n,
        shared_intermediate=shared_i,
        dense_intermediate=inter if len(moe) < L else 0,
        vocab_size=c.int("vocab_size"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", default=False)),
        dtype=check_dtype(dtype) if dtype else native,
        expert_dtype=expert_dtype,
        num_heads=heads,
        qk_norm=fam.get("qk_norm", "none"),
        attention_gate=bool(fam.get("attention_gate")),
        attention_sinks=bool(fam.get("sinks")),
        router_bias=bool(fam.get("router_bias")),
        expert_bias=bool(fam.get("expert_bias")),
        shared_gate=shared_gate,
        norm_bias=bool(fam.get("norm_bias")),
        model_type=str(model_type),
        source=where,
        **kw,
    )


def _from_model(model: Any, *, name: str | None) -> ModelShape:
    from moelab.adapters import moe_layers

    layers = moe_layers(model)
    model = getattr(model, "model", model) if not hasattr(model, "config") else model
    base = _from_config(model.config, name=name or getattr(model.config, "_name_or_path", None) or None,
                        dtype=None)
    first = layers[0]
    Es = {layer.num_experts for layer in layers}
    Ks = {layer.top_k for layer in layers}
    if len(Es) > 1 or len(Ks) > 1:
        raise MoelabError(f"{type(model).__name__}: MoE layers differ in experts {sorted(Es)} or top-k "
                          f"{sorted(Ks)}; ModelShape describes models whose MoE layers are alike.")
    down = getattr(first.experts, "down_proj", None)
    if down is None or down.dim() != 3:
        raise MoelabError(f"{type(model).__name__}: expert weights are not a fused (E, ·, ·) down_proj; "
                          "cannot read the expert intermediate size.")
    # down_proj is (E, H, I) (most families) or (E, I, H) (gpt_oss): I is the side that is not H
    H = base.hidden_size
    inter = int(down.shape[2] if down.shape[1] == H else down.shape[1])
    shared_n = shared_i = 0
    if first.shared_experts is not None:
        sh_down = first.shared_experts.down_proj.weight  # (H, n × S)
        total = int(sh_down.shape[1])
        if base.num_shared_experts > 1 and total % base.num_shared_experts == 0:
            shared_n, shared_i = base.num_shared_experts, total // base.num_shared_experts
        else:
            shared_n, shared_i = 1, total
    dense = 0
    moe_idx = tuple(layer.layer_idx for layer in layers)
    if len(moe_idx) < base.num_layers:
        dense_idx = next(i for i in range(base.num_layers) if i not in set(moe_idx))
        mlp = _decoder_layers(model)[dense_idx].mlp
        dense = int(mlp.down_proj.weight.shape[1])
    p = next(iter(model.parameters()))
    dtype = _TORCH_DTYPES.get(str(p.dtype).replace("torch.", ""), "bf16")
    return dataclasses.replace(
        base,
        moe_layers=moe_idx,
        num_experts=Es.pop(),
        top_k=Ks.pop(),
        expert_intermediate=inter,
        num_shared_experts=shared_n,
        shared_intermediate=shared_i,
        shared_gate=first.shared_gate is not None,
        dense_intermediate=dense,
        dtype=dtype,
        source=f"live model {type(model).__name__}",
    )


def _decoder_layers(model: Any):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        raise MoelabError(f"{type(model).__name__} has no model.layers; cannot read its dense MLP size.")
    return layers


# ---------------------------------------------------------------------- the packaged catalog
CATALOG_DIR = Path(__file__).resolve().parent / "shape_configs"


def load_catalog_entry(path: str | Path) -> ModelShape:
    """A shape from a catalog file (``{"name", "hf_id", "config": {config.json keys}, ...}``)."""
    path = Path(path)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise MoelabError(f"model shape file {str(path)!r} cannot be read ({e}).") from None
    for key in ("name", "hf_id", "config"):
        if key not in entry:
            raise MoelabError(f"model shape file {str(path)!r} has no {key!r}; see moelab/timing/shape_configs/.")
    shape = _from_config(entry["config"], name=entry["name"], dtype="bf16")
    extra = {k: v for k, v in entry.items() if k != "config"}
    extra["native_dtype"] = entry.get("native_dtype", _config_dtype(_Cfg(entry["config"], str(path))))
    return dataclasses.replace(shape, source=f"{entry['hf_id']} config.json", extra=extra)


def _register_builtins() -> None:
    for f in sorted(CATALOG_DIR.glob("*.json")):
        SHAPES.register(f.stem, load_catalog_entry(f))


#: Packaged model shapes, by short name (``deepseek-v3``); read on first use.
SHAPES: Registry[ModelShape] = Registry("model shape", base=ModelShape, instances=True, loader=_register_builtins)


def _short(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower()


def get_shape(name: str | Path | ModelShape | dict, *, dtype: str | None = None) -> ModelShape:
    """A packaged shape by name (``deepseek-v3``, or its Hub id ``deepseek-ai/DeepSeek-V3``), a
    ``config.json`` path or model directory, a config dict, or a shape as is; ``dtype``
    re-costs it (``fp8``, ``int4``, ...). Unknown names raise with the closest names."""
    if isinstance(name, ModelShape):
        shape = name
    elif isinstance(name, (dict, Path)) or (isinstance(name, str) and (name.endswith(".json") or Path(name).is_dir())):
        shape = ModelShape.from_hf_config(name)
    else:
        if name in SHAPES:
            shape = SHAPES.get(name)
        else:
            by_id = {_short(s.extra.get("hf_id", "")): n for n, s in SHAPES.items()}
            key = _short(str(name))
            if key in SHAPES:
                shape = SHAPES.get(key)
            elif key in by_id:
                shape = SHAPES.get(by_id[key])
            else:
                raise unknown_name("model shape", name, SHAPES.names()) from None
    return shape.with_dtype(dtype) if dtype else shape


def available_shapes() -> list[str]:
    return SHAPES.names()


def register_shape(shape: ModelShape, *, name: str | None = None, overwrite: bool = False) -> ModelShape:
    """Add ``shape`` to :data:`SHAPES` (under ``name`` if given)."""
    if name is not None:
        shape = dataclasses.replace(shape, name=name)
    SHAPES.register(shape.name, shape, overwrite=overwrite, stacklevel=2)
    return shape


__all__ = [
    "DTYPES",
    "SHAPES",
    "DtypeSpec",
    "ModelShape",
    "available_shapes",
    "get_shape",
    "load_catalog_entry",
    "register_shape",
]
