"""Sections: frozen keyword-only dataclasses whose fields carry their help text, checked at construction.

    @dataclass(frozen=True, kw_only=True)
    class SandboxSection:
        pids: int = knob(256, "process limit per sandbox container")

        def __post_init__(self) -> None:
            check_types(self)
            check(self.pids >= 16, "sandbox.pids", ">= 16", self.pids)

Errors name `section.key`; `check_types` takes the section's name from its class (SandboxSection -> sandbox).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal


def knob(default: Any, help: str) -> Any:
    """A section field: its default and its help (printed beside its value at the start of a run, written above it
    in the run's config.toml: `t1config.toml.format_sections`, `to_toml`)."""
    return field(default=default, metadata={"help": help})


def check(ok: bool, name: str, expected: str, got: Any) -> None:
    """ValueError 'name: expected ..., got ...' unless `ok`."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {got!r}")


def check_types(section: Any) -> None:
    """Every field's value matches its annotation (catches e.g. a string where a float belongs)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if not _matches(value, hints[f.name]):
            where = type(section).__name__.removesuffix("Section").lower()  # SandboxSection -> sandbox
            raise ValueError(f"{where}.{f.name}: expected {type_name(hints[f.name])}, "
                             f"got {value!r} ({type(value).__name__})")


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
    if tp is float:  # an int is a fine float; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "") if typing.get_args(tp) else tp.__name__
