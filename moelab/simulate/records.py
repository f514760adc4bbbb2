"""The compiled planner's packed records as the simulator's flat plan columns (no per-plan lists).

:class:`moelab.hybrid._compiled.CompiledPlanner` returns each layer's plan as a lazy
:class:`~moelab.hybrid.planner.LayerPlan` that keeps one record of int64 values
(:func:`moelab.hybrid._compiled.pack`, kept as a list of ints) and builds its lists only when one
is read. The simulator's encoder (:func:`moelab.simulate.executor.encode`) needs flat arrays, not
the plans' lists: :func:`plan_columns`
concatenates the records of every plan and decodes them with numpy, field by field as
:meth:`~moelab.hybrid._compiled.CompiledPlanner.fill` decodes one record into lists, so the columns
equal those the encoder reads from the decoded plans (``tests/test_simulate_records.py``):

* ``device``: the needed experts placed ``DEVICE`` (hits), then those ``FETCHED``, each group in
  access order, with their tokens; an item's fate is ``prefetch-hit`` where the record marks it a
  hit on an unused prefetch, ``hit`` where it marks a hit, else ``miss-fetch``;
* ``host``: those ``HOSTED``, then those ``STOLEN``; ``deferred``: the record's sorted pairs;
* ``transfers``: the ``FETCHED`` experts (``demand``) and the host misses copied in afterwards
  (``insert``), in access order, then — where the prefetch moved anything — the prefetch's
  insertions into the target layer (``prefetch``), with the planner's bytes per expert of the
  layer copied into.

A plan whose lists were already read (its record is gone), a plain ``LayerPlan`` or plans of
several planners give None, and the encoder reads the lists instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from moelab.errors import MoelabError


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + l)`` for each (start, length)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.cumsum(lengths) - lengths
    return np.repeat(starts - offs, lengths) + np.arange(total, dtype=np.int64)


def _grouped(plan: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Indices of the items in ``first`` then those in ``second`` within each plan, each group in
    item order (items come in plan order): a stable sort on ``(plan, group)``."""
    pick = np.flatnonzero(first | second)
    key = plan[pick] * 2 + second[pick]
    return pick[np.argsort(key, kind="stable")]


def plan_columns(plans: Sequence[Any]) -> dict | None:
    """The encoder's columns of ``plans`` from their packed records, or None (see the module docstring).

    Returns ``forward``, ``step``, ``layer``, ``tokens``, ``prefill`` (one per plan), ``nv``/``v``
    ([n, 3]: expert, tokens, fate), ``nh``/``h`` and ``nf``/``f`` ([n, 2]: expert, tokens) and
    ``nx``/``x`` ([n, 4]: layer, expert, bytes, kind 0 demand / 1 insert / 2 prefetch).

    Size: one decoding pass over the concatenated records, field by field in the record's order.
    """
    n = len(plans)
    if n == 0:
        return None
    try:  # a lazy plan keeps its fields in its __dict__: read them column by column (C-level maps)
        dicts = list(map(vars, plans))
        recs, decs = list(map(itemgetter("_rec"), dicts)), list(map(itemgetter("_dec"), dicts))
    except (TypeError, KeyError):  # a plain LayerPlan, or one whose lists were read (its record is gone)
        return None
    dec = decs[0]
    if decs.count(dec) != n:  # plans of several planners (a planner compares by identity)
        return None

    def column(name: str, dtype: Any = np.int64) -> np.ndarray:
        return np.fromiter(map(itemgetter(name), dicts), dtype=dtype, count=n)

    from moelab.hybrid._compiled import (
        DEVICE,
        ERROR,
        FETCHED,
        HOSTED,
        MOVED,
        N_DEFERRED,
        N_EVICTED,
        N_NEEDED,
        N_PF_IN,
        STOLEN,
    )

    lens = np.fromiter(map(len, recs), dtype=np.int64, count=n)
    # a record is a list of ints (moelab.hybrid._compiled.LazyPlan): one pass over their chain
    rec = np.fromiter(chain.from_iterable(recs), dtype=np.int64, count=int(lens.sum()))
    off = np.cumsum(lens) - lens
    head = rec[off[:, None] + np.arange(8)]
    if head[:, ERROR].any():
        raise MoelabError("a compiled plan's record carries an error code; plan again (this is a bug).")
    nn, nd, ne, ni = head[:, N_NEEDED], head[:, N_DEFERRED], head[:, N_EVICTED], head[:, N_PF_IN]
    layer = column("layer")
    plans_idx = np.arange(n, dtype=np.int64)

    # ---- the needed experts, one item each: expert, tokens, hit, where, spec, inserted afterwards
    item = _ranges(off + 8, nn)
    iplan = np.repeat(plans_idx, nn)
    fields = rec[item + np.outer(np.arange(6), nn[iplan])]  # [6, items]: one gather
    expert, tok, hit, where, spec, ins = fields
    fetched = where == FETCHED

    dev = _grouped(iplan, where == DEVICE, fetched)
    fate = np.where(hit[dev] == 0, 2, np.where(spec[dev] != 0, 1, 0))
    v = np.column_stack([expert[dev], tok[dev], fate])
    nv = np.bincount(iplan[dev], minlength=n)
    hst = _grouped(iplan, where == HOSTED, where == STOLEN)
    h = np.column_stack([expert[hst], tok[hst]])
    nh = np.bincount(iplan[hst], minlength=n)
    nf = nd
    f = rec[_ranges(off + 8 + 6 * nn, 2 * nd)].reshape(-1, 2)

    # ---- transfers: demand and insert copies in access order, then the prefetch's insertions
    planner = dec.planner
    layer_bytes = np.asarray(planner.expert_bytes, dtype=np.int64)
    key_off = np.asarray(dec._offsets, dtype=np.int64)
    tr = np.flatnonzero(fetched | (ins != 0))
    trplan = iplan[tr]
    npf = np.where(head[:, MOVED] != 0, ni, 0)
    pf = rec[_ranges(off + 8 + 6 * nn + 2 * nd + ne, npf)]
    pfplan = np.repeat(plans_idx, npf)
    moved = np.flatnonzero(npf)  # the prefetch's target layer
    target = np.repeat(column("_target")[moved], npf[moved])
    x_all = np.concatenate([
        np.column_stack([layer[trplan], expert[tr], layer_bytes[layer[trplan]], np.where(fetched[tr], 0, 1)]),
        np.column_stack([target, pf - key_off[target], layer_bytes[target], np.full(len(pf), 2)]),
    ]).astype(np.int64, copy=False)
    order = np.argsort(np.concatenate([trplan * 2, pfplan * 2 + 1]), kind="stable")
    x = x_all[order]
    nx = np.bincount(trplan, minlength=n) + npf
    return {
        "forward": column("forward"), "step": column("step"), "layer": layer, "tokens": column("tokens"),
        "prefill": np.fromiter(map("prefill".__eq__, map(itemgetter("phase"), dicts)), dtype=bool, count=n),
        "nv": nv, "v": v, "nh": nh, "h": h, "nf": nf, "f": f, "nx": nx, "x": x,
    }


__all__ = ["plan_columns"]
