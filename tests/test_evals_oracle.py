"""The metrics are exact: an oracle that answers some documents with the gold answer and
the rest with known corruptions scores exactly the known fraction (GSM8K, HumanEval, arith)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402

from moelab.evals import evaluate  # noqa: E402

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
    assert task.n_docs == n and task.num_fewshot == 8
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
