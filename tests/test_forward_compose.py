"""Every component on one forward context: recorder + deferral + an online learned predictor +
the moelab kernels in one ``generate``, on all 10 families, checked against references that
use none of moelab's forward code.

* logits: the slow, hand-written deferral reference of tests/test_policies_parity.py, fed
  the generated tokens step by step (prefill unmodified, decode steps deferred);
* trace: plain torch forward hooks on the routers, registered by this test, capture what
  the routers produced in the same ``generate``; the trace must hold exactly those rows
  (real tokens only);
* predictor: its online callbacks must equal ``predict`` on the router inputs those hooks
  captured, for the real tokens only.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import moelab
from moelab.adapters import moe_layers
from moelab.compat import cache_kwargs, output_cache, router_outputs
from moelab.errors import MoelabError
from moelab.forward import Order, forward_hooks, hooks, use_backend
from moelab.models.tiny import FAMILIES, build_tiny
from moelab.policies import ExpertDeferral
from moelab.predictors import attach, make_predictor
from tests.test_policies_lifecycle import assert_same_state, snapshot
from tests.test_policies_parity import TOL, Reference, RefSettings

pytestmark = pytest.mark.xdist_group("forward_compose")


def _prompts(B=2, S=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :2] = 0  # row 1 is left-padded
    ids[1, :2] = 0
    return ids, mask


def _fit_predictor(model, family, tmp):
    with moelab.record(model, tmp / "fit", hidden_states=True, hidden_dtype="float32",
                       model_name=f"tiny-{family}") as rec:
        for i in range(4):
            g = torch.Generator().manual_seed(100 + i)
            model.generate(torch.randint(3, 250, (1, 6), generator=g), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
    return make_predictor("learned", distance=1, progress=False, max_epochs=2, width=16).fit(rec.trace)


class RouterTap:
    """Plain torch hooks (not moelab.forward) capturing every router call of the outer forwards."""

    def __init__(self, model):
        self.layers = moe_layers(model)
        self.calls: list[list[tuple]] = []  # per forward: (moe layer, hidden, weights, experts)
        self.masks: list[torch.Tensor] = []
        self._handles = []
        top = model.base_model

        def pre(module, args, kwargs):
            self.calls.append([])
            ids = kwargs.get("input_ids", args[0] if args else None)
            m = kwargs.get("attention_mask")
            S = ids.shape[1]
            self.masks.append(m[:, -S:].bool().reshape(-1) if m is not None else torch.ones(ids.numel(), dtype=bool))

        self._handles.append(top.register_forward_pre_hook(pre, with_kwargs=True))
        for layer in self.layers:
            def hook(module, args, output, layer=layer):
                _, weights, ids = router_outputs(output)  # either order transformers 5.x emits
                self.calls[-1].append((layer.index, args[0].detach().clone(), weights.detach().clone(),
                                       ids.detach().clone()))
            self._handles.append(layer.router.register_forward_hook(hook))

    def remove(self):
        for h in self._handles:
            h.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_recorder_deferral_predictor_and_kernels_in_one_generate(family, tmp_path):
    pytest.importorskip("moelab.kernels.op")
    model = build_tiny(family, seed=0)
    predictor = _fit_predictor(model, family, tmp_path)
    before = snapshot(model)
    ids, mask = _prompts()
    seen: list[tuple[int, int, np.ndarray]] = []
    tap = RouterTap(model)
    try:
        with (
            moelab.record(model, tmp_path / "t", model_name=f"tiny-{family}") as rec,
            ExpertDeferral(model, 1, min_immediate=1),
            attach(model, predictor, lambda s, t, e: seen.append((s, t, e.copy()))),
            use_backend(model, "moelab"),
        ):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    finally:
        tap.remove()
    assert_same_state(before, snapshot(model))
    assert forward_hooks(model, create=False) is None

    # --- logits against the slow reference, teacher-forced on the generated tokens
    layers = moe_layers(model)
    per_layer = [1] * (len(layers) - 1) + [0]
    ref = Reference(model, RefSettings(deferred=per_layer))
    seqs = out.sequences
    S = ids.shape[1]
    with torch.no_grad():
        with ref.active(False):
            r = model(ids, attention_mask=mask, use_cache=True)
        ref_logits = [r.logits[:, -1]]
        past, m = output_cache(r), mask
        for i in range(len(out.logits) - 1):
            nxt = seqs[:, S + i: S + i + 1]
            m = torch.cat([m, torch.ones_like(nxt)], dim=1)
            with ref.active(True):
                r = model(nxt, attention_mask=m, **cache_kwargs(past), use_cache=True)
            past = output_cache(r)
            ref_logits.append(r.logits[:, -1])
    for step, (got, want) in enumerate(zip(out.logits, ref_logits, strict=True)):
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float32], msg=f"step {step}")

    # --- the trace holds exactly what the routers produced, real tokens only
    df = rec.trace.to_pandas()
    for fwd, (calls, valid) in enumerate(zip(tap.calls, tap.masks, strict=True)):
        rows = df[df["step"] == fwd]
        for moe, _, w, e in calls:
            got = rows[rows["moe_layer"] == moe]
            order = torch.argsort(w.float(), dim=-1, descending=True, stable=True)
            want = e.gather(1, order)[valid].tolist()
            assert [list(x) for x in got["experts"]] == want, (family, fwd, moe)

    # --- the predictor saw real tokens only, and predicted what predict() gives on them
    online: dict[tuple[int, int], np.ndarray] = {}
    per_source = {s: 0 for s in predictor.source_layers()}
    for s, t, e in seen:
        assert t == s + 1
        online[(per_source[s], s)] = e
        per_source[s] += 1
    for fwd, (calls, valid) in enumerate(zip(tap.calls, tap.masks, strict=True)):
        for moe, hidden, _, _ in calls:
            if moe not in per_source:
                continue
            want = predictor.predict(moe, hidden=hidden.reshape(-1, hidden.shape[-1])[valid])
            assert np.array_equal(online[(fwd, moe)], want), (family, fwd, moe)


@pytest.fixture(scope="module")
def qwen():
    return build_tiny("qwen2_moe", seed=0)


def test_a_handler_that_raises_leaves_the_model_exactly_as_it_was(qwen):
    before = snapshot(qwen)
    ids, mask = _prompts()
    want = qwen(ids, attention_mask=mask).logits

    def boom(ctx, layer, call):
        if layer.index == 1:
            raise RuntimeError("handler failed")

    for point in ("router", "plan", "experts"):
        with (
            pytest.raises(RuntimeError, match="handler failed"),
            ExpertDeferral(qwen, 1, min_immediate=1, phase="all"),
            hooks(qwen, **{point: boom}),
        ):
            qwen(ids, attention_mask=mask)
        assert_same_state(before, snapshot(qwen))
        assert forward_hooks(qwen, create=False) is None
    torch.testing.assert_close(qwen(ids, attention_mask=mask).logits, want, rtol=0, atol=0)


def test_handlers_run_by_order_not_registration(qwen):
    ran: list[str] = []
    mgr = forward_hooks(qwen)
    late = mgr.add("plan", lambda ctx, layer, call: ran.append("observe"), order=Order.OBSERVE)
    early = mgr.add("plan", lambda ctx, layer, call: ran.append("routing"), order=Order.ROUTING)
    try:
        qwen(_prompts()[0])
    finally:
        late.remove()
        early.remove()
    assert ran[:2] == ["routing", "observe"] and len(ran) == 2 * len(moe_layers(qwen))


def test_context_is_computed_once_per_forward_with_sequences_steps_and_padding(qwen):
    got = []
    with hooks(qwen, forward=lambda ctx: got.append(ctx)):
        ids, mask = _prompts()
        qwen.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert [c.phase for c in got] == ["prefill", "decode", "decode"]
    assert [c.step for c in got] == [0, 1, 2] and [c.starts_sequences for c in got] == [True, False, False]
    assert all(c.seq.tolist() == [0, 1] for c in got)
    assert got[0].mask_cpu[1].tolist() == [False, False, True, True, True]
    assert got[0].positions[1, 2:].tolist() == [0, 1, 2] and got[1].positions[:, 0].tolist() == [5, 3]
    assert got[1].valid() is None  # decode steps: every token real


def test_bad_registrations_are_refused(qwen):
    mgr = forward_hooks(qwen)
    try:
        with pytest.raises(MoelabError, match="unknown forward point 'routr'.*'router'"):
            mgr.add("routr", lambda *a: None)
        with pytest.raises(MoelabError, match=r"MoE layer\(s\) \[99\] do not exist"):
            mgr.add("router", lambda *a: None, layers=[99])
    finally:
        if mgr.empty:
            mgr._refresh()
    assert forward_hooks(qwen, create=False) is None


def test_no_handlers_means_no_hooks_and_bit_identical_outputs(qwen):
    ids, mask = _prompts()
    want = qwen(ids, attention_mask=mask).logits
    with contextlib.ExitStack() as stack:
        stack.enter_context(hooks(qwen, output=lambda ctx, layer, call, out: None))
        torch.testing.assert_close(qwen(ids, attention_mask=mask).logits, want, rtol=0, atol=0)
    assert all("forward" not in m.__dict__ for m in qwen.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in qwen.modules())
