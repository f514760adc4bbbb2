"""The routing-policy registry: policies selectable by name (``"deferral"``, ``"skipping"``).

>>> policy = make_policy("deferral", model, deferred=2)     # = ExpertDeferral(model, deferred=2)
>>> with policy:
...     model.generate(...)

Entries are :class:`~moelab.policies.base.RoutingPolicy` subclasses; the built-ins are lazy
``"module:attr"`` entries, so naming them (the CLI's parser) imports no torch. A policy's
name is its class's ``kind``; its settings are the fields of its ``config_class``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from moelab.errors import MoelabError, unknown_name
from moelab.registry import Registry

if TYPE_CHECKING:
    from moelab.policies.base import RoutingPolicy


def _is_policy_class(obj: Any) -> bool:
    from moelab.policies.base import RoutingPolicy

    return isinstance(obj, type) and issubclass(obj, RoutingPolicy)


#: Routing policies by name (``RoutingPolicy`` subclasses).
POLICIES: Registry[type[RoutingPolicy]] = Registry("routing policy", check=_is_policy_class)
POLICIES.register("deferral", "moelab.policies.deferral:ExpertDeferral")
POLICIES.register("skipping", "moelab.policies.skipping:ExpertSkipping")


def register_policy(name: str, *, overwrite: bool = False):
    """Class decorator: make a :class:`RoutingPolicy` subclass available by ``name``.

    A different class under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    return POLICIES.class_decorator(name, attr="kind", overwrite=overwrite, stacklevel=2)


def available_policies() -> list[str]:
    """Registered routing-policy names."""
    return POLICIES.names()


def policy_params(name: str) -> list[str]:
    """The settings ``make_policy(name, model, ...)`` accepts (its config dataclass's fields)."""
    cls = POLICIES.get(name)
    config = getattr(cls, "config_class", None)
    if config is None or not dataclasses.is_dataclass(config):
        raise MoelabError(
            f"routing policy {name!r} ({cls.__name__}) declares no config_class; set "
            "config_class = <its settings dataclass> on the class."
        )
    return [f.name for f in dataclasses.fields(config)]


def make_policy(name: str, model: Any, **params: Any) -> RoutingPolicy:
    """A new (not yet applied) routing policy ``name`` on ``model`` with settings ``params``.

    Unknown names and unknown settings raise one line with the closest names.
    """
    cls = POLICIES.get(name)
    known = policy_params(name)
    for key in params:
        if key not in known:
            raise unknown_name(f"setting of the {name!r} routing policy", key, known)
    return cls(model, config=cls.config_class(**params))
