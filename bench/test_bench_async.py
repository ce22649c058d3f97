"""Synchronous RL against rollout.max_staleness 1 and 2 on a heavy-tailed task mix, at equal trained episodes.

Run: `python -m pytest bench/test_bench_async.py -q -s` (Docker; about 6 minutes on the 2-core box). Four tiny runs
(the same seed, steps, episodes per step and task mix) print side by side: wall time of the RL steps, seconds per
step, engine idle fraction (no batch step running), trainer idle fraction (waiting for episodes), mean staleness,
dropped and continued episodes (max_staleness 1 also with stale_episodes='continue'), trained (sampled) tokens,
and held-out success after RL on a probe benchmark.

The heavy tail: the untrained tiny model never writes the done marker, so every episode takes rollout.max_turns
turns and turn counts cannot make a tail here. The tasks' verifiers do: each task's test sleeps a different time,
0.25 s to 8 s, log-spaced (a factor of 32, like families of 2 to 40 turns; episode wall time includes verification
in the agent loop). A synchronous step waits for its slowest episode, then the engine idles through the update.

Gates on correctness only: every run completes its steps, drift 0, staleness within each bound. CI sets
T1_BENCH_QUICK=1: 3 steps, synchronous and max_staleness 1 only (the same gates; the figures come from the full run).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from t1core import train
from tests.benchmark_tasks import write_benchmark, write_task

docker = pytest.importorskip("docker")

QUICK = os.environ.get("T1_BENCH_QUICK") == "1"
STEPS = 3 if QUICK else 6
RUNS = ((0, "drop"), (1, "drop")) if QUICK else ((0, "drop"), (1, "drop"), (2, "drop"), (1, "continue"))
"""(rollout.max_staleness, rollout.stale_episodes); 0 is the synchronous loop."""
SLEEPS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
COMMON = ["--rollout.episodes_per_step=4", "--rollout.group_size=2", "--rollout.concurrency=4",
          "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=640",
          "--algo.minibatch_tokens=1400", "--warmstart.pretrain_steps=0", "--warmstart.sft_epochs=0",
          "--warmstart.critic_steps=1", "--run.checkpoint_every=0", "--optim.lr_actor=1e-3",
          "--algo.actor_push=center", f"--run.steps={STEPS}", "--eval.attempts=1"]


def _write_tasks(root: Path) -> Path:
    for i, s in enumerate(SLEEPS_S):
        test = f"""
            import time
            from pathlib import Path

            def test_count():
                time.sleep({s})
                assert Path("/root/count{i}").exists()
            """
        write_task(root, f"wait-{s:g}s", f"Count the lines of /etc/passwd and save that number as /root/count{i}.",
                   test)
    return root


def _summary(run: Path, staleness: int) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if 0 <= r["step"] < STEPS]
    assert len(steps) == STEPS
    after = rows[-1]
    out = {"steps_wall_s": steps[-1]["wall_time"] - steps[0]["wall_time"] + steps[0]["time/step_s"],
           "engine_idle": sum(r["rollout/engine_idle_frac"] * r["time/step_s"] for r in steps)
           / sum(r["time/step_s"] for r in steps),
           "trainer_idle": sum(r["train/trainer_idle_frac"] * r["time/step_s"] for r in steps)
           / sum(r["time/step_s"] for r in steps),
           "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in steps) / STEPS,
           "dropped": sum(r.get("async/dropped_episodes", 0.0) for r in steps),
           "continued": sum(r.get("async/continued_episodes", 0.0) for r in steps),
           "sampled_tokens": sum(r["rollout/sampled_tokens"] for r in steps),
           "heldout_success": next((v for k, v in after.items() if k.endswith("_resolved")), float("nan"))}
    for r in steps:  # correctness gates
        assert r["tito/drift_tokens"] == 0, r
        assert r.get("async/staleness_max", 0) <= staleness, r
    return out


def test_sync_vs_async_at_equal_trained_episodes(tmp_path: Path) -> None:
    try:
        docker.from_env().ping()
    except docker.errors.DockerException:
        pytest.skip("no Docker daemon answers")
    tasks, probes = _write_tasks(tmp_path / "tasks"), write_benchmark(tmp_path / "probes")
    results = {}
    for n, stale in RUNS:
        run = tmp_path / f"run{n}{stale}"
        t0 = time.perf_counter()
        assert train.main(["--out", str(run), f"--tasks.source={tasks}", f"--eval.source={probes}", *COMMON,
                           f"--rollout.max_staleness={n}", f"--rollout.stale_episodes={stale}"]) == 0
        results[n, stale] = {**_summary(run, n), "run_wall_s": time.perf_counter() - t0}
    keys = ["steps_wall_s", "run_wall_s", "engine_idle", "trainer_idle", "staleness_mean", "dropped", "continued",
            "sampled_tokens", "heldout_success"]
    print(f"\n{STEPS} steps x 4 episodes, verifier sleeps {SLEEPS_S} s")
    print(f"{'':>16}" + "".join(f"{'sync' if n == 0 else f'N={n} {stale}':>14}" for n, stale in results))
    for k in keys:
        print(f"{k:>16}" + "".join(f"{r[k]:>14.3f}" for r in results.values()))
    base = results[0, "drop"]["steps_wall_s"]
    print(f"{'speedup':>16}" + "".join(f"{base / r['steps_wall_s']:>13.2f}x" for r in results.values()))
