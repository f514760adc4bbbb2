"""The README and the reference pages are executable documentation: their ``bash`` and ``python``
blocks run as written.

The pages are those of :data:`PAGES`, in that fixed order: ``README.md``, then the pages of
``docs/reference/`` in the order their sections had in the README (the order of the site's
"Reference" navigation and of ``docs/reference/index.md``). Blocks run page after page, each
page top to bottom, all in one temporary working directory, as a reader following along would
run them: a later block may read what an earlier one wrote, also on an earlier page (the
README's short example records ``traces/run1``, which ``docs/reference/caches.md`` and
``simulator-inputs.md`` read; ``hybrid.md`` writes ``runs/h1``, which ``timelines.md`` reads).
Each Python block runs in a fresh interpreter, each shell command with ``moelab`` and
``python`` on ``PATH`` resolving to this checkout. Fences without a language (file listings,
synopses) are not code. A failure names the page and the line of the block's opening fence.

An HTML comment right before a fence adjusts how its block runs (directives separated by ``;``,
each ``NAME: VALUE``)::

    <!-- readme-test: skip: REASON -->               the block is not run (needs data, minutes)
    <!-- readme-test: replace: OLD => NEW -->        textual substitution before running
                                                     (placeholders, smaller --limit); repeatable
    <!-- readme-test: skip-line: TEXT (REASON) -->   shell commands containing TEXT are not run
    <!-- readme-test: xfail-line: TEXT (REASON) -->  shell commands containing TEXT are known to
                                                     fail (a bug being fixed): they must fail, and
                                                     once they pass the marker has to go

so a page that drifts from the code fails here. Replacements keep the runs small (``--limit 1``,
short generations); all pages together run in about five minutes on two cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The pages whose blocks run, in this order (paths relative to the repository root): the README,
#: then the reference pages in the order their sections had in the README, so that files written
#: by earlier blocks exist for later ones. A new reference page is added here and to mkdocs.yml's
#: "Reference" navigation at the same place (test_every_reference_page_runs_in_nav_order).
PAGES = (
    "README.md",
    "docs/reference/forward.md",
    "docs/reference/traces.md",
    "docs/reference/development.md",
    "docs/reference/lm-eval.md",
    "docs/reference/routing-policies.md",
    "docs/reference/sweeps.md",
    "docs/reference/kernels.md",
    "docs/reference/fp8.md",
    "docs/reference/attribution.md",
    "docs/reference/predictors.md",
    "docs/reference/caches.md",
    "docs/reference/hybrid.md",
    "docs/reference/timelines.md",
    "docs/reference/simulator.md",
    "docs/reference/simulator-inputs.md",
    "docs/reference/simulator-whatif.md",
    "docs/reference/simulator-throughput.md",
    "docs/reference/bundled-models.md",
)
LANGS = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "python": "python", "py": "python"}
MARKER = re.compile(r"<!--\s*readme-test:(.*?)-->", re.S)
DIRECTIVE_SPLIT = re.compile(r";\s*(?=(?:skip|replace|skip-line|xfail-line)\s*:)")  # a reason may hold ";"


@dataclass
class Block:
    page: str  # the file, relative to the repository root
    line: int  # of the opening fence, 1-based
    kind: str  # "shell" or "python"
    code: str
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)
    skip_lines: list[str] = field(default_factory=list)
    xfail_lines: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    def source(self) -> str:
        code = self.code
        for old, new in self.replace:
            assert old in code, f"{self.where}: replace target {old!r} not in the block"
            code = code.replace(old, new)
        return code


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The runnable blocks of one page, top to bottom, with the directives before each."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        kind = LANGS.get(m.group(1).lower())
        if kind:
            block = Block(page=page, line=start + 1, kind=kind, code="\n".join(lines[start + 1 : j]) + "\n")
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            # the marker comment may span several lines ending right before the fence
            end = k
            while k >= 0 and "<!--" not in lines[k] and "-->" in lines[end] and end - k < 10:
                k -= 1
            comment = "\n".join(lines[k : end + 1]) if k >= 0 else ""
            mm = MARKER.search(comment) if comment.rstrip().endswith("-->") else None
            if mm:
                for directive in (d.strip() for d in DIRECTIVE_SPLIT.split(mm.group(1))):
                    key, _, value = directive.partition(":")
                    key, value = key.strip(), value.strip()
                    if key == "skip":
                        block.skip = value or "marked skip"
                    elif key == "replace":
                        old, sep, new = value.partition("=>")
                        assert sep, f"{block.where}: replace needs OLD => NEW, got {value!r}"
                        block.replace.append((old.strip(), new.strip()))
                    elif key == "skip-line":
                        block.skip_lines.append(value.split(" (", 1)[0].strip())
                    elif key == "xfail-line":
                        text, _, reason = value.partition(" (")
                        block.xfail_lines.append((text.strip(), reason.rstrip(")").strip()))
                    elif key:
                        raise AssertionError(f"{block.where}: unknown readme-test directive {key!r}")
            blocks.append(block)
        i = j + 1
    return blocks


def shell_commands(code: str) -> list[str]:
    """One entry per command: continuation lines joined, comments and blank lines dropped."""
    out, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


BLOCKS = [block for page in PAGES for block in readme_blocks((ROOT / page).read_text(encoding="utf-8"), page)]


def test_readme_has_code_blocks_and_most_run():
    assert len(BLOCKS) >= 10
    assert any(b.page == "README.md" and b.skip is None for b in BLOCKS)
    run = [b for b in BLOCKS if b.skip is None]
    assert len(run) >= len(BLOCKS) // 2, [(b.where, b.skip) for b in BLOCKS if b.skip]


def test_every_reference_page_runs_in_nav_order():
    """Every page of docs/reference/ is in PAGES, in the order of mkdocs.yml's navigation."""
    reference = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "reference").glob("*.md"))
    listed = [p for p in PAGES if p.startswith("docs/reference/")]
    assert sorted([*listed, "docs/reference/index.md"]) == reference
    nav = re.findall(r"^\s*-\s*(reference/\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    assert [f"docs/{p}" for p in nav if p != "reference/index.md"] == listed


def test_shell_commands_are_split_at_unescaped_line_ends():
    assert shell_commands("a \\\n  b\n# c\n\nd  # e\n") == ["a    b", "d  # e"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The reader's working directory, with ``moelab`` / ``python`` on PATH from this checkout."""
    work = tmp_path_factory.mktemp("readme")
    bin_dir = tmp_path_factory.mktemp("readme-bin")
    for name, argv in (("moelab", f'"{sys.executable}" -m moelab "$@"'), ("python", f'"{sys.executable}" "$@"')):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\nexec {argv}\n")
        shim.chmod(0o755)
    # a prompts file for `moelab trace --prompts prompts.jsonl` (one JSON object per line)
    (work / "prompts.jsonl").write_text(
        '{"text": "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\\nAnswer:"}\n'
        '{"text": "def add(a, b):"}\n'
    )
    # the bundled predictors, where a reader in the repository finds them (predictors/...)
    (work / "predictors").symlink_to(ROOT / "predictors", target_is_directory=True)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return work, env


@pytest.mark.slow
def test_readme_blocks_run_in_order(workdir):
    """Every block of every page, in PAGES order, in one working directory (one test: a
    parametrised test was split across xdist workers, so a block could run before the one that
    made its inputs)."""
    work, env = workdir
    known_failures = []
    for block in BLOCKS:
        if block.skip is None:
            known_failures += _run_block(block, work, env)
    if known_failures:
        pytest.xfail("; ".join(known_failures))


def _run_block(block, work, env) -> list[str]:
    code = block.source()
    if block.kind == "python":
        runs = [[sys.executable, "-c", code]]
    else:
        commands = [c for c in shell_commands(code) if not any(s in c for s in block.skip_lines)]
        runs = [["bash", "-euo", "pipefail", "-c", c] for c in commands]
    known_failures = []
    for argv in runs:
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        xfail = [reason for text, reason in block.xfail_lines if text in argv[-1]]
        if xfail:
            assert proc.returncode != 0, (
                f"{block.where}: {argv[-1]!r} now succeeds; remove its xfail-line marker "
                f"({xfail[0]})"
            )
            known_failures.append(f"{block.where}: {argv[-1]!r}: {xfail[0]}: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        assert proc.returncode == 0, (
            f"{block.where} ({block.kind}) failed with exit status {proc.returncode}:\n"
            f"{argv[-1]}\n--- stderr (tail) ---\n{proc.stderr[-3000:]}"
        )
    return known_failures
