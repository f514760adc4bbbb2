"""MoE-Gen's module-based batching as a DAG of jobs per decoder layer (techniques.md §7.1).

A :class:`ThroughputConfig` fixes one phase's accumulated batch ``B`` (sequences), attention
micro-batch ``b_a`` (sequences), expert micro-batch ``b_e`` (tokens), the CPU-attention share
``ω``, the expert slots ``S_Expert`` and the pinned weights ``S_Params``. :func:`layer_dag` builds
one decoder layer's jobs (Fig. 6) on the engines of :mod:`~moelab.simulate.moegen.dag`:

decode
    ``PreAttn`` (norm + QKV projection) on the GPU for the CPU share ``ω·B`` and for each GPU
    micro-batch ``j``; the CPU share's Q and new K/V go ``dtoh`` and ``CPUAttn`` (the attention
    core only, reading host KV in place) runs on the CPU, its output comes back ``htod``; each GPU
    micro-batch copies its KV ``htod`` into one of two staging buffers (``S_KV-GPU``, so
    micro-batch ``j+2``'s copy waits for ``GPUAttn j``), runs ``GPUAttn j`` and writes its new
    K/V back ``dtoh``; then ``PostAttn`` (output projection over ``B``, after both parts),
    the shared experts, the ``Router``, and the experts **sequentially**: the pinned ones first,
    then each streamed expert ``Wcopy e`` (``htod``, into one of ``S_Expert`` slots: it waits
    for the expert ``S_Expert`` places before it to finish) and ``Expert e`` in ``⌈n_e/b_e⌉``
    chunks; finally the next layer's dense modules are prefetched ``htod`` (``S_Dense``, double
    buffered) unless ``S_Params`` pins them. A dense (non-MoE) layer runs its MLP instead of
    router and experts.
prefill
    GPU only: ``PreAttn j`` → ``GPUAttn j`` over ``b_a`` prompts, new K/V ``dtoh``; no KV
    ``htod``, no CPU attention (``ω = 0``); the experts as in decode over ``B × prompt`` tokens.

Costs come from the one cost model (:class:`~moelab.timing.costs.CostModel`): experts
``device_us`` (its launches + roofline), copies at ``link_cap`` plus the link's latency (each
direction at the same rate: PCIe is full duplex), shared experts ``shared_us``, GPU dense work
(projections, attention, router, LM head) ``gpu_launch_us`` × launches + bytes / ``dense_cap``
(the executor's formula, :mod:`moelab.simulate.executor`), CPU attention ``cpu_call_us`` +
bytes / (``host_cap`` × NUMA nodes) — the KV is spread over the nodes and every core reads its
own. Bytes and FLOPs come from the shape (:mod:`moelab.timing.shapes`). **MLA**: MoE-Gen
up-projects the latent KV (``S_IS`` holds the up-projected KV), so attention on either side is
charged ``2·r·h·(d_nope + d_v)`` FLOPs per cached token for the up-projection plus the core
over the up-projected heads ``2·h·(d_nope + d_rope + d_v)``, instead of the shapes'
weight-absorbed decode form.

Assumptions (stated in every result): routing is uniform — each of the ``E·(1−(1−k/E)^T)``
experts active among ``T`` tokens gets ``T·k/active`` of them; a decode step's attention sees
the mean context of the generation, ``prompt + generate/2``; hidden states of the batch stay in
GPU memory (``S_IS``) and move no bytes; launches split ``gpu_kernels_per_attention`` as ½
before the attention core, ¼ in it and ¼ after; the router costs 2 launches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from moelab.errors import MoelabError
from moelab.simulate.moegen.dag import Dag, Job
from moelab.timing.costs import CostModel

Phase = Literal["decode", "prefill"]


@dataclass(frozen=True)
class ThroughputConfig:
    """One MoE-Gen configuration of one phase (the search's candidate; Eqs. 1–3)."""

    phase: Phase = "decode"
    batch: int = 1
    """``B``: sequences accumulated per module."""
    micro_batch: int = 1
    """``b_a``: sequences per attention micro-batch."""
    expert_batch: int = 1
    """``b_e``: tokens per expert chunk."""
    cpu_attention: float = 0.0
    """``ω``: share of the batch whose attention core runs on the CPU (decode only)."""
    expert_slots: int = 2
    """``S_Expert``: expert buffers on the GPU that streamed experts are copied into."""
    pinned_experts: int = 0
    """``S_Params`` (experts): routed experts resident on the GPU, over all MoE layers."""
    pin_dense: bool = False
    """``S_Params`` (dense): every layer's attention, router, shared experts and dense MLP resident."""
    prompt: int = 512
    generate: int = 256

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise MoelabError(f"phase {self.phase!r}: expected 'decode' or 'prefill'.")
        for f, low in (("batch", 1), ("micro_batch", 1), ("expert_batch", 1), ("expert_slots", 1),
                       ("pinned_experts", 0), ("prompt", 1), ("generate", 0)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise MoelabError(f"throughput config: {f} is {v!r}; expected an integer ≥ {low}.")
        w = self.cpu_attention
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            raise MoelabError(f"throughput config: cpu_attention (ω) is {w!r}; expected a share in [0, 1].")
        if self.phase == "prefill" and w:
            raise MoelabError(f"prefill is GPU-only in MoE-Gen: cpu_attention must be 0, got {w!r}.")

    @property
    def attention_context(self) -> int:
        """Tokens one decode step's attention reads per sequence (the generation's mean), or the prompt."""
        return self.prompt + self.generate // 2 if self.phase == "decode" else self.prompt

    @property
    def memory_context(self) -> int:
        """Tokens of KV cache reserved per sequence: the prompt plus every generated token."""
        return self.prompt + self.generate if self.phase == "decode" else self.prompt

    @property
    def tokens_per_step(self) -> int:
        """Tokens one pass over the layers produces: ``B`` in decode, ``B × prompt`` in prefill."""
        return self.batch if self.phase == "decode" else self.batch * self.prompt

    @property
    def cpu_rows(self) -> int:
        """Sequences of the CPU share ``round(ω·B)``."""
        return int(round(self.cpu_attention * self.batch))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ASSUMPTIONS: tuple[str, ...] = (
    "uniform routing: each active expert gets T·k/active tokens, E·(1−(1−k/E)^T) experts active among T tokens",
    "decode attention at the generation's mean context prompt + generate/2; KV reserved for prompt + generate",
    "attention results go to host memory (B·H values DtoH per layer); each FFN chunk copies its tokens HtoD and "
    "its output DtoH (Fig. 2); S_IS still counts the batch's activations on the GPU; the LM head runs in b_e-row "
    "chunks",
    "host→device and device→host copies at the profile's link rate each (PCIe is full duplex)",
    "CPU attention reads the host KV at every NUMA node's bandwidth × cpu_memory_efficiency",
    "the next layer's dense modules are prefetched after the layer's expert copies (double-buffered S_Dense)",
    "MLA: the latent KV is up-projected (charged 2·r·h·(d_nope+d_v) FLOPs per cached token) before the core",
)


class LayerCosts:
    """Bytes, FLOPs and µs of MoE-Gen's jobs for one shape on one profile (see the module docstring)."""

    def __init__(self, costs: CostModel, slots_per_token: float | None = None) -> None:
        s = costs.shape
        if s is None:
            raise MoelabError("MoE-Gen's schedule needs a cost model built by CostModel.of(shape, profile).")
        if slots_per_token is not None and not 0 < float(slots_per_token) <= s.top_k:
            raise MoelabError(f"slots_per_token={slots_per_token!r}: expected a number in (0, {s.top_k}] (the routed "
                              f"experts a token runs on average; {s.top_k} = the shape's top-k, nothing skipped).")
        self.costs, self.shape, self.hw = costs, s, costs.profile
        self.top_k = float(slots_per_token) if slots_per_token is not None else s.top_k
        """Routed experts each token runs (the shape's top-k; fewer where a routing policy drops slots)."""
        self._memo: dict[tuple, float] = {}
        bpp = float(s.bytes_per_param())
        self.act_bytes = 4.0 if s.dtype == "fp32" else 2.0
        H, nh = s.hidden_size, s.num_heads
        self.mla = s.attention == "mla"
        self.v_dim = s.v_head_dim if self.mla else s.head_dim
        self.q_dim = nh * ((s.qk_nope_head_dim + s.qk_rope_head_dim) if self.mla else s.head_dim)
        self.o_params = H * nh * self.v_dim
        self.w_att = float(s.attention_weight_bytes())
        self.o_bytes = self.o_params * bpp
        self.up_bytes = (s.kv_lora_rank * nh * (s.qk_nope_head_dim + s.v_head_dim) * bpp) if self.mla else 0.0
        self.kv_tok = float(s.kv_bytes_per_token())
        self.hidden_bytes = H * self.act_bytes
        """Bytes of one token's hidden state (the activations' dtype)."""
        k = self.hw.gpu_kernels_per_attention
        self.k_pre, self.k_attn, self.k_post = max(1, k // 2), max(1, k // 4), max(1, k - k // 2 - k // 4)

    # ------------------------------------------------------------------ engines' cost formulas
    def gpu_us(self, nbytes: float, flops: float, kernels: int) -> float:
        """Dense GPU work: launches + the roofline at ``dense_cap`` (the executor's formula)."""
        t = nbytes / float(self.costs.dense_cap(nbytes, flops)) if nbytes > 0 else 0.0
        return kernels * self.hw.gpu_launch_us + t

    def cpu_us(self, nbytes: float, flops: float) -> float:
        """The CPU attention kernel over all NUMA nodes: ``cpu_call_us`` + the host roofline."""
        cap = float(self.costs.host_cap(nbytes, flops)) * self.hw.numa_nodes
        return self.hw.cpu_call_us + (nbytes / cap if nbytes > 0 else 0.0)

    def copy_us(self, nbytes: float) -> float:
        """One copy (either direction): the link's latency + bytes at ``link_cap``."""
        return self.hw.link.latency_us + nbytes / self.costs.link_cap

    def kv_copy_us(self, nbytes: float) -> float:
        """One micro-batch's KV host→device (the on-demand baseline keeps KV on the GPU: 0 there)."""
        return self.copy_us(nbytes)

    # ------------------------------------------------------------------ attention parts
    def proj_flops(self, rows: int) -> float:
        """FLOPs of every attention projection for ``rows`` tokens (the shape's count at context 0)."""
        return float(self.shape.attention_flops(0, rows))

    def o_flops(self, rows: int) -> float:
        return 2.0 * self.o_params * rows

    def core_flops(self, cfg: ThroughputConfig, seqs: int) -> float:
        """The attention core of ``seqs`` sequences (decode: one new token each; prefill: the prompt)."""
        s = self.shape
        if cfg.phase == "decode":
            ctx = cfg.attention_context
            if self.mla:
                return seqs * ctx * self.mla_per_position()
            return float(s.attention_flops(ctx, seqs) - s.attention_flops(0, seqs))
        P = cfg.prompt
        if self.mla:  # up-project each prompt token's latent once, attend at half the prompt on average
            nh = s.num_heads
            up = 2.0 * s.kv_lora_rank * nh * (s.qk_nope_head_dim + s.v_head_dim)
            core = 2.0 * nh * (s.qk_nope_head_dim + s.qk_rope_head_dim + s.v_head_dim)
            return seqs * (up * P + core * P * max(P // 2, 1))
        return seqs * float(s.attention_flops(max(P // 2, 1), P) - s.attention_flops(0, P))

    def mla_per_position(self) -> float:
        """MLA FLOPs per cached token and query: the latent up-projection plus the core over full heads."""
        s = self.shape
        nh = s.num_heads
        up = 2.0 * s.kv_lora_rank * nh * (s.qk_nope_head_dim + s.v_head_dim)
        return up + 2.0 * nh * (s.qk_nope_head_dim + s.qk_rope_head_dim + s.v_head_dim)

    def kv_read_bytes(self, cfg: ThroughputConfig, seqs: int) -> float:
        return float(self.shape.kv_cache_bytes(cfg.attention_context, seqs)) if cfg.phase == "decode" else 0.0

    def new_kv_bytes(self, cfg: ThroughputConfig, seqs: int) -> float:
        return seqs * self.kv_tok * (1 if cfg.phase == "decode" else cfg.prompt)

    def dense_module_bytes(self, moe: bool) -> float:
        """One layer's dense modules (``S_Dense``): attention, and router + shared experts or the dense MLP."""
        c = self.costs
        return self.w_att + (c.router_bytes + c.shared_bytes if moe else c.dense_mlp_bytes)

    def micro_batch_us(self, cfg: ThroughputConfig, rows: int) -> tuple[float, float, float, float]:
        """(PreAttn, KV HtoD, GPUAttn, KV DtoH) µs of one GPU micro-batch of ``rows`` sequences."""
        key = ("mb", cfg.phase, cfg.attention_context, cfg.prompt, rows)
        v = self._memo.get(key)
        if v is None:
            toks = rows if cfg.phase == "decode" else rows * cfg.prompt
            pre = self.gpu_us(self.w_att - self.o_bytes, self.proj_flops(toks) - self.o_flops(toks), self.k_pre)
            kv_read = self.kv_read_bytes(cfg, rows)
            kvh = self.kv_copy_us(kv_read) if cfg.phase == "decode" else 0.0
            nbytes = (kv_read if cfg.phase == "decode" else self.new_kv_bytes(cfg, rows)) + self.up_bytes
            attn = self.gpu_us(nbytes, self.core_flops(cfg, rows), self.k_attn)
            v = self._memo[key] = (pre, kvh, attn, self.copy_us(self.new_kv_bytes(cfg, rows)))
        return v

    def cpu_share_us(self, cfg: ThroughputConfig, rows: int) -> tuple[float, float, float, float]:
        """(PreAttn, Q+new KV DtoH, CPUAttn, O HtoD) µs of the CPU share of ``rows`` sequences (decode)."""
        key = ("cpu", cfg.attention_context, rows)
        v = self._memo.get(key)
        if v is None:
            pre = self.gpu_us(self.w_att - self.o_bytes, self.proj_flops(rows) - self.o_flops(rows), self.k_pre)
            q = self.copy_us(rows * (self.q_dim * self.act_bytes + self.kv_tok))
            ca = self.cpu_us(self.kv_read_bytes(cfg, rows) + self.up_bytes, self.core_flops(cfg, rows))
            o = self.copy_us(rows * self.shape.num_heads * self.v_dim * self.act_bytes)
            v = self._memo[key] = (pre, q, ca, o)
        return v

    def lm_head_us(self, cfg: ThroughputConfig) -> float:
        """The LM head over the batch's last tokens (``B`` rows) in ``b_e``-row chunks (``S_IS`` holds one
        chunk's logits)."""
        c = self.costs
        return sum(self.gpu_us(c.lm_head_bytes, c.lm_head_flops_per_token * n, 2)
                   for n in _chunks(cfg.batch, cfg.expert_batch))

    # ------------------------------------------------------------------ routing
    def expert_tokens(self, tokens: int) -> tuple[int, int]:
        """(active experts, tokens each) of one MoE layer over ``tokens`` tokens, uniform routing
        (``top_k`` slots per token: the shape's, or a routing policy's mean)."""
        E, k = self.shape.num_experts, self.top_k
        active = min(E, max(1, round(E * (1.0 - (1.0 - k / E) ** tokens))))
        return active, max(1, round(tokens * k / active))


def _memoised(fn):
    """Memoise a :class:`LayerCosts` method by its arguments (the shape's per-layer sums and the numpy
    roofline are slow; the search asks the same few values thousands of times)."""
    def wrapper(self, *args):
        key = (fn.__name__, *args)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = fn(self, *args)
        return v

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


for _name in ("gpu_us", "cpu_us", "copy_us", "proj_flops"):
    setattr(LayerCosts, _name, _memoised(getattr(LayerCosts, _name)))


def _chunks(n: int, size: int) -> list[int]:
    return [min(size, n - i) for i in range(0, n, size)]


def layer_dag(lc: LayerCosts, cfg: ThroughputConfig, *, moe: bool = True, pinned: int = 0,
              record: bool = True, layer: int | None = None) -> Dag:
    """One decoder layer's DAG under ``cfg`` with ``pinned`` of its routed experts resident
    (see the module docstring); ``layer`` is recorded on each job."""
    c = lc.costs
    g = Dag(record=record)
    f = {} if layer is None else {"layer": layer}
    decode = cfg.phase == "decode"
    B = cfg.batch
    n_c = cfg.cpu_rows if decode else 0
    mbs = _chunks(B - n_c, cfg.micro_batch)
    # ---- PreAttn: the CPU share first (the CPU starts early), then each GPU micro-batch
    mb = [lc.micro_batch_us(cfg, r) for r in mbs]
    cs = lc.cpu_share_us(cfg, n_c) if n_c else None
    pc = ca = None
    if cs:
        pc = g.add("PreAttn[cpu share]", "gpu", cs[0], rows=n_c, module="attention", **f)
    pj = [g.add(f"PreAttn[{j}]", "gpu", mb[j][0], rows=r, micro_batch=j, module="attention", **f)
          for j, r in enumerate(mbs)]
    if cs:
        q = g.add("Q+newKV DtoH[cpu share]", "dtoh", cs[1], [pc], rows=n_c, module="attention", **f)
        ca = g.add("CPUAttn", "cpu", cs[2], [q], rows=n_c, module="attention", **f)
    for j, r in enumerate(mbs):
        g.add(f"KV DtoH[{j}]", "dtoh", mb[j][3], [pj[j]], rows=r, micro_batch=j, module="attention", **f)
    # ---- GPU attention: KV copies into two staging buffers, the core after its copy
    attn: list[int] = []
    kv: list[int | None] = []

    def gpu_attn(j: int) -> int:
        preds = [pj[j]] + ([kv[j]] if kv[j] is not None else [])
        return g.add(f"GPUAttn[{j}]", "gpu", mb[j][2], preds, rows=mbs[j], micro_batch=j, module="attention", **f)

    for j, r in enumerate(mbs):
        if decode:
            kv.append(g.add(f"KV HtoD[{j}]", "htod", mb[j][1], [attn[j - 2]] if j >= 2 else [], rows=r,
                            micro_batch=j, module="attention", **f))
        else:
            kv.append(None)
        if j >= 1:
            attn.append(gpu_attn(j - 1))
    if mbs:
        attn.append(gpu_attn(len(mbs) - 1))
    # ---- experts' first copies (free slots) go before the CPU share's output on the link
    stream = 0
    active = n_e = 0
    if moe:
        active, n_e = lc.expert_tokens(cfg.tokens_per_step)
        stream = max(0, active - min(pinned, active))
    slots = cfg.expert_slots
    wcopy: list[int] = []
    for e in range(min(slots, stream)):
        wcopy.append(g.add(f"Wcopy[{e}]", "htod", c.fetch_us(), expert=e, module="experts", **f))
    after_attn = list(attn)
    if n_c:
        after_attn.append(g.add("O HtoD[cpu share]", "htod", cs[3], [ca], rows=n_c, module="attention", **f))
    T = cfg.tokens_per_step
    post = g.add("PostAttn", "gpu", lc.gpu_us(lc.o_bytes, lc.o_flops(T), lc.k_post), after_attn, rows=B,
                 module="attention", **f)
    # the attention results are collected in host memory (Fig. 2); each FFN chunk brings its tokens back
    hid = g.add("Hidden DtoH", "dtoh", lc.copy_us(T * lc.hidden_bytes), [post], rows=T, module="attention", **f)

    def ffn_chunk(name: str, cost: float, n: int, preds: list[int], **fields) -> int:
        tok = g.add(f"Tokens HtoD {name}", "htod", lc.copy_us(n * lc.hidden_bytes), preds + [hid], rows=n,
                    **fields, **f)
        job = g.add(name, "gpu", cost, preds + [tok], rows=n, **fields, **f)
        g.add(f"Out DtoH {name}", "dtoh", lc.copy_us(n * lc.hidden_bytes), [job], rows=n, **fields, **f)
        return job

    last = post
    if not moe:
        for i, n in enumerate(_chunks(T, cfg.expert_batch)):
            last = ffn_chunk(f"DenseMLP[{i}]", lc.gpu_us(c.dense_mlp_bytes, c.dense_mlp_flops_per_token * n,
                                                          lc.hw.gpu_kernels_per_expert), n, [last],
                             module="dense-mlp")
    else:
        router = g.add("Router", "gpu", lc.gpu_us(c.router_bytes, c.router_flops_per_token * T, 2), [post],
                       rows=T, module="router", **f)
        if c.shared_bytes:
            for i, n in enumerate(_chunks(T, cfg.expert_batch)):
                ffn_chunk(f"Shared[{i}]", c.shared_us(n), n, [router], module="shared-experts")
        for e in range(active - stream):  # pinned experts: no copy
            for i, n in enumerate(_chunks(n_e, cfg.expert_batch)):
                ffn_chunk(f"Expert[pinned {e}][{i}]", c.device_us(n), n, [router], expert=e, chunk=i,
                          module="experts", pinned=True)
        for e in range(stream):
            for i, n in enumerate(_chunks(n_e, cfg.expert_batch)):
                last = ffn_chunk(f"Expert[{e}][{i}]", c.device_us(n), n, [router, wcopy[e]], expert=e, chunk=i,
                                 module="experts")
            if e + slots < stream:  # the slot this expert used is free for the expert `slots` later
                wcopy.append(g.add(f"Wcopy[{e + slots}]", "htod", c.fetch_us(), [last], expert=e + slots,
                                   module="experts", **f))
    if not cfg.pin_dense:
        g.add("Dense prefetch[next layer]", "htod", lc.copy_us(lc.dense_module_bytes(moe)), module="dense", **f)
    return g


def layer_busy_us(lc: LayerCosts, cfg: ThroughputConfig, *, moe: bool = True, pinned: int = 0) -> dict[str, float]:
    """Each engine's summed job costs in :func:`layer_dag`'s layer, without building it (micro-batches of
    equal size counted once): every engine serialises its jobs, so the largest is a lower bound of the
    layer's longest path — the search skips a candidate whose bound cannot beat the best found."""
    c = lc.costs
    busy = dict.fromkeys(("gpu", "cpu", "htod", "dtoh"), 0.0)
    decode = cfg.phase == "decode"
    n_c = cfg.cpu_rows if decode else 0
    full, rem = divmod(cfg.batch - n_c, cfg.micro_batch)
    for count, r in ((full, cfg.micro_batch), (1 if rem else 0, rem)):
        if count:
            pre, kvh, att, kvd = lc.micro_batch_us(cfg, r)
            busy["gpu"] += count * (pre + att)
            busy["htod"] += count * kvh
            busy["dtoh"] += count * kvd
    if n_c:
        pre, q, ca, o = lc.cpu_share_us(cfg, n_c)
        busy["gpu"] += pre
        busy["dtoh"] += q
        busy["cpu"] += ca
        busy["htod"] += o
    T = cfg.tokens_per_step
    busy["gpu"] += lc.gpu_us(lc.o_bytes, lc.o_flops(T), lc.k_post)
    busy["dtoh"] += lc.copy_us(T * lc.hidden_bytes)
    chunks = _chunks(T, cfg.expert_batch)

    def ffn(sizes: list[int], times: int = 1) -> None:  # each chunk's tokens in, its output out
        moved = times * sum(lc.copy_us(n * lc.hidden_bytes) for n in sizes)
        busy["htod"] += moved
        busy["dtoh"] += moved

    if not moe:
        busy["gpu"] += sum(lc.gpu_us(c.dense_mlp_bytes, c.dense_mlp_flops_per_token * n, lc.hw.gpu_kernels_per_expert)
                           for n in chunks)
        ffn(chunks)
    else:
        if c.shared_bytes:
            busy["gpu"] += sum(c.shared_us(n) for n in chunks)
            ffn(chunks)
        busy["gpu"] += lc.gpu_us(c.router_bytes, c.router_flops_per_token * T, 2)
        active, n_e = lc.expert_tokens(T)
        e_chunks = _chunks(n_e, cfg.expert_batch)
        busy["gpu"] += active * sum(c.device_us(n) for n in e_chunks)
        ffn(e_chunks, active)
        busy["htod"] += max(0, active - min(pinned, active)) * c.fetch_us()
    if not cfg.pin_dense:
        busy["htod"] += lc.copy_us(lc.dense_module_bytes(moe))
    return busy


def layer_lower_bound_us(lc: LayerCosts, cfg: ThroughputConfig, *, moe: bool = True, pinned: int = 0) -> float:
    """A lower bound of the layer's longest path: its busiest engine (:func:`layer_busy_us`), or the
    path through the CPU share — PreAttn → Q copy → CPUAttn → O copy → PostAttn → and every later GPU
    job (shared experts, router, experts or the dense MLP, serial on the GPU)."""
    busy = layer_busy_us(lc, cfg, moe=moe, pinned=pinned)
    bound = max(busy.values())
    n_c = cfg.cpu_rows if cfg.phase == "decode" else 0
    if n_c:
        c = lc.costs
        T = cfg.tokens_per_step
        chain = sum(lc.cpu_share_us(cfg, n_c)) + lc.gpu_us(lc.o_bytes, lc.o_flops(T), lc.k_post)
        chunks = _chunks(T, cfg.expert_batch)
        if moe:
            active, n_e = lc.expert_tokens(T)
            chain += (sum(c.shared_us(n) for n in chunks) if c.shared_bytes else 0.0)
            chain += lc.gpu_us(c.router_bytes, c.router_flops_per_token * T, 2)
            chain += active * sum(c.device_us(n) for n in _chunks(n_e, cfg.expert_batch))
        else:
            chain += sum(lc.gpu_us(c.dense_mlp_bytes, c.dense_mlp_flops_per_token * n, lc.hw.gpu_kernels_per_expert)
                         for n in chunks)
        bound = max(bound, chain)
    return bound


def step_lower_bound_us(lc: LayerCosts, cfg: ThroughputConfig) -> float:
    """A lower bound of :func:`step_time`'s ``step_us``: each layer's :func:`layer_lower_bound_us`."""
    s = lc.shape
    M = s.num_moe_layers
    D = s.num_layers - M
    p, r = divmod(cfg.pinned_experts, M)
    lb = (M - r) * layer_lower_bound_us(lc, cfg, pinned=p)
    if r:
        lb += r * layer_lower_bound_us(lc, cfg, pinned=p + 1)
    if D:
        lb += D * layer_lower_bound_us(lc, cfg, moe=False)
    return lb + lc.lm_head_us(cfg)


@dataclass(frozen=True)
class StepTime:
    """One pass over every layer: its time, tokens/s and how it adds up (µs)."""

    step_us: float
    tokens: int
    moe_layer_us: float
    """Mean MoE layer time (over the two pinned counts the layers hold)."""
    dense_layer_us: float
    lm_head_us: float
    moe_layers: int
    dense_layers: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_us * 1e6 if self.step_us > 0 else 0.0


def step_time(lc: LayerCosts, cfg: ThroughputConfig) -> StepTime:
    """``T`` of one step: every MoE layer's longest path (``pinned_experts`` spread over the MoE layers,
    ``p`` or ``p+1`` each), every dense layer's, and the LM head over the batch's last tokens."""
    s = lc.shape
    M = s.num_moe_layers
    D = s.num_layers - M
    p, r = divmod(cfg.pinned_experts, M)
    if p > s.num_experts or (p == s.num_experts and r):
        raise MoelabError(f"{cfg.pinned_experts} pinned experts exceed {s.name}'s {M} × {s.num_experts} routed experts.")
    t_p = layer_dag(lc, cfg, moe=True, pinned=p, record=False).T
    t_p1 = layer_dag(lc, cfg, moe=True, pinned=p + 1, record=False).T if r else 0.0
    moe_total = (M - r) * t_p + r * t_p1
    t_dense = layer_dag(lc, cfg, moe=False, record=False).T if D else 0.0
    lm = lc.lm_head_us(cfg)
    total = moe_total + D * t_dense + lm
    return StepTime(total, cfg.tokens_per_step, moe_total / M, t_dense, lm, M, D)


def step_jobs(lc: LayerCosts, cfg: ThroughputConfig) -> list[Job]:
    """Every job of one step with its times on the step's clock (each layer starts when the previous
    one's longest path ends, the LM head last): the schedule :func:`step_time` adds up, for the
    timeline (:mod:`moelab.simulate.moegen.events`)."""
    s = lc.shape
    M = s.num_moe_layers
    p, r = divmod(cfg.pinned_experts, M)
    jobs: list[Job] = []
    t0 = 0.0
    for i in range(s.num_layers):
        moe = i in s.moe_layers
        extra = 1 if moe and s.moe_layers.index(i) < r else 0
        part = layer_dag(lc, cfg, moe=moe, pinned=p + extra, layer=i)
        jobs += [replace(j, start_us=j.start_us + t0, finish_us=j.finish_us + t0) for j in part.jobs]
        t0 += part.T
    lm = lc.lm_head_us(cfg)
    jobs.append(Job("LMHead", "gpu", lm, (), t0, t0 + lm, {"module": "lm-head", "rows": cfg.batch}))
    return jobs


__all__ = ["ASSUMPTIONS", "LayerCosts", "StepTime", "ThroughputConfig", "layer_busy_us", "layer_dag", "layer_lower_bound_us", "step_jobs", "step_lower_bound_us",
           "step_time"]
