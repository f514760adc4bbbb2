"""MoE-Gen's module-based batching on a live transformers model (techniques.md §7.1), run for real.

:class:`ModuleBatchedDecoder` decodes ``B`` sequences of equal-length prompts (no padding) the way
MoE-Gen's throughput schedule does, one decode step at a time:

* **prefill** with the plain model, once per attention micro-batch of ``b_a`` sequences: each
  micro-batch keeps its own ``DynamicCache`` (the cache keyword of the installed transformers
  release: :func:`moelab.compat.cache_kwargs`);
* **each decode step, layer by layer**: for each micro-batch ``j`` the decoder layer's
  ``input_layernorm`` + ``self_attn`` (query length 1, no mask: every sequence attends to its
  whole cache, which is correct because nothing is padded; position embeddings from
  ``model.model.rotary_emb``) + the residual; the results of all ``B`` sequences are collected;
  then ``post_attention_layernorm`` and the layer's MLP over all ``B`` tokens at once. In a MoE
  block the router and the shared experts run as the block computes them (the shared experts in
  ``b_e``-row chunks, as the schedule runs them), and the routed experts run **sequentially**,
  one expert at a time over all of its routed tokens in ``b_e``-row chunks (the ``moelab_moegen``
  experts implementation registered with transformers' ``ExpertsInterface``; each chunk is the
  reference backend's :func:`~moelab.backends.reference.expert_forward`, the kernel ``moelab
  calibrate`` times for the device lane). A dense (non-MoE) layer's MLP runs in ``b_e``-row chunks
  over all ``B``; the final norm over ``B`` and the LM head in ``b_e``-row chunks (the schedule's
  ``S_IS`` holds one chunk's logits).

Everything runs on the CPU: this machine has no GPU, and the "device" is a CPU worker, as in the
rest of moelab. So the copies MoE-Gen makes on a GPU machine — each micro-batch's KV host→device,
new K/V and the collected hidden states device→host, each FFN chunk's tokens and output, expert
weights into ``S_Expert`` slots, the next layer's dense modules — are **not made**: the KV cache
and every weight stay in place in the one memory. :func:`moelab.simulate.moegen.real.simulated_step` asks the simulator
(:mod:`moelab.simulate.moegen`) for the same configuration with that correspondence: every routed
expert pinned (``S_Params`` = all experts, no ``Wcopy``), every dense module pinned (no prefetch),
``ω = 0`` (all attention on the device lane, as here), and every copy job costing 0 (a
:class:`InPlaceCosts`: the DAG keeps its jobs and edges, the copies take no time because there is
no link between the CPU worker and host memory).

Events (:class:`~moelab.hybrid.events.EventLog`, the one schema): on lane ``device``, ``dense``
spans for each micro-batch's attention (``Attention[j]``, tokens = its sequences), the router
(``Router``), each dense-MLP chunk (``DenseMLP[i]``) and LM-head chunk (``LMHead[i]``);
``shared-experts`` spans per shared chunk (``Shared[i]``); ``expert-device`` spans per routed
expert chunk (``Expert[e][i]``, ``expert`` = ``e``, tokens = the chunk's rows). So
:class:`moelab.timeline.Timeline` draws a real module-batched step.

>>> dec = ModuleBatchedDecoder(model, micro_batch=4, expert_batch=8)
>>> out = dec.generate(input_ids, steps=8)        # input_ids (B, P), no padding
>>> out.tokens, out.tokens_per_s, moelab.Timeline(dec.log)
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moelab.backends.reference import expert_forward
from moelab.compat import cache_kwargs, output_cache
from moelab.errors import MoelabError
from moelab.hybrid.events import EventLog

#: the experts implementation name registered with transformers
EXPERTS_IMPLEMENTATION = "moelab_moegen"


#: the event lane of each of a module-batched step's streams
LANES = {"compute": "device", "htod": "copy-htod", "dtoh": "copy-dtoh"}


class WallClock:
    """Spans timed by the host's wall clock on one thread (the CPU worker as the device): a mark is
    the time now. :class:`moelab.hybrid.throughput_offload` has the CUDA clock (timing events on
    streams) with the same two methods."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def mark(self, stream: str = "compute") -> float:
        return self.log.now_us()

    def span(self, start: Any, end: Any, step: int, layer: int, stream: str, kind: str, **fields: Any) -> None:
        """One event on ``stream``'s lane from mark ``start`` to mark ``end``."""
        self.log.add(step, layer, LANES[stream], kind, start, end, **fields)


@dataclass
class _Active:
    """What the experts implementation needs to know while a module-batched step runs."""

    expert_batch: int
    log: EventLog | None
    step: int = 0
    layer: int = -1
    clock: Any = None
    """:class:`WallClock` (default, over ``log``) or the offloaded decoder's CUDA clock."""
    streamer: Any = None
    """``streamer(module, hidden, top_k_index, top_k_weights, state)``: runs the routed experts instead
    (the offloaded decoder's, which streams them into GPU slots); None: the experts run in place."""

    def __post_init__(self) -> None:
        if self.clock is None and self.log is not None:
            self.clock = WallClock(self.log)


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("moelab_moegen_active", default=None)


def moegen_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed experts one after the other (ascending id), each over all of its routed tokens in
    ``b_e``-row chunks (slot-major token order, as transformers' eager forward). Outside a
    :class:`ModuleBatchedDecoder` step (no active ``b_e``) each expert runs in one chunk."""
    st = _ACTIVE.get()
    if getattr(module, "_is_expert_parallel", False):
        raise MoelabError("the moelab_moegen experts implementation runs every expert locally; this experts module "
                          "is expert-parallel. Fix: run it without expert parallelism.")
    if st is not None and st.streamer is not None:
        return st.streamer(module, hidden_states, top_k_index, top_k_weights, st)
    T, k = top_k_index.shape
    E = num_experts(module)
    out = torch.zeros_like(hidden_states)
    tok_all, w_all, counts = slot_major(top_k_index, top_k_weights, E)
    be = st.expert_batch if st is not None else max(T * k, 1)
    start = 0
    for e, n in enumerate(counts):
        if n and e < E:  # index E is a masked slot: no expert
            run_expert_chunks(module, e, hidden_states, tok_all[start:start + n], w_all[start:start + n], out, be, st)
        start += n
    return out


def num_experts(module: torch.nn.Module) -> int:
    """Routed experts in a transformers experts module (its weight stacks' first dimension)."""
    return int(module.gate_up_proj.shape[0] if hasattr(module, "gate_up_proj") else module.down_proj.shape[0])


def slot_major(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         list[int]]:
    """(token of each routed slot, its weight, slots per expert ``0..E``): slots grouped by expert in
    ascending id, slot-major within an expert (every token's slot 0, then slot 1, ..., as transformers'
    eager forward orders them). Reading the counts waits for the router."""
    T = top_k_index.shape[0]
    flat = top_k_index.T.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E + 1).tolist()
    return order % T, top_k_weights.T.reshape(-1)[order], counts


def run_expert_chunks(weights: Any, e: int, hidden: torch.Tensor, tok: torch.Tensor, w: torch.Tensor,
                      out: torch.Tensor, be: int, st: _Active | None, slot: int | None = None) -> None:
    """Expert ``e`` over its routed tokens ``tok`` (weights ``w``) in ``be``-row chunks, each one
    ``expert-device`` event ``Expert[e][i]``; the expert's weights are ``weights``' index ``slot``
    (default ``e``), so a GPU slot ring or resident stack runs through the same code.

    Size: the per-layer hot path of both decoders; its nine inputs are the chunk loop's state, passed
    as they are rather than boxed per call."""
    clock = st.clock if st is not None else None
    n = int(tok.shape[0])
    for i, c0 in enumerate(range(0, n, be)):
        c1 = min(c0 + be, n)
        t0 = clock.mark() if clock is not None else 0.0
        y = expert_forward(weights, e if slot is None else slot, hidden[tok[c0:c1]]) * w[c0:c1, None]
        out.index_add_(0, tok[c0:c1], y.to(out.dtype))
        if clock is not None:
            clock.span(t0, clock.mark(), st.step, st.layer, "compute", "expert-device", expert=e, tokens=c1 - c0,
                       cause=f"Expert[{e}][{i}]")


def register() -> str:
    """Register :data:`EXPERTS_IMPLEMENTATION` with transformers' experts interface (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moegen_experts_forward)
    return EXPERTS_IMPLEMENTATION


class _ChunkedRows(torch.nn.Module):
    """A module applied to its input's rows in ``b_e``-row chunks, each chunk one event (the shared
    experts of a MoE block while a module-batched step runs)."""

    def __init__(self, inner: torch.nn.Module, kind: str, name: str) -> None:
        super().__init__()
        self.inner, self.kind, self.name = inner, kind, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = _ACTIVE.get()
        if st is None:
            return self.inner(x)
        return _chunked(self.inner, x, st, self.kind, self.name)


def _chunked(fn, x: torch.Tensor, st: _Active, kind: str, name: str) -> torch.Tensor:
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    outs = []
    clock = st.clock
    for i, r0 in enumerate(range(0, rows.shape[0], st.expert_batch)):
        t0 = clock.mark() if clock is not None else 0.0
        part = rows[r0:r0 + st.expert_batch]
        outs.append(fn(part))
        if clock is not None:
            clock.span(t0, clock.mark(), st.step, st.layer, "compute", kind, tokens=int(part.shape[0]),
                       cause=f"{name}[{i}]")
    y = torch.cat(outs, 0)
    return y.reshape(*shape[:-1], y.shape[-1])


#: names under which MoE blocks hold their shared experts
SHARED_NAMES: tuple[str, ...] = ("shared_experts", "shared_expert")


def check_structure(model: Any) -> list[bool]:
    """Whether each decoder layer is MoE (True) or dense (False); raises :class:`MoelabError` for a
    model whose decoder layers are not ``input_layernorm → self_attn → post_attention_layernorm → mlp``
    or whose MoE block is not ``gate`` + gated ``experts`` (3-D weight stacks)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens") \
            or not hasattr(model, "lm_head") or not hasattr(inner, "norm"):
        raise MoelabError(f"{type(model).__name__}: the module-batched decoder needs a causal LM with model.model."
                          "{embed_tokens, layers, norm, rotary_emb} and lm_head (transformers' decoder-only layout). "
                          "Fix: use a transformers MoE model such as moelab.load('moelab-tiny-mixtral').")
    moe = []
    for i, layer in enumerate(layers):
        missing = [n for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
                   if not hasattr(layer, n)]
        if missing:
            raise MoelabError(f"decoder layer {i} ({type(layer).__name__}) lacks {', '.join(missing)}: the module-"
                              "batched decoder runs input_layernorm → self_attn → post_attention_layernorm → mlp "
                              "and refuses other structures (parallel attention/MLP, post-norms, linear attention).")
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:
            moe.append(False)
            continue
        if not hasattr(mlp, "gate") or not hasattr(experts, "down_proj") or not hasattr(experts, "gate_up_proj") \
                or experts.down_proj.dim() != 3 or not getattr(experts, "has_gate", True):
            raise MoelabError(f"layer {i}'s MoE block ({type(mlp).__name__}) is not a router `gate` with gated "
                              "`experts` (gate_up_proj, down_proj as 3-D stacks, transformers 5's layout); the "
                              "module-batched decoder refuses it.")
        if getattr(experts, "has_post_expert_norm", False):
            raise MoelabError(f"layer {i}'s experts apply a post-expert norm, which the module-batched decoder "
                              "does not run; it refuses the model.")
        moe.append(True)
    return moe


@dataclass
class Generation:
    """A module-batched (or plain) greedy decode: tokens, per-step logits and the decode's wall time."""

    tokens: torch.Tensor
    """``(B, steps + 1)``: the prefill's greedy token, then each decode step's."""
    logits: list[torch.Tensor]
    """Last-position logits ``(B, V)`` of the prefill and of each decode step (when kept)."""
    prefill_s: float
    decode_s: float
    steps: int
    batch: int
    step_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: ``B × steps`` over the decode's wall time (prefill excluded)."""
        return self.batch * self.steps / self.decode_s if self.decode_s > 0 else 0.0


def _check_ids(input_ids: Any, steps: int) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 1 \
            or input_ids.shape[1] < 1:
        raise MoelabError(f"input_ids of shape {tuple(getattr(input_ids, 'shape', ()))}: expected a (B, P) tensor of "
                          "token ids, B ≥ 1 sequences of one prompt length P ≥ 1 (no padding).")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise MoelabError(f"steps={steps!r}: expected an integer ≥ 0 (decode steps after the prefill).")
    return input_ids


class ModuleBatchedDecoder:
    """MoE-Gen's decode schedule on ``model`` (see the module docstring) with attention micro-batches of
    ``micro_batch`` sequences and expert chunks of ``expert_batch`` rows; events go to :attr:`log`."""

    def __init__(self, model: Any, micro_batch: int, expert_batch: int, *, log: EventLog | None = None,
                 run: str = "moegen-real") -> None:
        for name, v in (("micro_batch", micro_batch), ("expert_batch", expert_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoelabError(f"{name}={v!r}: expected an integer ≥ 1 ({'b_a, sequences per attention micro-batch' if name == 'micro_batch' else 'b_e, rows per expert chunk'}).")
        self.model = model
        self.moe = check_structure(model)
        self.micro_batch, self.expert_batch = micro_batch, expert_batch
        self.log = log if log is not None else EventLog(run)
        register()

    # ------------------------------------------------------------------ installing the schedule's pieces
    @contextlib.contextmanager
    def _installed(self, state: _Active):
        """The moelab_moegen experts, chunked shared experts and the router's events, for one step."""
        layers = self.model.model.layers
        configs, swapped, hooks = {}, [], []
        try:
            for i, layer in enumerate(layers):
                if not self.moe[i]:
                    continue
                block = layer.mlp
                cfg = getattr(block.experts, "config", None)
                if cfg is not None and id(cfg) not in configs:
                    configs[id(cfg)] = (cfg, getattr(cfg, "_experts_implementation", None))
                    cfg._experts_implementation = EXPERTS_IMPLEMENTATION
                for name in SHARED_NAMES:
                    inner = getattr(block, name, None)
                    if isinstance(inner, torch.nn.Module) and not isinstance(inner, _ChunkedRows):
                        block._modules[name] = _ChunkedRows(inner, "shared-experts", "Shared")
                        swapped.append((block, name, inner))
                if self.log is not None:
                    hooks.append(block.gate.register_forward_pre_hook(self._router_start))
                    hooks.append(block.gate.register_forward_hook(self._router_end))
            token = _ACTIVE.set(state)
            try:
                yield
            finally:
                _ACTIVE.reset(token)
        finally:
            for h in hooks:
                h.remove()
            for block, name, inner in swapped:
                block._modules[name] = inner
            for cfg, before in configs.values():
                cfg._experts_implementation = before

    def _router_start(self, module, args) -> None:
        st = _ACTIVE.get()
        self._t_router = st.clock.mark() if st is not None and st.clock is not None else None

    def _router_end(self, module, args, output) -> None:
        st = _ACTIVE.get()
        if st is not None and st.clock is not None and self._t_router is not None:
            rows = int(args[0].reshape(-1, args[0].shape[-1]).shape[0]) if args else 0
            st.clock.span(self._t_router, st.clock.mark(), st.step, st.layer, "compute", "dense", tokens=rows,
                          cause="Router")

    # ------------------------------------------------------------------ the decode
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
        """The plain model over each micro-batch's prompts: (one cache per micro-batch, last logits ``(B, V)``)."""
        caches, logits = [], []
        for j0 in range(0, input_ids.shape[0], self.micro_batch):
            out = self.model(input_ids=input_ids[j0:j0 + self.micro_batch], use_cache=True)
            caches.append(output_cache(out))
            logits.append(out.logits[:, -1, :])
        return caches, torch.cat(logits, 0)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, caches: list[Any], position: int, step: int = 0) -> torch.Tensor:
        """One module-batched decode step: ``tokens`` ``(B,)`` at ``position``; returns logits ``(B, V)``."""
        m = self.model.model
        log = self.log
        state = _Active(self.expert_batch, log, step)
        B, ba = tokens.shape[0], self.micro_batch
        with self._installed(state):
            h = m.embed_tokens(tokens[:, None])
            for i, layer in enumerate(m.layers):
                state.layer = i
                parts = []
                for j, j0 in enumerate(range(0, B, ba)):
                    t0 = log.now_us()
                    x = h[j0:j0 + ba]
                    pos = torch.full((x.shape[0], 1), position, dtype=torch.long, device=x.device)
                    pe = m.rotary_emb(x, pos)
                    a = layer.self_attn(hidden_states=layer.input_layernorm(x), attention_mask=None, position_ids=pos,
                                        position_embeddings=pe, use_cache=True,
                                        **cache_kwargs(caches[j], layer.self_attn))
                    parts.append(x + (a[0] if isinstance(a, tuple) else a))
                    log.add(step, i, "device", "dense", t0, log.now_us(), tokens=int(x.shape[0]),
                            cause=f"Attention[{j}]")
                h = torch.cat(parts, 0)
                y = layer.post_attention_layernorm(h)
                if self.moe[i]:
                    y = layer.mlp(y)
                    y = y[0] if isinstance(y, tuple) else y
                else:
                    y = _chunked(layer.mlp, y, state, "dense", "DenseMLP")
                h = h + y
            state.layer = -1
            h = m.norm(h)
            logits = _chunked(self.model.lm_head, h, state, "dense", "LMHead")
        return logits[:, -1, :]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, steps: int, *, keep_logits: bool = True) -> Generation:
        """Greedy decode of ``steps`` module-batched steps after the plain prefill (see the module docstring)."""
        ids = _check_ids(input_ids, steps)
        t0 = time.perf_counter()
        caches, logits = self.prefill(ids)
        t1 = time.perf_counter()
        P = ids.shape[1]
        toks, kept, step_s = _greedy_steps(logits, steps, keep_logits,
                                           lambda s, tok: self.step(tok, caches, P + s, step=s))
        t2 = time.perf_counter()
        return Generation(torch.stack(toks, 1), kept, t1 - t0, t2 - t1, steps, int(ids.shape[0]), step_s)


def _greedy_steps(logits: torch.Tensor, steps: int, keep_logits: bool, step) -> tuple[list, list, list]:
    """Greedy decode from the prompt's last ``logits``: ``step(s, tokens)`` gives step ``s``'s logits;
    returns (tokens per step, the logits kept, seconds per step)."""
    tok = logits.argmax(-1)
    toks, kept, step_s = [tok], [logits] if keep_logits else [], []
    for s in range(steps):
        ts = time.perf_counter()
        logits = step(s, tok)
        tok = logits.argmax(-1)
        _sync(tok)
        step_s.append(time.perf_counter() - ts)
        toks.append(tok)
        if keep_logits:
            kept.append(logits)
    return toks, kept, step_s


def _sync(t: torch.Tensor) -> None:
    """Wait for the GPU when ``t`` lives there, so a wall-clock time covers the work it timed."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


@torch.no_grad()
def plain_generate(model: Any, input_ids: torch.Tensor, steps: int, *, keep_logits: bool = True) -> Generation:
    """The plain model's batched greedy decode of the same prompts (one cache for all ``B``): the reference."""
    ids = _check_ids(input_ids, steps)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    _sync(out.logits)
    t1 = time.perf_counter()
    box = {"cache": output_cache(out)}

    def step(_s: int, tok: torch.Tensor) -> torch.Tensor:
        o = model(input_ids=tok[:, None], use_cache=True, **cache_kwargs(box["cache"], model))
        box["cache"] = output_cache(o)
        return o.logits[:, -1, :]

    toks, kept, step_s = _greedy_steps(out.logits[:, -1, :], steps, keep_logits, step)
    t2 = time.perf_counter()
    return Generation(torch.stack(toks, 1), kept, t1 - t0, t2 - t1, steps, int(ids.shape[0]), step_s)


__all__ = ["EXPERTS_IMPLEMENTATION", "LANES", "SHARED_NAMES", "Generation", "ModuleBatchedDecoder", "WallClock",
           "check_structure", "moegen_experts_forward", "num_experts", "plain_generate", "register",
           "run_expert_chunks", "slot_major"]
