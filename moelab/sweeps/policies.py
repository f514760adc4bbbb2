"""The routing policies a sweep can name, behind one small adapter.

A sweep names a policy by ``name`` and settings (``{policy: deferral, deferred: 2}``); this
module checks the settings against the policy's config dataclass (unknown settings get the
closest names), fills in the defaults (so the cell hash covers every setting that decides
the result) and applies the policy to a loaded model.

The adapter is the one place that knows the policy classes: where ``moelab.policies`` has its
registry (``moelab.policies.registry``: ``make_policy(name, model, **params)``, issue #11) the
names, settings and classes come from it, so a registered policy can be swept; otherwise from
the built-in table below. ``_BUILTIN`` also names each policy's "experts affected" setting (the
x axis of deferral-vs-skipping curves). Nothing else in ``moelab.sweeps`` names a policy class.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from moelab.errors import MoelabError, did_you_mean

#: ``none`` is the unmodified model.
NONE = "none"
#: ``hybrid`` applies a hybrid configuration (:class:`moelab.hybrid.HybridConfig`; setting
#: ``config``: its fields as a mapping, or in a spec a YAML file) with :class:`HybridRun`.
HYBRID = "hybrid"

#: name -> (module, policy class, config class, the setting that counts affected experts)
_BUILTIN: dict[str, tuple[str, str, str, str]] = {
    "deferral": ("moelab.policies.deferral", "ExpertDeferral", "DeferralConfig", "deferred"),
    "skipping": ("moelab.policies.skipping", "ExpertSkipping", "SkippingConfig", "skipped"),
}


def _registry() -> Any:
    """``moelab.policies.registry`` where this moelab has it (issue #11), else None."""
    try:
        from moelab.policies import registry
    except ImportError:
        return None
    return registry


def policy_names() -> list[str]:
    reg = _registry()
    return [NONE, *(reg.available_policies() if reg is not None else _BUILTIN), HYBRID]


def _classes(name: str) -> tuple[type, type]:
    reg = _registry()
    if reg is not None:
        cls = reg.POLICIES.get(name)
        return cls, cls.config_class
    import importlib

    module, policy_cls, config_cls, _ = _BUILTIN[name]
    mod = importlib.import_module(module)
    return getattr(mod, policy_cls), getattr(mod, config_cls)


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
    if name not in _BUILTIN:
        return None
    value = settings.get(_BUILTIN[name][3])
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
    reg = _registry()
    if reg is not None:
        return reg.make_policy(name, model, **settings)
    policy_cls, config_cls = _classes(name)
    return policy_cls(model, config=config_cls(**settings))
