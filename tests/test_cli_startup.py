"""The command line starts without importing the heavy libraries (torch, transformers, lm-eval).

`moelab --help` (and every sub-command's `--help`) only builds the argparse parser; the
libraries are imported when a command runs. Checked by the modules a fresh interpreter has
loaded, not by timing.
"""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "lm_eval", "pandas", "numpy", "pyarrow", "sklearn", "numba", "plotly")

_PROBE = """
import json, sys
from moelab.cli import main
argv = json.loads(sys.argv[1])
try:
    main(argv)
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)), file=sys.stderr)
"""


def _heavy_modules_after(argv: list[str]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY), json.dumps(argv)],
        capture_output=True, text=True, timeout=120,
    )
    return json.loads(proc.stderr.strip().splitlines()[-1])


def test_import_cli_is_light():
    proc = subprocess.run(
        [sys.executable, "-c",
         f"import sys, moelab.cli; moelab.cli.build_parser(); "
         f"print([m for m in {HEAVY!r} if m in sys.modules])"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["eval", "--help"], ["generate", "--help"],
                                  ["bench", "kernels", "--help"], ["cache", "simulate", "--help"],
                                  ["predict", "eval", "--help"], ["compare-policies", "--help"]],
                         ids=" ".join)
def test_help_imports_no_heavy_library(argv):
    assert _heavy_modules_after(argv) == []


def test_bench_cli_defaults_match_the_benchmark():
    from moelab.cli import bench as cli_bench
    from moelab.kernels import bench

    assert cli_bench.DEFAULT_SHAPES == bench.DEFAULT_SHAPES
    assert cli_bench.DEFAULT_TOKENS == bench.DEFAULT_TOKENS
    assert cli_bench.DEFAULT_DTYPES == bench.DEFAULT_DTYPES
    assert cli_bench.DTYPES == bench.DTYPES
    assert cli_bench.BASELINES == bench.BASELINES

    from moelab.simulate.moegen import bench as throughput_bench

    assert cli_bench.THROUGHPUT_MODELS == throughput_bench.DEFAULT_MODELS


def test_policies_package_exports_resolve():
    import moelab.policies as policies

    for name in policies.__all__:
        assert getattr(policies, name) is not None
