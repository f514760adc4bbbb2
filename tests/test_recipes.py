"""The contributor recipes of the documentation run as written: each ``docs/recipes/<name>.py`` is
executed (``runpy``, as ``__main__``, in a temporary working directory) and what it produced is
checked. The pages include these files verbatim (``--8<--``), so a recipe that drifts from the
code fails here.

Each recipe registers something (a cache policy, a placement, a predictor kind, a hardware
profile, a family adapter); the names it added are removed afterwards so that other tests see
the registries as they were.
"""

from __future__ import annotations

import runpy
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "docs" / "recipes"
PAGES = ROOT / "docs" / "recipes"
MAX_LINES = 40  # a recipe is one complete example a reader takes in at once


def _registries():
    from moelab.adapters import ADAPTERS
    from moelab.caches import POLICIES
    from moelab.hybrid.placement import PLACEMENTS
    from moelab.predictors import PREDICTORS
    from moelab.timing import PROFILES

    return (ADAPTERS, POLICIES, PLACEMENTS, PREDICTORS, PROFILES)


@pytest.fixture
def run_recipe(tmp_path, monkeypatch):
    """Run one recipe in ``tmp_path`` (temporary directories it makes go there too); returns
    its globals. Names it registered are unregistered afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    registries = _registries()
    before = [set(r.names()) for r in registries]

    def run(name: str) -> dict:
        return runpy.run_path(str(RECIPES / f"{name}.py"), run_name="__main__")

    yield run
    for registry, names in zip(registries, before):
        for added in set(registry.names()) - names:
            registry.unregister(added)


def test_every_recipe_is_short_and_included_by_its_page():
    recipes = sorted(RECIPES.glob("*.py"))
    assert {p.stem for p in recipes} == {"cache_policy", "placement", "predictor", "hardware_profile", "model_family"}
    for path in recipes:
        n = len(path.read_text(encoding="utf-8").splitlines())
        assert n < MAX_LINES, f"{path.name} has {n} lines; a recipe stays under {MAX_LINES}"
        page = PAGES / f"{path.stem.replace('_', '-')}.md"
        assert page.is_file(), f"{path.name} has no page {page.relative_to(ROOT)}"
        assert f'--8<-- "docs/recipes/{path.name}"' in page.read_text(encoding="utf-8"), (
            f"{page.name} does not include {path.name} (a snippet line --8<-- \"docs/recipes/{path.name}\")")


def test_cache_policy_recipe(run_recipe):
    from moelab.caches import POLICIES

    g = run_recipe("cache_policy")
    assert g["MRUCache"].name == "mru"
    # 0 m; 1 m; 2 m evicts 1 (most recent) -> [0 2]; 0 h; 1 m evicts 0 -> [2 1]; 2 h
    assert g["online"] == [False, False, False, True, False, True]
    assert g["cache"].contents(0) == [1, 2]
    rate = g["hit_rate"]
    assert rate["lru"] == 0.0  # a cyclic scan one larger than the cache: LRU evicts what comes next
    assert rate["mru"] == pytest.approx(rate["belady"]) and rate["mru"] > 0.45
    assert "mru" in POLICIES


def test_placement_recipe(run_recipe):
    g = run_recipe("placement")
    prefill, decode = g["plans"]
    assert prefill.device == [(0, 2), (1, 2)] and prefill.host == [(3, 1), (2, 1)]  # shared misses fetched
    assert [(t.expert, t.priority) for t in prefill.transfers] == [(0, "demand"), (1, "demand")]
    assert decode.device == [] and decode.host == [(2, 1), (3, 1)] and decode.transfers == []


def test_predictor_recipe(run_recipe):
    g = run_recipe("predictor")
    p = g["CentroidPredictor"]
    assert p.kind == "centroid" and p.needs_hidden
    acc = g["accuracy"]
    assert set(acc) == {"frequency", "centroid"}
    assert 0.0 <= acc["frequency"] < acc["centroid"] <= 1.0  # the router input predicts the next layer


def test_hardware_profile_recipe(run_recipe, tmp_path):
    from moelab.caches import PrefetchConfig
    from moelab.timing import load_profile

    g = run_recipe("hardware_profile")
    mine = g["mine"]
    assert mine.name == "my-box" and mine.link.bandwidth_gbs == 15.75 * 0.76  # nominal × efficiency
    assert mine.provenance["link_efficiency"].startswith("assumed: ")
    base_hw = g["get_profile"]("rtx4090-desktop")  # inherited fields keep the base's numbers and sources
    assert (mine.cpu_cores, mine.provenance["cpu_cores"]) == (base_hw.cpu_cores, base_hw.provenance["cpu_cores"])
    assert load_profile(tmp_path / "my-box.yaml") == mine  # the file it wrote is a valid profile
    base = PrefetchConfig.from_profile("rtx4090-desktop", num_layers=26).experts_budget(g["expert"])
    assert g["name"] == "my-box" and 0 < g["budget"] < base  # a slower link moves fewer experts per step


def test_model_family_recipe(run_recipe):
    g = run_recipe("model_family")
    trace = g["rec"].trace
    assert trace.meta["model"]["model_type"] == "flex_olmo"
    assert trace.num_moe_layers == 2 and trace.expert_load(phase="decode").shape == (2, 8)
    assert trace.expert_load(phase="decode").sum() == 2 * 2 * 2 * 3  # layers × rows × top-k × decode steps
