"""``moelab calibrate --out PROFILE``: measure this machine and write a hardware profile for the simulator."""

from __future__ import annotations

import json

from moelab.cli._util import emit_json, positive_int
from moelab.errors import MoelabError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine and write a hardware profile (for the simulator)",
        description="Measure memory read bandwidth, the experts kernels' bandwidth by dtype and batch (host: "
        "moelab's native kernels; device: the CPU worker's backend), attention time by context, copy bandwidth "
        "into a preallocated pool and per-call overheads; fit the hardware profile fields and write PROFILE "
        "(YAML, every number stated as measured) atomically, with the raw measurements in PROFILE.raw.json "
        "(moelab.simulate.calibrate), and moelab's executor's own costs (runtime_layer_us, runtime_call_us). "
        "Refuses a busy machine (other work's load, or repeated measurements that disagree) and values outside "
        "physical bounds (moelab.simulate.bounds), naming each. About a minute; --quick for fewer points.",
    )
    p.add_argument("--out", required=True, metavar="PROFILE", help="profile file to write (.yaml)")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--repeat", type=positive_int, default=5, help="timed repetitions per point (median; default 5)")
    p.add_argument("--quick", action="store_true", help="bf16 only, batches 1 and 16, two contexts, 2 repeats")
    p.add_argument("--host-backend", default="moelab", help="experts backend of the host lane (default moelab)")
    p.add_argument("--device-backend", default="reference",
                   help="experts backend of the CPU worker standing in for the device (default reference)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PROFILE")
    p.add_argument("--allow-busy", action="store_true",
                   help="calibrate although other work loads the machine (refused by default); every value is "
                   "flagged BUSY in the profile's provenance")
    p.add_argument("--allow-out-of-bounds", action="store_true",
                   help="write values outside their physical bounds (refused by default: moelab.simulate.bounds); "
                   "each is marked OUT OF BOUNDS in the profile's provenance")
    p.add_argument("--json", action="store_true", help="print the profile and raw measurements as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.simulate.calibrate import CalibrateConfig, calibrate, format_summary, write_profile

    cfg = CalibrateConfig(repeat=args.repeat, host_backend=args.host_backend, device_backend=args.device_backend)
    if args.quick:
        cfg.quick()
    from pathlib import Path

    out = Path(args.out)
    if out.exists() and not args.overwrite:  # refuse before a minute of measuring
        raise MoelabError(f"{str(out)!r} exists; pass --overwrite to replace it or choose another --out.")
    try:
        profile, raw = calibrate(cfg, progress=not args.json, allow_busy=args.allow_busy,
                                 allow_out_of_bounds=args.allow_out_of_bounds)
    except MoelabError as e:  # refused after measuring: keep what was measured aside, not as a profile
        if getattr(e, "raw", None) is None:
            raise
        out.parent.mkdir(parents=True, exist_ok=True)
        rejected = out.with_suffix(".rejected.raw.json")
        rejected.write_text(json.dumps(e.raw, indent=2, default=float) + "\n", encoding="utf-8")
        raise MoelabError(f"{e}\nThe raw measurements (every point and fit) are in {rejected}.") from None
    path = write_profile(profile, raw, out, overwrite=args.overwrite, name=args.name)
    if args.json:
        emit_json({"profile": profile, "raw": raw, "path": str(path)})
    else:
        print(format_summary(profile, raw))
        print(f"wrote {path} and {path.with_suffix('.raw.json')}")
    return 0
