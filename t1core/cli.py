"""The command line of `python -m t1core.train`: arguments to (config, run directory), and the run's first lines.

Kept out of `t1core.train` so that the trainer reads like the loop; `t1core.train.main` calls it (`parse_args`,
`session`).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from sandbox.cli import Parser
from sandbox.runtime.signals import exit_on_signals_while
from t1config.cli import add_config_argument, parse_known
from t1core import distributed
from t1core.config import RunConfig, resolved
from t1core.config_toml import config_to_toml, format_config, load_config
from t1core.distributed import DataParallel

DESCRIPTION = """Warm-started actor-critic PPO on exact sampled tokens (TITO) with routing replay (R3):

    warm start:  SFT on reference-solution transcripts   (built with the same TITO construction)
    evaluate:    held-out tasks before RL
    each step:   collect -> score -> update (critic only for the first N steps) -> sync weights to the engine
    evaluate:    held-out tasks after RL; save the final checkpoint (HF format), metrics, plot

Every random choice derives from (run.seed, step), so a resumed run continues bit for bit. Under torchrun
(`torchrun --nproc_per_node=N -m t1core.train ...`) every rank runs its share of the episodes with its own engine
(a disaggregated vLLM: rank 0 runs them all, t1core.rollout_ranks), the updates are data-parallel over
FSDP2-sharded models, and rank 0 writes the files (t1core.distributed)."""


def parser() -> Parser:
    p = Parser(prog="python -m t1core.train", description=DESCRIPTION,
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Any config field can be set as --section.key=value (the run prints them all). Examples:\n"
                      "  python -m t1core.train                                   # the embedded CPU default\n"
                      "  python -m t1core.train --rollout.episodes_per_step=16 --run.steps=10\n"
                      "  python -m t1core.train --config t1core/configs/qwen3_30b_a3b_harbor.toml --out runs/exp1\n"
                      "  python -m t1core.train --resume runs/exp1 --run.steps=20   # continue (or extend) a run")
    add_config_argument(p, "default: the embedded CPU run")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<time>-seed<seed>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint, "
                                                        "under its saved config.toml")
    return p


def parse_args(argv: list[str] | None) -> tuple[RunConfig, Path]:
    """(config, run directory) from the command line; ValueError names what is wrong with it. The config comes back
    resolved (`t1core.config.resolved`): what the run will do."""
    args, overrides = parse_known(parser(), argv)
    if args.resume is None:
        cfg = resolved(load_config(args.config, overrides))
        run_dir = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-seed{cfg.run.seed}")
        if (run_dir / "checkpoints").exists():
            raise ValueError(f"--out {run_dir} already holds a run; use --resume {run_dir} to continue it")
        return cfg, run_dir
    run_dir = Path(args.resume)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"--resume {run_dir}: no config.toml there (not a run directory)")
    if args.out is not None and Path(args.out) != run_dir:
        raise ValueError(f"--out {args.out}: a resumed run stays in its own directory {run_dir}")
    if args.config is not None:
        raise ValueError(f"--config {args.config} with --resume: the run keeps its saved config.toml; pass "
                         "changes as --section.key=value")
    # The run continues under its saved config; command-line overrides change it (e.g. extend run.steps).
    return resolved(load_config(str(run_dir / "config.toml"), overrides)), run_dir


def precision_notice(cfg: RunConfig) -> str | None:
    """The warning a CUDA run with fp32 weights prints before anything else (None otherwise): the kernels then run
    their IEEE fp32 path, without tensor cores."""
    if cfg.run.device.startswith("cuda") and cfg.model.dtype == "float32":
        return ("WARNING: model.dtype=float32 on CUDA: the MoE and log-prob Triton kernels take their IEEE fp32 path "
                "(no tensor cores, several times slower than bf16); pass --model.dtype=bfloat16 to train at scale")
    return None


def start(cfg: RunConfig, run_dir: Path, dp: DataParallel) -> None:
    """Seed the global generators, and on the main rank create the run directory, print the config and save it."""
    if dp.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    # Our own draws use explicit generators; the global ones are seeded too (and saved in checkpoints) so that
    # library code that draws from them repeats as well.
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed % 2**32)
    # This also NaN-fills every torch.empty (fill_uninitialized_memory, left on); the kernels' scratch, which
    # they write in full, skips that pass (t1kernels.scratch).
    torch.use_deterministic_algorithms(True, warn_only=True)
    if dp.is_main:
        notice = precision_notice(cfg)
        if notice:
            print(notice, flush=True)
        print(format_config(cfg), flush=True)
        if dp.distributed:
            print(f"data-parallel: {dp.world_size} ranks, FSDP2-sharded policy and critic", flush=True)
        (run_dir / "config.toml").write_text(config_to_toml(cfg))


@contextlib.contextmanager
def session(cfg: RunConfig, run_dir: Path) -> Iterator[tuple[DataParallel, Path]]:
    """The processes around a run: (this rank, the run directory) inside, after the run's first lines (`start`);
    SIGTERM / SIGINT stop builds, remove the run's sandboxes on every host and exit; on the way out the ranks close,
    and the main rank prints the run directory when the run ended normally."""
    dp = distributed.init_from_env(cfg.run.device)
    try:
        run_dir = dp.broadcast(run_dir)  # the default name holds the time: the main rank's is the run's
        start(cfg, run_dir, dp)
        with exit_on_signals_while():
            yield dp, run_dir
    finally:
        distributed.close(dp)
    if dp.is_main:
        print(run_dir.resolve())
