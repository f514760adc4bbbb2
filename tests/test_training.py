"""Tiny-model training: data masking, deterministic batches, atomic checkpoints, resume,
the subprocess code checker, and the bundled trained models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelab.errors import MoelabError
from moelab.models.bundled import bundled_models
from moelab.training import ModelShape, TrainConfig, Trainer, preset
from moelab.training.checkpoint import load_checkpoint, save_checkpoint
from moelab.training.data import IGNORE, Encoded, batch_stream, collate
from moelab.training.quick_eval import run_check

BUNDLED = ("moelab-tiny-mixtral", "moelab-tiny-qwen2moe")


def _tiny_config(arch: str = "mixtral") -> TrainConfig:
    return TrainConfig(
        name=f"test-{arch}",
        shape=ModelShape(
            arch=arch,  # type: ignore[arg-type]
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            num_experts=4,
            top_k=2,
            expert_intermediate_size=32,
            shared_expert_intermediate_size=32 if arch == "qwen2moe" else 0,
        ),
        vocab_size=300,
        n_train={"arith": 120, "pycode": 60},
        batch_tokens=1024,
        warmup_steps=2,
        max_steps=6,
        threads=1,
        checkpoint_every_s=1e9,
        eval_every_s=1e9,
    )


def test_collate_puts_loss_on_target_tokens_only():
    batch = collate([Encoded([5, 6, 7, 8], 2, "arith"), Encoded([5, 9, 2], 1, "pycode")])
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 7, 8], [IGNORE, 9, 2, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_batch_stream_is_deterministic_and_resumes_at_a_step():
    data = [Encoded(list(range(3, 3 + n % 17 + 2)), 1, "arith") for n in range(200)]
    full = batch_stream(data, 64, seed=1)
    first = [next(full)["input_ids"] for _ in range(40)]
    again = batch_stream(data, 64, seed=1, start_step=25)
    for want in first[25:]:
        assert torch.equal(next(again)["input_ids"], want)


def test_checkpoint_write_is_atomic(tmp_path):
    save_checkpoint({"a": torch.ones(3)}, tmp_path)
    save_checkpoint({"a": torch.zeros(3)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert torch.equal(load_checkpoint(tmp_path)["a"], torch.zeros(3))
    assert load_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_training_resumes_where_the_checkpoint_left_off(tmp_path, arch):
    cfg = _tiny_config(arch)
    straight = Trainer(cfg, tmp_path / "a", progress=False)
    straight.run()
    losses = [h[1] for h in straight.state["history"]]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))

    first = Trainer(cfg, tmp_path / "b", progress=False)
    first.run(max_steps=3)
    resumed = Trainer(cfg, tmp_path / "b", resume=True, progress=False)
    resumed.setup()
    assert resumed.state["step"] == 3
    for k, v in first.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    resumed.run()
    assert resumed.state["step"] == 6
    assert [h[1] for h in resumed.state["history"]] == pytest.approx(losses, rel=1e-4, abs=1e-4)

    extended = Trainer(cfg, tmp_path / "a", resume=True, progress=False, max_steps=8)
    extended.run()
    assert extended.state["step"] == 8 and len(extended.state["history"]) == 8


def test_refuses_to_overwrite_a_checkpoint_without_resume(tmp_path):
    from moelab.errors import MoelabError

    cfg = _tiny_config()
    Trainer(cfg, tmp_path, progress=False).run(max_steps=1)
    with pytest.raises(MoelabError, match="--resume"):
        Trainer(cfg, tmp_path, progress=False).setup()


def test_presets_match_the_bundled_architectures():
    assert preset("mixtral").shape.shared_expert_intermediate_size == 0
    q = preset("qwen2moe").shape
    assert q.shared_expert_intermediate_size > 0 and q.num_experts >= 32 and q.top_k >= 6
    with pytest.raises(Exception, match="mixtral"):
        preset("mixtrall")


def test_run_check_runs_code_in_a_subprocess_with_timeout():
    assert run_check("x = 1 + 1\n", "assert x == 2\n")
    assert not run_check("x = 1 + 1\n", "assert x == 3\n")
    assert not run_check("while True:\n    pass\n", "pass\n", timeout=1.0)
    # no tests: refused (a program's own "I ran to the end" can be faked)
    with pytest.raises(MoelabError, match="run_check needs tests"):
        run_check("assert 1 + 1 == 2\n")
    # candidate and tests apart (the scoring path): the verdict is the tests'
    assert run_check("def f(x):\n    return x + 1\n", "assert f(1) == 2\n")
    assert not run_check("def f(x):\n    return x\n", "assert f(1) == 2\n")
    assert not run_check("import os\nprint('ok')\nos._exit(0)\n", "assert f(1) == 2\n")


def test_quick_eval_pycode_scores_in_the_sandbox_and_records_its_level(monkeypatch):
    """Canonical completions pass, forged ones (early exit, always-equal objects) fail."""
    from moelab.evals.sandbox import available_isolation
    from moelab.tasks import generate
    from moelab.training import quick_eval

    examples = generate("pycode", "validation", n=4, seed=0)
    forged = [
        "    import os\n    os._exit(0)\n",
        "    class E:\n        def __eq__(self, o):\n            return True\n    return E()\n",
    ]
    answers = [ex["canonical_solution"] for ex in examples[:2]] + forged
    monkeypatch.setattr(quick_eval, "greedy_complete", lambda m, t, ctx, n, **kw: list(answers))
    res = quick_eval.eval_pycode(None, None, examples, timeout=30.0)
    assert res["pass@1"] == 0.5 and res["n"] == 4
    assert res["isolation"] == available_isolation()


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_model_loads_with_plain_transformers_and_uses_every_expert(name):
    path = bundled_models().get(name)
    assert path is not None, f"bundled model {name} must ship in moelab/bundled (train it: moelab train-tiny)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.tokenize("123") == ["1", "2", "3"]
    assert (path / "MODEL_CARD.md").is_file()
    assert (path / "model.safetensors").stat().st_size <= 20_000_000
    summary = json.loads((path / "training_summary.json").read_text())
    for layer in summary["expert_load"]:
        assert min(layer) > 0
    prompt = "Question: Ava has 5 apples. Ava finds 3 more apples. How many apples does Ava have now?\nAnswer:"
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=60, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "####" in text


def test_bundled_model_dirs_have_no_stray_files():
    for path in bundled_models().values():
        if path.name not in BUNDLED:
            continue
        names = {p.name for p in Path(path).iterdir()}
        assert {"config.json", "model.safetensors", "MODEL_CARD.md", "tokenizer.json"} <= names
        assert not any(n.endswith((".pt", ".tmp")) for n in names)
