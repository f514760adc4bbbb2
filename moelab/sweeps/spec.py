"""Sweep specs (YAML or dataclasses) and their expansion into cells.

A spec names models × routing policies × tasks × seeds (× hardware profiles, for the
simulated-latency column)::

    name: deferral_vs_skipping
    models: [moelab-tiny-mixtral, moelab-tiny-qwen2moe]
    policies:
      - none                                              # the unmodified model
      - {policy: deferral, min_immediate: 0, grid: {deferred: [1, 2]}}
      - {policy: skipping, min_kept: 0, grid: {skipped: [1, 2]}}
    tasks:
      - {task: arith, limit: 200}
      - {task: pycode, limit: 164}
    seeds: [1234]
    eval: {max_gen_toks: 64, allow_code_execution: true}

This module is the ``eval`` kind's spec (the default ``kind``); other kinds (``cache``,
``predictor``: :mod:`moelab.sweeps.trace_kinds`) are registered in
:mod:`moelab.sweeps.kinds`, and :func:`parse_spec` hands a spec to the kind it names.
``policies`` may also hold ``{policy: hybrid, config: FILE.yaml}`` (a hybrid configuration,
inline or a file relative to the spec), and ``artifacts: {trace: true, timeline: true}``
records each cell's routing trace and a hybrid cell's timeline in the store.
``hardware: [PROFILE, ...]`` (with optional ``simulate: {hybrid: ..., model_shape: ...}``)
gives every cell a simulated latency of its own routing trace per profile
(:mod:`moelab.sweeps.latency`); those inputs enter the cell hash.

``grid`` values are lists to sweep (their cartesian product); other policy keys are fixed
settings (a list there is a per-layer value, as ``ExpertDeferral`` takes it). A cell is one
(model, policy setting, task, seed); its hash covers everything that decides its result
(:func:`cell_key`). Bad input is refused with the file's line and the closest names.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Self

import moelab
from moelab._resources import resource_dir
from moelab.errors import MoelabError, did_you_mean
from moelab.evals.registry import EVAL_TASKS, get_eval_task
from moelab.evals.results import EvalConfig
from moelab.sweeps import policies as pol
from moelab.sweeps.yamlload import load_with_lines, read_text
from moelab.timing import available_profiles, get_profile

#: Bumped when the meaning of a cell key changes (old stores then recompute, never mix).
KEY_VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """A bundled model, ``tiny-random-<family>`` or a local directory (``moelab models``)."""
    dtype: str | None = None
    """Weights dtype (``float32``, ``bf16``, ...); None: the checkpoint's."""


@dataclass(frozen=True)
class PolicySpec:
    name: str
    """``none``, ``deferral`` or ``skipping`` (:func:`moelab.sweeps.policies.policy_names`)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """Fixed settings (the policy config's fields), as sorted pairs."""
    grid: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """Settings to sweep: each name with its values."""
    models: tuple[str, ...] = ()
    """The models this entry applies to (empty: all), e.g. to sweep D = 1..top-k per model."""

    def expand(self) -> list[dict[str, Any]]:
        """One settings dict per grid point (fixed settings included)."""
        base = {k: _thaw(v) for k, v in self.settings}
        if not self.grid:
            return [base]
        names = [k for k, _ in self.grid]
        return [{**base, **dict(zip(names, map(_thaw, combo)))}
                for combo in itertools.product(*(vals for _, vals in self.grid))]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    """A moelab evaluation task (``arith``, ``pycode``, ``gsm8k``, ``humaneval``)."""
    limit: int | None = None
    """Documents scored (the first ``limit``); None: the whole test split."""
    num_fewshot: int | None = None
    """Few-shot examples; None: the task's standard setting."""


@dataclass(frozen=True)
class EvalSettings:
    """Settings of every cell's evaluation (:class:`moelab.evals.EvalConfig` fields)."""

    max_gen_toks: int | None = None
    batch_size: int = 1
    allow_code_execution: bool = False
    code_timeout_s: float = 10.0
    sandbox_isolation: str | None = None
    gsm8k_dir: str | None = None
    humaneval_path: str | None = None


@dataclass
class SpecBase:
    """What every sweep spec has, whatever its kind: the common YAML keys (:data:`COMMON_KEYS`,
    read by :func:`parse_spec` and handed to the kind's ``parse``) and the results store they
    name. Every kind's spec (:class:`SweepSpec`, the trace kinds', the schedule kind's) is a
    subclass; the common fields after ``name`` are keyword-only, so a kind's own required fields
    follow ``name`` in its constructor."""

    name: str
    store: str | None = field(default=None, kw_only=True)
    """The results store directory (None: ``runs/sweeps/<name>``)."""
    retries: int = field(default=1, kw_only=True)
    """Extra attempts of a failed cell before it is reported as failed."""
    description: str = field(default="", kw_only=True)
    source: str | None = field(default=None, kw_only=True)
    """The YAML file this spec was read from."""

    def store_path(self) -> Path:
        """The results store: ``store`` (relative to the spec file) or ``runs/sweeps/<name>``."""
        if self.store is None:
            return Path("runs") / "sweeps" / self.name
        p = Path(self.store).expanduser()
        if not p.is_absolute() and self.source is not None:
            p = Path(self.source).resolve().parent / p
        return p


class StoredCell:
    """What every kind's cell (a dataclass) shares: its form in the results store, a plain dict
    (:meth:`to_dict`), and back (:meth:`from_dict`, which ignores keys the class no longer has)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})  # type: ignore[arg-type]


@dataclass
class SweepSpec(SpecBase):
    models: list[ModelSpec]
    policies: list[PolicySpec]
    tasks: list[TaskSpec]
    seeds: list[int] = field(default_factory=lambda: [1234])
    hardware: list[str] = field(default_factory=list)
    """Hardware profiles (names of ``moelab.timing.available_profiles()``) to simulate each
    cell's own routing trace on (:mod:`moelab.sweeps.latency`): the record's ``latency``."""
    simulate: dict[str, Any] = field(default_factory=dict)
    """How cells are costed on ``hardware``: ``hybrid`` (the HybridConfig dict a routing-policy
    cell is planned under) and ``model_shape`` (model name → ``{shape: NAME, ...}`` override)."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    artifacts: dict[str, bool] = field(default_factory=dict)
    """Per-cell artifacts: ``{trace: true}`` records each cell's routing trace, ``{timeline:
    true}`` a hybrid-config cell's timeline (``events.parquet``), in the cell's store folder."""
    attribution: dict[str, Any] = field(default_factory=dict)
    """``{max_new_tokens: N, limit: M}``: each cell also compares its policy with the unmodified
    model on the task's first ``limit`` prompts, teacher-forced on the baseline's greedy
    generation (:func:`moelab.attribution.compare`); the record's ``attribution`` holds mean KL,
    top-1 agreement, ... (empty: not asked for)."""
    kind = "eval"


@dataclass
class Cell(StoredCell):
    """One unit of work and of the results store: a model × policy setting × task × seed."""

    model: str
    dtype: str | None
    policy: str
    settings: dict[str, Any]
    task: str
    limit: int | None
    num_fewshot: int | None
    seed: int
    eval: dict[str, Any]
    hardware: list[str] = field(default_factory=list)
    simulate: dict[str, Any] = field(default_factory=dict)
    """The latency settings of this cell: ``hybrid`` (a full HybridConfig dict) and
    ``model_shape`` (this model's shape override, or None); empty without ``hardware``."""
    fingerprint: str = ""
    """:func:`moelab.adapters.model_fingerprint` of the model (filled by :func:`expand`)."""
    task_version: str = ""
    hash: str = ""
    artifacts: dict[str, bool] = field(default_factory=dict)
    """Per-cell artifacts to record (``trace``, ``timeline``); not in the hash (they do not
    change the result)."""
    attribution: dict[str, Any] = field(default_factory=dict)
    """The spec's ``attribution:`` settings (empty: none); in the hash when set."""
    kind: str = "eval"

    def resource(self) -> tuple:
        """What a worker keeps loaded between cells: the model."""
        return ("model", self.model, self.dtype)

    def columns(self) -> dict[str, Any]:
        """The store's headline columns of this cell."""
        return {"model": self.model, "policy": self.policy, "affected": self.affected, "task": self.task,
                "seed": self.seed}

    def label(self) -> str:
        s = ",".join(f"{k}={v}" for k, v in self.settings.items() if k in self._shown() and v is not None)
        return f"{self.model} · {self.policy}{'(' + s + ')' if s else ''} · {self.task} · seed {self.seed}"

    def _shown(self) -> set[str]:
        return {"deferred", "immediate", "skipped"}

    @property
    def affected(self) -> int | None:
        return pol.affected(self.policy, self.settings)


# --------------------------------------------------------------------------- keys
def cell_key(cell: Cell, moelab_version: str) -> dict[str, Any]:
    """Everything that decides a cell's result; its sha256 is the cell's hash. A cell with
    hardware profiles adds its latency inputs (profiles' fields, hybrid config, shape)."""
    key = {
        "key_version": KEY_VERSION,
        "model": {"fingerprint": cell.fingerprint, "name": cell.model, "dtype": cell.dtype},
        "policy": {"name": cell.policy, "settings": cell.settings},
        "task": {"name": cell.task, "version": cell.task_version, "limit": cell.limit,
                 "num_fewshot": cell.num_fewshot},
        "seed": cell.seed,
        "eval": cell.eval,
        "moelab": moelab_version,
    }
    if cell.hardware:
        from moelab.sweeps.latency import key as latency_key

        key["latency"] = latency_key(cell.hardware, cell.simulate)
    if cell.attribution:
        key["attribution"] = {**cell.attribution, "method": ATTRIBUTION_METHOD}
    return key


def cell_hash(cell: Cell, moelab_version: str) -> str:
    blob = json.dumps(cell_key(cell, moelab_version), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def task_version(task: str) -> str:
    """The task's definition version: its lm-eval YAML's ``metadata`` (version, data seed)."""
    import yaml

    t = get_eval_task(task)
    path = Path(resource_dir("evals")) / f"{t.lm_eval_task}.yaml"

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: f"!{suffix}")
    meta = (yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader) or {}).get("metadata") or {}
    return json.dumps(meta, sort_keys=True, default=str)


def expand(spec: SweepSpec, fingerprints: dict[str, str]) -> list[Cell]:
    """The spec's cells in a stable order (model, policy, setting, task, seed), each hashed.

    ``fingerprints`` maps each model name to its fingerprint
    (:func:`moelab.sweeps.fingerprints.resolve`).
    """

    _check_counts(spec)
    versions = {t.name: task_version(t.name) for t in spec.tasks}
    ev = asdict(spec.eval)
    cells: list[Cell] = []
    seen: set[str] = set()
    for m in spec.models:
        for p in spec.policies:
            if p.models and m.name not in p.models:
                continue
            for settings in p.expand():
                full = pol.full_settings(p.name, settings)
                for t in spec.tasks:
                    for seed in spec.seeds:
                        cell = Cell(model=m.name, dtype=m.dtype, policy=p.name, settings=full, task=t.name,
                                    limit=t.limit, num_fewshot=t.num_fewshot, seed=seed, eval=ev,
                                    hardware=list(spec.hardware), simulate=_cell_simulate(spec, m.name),
                                    fingerprint=fingerprints[m.name],
                                    task_version=versions[t.name], artifacts=dict(spec.artifacts),
                                    attribution=dict(spec.attribution))
                        cell.hash = cell_hash(cell, moelab.__version__)
                        if cell.hash not in seen:  # the same setting listed twice runs once
                            seen.add(cell.hash)
                            cells.append(cell)
    return cells


#: Settings that count experts per token, which a model can have at most top-k of.
_COUNTS = ("deferred", "skipped", "immediate", "min_immediate", "min_kept")


def _check_counts(spec: SweepSpec) -> None:
    """Refuse expert counts above a model's top-k before any cell is made (a grid of 1,999
    ``deferred`` values for a top-2 model is a typo, not 1,999 cells)."""
    from moelab.sweeps.fingerprints import model_top_k

    for m in spec.models:
        k = None
        for p in spec.policies:
            if p.models and m.name not in p.models:
                continue
            for key, values in [*((k_, [v]) for k_, v in p.settings), *p.grid]:
                if key not in _COUNTS:
                    continue
                for v in values:
                    v = _thaw(v)
                    nums = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, list) else [v]
                    big = [n for n in nums if isinstance(n, int) and not isinstance(n, bool)]
                    if not big:
                        continue
                    if k is None:
                        k = model_top_k(m) or -1
                    if k > 0 and max(big) > k:
                        raise MoelabError(
                            f"policy {p.name!r}: {key}={max(big)} but model {m.name} routes each token to {k} "
                            f"experts; use values 0..{k} (grid values above top-k are refused before any cell "
                            "is made).")


def _cell_simulate(spec: SweepSpec, model: str) -> dict[str, Any]:
    if not spec.hardware:
        return {}
    from moelab.sweeps.latency import hybrid_settings

    out = {"hybrid": hybrid_settings(spec.simulate.get("hybrid")),
           "model_shape": (spec.simulate.get("model_shape") or {}).get(model)}
    if spec.simulate.get("schedule"):  # only when set: the cells of specs without it keep their hashes
        out["schedule"] = dict(spec.simulate["schedule"])
    return out


# --------------------------------------------------------------------------- YAML
#: Keys of every spec, whatever its kind.
COMMON_KEYS = ("name", "kind", "description", "store", "retries")
_EVAL_KEYS = ("models", "policies", "tasks", "seeds", "hardware", "simulate", "eval", "artifacts")
_SIMULATE_KEYS = ("hybrid", "model_shape", "schedule", "prompt", "generate")
_TASK_KEYS = ("task", "limit", "num_fewshot")
_MODEL_KEYS = ("model", "dtype")
_ARTIFACTS = ("trace", "timeline")
_ATTRIBUTION = ("max_new_tokens", "limit", "batch_size")
#: Bumped when the meaning of a cell's attribution figures changes.
ATTRIBUTION_METHOD = "teacher-forced compare v1"


class _Reader:
    def __init__(self, source: str, lines: dict[tuple, int]) -> None:
        self.source, self.lines = source, lines

    def where(self, path: tuple) -> str:
        while path and path not in self.lines:
            path = path[:-1]
        line = self.lines.get(path)
        return f"{self.source}:{line}" if line else self.source

    def fail(self, path: tuple, message: str) -> MoelabError:
        return MoelabError(f"{self.where(path)}: {message}")

    def keys(self, d: Any, path: tuple, allowed: tuple[str, ...] | list[str], what: str) -> dict:
        if not isinstance(d, dict):
            raise self.fail(path, f"{what} must be a mapping (key: value), got {type(d).__name__} {d!r}.")
        for k in d:
            if k not in allowed:
                raise self.fail((*path, k), f"unknown key {k!r} in {what}.{did_you_mean(k, list(allowed))} "
                                            f"Known keys: {', '.join(allowed)}.")
        return d

    def int_or_none(self, v: Any, path: tuple, what: str, low: int) -> int | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self.fail(path, f"{what}={v!r}: expected an integer ≥ {low}.")
        return v

    def listed(self, v: Any, path: tuple, what: str) -> list:
        if v is None:
            return []
        if not isinstance(v, list):
            return [v]
        return v

    def required(self, data: dict, names: tuple[str, ...]) -> None:
        for required in names:
            if required not in data:
                raise self.fail((), f"the sweep spec has no {required!r}; add it (see evals/sweeps/*.yaml).")

    def path(self, v: Any, path: tuple, what: str) -> str:
        """A file or directory named in the spec, relative to the spec file."""
        if not isinstance(v, str) or not v:
            raise self.fail(path, f"{what} {v!r}: expected a path.")
        p = Path(v).expanduser()
        if not p.is_absolute() and Path(self.source).is_file():
            p = Path(self.source).resolve().parent / p
        return str(p)


def parse_spec(data: Any, lines: dict[tuple, int], source: str) -> Any:
    """A spec from parsed YAML (``lines``: value path → line, for errors); its ``kind``
    (default ``eval``: a :class:`SweepSpec`) names the cell kind that reads the rest."""
    from moelab.sweeps.kinds import CELL_KINDS

    r = _Reader(source, lines)
    if not isinstance(data, dict):
        raise r.fail((), f"a sweep spec is a mapping (name: ..., models: ...), got {type(data).__name__}.")
    kind_name = data.get("kind", "eval")
    if kind_name not in CELL_KINDS:
        raise r.fail(("kind",), f"unknown sweep kind {kind_name!r}.{did_you_mean(str(kind_name), CELL_KINDS.names())} "
                                f"Known: {', '.join(CELL_KINDS.names())}.")
    kind = CELL_KINDS.get(kind_name)
    r.keys(data, (), (*COMMON_KEYS, *kind.spec_keys), "the sweep spec")
    r.required(data, ("name",))
    name = data["name"]
    if not isinstance(name, str) or not name or any(c in name for c in "/\\") or name.startswith("."):
        raise r.fail(("name",), f"name={name!r}: expected a plain name (letters, digits, '-', '_').")
    retries = r.int_or_none(data.get("retries", 1), ("retries",), "retries", 0)
    store = data.get("store")
    if store is not None and not isinstance(store, str):
        raise r.fail(("store",), f"store={store!r}: expected a directory path.")
    common = {"name": name, "store": store, "retries": retries or 0,
              "description": str(data.get("description") or ""), "source": source}
    return kind.parse(r, data, common)


def parse_eval_spec(r: _Reader, data: dict, common: dict[str, Any]) -> SweepSpec:
    """The ``eval`` kind's part of a spec: models × policies × tasks × seeds."""
    r.required(data, ("models", "policies", "tasks"))
    models = [_model(r, m, ("models", i)) for i, m in enumerate(r.listed(data["models"], ("models",), "models"))]
    policies = [_policy(r, p, ("policies", i), [m.name for m in models])
                for i, p in enumerate(r.listed(data["policies"], ("policies",), "policies"))]
    tasks = [_task(r, t, ("tasks", i)) for i, t in enumerate(r.listed(data["tasks"], ("tasks",), "tasks"))]
    for what, items in (("models", models), ("policies", policies), ("tasks", tasks)):
        if not items:
            raise r.fail((what,), f"{what} is empty; list at least one.")
    seeds = r.listed(data.get("seeds", [1234]), ("seeds",), "seeds")
    for i, s in enumerate(seeds):
        r.int_or_none(s, ("seeds", i), "seed", 0)
    hardware = r.listed(data.get("hardware"), ("hardware",), "hardware")
    for i, h in enumerate(hardware):
        hardware[i] = _hardware(r, h, ("hardware", i))
    simulate = _simulate(r, data.get("simulate"), [m.name for m in models])
    if simulate and not hardware:
        raise r.fail(("simulate",), "simulate: settings but no hardware: profiles to simulate on; add "
                                    "hardware: [PROFILE, ...] or remove simulate:.")
    ev_fields = [f.name for f in fields(EvalSettings)]
    ev_data = r.keys(data.get("eval") or {}, ("eval",), ev_fields, "eval")
    try:
        ev = EvalSettings(**ev_data)
        EvalConfig(tasks=[t.name for t in tasks], limit=None, num_fewshot=None, seed=0,
                   **{k: v for k, v in asdict(ev).items()})
    except MoelabError as exc:
        raise r.fail(("eval",), str(exc)) from None
    artifacts = r.keys(data.get("artifacts") or {}, ("artifacts",), _ARTIFACTS, "artifacts")
    for k, v in artifacts.items():
        if not isinstance(v, bool):
            raise r.fail(("artifacts", k), f"artifacts {k}={v!r}: expected true or false.")
    attribution = _attribution(r, data.get("attribution"))
    spec = SweepSpec(models=models, policies=policies, tasks=tasks, seeds=seeds, hardware=hardware, eval=ev,
                     artifacts=dict(artifacts), simulate=simulate, attribution=attribution, **common)
    _check_tasks(r, spec)
    return spec


def _attribution(r: _Reader, data: Any) -> dict[str, Any]:
    """The ``attribution:`` block (``true`` or a mapping of max_new_tokens, limit, batch_size)."""
    if data is None or data is False:
        return {}
    if data is True:
        data = {}
    got = dict(r.keys(data, ("attribution",), _ATTRIBUTION, "attribution"))
    out = {"max_new_tokens": 32, "limit": 20, "batch_size": 8}
    for k, v in got.items():
        out[k] = r.int_or_none(v, ("attribution", k), f"attribution {k}", 1)
    return out


def _hardware(r: _Reader, h: Any, path: tuple) -> str:
    """A hardware profile name (unknown: the closest names) or a profile YAML file."""

    if not isinstance(h, str) or not h:
        raise r.fail(path, f"hardware profile {h!r}: expected a profile name ({', '.join(available_profiles())}).")
    if h.endswith((".yaml", ".yml")):
        h = r.path(h, path, "hardware profile")
    elif h not in available_profiles():
        raise r.fail(path, f"unknown hardware profile {h!r}.{did_you_mean(h, available_profiles())} "
                           f"Known: {', '.join(available_profiles())}, or a profile YAML file.")
    try:
        get_profile(h)
    except MoelabError as exc:
        raise r.fail(path, str(exc)) from None
    return h


def _simulate(r: _Reader, data: Any, model_names: list[str]) -> dict[str, Any]:
    """The ``simulate:`` block, checked: ``hybrid`` (a mapping or YAML file of HybridConfig
    fields) and ``model_shape`` (resolved now, so an unknown shape or field names its line)."""
    from moelab.sweeps import latency

    if data is None:
        return {}
    r.keys(data, ("simulate",), _SIMULATE_KEYS, "simulate")
    out: dict[str, Any] = {}
    hybrid = data.get("hybrid")
    if hybrid is not None:
        try:
            if isinstance(hybrid, str):
                from moelab.hybrid.config import HybridConfig

                hybrid = HybridConfig.from_yaml(r.path(hybrid, ("simulate", "hybrid"), "hybrid config")).to_dict()
            out["hybrid"] = latency.hybrid_settings(hybrid)
        except MoelabError as exc:
            raise r.fail(("simulate", "hybrid"), str(exc)) from None
    if data.get("model_shape") is not None:
        try:
            shapes = latency.shape_overrides(data["model_shape"], model_names)
        except MoelabError as exc:
            raise r.fail(("simulate", "model_shape"), str(exc)) from None
        for m, override in shapes.items():
            try:
                latency.resolve_shape(override)
            except MoelabError as exc:
                raise r.fail(("simulate", "model_shape", m), str(exc)) from None
        out["model_shape"] = shapes
    try:
        schedule = latency.schedule_settings(data.get("schedule"), data.get("prompt"), data.get("generate"))
    except MoelabError as exc:
        raise r.fail(("simulate", "schedule"), str(exc)) from None
    if schedule:
        out["schedule"] = schedule
    return out


def _model(r: _Reader, m: Any, path: tuple) -> ModelSpec:
    from moelab.loading import known_model_names, parse_dtype

    if isinstance(m, str):
        m = {"model": m}
    r.keys(m, path, _MODEL_KEYS, "a model entry")
    name = m.get("model")
    if not isinstance(name, str):
        raise r.fail(path, f"model entry {m!r} has no model name; write {{model: NAME}} or just NAME.")
    known = known_model_names()
    if name not in known and not (Path(name).expanduser() / "config.json").is_file():
        raise r.fail((*path, "model") if (*path, "model") in r.lines else path,
                     f"unknown model {name!r}.{did_you_mean(name, known)} Known: {', '.join(known)}, "
                     "or a local directory with a config.json.")
    dtype = m.get("dtype")
    if dtype is not None:
        try:
            parse_dtype(dtype)
        except MoelabError as exc:
            raise r.fail((*path, "dtype"), str(exc)) from None
    return ModelSpec(name=name, dtype=dtype)


def _policy(r: _Reader, p: Any, path: tuple, model_names: list[str]) -> PolicySpec:
    if isinstance(p, str):
        p = {"policy": p}
    if not isinstance(p, dict) or "policy" not in p:
        raise r.fail(path, f"policy entry {p!r}: expected a name ('none') or {{policy: NAME, ...settings}}.")
    name = p["policy"]
    try:
        pol.check_policy_name(name)
    except MoelabError as exc:
        raise r.fail((*path, "policy"), str(exc)) from None
    allowed = ["policy", "grid", "models", *pol.setting_names(name)]
    r.keys(p, path, allowed, f"policy {name!r}")
    grid = p.get("grid") or {}
    r.keys(grid, (*path, "grid"), pol.setting_names(name), f"the grid of policy {name!r}")
    for k, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            raise r.fail((*path, "grid", k), f"grid {k}={vals!r}: expected a non-empty list of values to sweep.")
        if k in p:
            raise r.fail((*path, "grid", k), f"{k!r} is both a fixed setting and in the grid; keep one.")
    fixed = {k: v for k, v in p.items() if k not in ("policy", "grid", "models")}
    if name == pol.HYBRID and isinstance(fixed.get("config"), str):  # a YAML file, relative to the spec
        from moelab.hybrid.config import HybridConfig

        try:
            fixed["config"] = HybridConfig.from_yaml(r.path(fixed["config"], (*path, "config"), "hybrid config"))\
                .to_dict()
        except MoelabError as exc:
            raise r.fail((*path, "config"), str(exc)) from None
    only = p.get("models") or []
    if not isinstance(only, list):
        only = [only]
    for i, m in enumerate(only):
        if m not in model_names:
            raise r.fail((*path, "models", i) if (*path, "models", i) in r.lines else (*path, "models"),
                         f"policy {name!r} names model {m!r}, which is not in the spec's models."
                         f"{did_you_mean(str(m), model_names)} Spec models: {', '.join(model_names)}.")
    spec = PolicySpec(name=name, settings=tuple(sorted((k, _freeze(v)) for k, v in fixed.items())),
                      grid=tuple((k, tuple(_freeze(v) for v in vals)) for k, vals in grid.items()),
                      models=tuple(only))
    for settings in spec.expand():  # every grid point is a valid config (values checked by the policy)
        try:
            pol.full_settings(name, settings)
        except (MoelabError, TypeError) as exc:
            raise r.fail(path, f"policy {name!r} with {settings}: {exc}") from None
    return spec


def _task(r: _Reader, t: Any, path: tuple) -> TaskSpec:
    if isinstance(t, str):
        t = {"task": t}
    r.keys(t, path, _TASK_KEYS, "a task entry")
    name = t.get("task")
    try:
        task = get_eval_task(name)
    except MoelabError:
        raise r.fail((*path, "task") if (*path, "task") in r.lines else path,
                     f"unknown evaluation task {name!r}.{did_you_mean(str(name), list(EVAL_TASKS))} "
                     f"Known: {', '.join(EVAL_TASKS)}.") from None
    limit = r.int_or_none(t.get("limit"), (*path, "limit"), "limit", 1)
    shots = r.int_or_none(t.get("num_fewshot"), (*path, "num_fewshot"), "num_fewshot", 0)
    if shots and not task.fewshot:
        raise r.fail((*path, "num_fewshot"), f"task {task.name!r} is 0-shot only; remove num_fewshot.")
    return TaskSpec(name=task.name, limit=limit, num_fewshot=shots)


def _check_tasks(r: _Reader, spec: SweepSpec) -> None:
    for i, t in enumerate(spec.tasks):
        if get_eval_task(t.name).executes_code and not spec.eval.allow_code_execution:
            raise r.fail(("tasks", i), f"task {t.name!r} runs model-generated code to score it; set "
                                       "eval: {allow_code_execution: true} to run it in moelab's sandbox.")


def load_spec(path: str | os.PathLike) -> Any:
    """Read and check a YAML sweep spec (errors name the file's line and the closest names):
    a :class:`SweepSpec` (``kind: eval``, the default) or a
    :class:`~moelab.sweeps.trace_kinds.TraceSweepSpec` (``kind: cache`` / ``predictor``)."""
    source = str(path)
    data, lines = load_with_lines(read_text(path), source)
    return parse_spec(data, lines, source)


_MAP = "__mapping__"


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return (_MAP, *sorted(((k, _freeze(x)) for k, x in v.items()), key=lambda kv: str(kv[0])))
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple):
        if v and v[0] == _MAP:
            return {k: _thaw(x) for k, x in v[1:]}
        return [_thaw(x) for x in v]
    return v
