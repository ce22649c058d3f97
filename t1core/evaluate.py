"""Held-out evaluation: the same instances and sampling seeds before RL, every run.eval_every steps, and after."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollout.trajectory import Trajectory, save_trajectories
from sandbox.tasks import Task
from t1core.builders import TaskSets
from t1core.config import RunConfig
from t1core.distributed import DataParallel
from t1core.heldout import change_metrics
from t1core.metrics import Stopwatch
from t1core.step import Stream, seed_for, solved

Collect = Callable[..., tuple[list[Trajectory], list[int]]]
"""`Trainer.collect(tasks, *, seed, desc, temperature)`: one episode per task, on every rank."""


def evaluate(collect: Collect, tasks: TaskSets, tag: str, *, cfg: RunConfig, run_dir: Path, dp: DataParallel,
             clock: Stopwatch) -> dict[str, float]:
    """Held-out success: unseen seeds of the training families, and unseen fixed tasks, separately. The family
    instances are also sampled run.eval_samples times each at the rollout temperature; after RL, both are
    compared with the evaluation before, instance by instance (t1core.heldout). Same instances and sampling
    seeds at every evaluation."""
    out: dict[str, float] = {}
    runs: list[tuple[str, list[Task], int, float]] = [
        ("family", tasks.heldout_family, 1, cfg.run.eval_temperature),
        ("fixed", tasks.heldout_fixed, 1, cfg.run.eval_temperature)]
    if cfg.run.eval_samples:
        runs.append(("family_sampled", tasks.heldout_family, cfg.run.eval_samples, cfg.rollout.temperature))
    for i, (name, chosen, k, temperature) in enumerate(runs):
        if not chosen:
            continue
        # The greedy runs share their seed (as always); the sampled run has its own.
        seed = seed_for(cfg.run.seed, Stream.HELDOUT) if i < 2 else seed_for(cfg.run.seed, Stream.HELDOUT, i)
        with clock.phase("eval"):
            trajs, _ = collect([t for t in chosen for _ in range(k)], seed=seed, desc=f"eval {tag} {name}",
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
    if tag != "before" and dp.is_main:
        out.update(change_metrics(run_dir, tag))
    return out
