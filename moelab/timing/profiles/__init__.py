"""The shipped hardware profiles, one YAML file each (schema: :mod:`moelab.timing.profile`).

Registry entries point here as ``"moelab.timing.profiles:NAME"``; the attribute is the
profile parsed from ``NAME.yaml`` on first access (PEP 562 ``__getattr__``), so importing
moelab reads no profile file.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from moelab.errors import MoelabError


@cache
def _load(name: str):
    from moelab.timing.profile import load_profile

    prof = load_profile(Path(__file__).resolve().parent / f"{name}.yaml")
    if prof.name != name:
        raise MoelabError(f"shipped hardware profile {name}.yaml says name: {prof.name!r}; the name must equal the file's stem.")
    return prof


def __getattr__(name: str):
    if name.startswith("__") or not (Path(__file__).resolve().parent / f"{name}.yaml").is_file():
        raise AttributeError(name)
    return _load(name)
