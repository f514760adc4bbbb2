"""CLI: every command has --help, --json is machine-readable, user errors are one line, exit 2."""

import json
import re
import subprocess
import sys

import pytest

from moelab.cli import COMMAND_MODULES, build_parser, main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True, timeout=300)


def test_every_command_has_help(capsys):
    parser = build_parser()
    names = [a for a in parser._subparsers._group_actions[0].choices]
    assert len(names) >= len(COMMAND_MODULES)
    for name in names:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_models_json(capsys):
    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "mixtral" in out["families"] and len(out["families"]) == 10
    assert "tiny-random-mixtral" in out["tiny_random"] and out["default"]


def test_trace_and_trace_info_json(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["trace", "--model", "tiny-random-olmoe", "--task", "demo", "--limit", "2",
                 "--max-new-tokens", "3", "--out", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["sequences"] == 2 and s["decode_tokens"] == 4
    assert main(["trace-info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["top_k"] == [4] * 4 and info["num_experts"] == [8] * 4
    assert all(row["experts_used"] >= 1 for row in info["expert_load"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["trace", "--model", "no-such-model", "--task", "demo", "--out", "{tmp}/x"], "neither a bundled model"),
        (["trace", "--model", "tiny-random-olmoe", "--task", "dmo", "--out", "{tmp}/x"], "Did you mean 'demo'"),
        (["trace", "--model", "tiny-random-olmoe", "--task", "demo", "--limit", "0", "--out", "{tmp}/x"],
         "expected a positive integer"),
        (["trace", "--model", "tiny-random-olmoe", "--task", "demo", "--out", "{tmp}"], "already exists; pass --overwrite"),
        (["trace-info", "{tmp}/missing"], "does not exist"),
        (["trace-info", "{tmp}"], "not a complete moelab trace"),
        (["trace", "--model", "tiny-random-olmoe", "--prompts", "{tmp}/none.txt", "--out", "{tmp}/x"],
         "prompts file"),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, message, tmp_path):
    r = _run(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


def test_demo_writes_self_contained_report(tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "report.html"
    assert main(["demo", "--model", "tiny-random-qwen2_moe", "--quick", "--max-new-tokens", "4",
                 "--sections", "routing", "--out", str(out)]) == 0
    assert [p.name for p in scratch.iterdir() if p.name.startswith("moelab")] == []  # scratch removed
    html = out.read_text()
    assert "Expert load per MoE layer" in html and "Token \\u2192 expert assignments" in html
    assert "Adjacent-layer routing" in html
    assert re.search(r"<script[^>]*\ssrc=", html) is None  # nothing loaded from outside: opens offline
    assert "<script" in html
    assert html.count("plotly.js v") <= 2  # the library is embedded once
    assert main(["demo", "--model", "tiny-random-qwen2_moe", "--quick", "--out", str(out)]) == 2
