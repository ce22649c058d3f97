"""Checkpoints of a run and resuming from them; the KL anchor (a frozen copy of the warm-started policy) a fresh
run takes and a resumed one reads back. Every rank calls these together when the models are sharded."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from t1core import distributed
from t1core.checkpoint.rng import capture_rng_state
from t1core.checkpoint.save import latest_checkpoint, load_checkpoint, save_checkpoint
from t1core.config import RunConfig
from t1core.distributed import DataParallel
from t1core.step import TrainerState
from t1core.update import ActorCritic
from t1model.hf_io import load_pretrained

WARMSTART_DIR = "warmstart"
"""Run subdirectory with the warm-started policy and its tokenizer (HF format): the anchor of the KL penalty
when kl_coef > 0, and a starting point for further RL runs (`--model.name=RUN/warmstart
--warmstart.sft_epochs=0` skips the SFT phase)."""


def optimizers(ac: ActorCritic) -> dict:
    """Optimizers (with their models: sharded ones save and load as shards) and schedulers by name."""
    return {"actor": distributed.ModelOptimizer(ac.policy, ac.opt_actor),
            "critic": distributed.ModelOptimizer(ac.critic, ac.opt_critic),
            "sched_actor": ac.sched_actor, "sched_critic": ac.sched_critic}


def checkpoint(run_dir: Path, ac: ActorCritic, state: TrainerState, *, cfg: RunConfig, dp: DataParallel) -> Path | None:
    """Atomic checkpoint (collective when sharded: every rank writes its own shards, the main rank the rest)."""
    return save_checkpoint(run_dir / "checkpoints", step=state.step, policy=ac.policy, critic=ac.critic,
                           optimizers=optimizers(ac), rng_states=capture_rng_state(), data_state=state.to_dict(),
                           config=cfg, keep_last=2, dp=dp)


def resume(run_dir: Path, ac: ActorCritic, *, kl: bool,
           dp: DataParallel) -> tuple[TrainerState, torch.nn.Module | None] | None:
    """(state, KL anchor or None) of the run's latest checkpoint, loaded into `ac`'s models and optimizers; None
    when there is none. The caller syncs its engine afterwards."""
    ckpt_root = run_dir / "checkpoints"
    if latest_checkpoint(ckpt_root) is None:
        return None
    ckpt = load_checkpoint(ckpt_root, policy=ac.policy, critic=ac.critic, optimizers=optimizers(ac))
    ref = None
    if kl:
        ref_dir = run_dir / WARMSTART_DIR
        if not (ref_dir / "config.json").is_file():
            raise ValueError(f"resume with algo.kl_coef > 0: the KL reference policy {ref_dir} is missing")
        ref = anchor_from_hf(ref_dir, ac.policy)
    state = TrainerState.from_dict(ckpt["data_state"])
    if dp.is_main:
        print(f"resumed from {ckpt['path']} at step {state.step}")
    return state, ref


def frozen_copy(model: torch.nn.Module, dp: DataParallel) -> torch.nn.Module:
    """A frozen copy of the policy (the KL anchor). Sharded policy: a sharded copy in the compute dtype, each rank
    copying its own shards (no rank ever holds the whole model)."""
    if not distributed.is_sharded(model):
        return copy.deepcopy(model).eval().requires_grad_(False)
    return distributed.frozen_shards(model).eval().requires_grad_(False)


def anchor_from_hf(path: Path, policy: torch.nn.Module) -> torch.nn.Module:
    """The KL anchor of a resumed run, read from its warm-start HF directory: sharded like the policy (each rank
    reads only its own rows) when the policy is sharded."""
    if not distributed.is_sharded(policy):
        param = next(policy.parameters())
        ref = load_pretrained(path, dtype=param.dtype, device=param.device)
        return ref.eval().requires_grad_(False)
    return distributed.frozen_shards(policy, hf_dir=path).eval().requires_grad_(False)
