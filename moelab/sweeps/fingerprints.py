"""Model fingerprints for cell hashes, without reloading every model on every resume.

A cell's hash covers :func:`moelab.adapters.model_fingerprint` (MoE structure, config and
router weights). Computing it needs the model loaded, so the store remembers it under a
*source signature*: for a checkpoint directory the names, sizes and modification times of
its files; for ``tiny-random-*`` the name and moelab's version (the builder is seeded). A
changed checkpoint gets a new signature, is loaded again and, if its weights changed, new
cell hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import moelab
from moelab.errors import MoelabError
from moelab.sweeps.spec import ModelSpec

log = logging.getLogger(__name__)


def source_signature(model: ModelSpec) -> str:
    from moelab.models.bundled import TINY_RANDOM_PREFIX, bundled_path

    parts: dict = {"name": model.name, "dtype": model.dtype}
    if model.name.startswith(TINY_RANDOM_PREFIX):
        parts["moelab"] = moelab.__version__
    else:
        path = bundled_path(model.name) or Path(model.name).expanduser()
        root = Path(path).resolve()
        parts["path"] = str(root)
        parts["files"] = sorted(
            (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()
        )
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def compute(model: ModelSpec) -> str:
    """Load ``model`` and return its fingerprint."""
    from moelab import load
    from moelab.adapters import model_fingerprint

    log.info("fingerprinting %s", model.name)
    m, _ = load(model.name, dtype=model.dtype)
    try:
        return model_fingerprint(m)
    finally:
        del m


def resolve(models: list[ModelSpec], store) -> dict[str, str]:
    """``{model name: fingerprint}``, from ``store``'s cache where the source is unchanged."""
    out: dict[str, str] = {}
    for m in models:
        sig = source_signature(m)
        fp = store.cached_fingerprint(sig) if store is not None else None
        if fp is None:
            fp = compute(m)
            if store is not None and store.writable:
                store.cache_fingerprint(sig, m.name, fp)
        out[m.name] = fp
    return out


def path_signature(path: str | Path) -> str:
    """A trace's (or saved predictor's) identity for cell hashes: the names, sizes and
    modification times of its files and the sha256 of its ``meta.json``/``predictor.json``
    (a re-recorded trace gets new cells; an untouched one keeps its finished cells)."""
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise MoelabError(f"{str(path)!r} does not exist; give the path of a routing trace (moelab trace --out) "
                          "or a saved predictor directory.")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    parts: dict = {"path": str(root), "files": [
        (str(p.relative_to(root)) if p != root else p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}
    for name in ("meta.json", "predictor.json"):
        if (root / name).is_file():
            parts[name] = hashlib.sha256((root / name).read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def model_top_k(model: ModelSpec) -> int | None:
    """The smallest top-k among ``model``'s MoE layers, read from its config on the meta device
    (no weights loaded); None where the config cannot be read here (the cell then checks)."""
    import torch

    from moelab.adapters import moe_layers
    from moelab.models.bundled import TINY_RANDOM_PREFIX, bundled_path

    try:
        if model.name.startswith(TINY_RANDOM_PREFIX):
            from moelab.models.tiny import tiny_config

            config = tiny_config(model.name[len(TINY_RANDOM_PREFIX):])
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(bundled_path(model.name) or Path(model.name).expanduser()))
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(config)
        return min(layer.top_k for layer in moe_layers(m))
    except Exception as e:  # noqa: BLE001 - a model the spec check cannot read is checked when it loads
        log.debug("top-k of %s not known before loading: %s", model.name, e)
        return None
