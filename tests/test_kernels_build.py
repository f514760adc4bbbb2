"""Building/loading the extension, ISA selection and the bench command."""

from __future__ import annotations

import argparse
import json

import pytest

from moelab.errors import MoelabError
from moelab.kernels import build


def test_cache_dir_respects_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.cache_dir() == tmp_path / "moelab_kernels"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert "moelab" in str(build.cache_dir()) and ".cache" in str(build.cache_dir())


def test_missing_compiler_is_a_readable_error(monkeypatch):
    monkeypatch.setenv("CXX", "definitely-not-a-compiler")
    with pytest.raises(MoelabError, match="apt-get install g\\+\\+"):
        build._check_toolchain()


def test_missing_ninja_is_a_readable_error(monkeypatch):
    import torch.utils.cpp_extension as ce

    monkeypatch.setattr(ce, "is_ninja_available", lambda: False)
    with pytest.raises(MoelabError, match="pip install ninja"):
        build._check_toolchain()


def test_isa_can_be_forced_by_env_and_context(monkeypatch):
    assert "portable" in build.supported_isas()
    monkeypatch.setenv(build.ISA_ENV, "portable")
    assert build.active_isa() == "portable"
    monkeypatch.setenv(build.ISA_ENV, "avx9000")
    with pytest.raises(MoelabError, match="avx9000"):
        build.active_isa()
    monkeypatch.delenv(build.ISA_ENV)
    with build.force_isa("portable"):
        assert build.active_isa() == "portable"
    assert build.active_isa() == build.supported_isas()[0]


def test_isa_ladder_is_ordered_by_what_each_path_needs():
    """ISAS is fastest first: a CPU that runs a path runs every later one (its requirements are a
    superset of theirs, the portable path needs nothing), every path has its own extension code,
    and each --emulate setting forces the path it is named after."""
    from moelab.cli.bench import EMULATE_ENV

    for faster, slower in zip(build.ISAS, build.ISAS[1:]):
        assert set(build._REQUIRED[faster]) >= set(build._REQUIRED[slower]), (faster, slower)
    assert build._REQUIRED["portable"] == ()
    assert set(build.ISA_CODES) == set(build.ISAS)
    assert len(set(build.ISA_CODES.values())) == len(build.ISAS)
    for isa, env in EMULATE_ENV.items():
        assert isa in build.ISAS and env["MOELAB_KERNELS_ISA"] == isa
    # a Cascade Lake (AVX-512 with VNNI, no BF16 or VBMI) runs the avx512vnni path, not avx512
    clx = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"}
    assert [i for i in build.ISAS if set(build._REQUIRED[i]) <= clx] == ["avx512vnni", "avx2", "portable"]


def test_bench_kernels_cli_prints_json(capsys):
    from moelab.cli import main

    code = main(["bench", "kernels", "--json", "--shapes", "64x96x8x2", "--tokens", "1", "4",
                 "--dtypes", "bf16", "int4", "--repeat", "1", "--allow-busy"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["machine"]["read_gbps"] > 0
    rows = data["rows"]
    assert {(r["dtype"], r["tokens"]) for r in rows} == {("bf16", 1), ("bf16", 4), ("int4", 1), ("int4", 4)}
    assert all(r["ms"] > 0 and set(r["baseline_ms"]) == {"eager", "batched_mm", "grouped_mm"} for r in rows)
    assert data["machine"]["isa"] and all(r["isa"] == data["machine"]["isa"] for r in rows)
    assert data["machine"]["fma_peak_gflops"] > 0 and all(r["pct_peak"] is None for r in rows)  # T < 64
    # %read divides by the bandwidth probed between the row's own timed calls; the opening probe's share is kept
    for r in rows:
        assert r["read_gbps"] > 0 and r["pct_read_bw"] == pytest.approx(100 * r["gbps"] / r["read_gbps"])
        assert r["pct_read_bw_opening"] == pytest.approx(100 * r["gbps"] / data["machine"]["read_gbps"])


def test_bench_kernels_prefill_flag_and_batched_mm_are_cli_choices():
    from moelab.cli import build_parser

    args = build_parser().parse_args(["bench", "kernels", "--prefill", "--baselines", "batched_mm"])
    assert args.prefill and args.baselines == ["batched_mm"]


def test_bench_kernels_cli_refuses_a_busy_machine_without_allow_busy(monkeypatch, capsys):
    """The bench's figures are refused (exit 2, the reason named) when the machine is busy."""
    from moelab import measure
    from moelab.cli import main

    monkeypatch.setattr(measure, "machine_load", lambda: {"load1": 99.0, "cpus": 1, "per_cpu": 99.0})
    code = main(["bench", "kernels", "--json", "--shapes", "64x96x8x2", "--tokens", "1",
                 "--dtypes", "bf16", "--repeat", "1"])
    assert code == 2
    assert "--allow-busy" in capsys.readouterr().err


def test_bench_kernels_emulate_reruns_itself_with_every_layer_held_to_that_isa(monkeypatch):
    """``--emulate avx2`` reruns the same command line in a child whose environment forces moelab's
    path and caps oneDNN and ATen (the built-ins) at AVX2; a process that already has them runs it."""
    import subprocess

    from moelab.cli import bench as cli_bench
    from moelab.cli import main

    for k in ("MOELAB_KERNELS_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(k, raising=False)
    seen = []

    def fake_run(cmd, env, check):
        seen.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 7)

    monkeypatch.setattr(subprocess, "run", fake_run)
    argv = ["bench", "kernels", "--emulate", "avx2", "--tokens", "256", "--dtypes", "fp8", "--json"]
    assert main(argv) == 7  # the child's status
    (cmd, env), = seen
    assert cmd[1:] == ["-m", "moelab.cli", *argv]
    assert env["MOELAB_KERNELS_ISA"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    # in the child (the environment set): no second rerun
    for k, v in cli_bench.EMULATE_ENV["avx2"].items():
        monkeypatch.setenv(k, v)
    assert cli_bench._emulated(argparse.Namespace(emulate="avx2", argv=argv)) is None


@pytest.mark.slow
def test_bench_kernels_emulate_avx2_times_the_built_ins_on_avx2_and_records_it():
    """End to end: the child's built-ins ran under ATen AVX2 and oneDNN capped at AVX2, moelab on its
    avx2 path, and the JSON (and the table's header) says so."""
    import os
    import subprocess
    import sys

    if "avx2" not in build.supported_isas():
        pytest.skip("this CPU has no AVX2 path to emulate")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOELAB_KERNELS_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    out = subprocess.run([sys.executable, "-m", "moelab.cli", "bench", "kernels", "--emulate", "avx2", "--json",
                          "--shapes", "64x96x8x2", "--tokens", "1", "--dtypes", "bf16", "--baselines", "eager",
                          "--repeat", "1", "--allow-busy"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    m = data["machine"]
    assert m["isa"] == "avx2" and m["builtin_isa"] == {"aten": "AVX2", "onednn_max": "AVX2"}
    assert all(r["isa"] == "avx2" for r in data["rows"])
    from moelab.kernels.bench import format_table

    assert "built-ins on ATen AVX2, oneDNN capped at AVX2" in format_table(data)
