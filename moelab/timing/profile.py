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
    ``value`` (a number; an integer for ``cpu_cores``) and exactly one of
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
``decode_layer_time_us``. The memory bandwidths and core counts are for the hybrid
runtime/simulator (hybrid.md §3) and are not read by anything yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.errors import MoelabError
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
    provenance: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Per numeric field: ``"stated: <source>"`` or ``"assumed: <why>"`` (from the file)."""

    def __post_init__(self) -> None:
        for f in ("link_bandwidth_gbs", "gpu_memory_bandwidth_gbs", "cpu_memory_bandwidth_gbs", "decode_layer_time_us"):
            if not getattr(self, f) > 0:
                raise MoelabError(f"HardwareProfile.{f} must be > 0, got {getattr(self, f)!r}.")
        if not self.link_latency_us >= 0:
            raise MoelabError(f"HardwareProfile.link_latency_us must be ≥ 0, got {self.link_latency_us!r}.")
        if not 0.0 <= self.attention_fraction <= 1.0:
            raise MoelabError(f"HardwareProfile.attention_fraction must be in [0, 1], got {self.attention_fraction!r}.")
        if not self.cpu_cores >= 1:
            raise MoelabError(f"HardwareProfile.cpu_cores must be ≥ 1, got {self.cpu_cores!r}.")

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
            from moelab.errors import did_you_mean

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
        ok = isinstance(value, int) if typ is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            want = "an integer" if typ is int else "a number"
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
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise _fail(path, f"not valid YAML/JSON ({msg}); fix the syntax.") from None
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
