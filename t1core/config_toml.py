"""Reading and writing the run config: the run's TOML file and `--section.key=value` overrides, and the run's own
config.toml with each key's help as a comment (`t1config.toml` does the work for any set of sections; this module
applies it to the whole `RunConfig`). A key the schema does not have (a typo, or a field an older config had) is
one line naming it, exit 2.

The schema itself is `t1core.config`.
"""

from __future__ import annotations

from t1config.toml import format_sections, load, to_toml
from t1core.config import RunConfig, sections

PLANNER_TABLE = "plan"
"""A TOML table the trainer skips: the hardware `t1 plan` plans for (`t1cli.plan.Hardware`)."""
PLAN_KEYS = ("nodes", "gpus_per_node", "gpu_mem_gib", "host_mem_gib")
"""The machine keys of the [plan] table (`t1cli.plan.Hardware`); only the planner reads them."""


def load_config(toml_path: str | None, overrides: list[str]) -> RunConfig:
    """The embedded defaults, updated by a TOML file (if given), then by `--section.key=value` overrides; the file's
    [plan] table is the planner's and is skipped here."""
    return RunConfig(**load(toml_path, overrides, sections(), others=(PLANNER_TABLE,)))


def _sections_of(cfg: RunConfig) -> dict:
    return {name: getattr(cfg, name) for name in sections()}


def config_to_toml(cfg: RunConfig) -> str:
    """TOML text that `load_config` reads back to an equal config; each key carries its help as a comment."""
    return to_toml(_sections_of(cfg))


def format_config(cfg: RunConfig, *, with_help: bool = False) -> str:
    """One 'section.key = value' line per field, for printing at the start of a run."""
    return format_sections(_sections_of(cfg), with_help=with_help)
