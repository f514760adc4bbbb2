"""Building/loading the extension, ISA selection and the bench command."""

from __future__ import annotations

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
