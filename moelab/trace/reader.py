"""Read routing traces lazily; pandas and numpy views.

Nothing is read when a trace is opened but ``meta.json`` and the Parquet footer (to
check that the trace is complete). Columns are read on demand and cached; hidden states
are memory-mapped from their safetensors shards.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.trace.schema import META_FILE, ROUTES_FILE, SCHEMA_VERSION


class RoutingTrace:
    """A recorded routing trace (see :mod:`moelab.trace.schema` for the format)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = _read_meta(self.path)
        self._columns: dict[str, Any] = {}
        self._check_complete()

    # ------------------------------------------------------------------ identity and shape
    def __repr__(self) -> str:
        m = self.meta["model"]
        return (
            f"RoutingTrace({str(self.path)!r}, model={m.get('name')!r}, rows={self.num_rows}, "
            f"moe_layers={len(self.moe_layers)}, E={self.num_experts}, K={self.top_k})"
        )

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_rows(self) -> int:
        return int(self.meta["num_rows"])

    @property
    def moe_layers(self) -> list[int]:
        """Decoder-layer indices of the MoE layers, in order."""
        return list(self.meta["model"]["moe_layers"])

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (a single int; see ``num_experts_per_layer``)."""
        return int(max(self.meta["model"]["num_experts"]))

    @property
    def num_experts_per_layer(self) -> list[int]:
        return list(self.meta["model"]["num_experts"])

    @property
    def top_k(self) -> int:
        """Experts per token (the largest top-k; see ``top_k_per_layer``)."""
        return int(max(self.meta["model"]["top_k"]))

    @property
    def top_k_per_layer(self) -> list[int]:
        return list(self.meta["model"]["top_k"])

    @property
    def has_scores(self) -> bool:
        return bool(self.meta["recording"]["scores"])

    @property
    def has_hidden_states(self) -> bool:
        return self.meta["recording"].get("hidden_states") is not None

    @property
    def model_fingerprint(self) -> str:
        return self.meta["model"]["fingerprint"]

    @property
    def trace_id(self) -> str:
        return self.meta["trace_id"]

    # ------------------------------------------------------------------ tables
    @cached_property
    def _parquet(self):
        import pyarrow.parquet as pq

        return pq.ParquetFile(self.path / ROUTES_FILE, memory_map=True)

    def table(self, columns: list[str] | None = None):
        """The routes as a ``pyarrow.Table`` (all columns, or the ones named)."""
        import pyarrow.parquet as pq

        names = self._parquet.schema_arrow.names
        for c in columns or []:
            if c not in names:
                hint = " (record with scores=True)" if c == "scores" else ""
                raise MoelabError(f"trace {str(self.path)!r} has no column {c!r}{hint}; columns: {', '.join(names)}.")
        try:
            return pq.read_table(self.path / ROUTES_FILE, columns=columns, memory_map=True)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise MoelabError(
                f"trace {str(self.path)!r} is corrupt ({ROUTES_FILE}: {_first_line(exc)}); record it again."
            ) from None

    def to_pandas(self, columns: list[str] | None = None):
        """The routes as a pandas DataFrame (list columns become numpy arrays per row)."""
        return self.table(columns).to_pandas()

    def column(self, name: str) -> np.ndarray:
        """A scalar column (seq, step, pos, phase, token_id, layer, moe_layer) as numpy, cached."""
        if name not in self._columns:
            col = self.table([name]).column(name)
            self._columns[name] = col.to_numpy(zero_copy_only=False)
        return self._columns[name]

    def _list_matrix(self, name: str, width: int | None) -> np.ndarray:
        key = f"{name}[]"
        if key not in self._columns:
            import pyarrow as pa

            col = self.table([name]).column(name)
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            if len(col) == 0:
                self._columns[key] = np.zeros((0, width or 0), dtype=np.float32)
                return self._columns[key]
            lengths = col.value_lengths().to_numpy(zero_copy_only=False)
            values = col.flatten().to_numpy(zero_copy_only=False)
            if np.all(lengths == lengths[0]):
                mat = values.reshape(len(col), int(lengths[0]))
            else:  # layers with different top-k / E: pad with -1 (ids) or 0 (floats)
                w = int(lengths.max())
                fill = -1 if np.issubdtype(values.dtype, np.integer) else 0
                mat = np.full((len(col), w), fill, dtype=values.dtype)
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
                    mat[i, : b - a] = values[a:b]
            self._columns[key] = mat
        return self._columns[key]

    def experts_array(self) -> np.ndarray:
        """(rows, K) int32 expert ids, by descending weight (-1 pads layers with smaller K)."""
        fresh = "experts[]" not in self._columns
        ids = self._list_matrix("experts", self.top_k)
        if fresh and ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= self.num_experts:
                del self._columns["experts[]"]
                bad = lo if lo < -1 else hi
                raise MoelabError(
                    f"trace {str(self.path)!r} is corrupt: expert id {bad} in {ROUTES_FILE}, expected "
                    f"0..{self.num_experts - 1} (num_experts in {META_FILE}); record it again."
                )
        return ids

    def weights_array(self) -> np.ndarray:
        """(rows, K) float32 router weights aligned with :meth:`experts_array`."""
        return self._list_matrix("weights", self.top_k)

    def scores_array(self) -> np.ndarray:
        """(rows, E) float32 full router score vectors; needs a trace recorded with scores."""
        if not self.has_scores:
            raise MoelabError(
                f"trace {str(self.path)!r} was recorded without router scores; record again with "
                "scores=True (the default; CLI: omit --no-scores)."
            )
        return self._list_matrix("scores", self.num_experts)

    # ------------------------------------------------------------------ hidden states
    def hidden_states(self):
        """(rows, H) router-input hidden states as a torch tensor, memory-mapped per shard.

        The shards are concatenated (one copy); use :meth:`hidden_shards` to stream them.
        """
        import torch

        shards = list(self.hidden_shards())
        return torch.cat(shards) if len(shards) != 1 else shards[0]

    def hidden_shards(self):
        """Yield the hidden-state shards (memory-mapped tensors) in row order."""
        from safetensors import safe_open

        info = self.meta["recording"].get("hidden_states")
        if info is None:
            raise MoelabError(
                f"trace {str(self.path)!r} has no hidden states; record with hidden_states=True "
                "(CLI: moelab trace ... --hidden-states)."
            )
        import torch

        H = info["hidden_size"]
        for shard in info["shards"]:
            where = f"trace {str(self.path)!r}: hidden-state shard {shard['file']}"
            try:
                with safe_open(str(self.path / shard["file"]), framework="pt") as f:
                    names = list(f.keys())
                    if "hidden" not in names:
                        raise MoelabError(
                            f"{where} has tensors {sorted(names)}, expected one named 'hidden'; "
                            "the trace is corrupt, record it again."
                        )
                    t = f.get_tensor("hidden")
            except MoelabError:
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types
                raise MoelabError(
                    f"{where} is not a readable safetensors file ({_first_line(exc)}); record the trace again."
                ) from None
            if t.ndim != 2 or t.shape[0] != shard["rows"] or t.shape[1] != H:
                raise MoelabError(
                    f"{where} has shape {tuple(t.shape)}, expected ({shard['rows']}, {H}) per "
                    f"{META_FILE}; the trace is corrupt, record it again."
                )
            if not t.is_floating_point():
                raise MoelabError(f"{where} has dtype {t.dtype}, expected a float type; record it again.")
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise MoelabError(
                    f"{where} holds NaN or infinite values; the trace is corrupt, record it again."
                )
            yield t

    # ------------------------------------------------------------------ summaries
    def mask(self, *, phase: str | None = None, moe_layer: int | None = None) -> np.ndarray:
        """Boolean row mask for a phase (``prefill``/``decode``) and/or an MoE layer ordinal."""
        m = np.ones(self.num_rows, dtype=bool)
        if phase is not None:
            if phase not in ("prefill", "decode"):
                raise MoelabError(f"phase must be 'prefill' or 'decode', got {phase!r}.")
            m &= self.column("phase") == phase
        if moe_layer is not None:
            m &= self.column("moe_layer") == moe_layer
        return m

    def expert_load(self, phase: str | None = None) -> np.ndarray:
        """(MoE layers, E) how many tokens selected each expert."""
        experts = self.experts_array()
        rows = self.mask(phase=phase)
        layer = self.column("moe_layer")[rows]
        ids = experts[rows]
        load = np.zeros((self.num_moe_layers, self.num_experts), dtype=np.int64)
        valid = ids >= 0
        np.add.at(load, (np.broadcast_to(layer[:, None], ids.shape)[valid], ids[valid]), 1)
        return load

    def summary(self) -> dict[str, Any]:
        """Tokens, layers, E, top-k and an expert-load summary (what ``moelab trace-info`` prints)."""
        phase = self.column("phase") if self.num_rows else np.array([], dtype=object)
        layers = max(self.num_moe_layers, 1)
        load = self.expert_load()
        per_layer = []
        for i, row in enumerate(load):
            total = row.sum()
            frac = row / total if total else row.astype(float)
            per_layer.append(
                {
                    "moe_layer": i,
                    "layer": self.moe_layers[i],
                    "experts_used": int((row > 0).sum()),
                    "max_share": float(frac.max()) if total else 0.0,
                    "min_share": float(frac.min()) if total else 0.0,
                    "cv": float(row.std() / row.mean()) if row.mean() > 0 else 0.0,
                }
            )
        return {
            "path": str(self.path),
            "model": self.meta["model"]["name"],
            "model_type": self.meta["model"]["model_type"],
            "rows": self.num_rows,
            "tokens": self.num_rows // layers,
            "prefill_tokens": int((phase == "prefill").sum()) // layers,
            "decode_tokens": int((phase == "decode").sum()) // layers,
            "sequences": int(self.meta["num_sequences"]),
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts_per_layer,
            "top_k": self.top_k_per_layer,
            "scores": self.has_scores,
            "hidden_states": self.has_hidden_states,
            "expert_load": per_layer,
        }

    # ------------------------------------------------------------------ validation
    def _check_complete(self) -> None:
        routes = self.path / ROUTES_FILE
        if not routes.is_file():
            raise MoelabError(f"trace {str(self.path)!r} is truncated: {ROUTES_FILE} is missing; record it again.")
        try:
            rows = self._parquet.metadata.num_rows
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise MoelabError(
                f"trace {str(self.path)!r} is truncated or corrupt ({ROUTES_FILE}: {exc}); record it again."
            ) from None
        if rows != self.num_rows:
            raise MoelabError(
                f"trace {str(self.path)!r} is truncated: meta.json says {self.num_rows} rows, "
                f"{ROUTES_FILE} has {rows}; record it again."
            )
        hidden = self.meta["recording"].get("hidden_states")
        if hidden:
            total = 0
            for shard in hidden["shards"]:
                if not (self.path / shard["file"]).is_file():
                    raise MoelabError(f"trace {str(self.path)!r} is truncated: {shard['file']} is missing.")
                total += shard["rows"]
            if total != self.num_rows:
                raise MoelabError(
                    f"trace {str(self.path)!r} is inconsistent: hidden-state shards hold {total} rows, "
                    f"routes {self.num_rows}; record it again."
                )


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise MoelabError(f"no trace at {str(path)!r}: the directory does not exist (record one with `moelab trace`).")
    if not path.is_dir():
        raise MoelabError(f"{str(path)!r} is a file; a trace is a directory with meta.json and {ROUTES_FILE}.")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise MoelabError(
            f"{str(path)!r} is not a complete moelab trace (no {META_FILE}): an interrupted recording "
            "or another directory; record it again."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MoelabError(f"{str(meta_path)!r} is not valid JSON ({exc}); the trace is corrupt, record it again.") from None
    if not isinstance(meta, dict):
        raise MoelabError(
            f"{str(meta_path)!r} holds a JSON {type(meta).__name__}, expected an object; not a moelab trace."
        )
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise MoelabError(f"{str(meta_path)!r} has no integer schema_version; not a moelab trace.")
    if version > SCHEMA_VERSION:
        raise MoelabError(
            f"trace {str(path)!r} has schema version {version}, newer than this moelab supports "
            f"({SCHEMA_VERSION}); upgrade moelab (pip install -U moelab) to read it."
        )
    _check_meta(meta, meta_path)
    return meta


#: Sanity bounds on shapes read from meta.json (real MoE models are far below them).
MAX_EXPERTS = 1 << 16
MAX_MOE_LAYERS = 1 << 12
_SHARD_NAME = re.compile(r"^hidden-\d{5,}\.safetensors$")


def _check_meta(meta: dict[str, Any], meta_path: Path) -> None:
    """meta.json must have the fields and types moelab reads; one clear error otherwise."""
    where = str(meta_path)

    def bad(field: str, value: Any, expected: str) -> MoelabError:
        return MoelabError(
            f"{where!r}: {field} is {value!r}, expected {expected}; the trace is corrupt or was "
            "edited, record it again."
        )

    def int_in(field: str, value: Any, low: int, high: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            rng = f"an integer in [{low}, {high}]" if high is not None else f"an integer ≥ {low}"
            raise bad(field, value, rng)
        return value

    def int_list(field: str, value: Any, low: int, high: int) -> list[int]:
        if not isinstance(value, list):
            raise bad(field, value, "a list of integers")
        return [int_in(f"{field}[{i}]", v, low, high) for i, v in enumerate(value)]

    model = meta.get("model")
    if not isinstance(model, dict):
        raise bad("model", model, "an object with the model's name, layers, experts and top-k")
    if not isinstance(model.get("fingerprint"), str):
        raise bad("model.fingerprint", model.get("fingerprint"), "a string")
    for key in ("name", "model_type"):
        if key in model and not isinstance(model[key], str):
            raise bad(f"model.{key}", model[key], "a string")
    layers = int_list("model.moe_layers", model.get("moe_layers"), 0, 1 << 20)
    if not 1 <= len(layers) <= MAX_MOE_LAYERS:
        raise bad("model.moe_layers", model.get("moe_layers"), f"1 to {MAX_MOE_LAYERS} layer indices")
    experts = int_list("model.num_experts", model.get("num_experts"), 1, MAX_EXPERTS)
    top_k = int_list("model.top_k", model.get("top_k"), 1, MAX_EXPERTS)
    for name, values in (("model.num_experts", experts), ("model.top_k", top_k)):
        if len(values) != len(layers):
            raise bad(name, values, f"one entry per MoE layer ({len(layers)})")
    for i, (k, e) in enumerate(zip(top_k, experts)):
        if k > e:
            raise bad(f"model.top_k[{i}]", k, f"at most num_experts ({e})")
    int_in("num_rows", meta.get("num_rows"), 0)
    int_in("num_sequences", meta.get("num_sequences"), 0)
    rec = meta.get("recording")
    if not isinstance(rec, dict):
        raise bad("recording", rec, "an object with 'scores' and 'hidden_states'")
    if not isinstance(rec.get("scores"), bool):
        raise bad("recording.scores", rec.get("scores"), "true or false")
    hidden = rec.get("hidden_states")
    if hidden is None:
        return
    if not isinstance(hidden, dict) or not isinstance(hidden.get("shards"), list):
        raise bad("recording.hidden_states", hidden, "null or an object with a list of 'shards'")
    int_in("recording.hidden_states.hidden_size", hidden.get("hidden_size"), 1, 1 << 20)
    for i, shard in enumerate(hidden["shards"]):
        if not isinstance(shard, dict):
            raise bad(f"recording.hidden_states.shards[{i}]", shard, "an object with 'file' and 'rows'")
        name = shard.get("file")
        # a plain file name inside the trace directory: no paths, no '..'
        if not isinstance(name, str) or not _SHARD_NAME.match(name):
            raise bad(f"recording.hidden_states.shards[{i}].file", name,
                      "a file name like 'hidden-00000.safetensors' inside the trace directory")
        int_in(f"recording.hidden_states.shards[{i}].rows", shard.get("rows"), 0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def open_trace(path: str | Path) -> RoutingTrace:
    """Open the routing trace at ``path`` (a clear error if missing, truncated or too new)."""
    return RoutingTrace(path)
