"""Defaults that would silently measure the wrong thing (issue 17): padding side, prompt
format, generation caps, prompt truncation, cache units, accuracy without uncertainty."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import moelab
from moelab.models.bundled import bundled_models

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = sorted(bundled_models())
needs_bundled = pytest.mark.skipif(not BUNDLED, reason="no bundled models in this checkout")


# --- 1. decoder-only models pad on the left ------------------------------------------


@needs_bundled
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_tokenizer_files_pad_left_within_the_models_context(name):
    d = ROOT / "moelab" / "bundled" / name
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    ctx = json.loads((d / "config.json").read_text())["max_position_embeddings"]
    assert tok_cfg.get("padding_side") == "left"
    assert tok_cfg.get("model_max_length") == ctx


@needs_bundled
@pytest.mark.parametrize("name", BUNDLED)
def test_batched_greedy_generation_equals_single_prompt_generation(name):
    from moelab.tasks import generate, prompt_and_target

    model, tok = moelab.load(name)
    # prompts of very different lengths, so the short ones are padded
    prompts = [prompt_and_target("arith", generate("arith", "test", n=1)[0])[0], "def f(x):\n", "Question:"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert len(set(enc["attention_mask"].sum(1).tolist())) == 3
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    batched = out[:, enc["input_ids"].shape[1] :].tolist()
    for prompt, row in zip(prompts, batched):
        single_enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            single = model.generate(**single_enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert row == single[0, single_enc["input_ids"].shape[1] :].tolist(), prompt
    assert tok.padding_side == "left"
    assert tok.model_max_length == model.config.max_position_embeddings


def test_load_makes_a_given_right_padding_tokenizer_pad_left(caplog):
    from moelab.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    tok.padding_side = "right"
    tok.model_max_length = 4096
    with caplog.at_level(logging.WARNING, logger="moelab"):
        model, tok2 = moelab.load("tiny-random-mixtral", tokenizer=tok)
    assert tok2.padding_side == "left" and tok2.model_max_length == 256
    assert "left padding" in caplog.text and "4096" in caplog.text


@needs_bundled
def test_trace_prompts_pads_left_even_with_a_right_padding_tokenizer(tmp_path):
    from moelab.prompts import task_prompts
    from moelab.trace.run import trace_prompts

    model, tok = moelab.load(BUNDLED[0])
    prompts = [task_prompts("arith", 1)[0], "def f(x):\n"]
    tok.padding_side = "right"
    batched = trace_prompts(model, tok, prompts, tmp_path / "b", max_new_tokens=4, batch_size=2, progress=False)
    single = trace_prompts(model, tok, prompts, tmp_path / "s", max_new_tokens=4, batch_size=1, progress=False)
    cols = ["step", "pos", "token_id", "moe_layer"]
    b = batched.to_pandas().sort_values(["seq", *cols]).reset_index(drop=True)
    s = single.to_pandas().sort_values(["seq", *cols]).reset_index(drop=True)
    assert b[cols].equals(s[cols])
    assert [list(x) for x in b["experts"]] == [list(x) for x in s["experts"]]


# --- 2. task prompt sources use the evaluated format ---------------------------------


@pytest.mark.parametrize("task", ["arith", "pycode"])
def test_task_prompt_sources_render_the_lm_eval_doc_to_text(task):
    import jinja2
    import yaml

    from moelab.prompts import task_prompts
    from moelab.tasks import generate

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # !function tags
    spec = yaml.load((ROOT / "evals" / f"{task}.yaml").read_text(), Loader=_Loader)
    template = jinja2.Template(spec["doc_to_text"], keep_trailing_newline=True)
    expected = [template.render(**doc) for doc in generate(task, "test", n=3)]
    assert task_prompts(task, 3) == expected
    if task == "arith":
        assert expected[0].startswith("Question: ") and expected[0].endswith("\nAnswer:")


def test_jsonl_prompts_can_hold_newlines(tmp_path):
    from moelab.prompts import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Question: 1 + 1?\nAnswer:"}) + "\n")
    assert read_prompts(f) == ["Question: 1 + 1?\nAnswer:"]


def test_demo_default_prompts_are_in_the_task_format():
    from moelab.demo import _default_prompts

    prompts = _default_prompts(quick=True)
    assert any(p.startswith("Question: ") and p.endswith("\nAnswer:") for p in prompts)
