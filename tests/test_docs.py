"""The documentation site builds with ``mkdocs build --strict``: no broken link or anchor, no page
left out of the navigation, no missing recipe snippet, and no docstring the API reference
(mkdocstrings, Google style) cannot render — any warning fails the build. The recipes the pages
include are executed by tests/test_recipes.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.mark.slow
@pytest.mark.xdist_group("docs")  # one site build per worker group (with `--dist loadgroup`)
def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs toolchain is in the dev extra (make install)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about its successor
    t0 = time.perf_counter()
    # run from the root: the recipe snippets (--8<--) and the griffe extension are found from there
    got = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    assert got.returncode == 0, f"mkdocs build --strict failed ({took:.0f} s):\n{got.stdout}\n{got.stderr}"
    site = tmp_path / "site"
    for page in ("index.html", "tour/index.html", "api/caches/index.html", "recipes/cache-policy/index.html",
                 "reference/index.html", "reference/caches/index.html"):
        assert (site / page).is_file(), f"the build wrote no {page}"
    api = (site / "api" / "caches" / "index.html").read_text(encoding="utf-8")
    assert "register_policy" in api and ":class:`" not in api  # docstrings rendered, reST roles converted
    recipe = (site / "recipes" / "cache-policy" / "index.html").read_text(encoding="utf-8")
    assert "MRUCache" in recipe and "--8&lt;--" not in recipe  # the snippet was included, not quoted
    assert not list(site.rglob("*.py")), "recipe sources are included into pages, not published as files"


def test_readme_links_existing_docs_pages():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Documentation" in readme
    linked = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert linked, "the README's Documentation section links no docs page"
    for path in linked:
        assert (ROOT / path).is_file(), f"README links {path}, which does not exist"
    # the README's reference sections moved to docs/reference/: its Documentation section lists each
    reference = {p.relative_to(ROOT).as_posix() for p in (DOCS / "reference").glob("*.md")}
    assert reference and reference <= set(linked), f"README links no {sorted(reference - set(linked))}"
