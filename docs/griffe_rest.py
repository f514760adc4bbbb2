"""A griffe extension for the API reference: the reST constructs of moelab's docstrings as Markdown.

moelab's docstrings are Google-style sections written with a few reST habits, which
Markdown would otherwise print literally or misread:

* roles, ``:class:`~moelab.caches.ExpertCache``` → `` `ExpertCache` `` (a code span; ``~``
  keeps the last dotted part, as in Sphinx);
* literal blocks introduced by ``::`` → fenced code blocks;
* doctest lines (``>>>``, ``...``) → ``pycon`` fenced blocks (Markdown reads ``>`` as a quote);
* simple tables framed by ``=====  =====`` lines → fenced text blocks (Markdown reads a line
  of ``=`` as a heading underline).

Only the text handed to the docstring parser changes; the code is not touched. Loaded by
mkdocs.yml (``extensions``); its effect is checked by ``mkdocs build --strict`` in
tests/test_docs.py.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref):`(~?)([^`]+)`")
_BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")
_DOCTEST = re.compile(r"^\s*(?:>>>|\.\.\.)(?: |$)")


def _role(m: re.Match) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rest_to_markdown(text: str) -> str:
    """``text`` with the constructs of the module docstring rewritten as Markdown."""
    text = _ROLE.sub(_role, text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        pad = " " * _indent(line)
        if line.rstrip().endswith("::") and not line.lstrip().startswith(">>>"):
            base = _indent(line)
            head = line.rstrip()[:-2].rstrip()
            if head:
                out.append(head + ":")
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            body_start = j
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
                j += 1
            while j > body_start and not lines[j - 1].strip():
                j -= 1
            body = lines[body_start:j]
            if body:
                cut = min(_indent(b) for b in body if b.strip())
                out += ["", pad + "```text", *[(pad + b[cut:]) if b.strip() else "" for b in body], pad + "```", ""]
                i = j
                continue
            i += 1
            continue
        if _BORDER.match(line):
            j, borders = i, 0
            while j < len(lines) and borders < 3 and lines[j].strip():
                borders += bool(_BORDER.match(lines[j]))
                j += 1
            out += ["", pad + "```text", *[pad + b[len(pad):] for b in lines[i:j]], pad + "```", ""]
            i = j
            continue
        if _DOCTEST.match(line):
            j = i
            while j < len(lines) and _DOCTEST.match(lines[j]) and _indent(lines[j]) == len(pad):
                j += 1
            out += ["", pad + "```pycon", *[pad + b[len(pad):] for b in lines[i:j]], pad + "```", ""]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RestToMarkdown(griffe.Extension):
    """Rewrite every docstring with :func:`rest_to_markdown` before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rest_to_markdown(obj.docstring.value)
