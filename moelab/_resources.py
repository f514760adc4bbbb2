"""Where moelab's data directories (``evals/``, ``predictors/``, ``kernels/``) live.

In a source checkout or an editable install they are the top-level folders of the
repository; a built wheel carries copies inside the package (``moelab/_resources/``,
copied by ``setup.py``). Code asks here and never builds those paths itself.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
RESOURCE_DIRS = ("evals", "predictors", "kernels")


def resource_dir(name: str) -> Path:
    """The directory of resource ``name`` (one of ``RESOURCE_DIRS``)."""
    if name not in RESOURCE_DIRS:
        raise ValueError(f"unknown resource {name!r}; expected one of {RESOURCE_DIRS}")
    for candidate in (_PACKAGE / "_resources" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"moelab's {name!r} directory is missing (looked in {_PACKAGE / '_resources'} and "
        f"{_PACKAGE.parent}); reinstall moelab with `pip install .` from a full checkout."
    )
