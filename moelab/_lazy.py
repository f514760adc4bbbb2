"""Lazy package attributes (PEP 562), so that importing a package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, table: dict[str, str], namespace: dict[str, Any]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a name to the module defining it.

    A name is imported on first access and cached in the package's ``namespace``; a name
    mapped to ``"<package>.<name>"`` is that subpackage itself (``moelab.attribution``).
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod = importlib.import_module(module)
        value = mod if module == f"{package}.{name}" else getattr(mod, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        # the public API: the lazy names, loaded subpackages, and dunders such as __version__ —
        # not what the package module imported for itself (logging, annotations, this helper)
        import types

        own = {n for n, v in namespace.items()
               if n.startswith("__") or (not n.startswith("_") and isinstance(v, types.ModuleType)
                                         and v.__name__.startswith(package + "."))}
        helpers = {"annotations", "logging", "lazy_attributes"}
        return sorted((own | set(table)) - helpers)

    return __getattr__, __dir__
