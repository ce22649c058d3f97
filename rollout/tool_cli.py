"""The command line `rollout.collect` and `rollout.evaluate` share: the device, the base-image map and the trainer's
config sections (`--config FILE`, `--section.key=value`: `rollout.config.ToolConfig`), parsed with one-line errors."""

from __future__ import annotations

import argparse

import torch

from rollout.config import ToolConfig
from sandbox.cli import bad_input
from sandbox.images.task_images import default_base_image_overrides, parse_override
from t1config.cli import add_config_argument, parse_known
from t1model.device import check_device


def add_shared_arguments(parser: argparse.ArgumentParser, sections: str) -> None:
    """--device, --base-image and --config (`sections`: which of the trainer's sections the tool reads)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--base-image", action="append", default=[], metavar="PATTERN=IMAGE",
                        help="map FROM images onto local ones (default: debian/ubuntu/python -> the sandbox base)")
    add_config_argument(parser, f"the trainer's; its {sections} are read")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, ToolConfig]:
    """The tool's arguments and its sections; bad input (an unknown flag or key, a missing --config file, a device
    torch cannot use) is the parser's one-line error, exit 2."""
    with bad_input(parser):
        args, overrides = parse_known(parser, argv)
        config = ToolConfig.load(args.config, overrides)
    try:
        check_device(torch.device(args.device), name="--device")
    except (RuntimeError, ValueError) as e:  # RuntimeError: torch.device's own for an unknown device string
        parser.error(str(e) if isinstance(e, ValueError) else f"--device {args.device!r}: {e}")
    return args, config


def base_image_overrides(args: argparse.Namespace) -> dict[str, str]:
    """--base-image's PATTERN=IMAGE pairs, else the defaults (debian/ubuntu/python -> the sandbox base)."""
    return dict(parse_override(s) for s in args.base_image) if args.base_image else default_base_image_overrides()
