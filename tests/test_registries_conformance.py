"""Every name table in moelab is a Registry and behaves the same way.

Unknown name → one line with the closest names; a repeated registration of a different
object → an error naming both places; ``overwrite=True`` replaces; ``temporarily`` restores.
The public ``register_*`` wrappers keep working and share the behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from moelab.errors import MoelabError
from moelab.registry import Registry


@dataclass
class Case:
    name: str
    registry: Callable[[], Registry]
    make: Callable[[str, int], Any]
    """A new valid entry for ``name``; ``variant`` 0 and 1 give two different objects."""
    register: Callable[..., Any]
    """The public wrapper: ``register(name, obj, overwrite=...)``."""


def _adapters() -> Case:
    from moelab.adapters import ADAPTERS, register_adapter
    from moelab.adapters.families import SoftmaxTopKAdapter

    return Case("adapters", lambda: ADAPTERS, lambda n, v: SoftmaxTopKAdapter(n, router_attr=f"gate{v}"),
                lambda n, obj, overwrite=False: register_adapter(obj, overwrite=overwrite))


def _cache_policies() -> Case:
    from moelab.caches import POLICIES, ExpertCache, register_policy

    def make(n, v):
        return type(f"Cache{v}", (ExpertCache,), {"_priority": lambda self, key: (0,)})

    return Case("cache policies", lambda: POLICIES, make,
                lambda n, obj, overwrite=False: register_policy(n, overwrite=overwrite)(obj))


def _predictors() -> Case:
    from moelab.predictors import PREDICTORS, Predictor, register_predictor

    return Case("predictors", lambda: PREDICTORS, lambda n, v: type(f"Pred{v}", (Predictor,), {}),
                lambda n, obj, overwrite=False: register_predictor(n, overwrite=overwrite)(obj))


def _routing_policies() -> Case:
    from moelab.policies import POLICIES, RoutingPolicy, register_policy

    return Case("routing policies", lambda: POLICIES, lambda n, v: type(f"Policy{v}", (RoutingPolicy,), {}),
                lambda n, obj, overwrite=False: register_policy(n, overwrite=overwrite)(obj))


def _tasks() -> Case:
    from moelab.tasks import TASK_SPECS, TaskSpec, register_task

    def make(n, v):
        return TaskSpec(name=n, sample=lambda rng: {"q": str(rng.random())}, key_field="q",
                        default_sizes={"train": v, "validation": 1, "test": 1})

    return Case("tasks", lambda: TASK_SPECS, make,
                lambda n, obj, overwrite=False: register_task(obj, overwrite=overwrite))


def _prompt_sources() -> Case:
    from moelab.prompts import PROMPT_SOURCES, register_prompt_source

    return Case("prompt sources", lambda: PROMPT_SOURCES, lambda n, v: (lambda limit: [str(v)]),
                lambda n, obj, overwrite=False: register_prompt_source(n, obj, overwrite=overwrite))


def _report_sections() -> Case:
    from moelab.report import SECTIONS, ReportSection, register_section

    return Case("report sections", lambda: SECTIONS, lambda n, v: ReportSection(n, lambda ctx: None, order=v),
                lambda n, obj, overwrite=False: register_section(n, obj.fn, obj.order, overwrite=overwrite))


def _eval_tasks() -> Case:
    from moelab.evals.registry import EVAL_TASKS, EvalTask, register_eval_task

    return Case("eval tasks", lambda: EVAL_TASKS,
                lambda n, v: EvalTask(n, f"{n}_lm", f"variant {v}", "synthetic", "acc,none"),
                lambda n, obj, overwrite=False: register_eval_task(obj, overwrite=overwrite))


def _training_presets() -> Case:
    from dataclasses import replace

    from moelab.training.config import PRESETS

    return Case("training presets", lambda: PRESETS, lambda n, v: replace(PRESETS.get("mixtral"), seed=100 + v),
                lambda n, obj, overwrite=False: PRESETS.register(n, obj, overwrite=overwrite))


def _experts_backends() -> Case:
    from moelab.backends import BACKENDS, ExpertsBackend, register_backend

    return Case("experts backends", lambda: BACKENDS, lambda n, v: type(f"Backend{v}", (ExpertsBackend,), {})(),
                lambda n, obj, overwrite=False: register_backend(n, obj, overwrite=overwrite))


def _placements() -> Case:
    from moelab.hybrid.placement import PLACEMENTS, Placement

    return Case("placements", lambda: PLACEMENTS, lambda n, v: type(f"Placement{v}", (Placement,), {}),
                lambda n, obj, overwrite=False: PLACEMENTS.register(n, obj, overwrite=overwrite))


def _model_shapes() -> Case:
    from dataclasses import replace

    from moelab.timing.shapes import SHAPES, get_shape, register_shape

    return Case("model shapes", lambda: SHAPES, lambda n, v: replace(get_shape("mixtral-8x7b"), name=n, top_k=1 + v),
                lambda n, obj, overwrite=False: register_shape(obj, name=n, overwrite=overwrite))


CASES = [_adapters, _cache_policies, _predictors, _routing_policies, _tasks, _prompt_sources,
         _report_sections, _eval_tasks, _training_presets, _experts_backends, _placements, _model_shapes]


@pytest.fixture(params=CASES, ids=lambda f: f.__name__.lstrip("_"))
def case(request) -> Case:
    return request.param()


def test_is_a_registry_with_builtins(case):
    reg = case.registry()
    assert isinstance(reg, Registry) and len(reg) > 0
    for name in reg.names():
        reg.get(name)  # every built-in (lazy ones too) resolves and passes the base check


def test_unknown_name_is_one_line_with_the_closest_name(case):
    reg = case.registry()
    known = reg.names()[0]
    typo = known[:-1] + ("x" if known[-1] != "x" else "y")
    with pytest.raises(MoelabError) as e:
        reg.get(typo)
    msg = str(e.value)
    assert "\n" not in msg and repr(typo) in msg and f"Did you mean {known!r}" in msg


def test_repeated_registration_names_both_places_and_overwrite_replaces(case):
    reg = case.registry()
    name = "conformance-test-entry"
    a, b = case.make(name, 0), case.make(name, 1)
    case.register(name, a)
    try:
        case.register(name, a)  # the same object again is no collision
        with pytest.raises(MoelabError) as e:
            case.register(name, b)
        msg = str(e.value)
        # both places: the first registration and this one are both in this file
        assert msg.count("test_registries_conformance.py") == 2, msg
        assert repr(name) in msg and "overwrite=True" in msg
        assert reg.get(name) is a or reg.get(name) == a
        case.register(name, b, overwrite=True)
        assert reg.get(name) == b and reg.get(name) != a
    finally:
        reg.unregister(name)
    assert name not in reg


def test_a_builtin_cannot_be_replaced_by_accident(case):
    reg = case.registry()
    builtin = reg.names()[0]
    with pytest.raises(MoelabError, match="already registered"):
        case.register(builtin, case.make(builtin, 0))
    assert reg.get(builtin) is not None


def test_temporarily_restores(case):
    reg = case.registry()
    builtin = reg.names()[0]
    before = reg.get(builtin)
    new = case.make(builtin, 1)
    with pytest.raises(RuntimeError), reg.temporarily(builtin, new, overwrite=True):
        assert reg.get(builtin) is new
        raise RuntimeError
    assert reg.get(builtin) is before
    with reg.temporarily("conformance-temp", case.make("conformance-temp", 0)):
        assert "conformance-temp" in reg
    assert "conformance-temp" not in reg


def test_base_check_refuses_the_wrong_kind(case):
    with pytest.raises(MoelabError):
        case.registry().register("conformance-wrong", 42)


def test_a_task_registered_later_is_a_prompt_source():
    from moelab.prompts import PROMPT_SOURCES, prompt_sources, task_prompts
    from moelab.tasks import TASK_SPECS, TaskSpec

    assert "demo" in prompt_sources()  # the first lookup has happened
    spec = TaskSpec(name="conformance-later", sample=lambda rng: {"prompt": f"p{rng.randrange(10**9)}",
                                                                  "canonical_solution": "x"},
                    key_field="prompt", default_sizes={"train": 1, "validation": 1, "test": 1})
    with TASK_SPECS.temporarily("conformance-later", spec):
        try:
            assert "conformance-later" in prompt_sources()
            assert len(task_prompts("conformance-later", limit=2)) == 2
        finally:
            PROMPT_SOURCES.unregister("conformance-later")
