"""Reading and writing the run config: TOML files, `--section.key=value` overrides, and the run's own config.toml
with each key's help as a comment. A key the schema does not have (a typo, or a field an older config had) is one
line naming it, exit 2.

The schema itself is `t1core.config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser (needs `pip install tomli`).
    import tomli as tomllib

from t1core.config import RunConfig, _type_name, sections

PLANNER_TABLE = "plan"
"""A TOML table the trainer skips: the hardware `t1 plan` plans for (`t1cli.plan.Hardware`)."""
PLAN_KEYS = ("nodes", "gpus_per_node", "gpu_mem_gib", "host_mem_gib")
"""The machine keys of the [plan] table (`t1cli.plan.Hardware`); only the planner reads them."""


def parse_bool(text: str) -> bool:
    """A config bool from the command line."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected a bool (true/false), got {text!r}")


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file's tables as they are (no checks)."""
    with open(path, "rb") as f:
        return tomllib.load(f)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """A TOML value (or a string from the command line) converted to the field type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value.strip() if isinstance(value, str) else value  # membership is checked by __post_init__
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is tuple:
        if isinstance(value, str):
            text = value.strip().strip("[]()").strip()
            value = [] if not text else [item.strip().strip("'\"") for item in text.split(",")]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(value)} ({value!r})")
        return tuple(_coerce(v, t, where) for v, t in zip(value, item_types))
    if isinstance(value, str) and tp is not str:
        return _parse_scalar(value, tp, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value  # type errors are reported by the section's __post_init__


def _parse_scalar(text: str, tp: Any, where: str) -> Any:
    text = text.strip()
    if tp is bool:
        try:
            return parse_bool(text)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    try:
        return tp(text)
    except ValueError:
        raise ValueError(f"{where}: expected {_type_name(tp)}, got {text!r}") from None


def _build(raw: dict[str, dict[str, Any]]) -> RunConfig:
    built = {}
    for name, cls in sections().items():
        hints = typing.get_type_hints(cls)
        values = {key: _coerce(v, hints[key], f"{name}.{key}") for key, v in raw.get(name, {}).items()}
        built[name] = cls(**values)
    return RunConfig(**built)


def _check_keys(raw: dict[str, Any], origin: str) -> None:
    known = sections()
    for name, values in raw.items():
        if name not in known:
            raise ValueError(f"{origin}: unknown section {name!r}; valid sections: {sorted(known)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: expected [{name}] to be a table, got {values!r}")
        valid = [f.name for f in dataclasses.fields(known[name])]
        for key in values:
            if key not in valid:
                raise ValueError(f"{origin}: unknown key {name}.{key}; valid keys of [{name}]: {valid}")


def parse_override(arg: str) -> tuple[str, str, str]:
    """'--section.key=value' -> (section, key, value); the value stays a string until it meets its field."""
    match = re.fullmatch(r"--([A-Za-z_]\w*)\.([A-Za-z_]\w*)=(.*)", arg, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"override: expected '--section.key=value', got {arg!r}")
    return match.group(1), match.group(2), match.group(3)


def load_config(toml_path: str | None, overrides: list[str]) -> RunConfig:
    """The embedded defaults, updated by a TOML file (if given), then by `--section.key=value` overrides; the file's
    [plan] table is the planner's and is skipped here."""
    raw: dict[str, dict[str, Any]] = {}
    if toml_path is not None:
        raw = read_toml(toml_path)
        raw.pop(PLANNER_TABLE, None)
        _check_keys(raw, toml_path)
    given: dict[str, dict[str, Any]] = {}
    for arg in overrides:
        section, key, value = parse_override(arg)
        if section in sections() and not isinstance(raw.get(section, {}), dict):
            raise ValueError(f"{arg}: expected [{section}] to be a table")
        given.setdefault(section, {})[key] = value
    for section, table in given.items():
        for key, value in table.items():
            _check_keys({section: {key: value}}, f"--{section}.{key}={value}")
    for section, table in given.items():
        raw.setdefault(section, {}).update(table)
    return _build(raw)


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form; always has '.', 'e' or is inf/nan
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"config value of unsupported type {type(value).__name__}: {value!r}")


def config_to_toml(cfg: RunConfig) -> str:
    """TOML text that `load_config` reads back to an equal config; each key carries its help as a comment."""
    lines: list[str] = []
    for name in sections():
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in dataclasses.fields(section):
            lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _display(value: Any) -> str:
    return "none" if value is None else _toml_value(value)


def format_config(cfg: RunConfig, *, with_help: bool = False) -> str:
    """One 'section.key = value' line per field, for printing at the start of a run."""
    rows = [(f"{name}.{f.name}", _display(getattr(getattr(cfg, name), f.name)), f.metadata["help"])
            for name in sections() for f in dataclasses.fields(getattr(cfg, name))]
    width = max(len(key) for key, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    if with_help:
        return "\n".join(f"{k:<{width}} = {v:<{value_width}}  # {h}" for k, v, h in rows)
    return "\n".join(f"{k:<{width}} = {v}" for k, v, _ in rows)
