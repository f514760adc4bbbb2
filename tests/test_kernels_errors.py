"""The native kernels' error paths raise; they never abort the interpreter.

A ``TORCH_CHECK`` thrown while the GIL is released could abort the process on some torch
releases (torch 2.11 crashed a pytest worker on an out-of-range expert id), so the operator
checks its inputs with the GIL held and releases it for the compute only. Each error path runs
here in a fresh interpreter: a crash (a signal, a lost process) is a failure with its output,
not a lost pytest worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.xdist_group("kernels")

SCRIPT = textwrap.dedent("""
    import torch
    from moelab.kernels import KernelSpec, moe_experts, pack_experts, supported_isas
    from moelab.kernels.build import force_isa, load_extension

    torch.manual_seed(0)
    E, H, I = 4, 32, 32
    w = dict(gate=torch.randn(E, I, H), up=torch.randn(E, I, H), down=torch.randn(E, H, I))
    x = torch.randn(2, H)
    cases = {
        "id too large": (x, torch.tensor([[0], [4]]), torch.ones(2, 1)),
        "negative id": (x, torch.tensor([[-1], [0]]), torch.ones(2, 1)),
        "id far out": (x, torch.tensor([[0], [1 << 40]]), torch.ones(2, 1)),
    }
    # every ISA path this CPU runs, a float and a bf16-activation dtype each
    for isa in supported_isas():
        for dtype in ("fp32", "bf16", "fp8"):
            packed = pack_experts(spec=KernelSpec(dtype), **w)
            with force_isa(isa):
                for name, (xx, ids, wts) in cases.items():
                    try:
                        moe_experts(xx, ids, wts, packed)
                    except Exception as e:  # what the caller sees
                        print(f"{isa} {dtype} {name} ->", type(e).__name__, str(e).splitlines()[0][:80], flush=True)
                    else:
                        print(f"{isa} {dtype} {name} -> no error", flush=True)
                # the operator still works after its errors
                out = moe_experts(x, torch.tensor([[0], [3]]), torch.ones(2, 1), packed)
                print(f"{isa} {dtype} after errors ->", tuple(out.shape), bool(torch.isfinite(out).all()), flush=True)
    try:
        load_extension().fma_peak_gflops(99, 1)
    except Exception as e:
        print("peak bad isa ->", type(e).__name__, str(e).splitlines()[0][:80], flush=True)
    print("isas ->", " ".join(supported_isas()), flush=True)
""")


@pytest.mark.slow
def test_error_paths_raise_in_a_fresh_interpreter_instead_of_aborting():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"the interpreter died (exit {r.returncode}):\n{out[-3000:]}"
    lines = dict(line.split(" -> ", 1) for line in r.stdout.splitlines() if " -> " in line)
    isas = lines["isas"].split()
    assert "portable" in isas, out
    for isa in isas:
        for dtype in ("fp32", "bf16", "fp8"):
            for name in ("id too large", "negative id", "id far out"):
                got = lines.get(f"{isa} {dtype} {name}", "")
                assert got.startswith("RuntimeError") and "out of range" in got, out
            assert lines[f"{isa} {dtype} after errors"] == "(2, 32) True", out
    assert lines["peak bad isa"].startswith("RuntimeError") and "unknown isa" in lines["peak bad isa"], out
