"""One registry type for every name → component table in moelab.

Adapters, routing policies, caches, predictors, hardware profiles, tasks, prompt sources,
report sections and experts backends are each a :class:`Registry`. They all behave the
same way (the shape follows lm-eval's ``api/registry.py``):

* an entry is an object or a lazy ``"module:attr"`` string, imported on first use, so
  registering costs no import;
* a base class (or a check function) is enforced when an entry is resolved;
* registering a name twice raises a :class:`~moelab.errors.MoelabError` naming both
  places, unless the object is the same or ``overwrite=True``;
* an unknown name raises one line with the closest names and the full list;
* :meth:`Registry.temporarily` registers inside a ``with`` block and restores what was
  there before, also on exceptions (tests and notebooks use it).

>>> CACHES = Registry("cache policy", base=ExpertCache)
>>> @CACHES.register("lru")
... class LRUCache(ExpertCache): ...
>>> CACHES.register("belady", "moelab.caches.policies:BeladyCache")   # lazy
>>> CACHES.get("lru")
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from moelab.errors import MoelabError, unknown_name

T = TypeVar("T")

_MISSING = object()


@dataclass
class _Entry:
    target: Any  # the object, or a "module:attr" string until resolved
    site: str  # where it was registered, for collision messages
    lazy: bool

    def describe(self) -> str:
        what = self.target if self.lazy else _qualname(self.target)
        return f"{what} (registered at {self.site})"


def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if mod and name:
        return f"{mod}:{name}"
    return repr(obj)


def _caller_site(depth: int) -> str:
    try:
        frame = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stacks
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _resolve(ref: str) -> Any:
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise MoelabError(f"lazy registry entry {ref!r} is not of the form 'package.module:attribute'.")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """A named table of components of one kind (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        *,
        base: type | tuple[type, ...] | None = None,
        check: Callable[[Any], bool] | None = None,
        instances: bool = False,
        loader: Callable[[], None] | None = None,
    ) -> None:
        """``kind`` names entries in messages ("cache policy"); ``base``: entries must be
        subclasses of it (``instances=True``: instances of it); ``check``: any further test;
        ``loader``: called once before the first lookup, to register the built-ins."""
        self.kind = kind
        self.base = base
        self.check = check
        self.instances = instances
        self._entries: dict[str, _Entry] = {}
        self._loader = loader
        self._loading = False

    # ------------------------------------------------------------------ registration
    @overload
    def register(
        self, name: str, obj: None = None, *, overwrite: bool = False, stacklevel: int = 1
    ) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T | str, *, overwrite: bool = False, stacklevel: int = 1) -> T | str: ...

    def register(self, name: str, obj: Any = None, *, overwrite: bool = False, stacklevel: int = 1) -> Any:
        """Register ``obj`` (an object or ``"module:attr"``) as ``name``; a decorator without ``obj``.

        ``stacklevel`` (as in :func:`warnings.warn`): which caller's file:line is recorded as
        the place of registration; a wrapper such as ``register_policy`` passes 2.
        """
        if obj is None:
            site = _caller_site(1 + stacklevel)

            def deco(target: T) -> T:
                self._add(name, target, overwrite, site)
                return target

            return deco
        self._add(name, obj, overwrite, _caller_site(1 + stacklevel))
        return obj

    def class_decorator(self, name: str, *, attr: str, overwrite: bool = False,
                        stacklevel: int = 1) -> Callable[[T], T]:
        """A class decorator registering its class as ``name`` and setting ``cls.<attr> = name``
        (what ``register_policy``/``register_predictor`` return; they pass ``stacklevel=2``)."""
        register = self.register(name, overwrite=overwrite, stacklevel=stacklevel + 1)

        def deco(cls: T) -> T:
            register(cls)
            setattr(cls, attr, name)
            return cls

        return deco

    def _add(self, name: str, obj: Any, overwrite: bool, site: str) -> None:
        if not isinstance(name, str) or not name:
            raise MoelabError(f"a {self.kind} name must be a non-empty string, got {name!r}.")
        lazy = isinstance(obj, str)
        if not lazy:
            self._check(name, obj)
        old = self._entries.get(name)
        if old is not None and not overwrite and not self._same(old, obj):
            raise MoelabError(
                f"{self.kind} {name!r} is already registered as {old.describe()}; registering "
                f"{obj if lazy else _qualname(obj)} at {site} would replace it. Pick another name, "
                "or pass overwrite=True to replace it on purpose."
            )
        self._entries[name] = _Entry(obj, site, lazy)

    @staticmethod
    def _same(old: _Entry, obj: Any) -> bool:
        if old.target is obj:
            return True
        if isinstance(obj, str):
            return old.lazy and old.target == obj
        if old.lazy:
            # a lazy entry that names exactly this object (a module registering itself on import)
            return _qualname(obj) == old.target
        try:  # an equal value (a frozen dataclass built again from the same parts)
            return bool(old.target == obj)
        except Exception:  # noqa: BLE001 - objects whose == does not give a bool
            return False

    def _check(self, name: str, obj: Any) -> None:
        if self.base is not None:
            ok = isinstance(obj, self.base) if self.instances else isinstance(obj, type) and issubclass(obj, self.base)
            if not ok:
                bases = self.base if isinstance(self.base, tuple) else (self.base,)
                want = " or ".join(b.__name__ for b in bases)
                what = "an instance of" if self.instances else "a subclass of"
                raise MoelabError(f"{self.kind} {name!r} must be {what} {want}, got {obj!r}.")
        if self.check is not None and not self.check(obj):
            raise MoelabError(f"{obj!r} is not a valid {self.kind} (registered as {name!r}).")

    def unregister(self, name: str) -> None:
        """Remove ``name`` (unknown names raise)."""
        self._load()
        if name not in self._entries:
            raise unknown_name(self.kind, name, self._entries)
        del self._entries[name]

    @contextmanager
    def temporarily(self, name: str, obj: T | str, *, overwrite: bool = False) -> Iterator[T | str]:
        """Register ``obj`` as ``name`` for the ``with`` block; what was there before comes back."""
        self._load()
        old = self._entries.get(name)
        self._add(name, obj, overwrite, _caller_site(3))
        try:
            yield obj
        finally:
            if old is None:
                self._entries.pop(name, None)
            else:
                self._entries[name] = old

    # ------------------------------------------------------------------ lookup
    def _load(self) -> None:
        if self._loader is not None and not self._loading:
            self._loading = True
            loader, self._loader = self._loader, None
            try:
                loader()
            except BaseException:
                self._loader = loader  # try again next time
                raise
            finally:
                self._loading = False

    def get(self, name: str, default: Any = _MISSING) -> T:
        """The entry registered as ``name``, imported if lazy (did-you-mean error if unknown)."""
        self._load()
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            if default is not _MISSING:
                return default
            raise unknown_name(self.kind, name, self._entries)
        if entry.lazy:
            try:
                obj = _resolve(entry.target)
            except (ImportError, AttributeError) as e:
                raise MoelabError(
                    f"{self.kind} {name!r} points at {entry.target!r}, which cannot be imported: {e}"
                ) from e
            self._check(name, obj)
            entry.target, entry.lazy = obj, False
        return entry.target

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        self._load()
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def items(self) -> list[tuple[str, T]]:
        """(name, entry) pairs, resolving lazy entries."""
        return [(n, self.get(n)) for n in self.names()]

    def site(self, name: str) -> str:
        """Where ``name`` was registered (file:line)."""
        self._load()
        if name not in self._entries:
            raise unknown_name(self.kind, name, self._entries)
        return self._entries[name].site

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} entries)"
