"""The one Registry type: lazy entries, base checks, collisions, did-you-mean, scoped registration."""

from __future__ import annotations

import pytest

from moelab.errors import MoelabError
from moelab.registry import Registry


class Base:
    pass


class A(Base):
    pass


class B(Base):
    pass


def test_register_get_decorator_and_lazy():
    r: Registry[type[Base]] = Registry("widget", base=Base)
    r.register("a", A)

    @r.register("b")
    class C(Base):
        pass

    r.register("lazy", "moelab.registry:Registry")
    with pytest.raises(MoelabError, match="must be a subclass of Base"):
        r["lazy"]
    exc = Registry("error", base=Exception)
    exc.register("lazy", "moelab.errors:MoelabError")
    assert exc["lazy"] is MoelabError
    assert r.get("a") is A and r.get("b") is C
    assert r.names() == ["a", "b", "lazy"] and "a" in r and "zz" not in r and len(r) == 3


def test_collision_names_both_places_and_overwrite():
    r = Registry("widget", base=Base)
    r.register("a", A)
    r.register("a", A)  # the same object again is not a collision
    with pytest.raises(MoelabError) as e:
        r.register("a", B)
    msg = str(e.value)
    assert "'a'" in msg and ":A" in msg and "test_registry.py" in msg and "overwrite=True" in msg
    r.register("a", B, overwrite=True)
    assert r.get("a") is B


def test_unknown_name_did_you_mean():
    r = Registry("widget", base=Base)
    r.register("alpha", A)
    with pytest.raises(MoelabError, match=r"unknown widget 'alpah'\. Did you mean 'alpha'\?"):
        r.get("alpah")
    assert r.get("nope", None) is None


def test_base_check_on_register_and_on_lazy_resolve():
    r = Registry("widget", base=Base)
    with pytest.raises(MoelabError, match="must be a subclass of Base"):
        r.register("x", int)
    r.register("bad", "builtins:int")
    with pytest.raises(MoelabError, match="must be a subclass of Base"):
        r.get("bad")
    r.register("missing", "moelab.no_such_module:X")
    with pytest.raises(MoelabError, match="cannot be imported"):
        r.get("missing")
    inst = Registry("thing", base=Base, instances=True)
    inst.register("a", A())
    with pytest.raises(MoelabError, match="an instance of Base"):
        inst.register("b", A)


def test_temporarily_restores_also_on_error():
    r = Registry("widget", base=Base)
    r.register("a", A)
    with pytest.raises(RuntimeError), r.temporarily("a", B, overwrite=True):
        assert r.get("a") is B
        raise RuntimeError
    assert r.get("a") is A
    with r.temporarily("new", B):
        assert "new" in r
    assert "new" not in r


def test_loader_runs_once_before_lookup():
    calls = []

    def load():
        calls.append(1)
        r.register("builtin", A)

    r = Registry("widget", base=Base, loader=load)
    assert r.names() == ["builtin"] and r.get("builtin") is A
    assert calls == [1]
