"""Helpers shared by the CLI commands: JSON output and argument validation."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moelab.errors import MoelabError


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON on stdout (the machine-readable output of ``--json``)."""
    json.dump(obj, sys.stdout, indent=2, default=_default)
    sys.stdout.write("\n")


def _default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1, with a message that says so."""
    return _int_at_least(text, 1, "a positive integer (≥ 1)")


def non_negative_int(text: str) -> int:
    """argparse type: an integer ≥ 0, with a message that says so."""
    return _int_at_least(text, 0, "an integer ≥ 0")


def _int_at_least(text: str, low: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def check_output_path(path: str | Path, overwrite: bool) -> Path:
    """Refuse to replace an existing output unless ``--overwrite`` was given."""
    p = Path(path)
    if os.path.lexists(p) and not overwrite:  # a dangling symlink counts: it would be replaced
        raise MoelabError(f"output {str(p)!r} already exists; pass --overwrite to replace it or choose another path.")
    return p


class DeprecatedAlias(argparse.Action):
    """``store`` that warns on stderr when the option is given by one of its ``deprecated`` names."""

    def __init__(self, option_strings, dest, deprecated: tuple[str, ...] = (), **kwargs):
        self.deprecated = tuple(deprecated)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.deprecated:
            print(f"moelab: warning: {option_string} is deprecated; use {self.option_strings[0]}.",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_prompt_arguments(p) -> None:
    """``--prompts FILE | --task T``, ``--limit``, ``--max-new-tokens``, ``--batch-size``: the prompts
    a command greedy-generates on (read them with :func:`prompts_from_args`)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help="text file (one prompt per line) or .jsonl with 'prompt'/'question'")
    src.add_argument("--task", metavar="T", help="built-in prompt source: demo, arith, pycode")
    p.add_argument("--limit", type=positive_int, help="use at most N prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="prompts per generate call (left padding)")


def prompts_from_args(args) -> list[str]:
    """The prompts :func:`add_prompt_arguments`' flags name."""
    from moelab.prompts import read_prompts, task_prompts

    return read_prompts(args.prompts, args.limit) if args.prompts else task_prompts(args.task, args.limit)
