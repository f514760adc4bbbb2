"""Record routing traces from any forward, ``generate`` or lm-eval run.

>>> with moelab.record(model, "traces/run1", hidden_states=True) as rec:
...     model.generate(**inputs, max_new_tokens=32)
>>> trace = rec.trace

How tokens are identified: the recorder is a set of handlers on the model's one forward
context (:mod:`moelab.forward`), which sees ``input_ids``, ``attention_mask`` and the KV
cache. A forward on an empty cache is a *prompt*: each batch row starts a new sequence
(``seq``), ``step`` 0, phase ``prefill``. A forward on a non-empty cache continues the
current sequences: ``step`` n, phase ``decode`` for one new token per row (a multi-token
continuation is labelled ``prefill``). Positions count the real tokens of a row;
padding (attention mask 0) is not recorded.

Handlers at the ``router`` point (level ``OBSERVE``) collect each MoE layer's outputs; they are converted to rows once
per forward (one host transfer per forward, not per layer), buffered, and flushed to
Parquet row groups (and safetensors shards for hidden states) every ``flush_rows``
rows, so memory stays bounded. Hooks are removed on exit, also on exceptions; an
exception (or an interrupted process) leaves no directory that looks like a trace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moelab import __version__
from moelab._output import reserve_output
from moelab.adapters import MoELayer, get_adapter, make_routing, model_info, moe_layers
from moelab.errors import MoelabError
from moelab.forward import ForwardContext, Order, RouterCall, forward_hooks
from moelab.trace.schema import (
    HIDDEN_PATTERN,
    META_FILE,
    ROUTES_FILE,
    SCHEMA_VERSION,
    routes_schema,
)

log = logging.getLogger(__name__)

#: Forwards whose router outputs are held before they are converted to rows together.
_PENDING_FORWARDS = 128

_HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class RecordConfig:
    """What a :class:`TraceRecorder` captures."""

    scores: bool = True
    """Record the router's full score vector (E floats per row); needed by MRS caches."""
    hidden_states: bool = False
    """Record the router-input hidden state of every row (needed to train learned predictors)."""
    hidden_dtype: str = "bfloat16"
    """dtype of stored hidden states: bfloat16, float16 or float32."""
    flush_rows: int = 1 << 16
    """Rows buffered in memory before a Parquet row group is written."""

    def __post_init__(self) -> None:
        if self.hidden_dtype not in _HIDDEN_DTYPES:
            raise MoelabError(
                f"hidden_dtype {self.hidden_dtype!r} is not supported; expected one of {', '.join(_HIDDEN_DTYPES)}."
            )
        if self.flush_rows < 1:
            raise MoelabError(f"flush_rows must be ≥ 1, got {self.flush_rows}.")


@dataclass
class _Forward:
    """What the model pre-hook learned about the forward in flight (real tokens only)."""

    valid: torch.Tensor | None  # (B*S,) bool on the CPU, real tokens in row-major order; None: all real
    seq: np.ndarray  # (n,) of the n real tokens
    pos: np.ndarray  # (n,)
    token_id: np.ndarray  # (n,)
    step: int
    phase: str
    calls: list = field(default_factory=list)  # (layer, hidden, logits, weights, experts)

    @property
    def n(self) -> int:
        return len(self.seq)


class TraceRecorder:
    """Context manager that streams a routing trace of ``model`` to ``out``.

    ``out=None`` records into a new temporary directory (kept; see ``rec.path``).
    An existing ``out`` is refused unless ``overwrite=True``.
    """

    def __repr__(self) -> str:
        state = "finished" if self.trace is not None else "recording or not started"
        return (f"TraceRecorder({str(self.path)!r}: {state}; {self._rows} rows so far "
                f"({self._phase_rows['prefill']} prefill, {self._phase_rows['decode']} decode))")

    def __init__(
        self,
        model: nn.Module,
        out: str | Path | None = None,
        *,
        config: RecordConfig | None = None,
        overwrite: bool = False,
        model_name: str | None = None,
        metadata: dict[str, Any] | None = None,
        reservation: Any = None,
        **config_kwargs: Any,
    ) -> None:
        if config is not None and config_kwargs:
            raise MoelabError("pass either config= or keyword settings (scores=..., hidden_states=...), not both.")
        self.config = config or RecordConfig(**config_kwargs)
        self.model = model
        self.adapter = get_adapter(model)
        self.layers: list[MoELayer] = moe_layers(model)
        self.path = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="moelab-trace-")) / "trace"
        self.overwrite = overwrite
        self.model_name = model_name or str(getattr(model, "name_or_path", "") or type(model).__name__)
        self.metadata = dict(metadata or {})
        self.trace = None
        self._hooks: list = []
        self._tmp: Path | None = None
        self._reservation = None
        # a claim of ``out`` taken before the work (moelab trace claims it before loading the model)
        self._claimed = reservation
        self._reset_state()

    def _reset_state(self) -> None:
        self._fwd: _Forward | None = None
        self._next_seq = 0
        self._seq_base: int | None = None
        self._buf: dict[str, list] = {k: [] for k in ("seq", "step", "pos", "phase", "token_id", "layer", "moe_layer")}
        self._buf_lists: dict[str, list] = {"experts": [], "weights": [], "scores": [], "k": []}
        self._buf_hidden: list[torch.Tensor] = []
        self._buf_rows = 0
        self._pending: list[_Forward] = []
        self._pending_rows = 0
        self._rows = 0
        self._phase_rows = {"prefill": 0, "decode": 0}
        self._writer = None
        self._shards: list[dict] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> TraceRecorder:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def start(self) -> None:
        if self._tmp is not None:
            raise MoelabError("this recorder is already recording; use a new TraceRecorder for a new trace.")
        # refuses an existing path, locks it against a second writer, creates the parents
        if self._claimed is not None and Path(self._claimed.path) == self.path:
            self._reservation, self._claimed = self._claimed, None
        else:
            self._reservation = reserve_output(self.path, self.overwrite, what="trace directory")
        self._tmp = self._reservation.staging
        self._reset_state()
        try:
            mgr = forward_hooks(self.model)
            self._hooks.append(mgr.add("forward", self._on_forward, order=Order.OBSERVE, name="trace recorder"))
            self._hooks.append(mgr.add("router", self._on_router, order=Order.OBSERVE, name="trace recorder"))
            self._hooks.append(mgr.add("forward_end", self._on_forward_end, order=Order.OBSERVE, name="trace recorder"))
        except BaseException:
            self._remove_hooks()
            self.abort()
            raise

    def close(self):
        """Finish: flush, write meta.json, move the trace into place atomically."""
        from moelab.trace.reader import RoutingTrace

        self._remove_hooks()
        try:
            self._convert_pending()
            self._flush()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            else:  # no rows: still a valid (empty) Parquet file
                import pyarrow.parquet as pq

                pq.write_table(routes_schema(self.config.scores).empty_table(), self._tmp / ROUTES_FILE)
            meta = self._meta()
            _write_json_atomic(self._tmp / META_FILE, meta)
            self._reservation.commit()
        except BaseException:
            self.abort()
            raise
        self._tmp = self._reservation = None
        if self._rows == 0:
            log.warning("trace %s has no rows: nothing ran through the model while recording", self.path)
        self.trace = RoutingTrace(self.path)
        return self.trace

    def abort(self) -> None:
        """Stop without producing a trace; removes everything written so far."""
        self._remove_hooks()
        self._pending, self._pending_rows = [], 0
        if self._writer is not None:
            with contextlib.suppress(Exception):  # best effort on the failure path
                self._writer.close()
            self._writer = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._reservation is not None:
            self._reservation.abort()
            self._reservation = None

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    # ------------------------------------------------------------------ handlers
    def _on_forward(self, ctx: ForwardContext) -> None:
        """Start of a forward: the context's sequences, step and positions of its real tokens.

        Sequence ids count from 0 at the first sequence this recorder sees (the forward context
        numbers them per model); positions count each row's real tokens since its sequence began.
        """
        if ctx.unknown_cache:
            log.warning("forward continues a KV cache of an unknown sequence; recording it as new sequences")
        if self._seq_base is None:
            self._seq_base = int(ctx.seq.min())
        S = ctx.seq_len
        seq = ctx.seq - self._seq_base
        self._next_seq = max(self._next_seq, int(seq.max()) + 1)
        token_id = ctx.real_token_ids
        pos = ctx.positions.reshape(-1).astype(np.int32)
        mask = ctx.mask_cpu
        if mask is None:  # every token real (the usual decode step): no masking
            self._fwd = _Forward(valid=None, seq=np.repeat(seq, S), pos=pos, token_id=token_id, step=ctx.step,
                                 phase=ctx.phase)
            return
        valid = mask.reshape(-1)
        self._fwd = _Forward(valid=torch.from_numpy(valid), seq=np.repeat(seq, S)[valid], pos=pos[valid],
                             token_id=token_id, step=ctx.step, phase=ctx.phase)

    def _on_router(self, ctx: ForwardContext, layer: MoELayer, call: RouterCall) -> None:
        fwd = self._fwd
        if fwd is None:
            return
        hidden = call.hidden if self.config.hidden_states else None
        fwd.calls.append((layer, hidden, call.logits, call.weights, call.experts))

    def _on_forward_end(self, ctx: ForwardContext, ok: bool) -> None:
        fwd, self._fwd = self._fwd, None
        if not ok or fwd is None or not fwd.calls or fwd.n == 0:
            return
        # Keep the raw router outputs; convert many forwards at once (see _convert_pending).
        self._pending.append(fwd)
        self._pending_rows += fwd.n * len(fwd.calls)
        # buffered + pending rows stay below flush_rows between forwards (pending alone could
        # otherwise add up to another flush_rows on top of an almost full buffer)
        if self._buf_rows + self._pending_rows >= self.config.flush_rows or len(self._pending) >= _PENDING_FORWARDS:
            self._convert_pending()
            if self._buf_rows >= self.config.flush_rows:
                self._flush()

    # ------------------------------------------------------------------ rows
    def _convert_pending(self) -> None:
        """Turn the pending forwards' router outputs into buffered rows.

        Small per-layer tensor operations dominate the cost of recording a decode step, so
        the calls of up to ``_PENDING_FORWARDS`` forwards go through one routing pass and
        one host copy. Rows keep their order: per forward, layer-major.
        """
        pending, self._pending, self._pending_rows = self._pending, [], 0
        calls = [(fwd, call) for fwd in pending for call in fwd.calls]
        if not calls:
            return
        keys = {_call_key(call) for _, call in calls}
        if len(keys) == 1:
            self._add_calls(calls)
        else:  # layers of different shapes: one call at a time keeps the row order
            for item in calls:
                self._add_calls([item])

    def _add_calls(self, calls: list) -> None:
        E, K, scoring, _, device = _call_key(calls[0][1])
        r = make_routing(
            torch.cat([c[2].reshape(-1, E) for _, c in calls]),
            torch.cat([c[3].reshape(-1, K) for _, c in calls]),
            torch.cat([c[4].reshape(-1, K) for _, c in calls]),
            scoring,
        )
        counts = np.array([fwd.n for fwd, _ in calls])
        rows = int(counts.sum())
        if all(fwd.valid is None for fwd, _ in calls):  # no padding anywhere: keep every row
            idx = slice(None)
        else:
            idx = torch.cat(
                [fwd.valid if fwd.valid is not None else torch.ones(fwd.n, dtype=torch.bool) for fwd, _ in calls]
            ).to(device)
        self._buf_lists["experts"].append(r.experts[idx].to("cpu", torch.int32).numpy().reshape(-1))
        self._buf_lists["weights"].append(r.weights[idx].to("cpu", torch.float32).numpy().reshape(-1))
        self._buf_lists["k"].append(np.full(rows, K, dtype=np.int32))
        if self.config.scores:
            self._buf_lists["scores"].append(r.scores[idx].to("cpu", torch.float32).numpy())
        self._buf["seq"].append(np.concatenate([fwd.seq for fwd, _ in calls]))
        self._buf["pos"].append(np.concatenate([fwd.pos for fwd, _ in calls]))
        self._buf["token_id"].append(np.concatenate([fwd.token_id for fwd, _ in calls]))
        self._buf["step"].append(np.repeat(np.array([fwd.step for fwd, _ in calls], np.int32), counts))
        self._buf["phase"].append(np.repeat(np.array([fwd.phase for fwd, _ in calls], dtype=object), counts))
        self._buf["layer"].append(np.repeat(np.array([c[0].layer_idx for _, c in calls], np.int32), counts))
        self._buf["moe_layer"].append(np.repeat(np.array([c[0].index for _, c in calls], np.int32), counts))
        if self.config.hidden_states:
            hidden = torch.cat([c[1].reshape(-1, c[1].shape[-1]) for _, c in calls])
            hidx = idx if isinstance(idx, slice) else idx.to(hidden.device)
            self._buf_hidden.append(hidden[hidx].to("cpu", _HIDDEN_DTYPES[self.config.hidden_dtype]))
        self._buf_rows += rows
        for fwd, _ in calls:
            self._phase_rows[fwd.phase] += fwd.n

    def _flush(self) -> None:
        if self._buf_rows == 0:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols: dict[str, Any] = {k: np.concatenate(v) for k, v in self._buf.items()}
        ks = np.concatenate(self._buf_lists["k"])
        offsets = np.concatenate([[0], np.cumsum(ks)]).astype(np.int32)
        arrays = [
            pa.array(cols["seq"], pa.int64()),
            pa.array(cols["step"], pa.int32()),
            pa.array(cols["pos"], pa.int32()),
            pa.array(cols["phase"], pa.string()),
            pa.array(cols["token_id"], pa.int64()),
            pa.array(cols["layer"], pa.int32()),
            pa.array(cols["moe_layer"], pa.int32()),
            pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(self._buf_lists["experts"]), pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(self._buf_lists["weights"]), pa.float32())),
        ]
        if self.config.scores:
            scores = self._buf_lists["scores"]
            lens = np.concatenate([np.full(s.shape[0], s.shape[1], dtype=np.int32) for s in scores])
            s_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            flat = np.concatenate([s.reshape(-1) for s in scores])
            arrays.append(pa.ListArray.from_arrays(s_off, pa.array(flat, pa.float32())))
        schema = routes_schema(self.config.scores)
        table = pa.Table.from_arrays(arrays, schema=schema)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._tmp / ROUTES_FILE, schema, compression="zstd")
        self._writer.write_table(table, row_group_size=table.num_rows)
        if self.config.hidden_states:
            from safetensors.torch import save_file

            name = HIDDEN_PATTERN.format(len(self._shards))
            hidden = torch.cat(self._buf_hidden) if self._buf_hidden else torch.empty(0)
            save_file({"hidden": hidden.contiguous()}, str(self._tmp / name))
            self._shards.append({"file": name, "rows": int(hidden.shape[0])})
        self._rows += table.num_rows
        self._buf = {k: [] for k in self._buf}
        self._buf_lists = {k: [] for k in self._buf_lists}
        self._buf_hidden = []
        self._buf_rows = 0
        _release_heap()

    def _meta(self) -> dict[str, Any]:
        import platform

        import pyarrow
        import transformers

        from moelab.adapters import model_fingerprint

        info = model_info(self.model).to_dict()
        dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
        hidden = None
        if self.config.hidden_states:
            hidden = {
                "dtype": self.config.hidden_dtype,
                "hidden_size": info["hidden_size"],
                "shards": self._shards,
                "what": "input of each MoE layer's router (the post-attention-norm hidden state)",
            }
        return {
            "format": "moelab.routing_trace",
            "schema_version": SCHEMA_VERSION,
            "trace_id": uuid.uuid4().hex,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": {
                "name": self.model_name,
                "fingerprint": model_fingerprint(self.model),
                "dtype": str(dtype).replace("torch.", ""),
                **info,
            },
            "recording": {"scores": self.config.scores, "hidden_states": hidden},
            "num_rows": self._rows,
            "num_sequences": int(self._next_seq),
            "rows_by_phase": self._phase_rows,
            "versions": {
                "moelab": __version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "pyarrow": pyarrow.__version__,
                "python": platform.python_version(),
            },
            "metadata": self.metadata,
        }


def _release_heap() -> None:
    """Give the freed buffers of a flush back to the OS (glibc only; a no-op elsewhere).

    A flush frees tens of MB of numpy/torch buffers allocated between many small model
    allocations; glibc keeps such freed heap pages (RSS grew about linearly with rows in
    the probe of issue 18, and ``malloc_trim`` returned most of it). Trimming after each
    flush keeps the recorder's resident memory bounded by ``flush_rows``.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def _call_key(call: tuple) -> tuple:
    """Router calls with equal keys can be converted in one batch."""
    layer, _, logits, weights, experts = call
    return (logits.shape[-1], experts.shape[-1], layer.spec.scoring, weights.dtype, logits.device)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record(model: nn.Module, out: str | Path | None = None, **kwargs: Any) -> TraceRecorder:
    """A :class:`TraceRecorder` for ``model`` (use it as a context manager)."""
    return TraceRecorder(model, out, **kwargs)
