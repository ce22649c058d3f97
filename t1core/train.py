"""`python -m t1core.train [--config FILE] [--out DIR] [--resume RUN_DIR] [--section.key=value ...]`

Warm start (pretraining, SFT), held-out evaluation, then per RL step collect -> score -> update -> sync, then the
evaluation after RL and the final HF checkpoint. This file only orchestrates; each phase has its own module
(t1core.pretrain, .sft, .evaluate, .update, .resume, .export, .cli: `t1core.cli.DESCRIPTION` says more)."""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from rollout.agent import EpisodeSpec, is_masked, run_episodes
from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory, save_trajectories
from sandbox.cli import bad_input
from sandbox.signals import exit_on_signals_while
from sandbox.tasks import Task
from t1core import async_collect, builders, cli, distributed
from t1core.async_collect import AsyncCollector
from t1core.cli import parse_args, precision_notice  # noqa: F401  (the command line, as `train.parse_args`)
from t1core.config import RunConfig, resolved
from t1core.config_toml import load_config  # noqa: F401  (tests and notebooks load configs through here)
from t1core.distributed import DataParallel
from t1core.drift import CompletionLog
from t1core.evaluate import evaluate
from t1core.metrics import (MetricsLogger, Stopwatch, closing_lines, engine_stat, gpu_stats, plot_metrics,
                            progress_line, rollout_metrics)
from t1core.pretrain import pretrain_base
from t1core.resume import WARMSTART_DIR, checkpoint, frozen_copy, resume
from t1core.export import save_hf
from t1core.segments import cut_metrics, training_segments
from t1core.sft import run_sft
from t1core.step import Stream, StepBatch, TrainerState, push_plan, seed_for, shaped_reward, step_draws
from t1core.update import ActorCritic, ppo_update, score


class Trainer:
    """Holds the run's parts; each method is one phase of the loop in `run`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, dp: DataParallel | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir = resolved(cfg), run_dir  # 'auto' values decided in a copy
        self.dp = dp = dp or DataParallel.single()
        self.pretrains = builders.pretrains(cfg)  # checked first: a config error must not wait for image builds
        self.replay, notice = builders.routing_replay(cfg)  # R3, or the trainer's own routing (said in one line)
        if notice and dp.is_main:
            print(notice, flush=True)
        self.tok = builders.load_tokenizer(cfg)
        self.tasks = self.prepare_tasks()  # written and built by the main rank, on every rank
        models = builders.ModelBuilder(cfg, self.tok, dp)  # load -> engine copy -> checkpoint + shard, in order
        self.actor_frozen = builders.frozen_parameters(models.policy, cfg.optim.actor_frozen)  # checked before SFT
        self.ranks = builders.rollout_ranks(cfg, dp)  # which ranks own an engine (t1core.rollout_ranks)
        self.engine = models.take_engine_copy()
        # what this rank's engine returned, to check drift against
        self.sampled = CompletionLog(self.engine) if self.engine is not None else None
        self.policy, self.critic = models.wrap_and_shard()
        self.state = TrainerState()
        rl_progress = (lambda: self.state.step / max(cfg.run.steps, 1)) if cfg.optim.lr_decay else None
        self.opt_actor, self.sched_actor = builders.make_optimizer(self.policy, lr=cfg.optim.lr_actor, cfg=cfg,
                                                                   progress=rl_progress)
        self.opt_critic, self.sched_critic = builders.make_optimizer(self.critic, lr=cfg.optim.lr_critic, cfg=cfg)
        self.ref_policy = None
        self.clock = Stopwatch()
        self.collector: AsyncCollector | None = None  # rollout.max_staleness >= 1: started with the first RL step

    def prepare_tasks(self) -> builders.TaskSets:
        """The task sets, their images built (a seam: bench/train_replay.py replays episodes without Docker)."""
        return builders.prepare_tasks(self.cfg, self.run_dir, self.dp)

    # ---- phases ----
    def collect(self, tasks: list[Task], *, seed: int, desc: str, temperature: float | None = None,
                task_timeouts: bool = False) -> tuple[list[Trajectory], list[int]]:
        """(trajectories, loss-region drift of each), episode i of `tasks` sampled with seed derive_seed(seed, i),
        on every rank. Rank r runs episodes r, r + W, ... on its own engine (or rank 0 all: t1core.rollout_ranks).
        task_timeouts: each episode's wall clock is its own task's agent timeout (evaluation)."""
        specs = [EpisodeSpec(task=t, image=self.tasks.images[t.name], seed=derive_seed(seed, i))
                 for i, t in enumerate(tasks)]
        mine = self.ranks.mine(specs)
        bar = tqdm(total=len(mine), desc=desc, leave=False, file=sys.stdout, disable=None if self.dp.is_main else True)
        trajs = []
        if self.sampled is not None and self.collector is None:  # drift is checked against this engine's own
            self.sampled.clear()  # completions (asynchronous episodes still sampling keep theirs: `forget` below)
        if mine:
            trajs = run_episodes(self.sampled, self.tok, mine,
                                 config=builders.agent_config(self.cfg, temperature=temperature,
                                                              task_timeouts=task_timeouts),
                                 num_parallel=self.ranks.parallel(self.cfg.rollout.concurrency),
                                 pool_size=self.ranks.parallel(self.cfg.sandbox.pool_size),
                                 on_done=lambda i, t: bar.update())
        bar.close()
        # Drift of every segment (a compacted episode's contexts), each against the completions of its own prompts.
        done = self.ranks.gather([(t, sum(self.sampled.drift(s) for s in t.segments())) for t in trajs], len(specs))
        if self.collector is not None:
            for t in trajs:
                for s in t.segments():
                    self.sampled.forget(s)
        return [t for t, _ in done], [d for _, d in done]

    def warm_start(self) -> dict[str, float]:
        """Base pretraining (from-scratch presets only), then SFT of the actor on reference transcripts; the
        critic-only steps are part of the RL loop."""
        cfg, dp, out = self.cfg, self.dp, {}
        if self.pretrains:
            with self.clock.phase("pretrain"):
                out = pretrain_base(cfg, self.policy, tok=self.tok, tasks=self.tasks, dp=dp)
        if cfg.warmstart.sft_epochs:
            out.update(run_sft(cfg, self.policy, tok=self.tok, tasks=self.tasks, run_dir=self.run_dir, dp=dp,
                               clock=self.clock))
        if out:  # the policy changed
            self.sync_engine()
            # The critic starts from the warm-started trunk (its head is still zero), not from the random weights
            # the policy had before; it has taken no optimizer step yet, so there is no state to reset.
            self.critic.copy_trunk_from(self.policy)
        return out

    def evaluate(self, tag: str) -> dict[str, float]:
        return evaluate(self.collect, self.tasks, tag, cfg=self.cfg, run_dir=self.run_dir, dp=self.dp,
                        clock=self.clock)

    def train_step(self, step: int) -> dict[str, float]:
        """collect -> score -> update -> sync (asynchronous: take what the collector has ready, then the same)."""
        cfg, t0 = self.cfg, time.perf_counter()
        busy0, pause0 = engine_stat(self.engine, "step_s"), engine_stat(self.engine, "pause_s")
        instances, gen = step_draws(cfg.run.seed, step, num_tasks=len(self.tasks.rl),
                                    num_groups=cfg.rollout.episodes_per_step // cfg.rollout.group_size)
        with self.clock.phase("collect"):
            batch = self.collect_step(step, instances) if cfg.rollout.max_staleness == 0 else self.take_step(step)
        waited = time.perf_counter() - t0  # the trainer does nothing while it waits for episodes
        out = self._update_and_sync(step, batch, gen)
        if self.collector is not None:
            self.collector.retire()
        wall = time.perf_counter() - t0
        busy, pause = engine_stat(self.engine, "step_s"), engine_stat(self.engine, "pause_s")
        if busy is not None:  # idle: no batch step running (waiting for sandboxes, for weights, or for work)
            out["rollout/engine_idle_frac"] = max(0.0, 1.0 - (busy - busy0) / wall)
            out["rollout/engine_busy_s"] = busy - busy0
        if pause is not None:
            out["rollout/engine_pause_s"] = pause - pause0
        return {**out, "train/trainer_idle_frac": waited / wall}

    def _update_and_sync(self, step: int, batch: StepBatch, gen: torch.Generator) -> dict[str, float]:
        cfg, k = self.cfg, self.cfg.rollout.group_size
        if not batch.trajs:
            if cfg.rollout.max_staleness:  # the engine's version counts the steps the staleness bound counts
                self.sync_engine()
            return {**batch.metrics, "skipped/no_sampled_tokens": 1.0}
        plan = push_plan(batch.rewards, batch.group_ids, step=step, algo=cfg.algo, group_size=k,
                         critic_steps=cfg.warmstart.critic_steps)
        if cfg.optim.lr_decay:
            builders.refresh_lr(self.sched_actor)  # this RL step's rate (progress moved since the last optimizer step)
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

    def step_batch(self, step: int, sampled: list[Trajectory], drift: list[int], groups: list[int], *,
                   trained: list[Trajectory] | None = None, metrics: dict[str, float] | None = None,
                   version: int | None = None) -> StepBatch:
        """A step's episodes as the update takes them: saved as sampled, rewarded as whole episodes (a trimmed one
        keeps its outcome), and the `trained` part of those with sampled tokens cut into training segments."""
        trained = sampled if trained is None else trained
        if self.dp.is_main:
            save_trajectories(sampled, self.run_dir / "trajectories" / f"step_{step:04d}")
        rewards = self.rewards(sampled)
        metrics = {**rollout_metrics(sampled, rewards), **cut_metrics(sampled), **(metrics or {})}
        # An episode the infrastructure ended on every try is masked: never trained, never a group's 0.
        kept = [i for i, t in enumerate(trained)
                if not is_masked(sampled[i]) and any(bool(s.loss_mask.any()) for s in t.segments())]
        if kept:
            metrics["tito/drift_tokens"] = float(sum(drift[i] for i in kept))
        segments, seg_rewards, seg_groups = training_segments(  # each context of a compacted episode trains alone
            [trained[i] for i in kept], [rewards[i] for i in kept], [groups[i] for i in kept],
            cut_episodes=self.cfg.algo.cut_episodes)
        metrics["train/segments"] = float(len(segments))  # what the update trains on, one trajectory per context
        return StepBatch(segments, seg_rewards, seg_groups, metrics, version=version)

    def rewards(self, trajs: list[Trajectory]) -> list[float]:
        """Each episode's reward for the update (`t1core.step.shaped_reward`)."""
        return [shaped_reward(t, self.cfg.algo) for t in trajs]

    def actor_critic(self) -> ActorCritic:
        return ActorCritic(self.policy, self.critic, self.opt_actor, self.opt_critic, self.sched_actor,
                           self.sched_critic, self.ref_policy)

    def sync_engine(self) -> None:
        """Every rank's engine (rank 0's alone when it serves all ranks) gets the policy's current weights, streamed
        one decoder layer at a time (gathered from the shards when sharded; collective then), in the engine's dtype."""
        dtype = distributed.compute_dtype(self.policy)
        self.ranks.sync(self.engine, distributed.iter_hf_tensors(self.policy, dtype=dtype))

    # ---- the loop ----
    def run(self) -> None:
        cfg, dp = self.cfg, self.dp
        resume_step = self._maybe_resume()
        logger = MetricsLogger(self.run_dir / "metrics.jsonl", resume_step=resume_step) if dp.is_main else None

        def log(step: int, metrics: dict) -> None:
            if logger is not None:  # one line per row for people (tqdm.write keeps terminal bars intact)
                tqdm.write(progress_line(logger.log(step, metrics), total_steps=cfg.run.steps), file=sys.stdout)
                sys.stdout.flush()
        if not self.state.warm_started:
            warm = self.warm_start()
            # Saved once: a resumed run anchors its KL penalty to it, and later runs can start from it.
            save_hf(self.policy, self.tok, self.run_dir / WARMSTART_DIR, dp)
            log(-1, {**warm, **self.evaluate("before"), **self.clock.pop()})
            if cfg.algo.kl_coef > 0:
                self.ref_policy = frozen_copy(self.policy, dp)
            self.state.warm_started = True
        builders.freeze(self.policy, self.actor_frozen)  # RL leaves these as pretraining and SFT made them
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
            log(step, m)
            if step + 1 == cfg.run.steps or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                self.checkpoint()
        self.stop_collector()  # its episodes must not share the engine with the evaluation after RL
        after = None
        if self.state.step == cfg.run.steps and self.state.evaluated_at != cfg.run.steps:
            after = self.evaluate("after")
            log(cfg.run.steps, {**after, **self.clock.pop()})
            self.state.evaluated_at = cfg.run.steps
        if logger is not None:
            logger.close()
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")
        save_hf(self.policy, self.tok, self.run_dir / "final", dp)
        if after is not None and dp.is_main:  # the run's closing lines: fidelity, what RL did to held-out success
            print("\n".join(closing_lines(self.run_dir / "metrics.jsonl", after, cfg)), flush=True)

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
        cfg, run_dir = parse_args(argv)
        builders.check_config(cfg)
    dp = distributed.init_from_env(cfg.run.device)
    try:
        run_dir = dp.broadcast(run_dir)  # the default name holds the time: the main rank's is the run's
        cli.start(cfg, run_dir, dp)
        with exit_on_signals_while():  # SIGTERM / SIGINT: stop builds, remove the run's sandboxes on every host, exit
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
