"""The trained tiny MoE models shipped inside the package (``moelab/bundled/<name>/``).

A bundled model is a directory saved with ``save_pretrained`` (config.json,
model.safetensors, tokenizer files) plus a ``MODEL_CARD.md``; it loads with
``moelab.load("<name>")`` and with plain ``AutoModelForCausalLM.from_pretrained(dir)``.
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "bundled"

#: Prefix of the names of tiny random models, e.g. ``tiny-random-mixtral``.
TINY_RANDOM_PREFIX = "tiny-random-"


def bundled_models() -> dict[str, Path]:
    """Bundled model name -> directory, for every complete bundled model (has config.json)."""
    if not BUNDLED_DIR.is_dir():
        return {}
    return {
        p.name: p
        for p in sorted(BUNDLED_DIR.iterdir())
        if p.is_dir() and (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    }


def bundled_path(name: str) -> Path | None:
    """The directory of bundled model ``name``, or None if there is none."""
    return bundled_models().get(name)


def default_model_name() -> str:
    """The model ``moelab demo`` and the notebooks use when none is given.

    The DeepSeek/Qwen2-MoE-style bundled model if it is there, else any bundled model,
    else a tiny random model (routing structure without trained behaviour).
    """
    models = bundled_models()
    for name in models:
        if "qwen2" in name or "deepseek" in name or "shared" in name:
            return name
    if models:
        return next(iter(models))
    return TINY_RANDOM_PREFIX + "qwen2_moe"
