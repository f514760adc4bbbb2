"""Model-generated code runs in a separate, limited process: hostile or broken programs
fail cleanly and harm neither the evaluator nor the host."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from moelab.evals.metrics import estimate_pass_at_k, pass_at_k
from moelab.evals.sandbox import SandboxConfig, run_program, run_programs

FAST = SandboxConfig(timeout_s=2.0, memory_mb=512)


def test_passing_program_passes_and_keeps_its_output():
    r = run_program("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('ok')", FAST)
    assert r.passed and r.status == "passed" and r.stdout.strip() == "ok"


def test_failing_assertion_fails_with_traceback():
    r = run_program("assert 1 == 2, 'nope'", FAST)
    assert r.status == "failed" and "AssertionError: nope" in r.stderr


def test_infinite_loop_times_out_and_the_process_group_is_killed():
    r = run_program("while True:\n    pass", SandboxConfig(timeout_s=1.0))
    assert r.status == "timeout" and not r.passed
    assert r.returncode is not None and r.returncode < 0  # killed by a signal


def test_memory_bomb_fails_without_growing_the_evaluator():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_program(
        "x = bytearray(8 * 1024 ** 3)\nblocks = [bytearray(10 ** 8) for _ in range(100)]", FAST
    )
    assert r.status == "failed" and "MemoryError" in r.stderr
    # the allocation happened in the child: the evaluator's peak RSS did not grow by GBs
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024


@pytest.mark.parametrize(
    "exit_code", ["import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"]
)
def test_early_exit_counts_as_failure_and_the_evaluator_survives(exit_code):
    r = run_program(exit_code + "\nassert False, 'tests never ran'", FAST)
    assert r.status == "failed"


@pytest.mark.parametrize(
    "drop_privileges", [True, False], ids=["as-nobody-if-root", "audit-hook-only"]
)
def test_write_outside_the_sandbox_is_refused(tmp_path: Path, drop_privileges: bool):
    target = tmp_path / "owned-by-test.txt"
    target.write_text("original")
    victim = tmp_path / "new-file.txt"
    program = f"open({str(victim)!r}, 'w').write('pwned')\n"
    config = SandboxConfig(timeout_s=2.0, drop_privileges=drop_privileges)
    assert run_program(program, config).status == "failed"
    for attempt in (
        f"open({str(target)!r}, 'a').write('pwned')",
        f"import os; os.remove({str(target)!r})",
        f"import os; os.rename({str(target)!r}, 'stolen.txt')",
        f"import os; fd = os.open({str(target)!r}, os.O_WRONLY | os.O_TRUNC); os.write(fd, b'x')",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
    ):
        r = run_program(attempt, config)
        assert r.status == "failed", attempt
    assert not victim.exists()
    assert target.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["owned-by-test.txt"]


def test_writes_inside_the_sandbox_are_allowed_and_the_sandbox_is_empty_and_removed():
    program = (
        "import os\n"
        "assert os.listdir('.') == [], os.listdir('.')\n"
        "assert os.environ['HOME'] == os.getcwd()\n"
        "open('scratch.txt', 'w').write('x')\n"
        "print(os.getcwd())\n"
    )
    r = run_program(program, FAST)
    assert r.passed, r.stderr
    assert not Path(r.stdout.strip()).exists()


@pytest.mark.parametrize(
    "program",
    [
        "import subprocess; subprocess.run(['true'])",
        "import os; os.system('true')",
        "import os; os.fork()",
        "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
        "import socket; socket.create_connection(('127.0.0.1', 9))",
        "import ctypes; ctypes.CDLL(None)",
    ],
    ids=["subprocess", "system", "fork", "kill-parent", "socket", "ctypes"],
)
def test_processes_signals_sockets_and_ctypes_are_refused(program):
    r = run_program(program, FAST)
    assert r.status == "failed" and "moelab sandbox" in r.stderr
    assert os.getpid() > 0  # still here


def test_run_programs_keeps_order():
    results = run_programs(["assert True", "assert False", "assert True"], FAST, workers=2)
    assert [r.passed for r in results] == [True, False, True]


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (10, 3, 1, 0.3),
        (10, 0, 5, 0.0),
        (10, 6, 5, 1.0),
        (5, 2, 2, 0.7),
    ],
)
def test_unbiased_pass_at_k_estimator(n, c, k, want):
    # (5, 2, 2): 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert estimate_pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_needs_enough_samples():
    with pytest.raises(ValueError, match="at least k=2"):
        estimate_pass_at_k(1, 1, 2)


def test_pass_at_k_metric_averages_problems():
    test = "def check(candidate):\n    assert candidate(2) == 4\ncheck(f)"
    good, bad = "def f(x):\n    return 2 * x", "def f(x):\n    return x"
    assert pass_at_k([test], [[good]], k=[1], timeout=2.0) == {"pass@1": 1.0}
    assert pass_at_k([test], [[good, bad]], k=[1, 2], timeout=2.0) == {"pass@1": 0.5, "pass@2": 1.0}
