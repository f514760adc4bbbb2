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


# --- 3. generation caps come from the task; a capped run warns -------------------------

def _notebook_cells(name: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.slow
@needs_bundled
def test_notebook_02_deferral_vs_skipping_accuracies_are_not_all_zero():
    # the notebook's own code: its set-up cell and its accuracy cell, as written
    cells = _notebook_cells("02_expert_deferral.ipynb")
    setup = next(c for c in cells if "moelab.load(" in c)
    scoring = next(c for c in cells if "compare_policies(" in c)
    ns: dict = {}
    exec(setup, ns)  # noqa: S102 - the repository's own notebook
    real, seen = ns["compare_policies"], {}

    def spy(*args, **kwargs):  # the notebook's call, as written; its settings recorded
        seen.update(kwargs)
        return real(*args, **kwargs)

    ns["compare_policies"] = spy
    exec(scoring, ns)  # noqa: S102
    cmp = ns["cmp"]
    assert "max_gen_toks" not in seen  # the cap stays the task's own (256), never a shorter one
    assert seen["deferred"] == seen["skipped"] == [0, ns["top_k"] // 2]
    assert {p.policy for p in cmp.points} == {"deferral", "skipping"}
    assert any(p.score > 0 for p in cmp.points), cmp.table()


@needs_bundled
def test_answers_cut_by_the_generation_cap_are_reported(caplog):
    from moelab.evals import evaluate

    model, tok = moelab.load(BUNDLED[0])
    with caplog.at_level(logging.WARNING, logger="moelab"):
        result = evaluate(model, tok, tasks=["arith"], limit=2, max_gen_toks=16, batch_size=2)
    assert "2 of 2 answers were cut off at the 16-token generation cap" in caplog.text
    assert any("16-token generation cap" in n for n in result.tasks["arith"].notes)


def test_demo_accuracy_section_uses_the_tasks_generation_cap(monkeypatch):
    from moelab.report import ReportContext
    from moelab.report import accuracy as report

    seen = {}

    def fake_section(model, tokenizer, limit=10, **kw):
        seen.update(kw, limit=limit)
        return ""

    monkeypatch.setattr(report, "report_section", fake_section)
    report.accuracy_section(ReportContext(None, None, "m", None, Path("."), quick=True))
    assert seen["limit"] == 3 and seen.get("max_gen_toks") is None


# --- 4. truncated prompts are reported with their numbers ------------------------------


def test_truncated_prompts_are_reported_with_their_lengths(caplog):
    from moelab.evals import evaluate

    model, tok = moelab.load("tiny-random-mixtral")  # 256-token context, one token per byte
    with caplog.at_level(logging.WARNING, logger="moelab"):
        result = evaluate(model, tok, tasks=["arith"], limit=2, max_gen_toks=100, batch_size=2)
    notes = " ".join(result.tasks["arith"].notes)
    assert "2 of 2 prompts were left-truncated to 156 tokens" in notes, notes
    assert "256-token context minus 100 generated tokens" in caplog.text


@needs_bundled
@pytest.mark.skipif(not (ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl").is_file(),
                    reason="needs a local GSM8K copy (../shared/data/gsm8k)")
def test_gsm8k_few_shot_prompts_truncated_on_the_bundled_models_are_reported(caplog):
    from moelab.evals import evaluate

    model, tok = moelab.load(BUNDLED[0])
    with caplog.at_level(logging.WARNING, logger="moelab"):
        evaluate(model, tok, tasks=["gsm8k"], limit=1, max_gen_toks=8,
                 gsm8k_dir=str(ROOT.parent / "shared" / "data" / "gsm8k"))
    assert "1 of 1 prompts were left-truncated to 504 tokens" in caplog.text


# --- 5. cache traffic units -------------------------------------------------------------


def test_cache_simulate_labels_experts_and_bytes_and_refuses_negative_sizes(tmp_path, capsys):
    from test_caches_errors import _tiny_trace

    from moelab.caches import make_cache, simulate
    from moelab.cli import main
    from moelab.errors import MoelabError

    trace = _tiny_trace(tmp_path)
    eb = max(json.loads((trace / "meta.json").read_text())["model"]["expert_bytes"])
    r = simulate(trace, "lru", 0.25)
    assert r.expert_bytes == eb > 1 and r.bytes_moved == r.transfers * eb
    assert main(["cache", "simulate", "--trace", str(trace), "--policy", "lru", "--capacity", "0.25"]) == 0
    out = capsys.readouterr().out
    assert f"expert size: {eb} bytes" in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    row = next(line for line in out.splitlines() if line.startswith("lru"))
    assert "moved (experts)" in header and "moved (bytes)" in header
    assert f" {r.transfers} " in row and f" {r.bytes_moved} " in row
    with pytest.raises(SystemExit) as exc:  # argparse: usage line + one-line error, status 2
        main(["cache", "simulate", "--trace", str(trace), "--policy", "lru", "--expert-bytes", "-5"])
    assert exc.value.code == 2 and "--expert-bytes: expected a positive integer (≥ 1), got -5" in capsys.readouterr().err
    with pytest.raises(MoelabError, match="expert_bytes=-5"):
        simulate(trace, "lru", 0.25, expert_bytes=-5)
    with pytest.raises(MoelabError, match="expert_bytes=0"):
        make_cache("lru", [4], 2, expert_bytes=0)


# --- 6. accuracy with its standard error and n -------------------------------------------


def test_compare_policies_reports_stderr_and_n_in_table_and_figures(monkeypatch):
    import moelab.evals
    from moelab.evals.compare import compare_policies
    from moelab.evals.results import EvalConfig, EvalResult, TaskResult

    scores = iter([0.65, 0.70, 0.60])  # baseline, deferral 1, skipping 1

    def fake_evaluate(model, tokenizer, tasks, limit=None, model_name=None, **kw):
        s = next(scores)
        se = (s * (1 - s) / 19) ** 0.5
        t = TaskResult("arith", "arith", {"exact_match,strict-match": s}, {"exact_match,strict-match": se},
                       "exact_match,strict-match", n_docs=20, n_available=200, num_fewshot=0)
        return EvalResult("m", {"arith": t}, EvalConfig(), {})

    monkeypatch.setattr(moelab.evals, "evaluate", fake_evaluate)
    model, tok = moelab.load("tiny-random-qwen2_moe")
    cmp = compare_policies(model, tok, ["arith"], deferred=[0, 1], skipped=[0, 1], limit=20)
    table = cmp.table()
    assert "0.700±0.105 (+7.7±24.3%)" in table, table  # "+7.7 %" alone hid a ±24-point error
    assert "20 documents per cell" in table
    d = cmp.cell("deferral", 1, "arith")
    assert d.n_docs == 20 and abs(d.stderr - 0.1051) < 1e-3 and d.relative_stderr > 20
    fig = cmp.line_figure()
    assert all(tr.error_y.array is not None and len(tr.error_y.array) == 2 for tr in fig.data)
    assert "n=20" in fig.layout.title.text
    heat = cmp.heatmap()
    assert "±" in heat.data[0].text[0][1] and "n=20" in heat.data[0].text[0][1]


def test_compare_policies_marks_a_zero_stderr_at_zero_accuracy_with_a_wilson_interval(monkeypatch):
    import moelab.evals
    from moelab.evals.compare import compare_policies
    from moelab.evals.results import EvalConfig, EvalResult, TaskResult

    scores = iter([2 / 3, 0.0])  # baseline 2 of 3, deferral 1: 0 of 3 (lm-eval's stderr: 0)

    def fake_evaluate(model, tokenizer, tasks, limit=None, model_name=None, **kw):
        s = next(scores)
        se = (s * (1 - s) / 2) ** 0.5
        t = TaskResult("arith", "arith", {"exact_match,strict-match": s}, {"exact_match,strict-match": se},
                       "exact_match,strict-match", n_docs=3, n_available=200, num_fewshot=0)
        return EvalResult("m", {"arith": t}, EvalConfig(), {})

    monkeypatch.setattr(moelab.evals, "evaluate", fake_evaluate)
    model, tok = moelab.load("tiny-random-qwen2_moe")
    cmp = compare_policies(model, tok, ["arith"], deferred=[0, 1], skipped=[], limit=3)
    table = cmp.table()
    assert "0.000±0.000 [0.000–0.561]" in table, table  # "0.000±0.000" alone claims certainty from n=3
    assert "0.667±0.333 (" in table and "[0." not in table.split("0.667±0.333")[1][:3]
    assert "Wilson 95% interval" in table
    zero = cmp.cell("deferral", 1, "arith")
    assert zero.stderr == 0.0 and zero.degenerate and zero.score_text() == "0.000±0.000 [95% CI 0.000–0.561] (n=3)"
    assert cmp.to_dict()["points"][-1]["ci95_wilson"] == [0.0, pytest.approx(0.5615, abs=1e-4)]
    tr = cmp.line_figure().data[0]
    assert tr.error_y.array[-1] == pytest.approx(0.5615, abs=1e-4) and tr.error_y.arrayminus[-1] == 0.0
    assert tr.error_y.array[0] == pytest.approx(1 / 3) and tr.error_y.arrayminus[0] == pytest.approx(1 / 3)
    assert "Wilson" in cmp.line_figure().layout.title.text


def test_eval_table_adds_a_wilson_interval_where_the_stderr_is_zero_at_zero_or_one():
    from moelab.evals.results import EvalConfig, EvalResult, TaskResult

    zero = TaskResult("arith", "arith", {"exact_match,strict-match": 0.0}, {"exact_match,strict-match": 0.0},
                      "exact_match,strict-match", n_docs=3, n_available=200, num_fewshot=0)
    half = TaskResult("pycode", "pycode", {"pass@1,none": 0.5}, {"pass@1,none": 0.2887},
                      "pass@1,none", n_docs=4, n_available=50, num_fewshot=0)
    table = EvalResult("m", {"arith": zero, "pycode": half}, EvalConfig(), {}).table()
    row = next(line for line in table.splitlines() if line.startswith("arith"))
    assert "0.0000 [0.0000–0.5615]" in row and row.split()[-1] == "3", table
    assert "[" not in next(line for line in table.splitlines() if line.startswith("pycode"))
    assert "Wilson 95% interval" in table
