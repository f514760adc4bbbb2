"""Model-generated code runs in a separate, confined process: broken programs fail cleanly
and harm neither the evaluator nor the host (deliberate escapes: test_sandbox_attacks.py)."""

from __future__ import annotations

import os
import resource
import tempfile
from pathlib import Path

import pytest

from moelab.errors import MoelabError
from moelab.evals import sandbox
from moelab.evals.metrics import estimate_pass_at_k, pass_at_k
from moelab.evals.sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    available_isolation,
    run_program,
    run_programs,
    run_tests,
)

LEVEL = available_isolation()
FAST = SandboxConfig(timeout_s=10.0, memory_mb=512, min_isolation="rlimits")
ISOLATIONS = ["rlimits"] + (["namespaces"] if LEVEL == "namespaces" else [])


def test_passing_program_passes_and_keeps_its_output():
    r = run_program("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('ok')", FAST)
    assert r.passed and r.status == "passed" and r.stdout.strip() == "ok"


def test_failing_assertion_fails_with_traceback():
    r = run_program("assert 1 == 2, 'nope'", FAST)
    assert r.status == "failed" and "AssertionError: nope" in r.stderr


def test_infinite_loop_times_out_and_the_process_group_is_killed():
    r = run_program("while True:\n    pass", SandboxConfig(timeout_s=1.0, min_isolation="rlimits"))
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


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_write_outside_the_sandbox_is_refused(tmp_path: Path, isolation: str):
    target = tmp_path / "owned-by-test.txt"
    target.write_text("original")
    victim = tmp_path / "new-file.txt"
    program = f"open({str(victim)!r}, 'w').write('pwned')\n"
    # the directory is visible (read-only) inside the namespaces sandbox
    config = SandboxConfig(timeout_s=10.0, isolation=isolation, min_isolation="rlimits",
                           read_only_paths=(str(tmp_path),))  # fmt: skip
    assert run_program(program, config).status == "failed"
    for attempt in (
        f"open({str(target)!r}, 'a').write('pwned')",
        f"import os; os.remove({str(target)!r})",
        f"import os; os.rename({str(target)!r}, 'stolen.txt')",
        f"import os; fd = os.open({str(target)!r}, os.O_WRONLY | os.O_TRUNC); os.write(fd, b'x')",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
    ):
        r = run_program(attempt, config)
        assert r.status == "failed" and r.isolation == isolation, attempt
    assert not victim.exists()
    assert target.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["owned-by-test.txt"]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_writes_inside_the_sandbox_are_allowed_and_the_sandbox_is_empty_and_removed(isolation):
    name = f"scratch-{os.getpid()}-{isolation}.txt"
    program = (
        "import os\n"
        "assert os.listdir('.') == [], os.listdir('.')\n"
        "assert os.environ['HOME'] == os.getcwd()\n"
        f"open({name!r}, 'w').write('x')\n"
    )
    config = SandboxConfig(timeout_s=10.0, isolation=isolation, min_isolation="rlimits")
    r = run_program(program, config)
    assert r.passed, r.stderr
    assert not list(Path(tempfile.gettempdir()).glob(f"moelab-sandbox-*/**/{name}"))


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
def test_rlimits_level_audit_hook_refuses_processes_signals_sockets_and_ctypes(program):
    r = run_program(program, SandboxConfig(timeout_s=10.0, isolation="rlimits", min_isolation="rlimits"))
    assert r.status == "failed" and "moelab sandbox" in r.stderr and r.isolation == "rlimits"
    assert os.getpid() > 0  # still here


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_run_tests_verdict_comes_from_the_tests(isolation):
    config = SandboxConfig(timeout_s=10.0, isolation=isolation, min_isolation="rlimits")
    tests = "def check(candidate):\n    assert candidate(2) == (4, [b'x'], {1: {2.5}})\n\ncheck(f)\n"
    good = "def f(x):\n    return (2 * x, [b'x'], {1: {2.5}})\n"
    assert run_tests(good, tests, config).passed
    for bad in (
        "def f(x):\n    return (x, [b'x'], {1: {2.5}})\n",  # wrong value
        "import os\nos._exit(0)\n",  # exits before the tests
        "def f(x):\n    raise SystemExit(0)\n",
        "class E:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return E()\n",
        "def f(x)\n",  # syntax error
    ):
        r = run_tests(bad, tests, config)
        assert r.status == "failed" and r.isolation == isolation, (bad, r)


def test_run_tests_uses_helpers_modules_and_exceptions_of_the_candidate():
    candidate = (
        "import math\nfrom typing import List\n"
        "def poly(xs: List[float], x: float) -> float:\n"
        "    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n"
        "def find_zero(xs):\n    return -xs[0] / xs[1]\n"
        "def picky(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    )
    tests = (
        "def check(candidate):\n"
        "    assert math.fabs(poly([2.0, 4.0], candidate([2.0, 4.0]))) < 1e-9\n"
        "    try:\n        picky(-1)\n    except ValueError:\n        pass\n"
        "    else:\n        raise AssertionError('no ValueError')\n"
        "check(find_zero)\n"
    )
    assert run_tests(candidate, tests, FAST).passed


def test_below_the_required_isolation_nothing_runs(monkeypatch):
    monkeypatch.setattr(sandbox, "available_isolation", lambda: "rlimits")
    with pytest.raises(SandboxUnavailable, match=r"needs isolation level 'namespaces'.*--sandbox-isolation rlimits"):
        run_tests("def f(x):\n    return x", "assert f(1) == 1", SandboxConfig())
    assert run_tests("def f(x):\n    return x", "assert f(1) == 1", SandboxConfig(min_isolation="rlimits")).passed
    with pytest.raises(MoelabError, match="isolation 'jail' is unknown"):
        SandboxConfig(isolation="jail")


def test_eval_refuses_code_tasks_below_the_required_isolation(monkeypatch):
    pytest.importorskip("lm_eval")
    from moelab.evals.api import preflight
    from moelab.evals.results import EvalConfig

    monkeypatch.setattr(sandbox, "available_isolation", lambda: "rlimits")
    with pytest.raises(SandboxUnavailable, match="namespaces"):
        preflight(EvalConfig(tasks=["pycode"], allow_code_execution=True))
    preflight(EvalConfig(tasks=["pycode"], allow_code_execution=True, sandbox_isolation="rlimits"))
    preflight(EvalConfig(tasks=["arith"]))  # no generated code: no sandbox needed


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
    assert pass_at_k([test], [[good]], k=[1], timeout=10.0) == {"pass@1": 1.0}
    assert pass_at_k([test], [[good, bad]], k=[1, 2], timeout=10.0) == {"pass@1": 0.5, "pass@2": 1.0}


def test_lm_eval_model_arg_sets_the_least_level_pass_at_k_accepts(monkeypatch):
    from moelab.evals import metrics

    monkeypatch.setattr(metrics, "_DEFAULTS", metrics._DEFAULTS)
    metrics.set_min_isolation("rlimits")
    assert metrics._DEFAULTS.min_isolation == "rlimits"
    with pytest.raises(MoelabError, match="unknown"):
        metrics.set_min_isolation("none")


@pytest.mark.skipif(LEVEL != "namespaces", reason=f"isolation level here is {LEVEL!r}")
def test_without_user_namespaces_the_level_drops_and_code_is_refused_with_the_reason():
    """In a user namespace whose max_user_namespaces is 0 the probe fails: rlimits, refused."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    script = (
        "from moelab.evals import sandbox as S\n"
        "print(S.available_isolation())\n"
        "print('WHY', S.unavailable_reason())\n"
        "try:\n"
        "    S.run_tests('def f(x):\\n    return x', 'assert f(1) == 1')\n"
        "except S.SandboxUnavailable as e:\n"
        "    print('REFUSED', e)\n"
    )
    inner = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"$0\""
    proc = subprocess.run(
        ["unshare", "-U", "-r", "--fork", "sh", "-c", inner, script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        timeout=60,
    )
    if proc.returncode != 0 and "max_user_namespaces" in proc.stderr:
        pytest.skip(f"cannot disable user namespaces here: {proc.stderr.strip()[-200:]}")
    lines = proc.stdout.splitlines()
    assert lines[0] == "rlimits", proc.stdout + proc.stderr
    assert lines[1].startswith("WHY") and "unshare" in lines[1]  # the attack suite's skip reason
    assert lines[2].startswith("REFUSED") and "unshare" in lines[2] and "--sandbox-isolation" in lines[2]


def test_run_tests_keeps_big_integers_and_the_candidates_exception_arguments():
    candidate = (
        "BIG = 10 ** 5000\n"  # a module-level value JSON's decimal ints could not carry
        "def f(x):\n    return x * 10 ** 5000\n"
        "def g(k):\n    raise KeyError(k)\n"
    )
    tests = (
        "assert f(-3) == -3 * 10 ** 5000 and f(10 ** 6000) == 10 ** 11000 and BIG == 10 ** 5000\n"
        "try:\n    g('missing')\nexcept KeyError as e:\n"
        "    assert e.args == ('missing',) and str(e) == \"'missing'\", e.args\n"
        "else:\n    raise AssertionError('no KeyError')\n"
    )
    r = run_tests(candidate, tests, FAST)
    assert r.passed, r.stderr


def test_run_tests_never_imports_a_module_that_acts_on_import():
    # unittest.__main__ runs an empty test discovery and exits 0 when imported
    candidate = "import types\nm = types.ModuleType('unittest.__main__')\ndef f(x):\n    return x\n"
    r = run_tests(candidate, "assert f(1) == 2\n", FAST)
    assert r.status == "failed" and "AssertionError" in r.stderr


def test_run_tests_needs_the_tests_to_reach_their_end():
    r = run_tests("def f(x):\n    return x\n", "import os\nos._exit(0)\nassert f(1) == 2\n", FAST)
    assert r.status == "failed" and r.returncode == 0  # exit status 0, but the tests stopped


def test_run_tests_sees_arguments_the_candidate_changed_in_place():
    candidate = (
        "def f(xs, d, s, b, *, kw):\n"
        "    xs.sort(); d['new'] = 1; s.add(9); b[0] = 65; kw.append('k')\n"
    )
    tests = (
        "xs, d, s, b, kw = [3, 1, 2], {}, {1}, bytearray(b'x'), []\n"
        "keep = xs\n"
        "assert f(xs, d, s, b, kw=kw) is None\n"
        "assert keep is xs and xs == [1, 2, 3] and d == {'new': 1} and s == {1, 9}\n"
        "assert b == bytearray(b'A') and kw == ['k']\n"
    )
    r = run_tests(candidate, tests, FAST)
    assert r.passed, r.stderr


@pytest.mark.skipif(LEVEL != "namespaces", reason=f"isolation level here is {LEVEL!r}")
def test_the_candidate_may_start_exactly_max_processes():
    # at most 12 tries, inside the sandbox; the children die with its PID namespace
    program = (
        "import os, time\nn = 0\nfor _ in range(12):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
        "    n += 1\nprint(n)\n"
    )
    r = run_program(program, SandboxConfig(timeout_s=20.0, max_processes=4))
    assert r.passed and r.stdout.strip() == "4", (r.stdout, r.stderr)
