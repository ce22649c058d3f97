"""`python -m t1core.train [--config FILE] [--out DIR] [--resume RUN_DIR] [--section.key=value ...]`

Warm start (pretraining, SFT), held-out evaluation, then per RL step collect -> score -> update -> sync, then the
evaluation after RL and the final HF checkpoint. This file only orchestrates; each phase has its own module
(t1core.pretrain, .sft, .evaluate, .update, .checkpoint, .cli: `t1core.cli.DESCRIPTION` says more)."""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rollout.agent import EpisodeSpec
from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory, save_trajectories
from sandbox.cli import bad_input
from sandbox.tasks.format import Task
from t1core import async_collect, cli, config_checks, models, optimizer, pretrain, rollout_ranks, segments, tasks
from t1core.async_collect import AsyncCollector
from t1core.config import RunConfig, resolved
from t1core.distributed import DataParallel
from t1core.drift import CompletionLog
from t1core.context import RunContext
from t1core.evaluation import evaluate
from t1core.clock import Stopwatch
from t1core.metrics import EngineWindow, RunLog, gpu_stats
from t1core.checkpoint.hf import export_policy
from t1core.checkpoint.resume import WARMSTART_DIR, checkpoint, frozen_copy, resume
from t1core.sft import warm_start
from t1core.advantages import push_plan, shaped_reward
from t1core.step import Stream, StepBatch, TrainerState, seed_for, step_draws
from t1core.update import ActorCritic, ppo_update, score


class Trainer:
    """Holds the run's parts; each method is one phase of the loop in `run`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, dp: DataParallel | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir = resolved(cfg), run_dir  # 'auto' values decided in a copy
        self.dp = dp = dp or DataParallel.single()
        pretrain.pretrains(cfg)  # checked first: a config error must not wait for image builds
        self.replay, notice = rollout_ranks.routing_replay(cfg)  # R3, or the trainer's own routing (said in one line)
        if notice and dp.is_main:
            print(notice, flush=True)
        self.tok = models.load_tokenizer(cfg)
        self.tasks = self.prepare_tasks()  # written and built by the main rank, on every rank
        built = models.ModelBuilder(cfg, self.tok, dp)  # load -> engine copy -> checkpoint + shard, in order
        self.actor_frozen = optimizer.frozen_parameters(built.policy, cfg.optim.actor_frozen)  # checked before SFT
        self.ranks = rollout_ranks.RolloutRanks.for_run(cfg, dp)  # which ranks own an engine
        self.engine = built.take_engine_copy()
        # what this rank's engine returned, to check drift against
        self.sampled = CompletionLog(self.engine) if self.engine is not None else None
        self.policy, self.critic = built.wrap_and_shard()
        self.state = TrainerState()
        rl_progress = (lambda: self.state.step / max(cfg.run.steps, 1)) if cfg.optim.lr_decay else None
        self.opt_actor, self.sched_actor = optimizer.make_optimizer(self.policy, lr=cfg.optim.lr_actor, cfg=cfg,
                                                                    progress=rl_progress)
        self.opt_critic, self.sched_critic = optimizer.make_optimizer(self.critic, lr=cfg.optim.lr_critic, cfg=cfg)
        self.ref_policy = None
        self.clock = Stopwatch()
        self.context = RunContext(cfg, run_dir, dp, self.tok, self.tasks, self.clock)  # what each phase reads
        self.collector: AsyncCollector | None = None  # rollout.max_staleness >= 1: started with the first RL step

    def prepare_tasks(self) -> tasks.TaskSets:
        """The task sets, their images built (a seam: bench/train_replay.py replays episodes without Docker)."""
        return tasks.prepare_tasks(self.cfg, self.run_dir, self.dp)

    def collect(self, tasks: list[Task], *, seed: int, desc: str, temperature: float | None = None,
                task_timeouts: bool = False) -> tuple[list[Trajectory], list[int]]:
        """(trajectories, loss-region drift of each), episode i of `tasks` sampled with seed derive_seed(seed, i),
        on every rank. Rank r runs episodes r, r + W, ... on its own engine (or rank 0 all: `RolloutRanks.run`).
        task_timeouts: each episode's wall clock is its own task's agent timeout (evaluation)."""
        specs = [EpisodeSpec(task=t, image=self.tasks.images[t.name], seed=derive_seed(seed, i))
                 for i, t in enumerate(tasks)]
        config = rollout_ranks.agent_config(self.cfg, temperature=temperature, task_timeouts=task_timeouts)
        return self.ranks.run(specs, self.sampled, self.tok, config=config, concurrency=self.cfg.rollout.concurrency,
                              pool_size=self.cfg.sandbox.pool_size, desc=desc, keep_log=self.collector is not None)

    def warm_start(self) -> dict[str, float]:
        """Base pretraining, then SFT (`t1core.sft.warm_start`); the critic-only steps are part of the RL loop."""
        out = warm_start(self.context, self.policy)
        if out:  # the policy changed
            self.sync_engine()
            # The critic starts from the warm-started trunk (its head is still zero), not from the random weights
            # the policy had before; it has taken no optimizer step yet, so there is no state to reset.
            self.critic.copy_trunk_from(self.policy)
        return out

    def evaluate(self, tag: str) -> dict[str, float]:
        return evaluate(self.context, self.collect, tag)

    def train_step(self, step: int) -> dict[str, float]:
        """collect -> score -> update -> sync (asynchronous: take what the collector has ready, then the same)."""
        cfg, t0, engine_time = self.cfg, time.perf_counter(), EngineWindow(self.engine)
        instances, gen = step_draws(cfg.run.seed, step, num_tasks=len(self.tasks.rl),
                                    num_groups=cfg.rollout.episodes_per_step // cfg.rollout.group_size)
        with self.clock.phase("collect"):
            batch = self.collect_step(step, instances) if cfg.rollout.max_staleness == 0 else self.take_step(step)
        waited = time.perf_counter() - t0  # the trainer does nothing while it waits for episodes
        out = self._update_and_sync(step, batch, gen)
        if self.collector is not None:
            self.collector.retire()
        wall = time.perf_counter() - t0
        return {**out, **engine_time.metrics(wall), "train/trainer_idle_frac": waited / wall}

    def _update_and_sync(self, step: int, batch: StepBatch, gen: torch.Generator) -> dict[str, float]:
        cfg, k = self.cfg, self.cfg.rollout.group_size
        if not batch.trajs:
            if cfg.rollout.max_staleness:  # the engine's version counts the steps the staleness bound counts
                self.sync_engine()
            return {**batch.metrics, "skipped/no_sampled_tokens": 1.0}
        plan = push_plan(batch.rewards, batch.group_ids, step=step, algo=cfg.algo, group_size=k,
                         critic_steps=cfg.warmstart.critic_steps)
        if cfg.optim.lr_decay:
            optimizer.refresh_lr(self.sched_actor)  # this RL step's rate (progress moved since the last optimizer step)
        if cfg.rollout.engine == "vllm" and cfg.vllm.placement == "colocated" and self.engine.line.sleep:
            self.engine.sleep()  # vLLM gives the shared GPUs back for the update; the weight sync wakes it
        ac, every = self.actor_critic(), cfg.run.routing_agreement_every
        with self.clock.phase("score"):
            scored, fidelity = score(batch, plan, ac, algo=cfg.algo, temperature=cfg.rollout.temperature,
                                     routing_agreement=every > 0 and step % every == 0, replay=self.replay,
                                     dp=self.dp)
        with self.clock.phase("update" if plan.update_actor else "critic_warmup"):
            upd = ppo_update(scored, plan, ac, algo=cfg.algo, optim=cfg.optim, temperature=cfg.rollout.temperature,
                             generator=gen, replay=self.replay, dp=self.dp)
        with self.clock.phase("sync"):
            # Also after critic-only steps: it resets the engine's prefix cache at every step boundary,
            # so a resumed run (which starts with an empty cache) computes exactly what a straight run does.
            self.sync_engine()
        return {**batch.metrics, **plan.metrics, **fidelity, **upd, "train/actor_updated": float(plan.update_actor)}

    def collect_step(self, step: int, instances: list[int]) -> StepBatch:
        """Episodes (each instance rollout.group_size times, spread over the ranks), rewards, drift: what every rank
        trains on (no trajectory when nothing was sampled)."""
        k = self.cfg.rollout.group_size
        order = [i for i in instances for _ in range(k)]  # each instance sampled k times (its own sampling seeds)
        trajs, drift_per = self.collect([self.tasks.rl[i] for i in order], desc=f"step {step} rollout",
                                        seed=seed_for(self.cfg.run.seed, Stream.ROLLOUT, step))
        return self.step_batch(step, trajs, drift_per, [i // k for i in range(len(trajs))])

    def take_step(self, step: int) -> StepBatch:
        """The asynchronous `collect_step`: the groups the collector has ready for this step (t1core.async_collect),
        as the synchronous loop would hand them on (the episodes saved as sampled, the fresh part trained)."""
        taken = self.collector.take() if self.collector is not None else None
        version = self.engine.policy_version if self.engine is not None else None
        if self.ranks.single_engine:  # rank 0's engine sampled every rank's episodes: each rank trains on them
            taken, version = self.dp.broadcast((taken, version))
        eps = taken.episodes
        return self.step_batch(step, [e.sampled for e in eps], [e.drift for e in eps], [e.group for e in eps],
                               trained=[e.trained for e in eps], metrics=taken.metrics, version=version)

    def step_batch(self, step: int, sampled: list[Trajectory], drift: list[int], groups: list[int],
                   **kw: Any) -> StepBatch:
        """A step's episodes, saved as sampled, then as the update takes them (`t1core.segments.step_batch`)."""
        if self.dp.is_main:
            save_trajectories(sampled, self.run_dir / "trajectories" / f"step_{step:04d}")
        return segments.step_batch(sampled, self.rewards(sampled), drift, groups,
                                   cut_episodes=self.cfg.algo.cut_episodes, **kw)

    def rewards(self, trajs: list[Trajectory]) -> list[float]:
        """Each episode's reward for the update (`t1core.advantages.shaped_reward`)."""
        return [shaped_reward(t, self.cfg.algo) for t in trajs]

    def actor_critic(self) -> ActorCritic:
        return ActorCritic(self.policy, self.critic, self.opt_actor, self.opt_critic, self.sched_actor,
                           self.sched_critic, self.ref_policy)

    def sync_engine(self) -> None:
        """Every engine gets the policy's current weights (`RolloutRanks.sync_policy`)."""
        self.ranks.sync_policy(self.engine, self.policy)

    def run(self) -> None:
        cfg, dp = self.cfg, self.dp
        log = RunLog(self.run_dir, resume_step=self._maybe_resume(), total_steps=cfg.run.steps, is_main=dp.is_main)
        if not self.state.warm_started:
            warm = self.warm_start()
            # Saved once: a resumed run anchors its KL penalty to it, and later runs can start from it.
            export_policy(self.policy, self.tok, self.run_dir / WARMSTART_DIR, dp)
            log.row(-1, {**warm, **self.evaluate("before"), **self.clock.pop()})
            if cfg.algo.kl_coef > 0:
                self.ref_policy = frozen_copy(self.policy, dp)
            self.state.warm_started = True
        optimizer.freeze(self.policy, self.actor_frozen)  # RL leaves these as pretraining and SFT made them
        if cfg.rollout.max_staleness and self.state.step < cfg.run.steps and self.ranks.owns_engine:
            self.collector = async_collect.for_run(self.cfg, self.tasks, self.sampled, self.tok,
                                                   first_step=self.state.step, ranks=self.ranks)
        for step in tqdm(range(self.state.step, cfg.run.steps), desc="rl", file=sys.stdout, disable=None):
            t0 = time.perf_counter()
            m = self.train_step(step)
            self.state.step = step + 1
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.run.steps:
                m.update(self.evaluate(f"step{step + 1}"))
            m.update(self.clock.pop(), **gpu_stats(), **{"time/step_s": time.perf_counter() - t0})
            log.row(step, m)
            if step + 1 == cfg.run.steps or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                self.checkpoint()
        self.stop_collector()  # its episodes must not share the engine with the evaluation after RL
        after = None
        if self.state.step == cfg.run.steps and self.state.evaluated_at != cfg.run.steps:
            after = self.evaluate("after")
            log.row(cfg.run.steps, {**after, **self.clock.pop()})
            self.state.evaluated_at = cfg.run.steps
        log.close()  # and its plot
        export_policy(self.policy, self.tok, self.run_dir / "final", dp)
        log.print_closing_lines(after, cfg)  # fidelity, what RL did to held-out success

    def checkpoint(self) -> Path | None:  # collective when sharded
        return checkpoint(self.run_dir, self.actor_critic(), self.state, cfg=self.cfg, dp=self.dp)

    def _maybe_resume(self) -> int | None:
        """The metrics row to continue after (None: a fresh run; -2: a run that died before its first checkpoint
        starts over and its partial rows go)."""
        found = resume(self.run_dir, self.actor_critic(), kl=self.cfg.algo.kl_coef > 0, dp=self.dp)
        if found is None:
            return -2 if (self.run_dir / "metrics.jsonl").exists() else None
        self.state, self.ref_policy = found
        self.sync_engine()
        return self.state.step - 1

    def stop_collector(self) -> None:
        if self.collector is not None:
            self.collector.close()
            self.collector = None

    def close(self) -> None:
        self.stop_collector()
        if self.engine is not None:
            self.engine.close()


def main(argv: list[str] | None = None) -> int:
    with bad_input(cli.parser()):
        cfg, run_dir = cli.parse_args(argv)
        config_checks.check_config(cfg)
    with cli.session(cfg, run_dir) as (dp, run_dir):  # the ranks, the run's first lines, SIGTERM/SIGINT handling
        trainer = Trainer(cfg, run_dir, dp)
        try:
            trainer.run()
        finally:
            trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
