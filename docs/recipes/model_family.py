"""Recipe: add a model family (FlexOlmo: a transformers MoE family moelab does not ship)."""

import torch
from transformers import AutoModelForCausalLM, FlexOlmoConfig

import moelab
from moelab.adapters import FamilyAdapter, RouterSpec, register_adapter
from moelab.forward import hooks


class FlexOlmoAdapter(FamilyAdapter):
    """Per family: the router's attribute (``router_attr``, default ``"gate"``), the shared
    experts (``shared_attr``; none here) and how router logits become the top-k weights."""

    def router_spec(self, config, router) -> RouterSpec:  # softmax, top-k, renormalised if asked
        return RouterSpec(scoring="softmax", renormalize=bool(getattr(router, "norm_topk_prob", False)))


register_adapter(FlexOlmoAdapter("flex_olmo"))  # keyed by config.model_type

config = FlexOlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = AutoModelForCausalLM.from_config(config).eval()  # tiny and random: nothing downloaded
print([(layer.name, layer.num_experts, layer.top_k) for layer in moelab.moe_layers(model)])


def check(ctx, layer, call):  # the spec must reproduce the weights the model's router applied
    w = call.logits.float().softmax(-1).gather(1, call.experts)
    w = w / w.sum(-1, keepdim=True) if layer.spec.renormalize else w
    assert torch.allclose(w, call.weights.float(), atol=1e-6), f"{layer.name}: RouterSpec is wrong"


prompt = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
with hooks(model, router=check), moelab.record(model, model_name="tiny-flex-olmo") as rec:
    model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
print(rec.trace.expert_load(phase="decode"))  # (MoE layers, E) decode-step selection counts
