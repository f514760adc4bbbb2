"""Teacher-forced comparison of a routing policy with the unmodified model, per token and layer.

>>> att = moelab.attribution.compare(model, {"policy": "deferral", "deferred": 2}, prompts, tokenizer=tok)
>>> att.tokens[["seq", "index", "kl", "top1_agree", "rank"]]    # one row per compared token
>>> att.layers.groupby("layer").kl_share.mean()                  # one row per token and MoE layer
>>> att.save("runs/att1")                                        # tokens.parquet, layers.parquet, meta.json

**The same tokens.** Each sequence is a prompt and a continuation: the baseline's own greedy
generation (default), a task's reference answers (``task=``), or a recorded trace's tokens
(``trace=``). Baseline and policy then read the *same* tokens in one forward each (teacher
forcing, batched with left padding and the positions generation would use), so every
difference in the next-token distributions is the policy's, not a different history.

**The policy acts where generation would act.** A decode-phase policy (the default of
deferral and skipping) changes only the forwards of generated tokens: in the teacher-forced
forward it acts on the continuation's tokens and leaves the prompt's exactly as they were
(a handler after the routing policies restores those tokens' plans), which is what
incremental decoding computes token by token. ``phase: all`` acts on every token.

Per token (``tokens``): ``kl`` = KL(baseline ‖ policy) of the next-token distribution (float64),
``top1_agree``, ``rank`` (of the baseline's top token under the policy, 0 = still top),
the target token's log-probabilities under both and their difference ``nll_delta``. Per token
and MoE layer (``layers``): the router weight and number of the slots the policy changed
(``changed_weight``, ``changed_slots``: deferred or dropped), ``moved_norm`` — the norm of the
expert output the policy moved out of that layer for that token (computed on the policy's
own input; deferred outputs reappear at the next layer) — and the total effect so far:
``moe_delta`` (norm of the MoE block's output difference) and ``resid_delta`` (relative norm of
the residual stream's difference after the block). ``free_running`` gives, per sequence, the
first generated token where the policy's own greedy generation leaves the baseline's.

Cost: one baseline and one policy forward per batch (plus the generations that make the
continuations and the free-running comparison).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import moelab
from moelab.errors import MoelabError
from moelab.forward import IMMEDIATE, Order, forward_hooks
from moelab.policies.registry import POLICIES, make_policy
from moelab.tasks import generate, prompt_and_target

log = logging.getLogger(__name__)

#: Runs after routing policies (and the hybrid runtime's own deferral/skipping), before caches.
MASK_ORDER = Order.ROUTING + 50
IDENTITY = "none"


# --------------------------------------------------------------------------- policies
@dataclass
class PolicySpec:
    """How to apply a policy for generation and for a teacher-forced forward (see :func:`as_policy`)."""

    label: str
    make: Any
    """``make(model, phase)`` → a context manager applying the policy (``phase`` None: its own)."""
    phase: str = "decode"
    """The phase the policy acts in (``decode`` or ``all``); ``none`` for the identity."""
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def identity(self) -> bool:
        return self.label == IDENTITY


def _parse_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``"deferral"`` or ``"deferral:deferred=2,min_immediate=0"`` → (name, settings)."""
    import yaml

    name, _, rest = text.partition(":")
    settings: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise MoelabError(f"policy {text!r}: expected key=value after the name, got {part!r} "
                              "(e.g. 'deferral:deferred=2,min_immediate=0').")
        settings[key.strip()] = yaml.safe_load(value)
    return name.strip(), settings


def as_policy(policy: Any) -> PolicySpec:
    """A :class:`PolicySpec` from what :func:`compare` accepts as ``policy``:

    None or ``"none"`` (the identity); a registered routing policy by name (``"deferral"``,
    ``"skipping:skipped=1"``) or as a mapping (``{"policy": "deferral", "deferred": 2}``); a
    :class:`~moelab.policies.RoutingPolicy` object (its class and config are reused); a hybrid
    configuration (a :class:`~moelab.hybrid.HybridConfig`, a mapping of its fields, or
    ``{"policy": "hybrid", "config": {...}}``) run by the functional executor.
    """
    from moelab.policies.base import RoutingPolicy

    if policy is None or policy == IDENTITY:
        return PolicySpec(IDENTITY, lambda model, phase: contextlib.nullcontext(), "none")
    if isinstance(policy, RoutingPolicy):
        cls, cfg = type(policy), policy.config
        return _routing_spec(cls.kind, cls, cfg)
    if isinstance(policy, str):
        name, settings = _parse_spec(policy)
        return as_policy({"policy": name, **settings})
    from moelab.hybrid.config import HybridConfig

    if isinstance(policy, HybridConfig):
        return _hybrid_spec(policy)
    if isinstance(policy, dict):
        d = dict(policy)
        name = d.pop("policy", None)
        if name == IDENTITY and not d:
            return as_policy(None)
        if name == "hybrid":
            return _hybrid_spec(HybridConfig.from_dict(d.get("config", {})))
        if name is None:
            return _hybrid_spec(HybridConfig.from_dict(d))

        probe = make_policy(name, None, **d)
        return _routing_spec(name, POLICIES.get(name), probe.config)
    raise MoelabError(f"policy {policy!r}: expected None, a routing-policy name or mapping, a RoutingPolicy, "
                      "or a hybrid configuration.")


def _routing_spec(name: str, cls: type, cfg: Any) -> PolicySpec:
    phase = getattr(cfg, "phase", "decode")

    def make(model, phase_override=None):
        c = cfg if phase_override is None or not hasattr(cfg, "phase") else dataclasses.replace(cfg, phase=phase_override)
        return cls(model, config=c)

    settings = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}
    label = name + "(" + ", ".join(f"{k}={v}" for k, v in settings.items() if k != "phase") + ")"
    return PolicySpec(label, make, phase, settings)


def _hybrid_spec(cfg: Any) -> PolicySpec:
    from moelab.hybrid.runtime import HybridRun

    if cfg.executor != "functional":
        cfg = dataclasses.replace(cfg, executor="functional")

    def make(model, phase_override=None):
        c = cfg
        if phase_override is not None:
            c = dataclasses.replace(cfg, routing=dataclasses.replace(cfg.routing, phase=phase_override))
        return HybridRun(model, c)

    return PolicySpec("hybrid", make, cfg.routing.phase, {"config": cfg.to_dict()})


# --------------------------------------------------------------------------- inputs
@dataclass
class Sequences:
    """Prompts and continuations as token ids (what baseline and policy read)."""

    prompts: list[list[int]]
    continuations: list[list[int]]
    texts: list[str] = field(default_factory=list)
    source: str = "generation"


def _generate(model: Any, prompts: list[list[int]], max_new_tokens: int, pad: int, eos: set[int],
              batch_size: int) -> list[list[int]]:
    """Greedy continuations (cut after the first end-of-sequence token)."""
    out: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        chunk = prompts[b:b + batch_size]
        ids, mask = _left_pad([list(p) for p in chunk], pad)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=pad)
        for row in seqs[:, ids.shape[1]:].tolist():
            cont = []
            for t in row:
                cont.append(t)
                if t in eos:
                    break
            out.append(cont)
    return out


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, n - len(r):] = 1
    return ids, mask


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _pad_id(tokenizer: Any, model: Any) -> int:
    for v in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
              getattr(model.config, "pad_token_id", None)):
        if v is not None:
            return int(v)
    return 0


def sequences_from_trace(trace: Any) -> Sequences:
    """Prompts (step 0) and continuations (later steps) of every sequence of a routing trace."""
    from moelab.trace import open_trace

    tr = open_trace(trace) if isinstance(trace, (str, os.PathLike)) else trace
    seq, step, pos, tok, layer = (tr.column(c) for c in ("seq", "step", "pos", "token_id", "layer"))
    first = layer == layer.min()
    prompts, conts = [], []
    for s in np.unique(seq[first]):
        rows = first & (seq == s)
        order = np.argsort(pos[rows], kind="stable")
        ids, steps = tok[rows][order], step[rows][order]
        if (ids < 0).any():
            raise MoelabError(f"trace {trace}: sequence {s} has no token ids (recorded from embeddings); "
                              "compare needs the tokens.")
        prompts.append(ids[steps == 0].tolist())
        conts.append(ids[steps > 0].tolist())
    return Sequences(prompts, conts, source="trace")


def sequences_from_task(task: str, tokenizer: Any, limit: int | None, split: str = "test") -> Sequences:
    """A local task's prompts with its reference answers as continuations."""

    docs = generate(task, split)[:limit] if limit else generate(task, split)
    prompts, conts, texts = [], [], []
    for doc in docs:
        prompt, target = prompt_and_target(task, doc)
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        t = tokenizer(target, add_special_tokens=False).input_ids
        prompts.append(p)
        conts.append(t)
        texts.append(prompt)
    return Sequences(prompts, conts, texts, source=f"task {task} (reference answers)")


# --------------------------------------------------------------------------- the comparison
@dataclass
class Attribution:
    """What :func:`compare` found (see the module docstring)."""

    tokens: Any
    """pandas DataFrame, one row per compared token."""
    layers: Any
    """pandas DataFrame, one row per compared token and MoE layer (empty with ``layers=False``)."""
    free_running: Any
    """pandas DataFrame, one row per sequence: ``first_divergence`` (-1: none) and the lengths."""
    meta: dict[str, Any]

    @property
    def mean_kl(self) -> float:
        return float(self.tokens["kl"].mean()) if len(self.tokens) else float("nan")

    @property
    def top1_agreement(self) -> float:
        return float(self.tokens["top1_agree"].mean()) if len(self.tokens) else float("nan")

    def summary(self) -> dict[str, Any]:
        t = self.tokens
        fr = self.free_running
        return {
            "policy": self.meta["policy"], "tokens": len(t), "sequences": int(t["seq"].nunique()) if len(t) else 0,
            "mean_kl": self.mean_kl, "top1_agreement": self.top1_agreement,
            "mean_rank": float(t["rank"].mean()) if len(t) else float("nan"),
            "mean_nll_delta": float(t["nll_delta"].mean()) if len(t) else float("nan"),
            "diverged_sequences": int((fr["first_divergence"] >= 0).sum()) if len(fr) else 0,
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (f"Attribution({s['policy']}: {s['tokens']} tokens of {s['sequences']} sequences, mean KL "
                f"{s['mean_kl']:.4g}, top-1 agreement {s['top1_agreement']:.3f}, "
                f"{s['diverged_sequences']} free-running divergences)")

    def save(self, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """``tokens.parquet``, ``layers.parquet``, ``free_running.parquet`` and ``meta.json`` in ``out``,
        written to a temporary folder and renamed into place (an interrupted save leaves nothing)."""
        out = Path(out)
        if out.exists():
            if not overwrite:
                raise MoelabError(f"{out} exists; pass overwrite=True (CLI: --overwrite) or choose another folder.")
            import shutil

            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
        self.tokens.to_parquet(tmp / "tokens.parquet", index=False)
        self.layers.to_parquet(tmp / "layers.parquet", index=False)
        self.free_running.to_parquet(tmp / "free_running.parquet", index=False)
        (tmp / "meta.json").write_text(json.dumps(self.meta, indent=2, default=str))
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> Attribution:
        import pandas as pd

        p = Path(path)
        if not (p / "meta.json").exists():
            raise MoelabError(f"{p} is not a saved attribution (no meta.json); write one with Attribution.save.")
        return cls(pd.read_parquet(p / "tokens.parquet"), pd.read_parquet(p / "layers.parquet"),
                   pd.read_parquet(p / "free_running.parquet"), json.loads((p / "meta.json").read_text()))


class _LayerStats:
    """Per-layer handlers of the policy forward: restore the plan of tokens the policy must not
    touch, and record what it changed (router weight, slots, the expert output it moved)."""

    def __init__(self, want_stats: bool) -> None:
        self.act: torch.Tensor | None = None  # (T,) bool: tokens the policy acts on (None: all)
        self.want = want_stats
        self.stats: dict[int, dict[str, torch.Tensor]] = {}

    def mask(self, ctx, layer, call) -> None:
        if self.act is None or call._plan is None:
            return
        plan = call.plan
        keep = ~self.act.to(plan.state.device).reshape(-1, 1)
        if not bool(keep.any()):
            return
        plan.state = torch.where(keep, torch.full_like(plan.state, IMMEDIATE), plan.state)
        if plan.weights is not call.weights:
            plan.weights = torch.where(keep, call.weights.to(plan.weights.dtype), plan.weights)

    def output(self, ctx, layer, call, out) -> None:
        if not self.want:
            return
        T = out.shape[0]
        plan = call._plan
        if plan is None or not plan.changed:
            zeros = torch.zeros(T, dtype=torch.float32)
            self.stats[layer.index] = {"changed_weight": zeros, "changed_slots": zeros.to(torch.int16),
                                       "moved_norm": zeros}
            return
        changed = plan.state != IMMEDIATE
        weight = (call.weights.float() * changed).sum(1)
        original = getattr(layer.experts.forward, "__wrapped__", None)
        moved = torch.zeros(T, dtype=torch.float32)
        if original is not None:
            with torch.no_grad():
                full = original(call.hidden, call.experts, call.weights)
            here = out - call.incoming if call.incoming is not None else out
            moved = (full.float() - here.float()).norm(dim=-1).cpu()
        self.stats[layer.index] = {"changed_weight": weight.cpu(), "changed_slots": changed.sum(1).to(torch.int16).cpu(),
                                   "moved_norm": moved}


def sequences(
    model: Any,
    prompts: Sequence[str] | None = None,
    *,
    tokenizer: Any = None,
    trace: Any = None,
    task: str | None = None,
    limit: int | None = None,
    continuations: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 8,
) -> Sequences:
    """The prompts and continuations :func:`compare` reads (its input rules); build them once to
    compare several policies on the same tokens (:func:`compare_many`).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    given = [x is not None for x in (prompts, trace, task)]
    if sum(given) != 1:
        raise MoelabError(f"compare needs exactly one of prompts=, trace= or task= (got {sum(given)}).")
    if batch_size < 1 or max_new_tokens < 1:
        raise MoelabError(f"batch_size and max_new_tokens must be ≥ 1 (got {batch_size}, {max_new_tokens}).")
    if trace is not None:
        seqs = sequences_from_trace(trace)
    elif task is not None:
        if tokenizer is None:
            raise MoelabError("task= needs tokenizer= to turn its prompts and answers into tokens.")
        seqs = sequences_from_task(task, tokenizer, limit)
    else:
        if tokenizer is None:
            raise MoelabError("prompts= are text: pass tokenizer= (moelab.load returns it).")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [tokenizer(p).input_ids for p in prompts]
        if continuations is not None:
            if len(continuations) != len(ids):
                raise MoelabError(f"{len(continuations)} continuations for {len(ids)} prompts.")
            seqs = Sequences(ids, [list(c) for c in continuations], list(prompts), source="given")
        else:
            pad, eos = _pad_id(tokenizer, model), _eos_ids(model, tokenizer)
            seqs = Sequences(ids, _generate(model, ids, max_new_tokens, pad, eos, batch_size), list(prompts))
    if not any(seqs.continuations):
        raise MoelabError("no sequence has a continuation to compare (every continuation is empty).")
    return seqs


def compare(
    model: Any,
    policy: Any = None,
    prompts: Sequence[str] | None = None,
    *,
    tokenizer: Any = None,
    trace: Any = None,
    task: str | None = None,
    limit: int | None = None,
    continuations: Sequence[Sequence[int]] | None = None,
    seqs: Sequences | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    layers: bool = True,
    free_running: bool = True,
    progress: bool | str = False,
) -> Attribution:
    """Compare ``policy`` with the unmodified model on the same tokens (see the module docstring).

    Inputs, one of: ``prompts`` (strings, with ``tokenizer``; continuations are the baseline's greedy
    generation of ``max_new_tokens``, or ``continuations`` given as token ids), ``trace`` (a routing
    trace or its folder: its recorded prompts and generated tokens), ``task`` (a local task's
    prompts and reference answers, ``limit`` documents) or ``seqs`` (from :func:`sequences`).
    ``layers=False`` skips the per-layer table; ``free_running=False`` the policy's own generation.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    import pandas as pd

    spec = as_policy(policy)
    if seqs is None:
        seqs = sequences(model, prompts, tokenizer=tokenizer, trace=trace, task=task, limit=limit,
                         continuations=continuations, max_new_tokens=max_new_tokens, batch_size=batch_size)
    pad, eos = _pad_id(tokenizer, model), _eos_ids(model, tokenizer)
    token_rows: list[pd.DataFrame] = []
    layer_rows: list[pd.DataFrame] = []
    batches = range(0, len(seqs.prompts), batch_size)
    it: Iterable[int] = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc=progress if isinstance(progress, str) else f"compare {spec.label}", unit="batch")
    for b in it:
        idx = list(range(b, min(b + batch_size, len(seqs.prompts))))
        t, lyr = _compare_batch(model, spec, seqs, idx, pad, layers)
        token_rows.append(t)
        layer_rows.append(lyr)
    tokens = pd.concat(token_rows, ignore_index=True)
    layer_df = pd.concat(layer_rows, ignore_index=True) if layers else pd.DataFrame()
    if free_running:
        fr = _free_running(model, spec, seqs, pad, eos, batch_size, max_new_tokens)
    else:
        fr = pd.DataFrame({"seq": [], "first_divergence": []})
    return Attribution(tokens, layer_df, fr, _meta(model, spec, seqs, batch_size, max_new_tokens))


def _compare_batch(model: Any, spec: PolicySpec, seqs: Sequences, idx: list[int], pad: int, want_layers: bool):
    import pandas as pd

    from moelab.attribution.capture import capture

    rows = [seqs.prompts[i] + seqs.continuations[i] for i in idx]
    ids, mask = _left_pad(rows, pad)
    B, L = ids.shape
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    starts = [L - len(r) for r in rows]  # first real token of each row
    # the positions whose logits predict continuation token j: start + P + j - 1
    pred = [(r, starts[r] + len(seqs.prompts[i]) + j - 1, j)
            for r, i in enumerate(idx) for j in range(len(seqs.continuations[i]))
            if starts[r] + len(seqs.prompts[i]) + j - 1 >= starts[r]]
    rr = torch.tensor([p[0] for p in pred], dtype=torch.long)
    pp = torch.tensor([p[1] for p in pred], dtype=torch.long)
    # tokens the policy acts on: the continuation's (fed as decode steps in generation)
    act = torch.zeros(B, L, dtype=torch.bool)
    for r, i in enumerate(idx):
        act[r, starts[r] + len(seqs.prompts[i]):] = True
    points = ("moe_out", "resid_post") if want_layers else ()
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}

    with torch.no_grad(), capture(model, points) as base_cap:
        base = model(**kwargs).logits[rr, pp].double()
    stats = _LayerStats(want_layers)
    mgr = forward_hooks(model)
    handles = []
    phase_override = "all" if spec.phase == "decode" else None
    stats.act = act.reshape(-1) if spec.phase == "decode" else None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(spec.make(model, phase_override))
            handles.append(mgr.add("plan", stats.mask, order=MASK_ORDER, name="attribution decode mask"))
            handles.append(mgr.add("output", stats.output, order=Order.OBSERVE, name="attribution layer stats"))
            pol_cap = stack.enter_context(capture(model, points))
            with torch.no_grad():
                pol = model(**kwargs).logits[rr, pp].double()
    finally:
        for h in handles:
            h.remove()

    logp = torch.log_softmax(base, -1)
    logq = torch.log_softmax(pol, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    top_base = base.argmax(-1)
    top_pol = pol.argmax(-1)
    rank = (pol > pol.gather(1, top_base[:, None])).sum(-1)
    target = torch.tensor([seqs.continuations[idx[r]][j] for r, _, j in pred], dtype=torch.long)
    lp_base = logp.gather(1, target[:, None])[:, 0]
    lp_pol = logq.gather(1, target[:, None])[:, 0]
    tokens = pd.DataFrame({
        "seq": [idx[r] for r, _, _ in pred], "index": [j for _, _, j in pred],
        "position": [p - starts[r] for r, p, _ in pred], "token_id": target.numpy(),
        "kl": kl.clamp(min=0).numpy(), "top1_agree": (top_base == top_pol).numpy(), "rank": rank.numpy(),
        "baseline_top": top_base.numpy(), "policy_top": top_pol.numpy(),
        "logprob_baseline": lp_base.numpy(), "logprob_policy": lp_pol.numpy(),
        "nll_delta": (lp_base - lp_pol).numpy(),
        "policy_acts": act[rr, pp].numpy() if spec.phase == "decode" else np.full(len(pred), not spec.identity),
    })
    if not want_layers:
        return tokens, pd.DataFrame()
    flat = rr * L + pp
    parts = []
    nl = len(forward_hooks(model).layers)
    for layer in range(nl):
        mb, mp = base_cap.get("moe_out", layer), pol_cap.get("moe_out", layer)
        rb, rp = base_cap.get("resid_post", layer), pol_cap.get("resid_post", layer)
        st = stats.stats.get(layer)
        part = pd.DataFrame({
            "seq": tokens["seq"].to_numpy(), "index": tokens["index"].to_numpy(), "layer": layer,
            "changed_weight": st["changed_weight"][flat].numpy() if st else 0.0,
            "changed_slots": st["changed_slots"][flat].numpy() if st else 0,
            "moved_norm": st["moved_norm"][flat].numpy() if st else 0.0,
            "moe_delta": (mp[rr, pp] - mb[rr, pp]).norm(dim=-1).numpy(),
            "resid_delta": ((rp[rr, pp] - rb[rr, pp]).norm(dim=-1) / rb[rr, pp].norm(dim=-1).clamp(min=1e-12)).numpy(),
        })
        parts.append(part)
    return tokens, pd.concat(parts, ignore_index=True)


def _free_running(model, spec: PolicySpec, seqs: Sequences, pad: int, eos: set[int], batch_size: int,
                  max_new_tokens: int):
    """Per sequence: the first generated token where the policy's greedy generation leaves the
    baseline's (-1: none within the compared length)."""
    import pandas as pd

    base = seqs.continuations if seqs.source == "generation" else _generate(
        model, seqs.prompts, max_new_tokens, pad, eos, batch_size)
    n = max(1, max(len(c) for c in base))
    with spec.make(model, None):
        pol = _generate(model, seqs.prompts, n, pad, eos, batch_size)
    first = []
    for a, b in zip(base, pol):
        d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), -1)
        if d < 0 and len(a) != len(b):
            d = min(len(a), len(b))
        first.append(d)
    return pd.DataFrame({"seq": range(len(base)), "first_divergence": first,
                         "baseline_len": [len(a) for a in base], "policy_len": [len(b) for b in pol]})


def _meta(model, spec: PolicySpec, seqs: Sequences, batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    import platform

    import transformers

    return {
        "policy": spec.label, "policy_phase": spec.phase, "settings": spec.settings,
        "continuations": seqs.source, "sequences": len(seqs.prompts),
        "tokens": int(sum(len(c) for c in seqs.continuations)),
        "model": getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__,
        "batch_size": batch_size, "max_new_tokens": max_new_tokens,
        "versions": {"moelab": moelab.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }


def compare_many(model: Any, policies: Iterable[Any], prompts: Sequence[str] | None = None, **kwargs: Any
                 ) -> dict[str, Attribution]:
    """:func:`compare` for several policies on the same sequences (built once), by policy label."""
    keys = ("tokenizer", "trace", "task", "limit", "continuations", "max_new_tokens", "batch_size")
    seqs = sequences(model, prompts, **{k: kwargs[k] for k in keys if k in kwargs})
    rest = {k: v for k, v in kwargs.items() if k not in ("trace", "task", "limit", "continuations")}
    out: dict[str, Attribution] = {}
    for p in policies:
        att = compare(model, p, seqs=seqs, **rest)
        out[att.meta["policy"]] = att
    return out
