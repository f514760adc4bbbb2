"""YAML with line numbers: every value of a spec file knows the line it came from.

PyYAML's node tree carries positions; :func:`load_with_lines` turns it into plain Python
values plus a map from each value's path (``("policies", 2, "grid")``) to its 1-based line,
so a spec error can say ``deferral_vs_skipping.yaml:12: unknown key 'limt'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moelab.errors import MoelabError

Path_ = tuple[Any, ...]


def load_with_lines(text: str, source: str) -> tuple[Any, dict[Path_, int]]:
    """``(value, lines)`` of a YAML document; ``lines[path]`` is the line of that value."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise MoelabError(f"{where}: not valid YAML ({problem}); fix the syntax there.") from None
    lines: dict[Path_, int] = {}
    if node is None:
        return None, lines
    return _convert(node, (), lines, source, ()), lines


def _convert(node: Any, path: Path_, lines: dict[Path_, int], source: str, above: tuple = ()) -> Any:
    import yaml

    if any(node is n for n in above):  # an alias to a node that contains it: an endless value
        raise MoelabError(f"{source}:{node.start_mark.line + 1}: this value refers to itself through a YAML alias "
                          "(an anchor used inside its own value); write the value out.")
    above = (*above, node)
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _scalar(key_node)
            if not isinstance(key, str):
                raise MoelabError(
                    f"{source}:{key_node.start_mark.line + 1}: key {key!r} is not a name; "
                    "spec keys are words such as 'models' or 'limit'."
                )
            if key in out:
                raise MoelabError(
                    f"{source}:{key_node.start_mark.line + 1}: key {key!r} appears twice in one "
                    "mapping; keep one."
                )
            out[key] = _convert(value_node, (*path, key), lines, source, above)
            lines.setdefault((*path, key), key_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, (*path, i), lines, source, above) for i, v in enumerate(node.value)]
    return _scalar(node)


def _scalar(node: Any) -> Any:
    import yaml

    return yaml.SafeLoader(stream="").construct_object(node, deep=True)


def read_text(path: str | Path) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise MoelabError(f"sweep spec {str(p)!r} does not exist; give the path of a YAML spec "
                          "(see evals/sweeps/ for examples).")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MoelabError(f"sweep spec {str(p)!r} is not UTF-8 text (byte {e.start}); give a YAML file.") from None
