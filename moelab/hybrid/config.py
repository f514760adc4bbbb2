"""``HybridConfig``: one object describing a hybrid CPU/GPU configuration, from Python or YAML.

>>> cfg = HybridConfig.from_dict({"cache": {"capacity": 0.25, "policy": "mrs"},
...                               "placement": "greedy-hss",
...                               "routing": {"deferred": 2}})
>>> cfg = HybridConfig.from_yaml("hybrid.yaml")

Unknown keys anywhere are refused with the closest valid name; values are checked when
the configuration is applied to a model (capacities against its experts, a predictor
against its fingerprint).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moelab.caches.prefetch import PrefetchConfig
from moelab.errors import MoelabError, did_you_mean, unknown_name
from moelab.hybrid.executors import available_executors
from moelab.timing import available_profiles

DEVICES = ("auto", "cpu", "cuda")
#: ``HybridConfig.planner`` values.
PLANNERS = ("auto", "compiled", "reference")
#: ``cache.admission`` values (see :class:`CacheConfig`).
ADMISSIONS = ("placement", "all")
#: ``cache.warm`` values (see :class:`CacheConfig`).
WARM_STARTS = ("empty", "frequency", "trace")


@dataclass
class CacheConfig:
    """The device-resident expert set."""

    capacity: float | int = 0.25
    """Experts resident on the device: a fraction of each layer's experts (float in (0, 1])
    or a count (int); 0 keeps nothing on the device."""
    policy: str = "lru"
    """Cache policy (a registered name: ``lru``, ``lfu``, ``fifo``, ``mrs``, ``static`` …)."""
    scope: str = "layer"
    """``layer``: each MoE layer its own slots; ``global``: one pool for all layers."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of the policy (e.g. ``alpha`` for ``mrs``)."""
    admission: str = "placement"
    """Which misses enter the cache: ``placement`` (only those the placement runs on the device —
    fetched misses — and prefetches; a miss computed on the host is not copied, as in
    KTransformers and HybriMoE) or ``all`` (every miss; host misses are copied in after they ran,
    as low-priority ``insert`` transfers behind demand and prefetch copies)."""
    warm: str = "empty"
    """What the cache holds before the first forward: ``empty``; ``frequency`` (each partition's
    most frequently needed experts, counted over ``warm_from`` or, offline, the routing being
    planned — with capacity 1.0, every expert); or ``trace`` (the contents one planning pass over
    that routing leaves: the steady state)."""
    warm_from: str | None = None
    """A routing trace directory to count ``frequency``/replay ``trace`` over; required by a running
    model with ``warm`` other than ``empty`` (offline planning defaults to its own routing)."""

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise MoelabError(f"cache.admission={self.admission!r}: expected one of {', '.join(ADMISSIONS)}."
                              f"{did_you_mean(str(self.admission), ADMISSIONS)}")
        if self.warm not in WARM_STARTS:
            raise MoelabError(f"cache.warm={self.warm!r}: expected one of {', '.join(WARM_STARTS)}."
                              f"{did_you_mean(str(self.warm), WARM_STARTS)}")


@dataclass
class RoutingConfig:
    """Deferral and skipping in a hybrid configuration: the YAML face of the routing policies'
    own configurations, which define every setting (:class:`moelab.policies.DeferralConfig`,
    :class:`moelab.policies.SkippingConfig`). :meth:`deferral` and :meth:`skipping` give them;
    the running model, the offline planner and the what-if grids all build their policies from
    those, so a deferral count means one thing everywhere."""

    deferred: int | list[int] | dict[int, int] = 0
    """Experts deferred per token (:attr:`moelab.policies.DeferralConfig.deferred`); 0: none."""
    skipped: int | list[int] | dict[int, int] = 0
    """Experts skipped per token (:attr:`moelab.policies.SkippingConfig.skipped`); 0: none."""
    phase: str = "decode"
    """Forwards both policies act in: ``decode`` or ``all``."""
    min_immediate: int = 2
    """Deferral's guard (:attr:`moelab.policies.DeferralConfig.min_immediate`)."""

    def deferral(self):
        """The :class:`moelab.policies.DeferralConfig` of these settings, or None (nothing deferred)."""
        from moelab.policies.deferral import DeferralConfig

        if not self.deferred:
            return None
        return DeferralConfig(deferred=self.deferred, phase=self.phase, min_immediate=self.min_immediate)

    def skipping(self):
        """The :class:`moelab.policies.SkippingConfig` of these settings, or None (nothing skipped)."""
        from moelab.policies.skipping import SkippingConfig

        if not self.skipped:
            return None
        return SkippingConfig(skipped=self.skipped, phase=self.phase)


@dataclass
class HybridConfig:
    """A hybrid CPU/GPU configuration (see the module docstring)."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    placement: str = "host-misses"
    """How misses run: ``host-misses``, ``fetch-misses``, ``greedy-hss``, ``min-cost``."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    device_backend: str | None = None
    """Experts backend of the device side (None: the model's own experts implementation)."""
    host_backend: str | None = None
    """Experts backend of the host side (None: the model's own experts implementation)."""
    executor: str = "functional"
    """A registered executor (:mod:`moelab.hybrid.executors`): ``functional`` (exact outputs,
    plans only), ``real`` (plans run on concurrent lanes with measured timestamps:
    :mod:`moelab.hybrid.real`; CUDA lanes on a GPU), ``cuda`` (the CUDA lanes, refused without a
    GPU) or ``simulated`` (functional outputs; each forward's plans simulated on ``hardware`` with
    the live model's shape, the simulated events written to the run's event log:
    :mod:`moelab.simulate.online`)."""
    device: str = "auto"
    """Where the real executor's device lane runs: ``cuda`` (a CUDA stream, a GPU expert pool,
    the model's dense parts moved to the GPU while the run is applied), ``cpu`` (a CPU worker
    standing in for the device), or ``auto`` (``cuda`` when a GPU is available and the executor
    is ``real``, else ``cpu``; :meth:`resolved_device`). The functional executor computes where
    the model is."""
    hardware: str | None = None
    """Hardware profile (a name of ``moelab.timing.available_profiles()`` or a profile YAML
    file), for placements that need a cost model."""
    planner: str = "auto"
    """Which per-layer planner plans (:mod:`moelab.hybrid._compiled`; both plan identically):
    ``compiled`` (numba, where the configuration allows it, else an error), ``reference`` (the
    Python planner), or ``auto``: compiled for the ``real`` and ``cuda`` executors, whose per-layer
    speed is what it is for, where the configuration allows it; the reference for the functional
    and simulated executors and offline planning, where a process's first compiled plan (loading
    numba and the planner's cached machine code, 1–2 s here) would outweigh what it saves. ``$MOELAB_PLANNER`` overrides it."""

    def __post_init__(self) -> None:
        names = available_executors()
        if self.executor not in names:
            raise MoelabError(
                f"executor {self.executor!r} is not available;{did_you_mean(self.executor, names)} "
                f"expected one of {', '.join(names)}."
            )
        if self.device not in DEVICES:
            raise MoelabError(f"device {self.device!r}: expected one of {', '.join(DEVICES)}.")
        if self.planner not in PLANNERS:
            raise MoelabError(f"planner {self.planner!r}: expected one of {', '.join(PLANNERS)}."
                              f"{did_you_mean(str(self.planner), PLANNERS)}")
        if self.executor == "cuda" and self.device == "cpu":
            raise MoelabError("executor 'cuda' runs its device lane on a GPU, but device is 'cpu'; use executor: "
                              "real with device: cpu (a CPU worker stands in for the device), or device: auto.")
        named_profile = isinstance(self.hardware, str) and not self.hardware.endswith((".yaml", ".yml", ".json"))
        if named_profile and self.hardware not in available_profiles():  # checked for every executor, not only when costed
            raise unknown_name("hardware profile", self.hardware, available_profiles())
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise MoelabError("device='cuda' but no CUDA GPU is available here; use device='auto' or 'cpu'.")

    def resolved_device(self) -> str:
        """``cuda`` or ``cpu``: the device this configuration runs its device lane on here."""
        if self.device == "auto":
            import torch

            if self.executor == "cuda":
                return "cuda"
            return "cuda" if self.executor == "real" and torch.cuda.is_available() else "cpu"
        return self.device

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, where: str = "hybrid config") -> HybridConfig:
        """A config from plain data; unknown keys raise naming the closest valid key."""
        return _build(cls, data or {}, where)

    @classmethod
    def from_yaml(cls, path: str | Path) -> HybridConfig:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise MoelabError(f"hybrid config {str(p)!r} does not exist; pass a YAML file.")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise MoelabError(f"hybrid config {str(p)!r} is not UTF-8 text (byte {e.start}); pass a YAML file.") from None
        except yaml.YAMLError as e:
            raise MoelabError(f"hybrid config {str(p)!r} is not valid YAML: {e}") from e
        if data is not None and not isinstance(data, dict):
            raise MoelabError(f"hybrid config {str(p)!r} must be a mapping of settings, got {type(data).__name__}.")
        return cls.from_dict(data, where=str(p))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise MoelabError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}.")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise MoelabError(
                f"{where}: unknown key {key!r}.{did_you_mean(key, known)} Valid keys: {', '.join(known)}."
            )
        sub = _NESTED.get((cls.__name__, key))
        kwargs[key] = _build(sub, value, f"{where}.{key}") if sub is not None else value
    return cls(**kwargs)


_NESTED = {
    ("HybridConfig", "cache"): CacheConfig,
    ("HybridConfig", "prefetch"): PrefetchConfig,
    ("HybridConfig", "routing"): RoutingConfig,
}
