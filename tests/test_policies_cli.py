"""Policies on the command line and inside lm-eval: generate, eval flags, compare-policies."""

from __future__ import annotations

import json

import pytest

from moelab.cli import main
from moelab.policies import ExpertDeferral

GEN = ["generate", "--model", "tiny-random-mixtral", "--prompt", "Hello", "--max-new-tokens", "5", "--json"]


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_generate_json_has_text_and_token_ids_and_zero_deferral_is_exact(capsys):
    assert main(GEN) == 0
    base = _json(capsys)
    assert len(base["token_ids"]) == 5 and isinstance(base["text"], str) and base["policy"] is None
    assert main([*GEN, "--deferred", "0"]) == 0
    assert _json(capsys)["token_ids"] == base["token_ids"]
    assert main([*GEN, "--deferred", "1", "--min-immediate", "1"]) == 0
    out = _json(capsys)
    assert out["policy"] == {"policy": "deferral", "deferred": 1, "phase": "decode", "min_immediate": 1}
    assert main([*GEN, "--skipped", "1", "--renormalize"]) == 0
    assert _json(capsys)["policy"]["policy"] == "skipping"


def test_generate_setting_that_does_not_fit_is_a_one_line_error(capsys):
    assert main([*GEN, "--deferred", "1"]) == 2  # mixtral top-2: 1 immediate < min_immediate 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MoE layer 0" in err and "min_immediate=2" in err


def test_deferred_and_skipped_are_mutually_exclusive():
    with pytest.raises(SystemExit) as exc:
        main([*GEN, "--deferred", "1", "--skipped", "1"])
    assert exc.value.code == 2


class CountingDeferral(ExpertDeferral):
    """Counts the layer plans it is asked for, by phase."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = {"prefill": 0, "decode": 0}

    def _plan(self, plan):
        self.calls[plan.phase] += 1
        super()._plan(plan)


@pytest.mark.slow
def test_deferral_acts_in_decode_steps_inside_lm_eval_scoring():
    from moelab import load
    from moelab.evals import evaluate

    model, tok = load("tiny-random-qwen2_moe")
    policy = CountingDeferral(model, 2)
    with policy:
        result = evaluate(model, tok, ["arith"], limit=1, max_gen_toks=4)
    assert result.tasks["arith"].n_docs == 1
    assert policy.calls["decode"] > 0 and policy.calls["prefill"] == 0


@pytest.mark.slow
def test_eval_cli_accepts_policy_flags(capsys):
    args = ["eval", "--model", "tiny-random-qwen2_moe", "--tasks", "arith", "--limit", "1", "--max-gen-toks", "4",
            "--json"]
    assert main([*args, "--deferred", "2", "--policy-phase", "all"]) == 0
    assert _json(capsys)["tasks"]["arith"]["n_docs"] == 1
    assert main([*args, "--skipped", "1"]) == 0


@pytest.mark.slow
def test_compare_policies_table_json_and_heatmap(tmp_path, capsys):
    html = tmp_path / "cmp.html"
    assert main(["compare-policies", "--model", "tiny-random-qwen2_moe", "--tasks", "arith", "--limit", "1",
                 "--deferred", "0,2", "--skipped", "0,4", "--max-gen-toks", "4", "--html", str(html), "--json"]) == 0
    out = _json(capsys)
    cells = {(p["policy"], p["n"]) for p in out["points"]}
    assert cells == {("deferral", 0), ("deferral", 2), ("skipping", 0), ("skipping", 4)}
    assert html.read_text().count("plotly") > 10 and "Heatmap".lower() in html.read_text().lower()
    assert main(["compare-policies", "--model", "tiny-random-qwen2_moe", "--tasks", "arith", "--limit", "1",
                 "--deferred", "0", "--skipped", "0", "--max-gen-toks", "4"]) == 0
    assert "n=0" in capsys.readouterr().out


def test_compare_policies_refuses_a_count_beyond_top_k_before_scoring(capsys):
    assert main(["compare-policies", "--model", "tiny-random-qwen2_moe", "--tasks", "arith", "--limit", "1",
                 "--deferred", "0,5"]) == 2
    assert "only 4 routed experts" in capsys.readouterr().err
