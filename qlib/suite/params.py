"""Notebook parameters from the command line and from a YAML file, and sweep grids.

- ``parse_value("3")``: a ``-p`` value as int, float, bool, None, a JSON (or YAML flow)
  list or dict, or a string.
- ``parse_grid("steps=4,6")``: a ``--grid`` axis, ``("steps", [4, 6])``; the values are
  split at commas outside brackets and quotes and parsed like ``-p`` values.
- ``load_params_file(path)``: papermill's ``-f params.yaml``, a mapping name -> value,
  whose top-level ``grid:`` mapping (name -> list of values) holds sweep axes.
- ``combine(...)``: the fixed parameters and the grid from the file and the command line
  (the command line wins over the file, name by name).
- ``default_value(source)``: a parameter's default from its source text;
  ``check_type(value, default, where)``: a value that cannot be what the notebook's default
  is (``-p steps x``) refused before any kernel starts.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

GRID_KEY = "grid"  # the top-level key of a parameters file that holds the sweep axes


def parse_value(text: str) -> Any:
    """A command-line value as a scalar: int, float, bool, None, JSON list/dict, or string.

    Quote a value to keep it a string: ``-p tag "'42'"``.
    """
    s = text.strip()
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", "~"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    if s[:1] in "[{":
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            import yaml  # flow style: [a, b], {k: v}

            try:
                return yaml.safe_load(s)
            except yaml.YAMLError:
                pass
    return text


def split_values(text: str) -> list[str]:
    """``"4,6"`` -> ``["4", "6"]``; commas inside ``[]``, ``{}`` or quotes do not split."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_grid(spec: str) -> tuple[str, list[Any]]:
    """``"NAME=V1,V2,..."`` -> ``(NAME, [parse_value(V1), ...])``.

    ``form=quantized,f32``; ``variants=[Q4_1],[Q8_0]`` (each value a list);
    ``prompt="a, b",c`` (quotes keep a comma).
    """
    name, eq, values = spec.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
        raise ValueError(f"--grid {spec!r}: expected NAME=V1,V2,... (NAME a parameter name)")
    texts = split_values(values)
    if any(not t.strip() for t in texts):
        raise ValueError(f"--grid {spec!r}: an empty value (quote it: {name}='',...)")
    return name, [parse_value(t) for t in texts]


def check_grid(grid: dict[str, Any], where: str) -> dict[str, list[Any]]:
    """Each axis a non-empty list of distinct values (a scalar is an axis of one value)."""
    out: dict[str, list[Any]] = {}
    for name, values in grid.items():
        if not str(name).isidentifier():
            raise ValueError(f"{where}: {name!r} is not a parameter name")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ValueError(f"{where}: grid axis {name!r} has no values")
        seen: list[str] = []
        for v in values:
            key = json.dumps(v, sort_keys=True, default=str)
            if key in seen:
                raise ValueError(f"{where}: grid axis {name!r} repeats the value {v!r}")
            seen.append(key)
        out[str(name)] = values
    return out


def load_params_file(path: str | Path) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """``(fixed, grid)`` from a YAML (or JSON) file: a mapping name -> value.

    Every top-level key is a parameter, given to the notebooks as it is (a list stays
    a list), except ``grid``: a mapping name -> list of values, the sweep's axes. A
    name may not be both.
    """
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"-f {path}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"-f {path}: expected a mapping name -> value, got {type(data).__name__}")
    fixed = {str(k): v for k, v in data.items() if k != GRID_KEY}
    grid_data = data.get(GRID_KEY) or {}
    if not isinstance(grid_data, dict):
        raise ValueError(f"-f {path}: `{GRID_KEY}:` must map names to lists of values")
    grid = check_grid(grid_data, f"-f {path}")
    both = sorted(set(fixed) & set(grid))
    if both:
        raise ValueError(f"-f {path}: {', '.join(both)} both fixed and under `{GRID_KEY}:`")
    for k in fixed:
        if not k.isidentifier():
            raise ValueError(f"-f {path}: {k!r} is not a parameter name")
    return fixed, grid


def combine(
    file_fixed: dict[str, Any],
    file_grid: dict[str, list[Any]],
    cli_fixed: dict[str, Any],
    cli_grid: dict[str, list[Any]],
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The run's fixed parameters and grid: the command line wins over the file, by name.

    ``-p NAME`` replaces the file's NAME, fixed or axis; ``--grid NAME`` replaces it
    too. On the command line a name is either ``-p`` or ``--grid``, not both.
    """
    both = sorted(set(cli_fixed) & set(cli_grid))
    if both:
        raise ValueError(f"{', '.join(both)}: given with both -p and --grid")
    fixed = {k: v for k, v in file_fixed.items() if k not in cli_grid}
    fixed.update(cli_fixed)
    grid = {k: v for k, v in file_grid.items() if k not in cli_fixed and k not in cli_grid}
    grid.update(cli_grid)
    return fixed, grid


# a default's type -> the value types it takes (an int is a float here; a bool is not an int)
_TAKES = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list, tuple),
          tuple: (list, tuple), dict: (dict,)}  # fmt: skip


def default_value(source: str | None, fallback: Any = None) -> Any:
    """A notebook parameter's default from its source (papermill's ``default``), or
    ``fallback`` where there is none or it is not a literal (``os.cpu_count()``)."""
    try:
        return ast.literal_eval(source) if source else fallback
    except (ValueError, SyntaxError):
        return fallback


def check_type(value: Any, default: str | None, where: str) -> None:
    """``value`` can be what a notebook parameter whose default's source is ``default`` is,
    else ``ValueError`` naming both: run with ``-p steps x`` the notebook would fail in its
    first cell (and its failed run replace the last good one in the results). ``None``, and
    any value for a default that is ``None`` or not a literal, pass."""
    expected = default_value(default)
    takes = _TAKES.get(type(expected))
    if value is None or takes is None:
        return
    if isinstance(value, takes) and not (isinstance(value, bool) and bool not in takes):
        return
    quote = f" (a string: quote it, '\"{value}\"')" if isinstance(expected, str) else ""
    raise ValueError(f"{where}: {value!r} is not of its default's type "
                     f"({type(expected).__name__}: {default}){quote}")  # fmt: skip
