"""Reading and writing sections: TOML files, `--section.key=value` overrides, and TOML text with each key's help as
a comment. A key a section does not have (a typo, or a field an older config had) is an error naming it.

    sections = load("run.toml", ["--rollout.max_turns=50"], {"rollout": RolloutSection, "sandbox": SandboxSection})

The trainer loads every section of its `RunConfig` this way (`t1core.config_toml`); `rollout.collect` and
`rollout.evaluate` load the sections they use from the same file, leaving the trainer's other tables to it.
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

from t1config.schema import type_name

Schema = dict[str, type]
"""Section name -> its dataclass."""


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


def coerce(value: Any, tp: Any, where: str) -> Any:
    """A TOML value (or a string from the command line) converted to the field type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value.strip() if isinstance(value, str) else value  # membership is checked by __post_init__
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, where)
    if origin is tuple:
        if isinstance(value, str):
            text = value.strip().strip("[]()").strip()
            value = [] if not text else [item.strip().strip("'\"") for item in text.split(",")]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(value)} ({value!r})")
        return tuple(coerce(v, t, where) for v, t in zip(value, item_types))
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
        raise ValueError(f"{where}: expected {type_name(tp)}, got {text!r}") from None


def build(raw: dict[str, dict[str, Any]], schema: Schema) -> dict[str, Any]:
    """Each section of `schema` built from its table in `raw` (its defaults where `raw` has none)."""
    built = {}
    for name, cls in schema.items():
        hints = typing.get_type_hints(cls)
        values = {key: coerce(v, hints[key], f"{name}.{key}") for key, v in raw.get(name, {}).items()}
        built[name] = cls(**values)
    return built


def check_keys(raw: dict[str, Any], origin: str, schema: Schema) -> None:
    """ValueError naming the first section or key of `raw` that `schema` does not have."""
    for name, values in raw.items():
        if name not in schema:
            raise ValueError(f"{origin}: unknown section {name!r}; valid sections: {sorted(schema)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: expected [{name}] to be a table, got {values!r}")
        valid = [f.name for f in dataclasses.fields(schema[name])]
        for key in values:
            if key not in valid:
                raise ValueError(f"{origin}: unknown key {name}.{key}; valid keys of [{name}]: {valid}")


def parse_override(arg: str) -> tuple[str, str, str]:
    """'--section.key=value' -> (section, key, value); the value stays a string until it meets its field."""
    match = re.fullmatch(r"--([A-Za-z_]\w*)\.([A-Za-z_]\w*)=(.*)", arg, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"override: expected '--section.key=value', got {arg!r}")
    return match.group(1), match.group(2), match.group(3)


def load(toml_path: str | None, overrides: list[str], schema: Schema, *,
         others: tuple[str, ...] | None = (), base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sections of `schema`: their defaults (or `base`'s sections: a tool's own preset), updated by a TOML file
    (if given), then by `--section.key=value` overrides. The file's tables named in `others` are someone else's and
    are skipped; `others=None` skips every table `schema` lacks (a file written for a larger schema: the trainer's,
    read by a tool that uses part of it). An override must name a section and key of `schema`."""
    raw = {name: {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
           for name, section in (base or {}).items()}
    if toml_path is not None:
        given = read_toml(toml_path)
        for name in list(given):
            if others is None and name not in schema or others is not None and name in others:
                del given[name]
        check_keys(given, toml_path, schema)
        for name, table in given.items():
            raw.setdefault(name, {}).update(table)
    for arg in overrides:
        section, key, value = parse_override(arg)
        check_keys({section: {key: value}}, f"--{section}.{key}={value}", schema)
        raw.setdefault(section, {})[key] = value
    return build(raw, schema)


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


def to_toml(sections: dict[str, Any]) -> str:
    """TOML text that `load` reads back to equal sections; each key carries its help as a comment."""
    lines: list[str] = []
    for name, section in sections.items():
        lines.append(f"[{name}]")
        for f in dataclasses.fields(section):
            lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _display(value: Any) -> str:
    return "none" if value is None else _toml_value(value)


def format_sections(sections: dict[str, Any], *, with_help: bool = False) -> str:
    """One 'section.key = value' line per field, for printing at the start of a run."""
    rows = [(f"{name}.{f.name}", _display(getattr(section, f.name)), f.metadata["help"])
            for name, section in sections.items() for f in dataclasses.fields(section)]
    width = max(len(key) for key, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    if with_help:
        return "\n".join(f"{k:<{width}} = {v:<{value_width}}  # {h}" for k, v, h in rows)
    return "\n".join(f"{k:<{width}} = {v}" for k, v, _ in rows)
