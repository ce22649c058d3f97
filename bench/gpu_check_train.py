"""The trainer loop on a GPU: two RL steps of `python -m t1core.train` with the tiny model on CUDA (torch engine).

    python bench/gpu_check_train.py [--dry-run] [--out DIR]

Step 1 is critic-only, step 2 updates actor and critic: collect -> score -> update -> sync once each on CUDA, with
the built-in task families in Docker sandboxes. Checks: the run exits 0, metrics.jsonl has both steps with finite
losses, and the final checkpoint is written. The episodes need a Docker daemon (and the `t1-sandbox-base` image,
built by scripts/setup.sh); T1 has no shell-free runner, so on a device without one the check says so and exits
77 (reported as skipped by bench/gpu_run.sh, like the vLLM part without vLLM). --dry-run prints the plan as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

STEPS = 2
ARGV = ["--run.device=cuda", f"--run.steps={STEPS}", "--run.checkpoint_every=0", "--model.name=tiny",
        "--rollout.engine=torch", "--rollout.episodes_per_step=2", "--rollout.group_size=2",
        "--rollout.concurrency=2", "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8",
        "--rollout.max_tokens=640", "--algo.minibatch_tokens=1400", "--warmstart.pretrain_steps=0",
        "--warmstart.sft_epochs=0", "--warmstart.critic_steps=1", "--algo.actor_push=center"]
SKIPPED = 77


def docker_answers() -> str | None:
    """None when a Docker daemon answers, else why not."""
    try:
        import docker

        docker.from_env().ping()
    except Exception as e:  # noqa: BLE001 (any failure to reach the daemon means the same: no sandboxes here)
        return f"{type(e).__name__}: {e}"
    return None


def check_run(run_dir: Path) -> list[str]:
    """What is wrong with a finished run directory (empty: nothing)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = sorted({r["step"] for r in rows if "step" in r})
    problems = [] if len(steps) == STEPS else [f"metrics.jsonl has steps {steps}, expected {STEPS}"]
    for r in rows:
        bad = [k for k, v in r.items() if "loss" in k and isinstance(v, float) and not math.isfinite(v)]
        problems += [f"step {r.get('step')}: non-finite {k}" for k in bad]
    if not (run_dir / "final" / "model.safetensors").is_file():
        problems.append("no final/model.safetensors")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/gpu_check_train.py --out /tmp/train-check")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    ap.add_argument("--out", default="bench/gpu_logs/train-check", help="run directory (must not exist)")
    args = ap.parse_args()
    if args.dry_run:
        from t1core.config_toml import load_config

        load_config(None, ARGV)  # a renamed or mistyped key fails here, on a CPU, not on the device
        print(json.dumps({"script": "train", "steps": STEPS, "device": "cuda", "engine": "torch",
                          "argv": ["--out", args.out, *ARGV]}))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("FAIL: the train check needs a CUDA GPU", flush=True)
        return 1
    why = docker_answers()
    if why is not None:
        print(f"SKIPPED: no Docker daemon answers on this device ({why}); the episodes run in Docker sandboxes",
              flush=True)
        return SKIPPED
    from t1core import train

    run_dir = Path(args.out)
    rc = train.main(["--out", str(run_dir), *ARGV])
    problems = [f"t1core.train exited {rc}"] if rc else check_run(run_dir)
    for p in problems:
        print(f"FAIL: {p}", flush=True)
    if not problems:
        print(f"ALL CHECKS PASSED: {STEPS} RL steps on CUDA ({torch.cuda.get_device_name()})", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
