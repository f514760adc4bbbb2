"""Save and load predictors: ``predictor.json`` + ``state.safetensors`` in a directory. No pickle.

``predictor.json`` holds the kind, the hyperparameters, the model identity (name,
fingerprint, layers, E, top-k), the trace identity, fit information and any metrics;
``state.safetensors`` holds the learned arrays (names documented per predictor class).
Writes go to a sibling temporary directory renamed into place, so a failure leaves
nothing behind.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from moelab import __version__
from moelab._output import reserve_output
from moelab.errors import MoelabError
from moelab.predictors.base import Predictor

FORMAT = "moelab.predictor"
FORMAT_VERSION = 1
META_FILE = "predictor.json"
STATE_FILE = "state.safetensors"

_IDENTITY = ("model_name_", "model_fingerprint_", "model_type_", "num_moe_layers_", "num_experts_",
             "top_k_", "hidden_size_", "trace_id_")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def save_predictor(predictor: Predictor, path: str | Path, *, metrics: dict | None = None,
                   overwrite: bool = False, reservation: Any = None) -> Path:
    """Write ``predictor`` (fitted) to directory ``path``; returns the path.

    ``reservation``: a claim of ``path`` taken before fitting (:func:`moelab._output.reserve_output`;
    ``moelab predict fit --out`` claims it before the work); without it, ``path`` is claimed here."""
    from safetensors.numpy import save_file

    predictor._check_fitted()
    path = Path(path)
    if reservation is None and os.path.lexists(path) and not overwrite:
        raise MoelabError(f"predictor output {str(path)!r} already exists; pass overwrite=True (CLI: --overwrite).")
    params = predictor.get_params()
    try:
        json.dumps(params)
    except TypeError as exc:
        raise MoelabError(f"hyperparameters of {predictor!r} are not JSON-serialisable ({exc}).") from None
    tensors, extra = predictor._state()
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    tensors["val_sequences"] = np.asarray(predictor.val_sequences_, dtype=np.int64)
    tensors["train_sequences"] = np.asarray(predictor.train_sequences_, dtype=np.int64)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": predictor.kind,
        "class": f"{type(predictor).__module__}.{type(predictor).__qualname__}",
        "params": params,
        "model": {
            "name": predictor.model_name_,
            "fingerprint": predictor.model_fingerprint_,
            "model_type": predictor.model_type_,
            "num_moe_layers": predictor.num_moe_layers_,
            "num_experts": predictor.num_experts_,
            "top_k": predictor.top_k_,
            "hidden_size": predictor.hidden_size_,
        },
        "trace": {"trace_id": predictor.trace_id_},
        "fit": {"seconds": getattr(predictor, "fit_seconds_", None)},
        "state": _jsonable(extra),
        "metrics": _jsonable(metrics or {}),
        "moelab_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with reservation or reserve_output(path, overwrite, what="predictor output") as out:
        save_file(tensors, str(out.staging / STATE_FILE), metadata={"format": FORMAT})
        (out.staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        out.commit()
    return path


def read_predictor_meta(path: str | Path) -> dict[str, Any]:
    """The ``predictor.json`` of a saved predictor (checked)."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise MoelabError(
            f"{str(path)!r} is not a saved predictor (no {META_FILE}); save one with predictor.save(dir) "
            "or `moelab predict fit ... --out DIR`."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MoelabError(f"{str(meta_path)!r} is not valid JSON ({exc}).") from None
    if not isinstance(meta, dict):
        raise MoelabError(
            f"{str(meta_path)!r} holds a JSON {type(meta).__name__}, expected an object; not a moelab predictor."
        )
    if meta.get("format") != FORMAT:
        raise MoelabError(f"{str(meta_path)!r} is not a moelab predictor (format {meta.get('format')!r}).")
    version = meta.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise MoelabError(
            f"{str(meta_path)!r}: format_version is {version!r}, expected an integer; the file is corrupt."
        )
    _check_meta(meta, meta_path)
    if version > FORMAT_VERSION:
        raise MoelabError(
            f"predictor {str(path)!r} has format version {meta['format_version']}, newer than this moelab "
            f"supports ({FORMAT_VERSION}); upgrade moelab."
        )
    return meta


def _check_meta(meta: dict[str, Any], meta_path: Path) -> None:
    """The fields :func:`load_predictor` reads, with their types; one clear error otherwise."""
    from moelab.trace.reader import MAX_EXPERTS, MAX_MOE_LAYERS

    def bad(field: str, value: Any, expected: str) -> MoelabError:
        return MoelabError(
            f"{str(meta_path)!r}: {field} is {value!r}, expected {expected}; the predictor file is corrupt "
            "or was edited, fit it again."
        )

    def int_in(field: str, value: Any, low: int, high: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise bad(field, value, f"an integer in [{low}, {high}]")
        return value

    if not isinstance(meta.get("kind"), str):
        raise bad("kind", meta.get("kind"), "a predictor kind name")
    if not isinstance(meta.get("params"), dict):
        raise bad("params", meta.get("params"), "an object of hyperparameters")
    m = meta.get("model")
    if not isinstance(m, dict):
        raise bad("model", m, "an object with the model's identity and shape")
    for key in ("name", "fingerprint"):
        if not isinstance(m.get(key), str):
            raise bad(f"model.{key}", m.get(key), "a string")
    L = int_in("model.num_moe_layers", m.get("num_moe_layers"), 1, MAX_MOE_LAYERS)
    for key in ("num_experts", "top_k"):
        values = m.get(key)
        if not isinstance(values, list) or len(values) != L:
            raise bad(f"model.{key}", values, f"a list of {L} integers (one per MoE layer)")
        for i, v in enumerate(values):
            int_in(f"model.{key}[{i}]", v, 1, MAX_EXPERTS)
    if m.get("hidden_size") is not None:
        int_in("model.hidden_size", m["hidden_size"], 0, 1 << 20)
    if not isinstance(meta.get("trace"), dict) or not isinstance(meta["trace"].get("trace_id"), str):
        raise bad("trace", meta.get("trace"), "an object with a 'trace_id' string")
    for key in ("state", "fit", "metrics"):
        if not isinstance(meta.get(key, {}), dict):
            raise bad(key, meta.get(key), "an object")


def load_predictor(path: str | Path, *, model: Any = None) -> Predictor:
    """Load a predictor saved with :func:`save_predictor`.

    ``model`` is needed by predictors that use the model's routers (skip) when the model
    cannot be loaded by its recorded name; its fingerprint must match.
    """
    from safetensors.numpy import load_file

    from moelab.predictors.registry import make_predictor

    path = Path(path)
    meta = read_predictor_meta(path)
    try:  # refuses unknown kinds and unknown hyperparameters by name
        predictor = make_predictor(meta["kind"], **meta["params"])
    except MoelabError as exc:
        raise MoelabError(f"predictor {str(path)!r}: {exc}") from None
    m = meta["model"]
    predictor.model_name_ = m["name"]
    predictor.model_fingerprint_ = m["fingerprint"]
    predictor.model_type_ = m["model_type"]
    predictor.num_moe_layers_ = int(m["num_moe_layers"])
    predictor.num_experts_ = [int(e) for e in m["num_experts"]]
    predictor.top_k_ = [int(k) for k in m["top_k"]]
    predictor.hidden_size_ = int(m.get("hidden_size") or 0)
    predictor.trace_id_ = meta["trace"]["trace_id"]
    predictor.fit_seconds_ = meta.get("fit", {}).get("seconds")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise MoelabError(f"predictor {str(path)!r} is incomplete: {STATE_FILE} is missing.")
    try:  # safetensors only: a pickle (or anything else) is refused, never executed
        tensors = load_file(str(state_file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MoelabError(
            f"predictor {str(path)!r}: {STATE_FILE} is not a readable safetensors file ({text}); fit it again."
        ) from None
    for name, arr in tensors.items():
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            raise MoelabError(
                f"predictor {str(path)!r}: tensor {name!r} in {STATE_FILE} holds NaN or infinite values; "
                "fit it again."
            )
    try:
        predictor.val_sequences_ = tensors.pop("val_sequences")
        predictor.train_sequences_ = tensors.pop("train_sequences")
        predictor._load_state(tensors, meta.get("state", {}), model)
    except MoelabError as exc:
        raise MoelabError(f"predictor {str(path)!r}: {exc}") from None
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise MoelabError(
            f"predictor {str(path)!r}: {STATE_FILE} does not match {META_FILE} ({type(exc).__name__}: "
            f"{exc}); the files are corrupt or from another predictor, fit it again."
        ) from None
    predictor.metrics_ = meta.get("metrics", {})
    return predictor
