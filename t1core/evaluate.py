"""Evaluation before RL, every eval.every steps and after: the built-in held-out split (same instances and sampling
seeds each time) and eval.source's benchmark directories (t1core.evaluation)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollout.trajectory import Trajectory, save_trajectories
from sandbox.tasks.format import Task
from t1core.tasks import TaskSets
from t1core.config import RunConfig
from t1core import evaluation
from t1core.distributed import DataParallel
from t1core.heldout import change_metrics, episode_shape
from t1core.metrics import Stopwatch
from t1core.step import Stream, seed_for, solved

Collect = Callable[..., tuple[list[Trajectory], list[int]]]
"""`Trainer.collect(tasks, *, seed, desc, temperature, task_timeouts)`: one episode per task, on every rank."""


def evaluate(collect: Collect, tasks: TaskSets, tag: str, *, cfg: RunConfig, run_dir: Path, dp: DataParallel,
             clock: Stopwatch) -> dict[str, float]:
    """Held-out success: unseen seeds of the training families, and unseen fixed tasks, separately. The family
    instances are also sampled eval.attempts times each at the rollout temperature; after RL, both are
    compared with the evaluation before, instance by instance (t1core.heldout). Then eval.source's benchmark
    directories (t1core.evaluation), each episode cut at its own task's agent timeout. Same tasks and sampling
    seeds at every evaluation."""
    out: dict[str, float] = {}
    runs: list[tuple[str, list[Task], int, float]] = [
        ("family", tasks.heldout_family, 1, evaluation.GREEDY),
        ("fixed", tasks.heldout_fixed, 1, evaluation.GREEDY)]
    if cfg.eval.attempts:
        runs.append(("family_sampled", tasks.heldout_family, cfg.eval.attempts, cfg.rollout.temperature))
    for i, (name, chosen, k, temperature) in enumerate(runs):
        if not chosen:
            continue
        # The greedy runs share their seed (as always); the sampled run has its own.
        seed = seed_for(cfg.run.seed, Stream.HELDOUT) if i < 2 else seed_for(cfg.run.seed, Stream.HELDOUT, i)
        with clock.phase("eval"):
            trajs, drift = collect([t for t in chosen for _ in range(k)], seed=seed, desc=f"eval {tag} {name}",
                                   temperature=temperature)
        if dp.is_main:
            save_trajectories(trajs, run_dir / "trajectories" / f"eval_{tag}_{name}")
        passed = [t.verifier["passed"] / t.verifier["total"] if t.verifier and t.verifier["total"] else 0.0
                  for t in trajs]
        num_solved = sum(map(solved, trajs))
        out[f"heldout/{name}_solved"] = float(num_solved)
        out[f"heldout/{name}_episodes"] = float(len(trajs))
        out[f"heldout/{name}_success"] = num_solved / len(trajs)
        out[f"heldout/{name}_verifier_frac"] = sum(passed) / len(trajs)
        out[f"heldout/{name}_drift_tokens"] = float(sum(drift))
        out.update(episode_shape(f"heldout/{name}", trajs))
    if tag != "before" and dp.is_main:
        out.update(change_metrics(run_dir, tag))
    for j, (name, bench) in enumerate(tasks.benchmarks.items()):
        for kind, episodes, temperature, index in evaluation.runs(cfg, j, bench):
            with clock.phase("eval"):
                trajs, _ = collect(episodes, seed=seed_for(cfg.run.seed, Stream.HELDOUT, index),
                                   desc=f"eval {tag} {name} {kind}", temperature=temperature, task_timeouts=True)
            if dp.is_main:
                out.update(evaluation.score(run_dir, tag, name, kind, trajs))
    out["eval/tasks"] = float(tasks.num_eval_tasks)
    return out
