"""The predictor registry: kinds selectable by name (``"token"``, ``"skip"``, ``"learned"`` ...).

>>> @register_predictor("my-kind")
... class MyPredictor(Predictor): ...
>>> make_predictor("my-kind", distance=2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moelab.errors import MoelabError, unknown_name
from moelab.predictors.base import Predictor

_REGISTRY: dict[str, type[Predictor]] = {}


def register_predictor(name: str, *, overwrite: bool = False) -> Callable[[type[Predictor]], type[Predictor]]:
    """Class decorator: register a :class:`Predictor` subclass under ``name``."""

    def deco(cls: type[Predictor]) -> type[Predictor]:
        if not (isinstance(cls, type) and issubclass(cls, Predictor)):
            raise MoelabError(f"register_predictor expects a Predictor subclass, got {cls!r}.")
        if name in _REGISTRY and _REGISTRY[name] is not cls and not overwrite:
            raise MoelabError(f"a predictor kind {name!r} is already registered; pass overwrite=True to replace it.")
        cls.kind = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_predictors() -> list[str]:
    """Registered predictor kinds."""
    return list(_REGISTRY)


def get_predictor_class(name: str) -> type[Predictor]:
    """The class registered as ``name`` (did-you-mean error if unknown)."""
    if name not in _REGISTRY:
        raise unknown_name("predictor kind", name, _REGISTRY)
    return _REGISTRY[name]


def make_predictor(name: str | Predictor, **params: Any) -> Predictor:
    """A new predictor of kind ``name`` with hyperparameters ``params`` (an instance passes through)."""
    if isinstance(name, Predictor):
        return name.set_params(**params) if params else name
    cls = get_predictor_class(name)
    names = cls._get_param_names()
    for key in params:
        if key not in names:
            raise unknown_name(f"parameter of the {name!r} predictor", key, names)
    return cls(**params)
