"""The trainer loop on a GPU: two RL steps of `python -m t1core.train` with the tiny model on CUDA (torch engine).

    python bench/gpu_check_train.py [--dry-run] [--out DIR]
    python bench/gpu_check_train.py --record      # on a CPU box with Docker: refresh the recorded episodes

Step 1 is critic-only, step 2 updates actor and critic: collect -> score -> update -> sync once each on CUDA.
Where a Docker daemon answers, the episodes run live in sandboxes (route "live"). The lent device has none, so
there the episodes are replayed from RECORDING (route "replay", bench/train_replay.py): real episodes of the same
run recorded on a CPU box, whose tokens, CPU rollout log-probs and R3 routing the CUDA trainer scores, updates on
and syncs into its engine. Checks: the run ends, metrics.jsonl has both steps with finite losses, drift 0, a
train/rollout gap below GAP_LIMIT (replay: CPU rollout vs CUDA trainer, fp32), and the final checkpoint. --dry-run
prints the plan as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

STEPS = 2
RECORDING = Path(__file__).resolve().parent / "fixtures" / "train_replay"
GAP_LIMIT = 1e-3
"""Largest mean |logp_train - logp_rollout| accepted: fp32 on both sides, only the devices' reductions differ."""
# eval.source=[]: no evaluation, so the recording holds the two steps' episodes alone (a few KiB).
RUN_ARGV = [f"--run.steps={STEPS}", "--run.checkpoint_every=0", "--model.name=tiny",
        "--rollout.engine=torch", "--rollout.episodes_per_step=2", "--rollout.group_size=2",
        "--rollout.concurrency=2", "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8",
        "--rollout.max_tokens=640", "--algo.minibatch_tokens=1400", "--warmstart.pretrain_steps=0",
        "--warmstart.sft_epochs=0", "--warmstart.critic_steps=1", "--algo.actor_push=center", "--eval.source=[]"]
ARGV = ["--run.device=cuda", *RUN_ARGV]


def docker_answers() -> str | None:
    """None when a Docker daemon answers, else why not."""
    try:
        import docker

        docker.from_env().ping()
    except Exception as e:  # noqa: BLE001 (any failure to reach the daemon means the same: no sandboxes here)
        return f"{type(e).__name__}: {e}"
    return None


def check_run(run_dir: Path) -> tuple[list[str], list[str]]:
    """(what is wrong with a finished run directory, one line per RL step for the log)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if "mismatch/gap" in r]  # the RL steps' rows (the warm-start row has no gap)
    problems = [] if len(rl) == STEPS else [f"metrics.jsonl has {len(rl)} RL steps, expected {STEPS}"]
    lines = []
    for r in rl:
        step = r.get("step")
        bad = [k for k, v in r.items() if "loss" in k and isinstance(v, float) and not math.isfinite(v)]
        problems += [f"step {step}: non-finite {k}" for k in bad]
        if r.get("tito/drift_tokens", 0.0) != 0.0:
            problems.append(f"step {step}: TITO drift {r['tito/drift_tokens']:.0f} tokens")
        if not r["mismatch/gap"] <= GAP_LIMIT:
            problems.append(f"step {step}: train/rollout gap {r['mismatch/gap']:.3g} > {GAP_LIMIT}")
        lines.append(f"step {step}: gap {r['mismatch/gap']:.3e} max|d| {r['mismatch/max_abs']:.3e} "
                     f"policy/loss {r.get('policy/loss', float('nan')):.4f} value/loss {r['value/loss']:.4f}")
    if not (run_dir / "final" / "model.safetensors").is_file():
        problems.append("no final/model.safetensors")
    return problems, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/gpu_check_train.py --out /tmp/train-check")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    ap.add_argument("--out", default="bench/gpu_logs/train-check", help="run directory (must not exist)")
    ap.add_argument("--record", action="store_true",
                    help=f"run on the CPU with Docker and record its episodes into {RECORDING} (replaced)")
    args = ap.parse_args()
    if args.dry_run:
        from t1core.config_toml import load_config

        load_config(None, ARGV)  # a renamed or mistyped key fails here, on a CPU, not on the device
        if not (RECORDING / "recording.json").is_file():  # the route without Docker needs it on the device
            print(f"FAIL: no recording at {RECORDING} (python bench/gpu_check_train.py --record)", flush=True)
            return 1
        print(json.dumps({"script": "train", "steps": STEPS, "device": "cuda", "engine": "torch",
                          "argv": ["--out", args.out, *ARGV], "replay": str(RECORDING.relative_to(Path.cwd()))
                          if RECORDING.is_relative_to(Path.cwd()) else str(RECORDING)}))
        return 0
    if args.record:  # a CPU box with Docker: the same run on the CPU, its episodes recorded
        import train_replay

        run_dir = train_replay.record(["--out", args.out, "--run.device=cpu", *RUN_ARGV], RECORDING)
        print(f"recorded {RECORDING} from {run_dir}", flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("FAIL: the train check needs a CUDA GPU", flush=True)
        return 1
    run_dir = Path(args.out)
    why = docker_answers()
    if why is None:
        print("route: live (episodes in Docker sandboxes)", flush=True)
        from t1core import train

        rc = train.main(["--out", str(run_dir), *ARGV])
    else:  # the device: no Docker daemon; the recorded episodes of this same run
        print(f"route: replay of {RECORDING.name} (no Docker daemon: {why})", flush=True)
        import train_replay

        train_replay.run(train_replay.ReplayTrainer, ["--out", str(run_dir), *ARGV], RECORDING)
        rc = 0
    problems, lines = ([f"t1core.train exited {rc}"], []) if rc else check_run(run_dir)
    for line in lines:
        print(line, flush=True)
    for p in problems:
        print(f"FAIL: {p}", flush=True)
    if not problems:
        print(f"ALL CHECKS PASSED: {STEPS} RL steps on CUDA ({torch.cuda.get_device_name()})", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
