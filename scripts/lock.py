#!/usr/bin/env python3
"""The lock: requirements/lock.txt, a pip constraints file of the exact versions the suite passed on.

    python scripts/lock.py write VENV LOCK   # the lock from VENV's installed versions (after its suite passed)
    python scripts/lock.py diff VENV LOCK    # VENV's versions, and where they differ from LOCK
    python scripts/lock.py check LOCK        # this interpreter's versions against LOCK (exit 1 on drift)
    python scripts/lock.py relax LOCK PKG... # LOCK without the pins of PKG... (scripts/version_matrix.sh)

Why a constraints file (``pip install -c``) and not a requirements lock: pip applies it to
every direct and transitive dependency without installing anything the project does not
ask for, it works beside ``-e .[dev]`` and beside a machine-wide constraint, and it needs no
tool beyond pip (pip-tools and uv resolve torch themselves and fetch CUDA builds). It has no
hashes because pip's hash-checking mode refuses editable installs (``-e .``), which the
README's set-up uses. The versions are those of one platform (CPython 3.11, x86_64 Linux,
the CPU build of torch); other platforms fall back on pyproject.toml's ranges.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

SKIP = {"moelab"}  # the project itself


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _strip_local(version: str) -> str:
    """``2.13.0+cpu`` → ``2.13.0``: ``==2.13.0`` matches the local build and the plain release."""
    return version.split("+", 1)[0]


def installed(python: str | None = None) -> dict[str, str]:
    """Normalised name → version of every distribution in ``python``'s environment."""
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version "
            "for d in m.distributions() if d.metadata['Name']}))")
    out = subprocess.run([python or sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {_norm(k): v for k, v in json.loads(out).items() if _norm(k) not in SKIP}


def read_lock(path: Path) -> dict[str, str]:
    """Normalised name → pinned version of a constraints file (``name==version`` lines)."""
    pins = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if not m:
            raise SystemExit(f"{path}:{n}: expected 'name==version', got {line!r}")
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def _venv_python(venv: str) -> str:
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"{venv}: no virtual environment there (no bin/python); run `make test-latest` first")
    return str(py)


def write(venv: str, lock: str) -> None:
    py = _venv_python(venv)
    pins = installed(py)
    ver = subprocess.run([py, "-c", "import platform; print(platform.python_version())"], check=True,
                         capture_output=True, text=True).stdout.strip()
    lines = [
        "# moelab's lock: the exact versions `make test` passed on (a pip constraints file; README,",
        "# 'Supported versions'). Written by `make lock` (scripts/lock.py) from an environment whose",
        "# suite passed; edit it by hand only to pin a version you have tested.",
        f"# Python {ver}, {platform.system()} {platform.machine()}, {date.today().isoformat()}.",
    ]
    lines += [f"{name}=={_strip_local(v)}" for name, v in sorted(pins.items())]
    target = Path(lock)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".lock.", suffix=".partial")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    print(f"wrote {target}: {len(pins)} pins")


def diff(venv: str, lock: str) -> None:
    have = installed(_venv_python(venv))
    pins = read_lock(Path(lock))
    key = ("transformers", "torch", "lm-eval", "numpy", "pandas", "plotly", "pyarrow", "accelerate", "tokenizers")
    print("resolved: " + ", ".join(f"{k} {have[k]}" for k in key if k in have))
    changed = [(k, pins.get(k), have.get(k)) for k in sorted(set(have) | set(pins))
               if _strip_local(have.get(k, "-")) != pins.get(k, "-")]
    print(f"differences from {lock}: {len(changed)}")
    for k, old, new in changed:
        print(f"  {k}: {old or '(not locked)'} -> {new or '(not installed)'}")


def check(lock: str) -> int:
    have = installed()
    pins = read_lock(Path(lock))
    bad = [f"{k}: installed {have.get(k, '(missing)')}, locked {pins.get(k, '(not locked)')}"
           for k in sorted(set(have) | set(pins)) if _strip_local(have.get(k, "-")) != pins.get(k, "-")]
    for line in bad:
        print(line)
    return 1 if bad else 0


def relax(lock: str, names: list[str]) -> None:
    drop = {_norm(n) for n in names}
    for name, v in sorted(read_lock(Path(lock)).items()):
        if name not in drop:
            print(f"{name}=={v}")


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "write":
        write(argv[1], argv[2])
    elif len(argv) == 3 and argv[0] == "diff":
        diff(argv[1], argv[2])
    elif len(argv) >= 2 and argv[0] == "relax":
        relax(argv[1], argv[2:])
    elif len(argv) == 2 and argv[0] == "check":
        return check(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
