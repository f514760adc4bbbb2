"""``moelab models``: supported families and loadable model names."""

from __future__ import annotations

from moelab.cli._util import emit_json


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list supported MoE families and bundled models")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.adapters import supported_families
    from moelab.models.bundled import TINY_RANDOM_PREFIX, bundled_models, default_model_name

    bundled = {name: str(path) for name, path in bundled_models().items()}
    families = supported_families()
    result = {
        "families": families,
        "bundled": bundled,
        "tiny_random": [TINY_RANDOM_PREFIX + f for f in families if f],
        "default": default_model_name(),
    }
    if args.json:
        emit_json(result)
        return 0
    print("Supported families: " + ", ".join(families))
    print("Bundled models:" + ("" if bundled else " (none installed)"))
    for name, path in bundled.items():
        print(f"  {name:28s} {path}")
    print(f"Tiny random models: {TINY_RANDOM_PREFIX}<family>  (e.g. {TINY_RANDOM_PREFIX}mixtral)")
    print(f"Default model: {result['default']}")
    return 0
