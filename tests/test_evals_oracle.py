"""The metrics are exact: an oracle that answers some documents with the gold answer and
the rest with known corruptions scores exactly the known fraction (GSM8K, HumanEval, arith)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402

from moelab.evals import evaluate, get_eval_task  # noqa: E402
from moelab.evals.registry import default_num_fewshot  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_gsm8k = pytest.mark.skipif(
    not (DATA / "gsm8k" / "test.jsonl").is_file(), reason=f"no local GSM8K copy at {DATA / 'gsm8k'}"
)
needs_humaneval = pytest.mark.skipif(
    not (DATA / "humaneval" / "HumanEval.jsonl.gz").is_file(),
    reason=f"no local HumanEval copy at {DATA / 'humaneval'}",
)


class OracleLM(LM):
    """Answers request ``i`` (its doc id) with ``answer(doc, doc_id)``; never scores likelihoods."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer
        self.seen: list[int] = []

    def generate_until(self, requests):
        self.seen.extend(r.doc_id for r in requests)
        return [self.answer(r.doc, r.doc_id) for r in requests]

    def loglikelihood(self, requests):  # pragma: no cover - generative tasks only
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):  # pragma: no cover
        raise NotImplementedError


def gsm8k_style_answer(doc: dict, doc_id: int) -> str:
    """Gold for doc ids ≡ 0 mod 3; a wrong final number for ≡ 1; no ``####`` at all for ≡ 2."""
    gold = doc["answer"]
    if doc_id % 3 == 0:
        return " " + gold
    number = int(gold.split("####")[-1].strip().replace(",", ""))
    if doc_id % 3 == 1:
        return " " + re.sub(r"#### .*$", f"#### {number + 1}", gold)
    return " I think the answer is unknown."


def expected_fraction(n: int, good) -> float:
    return sum(1 for i in range(n) if good(i)) / n


@needs_gsm8k
def test_gsm8k_exact_match_equals_known_fraction_of_gold_answers():
    n = 12
    oracle = OracleLM(gsm8k_style_answer)
    result = evaluate(oracle, tasks=["gsm8k"], limit=n, gsm8k_dir=str(DATA / "gsm8k"))
    task = result.tasks["gsm8k"]
    assert sorted(oracle.seen) == list(range(n))
    assert task.n_docs == n and task.num_fewshot == default_num_fewshot(get_eval_task("gsm8k"))
    want = expected_fraction(n, lambda i: i % 3 == 0)
    assert task.metrics["exact_match,strict-match"] == pytest.approx(want, abs=1e-12)
    # flexible extraction takes the last number: the corrupted answers end in a wrong
    # number, the ones without "####" have none, so the same documents are right.
    assert task.metrics["exact_match,flexible-extract"] == pytest.approx(want, abs=1e-12)


def test_arith_exact_match_equals_known_fraction_of_gold_answers():
    n = 9
    result = evaluate(OracleLM(gsm8k_style_answer), tasks=["arith"], limit=n)
    want = expected_fraction(n, lambda i: i % 3 == 0)
    assert result.score("arith") == pytest.approx(want, abs=1e-12)


def code_answer(doc: dict, doc_id: int) -> str:
    """Canonical solution for doc ids ≡ 0 mod 3 (and id 1); wrong, raising or exiting otherwise."""
    if doc_id % 3 == 0 or doc_id == 1:
        return doc["canonical_solution"]
    broken = ["    return None\n", "    raise ValueError('no')\n", "    import sys; sys.exit(0)\n"]
    return broken[doc_id % 3]


@needs_humaneval
def test_humaneval_pass_at_1_equals_known_fraction_of_canonical_solutions():
    n = 8
    result = evaluate(
        OracleLM(code_answer),
        tasks=["humaneval"],
        limit=n,
        allow_code_execution=True,
        humaneval_path=str(DATA / "humaneval"),
    )
    want = expected_fraction(n, lambda i: i % 3 == 0 or i == 1)
    assert result.tasks["humaneval"].metrics["pass@1,create_test"] == pytest.approx(want, abs=1e-12)


def test_pycode_pass_at_1_equals_known_fraction_of_canonical_solutions():
    n = 6
    result = evaluate(OracleLM(code_answer), tasks=["pycode"], limit=n, allow_code_execution=True)
    want = expected_fraction(n, lambda i: i % 3 == 0 or i == 1)
    assert result.score("pycode") == pytest.approx(want, abs=1e-12)
    from moelab.evals.sandbox import available_isolation

    assert result.code_isolation == available_isolation()  # recorded in every code-running result
    assert result.to_dict()["code_isolation"] == result.code_isolation


def _installed_gsm8k_shots() -> int:
    """num_fewshot of the installed lm-eval gsm8k.yaml, read independently of moelab."""
    import lm_eval.tasks

    text = (Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml").read_text(encoding="utf-8")
    return int(re.search(r"^num_fewshot:\s*(\d+)", text, re.M).group(1))


def test_gsm8k_default_shot_count_is_the_installed_lm_eval_tasks():
    assert default_num_fewshot(get_eval_task("gsm8k")) == _installed_gsm8k_shots()
    assert default_num_fewshot(get_eval_task("arith")) is None  # moelab's own YAML decides


def test_a_missing_lm_eval_task_file_is_a_clear_error():
    from dataclasses import replace

    from moelab.errors import MoelabError

    task = replace(get_eval_task("gsm8k"), fewshot_from="gsm8k/no_such_task.yaml")
    with pytest.raises(MoelabError, match="no_such_task.yaml.*--num-fewshot"):
        default_num_fewshot(task)


class PromptLM(OracleLM):
    def __init__(self):
        super().__init__(gsm8k_style_answer)
        self.contexts: list[str] = []

    def generate_until(self, requests):
        self.contexts.extend(r.args[0] for r in requests)
        return super().generate_until(requests)


@needs_gsm8k
@pytest.mark.parametrize("num_fewshot", [None, 2])
def test_gsm8k_prompts_hold_the_default_or_the_users_shot_count(num_fewshot):
    lm = PromptLM()
    result = evaluate(lm, tasks=["gsm8k"], limit=2, gsm8k_dir=str(DATA / "gsm8k"), num_fewshot=num_fewshot)
    shots = _installed_gsm8k_shots() if num_fewshot is None else num_fewshot
    assert result.tasks["gsm8k"].num_fewshot == shots
    assert [c.count("Question:") for c in lm.contexts] == [shots + 1] * 2


@needs_gsm8k
def test_gsm8k_follows_lm_eval_when_its_count_changes(monkeypatch):
    # moelab's own gsm8k_local.yaml says 5 too, so pretend lm-eval moved to 3: moelab must follow
    import moelab.evals.api as api

    monkeypatch.setattr(api, "default_num_fewshot", lambda task: 3 if task.name == "gsm8k" else None)
    lm = PromptLM()
    result = evaluate(lm, tasks=["gsm8k"], limit=1, gsm8k_dir=str(DATA / "gsm8k"))
    assert result.tasks["gsm8k"].num_fewshot == 3 and lm.contexts[0].count("Question:") == 4
