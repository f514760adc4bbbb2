"""The ``moelab`` command line: a thin layer over the Python API.

Each sub-command lives in its own module in this package and exposes
``register(subparsers)``; add a module name to ``COMMAND_MODULES`` to add a command.
Errors that are the user's to fix (:class:`moelab.errors.MoelabError`) print as one
line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from moelab import __version__
from moelab.errors import MoelabError, did_you_mean

#: Sub-command modules, in the order ``moelab --help`` lists them.
COMMAND_MODULES: list[str] = [
    "models",
    "trace",
    "trace_info",
    "eval",
    "generate",
    "run",
    "timeline",
    "compare_policies",
    "sweep",
    "predict",
    "cache",
    "demo",
    "bench",
    "calibrate",
    "simulate",
    "train_tiny",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moelab",
        description="Expert-routing experiments on Mixture-of-Experts language models.",
    )
    parser.add_argument("--version", action="version", version=f"moelab {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"moelab.cli.{name}").register(subparsers)
    return parser


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser ``argv`` selects: ``moelab calibrate --x`` → calibrate's."""
    for token in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            parser = subs[0].choices[token]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand that got them, with its usage and the closest option
        sub = _innermost(parser, argv)
        options = [o for a in sub._actions for o in a.option_strings]
        hint = "".join(did_you_mean(x, options) for x in extra if x.startswith("-"))
        sub.error(f"unrecognized arguments: {' '.join(extra)}.{hint}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    args.argv = argv  # the command line as given: a command that must rerun itself in a child (bench kernels --emulate)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except MoelabError as exc:
        print(f"moelab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moelab: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
