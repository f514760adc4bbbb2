"""Rough edges found by trying moelab as a new user (issue 17): each gets a clear error or does
what its help says, instead of a traceback, an empty result or noise."""

from __future__ import annotations

import pytest

from moelab.cli import main
from moelab.errors import MoelabError


def test_generate_with_an_empty_prompt_is_a_one_line_error(capsys):
    assert main(["generate", "--model", "tiny-random-mixtral", "--prompt", "", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab: error: prompt '' encodes to no tokens") and "Traceback" not in err


def test_demo_refuses_unknown_sections_before_doing_any_work(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["demo", "--sections", "foo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown report section 'foo'" in err and "routing" in err
    assert not out.exists()
    assert main(["demo", "--sections", ",", "--out", str(out)]) == 2
    assert "no report sections selected" in capsys.readouterr().err


def test_build_report_refuses_unknown_sections(tmp_path):
    from moelab.report import ReportContext, build_report

    ctx = ReportContext(model=None, tokenizer=None, model_name="m", trace=None, workdir=tmp_path)
    with pytest.raises(MoelabError, match="unknown report section 'rooting'.*Did you mean 'routing'"):
        build_report(ctx, tmp_path / "r.html", sections=["rooting"])
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("layer", [10, -1, 4])
def test_cache_access_to_a_layer_out_of_range_names_the_range(layer):
    from moelab.caches import make_cache

    cache = make_cache("lru", num_experts=[8] * 4, capacity=2)
    with pytest.raises(MoelabError, match=rf"MoE layer {layer} out of range: this cache has 4 MoE layers \(ordinals 0..3\)"):
        cache.access(layer, [0, 1])
    with pytest.raises(MoelabError, match="out of range"):
        cache.contents(layer)
    assert cache.access(3, [0, 1]) == [False, False]


@pytest.mark.parametrize("arg", ["policies", "capacities", "scopes", "prefetch"])
def test_sweep_with_nothing_to_sweep_is_refused(arg):
    from moelab.caches import stream_from_groups, sweep

    stream = stream_from_groups([(0, [0, 1]), (1, [2])], num_experts=[4, 4], top_k=[2, 2])
    with pytest.raises(MoelabError, match=rf"sweep\({arg}=\(\)\): expected a non-empty sequence"):
        sweep(stream, **{arg: ()})


def test_cache_scope_both_means_layer_and_global(tmp_path, capsys):
    from moelab.cli.cache import parse_scopes

    assert parse_scopes("both") == ["layer", "global"] == parse_scopes("layer,both")
    assert parse_scopes("global") == ["global"]
    with pytest.raises(MoelabError, match="unknown cache scope 'layr'"):
        parse_scopes("layr")
    # the CLI accepts it (the error is about the missing trace, which is read after the flags)
    assert main(["cache", "simulate", "--trace", str(tmp_path / "none"), "--scope", "both"]) == 2
    err = capsys.readouterr().err
    assert "unknown cache scope" not in err and "does not exist" in err


def test_predict_link_bandwidth_flag_matches_cache_and_keeps_the_old_spelling(capsys):
    from moelab.cli import build_parser

    parser = build_parser()
    base = ["predict", "eval", "--trace", "t", "--predictor", "p"]
    assert parser.parse_args([*base, "--link-gbps", "25"]).link_gbs == 25.0
    assert "deprecated" not in capsys.readouterr().err
    assert parser.parse_args([*base, "--link-gbs", "12.5"]).link_gbs == 12.5
    assert "--link-gbs is deprecated; use --link-gbps" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluate_outside_a_git_repository_prints_no_git_error(tmp_path, monkeypatch, capfd):
    from moelab import load
    from moelab.evals import evaluate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    model, tok = load("tiny-random-mixtral")
    result = evaluate(model, tok, tasks=["arith"], limit=1, max_gen_toks=2)
    captured = capfd.readouterr()
    assert result.tasks["arith"].n_docs == 1
    assert "fatal" not in captured.err and "not a git repository" not in captured.err
    # lm-eval's request-building bar is gone; its generation bar is transient (leave=False)
    bars = [seg for seg in captured.err.replace("\n", "\r").split("\r") if "it/s]" in seg]
    assert bars and all(seg.startswith("Running generate_until requests") for seg in bars), bars
    assert captured.err.rstrip(" ").endswith("\r"), "the generation bar is cleared when done"


def test_quick_eval_shows_progress(capsys):
    from moelab import load
    from moelab.training.quick_eval import quick_eval

    model, tok = load("moelab-tiny-mixtral")
    res = quick_eval(model, tok, split="validation", n={"arith": 1, "pycode": 1}, progress=True)
    assert res["arith"]["n"] == 1 and res["pycode"]["n"] == 1
    err = capsys.readouterr().err
    assert "eval arith" in err and "eval pycode" in err


def test_trainer_export_runs_its_final_validation_with_a_progress_bar(tmp_path, monkeypatch):
    from test_training import _tiny_config

    from moelab.training import trainer as trainer_mod

    calls = []

    def fake_quick_eval(model, tokenizer, **kwargs):
        calls.append(kwargs)
        return {"arith": {"exact_match": 0.0, "n": 1}, "pycode": {"pass@1": 0.0, "n": 1, "isolation": "namespaces"}}

    monkeypatch.setattr(trainer_mod, "quick_eval", fake_quick_eval)
    t = trainer_mod.Trainer(_tiny_config(), tmp_path / "ckpt", progress=True)
    t.run(max_steps=1)
    t.export(tmp_path / "out", final_eval_n={"arith": 1, "pycode": 1})
    assert calls and calls[-1]["progress"] is True



def test_readme_task_manager_snippet_names_moelab_task_folder():
    """The README's inline ``TaskManager(include_path=...)`` argument (now on the reference page
    docs/reference/lm-eval.md), run in a fresh interpreter (``moelab._resources`` was not an
    attribute of a freshly imported ``moelab``)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "lm-eval.md").read_text()
    arg = re.search(r"`TaskManager\(include_path=(.+?)\)`", readme).group(1)
    code = f"import moelab, pathlib\np = pathlib.Path({arg})\nprint(sorted(f.name for f in p.glob('*.yaml')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "arith.yaml" in proc.stdout and "gsm8k_local.yaml" in proc.stdout
