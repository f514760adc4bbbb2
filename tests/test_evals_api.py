"""moelab.evals.evaluate and `moelab eval`: bad input gives clear errors and no partial
results; the end-to-end runs work offline on tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402

from moelab.cli import main  # noqa: E402
from moelab.errors import MoelabError  # noqa: E402
from moelab.evals import EvalConfig, evaluate, get_eval_task  # noqa: E402
from moelab.evals.registry import default_num_fewshot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
HAVE_DATA = (DATA / "gsm8k" / "test.jsonl").is_file() and (
    DATA / "humaneval" / "HumanEval.jsonl.gz"
).is_file()


class EchoLM(LM):
    """A minimal lm-eval LM: answers every request with ``text`` (or raises)."""

    def __init__(self, text=" #### 0", fail=False):
        super().__init__()
        self.text, self.fail = text, fail

    def generate_until(self, requests):
        if self.fail:
            raise RuntimeError("model crashed mid-run")
        return [self.text for _ in requests]

    def loglikelihood(self, requests):  # pragma: no cover
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):  # pragma: no cover
        raise NotImplementedError


def test_unknown_task_suggests_close_names():
    with pytest.raises(MoelabError, match=r"unknown evaluation task 'arth'.*Did you mean 'arith'"):
        evaluate(EchoLM(), tasks=["arth"])


def test_lm_eval_task_names_are_accepted_as_aliases():
    assert get_eval_task("gsm8k_local").name == "gsm8k"


def test_missing_gsm8k_data_names_the_variable_and_flag(monkeypatch):
    monkeypatch.delenv("MOELAB_GSM8K_DIR", raising=False)
    with pytest.raises(MoelabError, match=r"MOELAB_GSM8K_DIR.*--gsm8k-dir"):
        evaluate(EchoLM(), tasks=["gsm8k"])


def test_gsm8k_dir_without_the_files_is_refused(tmp_path):
    with pytest.raises(MoelabError, match=r"lacks test.jsonl, train.jsonl"):
        evaluate(EchoLM(), tasks=["gsm8k"], gsm8k_dir=str(tmp_path))


def test_missing_humaneval_data_names_the_variable_and_flag(monkeypatch, tmp_path):
    monkeypatch.setenv("MOELAB_HUMANEVAL_DIR", str(tmp_path))
    with pytest.raises(
        MoelabError, match=r"no HumanEval file.*MOELAB_HUMANEVAL_DIR.*--humaneval-dir"
    ):
        evaluate(EchoLM(), tasks=["humaneval"], allow_code_execution=True)


@pytest.mark.parametrize("task", ["pycode", "humaneval"])
def test_code_tasks_need_the_explicit_opt_in(task):
    with pytest.raises(
        MoelabError, match=r"allow_code_execution=True \(CLI: --allow-code-execution\)"
    ):
        evaluate(EchoLM(), tasks=[task])


def test_fewshot_code_task_is_refused():
    with pytest.raises(MoelabError, match="0-shot only"):
        evaluate(EchoLM(), tasks=["pycode"], num_fewshot=3, allow_code_execution=True)


def test_non_generative_model_is_refused():
    import torch

    with pytest.raises(MoelabError, match="cannot generate text"):
        evaluate(torch.nn.Linear(2, 2), object(), tasks=["arith"])


@pytest.mark.parametrize("bad", [dict(limit=0), dict(batch_size=-1), dict(num_fewshot=-2)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(MoelabError, match="expected"):
        EvalConfig(**bad)


def test_limit_larger_than_the_split_scores_all_and_says_so(caplog):
    result = evaluate(EchoLM(), tasks=["arith"], limit=100_000)
    task = result.tasks["arith"]
    assert task.n_docs == task.n_available == 200
    assert task.notes and "larger than the 200 documents" in task.notes[0]
    assert "larger than the 200 documents" in caplog.text


def test_samples_are_written_atomically_and_a_failure_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    result = evaluate(EchoLM(), tasks=["arith"], limit=3, log_samples_dir=out)
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "samples_arith.jsonl"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["tasks"]["arith"]["n_docs"] == 3 and saved["versions"]["lm_eval"]
    assert len((out / "samples_arith.jsonl").read_text().splitlines()) == 3
    assert result.samples_dir == str(out)
    assert saved["code_isolation"] is None  # no task ran generated code

    with pytest.raises(MoelabError, match="already exists"):
        evaluate(EchoLM(), tasks=["arith"], limit=3, log_samples_dir=out)
    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="crashed"):
        evaluate(EchoLM(fail=True), tasks=["arith"], limit=3, log_samples_dir=failed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no partial or temp dirs


def test_cli_errors_are_one_line_with_status_2(capsys, monkeypatch):
    monkeypatch.delenv("MOELAB_GSM8K_DIR", raising=False)
    for argv, message in (
        (
            ["eval", "--model", "tiny-random-mixtral", "--tasks", "arith,gsm8kk"],
            "Did you mean 'gsm8k'",
        ),
        (["eval", "--model", "tiny-random-mixtral", "--tasks", "pycode"], "--allow-code-execution"),
        (["eval", "--model", "tiny-random-mixtral", "--tasks", "gsm8k"], "MOELAB_GSM8K_DIR"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_scores_a_tiny_model_on_arith_and_pycode_as_json(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny-random-mixtral", "--tasks", "arith,pycode", "--limit", "2"]
    argv += ["--max-gen-toks", "8", "--allow-code-execution", "--json", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "tiny-random-mixtral"
    assert set(result["tasks"]) == {"arith", "pycode"}
    assert 0.0 <= result["tasks"]["arith"]["metrics"]["exact_match,strict-match"] <= 1.0
    assert 0.0 <= result["tasks"]["pycode"]["metrics"]["pass@1,create_test"] <= 1.0
    assert (out / "samples_pycode.jsonl").is_file()
    saved = json.loads((out / "results.json").read_text())
    from moelab.evals.sandbox import available_isolation

    assert saved["code_isolation"] == result["code_isolation"] == available_isolation()
    assert saved["config"]["sandbox_isolation"] is None  # the default requirement: namespaces


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DATA, reason=f"no local GSM8K/HumanEval copies under {DATA}")
def test_cli_runs_gsm8k_and_humaneval_offline_on_a_tiny_model(capsys, monkeypatch):
    monkeypatch.setenv("MOELAB_GSM8K_DIR", str(DATA / "gsm8k"))
    monkeypatch.setenv("MOELAB_HUMANEVAL_DIR", str(DATA / "humaneval"))
    argv = [
        "eval",
        "--model",
        "tiny-random-qwen2_moe",
        "--tasks",
        "gsm8k,humaneval",
        "--limit",
        "2",
    ]
    assert main([*argv, "--max-gen-toks", "8", "--allow-code-execution", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tasks"]["gsm8k"]["num_fewshot"] == default_num_fewshot(get_eval_task("gsm8k")) == 5
    assert set(result["tasks"]["gsm8k"]["metrics"]) == {
        "exact_match,strict-match",
        "exact_match,flexible-extract",
    }
    assert result["tasks"]["humaneval"]["n_docs"] == 2


@pytest.mark.slow
def test_lm_eval_command_line_can_select_moelab_models(tmp_path):
    cmd = [sys.executable, "-m", "moelab.evals.lm_eval_cli", "--model", "moelab"]
    cmd += ["--model_args", "pretrained=tiny-random-mixtral", "--tasks", "arith", "--limit", "1"]
    cmd += ["--gen_kwargs", "max_gen_toks=4", "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "arith" in proc.stdout and "exact_match" in proc.stdout


def test_report_section_shows_metrics_and_answers_without_running_code():
    from moelab.evals import report_section

    page = report_section(EchoLM(" #### 41"), None, limit=2)
    assert "<table>" in page and "exact_match,strict-match" in page
    assert "arith #0" in page and "#### 41" in page
    assert "--allow-code-execution" in page  # pycode is left out without the opt-in


def test_result_records_the_routing_policy_the_model_was_scored_under():
    import moelab
    from moelab.evals import evaluate

    model, tok = moelab.load("tiny-random-qwen2_moe")
    plain = evaluate(model, tok, tasks=["arith"], limit=1, max_gen_toks=8)
    assert plain.policies == []
    with moelab.ExpertDeferral(model, deferred=1):
        deferred = evaluate(model, tok, tasks=["arith"], limit=1, max_gen_toks=8)
    (policy,) = deferred.policies
    assert policy["policy"] == "ExpertDeferral" and policy["deferred"] == 1 and policy["phase"] == "decode"
    assert deferred.to_dict()["policies"] == deferred.policies


def test_cli_refuses_code_tasks_below_the_required_sandbox_level(capsys, monkeypatch):
    from moelab.evals import sandbox

    monkeypatch.setattr(sandbox, "available_isolation", lambda: "rlimits")
    argv = ["eval", "--model", "tiny-random-mixtral", "--tasks", "pycode", "--allow-code-execution"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs isolation level 'namespaces'" in err and "--sandbox-isolation rlimits" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit):  # argparse: not a level
        main([*argv, "--sandbox-isolation", "jail"])
    assert "invalid choice: 'jail'" in capsys.readouterr().err
