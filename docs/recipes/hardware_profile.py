"""Recipe: add a hardware profile (a YAML file; every number stated with a source or assumed)."""

from pathlib import Path

from moelab.caches import PrefetchConfig
from moelab.timing import available_profiles, get_profile, reference_expert_bytes, register_profile

# Start from a packaged profile (`base:`) and give only what differs on your box; the other
# fields, and where their numbers come from, are the base's.
Path("my-box.yaml").write_text("""\
name: my-box
base: rtx4090-desktop
description: RTX 4090 desktop behind a PCIe 3.0 x16 slot
link_bandwidth_gbs: {value: 15.75, stated: "PCI-SIG: PCIe 3.0 x16, 15.75 GB/s per direction"}
link_efficiency: {value: 0.76, assumed: "pinned copies reach ~75 % of the slot's rate"}
link_latency_us: {value: 12.0, assumed: "a slower slot's DMA set-up; not measured"}
""")

mine = register_profile("my-box.yaml")  # validated: unknown, mistyped or unsourced fields are refused
assert "my-box" in available_profiles() and get_profile("my-box") is mine
print(mine.provenance["link_efficiency"], "|", mine.provenance["cpu_cores"])

# Everything that takes a profile name now takes "my-box": GoodPred (--hardware my-box.yaml on
# the command line), cache prefetch budgets, the hybrid planner's cost model, the simulator.
# The link is bandwidth × efficiency: hw.link.bandwidth_gbs is what every consumer reads.
expert = reference_expert_bytes("deepseek-v2-lite")
for name in ("rtx4090-desktop", "my-box"):
    hw = get_profile(name)
    budget = PrefetchConfig.from_profile(name, num_layers=26).experts_budget(expert)
    print(f"{name}: {hw.link.bandwidth_gbs:.1f} GB/s, one expert {hw.transfer_time_us(expert):.0f} µs, "
          f"{budget} prefetches per step")
