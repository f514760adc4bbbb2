"""MODEL_CARD.md for a trained tiny model, written from its training summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCH_TEXT = {
    "mixtral": "Mixtral-style (`MixtralForCausalLM`): no shared expert, softmax router, top-k renormalised",
    "qwen2moe": "Qwen2-MoE-style (`Qwen2MoeForCausalLM`): fine-grained routed experts plus one "
    "sigmoid-gated shared expert, `norm_topk_prob=False`",
}


def write_model_card(out_dir: Path, s: dict[str, Any]) -> Path:
    """Write ``out_dir/MODEL_CARD.md`` from an export summary (see ``Trainer.export``)."""
    cfg, shape = s["config"], s["config"]["shape"]
    val = s["validation"]
    size_mb = (out_dir / "model.safetensors").stat().st_size / 1e6
    lines = [
        f"# {s['name']}",
        "",
        "A tiny Mixture-of-Experts language model trained by moelab on its own synthetic tasks",
        "(`moelab.tasks`: `arith`, GSM8K-format word problems; `pycode`, HumanEval-format",
        "function completion). It exists so that routing experiments (deferral, skipping,",
        "predictors, caches) can be judged on a model whose accuracy means something. It knows",
        "nothing else.",
        "",
        "## Architecture",
        "",
        f"- {ARCH_TEXT[shape['arch']]}",
        f"- hidden {shape['hidden_size']}, {shape['num_layers']} layers (all MoE), "
        f"{shape['num_heads']} heads / {shape['num_kv_heads']} KV heads",
        f"- {shape['num_experts']} routed experts per layer, top-{shape['top_k']}, expert "
        f"intermediate {shape['expert_intermediate_size']}"
        + (
            f", shared expert intermediate {shape['shared_expert_intermediate_size']}"
            if shape["shared_expert_intermediate_size"]
            else ""
        ),
        f"- vocabulary {s['vocab_size']} (byte-level BPE trained on the task text, one token per "
        "digit), tied embeddings, RoPE θ=10⁴",
        f"- {s['parameters']:,} parameters, {size_mb:.1f} MB (fp32 safetensors)",
        "",
        "## Training",
        "",
        f"- data: `arith` {cfg['n_train']['arith']:,} + `pycode` {cfg['n_train']['pycode']:,} "
        f"examples of the train split (seed {cfg['seed']}); loss on the answer/solution tokens "
        "and EOS only (the question/prompt is context)",
        "- format: arith context `Question: {question}\\nAnswer:`, target ` {answer}`; pycode "
        "context `prompt`, target `canonical_solution`; each followed by EOS; zero-shot",
        f"- AdamW, peak lr {cfg['lr']}, cosine to {cfg['min_lr_ratio']}×, warm-up "
        f"{cfg['warmup_steps']}, ~{cfg['batch_tokens']} tokens/batch, "
        f"load-balancing loss coefficient {shape['router_aux_loss_coef']}",
        f"- {s['steps']:,} steps, {s['tokens']:,} tokens, {s['train_wall_s'] / 60:.1f} min wall "
        f"on {cfg['threads']} CPU thread(s); final LM loss {s['final_lm_loss']:.3f}",
        f"- reproduce: `moelab train-tiny --model {shape['arch']} --out DIR --max-steps {s['steps']}`"
        + (
            f" (deterministic for a given seed; this model was trained with a wall-time budget,"
            f" `--minutes {s['time_budget_min']:g}`, on a shared CPU: the measured speed chose the"
            " step count and stretched the cosine schedule while training, so a rerun matches"
            " its length and data, not its weights bit for bit)"
            if s.get("time_budget_min")
            else " (deterministic for a given seed)"
        ),
        *(f"- note: {n}" for n in s.get("notes", [])),
        "",
        "## Accuracy (greedy decoding, `moelab.training.quick_eval`)",
        "",
        "| split | arith exact match (strict `#### N`) | pycode pass@1 |",
        "|---|---|---|",
        f"| validation | {val['arith_exact_match']:.1%} (n={val['arith_n']}) "
        f"| {val['pycode_pass@1']:.1%} (n={val['pycode_n']}) |",
    ]
    if s.get("test"):
        t = s["test"]
        lines.append(
            f"| test | {t['arith_exact_match']:.1%} (n={t['arith_n']}) "
            f"| {t['pycode_pass@1']:.1%} (n={t['pycode_n']}) |"
        )
    lines += [
        "",
        "lm-eval numbers on the test split: to be added by the evaluation suite.",
        "",
        "## Routing statistics",
        "",
        "Per-layer expert load: share of the top-k assignments each expert receives on",
        "validation text (200 arith + 100 pycode examples, all tokens). Uniform share is "
        f"{1 / shape['num_experts']:.3f}; entropy is normalised to 1 for uniform load.",
        "",
        "| layer | min share | max share | unused experts | entropy |",
        "|---|---|---|---|---|",
    ]
    for r in s["expert_load_summary"]:
        lines.append(
            f"| {r['layer']} | {r['min_share']:.3f} | {r['max_share']:.3f} | {r['unused']} "
            f"| {r['entropy']:.3f} |"
        )
    lines += [
        "",
        "Raw counts per layer and expert: `training_summary.json` (`expert_load`).",
        "",
    ]
    path = out_dir / "MODEL_CARD.md"
    path.write_text("\n".join(lines))
    return path
