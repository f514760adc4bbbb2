"""``moelab.load``: one entry point for bundled names, tiny random models, local paths and hub ids."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelab.errors import MoelabError, did_you_mean

log = logging.getLogger(__name__)

_DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """A torch dtype (or ``"auto"``) from a name such as ``"bf16"``; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise MoelabError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}.")
    return _DTYPES[dtype]


def known_model_names() -> list[str]:
    """Names ``load`` accepts without a path: bundled models and ``tiny-random-<family>``."""
    from moelab.models.bundled import TINY_RANDOM_PREFIX, bundled_models
    from moelab.models.tiny import FAMILIES

    return [*bundled_models(), *(TINY_RANDOM_PREFIX + f for f in FAMILIES)]


def load(
    name_or_path: str | Path | nn.Module,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[nn.Module, Any]:
    """Load an MoE causal LM and its tokenizer; returns ``(model, tokenizer)`` in eval mode.

    ``name_or_path`` is one of:

    * a model instance — returned as is (with ``tokenizer`` if given, else None);
    * a bundled model name (``moelab models`` lists them);
    * ``tiny-random-<family>`` — a random tiny model of a supported family (``seed``);
    * a local directory saved with ``save_pretrained``;
    * a hub id (needs network access; real checkpoints load as with transformers).

    Loading also registers moelab's native experts implementations, so
    ``model.set_experts_implementation("moelab")`` (or ``moelab_int8``/``moelab_int4``) works.

    ``dtype`` and ``device_map`` (accelerate; e.g. ``"auto"`` to spread a model larger
    than memory over devices and disk) and any other keyword are passed to
    ``from_pretrained``. ``trust_remote_code`` stays off unless asked for.
    """
    import moelab.kernels  # noqa: F401 - registers the "moelab*" experts implementations (builds nothing)
    from moelab.adapters import get_adapter

    if isinstance(name_or_path, nn.Module):
        get_adapter(name_or_path)
        return name_or_path, prepare_tokenizer(tokenizer, name_or_path, given=True)

    from moelab.models.bundled import TINY_RANDOM_PREFIX, bundled_path

    name = str(name_or_path)
    torch_dtype = parse_dtype(dtype)
    if name.startswith(TINY_RANDOM_PREFIX):
        from moelab.models.tiny import FAMILIES, build_tiny
        from moelab.models.tokenizer import byte_tokenizer

        family = name[len(TINY_RANDOM_PREFIX) :]
        if family not in FAMILIES:
            raise MoelabError(
                f"unknown tiny random model {name!r}.{did_you_mean(name, known_model_names())} "
                f"Tiny random models are named {TINY_RANDOM_PREFIX}<family> with family one of: {', '.join(FAMILIES)}."
            )
        model = build_tiny(family, seed=seed, dtype=torch_dtype if isinstance(torch_dtype, torch.dtype) else torch.float32)
        model.name_or_path = name
        return model, prepare_tokenizer(tokenizer or byte_tokenizer(), model, given=tokenizer is not None)

    path = bundled_path(name)
    if path is None and Path(name).expanduser().exists():
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise MoelabError(
                f"{str(path)!r} exists but has no config.json; expected a directory written by "
                "model.save_pretrained() (and tokenizer.save_pretrained())."
            )
    if path is None and _looks_like_path(name):
        raise MoelabError(
            f"model {name!r} is neither a bundled model nor an existing directory.{did_you_mean(name, known_model_names())} "
            f"Known names: {', '.join(known_model_names())}."
        )
    source = str(path) if path is not None else name
    model = _from_pretrained(source, torch_dtype, device_map, trust_remote_code, kwargs)
    get_adapter(model)  # refuse non-MoE and unsupported models with a clear message
    given = tokenizer is not None
    if tokenizer is None:
        tokenizer = _load_tokenizer(source, trust_remote_code)
    model.eval()
    return model, prepare_tokenizer(tokenizer, model, given=given)


def model_context_length(model: Any) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` or its aliases), if known."""
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def prepare_tokenizer(tokenizer: Any, model: Any, *, given: bool = False) -> Any:
    """Make ``tokenizer`` fit a decoder-only ``model``: pad on the left, and a
    ``model_max_length`` no longer than the model's context.

    Right padding puts pad tokens between a shorter prompt and its continuation, so batched
    ``generate`` continues those rows from padding (wrong text, wrong routing traces); a
    ``model_max_length`` above the context lets ``truncation=True`` pass prompts the model
    cannot read. ``given``: the caller passed this tokenizer (changes are logged as warnings).
    """
    if tokenizer is None:
        return None
    report = log.warning if given else log.info
    if getattr(tokenizer, "padding_side", "left") != "left":
        report("tokenizer padded on the %s; decoder-only models need left padding: set padding_side='left'",
               tokenizer.padding_side)
        tokenizer.padding_side = "left"
    ctx = model_context_length(model)
    current = getattr(tokenizer, "model_max_length", None)
    if ctx is not None and isinstance(current, int) and current > ctx:
        if current < 10**9:  # transformers' "no limit" sentinel is ~1e30: nothing to report
            report("tokenizer model_max_length %d is longer than the model's %d-token context; set to %d",
                   current, ctx, ctx)
        tokenizer.model_max_length = ctx
    return tokenizer


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or " " in name


def _from_pretrained(source: str, dtype, device_map, trust_remote_code: bool, kwargs: dict) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if Path(source).is_dir():  # a local directory whose config.json is malformed
            raise MoelabError(
                f"model {source!r}: config.json cannot be read ({exc.__class__.__name__}: "
                f"{str(exc).strip().splitlines()[0][:200]}); fix or replace the config."
            ) from None
        raise MoelabError(
            f"could not load model {source!r}: not a bundled model ({', '.join(known_model_names())}), "
            f"not a local model directory, and not reachable as a hub id ({exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0][:200]})."
        ) from None
    except Exception as exc:  # noqa: BLE001 - e.g. huggingface_hub's strict-dataclass validation
        text = " ".join(str(exc).split())[:300] or exc.__class__.__name__
        raise MoelabError(f"model {source!r}: config.json is invalid ({text}); fix or replace the config.") from None
    from moelab.adapters import get_adapter, supported_families

    model_type = getattr(config, "model_type", None)
    if model_type not in supported_families():
        # Fail before reading weights: a dense or unsupported model.
        raise MoelabError(
            f"model {source!r} has model type {model_type!r}, which is not a supported Mixture-of-Experts "
            f"family. Supported: {', '.join(supported_families())}."
        )
    if device_map is None:  # an offloading device_map may hold more than memory
        _check_size(source, config)
    load_kwargs: dict[str, Any] = dict(kwargs)
    if dtype is not None:
        load_kwargs["dtype"] = dtype
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    log.info("loading %s (%s)", source, model_type)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=trust_remote_code, **load_kwargs)
    except ValueError as exc:
        raise MoelabError(f"{source!r} cannot be loaded as a causal language model: {str(exc)[:300]}") from None
    get_adapter(model)
    return model


def _check_size(source: str, config: Any) -> None:
    """Refuse a config whose shape cannot be built here (e.g. ``num_hidden_layers`` 10^6) before
    transformers starts allocating it: shape fields must be positive integers and the estimated
    parameter memory must fit in the memory available."""
    fields = {}
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
                 "num_local_experts", "num_experts", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "num_attention_heads"):
        value = getattr(config, name, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MoelabError(
                f"model {source!r}: config.json has {name}={value!r}, expected a positive integer."
            )
        fields[name] = value
    H = fields.get("hidden_size", 1)
    E = max(fields.get("num_local_experts", 1), fields.get("num_experts", 1))
    inter = fields.get("moe_intermediate_size", fields.get("intermediate_size", H))
    per_layer = 4 * H * H + E * (3 * H * inter + H) + 3 * H * fields.get("shared_expert_intermediate_size", 0)
    params = fields.get("num_hidden_layers", 1) * per_layer + 2 * fields.get("vocab_size", 1) * H
    need = params * 2  # bytes at 16-bit precision: a lower bound for any dtype moelab loads
    available = _available_memory()
    if available is not None and need > available:
        raise MoelabError(
            f"model {source!r}: config.json describes about {params:.3g} parameters "
            f"(num_hidden_layers={fields.get('num_hidden_layers')}, hidden_size={H}, experts={E}), "
            f"at least {need / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of memory "
            "available; check the config."
        )


def _available_memory() -> int | None:
    """Bytes of memory available (RAM plus the GPU's), or None where it cannot be read."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    total = int(line.split()[1]) * 1024
    except OSError:
        return None
    if total is not None and torch.cuda.is_available():
        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total


def _load_tokenizer(source: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("no tokenizer found with %s (%s); pass tokenizer= to moelab.load", source, exc)
        return None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok
