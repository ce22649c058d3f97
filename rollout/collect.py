"""Collect trajectories: run agent episodes of a policy on tasks and write them to a directory.

    python -m rollout.collect [--tasks DIR] [--split train|heldout] [--episodes N] [--checkpoint PATH] --out DIR
        [--config FILE] [--section.key=value ...]

Defaults: the built-in task suite (`sandbox.tasks.suite`, the given split) and the tiny untrained policy
(`ModelConfig.tiny()`, seed 0) with the built-in tokenizer. `--tasks DIR` takes a task directory or a
directory of task directories (Harbor or Terminal-Bench 1 layout). Episode i runs task i mod #tasks.
Writes NNNNNN.safetensors/.json per trajectory (rollout.trajectory) and summary.json; the last line
printed is the output directory.

The episodes run as the trainer's do: its [rollout], [sandbox] and [context] sections, read from the trainer's TOML
file (`--config`) and `--section.key=value` flags (`rollout.config.ToolConfig`), with the trainer's defaults:
rollout.concurrency episodes at once, rollout.max_turns, the token budgets, the temperature, sandbox limits,
sandbox.hosts (several Docker daemons), compaction. An episode the infrastructure ended on every try is written with
its "infra" reason and counted as unscored (`rollout.report` leaves it out of every rate).
"""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


from rollout import budget
from rollout.agent import AgentConfig, EpisodeSpec, run_episodes
from rollout import tool_cli
from rollout.config import ToolConfig
from rollout.sampling import derive_seed
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory, is_infra, save_trajectory
from sandbox.tasks import suite
from sandbox.cli import Parser, bad_input
from sandbox.runtime.hosts import use_hosts
from sandbox.images.task_images import build_task_image
from sandbox.tasks.format import Task, load_task
from t1model.hf_io import load_pretrained
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer


def load_tasks(tasks_dir: str | None, *, split: str, work_dir: Path, num_per_family: int, seed: int) -> list[Task]:
    """Tasks from a directory (one task, or one task per subdirectory), else the built-in suite's split."""
    if tasks_dir is None:
        if split == "train":
            return suite.train_tasks(work_dir, num_per_family=num_per_family, seed=seed)
        fam, fixed = suite.heldout_tasks(work_dir, num_per_family=num_per_family, seed=seed)
        return fam + fixed
    root = Path(tasks_dir)
    if (root / "task.toml").is_file() or (root / "task.yaml").is_file():
        return [load_task(root)]
    dirs = sorted(p for p in root.iterdir() if (p / "task.toml").is_file() or (p / "task.yaml").is_file())
    if not dirs:
        raise ValueError(f"--tasks {root}: no task directories (task.toml / task.yaml) found")
    return [load_task(p) for p in dirs]


def load_policy(checkpoint: str | None, *, device: str) -> tuple[MoEModel, ChatTokenizer]:
    """The checkpoint's model and tokenizer (its tokenizer.json, else the built-in one), or the tiny default."""
    if checkpoint is None:
        model = MoEModel(ModelConfig.tiny(), seed=0, device=device)
        tok = ChatTokenizer.builtin()
    else:
        model = load_pretrained(checkpoint, device=device)
        has_tok = (Path(checkpoint) / "tokenizer.json").is_file()
        tok = ChatTokenizer.from_pretrained(checkpoint) if has_tok else ChatTokenizer.builtin()
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {model.config.vocab_size}")
    return model, tok


def summarize(trajs: list[Trajectory]) -> dict[str, Any]:
    """Aggregate figures of a collection run."""
    n = len(trajs)
    verified = [t for t in trajs if t.verifier is not None]
    turns = sum(len(t.turns) for t in trajs)
    return {
        "episodes": n,
        "mean_reward": sum(t.reward for t in trajs) / max(n, 1),
        "solved": sum(bool(t.verifier and t.verifier.get("outcome")) for t in verified),
        "verified": len(verified),
        "unscored": sum(is_infra(t.finish_reason) for t in trajs),
        "finish_reasons": dict(Counter(t.finish_reason.split(":")[0] for t in trajs)),
        "turns": turns,
        "tokens": sum(t.num_tokens for t in trajs),
        "sampled_tokens": sum(int(t.loss_mask.sum()) for t in trajs),
        "malformed_tool_call_rate": sum(t.metrics.get("malformed_tool_calls", 0) for t in trajs) / max(turns, 1),
        "per_episode": [{"task": t.task_name, "reward": t.reward, "finish_reason": t.finish_reason,
                         "turns": len(t.turns), "tokens": t.num_tokens,
                         "wall_s": round(t.metrics.get("wall_s", 0.0), 3)} for t in trajs],
    }


def _parser() -> Parser:
    p = Parser(prog="python -m rollout.collect", description=__doc__.split("\n\n")[0],
               epilog="Any knob of the [rollout], [sandbox] and [context] sections is a flag --section.key=value. "
                      "Example: python -m rollout.collect --split heldout --num-per-family 12 "
                      "--rollout.temperature=0 --checkpoint runs/exp1/final --out runs/exp1/heldout_final")
    p.add_argument("--tasks", default=None, help="task dir or dir of task dirs (default: built-in suite)")
    p.add_argument("--split", choices=("train", "heldout"), default="train", help="built-in suite split")
    p.add_argument("--episodes", type=int, default=None, help="number of episodes (default: one per task)")
    p.add_argument("--checkpoint", default=None, help="HF Qwen3-MoE checkpoint dir (default: tiny untrained)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-per-family", type=int, default=1, help="built-in family instances per family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="skip the verifiers (reward 0)")
    tool_cli.add_shared_arguments(p, "[rollout], [sandbox] and [context]")
    return p


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ToolConfig]:
    p = _parser()
    args, config = tool_cli.parse(p, argv)
    if config.rollout.engine != "torch":
        p.error("rollout.engine: collect serves its policy with the torch engine, got 'vllm' (rollout.evaluate "
                "runs a checkpoint on vLLM)")
    if args.episodes is not None and args.episodes < 1:
        p.error(f"--episodes must be >= 1, got {args.episodes}")
    return args, config


def main(argv: list[str] | None = None) -> int:
    args, config = _parse_args(argv)
    r = config.rollout
    out = Path(args.out)
    with bad_input(_parser()):  # a missing task or checkpoint directory is the user's, found before any build
        model, tok = load_policy(args.checkpoint, device=args.device)
        max_len = budget.engine_slot(r.max_tokens, r.max_new_tokens_per_turn, model.config.max_positions)
        out.mkdir(parents=True, exist_ok=True)
        tasks = load_tasks(args.tasks, split=args.split, work_dir=out / "tasks",
                           num_per_family=args.num_per_family, seed=args.seed)
    overrides = tool_cli.base_image_overrides(args)
    n = args.episodes if args.episodes is not None else len(tasks)
    episode_tasks = [tasks[i % len(tasks)] for i in range(n)]
    hosts = use_hosts(config.sandbox.hosts)  # every sandbox pool starts from these
    hosts.reap()  # containers of crashed runs
    images = {t.name: build_task_image(t, base_image_overrides=overrides) for t in episode_tasks}
    if config.sandbox.hosts:  # built once on DOCKER_HOST's daemon, streamed to each host
        hosts.distribute({image.ref for image in images.values()})
    specs = [EpisodeSpec(task=t, image=images[t.name], seed=derive_seed(args.seed, i))
             for i, t in enumerate(episode_tasks)]
    agent = AgentConfig(rollout=r, sandbox=config.sandbox, context=config.context, verify=not args.no_verify)
    engine_cfg = EngineConfig.for_rollout(r, max_seq_len=max_len)
    print(f"collect: {n} episodes over {len(tasks)} tasks, {r.concurrency} at once, policy "
          f"{args.checkpoint or 'tiny untrained'} on {args.device}", flush=True)

    def on_done(i: int, traj: Trajectory) -> None:
        save_trajectory(traj, out, i)
        print(f"  [{i:4d}] {traj.task_name:32s} reward {traj.reward:4.1f}  turns {len(traj.turns):3d}  "
              f"tokens {traj.num_tokens:6d}  {traj.finish_reason}", flush=True)

    t0 = time.monotonic()
    with TorchEngine(model, engine_cfg) as engine:
        trajs = run_episodes(engine, tok, specs, config=agent, num_parallel=r.concurrency,
                             pool_size=config.sandbox.pool_size, on_done=on_done)
        stats = dict(engine.stats)
    summary = summarize(trajs) | {"wall_s": time.monotonic() - t0, "engine": stats, "args": vars(args),
                                  "config": dataclasses.asdict(config)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"mean reward {summary['mean_reward']:.2f}, solved {summary['solved']}/{summary['verified']}, "
          f"{summary['sampled_tokens']} sampled tokens, {summary['wall_s']:.1f}s" + (
              f"; {summary['unscored']} episodes unscored (the infrastructure failed on every try)"
              if summary["unscored"] else ""))
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
