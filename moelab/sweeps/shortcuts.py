"""The ad-hoc comparisons as sweep specs: ``compare-policies``, the cache sweep, the predictor comparison.

Each command builds a spec (:func:`policy_comparison_spec`, :func:`cache_spec`,
:func:`predictor_spec`) and runs it with the sweep engine (:func:`run_shortcut`): the same
cells, hashes, records and resume as ``moelab sweep run``; with ``--store DIR`` an
interrupted comparison resumes and a repeated one is read back, without it the store is a
temporary directory. The commands then print what they printed before, from the records.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from moelab.errors import MoelabError, unknown_name
from moelab.sweeps.spec import EvalSettings, ModelSpec, PolicySpec, SweepSpec, TaskSpec
from moelab.sweeps.trace_kinds import CACHE_SETTINGS, PREDICTOR_SETTINGS, TraceSweepSpec
from moelab.timing import DEFAULT_PROFILE


def run_shortcut(spec: Any, store: str | os.PathLike | None, *, preload: dict[tuple, Any] | None = None,
                 fingerprints: dict[str, str] | None = None, progress: bool = False,
                 threads: int | None = None) -> list[dict[str, Any]]:
    """Run ``spec`` in this process (into ``store``, or a temporary one) and return its records
    in cell order; the first failed cell's error is raised (a :class:`MoelabError`)."""
    from moelab.sweeps.backends import LocalBackend
    from moelab.sweeps.driver import plan, run_sweep
    from moelab.sweeps.store import open_store

    with tempfile.TemporaryDirectory(prefix="moelab-sweep-") as tmp:
        path = Path(store) if store is not None else Path(tmp) / "store"
        spec.retries = 0
        summary = run_sweep(spec, backend=LocalBackend(threads, preload=preload), store=path, progress=progress,
                            fingerprints=fingerprints, log_failures=False)
        if summary.failed:
            raise MoelabError(next(iter(summary.failed.values())))
        with open_store(path, writable=False) as st:
            cells = plan(spec, st, fingerprints)
            good, _ = st.records()
        return [good[c.hash] for c in cells]


# --------------------------------------------------------------------------- compare-policies
def policy_comparison_spec(model: str, dtype: str | None, tasks: list[str], *, deferred: list[int],
                           skipped: list[int], limit: int | None, phase: str, renormalize: bool,
                           **eval_settings: Any) -> SweepSpec:
    """The cells of ``moelab compare-policies``: unmodified, each deferral and each skipping count.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    policies = [PolicySpec("none")]
    d = tuple(sorted({n for n in deferred if n}))
    s = tuple(sorted({n for n in skipped if n}))
    if d:
        policies.append(PolicySpec("deferral", settings=(("min_immediate", 0), ("phase", phase)),
                                   grid=(("deferred", d),)))
    if s:
        policies.append(PolicySpec("skipping", settings=(("min_kept", 0), ("phase", phase),
                                                         ("renormalize", renormalize)), grid=(("skipped", s),)))
    return SweepSpec(name="compare-policies", models=[ModelSpec(model, dtype)], policies=policies,
                     tasks=[TaskSpec(t, limit=limit) for t in tasks], eval=EvalSettings(**eval_settings))


def run_policy_comparison(spec: SweepSpec, model: Any, tokenizer: Any, *, deferred: list[int], skipped: list[int],
                          phase: str, renormalize: bool, limit: int | None,
                          store: str | os.PathLike | None = None) -> Any:
    """Score ``spec`` (:func:`policy_comparison_spec`) with ``model`` already loaded; every
    policy setting is checked against the model before anything is scored.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.adapters import model_fingerprint
    from moelab.evals.compare import PolicyComparison, comparison_from_scores
    from moelab.sweeps.policies import full_settings, make_policy

    if not deferred and not skipped:
        raise MoelabError("nothing to compare: pass deferred and/or skipped counts, e.g. [0, 1, 2].")
    for p in spec.policies:  # refuse a setting that does not fit the model before scoring anything
        for settings in p.expand():
            with make_policy(p.name, model, full_settings(p.name, settings)):
                pass
    m = spec.models[0]
    records = run_shortcut(spec, store, preload={("model", m.name, m.dtype): (model, tokenizer)},
                           fingerprints={m.name: model_fingerprint(model)}, progress=True)
    tasks = [t.name for t in spec.tasks]
    base: dict[str, tuple] = {}
    runs: dict[tuple[str, int], dict[str, tuple]] = {}
    for r in records:
        c = r["cell"]
        entry = (r["score"], r["n_docs"], r["score_stderr"])
        if c["policy"] == "none":
            base[c["task"]] = entry
        else:
            n = c["settings"]["deferred" if c["policy"] == "deferral" else "skipped"]
            runs.setdefault((c["policy"], n), {})[c["task"]] = entry
    cmp = PolicyComparison(model=m.name, tasks=tasks, phase=phase, renormalize=renormalize,  # type: ignore[arg-type]
                           limit=limit)
    return comparison_from_scores(cmp, base, [(k, n, s) for (k, n), s in runs.items()], deferred, skipped)


# --------------------------------------------------------------------------- cache sweep
def cache_spec(trace: str | os.PathLike, policies: list[str], capacities: list[float | int], scopes: list[str],
               prefetch: dict[str, Any] | None = None, params: dict[str, dict[str, Any]] | None = None,
               **settings: Any) -> TraceSweepSpec:
    """The cells of ``moelab cache simulate``: scopes × policies × capacities (one prefetch setting)."""
    unknown = set(settings) - set(CACHE_SETTINGS)
    if unknown:
        raise MoelabError(f"unknown cache sweep setting(s) {', '.join(sorted(unknown))}; known: "
                          f"{', '.join(CACHE_SETTINGS)}.")
    pf = dict(prefetch) if prefetch else None
    if pf and Path(str(pf["predictor"])).exists():
        pf["predictor"] = str(Path(pf["predictor"]).resolve())
    return TraceSweepSpec(name="cache-sweep", kind="cache", traces=[{"train": str(Path(trace).resolve()), "test": None}],
                          methods=[(p, dict((params or {}).get(p, {}))) for p in policies],
                          points=[{"capacity": c, "scope": s, "prefetch": pf} for s in scopes for c in capacities],
                          settings={**CACHE_SETTINGS, **settings}, seeds=[0])


def run_cache_sweep(spec: TraceSweepSpec, stream: Any = None, store: str | os.PathLike | None = None,
                    progress: bool = False) -> list[Any]:
    """The :class:`~moelab.caches.CacheResult` of every cell of ``spec``, in order; ``stream``:
    the trace's access stream if already loaded (with the spec's prefill, replay and scores)."""
    from moelab.sweeps.trace_kinds import CACHE, cache_result

    preload = None
    if stream is not None:
        preload = {CACHE.expand(spec, None)[0].resource(): stream}
    return [cache_result(r) for r in run_shortcut(spec, store, preload=preload, progress=progress)]


# --------------------------------------------------------------------------- predictor comparison
def predictor_spec(train: str | os.PathLike, test: str | os.PathLike | None = None, *,
                   kinds: list[str], distances: list[int], params: dict[str, dict[str, Any]] | None = None,
                   seed: int = 0, **settings: Any) -> TraceSweepSpec:
    """The cells of ``moelab predict compare`` (:func:`moelab.predictors.compare` as a spec)."""
    from moelab.predictors.registry import available_predictors

    for k in [*kinds, *(params or {})]:
        if k not in available_predictors():
            raise unknown_name("predictor kind", k, available_predictors())
    if not kinds or not distances or any(d < 1 for d in distances):
        raise MoelabError(f"kinds={kinds!r}, distances={distances!r}: expected at least one kind and distances ≥ 1.")
    from moelab.predictors.registry import make_predictor

    for k in kinds:  # bad hyperparameters fail before any cell runs
        make_predictor(k, distance=1, **(params or {}).get(k, {}))
    unknown = set(settings) - set(PREDICTOR_SETTINGS)
    if unknown:
        raise MoelabError(f"unknown predictor comparison setting(s) {', '.join(sorted(unknown))}; known: "
                          f"{', '.join(PREDICTOR_SETTINGS)}.")
    full = {**PREDICTOR_SETTINGS, **{k: v for k, v in settings.items() if v is not None}}
    full["hardware"] = full["hardware"] or DEFAULT_PROFILE
    return TraceSweepSpec(
        name="predictor-compare", kind="predictor",
        traces=[{"train": str(Path(train).resolve()), "test": str(Path(test).resolve()) if test else None}],
        methods=[(k, dict((params or {}).get(k, {}))) for k in kinds], points=[{"distance": d} for d in distances],
        settings=full, seeds=[seed])


def run_predictor_comparison(spec: TraceSweepSpec, store: str | os.PathLike | None = None,
                             progress: bool = True) -> list[dict[str, Any]]:
    """Per cell of ``spec`` (:func:`predictor_spec`), in order: ``kind``, ``distance``, ``seed``
    and the prediction report (:meth:`moelab.predictors.PredictionReport.to_dict`)."""
    return [{"kind": r["cell"]["method"], "distance": r["cell"]["point"]["distance"], "seed": r["cell"]["seed"],
             **r["metrics"]} for r in run_shortcut(spec, store, progress=progress)]
