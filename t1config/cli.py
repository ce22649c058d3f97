"""The config part of every command line: `--config FILE` and `--section.key=value` flags, the same for the trainer
(`python -m t1core.train`, all of `RunConfig`) and the tools that use part of it (`rollout.collect`,
`rollout.evaluate`: [rollout], [sandbox], [context], [vllm]), so a knob is set the same way everywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

def add_config_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--config FILE`: a TOML file of config sections (`what` says which are read)."""
    parser.add_argument("--config", metavar="FILE", help=f"TOML file with config sections ({what})")


def parse_known(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the parser's arguments, the `--section.key=value` overrides); ValueError naming anything else left over,
    or a --config file that is not there."""
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if bad:
        raise ValueError(f"unrecognised arguments {bad}; config overrides look like --section.key=value")
    if getattr(args, "config", None) is not None and not Path(args.config).is_file():
        raise ValueError(f"--config {args.config}: no such file")
    return args, overrides
