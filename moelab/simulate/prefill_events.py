"""The stream-loading prefill schedule as events of the project's one schema (:mod:`moelab.events`).

Lanes (a timeline draws one row each, :mod:`moelab.timeline`):

* ``copy`` — the **loader**: one ``transfer-prefetch`` per module (cause ``stream``; ``bytes`` the
  module's weights, or the prompt's activations for the embedding);
* ``device`` — the **compute** stream: ``dense`` for a dense module (cause ``attention``,
  ``lm-head``), ``expert-device`` for an expert (cause ``stream``, ``tokens`` its tokens);
* ``unloader`` — one zero-length ``release`` per module at its compute's end (cause ``ring`` or
  ``dense-budget``): it frees memory without write-back;
* ``slot0`` .. ``slot{R-1}`` — the **ring**: each expert's stay in its slot as three events of kind
  ``slot``, cause ``loading`` (its copy), ``ready`` (loaded, waiting for the compute stream) and
  ``computing``.

``step`` is 0 (one prefill forward); ``layer`` the MoE layer ordinal of an expert, the decoder layer
of a dense module, -1 for the embedding and the LM head; ``expert`` the expert id (the slice for the
LM head), else -1.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.errors import MoelabError
from moelab.events import COLUMNS


def _frame(run, layer, lane, kind, expert, tokens, nbytes, t0, t1, cause) -> pd.DataFrame:
    """Events from columns (a scalar is repeated).

    Size: one parameter per column of the event schema (moelab.events.COLUMNS), as EventLog.add.
    """
    n = len(t0)

    def full(v, dtype):
        return np.full(n, v, dtype=dtype) if np.isscalar(v) else np.asarray(v, dtype=dtype)

    return pd.DataFrame({"run": full(run, object), "step": np.zeros(n, np.int32), "layer": full(layer, np.int32),
                         "lane": full(lane, object), "kind": full(kind, object), "expert": full(expert, np.int32),
                         "tokens": full(tokens, np.int32), "bytes": full(nbytes, np.int64),
                         "t_start_us": full(t0, np.float64), "t_end_us": full(t1, np.float64),
                         "cause": full(cause, object)})


def slp_events(s, run: str = "slp") -> pd.DataFrame:
    """The events of a :class:`~moelab.simulate.prefill.StreamSchedule` (module docstring)."""
    is_x = s.kind == "expert"
    toks = np.rint(s.tokens).astype(np.int64)
    layer = s.layer
    dev_kind = np.where(is_x, "expert-device", "dense")
    dev_cause = np.where(is_x, "stream", np.where(s.kind == "lm-head", "lm-head",
                                                  np.where(s.kind == "embed", "embedding", "attention")))
    computes = s.compute_end > s.compute_start
    parts = [
        _frame(run, layer, "copy", "transfer-prefetch", s.expert, 0, s.nbytes, s.load_start, s.load_end, "stream"),
        _frame(run, layer[computes], "device", dev_kind[computes], s.expert[computes],
               np.where(is_x, toks, 0)[computes], np.where(is_x, s.nbytes, 0)[computes],
               s.compute_start[computes], s.compute_end[computes], dev_cause[computes]),
        _frame(run, layer, "unloader", "release", s.expert, 0, 0, s.compute_end, s.compute_end,
               np.where(is_x, "ring", "dense-budget")),
    ]
    x = np.flatnonzero(is_x)
    lanes = np.array([f"slot{i}" for i in s.slot[x]], dtype=object)
    for cause, t0, t1 in (("loading", s.load_start[x], s.load_end[x]),
                          ("ready", s.load_end[x], s.compute_start[x]),
                          ("computing", s.compute_start[x], s.compute_end[x])):
        keep = t1 > t0
        parts.append(_frame(run, layer[x][keep], lanes[keep], "slot", s.expert[x][keep], toks[x][keep], 0,
                            t0[keep], t1[keep], cause))
    df = pd.concat(parts, ignore_index=True)
    return df.loc[:, list(COLUMNS)].sort_values(["t_start_us", "t_end_us"], kind="stable").reset_index(drop=True)


def write_events(schedule, path) -> None:
    """Write the SLP ``schedule``'s events as an events Parquet file (``moelab.Timeline(path)`` opens it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if schedule is None:
        raise MoelabError("no stream-loading schedule to write: the prefill took the hybrid path; use "
                          "--prefill-path slp (or a prompt past the crossover) for --events.")
    df = slp_events(schedule)
    for c, t in (("step", "int32"), ("layer", "int32"), ("expert", "int32"), ("tokens", "int32")):
        df[c] = df[c].astype(t)
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), str(path))


__all__ = ["slp_events", "write_events"]
