"""The routing policies a sweep can name, behind one small adapter.

A sweep names a policy by ``name`` and settings (``{policy: deferral, deferred: 2}``); this
module checks the settings against the policy's config dataclass (unknown settings get the
closest names), fills in the defaults (so the cell hash covers every setting that decides
the result) and applies the policy to a loaded model.

The adapter is the one place that knows the policy classes: the names, settings and classes come
from ``moelab.policies``' registry (``moelab.policies.registry``), so a registered policy can be
swept. ``_AFFECTED`` names the built-ins' "experts affected" setting (the x axis of
deferral-vs-skipping curves). Nothing else in ``moelab.sweeps`` names a policy class.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from moelab.errors import MoelabError, did_you_mean
from moelab.policies import registry

#: ``none`` is the unmodified model.
NONE = "none"
#: ``hybrid`` applies a hybrid configuration (:class:`moelab.hybrid.HybridConfig`; setting
#: ``config``: its fields as a mapping, or in a spec a YAML file) with :class:`HybridRun`.
HYBRID = "hybrid"

#: policy name -> the setting that counts the experts it affects per token
_AFFECTED: dict[str, str] = {"deferral": "deferred", "skipping": "skipped"}


def policy_names() -> list[str]:
    return [NONE, *registry.available_policies(), HYBRID]


def _classes(name: str) -> tuple[type, type]:
    cls = registry.POLICIES.get(name)
    return cls, cls.config_class


def check_policy_name(name: Any) -> str:
    if name not in policy_names():
        raise MoelabError(
            f"unknown routing policy {name!r}.{did_you_mean(str(name), policy_names())} "
            f"Known: {', '.join(policy_names())}."
        )
    return name


def setting_names(name: str) -> list[str]:
    """The settings ``name`` takes (its config dataclass's fields); none for ``none``."""
    check_policy_name(name)
    if name == NONE:
        return []
    if name == HYBRID:
        return ["config"]
    _, config_cls = _classes(name)
    return [f.name for f in dataclasses.fields(config_cls)]


def full_settings(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` checked (a bad value raises the config's own error) with every default filled in."""
    check_policy_name(name)
    if name == NONE:
        if params:
            raise MoelabError(f"policy 'none' takes no settings; got {', '.join(params)}.")
        return {}
    if name == HYBRID:
        from moelab.hybrid.config import HybridConfig

        if set(params) != {"config"} or not isinstance(params["config"], dict):
            raise MoelabError("policy 'hybrid' takes one setting, config: a hybrid configuration (a YAML file "
                              "or a mapping of HybridConfig fields).")
        return {"config": HybridConfig.from_dict(params["config"]).to_dict()}
    _, config_cls = _classes(name)
    return dataclasses.asdict(config_cls(**params))


def affected(name: str, settings: dict[str, Any]) -> int | None:
    """Experts deferred or skipped per token (the x of a deferral-vs-skipping curve); 0 for
    ``none``; None where the setting is per layer (a list or mapping) or the policy has no count."""
    if name == NONE:
        return 0
    if name not in _AFFECTED:
        return None
    value = settings.get(_AFFECTED[name])
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def make_policy(name: str, model: Any, settings: dict[str, Any]) -> Any:
    """A context manager applying policy ``name`` with ``settings`` to ``model``."""
    check_policy_name(name)
    if name == NONE:
        return contextlib.nullcontext()
    if name == HYBRID:
        from moelab.hybrid.config import HybridConfig
        from moelab.hybrid.runtime import HybridRun

        return HybridRun(model, HybridConfig.from_dict(settings["config"]))
    return registry.make_policy(name, model, **settings)


def offline_policies(name: str, settings: dict[str, Any]) -> list[Any] | None:
    """Policy ``name`` with ``settings`` as :mod:`moelab.policies` objects applied to no model,
    for :func:`moelab.hybrid.offline.plan_routing`'s ``routing_policies`` (so the planner runs
    the cell's own policy, guards included); ``[]`` for ``none``; None for ``hybrid`` (its
    configuration's own ``routing`` applies)."""
    check_policy_name(name)
    if name == NONE:
        return []
    if name == HYBRID:
        return None
    policy_cls, config_cls = _classes(name)
    return [policy_cls(None, config=config_cls(**settings))]
