"""`python -m t1core.train [--config FILE] [--out DIR] [--resume RUN_DIR] [--section.key=value ...]`

Warm-started actor-critic PPO on exact sampled tokens (TITO) with routing replay (R3):

    warm start:  SFT on reference-solution transcripts   (built with the same TITO construction)
    evaluate:    held-out tasks before RL
    each step:   collect -> score -> update (critic only for the first N steps) -> sync weights to the engine
    evaluate:    held-out tasks after RL; save the final checkpoint (HF format), metrics, plot

Every random choice derives from (run.seed, step), so a resumed run continues bit for bit. Under torchrun
(`torchrun --nproc_per_node=N -m t1core.train ...`) every rank runs its share of the episodes with its own engine
(a disaggregated vLLM: rank 0 runs them all, t1core.rollout_ranks), the updates are data-parallel over
FSDP2-sharded models, and rank 0 writes the files (t1core.distributed).
"""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import argparse
import copy
import dataclasses
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from rollout.agent import EpisodeSpec, run_episodes
from rollout.sampling import derive_seed
from rollout.trajectory import save_trajectories
from sandbox.families import FAMILIES
from sandbox.cli import Parser, bad_input
from sandbox.reap import reap
from t1core import builders, distributed
from t1model.hf_io import load_pretrained
from t1core.checkpointing import capture_rng_state, latest_checkpoint, load_checkpoint, save_checkpoint
from t1core.config import RunConfig, config_to_toml, format_config, load_config
from t1core.distributed import DataParallel
from t1core.drift import CompletionLog
from t1core.heldout import change_metrics, summary_lines
from t1core.metrics import (MetricsLogger, Stopwatch, fidelity_line, gpu_stats, plot_metrics, progress_line,
                            read_metrics)
from t1core.pretrain import pretrain
from t1core.retokenize import retokenize
from t1core.segments import cut_metrics, training_segments
from t1core.step import Stream, StepBatch, TrainerState, push_plan, seed_for, shaped_reward, solved
from t1core.update import ActorCritic, ppo_update, score, sft_num_steps, sft_update
from t1core.warmstart import reference_transcripts

WARMSTART_DIR = "warmstart"
"""Run subdirectory with the warm-started policy and its tokenizer (HF format): the anchor of the KL penalty
when kl_coef > 0, and a starting point for further RL runs (`--model.name=RUN/warmstart
--warmstart.sft_enabled=false` skips the SFT phase)."""


class Trainer:
    """Holds the run's parts; each method is one phase of the loop in `run`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, dp: DataParallel | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.dp = dp = dp or DataParallel.single()
        self.pretrains = builders.pretrains(cfg)  # checked first: a config error must not wait for image builds
        builders.shard_options(cfg)
        self.tok = builders.load_tokenizer(cfg)
        tasks = None
        if dp.is_main:  # one rank writes the task directories and builds the images; all ranks run sandboxes
            reap()  # containers left behind by crashed runs
            tasks = builders.load_tasks(cfg, run_dir)
            builders.build_images(tasks, cfg)
        self.tasks = dp.broadcast(tasks)
        self.policy, self.critic = builders.load_models(cfg, self.tok, dp)
        self.actor_frozen = builders.frozen_parameters(self.policy, cfg.optim.actor_frozen)  # checked before SFT
        # Each rank's engine copy is taken before sharding (or read from the checkpoint); refreshed after updates.
        # A rank without an engine (disaggregated vLLM: rank 0's serves all) gets its trajectories from rank 0.
        self.ranks = builders.rollout_ranks(cfg, dp)
        self.engine = builders.make_engine(self.policy, cfg, dp)
        # what this rank's engine returned, to check drift against
        self.sampled = CompletionLog(self.engine) if self.engine is not None else None
        if cfg.parallel.activation_checkpointing:  # after the engine's copy: it must not share the wrapped forwards
            distributed.checkpoint_layers_(self.policy)
            distributed.checkpoint_layers_(self.critic)
        distributed.shard_(self.policy, dp, **builders.shard_options(cfg))
        distributed.shard_(self.critic, dp, **builders.shard_options(cfg))
        self.state = TrainerState()
        rl_progress = (lambda: self.state.step / max(cfg.run.steps, 1)) if cfg.optim.actor_lr_decay else None
        self.opt_actor, self.sched_actor = builders.make_optimizer(self.policy, lr=cfg.optim.lr_actor, cfg=cfg,
                                                                progress=rl_progress)
        self.opt_critic, self.sched_critic = builders.make_optimizer(self.critic, lr=cfg.optim.lr_critic, cfg=cfg)
        self.ref_policy = None
        self.clock = Stopwatch()

    # ---- phases ----
    def collect(self, tasks: list, *, seed: int, desc: str, temperature: float | None = None) -> tuple[list, list[int]]:
        """One episode per task, episode i sampled with seed derive_seed(seed, i); see `_run`."""
        return self._run(self._specs(tasks, seed), desc=desc, temperature=temperature)

    def _specs(self, tasks: list, seed: int) -> list[EpisodeSpec]:
        return [EpisodeSpec(task=t, image=self.tasks.images[t.name], seed=derive_seed(seed, i))
                for i, t in enumerate(tasks)]

    def _run(self, specs: list[EpisodeSpec], *, desc: str, temperature: float | None) -> tuple[list, list[int]]:
        """(trajectories, loss-region drift of each) in the order of `specs`, on every rank. Rank r runs episodes
        r, r + W, ... on its own engine (or rank 0 all of them on the one engine: t1core.rollout_ranks) and checks
        their drift against that engine's completions."""
        dp, ranks = self.dp, self.ranks
        mine = ranks.mine(specs)
        bar = tqdm(total=len(mine), desc=desc, leave=False, file=sys.stdout, disable=None if dp.is_main else True)
        trajs = []
        if self.sampled is not None:
            self.sampled.clear()
        if mine:
            config = builders.agent_config(self.cfg, temperature=temperature)
            trajs = run_episodes(self.sampled, self.tok, mine, config=config,
                                 num_parallel=ranks.parallel(self.cfg.rollout.concurrency),
                                 pool_size=ranks.parallel(self.cfg.sandbox.pool_size),
                                 on_done=lambda i, t: bar.update())
        bar.close()
        # Drift of every segment (a compacted episode's contexts), each against the completions of its own prompts.
        done = ranks.gather([(t, sum(self.sampled.drift(s) for s in t.segments())) for t in trajs], len(specs))
        return [t for t, _ in done], [d for _, d in done]

    def warm_start(self) -> dict[str, float]:
        """Base pretraining (from-scratch presets only), then (a) SFT of the actor on reference transcripts;
        the critic-only steps (b) are part of the RL loop."""
        out = self.pretrain_base() if self.pretrains else {}
        if self.cfg.warmstart.sft_enabled:
            out.update(self.sft())
        if out:  # the policy changed
            self.sync_engine()
            # The critic starts from the warm-started trunk (its head is still zero), not from the random weights
            # the policy had before; it has taken no optimizer step yet, so there is no state to reset.
            self.critic.copy_trunk_from(self.policy)
        return out

    def sft(self) -> dict[str, float]:
        """(a) SFT of the actor on reference-solution transcripts of the training tasks."""
        w, dp = self.cfg.warmstart, self.dp
        with self.clock.phase("sft_transcripts"):  # each rank runs its share of the reference solutions
            transcripts, metrics = reference_transcripts(
                self.tasks.train, self.tasks.images, tok=self.tok,
                config=dataclasses.replace(builders.agent_config(self.cfg), verify=w.verify_references),
                num_parallel=self.cfg.rollout.concurrency, pool_size=self.cfg.sandbox.pool_size, dp=dp)
            if dp.is_main:
                save_trajectories(transcripts, self.run_dir / "trajectories" / "sft")
        gen = torch.Generator().manual_seed(seed_for(self.cfg.run.seed, Stream.SFT))
        planned = sft_num_steps([t.num_tokens for t in transcripts], epochs=w.sft_epochs,
                                minibatch_tokens=w.sft_minibatch_tokens, generator=gen, dp=dp)
        if w.sft_max_steps is not None:
            planned = min(planned, w.sft_max_steps)
        opt, sched = builders.make_optimizer(self.policy, lr=w.sft_lr, cfg=self.cfg,
                                          decay_steps=planned if w.sft_lr_decay else None)
        steps, epochs, m = 0, 0, {}
        for _ in tqdm(range(w.sft_epochs), desc="sft", leave=False, file=sys.stdout, disable=None):
            if steps >= planned:
                break
            with self.clock.phase("sft_update"):
                m = sft_update(transcripts, policy=self.policy, opt=opt, sched=sched,
                               grad_clip=self.cfg.optim.grad_clip, minibatch_tokens=w.sft_minibatch_tokens,
                               generator=gen, max_steps=planned - steps, dp=dp)
            steps += int(m["sft/steps"])
            epochs += 1
        return {**metrics, **m, "sft/epochs": float(epochs), "sft/steps": float(steps)}

    def pretrain_base(self) -> dict[str, float]:
        """Next-token training on synthetic instruction -> tool-call text (t1core.pretrain): the base model a
        from-scratch preset lacks. RL and held-out instructions are kept out of the corpus."""
        w, t = self.cfg.warmstart, self.tasks
        opt, sched = builders.make_optimizer(self.policy, lr=w.pretrain_lr, cfg=self.cfg)
        families = list(self.cfg.tasks.families) or list(FAMILIES)
        avoid = {task.instruction.strip() for task in t.rl + t.heldout_family}
        with self.clock.phase("pretrain"):
            return pretrain(self.policy, self.tok, families=families, steps=w.pretrain_steps, opt=opt, sched=sched,
                            grad_clip=self.cfg.optim.grad_clip, row_tokens=w.pretrain_row_tokens,
                            seed_block=w.pretrain_seed_block, avoid=avoid, dp=self.dp)

    def evaluate(self, tag: str) -> dict[str, float]:
        """Held-out success: unseen seeds of the training families, and unseen fixed tasks, separately. The family
        instances are also sampled run.eval_samples times each at the rollout temperature; after RL, both are
        compared with the evaluation before, instance by instance (t1core.heldout). Same instances and sampling
        seeds at every evaluation."""
        cfg, out = self.cfg, {}
        runs = [("family", self.tasks.heldout_family, 1, cfg.run.eval_temperature),
                ("fixed", self.tasks.heldout_fixed, 1, cfg.run.eval_temperature)]
        if cfg.run.eval_samples:
            runs.append(("family_sampled", self.tasks.heldout_family, cfg.run.eval_samples, cfg.rollout.temperature))
        for i, (name, tasks, k, temperature) in enumerate(runs):
            if not tasks:
                continue
            # The greedy runs share their seed (as always); the sampled run has its own.
            seed = seed_for(cfg.run.seed, Stream.HELDOUT) if i < 2 else seed_for(cfg.run.seed, Stream.HELDOUT, i)
            with self.clock.phase("eval"):
                trajs, _ = self.collect([t for t in tasks for _ in range(k)], seed=seed,
                                        desc=f"eval {tag} {name}", temperature=temperature)
            if self.dp.is_main:
                save_trajectories(trajs, self.run_dir / "trajectories" / f"eval_{tag}_{name}")
            passed = [t.verifier["passed"] / t.verifier["total"] if t.verifier and t.verifier["total"] else 0.0
                      for t in trajs]
            num_solved = sum(map(solved, trajs))
            out[f"heldout/{name}_solved"] = float(num_solved)
            out[f"heldout/{name}_episodes"] = float(len(trajs))
            out[f"heldout/{name}_success"] = num_solved / len(trajs)
            out[f"heldout/{name}_verifier_frac"] = sum(passed) / len(trajs)
        if tag != "before" and self.dp.is_main:
            out.update(change_metrics(self.run_dir, tag))
        return out

    def train_step(self, step: int) -> dict[str, float]:
        """collect -> score -> update -> sync."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(seed_for(cfg.run.seed, Stream.UPDATE, step))
        n, k = cfg.rollout.episodes_per_step, cfg.rollout.group_size
        instances = torch.randint(len(self.tasks.rl), (n // k,), generator=gen).tolist()  # with replacement
        with self.clock.phase("collect"):
            batch = self._collect_step(step, instances)
        if not batch.trajs:
            return {**batch.metrics, "skipped/no_sampled_tokens": 1.0}
        plan = push_plan(batch.rewards, batch.group_ids, step=step, algo=cfg.algo, group_size=k)
        if cfg.optim.actor_lr_decay:
            builders.refresh_lr(self.sched_actor)  # this RL step's rate (progress moved since the last optimizer step)
        if cfg.rollout.engine == "vllm" and cfg.vllm.placement == "colocated":
            self.engine.sleep()  # vLLM gives the shared GPUs back for the update; the weight sync wakes it
        with self.clock.phase("update"):
            scored, fidelity = score(batch.trajs, batch.rewards, policy=self.policy, critic=self.critic,
                                     ref_policy=self.ref_policy, algo=cfg.algo, temperature=cfg.rollout.temperature,
                                     group_ids=batch.group_ids, no_push=plan.no_push, dp=self.dp,
                                     routing_agreement=_every(cfg.run.routing_agreement_every, step))
            upd = ppo_update(scored, self.actor_critic(), algo=cfg.algo, optim=cfg.optim,
                             temperature=cfg.rollout.temperature, update_actor=plan.update_actor, generator=gen,
                             dp=self.dp)
        with self.clock.phase("sync"):
            # Also after critic-only steps: it resets the engine's prefix cache at every step boundary,
            # so a resumed run (which starts with an empty cache) computes exactly what a straight run does.
            self.sync_engine()
        return {**batch.metrics, **plan.metrics, **fidelity, **upd, "train/actor_updated": float(plan.update_actor)}

    def _collect_step(self, step: int, instances: list[int]) -> StepBatch:
        """Episodes (each instance rollout.group_size times, spread over the ranks), rewards, drift: what every rank
        trains on (no trajectory when nothing was sampled)."""
        cfg, k = self.cfg, self.cfg.rollout.group_size
        order = [i for i in instances for _ in range(k)]  # each instance sampled k times (its own sampling seeds)
        group_of = [j // k for j in range(len(order))]
        trajs, drift_per = self.collect([self.tasks.rl[i] for i in order],
                                        seed=seed_for(cfg.run.seed, Stream.ROLLOUT, step), desc=f"step {step} rollout")
        if self.dp.is_main:
            save_trajectories(trajs, self.run_dir / "trajectories" / f"step_{step:04d}")
        rewards = self.rewards(trajs)
        metrics = {**_rollout_metrics(trajs, rewards), **cut_metrics(trajs)}
        kept = [i for i, t in enumerate(trajs) if any(bool(s.loss_mask.any()) for s in t.segments())]
        drift = sum(drift_per[i] for i in kept)
        train_trajs, train_rewards, groups = training_segments(
            [trajs[i] for i in kept], [rewards[i] for i in kept], [group_of[i] for i in kept],
            cut_episodes=cfg.algo.cut_episodes)
        if not cfg.algo.use_tito:  # ablation: train on the re-tokenized transcript
            pairs = [retokenize(t, self.tok) for t in train_trajs]
            train_trajs, drift = [p[0] for p in pairs], sum(p[1] for p in pairs)
        if kept:
            metrics["tito/drift_tokens"] = float(drift)
        return StepBatch(train_trajs, train_rewards, groups, metrics)

    def rewards(self, trajs: list) -> list[float]:
        """Each episode's reward for the update (`t1core.step.shaped_reward`)."""
        return [shaped_reward(t, self.cfg.algo) for t in trajs]

    def actor_critic(self) -> ActorCritic:
        return ActorCritic(self.policy, self.critic, self.opt_actor, self.opt_critic, self.sched_actor,
                           self.sched_critic, self.ref_policy)

    def sync_engine(self) -> None:
        """Every rank's engine (rank 0's alone when it serves all ranks) gets the policy's current weights, streamed
        one decoder layer at a time (gathered from the shards when sharded; collective then), in the engine's dtype."""
        dtype = builders.compute_dtype(self.cfg)
        self.ranks.sync(self.engine, distributed.iter_hf_tensors(self.policy, dtype=dtype))

    # ---- the loop ----
    def run(self) -> None:
        cfg = self.cfg
        resume_step = self._maybe_resume()
        logger = MetricsLogger(self.run_dir / "metrics.jsonl", resume_step=resume_step) if self.dp.is_main else None

        def log(step: int, metrics: dict) -> None:
            if logger is not None:  # one line per row for people (tqdm.write keeps terminal bars intact)
                tqdm.write(progress_line(logger.log(step, metrics), total_steps=cfg.run.steps), file=sys.stdout)
                sys.stdout.flush()
        if not self.state.warm_started:
            warm = self.warm_start()
            # Saved once: a resumed run anchors its KL penalty to it, and later runs can start from it.
            self.save_hf(self.run_dir / WARMSTART_DIR)
            log(-1, {**warm, **self.evaluate("before"), **self.clock.pop()})
            if cfg.algo.kl_coef > 0:
                self.ref_policy = _frozen_copy(self.policy, self.dp)
            self.state.warm_started = True
        # RL leaves these as warm-started (pretraining and SFT trained them): no gradient, no optimizer step.
        frozen = set(self.actor_frozen)
        for name, p in self.policy.named_parameters():
            p.requires_grad_(name not in frozen)
        for step in tqdm(range(self.state.step, cfg.run.steps), desc="rl", file=sys.stdout, disable=None):
            t0 = time.perf_counter()
            m = self.train_step(step)
            self.state.step = step + 1
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and step + 1 < cfg.run.steps:
                m.update(self.evaluate(f"step{step + 1}"))
            m.update(self.clock.pop(), **gpu_stats(), **{"time/step_s": time.perf_counter() - t0})
            log(step, m)
            last = step + 1 == cfg.run.steps
            if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                self.checkpoint()
        after = None
        if self.state.step == cfg.run.steps and self.state.evaluated_at != cfg.run.steps:
            after = self.evaluate("after")
            log(cfg.run.steps, {**after, **self.clock.pop()})
            self.state.evaluated_at = cfg.run.steps
        if logger is not None:
            logger.close()
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")
        self.save_hf(self.run_dir / "final")
        if after is not None and self.dp.is_main:  # the run's closing lines: fidelity, what RL did to held-out success
            fidelity = fidelity_line(read_metrics(self.run_dir / "metrics.jsonl"), bitwise=cfg.algo.bitwise == "on")
            for line in ([fidelity] if fidelity else []) + summary_lines(after, temperature=cfg.rollout.temperature):
                print(line, flush=True)

    def save_hf(self, path: Path) -> None:
        """The policy as a HF checkpoint directory with its tokenizer: `--model.name=PATH` loads it. Sharded: streamed
        one layer at a time to the main rank, which writes it (collective)."""
        distributed.save_hf(self.policy, path, self.dp)
        if self.dp.is_main:
            self.tok.save_pretrained(path)

    def checkpoint(self) -> Path | None:
        """Atomic checkpoint (collective when sharded: every rank writes its own shards, the main rank the rest)."""
        return save_checkpoint(self.run_dir / "checkpoints", step=self.state.step, policy=self.policy,
                               critic=self.critic, optimizers=self._optimizers(), rng_states=capture_rng_state(),
                               data_state=self.state.to_dict(), config=self.cfg, keep_last=2, dp=self.dp)

    def _optimizers(self) -> dict:
        """Optimizers (with their models: sharded ones save and load as shards) and schedulers by name."""
        return {"actor": distributed.ModelOptimizer(self.policy, self.opt_actor),
                "critic": distributed.ModelOptimizer(self.critic, self.opt_critic),
                "sched_actor": self.sched_actor, "sched_critic": self.sched_critic}

    def _maybe_resume(self) -> int | None:
        ckpt_root = self.run_dir / "checkpoints"
        if latest_checkpoint(ckpt_root) is None:
            # A run that died before its first checkpoint starts over; its partial metrics rows go.
            return -2 if (self.run_dir / "metrics.jsonl").exists() else None
        ckpt = load_checkpoint(ckpt_root, policy=self.policy, critic=self.critic, optimizers=self._optimizers())
        self.state = TrainerState.from_dict(ckpt["data_state"])
        self.sync_engine()
        if self.cfg.algo.kl_coef > 0:
            ref_dir = self.run_dir / WARMSTART_DIR
            if not (ref_dir / "config.json").is_file():
                raise ValueError(f"resume with algo.kl_coef > 0: the KL reference policy {ref_dir} is missing")
            self.ref_policy = _anchor_from_hf(ref_dir, self.policy)
        if self.dp.is_main:
            print(f"resumed from {ckpt['path']} at step {self.state.step}")
        return self.state.step - 1

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _frozen_copy(model: torch.nn.Module, dp: DataParallel) -> torch.nn.Module:
    """A frozen copy of the policy (the KL anchor). Sharded policy: a sharded copy in the compute dtype, each rank
    copying its own shards (no rank ever holds the whole model)."""
    if not distributed.is_sharded(model):
        return copy.deepcopy(model).eval().requires_grad_(False)
    return distributed.frozen_shards(model).eval().requires_grad_(False)


def _anchor_from_hf(path: Path, policy: torch.nn.Module) -> torch.nn.Module:
    """The KL anchor of a resumed run, read from its warm-start HF directory: sharded like the policy (each rank
    reads only its own rows) when the policy is sharded."""
    if not distributed.is_sharded(policy):
        param = next(policy.parameters())
        ref = load_pretrained(path, dtype=param.dtype, device=param.device)
        return ref.eval().requires_grad_(False)
    return distributed.frozen_shards(policy, hf_dir=path).eval().requires_grad_(False)


def _every(n: int, step: int) -> bool:
    """Whether RL step `step` (0-based) is one of every n-th (n = 0: never)."""
    return n > 0 and step % n == 0


def _rollout_metrics(trajs: list, rewards: list[float]) -> dict[str, float]:
    n = len(trajs)
    verified = [t.verifier for t in trajs if t.verifier]
    segs = [s for t in trajs for s in t.segments()]  # every context of a compacted episode
    tokens = sum(s.num_tokens for s in segs)
    out = {
        "reward/dense_mean": sum(v["passed"] for v in verified) / n,
        "reward/shaped_mean": sum(rewards) / n,
        "outcome/rate": sum(map(solved, trajs)) / n,
        "rollout/turns_mean": sum(len(s.turns) for s in segs) / n,
        "rollout/tokens": float(tokens),
        "rollout/sampled_tokens": float(sum(int(s.loss_mask.sum()) for s in segs)),
        "rollout/malformed_tool_calls": float(sum(t.metrics.get("malformed_tool_calls", 0) for t in trajs)),
        "rollout/sandbox_errors": float(sum(t.finish_reason.startswith("sandbox_error") for t in trajs)),
        "tito/prefix_checks": float(sum(t.metrics.get("tito_prefix_checks", 0) for t in trajs)),
    }
    for key in ("generate_s", "command_s", "verify_s"):
        out[f"time/episode_{key}"] = sum(t.metrics.get(key, 0.0) for t in trajs)
    return out


def _parser() -> Parser:
    p = Parser(prog="python -m t1core.train", description="\n\n".join(__doc__.split("\n\n")[1:3]),
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Any config field can be set as --section.key=value (the run prints them all). Examples:\n"
                      "  python -m t1core.train                                   # the embedded CPU default\n"
                      "  python -m t1core.train --rollout.episodes_per_step=16 --run.steps=10\n"
                      "  python -m t1core.train --config t1core/configs/qwen3_30b_a3b_harbor.toml --out runs/exp1\n"
                      "  python -m t1core.train --resume runs/exp1 --run.steps=20   # continue (or extend) a run")
    p.add_argument("--config", metavar="FILE", help="TOML file with config sections (default: the embedded CPU run)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<time>-seed<seed>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint, "
                                                        "under its saved config.toml")
    return p


def parse_args(argv: list[str] | None) -> tuple[RunConfig, Path]:
    """(config, run directory) from the command line; ValueError names what is wrong with it."""
    p = _parser()
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if bad:
        raise ValueError(f"unrecognised arguments {bad}; config overrides look like --section.key=value")
    if args.config is not None and not Path(args.config).is_file():
        raise ValueError(f"--config {args.config}: no such file")
    if args.resume is None:
        cfg = load_config(args.config, overrides)
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
    return load_config(str(run_dir / "config.toml"), overrides), run_dir


def precision_notice(cfg: RunConfig) -> str | None:
    """The warning a CUDA run with fp32 weights prints before anything else (None otherwise): the kernels then run
    their IEEE fp32 path, without tensor cores."""
    if cfg.run.device.startswith("cuda") and cfg.model.dtype == "float32":
        return ("WARNING: model.dtype=float32 on CUDA: the MoE and log-prob Triton kernels take their IEEE fp32 path "
                "(no tensor cores, several times slower than bf16); pass --model.dtype=bfloat16 to train at scale")
    return None


def main(argv: list[str] | None = None) -> int:
    with bad_input(_parser()):
        cfg, run_dir = parse_args(argv)
        builders.check_config(cfg)
    dp = distributed.init_from_env(cfg.run.device)
    try:
        run_dir = dp.broadcast(run_dir)  # the default name holds the time: the main rank's is the run's
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
        trainer = Trainer(cfg, run_dir, dp)
        try:
            trainer.run()
        finally:
            trainer.close()
    finally:
        distributed.close(dp)
    if dp.is_main:
        print(run_dir.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
