"""Hardware profiles: the numbers that turn bytes and layers into microseconds.

A :class:`HardwareProfile` describes one host + accelerator pair as far as expert
offloading cares. Profiles are data files, one per profile, shipped in
``moelab/timing/profiles/NAME.yaml`` and registered lazily in :data:`PROFILES` (a
:class:`moelab.registry.Registry`); a file of your own loads with
:func:`load_profile` or ``get_profile("path/to/box.yaml")``.

**File schema.** Top-level keys, no others:

``name`` (string, required)
    registry name, e.g. ``pcie4-x16``; must equal the file's stem for shipped profiles.
``description`` (string; required unless there is a ``base``)
    what machine the numbers stand for.
``base`` (string, optional)
    a registered profile name or another profile file (relative to this one): the fields
    this file does not give, and their provenance, are the base's.
each numeric field of :data:`FIELDS` (a mapping; required unless there is a ``base``,
except :data:`OPTIONAL_FIELDS`)
    ``value`` (a number; an integer for counts, ``true``/``false`` for
    ``device_shares_host_memory``) and exactly one of
    ``stated: "<source: spec sheet, or paper + section/table>"`` or
    ``assumed: "<why this value>"``.

Example::

    link_bandwidth_gbs:
      value: 32.0
      stated: "ProMoE §7.1: PCIe 4.0, 32 GB/s one way"

A machine like a shipped one, in a few lines::

    name: my-h100
    base: h100-pcie5-ddr5
    host_memory_gb: {value: 512, stated: "free -g on my box"}
    link_efficiency: {value: 0.9, assumed: "nvbandwidth on a similar box reached 55 of 63 GB/s"}

On the command line, ``--set FIELD=VALUE`` overrides one field (:func:`apply_settings`); in
Python, ``profile.with_changes(field=value)`` gives a profile usable wherever a name is.

Units: bandwidths in GB/s (10^9 bytes per second), memory sizes in GB (10^9 bytes), times in
microseconds. The link's effective bandwidth is ``link_bandwidth_gbs × link_efficiency``
(:attr:`HardwareProfile.link`); memory sizes feed :mod:`moelab.timing.memory`.

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
from collections.abc import Mapping, Sequence
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
    "link_efficiency": (
        float, "in (0, 1]", "share of link_bandwidth_gbs that copies reach (ProMoE measured 23.9 GB/s on its "
        "nominal 32: 0.747); profile.link applies it, so every consumer sees the effective bandwidth"),
    "gpu_memory_gb": (
        float, "> 0", "device memory, GB (10^9 bytes): dense weights, KV cache and expert slots must fit in it"),
    "host_memory_gb": (
        float, "> 0", "host memory, GB (10^9 bytes): the routed experts kept on the host (and a host KV cache)"),
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

#: Fields a file may leave out (files written before they existed, ``moelab calibrate``'s):
#: field -> (value, the ``assumed:`` note its provenance then carries). A memory size left
#: out is None: the memory check (:mod:`moelab.timing.memory`) says it could not check.
OPTIONAL_FIELDS: dict[str, tuple[Any, str]] = {
    "link_efficiency": (1.0, "not given in the file; link_bandwidth_gbs is taken as what copies reach"),
    "gpu_memory_gb": (None, "not given in the file; device memory is not checked"),
    "host_memory_gb": (None, "not given in the file; host memory is not checked"),
}
_NULLABLE = {k for k, (v, _) in OPTIONAL_FIELDS.items() if v is None}


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
    link_efficiency: float = 1.0
    """Share of ``link_bandwidth_gbs`` copies reach; :attr:`link` applies it."""
    gpu_memory_gb: float | None = None
    """Device memory (GB, 10^9 bytes); None: not stated, memory not checked."""
    host_memory_gb: float | None = None
    """Host memory (GB, 10^9 bytes); None: not stated, memory not checked."""
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
            if v is None and f in _NULLABLE:
                continue
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
        """The host→device :class:`~moelab.timing.link.Link` of this profile, at its effective
        bandwidth ``link_bandwidth_gbs × link_efficiency``: read copy times from here, not from
        the raw field."""
        from moelab.timing.link import Link

        return Link(self.effective_link_bandwidth_gbs, self.link_latency_us)

    @property
    def effective_link_bandwidth_gbs(self) -> float:
        """What host→device copies reach: ``link_bandwidth_gbs × link_efficiency`` (GB/s)."""
        return self.link_bandwidth_gbs * self.link_efficiency

    def transfer_time_us(self, nbytes: float) -> float:
        """Time to copy ``nbytes`` host→device as one transfer: latency + bytes / bandwidth."""
        return self.link.transfer_us(nbytes)

    def cpu_read_time_us(self, nbytes: float) -> float:
        """Lower bound of the time to stream ``nbytes`` from host memory (a CPU GEMV)."""
        return nbytes / (self.cpu_memory_bandwidth_gbs * 1e3)

    def gpu_read_time_us(self, nbytes: float) -> float:
        """Lower bound of the time to stream ``nbytes`` from device memory."""
        return nbytes / (self.gpu_memory_bandwidth_gbs * 1e3)

    def with_changes(self, *, why: str = "set by the caller (overrides the profile)",
                     **changes: Any) -> HardwareProfile:
        """A copy with some fields replaced; their provenance says ``assumed: <why>``. Usable
        wherever a profile name is (``get_profile(obj)`` returns it as is)."""
        known = {f.name for f in dataclasses.fields(self)} - {"provenance"}
        for k in changes:
            if k not in known:
                raise MoelabError(f"HardwareProfile has no field {k!r};{did_you_mean(k, sorted(known))} "
                                  f"fields: {', '.join(FIELDS)}.")
        prov = dict(self.provenance)
        for k in changes:
            if k in FIELDS:
                prov[k] = f"assumed: {why}"
        return dataclasses.replace(self, **changes, provenance=prov)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "provenance"}
        return d


# ---------------------------------------------------------------------- files
def _fail(path: Path | str, what: str) -> MoelabError:
    return MoelabError(f"hardware profile file {str(path)!r}: {what}")


def _parse_entry(path: Path | str, key: str, entry: Any) -> tuple[Any, str]:
    """(value, provenance) of one numeric field's ``{value, stated|assumed}`` mapping."""
    typ, constraint, _ = FIELDS[key]
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
    return typ(value), f"{bases[0]}: {note.strip()}"


def _resolve_base(base: Any, path: Path | str, seen: tuple[str, ...]) -> HardwareProfile:
    """The profile a file's ``base:`` names: a registered name, or a file (relative to this one)."""
    if not isinstance(base, str) or not base.strip():
        raise _fail(path, f"`base` must name a profile (a registered name such as h100-pcie5-ddr5, or a "
                          f"profile file), got {base!r}.")
    base = base.strip()
    if base.endswith((".yaml", ".yml", ".json")):
        target = Path(base)
        if not target.is_absolute() and isinstance(path, Path | str) and str(path) != "<dict>":
            target = Path(path).parent / target
        key = str(target.resolve())
        if key in seen:
            raise _fail(path, f"`base: {base}` leads back to itself ({' → '.join([*seen, key])}); break the cycle.")
        return load_profile(target, _seen=(*seen, key))
    return get_profile(base)


def parse_profile(data: Any, path: Path | str = "<dict>", *, _seen: tuple[str, ...] = ()) -> HardwareProfile:
    """A profile from the parsed contents of a profile file (see the module docstring).

    With ``base: NAME`` (a registered profile or a profile file) the file gives only the fields it
    changes; the others, and their provenance, are the base's.
    """
    if not isinstance(data, Mapping):
        raise _fail(path, f"expected a mapping of fields at the top level, got {type(data).__name__}; "
                          "see moelab.timing.profile for the schema.")
    allowed = {*_TEXT_FIELDS, "base", *FIELDS}
    for key in data:
        if key not in allowed:
            raise _fail(path, f"unknown field {key!r}.{did_you_mean(str(key), allowed)} "
                              f"Allowed: {', '.join(sorted(allowed))}; remove or rename it.")
    base = _resolve_base(data["base"], path, _seen) if "base" in data else None
    kwargs: dict[str, Any] = {}
    prov: dict[str, str] = {}
    for key in _TEXT_FIELDS:
        if key not in data and base is not None and key == "description":
            kwargs[key] = f"{base.description} (overrides: {', '.join(k for k in data if k in FIELDS) or 'none'})"
            continue
        if key not in data:
            raise _fail(path, f"missing field {key!r} (a string); add it.")
        if not isinstance(data[key], str) or not data[key].strip():
            raise _fail(path, f"field {key!r} must be a non-empty string, got {data[key]!r}.")
        kwargs[key] = data[key].strip()
    for key, (_, _, meaning) in FIELDS.items():
        if key in data:
            kwargs[key], prov[key] = _parse_entry(path, key, data[key])
        elif base is not None:
            kwargs[key] = getattr(base, key)
            prov[key] = base.provenance.get(key, f"assumed: inherited from {base.name}")
        elif key in OPTIONAL_FIELDS:
            kwargs[key], why = OPTIONAL_FIELDS[key]
            prov[key] = f"assumed: {why}"
        else:
            raise _fail(path, f"missing field {key!r} ({meaning}); add `{key}: {{value: ..., stated: SOURCE}}` "
                              "or `assumed: WHY`, or inherit it with `base: PROFILE`.")
    try:
        return HardwareProfile(**kwargs, provenance=prov)
    except MoelabError as e:
        raise _fail(path, str(e)) from None


def load_profile(path: str | Path, *, _seen: tuple[str, ...] = ()) -> HardwareProfile:
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
    return parse_profile(data, path, _seen=(*_seen, str(path.resolve())))


# ---------------------------------------------------------------------- --set FIELD=VALUE
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


def parse_setting(text: str) -> tuple[str, Any]:
    """``"link_efficiency=0.75"`` → ``("link_efficiency", 0.75)``, the value typed by :data:`FIELDS`
    (an integer for counts, true/false for flags, a number otherwise); a clear error for an
    unknown field or a value of the wrong type. Constraints (``> 0``, ``in (0, 1]``) are checked
    when the setting is applied."""
    if not isinstance(text, str) or "=" not in text:
        raise MoelabError(f"--set {text!r}: expected FIELD=VALUE (e.g. --set link_efficiency=0.75); fields: "
                          f"{', '.join(FIELDS)}.")
    key, raw = (x.strip() for x in text.split("=", 1))
    if key not in FIELDS:
        raise MoelabError(f"--set {text!r}: {key!r} is not a profile field;{did_you_mean(key, list(FIELDS))} "
                          f"fields: {', '.join(FIELDS)}.")
    typ, constraint, meaning = FIELDS[key]
    if typ is bool:
        if raw.lower() not in (*_TRUE, *_FALSE):
            raise MoelabError(f"--set {key}={raw!r}: expected true or false ({meaning}).")
        return key, raw.lower() in _TRUE
    try:
        value = typ(raw) if typ is int else float(raw)
    except ValueError:
        want = "a whole number" if typ is int else "a number"
        raise MoelabError(f"--set {key}={raw!r}: expected {want} {constraint} ({meaning}).") from None
    return key, value


def apply_settings(profile: HardwareProfile, settings: Sequence[str] | Mapping[str, Any] | None,
                   *, origin: str = "--set on the command line") -> HardwareProfile:
    """``profile`` with ``settings`` (``["field=value", ...]`` or a mapping) applied, each field's
    provenance saying it was set by ``origin``; the profile itself when there are none."""
    if not settings:
        return profile
    pairs = settings.items() if isinstance(settings, Mapping) else (parse_setting(t) for t in settings)
    changes: dict[str, Any] = {}
    for k, v in pairs:
        if isinstance(v, str):
            k, v = parse_setting(f"{k}={v}")
        changes[k] = v
    try:
        return profile.with_changes(why=f"{origin} (the profile's value was overridden)", **changes)
    except MoelabError as e:
        raise MoelabError(f"--set on profile {profile.name!r}: {e}") from None


def profile_to_dict(profile: HardwareProfile) -> dict[str, Any]:
    """``profile`` in the file schema (every field with its value and ``stated``/``assumed`` note):
    :func:`parse_profile` of it gives the profile back."""
    out: dict[str, Any] = {"name": profile.name, "description": profile.description or profile.name}
    for key in FIELDS:
        value = getattr(profile, key)
        if value is None:  # an optional size not stated: leave it out, as the file did
            continue
        basis, _, note = profile.provenance.get(key, "assumed: set in Python, no source given").partition(": ")
        out[key] = {"value": value, basis if basis in _BASES else "assumed": note or "no source given"}
    return out


def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    """Write ``profile`` as a profile file (YAML) that :func:`load_profile` reads back equal."""
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(profile_to_dict(profile), sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def pool_numa(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with its NUMA nodes pooled into one host lane that reads all of them at once
    (``numa_nodes=1``, ``numa_node_bandwidth_gbs × numa_nodes``): each CPU expert split over the
    sockets, as KTransformers' NUMA-aware kernels do. The simulator's default instead places
    expert ``e`` on node ``e % numa_nodes`` and reads it at that node's bandwidth."""
    if profile.numa_nodes == 1:
        return profile
    return profile.with_changes(
        why=f"NUMA pooled: {profile.numa_nodes} nodes read as one host lane (each expert split over the sockets)",
        numa_nodes=1, numa_node_bandwidth_gbs=profile.numa_node_bandwidth_gbs * profile.numa_nodes)


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
    "OPTIONAL_FIELDS",
    "PROFILES",
    "HardwareProfile",
    "apply_settings",
    "available_profiles",
    "get_profile",
    "load_profile",
    "parse_profile",
    "parse_setting",
    "pool_numa",
    "profile_to_dict",
    "register_profile",
    "save_profile",
]
