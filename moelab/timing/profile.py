"""Hardware profiles: the numbers that turn bytes and layers into microseconds.

A :class:`HardwareProfile` describes one host + accelerator pair as far as expert
offloading cares. Profiles are data files, one per profile, shipped in
``moelab/timing/profiles/NAME.yaml`` and registered lazily in :data:`PROFILES` (a
:class:`moelab.registry.Registry`); a file of your own loads with
:func:`load_profile` or ``get_profile("path/to/box.yaml")``.

**File schema.** Top-level keys, all required, no others:

``name`` (string)
    registry name, e.g. ``pcie4-x16``; must equal the file's stem for shipped profiles.
``description`` (string)
    what machine the numbers stand for.
each numeric field of :data:`FIELDS` (a mapping)
    ``value`` (a number; an integer for counts, ``true``/``false`` for
    ``device_shares_host_memory``) and exactly one of
    ``stated: "<source: spec sheet, or paper + section/table>"`` or
    ``assumed: "<why this value>"``.

Example::

    link_bandwidth_gbs:
      value: 32.0
      stated: "ProMoE §7.1: PCIe 4.0, 32 GB/s one way"

Units: bandwidths in GB/s (10^9 bytes per second), times in microseconds.

Who reads what: GoodPred's in-time schedule (:mod:`moelab.predictors.timing`) reads the
link, ``decode_layer_time_us`` and ``attention_fraction``; cache prefetch budgets
(:meth:`moelab.caches.simulation.PrefetchConfig.from_profile`) read the link and
``decode_layer_time_us``. The placement cost model (:class:`moelab.hybrid.placement.CostModel`)
reads the bandwidths and peaks. The simulator (:mod:`moelab.simulate`) reads the rest: a roofline
``max(bytes / (bandwidth × efficiency), FLOPs / (peak × efficiency))`` per kernel plus launch,
dispatch and synchronisation costs, NUMA nodes whose bandwidth CPU kernels and copies share, and
the copy engines. ``moelab calibrate --out PROFILE`` measures these on the machine it runs on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.errors import MoelabError, did_you_mean
from moelab.registry import Registry

#: The profile used when none is named (GoodPred, plots, the CLI's ``--hardware``).
DEFAULT_PROFILE = "pcie4-x16"

#: Numeric fields of a profile file: name -> (type, constraint text, meaning).
FIELDS: dict[str, tuple[type, str, str]] = {
    "link_bandwidth_gbs": (float, "> 0", "host→device copy bandwidth of the link, GB/s"),
    "link_latency_us": (float, "≥ 0", "fixed cost of one transfer (launch + DMA set-up), µs"),
    "gpu_memory_bandwidth_gbs": (float, "> 0", "device memory bandwidth, GB/s"),
    "cpu_memory_bandwidth_gbs": (float, "> 0", "host memory read bandwidth, GB/s"),
    "cpu_cores": (int, "≥ 1", "host cores available for CPU experts and predictors"),
    "decode_layer_time_us": (
        float, "> 0",
        "wall time of one decoder layer (attention + MoE) at batch 1 during decode: the time "
        "between two consecutive MoE routers, the lead-time unit of layer-wise prediction",
    ),
    "attention_fraction": (
        float, "in [0, 1]",
        "share of a layer's time before its MoE block (attention, norms); the token id of a "
        "decode step is known this long before MoE layer 0 routes",
    ),
    # ------------------------------------------------------------ the simulator's roofline
    "gpu_peak_tflops": (float, "> 0", "dense bf16 peak of the device (tensor cores, no sparsity), TFLOP/s"),
    "gpu_memory_efficiency": (float, "in (0, 1]", "share of gpu_memory_bandwidth_gbs a kernel reaches"),
    "gpu_compute_efficiency": (float, "in (0, 1]", "share of gpu_peak_tflops a kernel reaches"),
    "gpu_dense_efficiency": (
        float, "> 0", "bandwidth of the dense work between MoE blocks (attention, dense MLPs, router, LM head) "
        "relative to an expert kernel's (gpu_memory_bandwidth_gbs × gpu_memory_efficiency × this)"),
    "gpu_launch_us": (float, "≥ 0", "fixed cost of one device kernel launch, µs"),
    "gpu_kernels_per_attention": (
        int, "≥ 1", "device kernels between two MoE blocks (norms, attention, shared expert, router)"),
    "gpu_kernels_per_expert": (int, "≥ 1", "device kernels of one routed expert (gate/up, act, down)"),
    "gpu_call_us": (
        float, "≥ 0", "fixed cost of one experts call on the device per MoE layer (handing it to the device "
        "stream/worker, the backend's host-side set-up before its kernels), µs"),
    "cpu_peak_tflops": (float, "> 0", "host peak over all cores for the experts' dtype, TFLOP/s"),
    "cpu_memory_efficiency": (
        float, "in (0, 1]", "share of the NUMA node's bandwidth a CPU expert kernel reaches"),
    "numa_nodes": (int, "≥ 1", "host NUMA nodes (sockets); experts are spread over them"),
    "numa_node_bandwidth_gbs": (float, "> 0", "read bandwidth of one NUMA node's local memory, GB/s"),
    "cpu_dispatch_us": (float, "≥ 0", "fixed cost per routed expert of a CPU experts call, µs"),
    "cpu_call_us": (
        float, "≥ 0", "fixed cost of one CPU experts call per MoE layer and host lane (handing it to the "
        "workers, thread-pool wake-up, the native kernel's set-up, Python dispatch), µs"),
    "sync_us": (float, "≥ 0", "one host↔device synchronisation (the host learns a device result), µs"),
    "copy_engines": (int, "≥ 1", "host→device copies that run at once (DMA engines)"),
    "device_shares_host_memory": (
        bool, "true/false",
        "the 'device' is a CPU worker on the host (a CPU-only machine): every lane (control, device, "
        "copies, host) is a CPU thread and the simulator has them time-share cpu_cores",
    ),
    # runtime overhead (calibrated): moelab's real executor's own costs, beyond the hardware's; 0 on a
    # profile that predicts the hardware alone (moelab.simulate.runtime)
    "runtime_layer_us": (float, "≥ 0", "moelab's executor: control-thread cost per MoE layer (planning, handing "
                         "work to the lanes, merging), µs"),
    "runtime_call_us": (float, "≥ 0", "moelab's executor: hand-off of one lane call (submit, wake-up, result "
                        "back), µs"),
}
_TEXT_FIELDS = ("name", "description")
_BASES = ("stated", "assumed")


@dataclass(frozen=True)
class HardwareProfile:
    """One host/accelerator pair, as seen by expert offloading (fields: :data:`FIELDS`)."""

    name: str
    """Registry name, e.g. ``"pcie4-x16"``."""
    description: str = ""
    """What machine the numbers stand for."""
    link_bandwidth_gbs: float = 25.0
    """Host→device copy bandwidth of the link (GB/s)."""
    link_latency_us: float = 10.0
    """Fixed cost of one transfer, added to every expert copy (µs)."""
    gpu_memory_bandwidth_gbs: float = 2000.0
    """Device memory bandwidth (GB/s)."""
    cpu_memory_bandwidth_gbs: float = 60.0
    """Host memory read bandwidth (GB/s)."""
    cpu_cores: int = 16
    """Host cores available for CPU experts and predictors."""
    decode_layer_time_us: float = 500.0
    """Wall time of one decoder layer at batch 1 during decode (µs); a prediction made at
    layer l for layer l+d has about ``d × decode_layer_time_us`` to complete its transfers."""
    attention_fraction: float = 0.5
    """Share of a layer's time spent before its MoE block."""
    gpu_peak_tflops: float = 100.0
    """Dense bf16 peak of the device (TFLOP/s)."""
    gpu_memory_efficiency: float = 0.8
    """Share of the device memory bandwidth a kernel reaches."""
    gpu_compute_efficiency: float = 0.6
    """Share of the device peak a kernel reaches."""
    gpu_dense_efficiency: float = 1.0
    """Bandwidth of the dense work between MoE blocks relative to an expert kernel's."""
    gpu_launch_us: float = 5.0
    """Fixed cost of one device kernel launch (µs)."""
    gpu_kernels_per_attention: int = 12
    """Device kernels between two MoE blocks (norms, attention, shared expert, router)."""
    gpu_kernels_per_expert: int = 3
    """Device kernels of one routed expert."""
    gpu_call_us: float = 10.0
    """Fixed cost of one experts call on the device per MoE layer (µs)."""
    cpu_peak_tflops: float = 1.0
    """Host peak over all cores for the experts' dtype (TFLOP/s)."""
    cpu_memory_efficiency: float = 0.7
    """Share of a NUMA node's bandwidth a CPU expert kernel reaches."""
    numa_nodes: int = 1
    """Host NUMA nodes; routed experts are spread over them (expert ``e`` on node ``e % numa_nodes``)."""
    numa_node_bandwidth_gbs: float = 60.0
    """Read bandwidth of one NUMA node's local memory (GB/s)."""
    cpu_dispatch_us: float = 5.0
    """Fixed cost per routed expert of a CPU experts call (µs)."""
    cpu_call_us: float = 20.0
    """Fixed cost of one CPU experts call per MoE layer and host lane (µs)."""
    sync_us: float = 10.0
    """One host↔device synchronisation (µs)."""
    copy_engines: int = 1
    """Host→device copies that run at once."""
    device_shares_host_memory: bool = False
    """The device is a CPU worker on the host (reads contend for host memory bandwidth)."""
    # runtime overhead (calibrated)
    runtime_layer_us: float = 0.0
    """moelab's executor: control-thread cost per MoE layer (µs); 0: the hardware alone."""
    runtime_call_us: float = 0.0
    """moelab's executor: hand-off of one lane call (µs); 0: the hardware alone."""
    provenance: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Per numeric field: ``"stated: <source>"`` or ``"assumed: <why>"`` (from the file)."""

    def __post_init__(self) -> None:
        for f, (typ, constraint, _) in FIELDS.items():
            v = getattr(self, f)
            if typ is bool:
                ok = isinstance(v, bool)
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                ok = False
            elif constraint == "> 0":
                ok = v > 0
            elif constraint == "≥ 0":
                ok = v >= 0
            elif constraint == "≥ 1":
                ok = v >= 1
            elif constraint == "in [0, 1]":
                ok = 0.0 <= v <= 1.0
            elif constraint == "in (0, 1]":
                ok = 0.0 < v <= 1.0
            else:  # pragma: no cover - a FIELDS entry with a constraint this check does not know
                raise AssertionError(constraint)
            if not ok:
                fix = ("a bandwidth ≤ 0 makes every transfer or read take forever; set it to the measured "
                       "or stated GB/s" if f.endswith("_gbs") else f"set a value {constraint}")
                raise MoelabError(f"HardwareProfile.{f} must be {constraint}, got {v!r}; {fix}.")

    @property
    def link(self):
        """The host→device :class:`~moelab.timing.link.Link` of this profile."""
        from moelab.timing.link import Link

        return Link(self.link_bandwidth_gbs, self.link_latency_us)

    def transfer_time_us(self, nbytes: float) -> float:
        """Time to copy ``nbytes`` host→device as one transfer: latency + bytes / bandwidth."""
        return self.link.transfer_us(nbytes)

    def cpu_read_time_us(self, nbytes: float) -> float:
        """Lower bound of the time to stream ``nbytes`` from host memory (a CPU GEMV)."""
        return nbytes / (self.cpu_memory_bandwidth_gbs * 1e3)

    def gpu_read_time_us(self, nbytes: float) -> float:
        """Lower bound of the time to stream ``nbytes`` from device memory."""
        return nbytes / (self.gpu_memory_bandwidth_gbs * 1e3)

    def with_changes(self, **changes: Any) -> HardwareProfile:
        """A copy with some fields replaced; their provenance says they were set by the caller."""
        prov = dict(self.provenance)
        for k in changes:
            if k in FIELDS:
                prov[k] = "assumed: set by the caller (overrides the profile)"
        return dataclasses.replace(self, **changes, provenance=prov)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "provenance"}
        return d


# ---------------------------------------------------------------------- files
def _fail(path: Path | str, what: str) -> MoelabError:
    return MoelabError(f"hardware profile file {str(path)!r}: {what}")


def parse_profile(data: Any, path: Path | str = "<dict>") -> HardwareProfile:
    """A profile from the parsed contents of a profile file (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise _fail(path, f"expected a mapping of fields at the top level, got {type(data).__name__}; "
                          "see moelab.timing.profile for the schema.")
    allowed = set(_TEXT_FIELDS) | set(FIELDS)
    for key in data:
        if key not in allowed:
            raise _fail(path, f"unknown field {key!r}.{did_you_mean(str(key), allowed)} "
                              f"Allowed: {', '.join(sorted(allowed))}; remove or rename it.")
    kwargs: dict[str, Any] = {}
    prov: dict[str, str] = {}
    for key in _TEXT_FIELDS:
        if key not in data:
            raise _fail(path, f"missing field {key!r} (a string); add it.")
        if not isinstance(data[key], str) or not data[key].strip():
            raise _fail(path, f"field {key!r} must be a non-empty string, got {data[key]!r}.")
        kwargs[key] = data[key].strip()
    for key, (typ, constraint, meaning) in FIELDS.items():
        if key not in data:
            raise _fail(path, f"missing field {key!r} ({meaning}); add `{key}: {{value: ..., stated: SOURCE}}` "
                              "or `assumed: WHY`.")
        entry = data[key]
        if not isinstance(entry, Mapping) or "value" not in entry:
            raise _fail(path, f"field {key!r} must be a mapping with `value` and `stated: SOURCE` or "
                              f"`assumed: WHY`, got {entry!r}.")
        extra = set(entry) - {"value", *_BASES}
        if extra:
            raise _fail(path, f"field {key!r} has unknown key(s) {sorted(extra)}; allowed: value, stated, assumed.")
        bases = [b for b in _BASES if b in entry]
        if len(bases) != 1:
            raise _fail(path, f"field {key!r} must say exactly one of `stated: SOURCE` (a spec sheet or paper "
                              f"+ table) or `assumed: WHY`, got {bases or 'neither'}.")
        note = entry[bases[0]]
        if not isinstance(note, str) or not note.strip():
            raise _fail(path, f"field {key!r}: `{bases[0]}` must name the source or the reason, got {note!r}.")
        value = entry["value"]
        if typ is bool:
            ok = isinstance(value, bool)
        else:
            ok = not isinstance(value, bool) and (
                isinstance(value, int) if typ is int else isinstance(value, (int, float)))
        if not ok:
            want = {int: "an integer", bool: "true or false"}.get(typ, "a number")
            raise _fail(path, f"field {key!r}: value must be {want} ({constraint}), got {value!r}.")
        kwargs[key] = typ(value)
        prov[key] = f"{bases[0]}: {note.strip()}"
    try:
        return HardwareProfile(**kwargs, provenance=prov)
    except MoelabError as e:
        raise _fail(path, str(e)) from None


def load_profile(path: str | Path) -> HardwareProfile:
    """Read one profile file (YAML or JSON; the schema is in the module docstring)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise MoelabError(f"hardware profile file {str(path)!r} does not exist; give a YAML file "
                          "(schema: moelab.timing.profile) or a registered name.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise _fail(path, f"not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                          "give a YAML or JSON profile file.") from None
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise _fail(path, f"not valid YAML/JSON ({msg}); fix the syntax.") from None
    except RecursionError:
        raise _fail(path, "a value refers to itself through a YAML alias; write the value out.") from None
    return parse_profile(data, path)


# ---------------------------------------------------------------------- registry
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def _register_builtins() -> None:
    for f in sorted(PROFILES_DIR.glob("*.yaml")):
        PROFILES.register(f.stem, f"moelab.timing.profiles:{f.stem}")


#: Registered hardware profiles (shipped ones are lazy: their file is read on first use).
PROFILES: Registry[HardwareProfile] = Registry(
    "hardware profile", base=HardwareProfile, instances=True, loader=_register_builtins
)


def register_profile(profile: HardwareProfile | str | Path, *, name: str | None = None,
                     overwrite: bool = False) -> HardwareProfile:
    """Add ``profile`` (an instance or a profile file) to :data:`PROFILES`, under ``name`` if given."""
    if isinstance(profile, (str, Path)):
        profile = load_profile(profile)
    if name is not None:
        profile = dataclasses.replace(profile, name=name)
    PROFILES.register(profile.name, profile, overwrite=overwrite)
    return profile


def get_profile(name: str | Path | HardwareProfile | None = None) -> HardwareProfile:
    """The profile called ``name`` (default :data:`DEFAULT_PROFILE`); a path to a ``.yaml``/
    ``.yml``/``.json`` file is loaded; an instance is returned as is."""
    if isinstance(name, HardwareProfile):
        return name
    if name is None:
        name = DEFAULT_PROFILE
    if isinstance(name, Path) or (isinstance(name, str) and name.endswith((".yaml", ".yml", ".json"))):
        return load_profile(name)
    return PROFILES.get(name)


def available_profiles() -> list[str]:
    """Names of the registered profiles."""
    return PROFILES.names()


__all__ = [
    "DEFAULT_PROFILE",
    "FIELDS",
    "PROFILES",
    "HardwareProfile",
    "available_profiles",
    "get_profile",
    "load_profile",
    "parse_profile",
    "register_profile",
]
