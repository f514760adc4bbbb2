"""moelab's error type and helpers that make messages name the value, the expectation and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MoelabError(Exception):
    """A user-facing error: the message names the offending value, what was expected and the fix.

    The CLI prints these as one line (no traceback).
    """


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for close matches of ``name`` among ``choices``, else ``''``."""
    close = difflib.get_close_matches(str(name), list(choices), n=3, cutoff=0.5)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> MoelabError:
    """The error for an unknown registry name, with close suggestions and the full list."""
    choices = sorted(choices)
    return MoelabError(
        f"unknown {kind} {name!r}.{did_you_mean(name, choices)} Known: {', '.join(choices)}."
    )
