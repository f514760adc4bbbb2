"""What the installed transformers passes to a model's forward and expects back — in one place.

transformers changes its calling conventions between minor releases, and moelab reads
them inside every forward pass. A convention read wrongly is not an error in transformers:
it is a silently wrong experiment (5.24 renamed the KV cache argument from
``past_key_values`` to ``cache``; a reader that looked only for the old name took every
decode step for a new one-token prompt, so deferral "changed nothing"). So every such
reading lives here, is derived from the objects themselves where possible, and **refuses**
a forward it cannot read instead of guessing:

* **the KV cache of a forward** (:func:`find_cache`): under any name transformers has used
  (``cache`` from 5.24, ``past_key_values`` before, ``cache_params`` for linear-attention
  models), passed by keyword or by position (bound against the forward's own signature);
  its length comes from the cache object (``get_seq_length``). A forward with evidence of
  earlier tokens — a cache object under a name moelab does not know, an attention mask or
  position ids longer than the input, a ``cache_position`` past 0 — and no cache moelab
  can read raises :class:`UnreadableForwardError` naming the transformers version and the fix.
* **the cache argument to pass** (:func:`cache_kwargs`) and **the cache of an output**
  (:func:`output_cache`), so moelab's own decode loops use the name the installed release
  expects (no deprecation warnings from moelab's calls);
* **a router's output triple** (:func:`router_outputs`): ``(logits, weights, ids)`` in most
  families, ``(ids, weights, logits)`` in granitemoe before 5.2x — told apart by dtype;
* **an experts module's call** (:func:`experts_call_arguments`, :func:`with_routing`):
  ``experts(hidden, top_k_index, top_k_weights)`` by position or under the keywords 5.x uses.

:data:`TESTED` lists the releases the test suite was run on (README, "Supported
versions") and the conventions each one has; ``tests/test_compat.py`` checks that the
installed release behaves as its row says, so running the suite under each version of
the matrix is a test per supported version.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moelab.errors import MoelabError

log = logging.getLogger(__name__)

#: Names under which transformers has passed a decoder's KV cache, newest first.
CACHE_NAMES: tuple[str, ...] = ("cache", "past_key_values", "cache_params")


@dataclass(frozen=True)
class Conventions:
    """How one transformers release calls a causal LM's inner model (see the module docstring)."""

    cache_kwarg: str
    """The keyword the models' ``forward`` takes the KV cache under."""
    output_cache: str
    """The field of a model output that holds the cache."""


_OLD = Conventions(cache_kwarg="past_key_values", output_cache="past_key_values")
_NEW = Conventions(cache_kwarg="cache", output_cache="cache")

#: Releases the suite was run on (the README's supported-versions matrix), with their conventions.
TESTED: dict[str, Conventions] = {
    "5.17.0": _OLD,
    "5.23.0": _OLD,
    "5.24.0": _NEW,
}


class UnreadableForwardError(MoelabError):
    """A forward pass whose KV cache moelab cannot find although it continues earlier tokens."""


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


@functools.lru_cache(maxsize=1)
def conventions() -> Conventions:
    """The installed release's conventions, read off its model classes (not its version number).

    Warns once when the release is newer than the newest in :data:`TESTED`.
    """
    from transformers import PreTrainedModel

    version = transformers_version()
    newest = max(TESTED, key=_parse)
    if _parse(version) > _parse(newest):
        log.warning(
            "transformers %s is newer than the newest release moelab was tested with (%s); its "
            "forward conventions are read from its model classes, but run `make test-latest` "
            "before trusting results (README, 'Supported versions').", version, newest,
        )
    try:  # a causal LM's inner model, the module moelab's forward hook sits on
        from transformers import MixtralModel

        params = inspect.signature(MixtralModel.forward).parameters
    except Exception:  # noqa: BLE001 - a release without Mixtral: fall back on the generation code
        params = inspect.signature(PreTrainedModel.prepare_inputs_for_generation).parameters
    if "cache" in params:
        return _NEW
    return _OLD


def cache_kwarg(module: Any = None) -> str:
    """The keyword ``module.forward`` takes the KV cache under (default: the installed release's)."""
    if module is not None:
        names = _parameters(module if isinstance(module, type) else type(module))
        for name in CACHE_NAMES:
            if names is not None and name in names:
                return name
    return conventions().cache_kwarg


def cache_kwargs(cache: Any, module: Any = None) -> dict[str, Any]:
    """``{name: cache}`` to pass to ``module(...)`` (or to any model of the installed release)."""
    return {cache_kwarg(module): cache}


def output_cache(output: Any) -> Any:
    """The KV cache a model's output carries (``output.cache`` or ``output.past_key_values``),
    read without tripping a deprecation warning; None when it carries none."""
    if isinstance(output, Mapping):  # a ModelOutput holds its non-None fields as keys
        return next((output[n] for n in CACHE_NAMES if n in output), None)
    return next((v for n in CACHE_NAMES if (v := getattr(output, n, None)) is not None), None)


@functools.lru_cache(maxsize=256)
def _parameters(cls: type) -> tuple[str, ...] | None:
    """Names of ``cls.forward``'s parameters after ``self`` (through functools.wraps), or None."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return None
    names = list(params)
    return tuple(names[1:] if names and names[0] == "self" else names)


@functools.lru_cache(maxsize=256)
def _positional(cls: type) -> tuple[str, ...]:
    """Names of the parameters of ``cls.forward`` that can be passed by position, in order."""
    params = inspect.signature(cls.forward).parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(names[1:] if names and names[0] == "self" else names)


def _is_cache(obj: Any) -> bool:
    """True for a transformers ``Cache`` (or anything that reports a sequence length like one)."""
    if obj is None or isinstance(obj, torch.Tensor):
        return False
    try:
        from transformers.cache_utils import Cache

        if isinstance(obj, Cache):
            return True
    except ImportError:  # pragma: no cover - every supported release has cache_utils
        pass
    return callable(getattr(obj, "get_seq_length", None))


def past_length(past: Any) -> int:
    """Tokens held by a KV cache (``Cache`` object or legacy tuple); 0 for None or empty."""
    if past is None:
        return 0
    get = getattr(past, "get_seq_length", None)
    if get is not None:
        try:
            return int(get())
        except Exception:  # noqa: BLE001 - caches without layers yet report nothing
            return 0
    try:  # legacy tuple of (k, v) per layer
        return int(past[0][0].shape[-2])
    except Exception:  # noqa: BLE001
        return 0


@dataclass(frozen=True)
class FoundCache:
    """Where a forward's KV cache was found and how many tokens it holds."""

    name: str | None
    """The argument it came under (None: no cache passed)."""
    cache: Any
    past_len: int


def bound_arguments(fn: Callable | type | None, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus the positional ``args`` named by ``fn``'s forward signature (``fn``: a module
    class or instance, or None to name nothing). ``args`` exclude ``self``."""
    out = dict(kwargs)
    if not args or fn is None:
        return out
    cls = fn if isinstance(fn, type) else type(fn)
    if _parameters(cls) is None:
        return out
    names = _positional(cls)
    for name, value in zip(names, args):
        out.setdefault(name, value)
    return out


def find_cache(fn: Callable | type | None, args: tuple, kwargs: Mapping[str, Any], seq_len: int) -> FoundCache:
    """The KV cache of one forward call of ``fn`` (see the module docstring).

    Raises :class:`UnreadableForwardError` when the call carries evidence of earlier tokens and
    no cache moelab can read; an ordinary first forward (no cache yet) is a prompt.
    """
    named = bound_arguments(fn, args, kwargs)
    for name in CACHE_NAMES:
        value = named.get(name)
        if value is not None:
            if isinstance(value, tuple | list) or _is_cache(value):
                return FoundCache(name, value, past_length(value))
            raise _unreadable(f"its {name}= argument is a {type(value).__name__}, not a transformers Cache")
    # no cache under a name moelab knows: a prompt, unless the call says otherwise
    for name, value in named.items():
        if _is_cache(value):
            raise _unreadable(f"it passes a {type(value).__name__} under {name}=, a name moelab does not "
                              f"know for the KV cache (known: {', '.join(CACHE_NAMES)})")
    mask = named.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] > seq_len:
        raise _unreadable(f"its attention mask covers {mask.shape[-1]} tokens for {seq_len} new ones")
    pos = named.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.numel() and pos.dim() <= 2 and int(pos.max()) >= seq_len:
        raise _unreadable(f"its position ids reach {int(pos.max())} for {seq_len} new tokens")
    cpos = named.get("cache_position")
    if isinstance(cpos, torch.Tensor) and cpos.numel() and int(cpos.reshape(-1)[0]) > 0:
        raise _unreadable(f"its cache_position starts at {int(cpos.reshape(-1)[0])}")
    return FoundCache(None, None, 0)


def _unreadable(why: str) -> UnreadableForwardError:
    return UnreadableForwardError(
        f"moelab cannot tell the phase of this forward: {why}, so it continues earlier tokens, but "
        f"moelab found no KV cache it can read (transformers {transformers_version()}; moelab reads "
        f"{', '.join(CACHE_NAMES)}). Taking it for a new prompt would silently misreport decode as "
        "prefill. Fix: install the tested versions (`make install` uses the lock in "
        "requirements/lock.txt), or teach moelab.compat.find_cache this release's convention."
    )


def router_outputs(output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits, weights, expert ids)`` of a router's output triple, in either order transformers
    5.x uses: ``(logits, weights, ids)`` (most families, granitemoe from 5.2x) or ``(ids, weights,
    logits)`` (granitemoe in earlier 5.x releases). The ids are the integer tensor."""
    # (no generator expressions on this per-layer path: each is a function call before Python 3.12)
    if not (isinstance(output, tuple | list) and len(output) == 3 and isinstance(output[0], torch.Tensor)
            and isinstance(output[1], torch.Tensor) and isinstance(output[2], torch.Tensor)):
        got = f"a {len(output)}-tuple" if isinstance(output, tuple | list) else type(output).__name__
        raise UnreadableForwardError(
            f"a router returned {got}; moelab reads (logits, weights, expert ids) (transformers "
            f"{transformers_version()}). Fix: install the tested versions (`make install`), or teach "
            "moelab.compat.router_outputs this release's router output.")
    first, weights, last = output[0], output[1], output[2]
    if not first.is_floating_point() and last.is_floating_point():
        return last, weights, first
    return first, weights, last


#: Keywords transformers 5.x uses for an experts call's routing, after ``hidden_states``.
EXPERTS_INDEX_NAMES: tuple[str, ...] = ("top_k_index", "router_indices")
EXPERTS_WEIGHT_NAMES: tuple[str, ...] = ("top_k_weights", "routing_weights")


def experts_call_arguments(args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (T,H), expert ids (T,K), weights (T,K)) of an ``experts(...)`` call, positional or keyword."""
    values = list(args[:3])
    names = (("hidden_states",), EXPERTS_INDEX_NAMES, EXPERTS_WEIGHT_NAMES)
    for i in range(len(values), 3):  # (loops, not generators: this runs per MoE layer)
        value = None
        for n in names[i]:
            if n in kwargs:
                value = kwargs[n]
                break
        values.append(value)
    if values[0] is None or values[1] is None or values[2] is None:
        raise UnreadableForwardError(
            f"unexpected experts call: {len(args)} positional argument(s), keywords {sorted(kwargs)}; moelab reads "
            f"experts(hidden_states, top_k_index, top_k_weights) (transformers {transformers_version()}). Fix: "
            "install the tested versions (`make install`), or teach moelab.compat.experts_call_arguments this call.")
    return values[0], values[1], values[2]


def with_routing(args: tuple, kwargs: Mapping[str, Any], experts: torch.Tensor,
                 weights: torch.Tensor) -> tuple[tuple, dict]:
    """The same experts call with its expert ids and weights replaced, where the call had them."""
    args = list(args)
    kwargs = dict(kwargs)
    for i, (value, names) in enumerate(((experts, EXPERTS_INDEX_NAMES), (weights, EXPERTS_WEIGHT_NAMES)), start=1):
        if len(args) > i:
            args[i] = value
        else:
            kwargs[next(n for n in names if n in kwargs)] = value
    return tuple(args), kwargs


__all__ = [
    "CACHE_NAMES", "EXPERTS_INDEX_NAMES", "EXPERTS_WEIGHT_NAMES", "TESTED", "Conventions", "FoundCache",
    "UnreadableForwardError", "bound_arguments", "cache_kwarg", "cache_kwargs", "conventions",
    "experts_call_arguments", "find_cache", "output_cache", "past_length", "router_outputs",
    "transformers_version", "with_routing",
]
