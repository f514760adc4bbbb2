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
from moelab.registry import Registry


def _load_builtins() -> None:
    from moelab.predictors import baselines, learned, skip, token  # noqa: F401  (they register the built-in kinds)


#: Predictor kinds by name (``Predictor`` subclasses).
PREDICTORS: Registry[type[Predictor]] = Registry("predictor kind", base=Predictor, loader=_load_builtins)


def register_predictor(name: str, *, overwrite: bool = False) -> Callable[[type[Predictor]], type[Predictor]]:
    """Class decorator: register a :class:`Predictor` subclass under ``name``.

    A different class under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    register = PREDICTORS.class_decorator(name, attr="kind", overwrite=overwrite, stacklevel=2)

    def deco(cls: type[Predictor]) -> type[Predictor]:
        if not (isinstance(cls, type) and issubclass(cls, Predictor)):
            raise MoelabError(f"register_predictor expects a Predictor subclass, got {cls!r}.")
        return register(cls)

    return deco


def available_predictors() -> list[str]:
    """Registered predictor kinds."""
    return PREDICTORS.names()


def get_predictor_class(name: str) -> type[Predictor]:
    """The class registered as ``name`` (did-you-mean error if unknown)."""
    return PREDICTORS.get(name)


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
