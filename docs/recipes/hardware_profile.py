"""Recipe: add a hardware profile (a YAML file; every number stated with a source or assumed)."""

from pathlib import Path

import yaml

from moelab.caches import PrefetchConfig
from moelab.timing import available_profiles, get_profile, reference_expert_bytes, register_profile
from moelab.timing.profile import PROFILES_DIR

# Start from a packaged profile (all fields are required) and change what differs on your box.
doc = yaml.safe_load((PROFILES_DIR / "rtx4090-desktop.yaml").read_text())
doc["name"] = "my-box"
doc["description"] = "RTX 4090 desktop behind a PCIe 3.0 x16 slot"
# `stated:` names a source (spec sheet, paper and section); `assumed:` says why the value is taken.
doc["link_bandwidth_gbs"] = {"value": 12.0, "assumed": "~75 % of PCIe 3.0 x16's 15.75 GB/s"}
doc["link_latency_us"] = {"value": 12.0, "assumed": "a slower slot's DMA set-up; not measured"}
Path("my-box.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

mine = register_profile("my-box.yaml")  # validated: unknown, missing or unsourced fields are refused
assert "my-box" in available_profiles() and get_profile("my-box") is mine
print(mine.provenance["link_bandwidth_gbs"])

# Everything that takes a profile name now takes "my-box": GoodPred (--hardware my-box.yaml on
# the command line), cache prefetch budgets, the hybrid planner's cost model, the simulator.
expert = reference_expert_bytes("deepseek-v2-lite")
for name in ("rtx4090-desktop", "my-box"):
    hw = get_profile(name)
    budget = PrefetchConfig.from_profile(name, num_layers=26).experts_budget(expert)
    print(f"{name}: one expert {hw.transfer_time_us(expert):.0f} µs, {budget} prefetches per step")
