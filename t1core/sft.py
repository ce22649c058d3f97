"""Warm start: base pretraining of a from-scratch model (t1core.pretrain), then supervised fine-tuning of the actor
on reference-solution transcripts of the training tasks."""

from __future__ import annotations

import dataclasses
import sys

import torch
from tqdm import tqdm

from rollout.trajectory import save_trajectories
from t1core.context import RunContext
from t1core.optimizer import make_optimizer
from t1core.pretrain import pretrain_base, pretrains
from t1core.rollout_ranks import agent_config
from t1core.step import Stream, seed_for
from t1core.update import sft_num_steps, sft_update
from t1core.warmstart import reference_transcripts


def warm_start(run: RunContext, policy: torch.nn.Module) -> dict[str, float]:
    """Base pretraining (`pretrains`: from-scratch presets only), then SFT (warmstart.sft_epochs > 0): the metrics of
    both, {} when neither ran (the policy is as loaded)."""
    out = {}
    if pretrains(run.cfg):
        with run.clock.phase("pretrain"):
            out = pretrain_base(run, policy)
    if run.cfg.warmstart.sft_epochs:
        out.update(run_sft(run, policy))
    return out


def run_sft(run: RunContext, policy: torch.nn.Module) -> dict[str, float]:
    """warmstart.sft_epochs passes (at most warmstart.sft_max_steps optimizer steps) over the transcripts, each
    rank building its share of them; the rate decays to 0 over the planned steps with optim.lr_decay."""
    cfg, tok, tasks, run_dir, dp, clock = run.cfg, run.tok, run.tasks, run.dir, run.dp, run.clock
    w = cfg.warmstart
    with clock.phase("sft_transcripts"):  # each rank runs its share of the reference solutions
        transcripts, metrics = reference_transcripts(
            tasks.train, tasks.images, tok=tok,
            config=dataclasses.replace(agent_config(cfg), verify=w.verify_references),
            num_parallel=cfg.rollout.concurrency, pool_size=cfg.sandbox.pool_size, dp=dp)
        if dp.is_main:
            save_trajectories(transcripts, run_dir / "trajectories" / "sft")
    # A compacted transcript (a long task) trains every context it was folded into, each on its own tokens.
    transcripts = [s for t in transcripts for s in t.segments()]
    gen = torch.Generator().manual_seed(seed_for(cfg.run.seed, Stream.SFT))
    planned = sft_num_steps([t.num_tokens for t in transcripts], epochs=w.sft_epochs,
                            minibatch_tokens=w.sft_minibatch_tokens, generator=gen, dp=dp)
    if w.sft_max_steps is not None:
        planned = min(planned, w.sft_max_steps)
    opt, sched = make_optimizer(policy, lr=w.sft_lr, cfg=cfg,
                                decay_steps=planned if cfg.optim.lr_decay else None)
    steps, epochs, m = 0, 0, {}
    for _ in tqdm(range(w.sft_epochs), desc="sft", leave=False, file=sys.stdout, disable=None):
        if steps >= planned:
            break
        with clock.phase("sft_update"):
            m = sft_update(transcripts, policy=policy, opt=opt, sched=sched, grad_clip=cfg.optim.grad_clip,
                           minibatch_tokens=w.sft_minibatch_tokens, generator=gen, max_steps=planned - steps, dp=dp)
        steps += int(m["sft/steps"])
        epochs += 1
    return {**metrics, **m, "sft/epochs": float(epochs), "sft/steps": float(steps)}
