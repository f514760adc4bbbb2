"""The routing-policy options shared by ``moelab eval``, ``moelab generate`` and friends.

A thin layer: the flags map one to one onto :class:`DeferralConfig` / :class:`SkippingConfig`,
and the policy is built by name through :func:`moelab.policies.make_policy`. (It lives in the
CLI package: the library never imports argparse helpers.)
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from moelab.cli._util import non_negative_int

if TYPE_CHECKING:  # the CLI imports this module to build its parser: no torch at import
    from moelab.policies.base import RoutingPolicy


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """``--deferred D | --skipped S``, ``--policy-phase``, ``--min-immediate``, ``--renormalize``."""
    g = p.add_argument_group("routing policy (default: none)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--deferred", type=non_negative_int, metavar="D",
                   help="Expert Deferral: defer the D lowest-weight routed experts of every token "
                        "to the next MoE layer (the last MoE layer never defers)")
    x.add_argument("--skipped", type=non_negative_int, metavar="S",
                   help="Expert Skipping: drop the S lowest-weight routed experts of every token")
    g.add_argument("--policy-phase", choices=("decode", "all"), default="decode",
                   help="apply the policy in decode steps only (default) or in prefill too")
    g.add_argument("--min-immediate", type=non_negative_int, default=2, metavar="I",
                   help="deferral guard: refuse settings that leave fewer immediate experts (default 2)")
    g.add_argument("--renormalize", action="store_true",
                   help="skipping: rescale the kept experts' weights to the original top-k total")


def policy_from_args(model: Any, args: argparse.Namespace) -> RoutingPolicy | None:
    """The policy the parsed flags ask for (not applied yet), or None."""
    from moelab.policies.registry import make_policy

    phase = getattr(args, "policy_phase", "decode")
    if getattr(args, "deferred", None) is not None:
        return make_policy("deferral", model, deferred=args.deferred, phase=phase,
                           min_immediate=args.min_immediate)
    if getattr(args, "skipped", None) is not None:
        return make_policy("skipping", model, skipped=args.skipped, phase=phase, renormalize=args.renormalize)
    return None


def describe_policy(args: argparse.Namespace) -> dict[str, Any] | None:
    """A JSON-ready description of the requested policy (for results), or None."""
    if getattr(args, "deferred", None) is not None:
        return {"policy": "deferral", "deferred": args.deferred, "phase": args.policy_phase,
                "min_immediate": args.min_immediate}
    if getattr(args, "skipped", None) is not None:
        return {"policy": "skipping", "skipped": args.skipped, "phase": args.policy_phase,
                "renormalize": args.renormalize}
    return None


@contextlib.contextmanager
def policy_context(args: argparse.Namespace, model: Any) -> Iterator[Any]:
    """``model`` with the requested policy applied for the duration of the block."""
    policy = policy_from_args(model, args)
    if policy is None:
        yield model
        return
    with policy:
        yield model
