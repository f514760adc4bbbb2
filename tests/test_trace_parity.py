"""Recorded routes equal what the routers produced, for every family (prefill and decode).

The reference is collected with plain forward hooks on the router modules, found by
name and class here, independently of moelab's adapters and recorder.
"""

import re

import numpy as np
import pytest
import torch

from moelab.cli import main
from moelab.models.tiny import FAMILIES
from moelab.trace import open_trace

PROMPTS = ["Hello MoE", "def f(x): return", "2 + 3 ="]
NEW_TOKENS = 4


def _independent_routes(model_dir, prompts):
    """(seq, step, pos, decoder layer) -> sorted expert ids, from raw router hooks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    routers = {}
    for name, mod in model.named_modules():
        m = re.search(r"layers\.(\d+)\.[a-z_]+\.(gate|router)$", name)
        if m and "Router" in type(mod).__name__:
            routers[int(m.group(1))] = mod
    assert routers, "no router modules found"
    calls = []

    def hook(layer):
        # the expert ids are the integer tensor of the triple (granitemoe before 5.2x put them first)
        return lambda mod, args, out: calls.append(
            (layer, next(t for t in out if not t.is_floating_point()).detach().clone()))

    handles = [mod.register_forward_hook(hook(layer)) for layer, mod in routers.items()]
    routes = {}
    try:
        for seq, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt").input_ids
            n = ids.shape[1]
            calls.clear()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
            # calls arrive per forward, layer by layer; forward f covers positions [start, start+T)
            per_layer_count = {}
            for layer, idx in calls:
                f = per_layer_count.get(layer, 0)
                per_layer_count[layer] = f + 1
                start = 0 if f == 0 else n + f - 1
                for t in range(idx.shape[0]):
                    routes[(seq, f, start + t, layer)] = sorted(idx[t].tolist())
    finally:
        for h in handles:
            h.remove()
    return routes, sorted(routers)


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_trace_of_saved_model_matches_router_hooks(family, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(family)
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS))
    out = tmp_path / "trace"
    rc = main(["trace", "--model", str(model_dir), "--prompts", str(prompts_file),
               "--max-new-tokens", str(NEW_TOKENS), "--out", str(out)])
    assert rc == 0
    trace = open_trace(out)
    expected, moe_layer_idx = _independent_routes(model_dir, PROMPTS)
    assert trace.moe_layers == moe_layer_idx

    experts = trace.experts_array()
    got = {
        (int(s), int(st), int(p), int(layer)): sorted(experts[i].tolist())
        for i, (s, st, p, layer) in enumerate(zip(trace.column("seq"), trace.column("step"),
                                                  trace.column("pos"), trace.column("layer")))
    }
    assert got == expected
    phases = trace.column("phase")
    steps = trace.column("step")
    assert set(phases[steps == 0]) == {"prefill"} and set(phases[steps > 0]) == {"decode"}
    # every decode forward of the reference is recorded (generation may stop early at EOS)
    assert (phases == "decode").sum() == sum(1 for key in expected if key[1] > 0) > 0
    # weights are sorted descending and sum like the family's router says
    w = trace.weights_array()
    assert np.all(w[:, :-1] >= w[:, 1:])
