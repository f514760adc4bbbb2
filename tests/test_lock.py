"""The lock and the ranges agree: every dependency pyproject.toml declares is pinned in
requirements/lock.txt at a version its range admits, every range has a tested upper bound,
and under ``make test`` the environment is exactly the lock (no drift from an old venv)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
sys.path.insert(0, str(ROOT / "scripts"))
import lock as locktool  # noqa: E402


def _requirements() -> list[Requirement]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in meta["dependencies"]]
    for extra in meta["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def test_every_declared_dependency_is_locked_inside_its_range():
    pins = locktool.read_lock(LOCK)
    for req in _requirements():
        name = locktool._norm(req.name)
        assert name in pins, f"{req.name} is a dependency but not in {LOCK.name}; run `make test-latest` then `make lock`"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name]}, outside pyproject.toml's {req}")


def test_every_range_has_an_upper_bound_above_the_locked_version():
    """Honest ranges: each says how far it was tested (a bound that the lock's version is below)."""
    for req in _requirements():
        uppers = [s for s in req.specifier if s.operator in ("<", "<=", "==")]
        assert uppers, f"pyproject.toml's {req} has no upper bound; add the next release it was not tested with"


def test_the_lock_pins_the_build_backend_and_torch():
    pins = locktool.read_lock(LOCK)
    assert {"pip", "setuptools", "wheel", "torch", "transformers", "lm-eval"} <= set(pins)


def test_the_lock_reader_refuses_a_line_that_is_not_a_pin(tmp_path):
    bad = tmp_path / "lock.txt"
    bad.write_text("numpy==2.0\ntransformers>=5\n")
    with pytest.raises(SystemExit, match=r"lock.txt:2: expected 'name==version', got 'transformers>=5'"):
        locktool.read_lock(bad)


@pytest.mark.skipif(not os.environ.get("MOELAB_EXPECT_LOCK"),
                    reason="MOELAB_EXPECT_LOCK is set by `make test` only (make test-latest checks newer versions)")
def test_the_environment_is_the_lock():
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "check", os.environ["MOELAB_EXPECT_LOCK"]],
                         capture_output=True, text=True)
    assert got.returncode == 0, "the environment differs from the lock (rm -rf .venv; make test):\n" + got.stdout
