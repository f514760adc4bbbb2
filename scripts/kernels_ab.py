"""A/B two builds of the native kernels in one process, calls alternating.

The development VM's speed swings up to 2x between minutes, so two benchmark runs (or two
processes taking turns) cannot resolve a 10 % change. This loads two source trees of ``kernels/``
side by side (each compiled as its own extension, its C++ namespace renamed so pybind11 keeps
their types apart) and times the same calls on both in alternating order; it prints each build's
median and the median and quartiles of the per-call ratio base / new, and checks that both builds
return the same output bit for bit (``maxdiff``).

    git worktree add /tmp/base <rev>
    python scripts/kernels_ab.py --base /tmp/base/kernels --new kernels --dtypes fp8 int8 --tokens 1 16 256

The first run compiles both builds (about a minute each) into ``--build-dir``. ``--base-isa`` runs
the base build on another path than ``--isa`` (the same tree on both sides compares two paths:
``--base kernels --new kernels --base-isa avx2 --isa avx512vnni``; their outputs then differ by
rounding, not bit for bit).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import torch
from torch.utils import cpp_extension

from moelab.kernels.backend import packed_for
from moelab.kernels.bench import Shape, _experts_module, _Routing
from moelab.kernels.build import ISAS
from moelab.kernels.op import _args
from moelab.kernels.packing import KernelSpec


def build(name: str, src: str, build_dir: str):
    """The kernels in ``src`` as extension ``name`` (namespace ``moelab_<name>``)."""
    out = os.path.join(build_dir, name)
    os.makedirs(out, exist_ok=True)
    return cpp_extension.load(
        name=name, sources=sorted(glob.glob(os.path.join(src, "*.cpp"))), build_directory=out,
        extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", f"-Dmoelab=moelab_{name}"],
        extra_ldflags=["-fopenmp"], extra_include_paths=[src], verbose=False,
    )


def compare(exts: dict, packed, shape: Shape, tokens: int, reps: int, isas: dict[str, str]) -> str:
    """One (dtype, T) point: alternating calls on every build (each on its path); a line of figures."""
    r = _Routing(tokens, shape.experts, shape.top_k)
    x = (torch.randn(tokens, shape.hidden) * 0.5).to(torch.bfloat16)
    outs = {k: e.moe_forward(*_args(x, r.ids, r.w, packed, isas[k], None), expert_map=None) for k, e in exts.items()}
    diff = (outs["base"].float() - outs["new"].float()).abs().max().item()
    ts: dict[str, list[float]] = {k: [] for k in exts}
    for i in range(reps):
        r.redraw()
        args = {k: _args(x, r.ids, r.w, packed, isas[k], None) for k in exts}
        for k in (["base", "new"] if i % 2 == 0 else ["new", "base"]):
            t0 = time.perf_counter()
            exts[k].moe_forward(*args[k], expert_map=None)
            ts[k].append(time.perf_counter() - t0)
    ratio = sorted(b / n for b, n in zip(ts["base"], ts["new"]))
    q = len(ratio) // 4
    return (f"base {statistics.median(ts['base']) * 1e3:.2f} ms, new {statistics.median(ts['new']) * 1e3:.2f} ms, "
            f"base/new {statistics.median(ratio):.2f} [{ratio[q]:.2f}-{ratio[-1 - q]:.2f}], maxdiff {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="kernels/ source directory of the base build")
    ap.add_argument("--new", required=True, help="kernels/ source directory of the new build")
    ap.add_argument("--shape", default="2048x1408x64x6", help="HxIxExK")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "int8", "fp8"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256])
    ap.add_argument("--reps", type=int, default=12, help="alternating pairs of calls per point")
    ap.add_argument("--isa", default="amx", choices=ISAS)
    ap.add_argument("--base-isa", default=None, choices=ISAS, help="the base build's path (default: --isa)")
    ap.add_argument("--build-dir", default="/tmp/moelab_kernels_ab")
    a = ap.parse_args()
    exts = {k: build(f"kab_{k}", src, a.build_dir) for k, src in (("base", a.base), ("new", a.new))}
    torch.manual_seed(0)
    shape = Shape.parse(a.shape)
    mod = _experts_module(shape, shape.experts)
    for dtype in a.dtypes:
        packed = packed_for(mod, KernelSpec(dtype, 64, block=(128, 128)))
        for t in a.tokens:
            isas = {"base": a.base_isa or a.isa, "new": a.isa}
            print(f"{shape} {isas['base']}/{a.isa} {dtype} T={t}: {compare(exts, packed, shape, t, a.reps, isas)}", flush=True)


if __name__ == "__main__":
    main()
