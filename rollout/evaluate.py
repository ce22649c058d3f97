"""Score a HF checkpoint on a directory of tasks: resolved rate, interval, per-task table; resumable.

    python -m rollout.evaluate --checkpoint CKPT --tasks DIR [--attempts N] [--temperature T] --out DIR
        [--config FILE] [--section.key=value ...]

DIR is a task directory or a directory of task directories (Harbor or Terminal-Bench 1), e.g. a benchmark.
Every task gets N attempts at temperature T (default: one greedy attempt; T overrides rollout.temperature, as the
trainer's greedy evaluation does), each in its own sandbox, rollout.concurrency at once, each cut at its own task's
agent timeout (task.toml [agent] timeout_sec). Everything else runs as the trainer's episodes do: its [rollout],
[sandbox], [context] and [vllm] sections, read from the trainer's TOML file (`--config`) and `--section.key=value`
flags (`rollout.config.ToolConfig`), with the trainer's defaults (rollout.engine picks TorchEngine or vLLM). A
task is resolved by an attempt when all its verifiers pass; the resolved rate is the mean over tasks of their
rates, with a 95% bootstrap interval over tasks (rollout.scorecard).

Writes OUT/attempts.jsonl (one record per finished attempt, appended as it finishes), OUT/report.json (settings,
summary, per-task rows) and OUT/tasks.tsv (task, attempts, resolved, tests passed/total, turns, tokens, time,
why it failed). Run again with the same arguments and it resumes: finished attempts are not run again (more
--attempts adds attempts; other settings must match the first run's). The last line printed is report.json.

sandbox.hosts (docs/sandbox-hosts.md) spreads the sandboxes over several Docker daemons. An attempt the
infrastructure ended on every try (a daemon or host died, `sandbox.runtime.failure`) is no verdict on the checkpoint:
it is not recorded, the report counts it as unscored, and running the same command
again runs it again.
"""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import argparse
import dataclasses
import json
import os
import sys
import threading
import zlib
from pathlib import Path
from typing import Any


from rollout import scorecard
from rollout.agent import AgentConfig, EpisodeSpec, run_episodes
from rollout import tool_cli
from rollout.config import ToolConfig
from rollout import budget
from rollout.engine import Engine
from rollout.sampling import derive_seed
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory
from rollout.vllm_engine import VLLMEngine, VLLMSettings
from sandbox.images.base_image import ensure_base_image
from sandbox.cli import Parser, bad_input
from sandbox.runtime.hosts import use_hosts
from sandbox.images.task_images import build_task_images
from sandbox.tasks.format import Task, load_task_dirs
from t1model.hf_io import load_pretrained, read_config
from t1model.tokenizer import ChatTokenizer

RESUME_KEYS = ("checkpoint", "tasks", "temperature", "seed", "max_turns", "max_new_tokens_per_turn", "max_tokens")
"""Settings a resumed evaluation must share with the one it continues (its attempts are comparable then)."""


def _parser() -> Parser:
    p = Parser(prog="python -m rollout.evaluate", description=__doc__.split("\n\n")[0],
               epilog="Any knob of the [rollout], [sandbox], [context] and [vllm] sections is a flag "
                      "--section.key=value. Example: python -m rollout.evaluate --checkpoint runs/exp1/final --tasks "
                      "~/tb2 --attempts 5 --temperature 1 --rollout.concurrency=8 --out runs/exp1/tb2_final")
    p.add_argument("--checkpoint", required=True, help="HF Qwen3-MoE checkpoint dir (with its tokenizer.json)")
    p.add_argument("--tasks", required=True, help="task dir or dir of task dirs")
    p.add_argument("--out", required=True, help="output directory (an existing one is resumed)")
    p.add_argument("--attempts", type=int, default=1, help="attempts per task")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the attempts; 0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="attempt a of task t samples with seed (seed, t, a)")
    tool_cli.add_shared_arguments(p, "[rollout], [sandbox], [context] and [vllm]")
    return p


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ToolConfig]:
    """The evaluation's arguments and its sections, the attempts' temperature in rollout.temperature."""
    p = _parser()
    args, config = tool_cli.parse(p, argv)
    if args.attempts < 1:
        p.error(f"--attempts must be >= 1, got {args.attempts}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    return args, dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, temperature=args.temperature))


def settings_of(args: argparse.Namespace, config: ToolConfig) -> dict[str, Any]:
    """What report.json records of the run; RESUME_KEYS of it must match when resuming."""
    r = config.rollout
    return {"checkpoint": str(Path(args.checkpoint).resolve()), "tasks": str(Path(args.tasks).resolve()),
            "attempts": args.attempts, "temperature": args.temperature, "seed": args.seed,
            "max_turns": r.max_turns, "max_new_tokens_per_turn": r.max_new_tokens_per_turn,
            "max_tokens": r.max_tokens, "engine": r.engine}


def check_resumable(out: Path, settings: dict[str, Any]) -> None:
    """ValueError naming the first setting that differs from the evaluation already in `out`."""
    path = out / "settings.json"
    if not path.is_file():
        return
    before = json.loads(path.read_text())
    for key in RESUME_KEYS:
        if before.get(key) != settings[key]:
            raise ValueError(f"--out {out} holds an evaluation with {key}={before.get(key)!r}, not "
                             f"{settings[key]!r}: use another --out, or the same settings to resume it")


def attempt_seed(seed: int, task: str, attempt: int) -> int:
    """A task's attempt seed from its name (crc32), not its position: stable when tasks come and go."""
    return derive_seed(seed, zlib.crc32(task.encode()), attempt)


def open_engine(args: argparse.Namespace, config: ToolConfig) -> tuple[Engine, ChatTokenizer]:
    """The checkpoint served by TorchEngine or vLLM (rollout.engine), and its tokenizer (tokenizer.json, else the
    built-in one)."""
    ckpt, r = args.checkpoint, config.rollout
    has_tok = (Path(ckpt) / "tokenizer.json").is_file()
    tok = ChatTokenizer.from_pretrained(ckpt) if has_tok else ChatTokenizer.builtin()
    if r.engine == "vllm":
        mcfg = read_config(ckpt)
        max_len = budget.engine_slot(r.max_tokens, r.max_new_tokens_per_turn, mcfg.max_positions)
        settings = VLLMSettings(vllm=config.vllm, max_model_len=max_len, seed=args.seed, trainer_device=args.device)
        return VLLMEngine.from_pretrained(ckpt, mcfg, settings), tok
    model = load_pretrained(ckpt, device=args.device).eval().requires_grad_(False)
    max_len = budget.engine_slot(r.max_tokens, r.max_new_tokens_per_turn, model.config.max_positions)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {model.config.vocab_size}")
    return TorchEngine(model, EngineConfig.for_rollout(r, max_seq_len=max_len)), tok


def run_attempts(args: argparse.Namespace, config: ToolConfig, todo: list[tuple[Task, int]], out: Path) -> None:
    """Run the `todo` (task, attempt) pairs, appending each finished attempt's record to attempts.jsonl."""
    overrides = tool_cli.base_image_overrides(args)
    hosts = use_hosts(config.sandbox.hosts)  # every sandbox pool starts from these
    hosts.reap()  # containers of crashed runs
    ensure_base_image()
    images = build_task_images(sorted({t.name: t for t, _ in todo}.values(), key=lambda t: t.name),
                               base_image_overrides=overrides)
    if config.sandbox.hosts:  # built once on DOCKER_HOST's daemon, streamed to each host
        hosts.distribute({image.ref for image in images.values()})
    specs = [EpisodeSpec(task=t, image=images[t.name], seed=attempt_seed(args.seed, t.name, a)) for t, a in todo]
    # task_timeouts: each attempt is cut at its own task's agent timeout, so one long task stalls nothing else.
    # An evaluation replays no routing: vLLM is not asked for it (its CPU build has none, rollout.vllm_api).
    agent = AgentConfig(rollout=config.rollout, sandbox=config.sandbox, context=config.context, task_timeouts=True,
                        return_routing=config.rollout.engine == "torch")
    lock = threading.Lock()
    records = open(out / "attempts.jsonl", "a")

    def on_done(i: int, traj: Trajectory) -> None:
        rec = scorecard.attempt_record(traj, attempt=todo[i][1])
        if rec["infra"]:  # not recorded: the report counts it as unscored and the next run of the command retries it
            print(f"  {rec['task']:32s} attempt {rec['attempt']:2d}  unscored (the infrastructure failed on every "
                  f"try; run again to retry it): {rec['finish'][:160]}", flush=True)
            return
        with lock:  # one whole line per attempt, on disk before the next: what a resumed run trusts
            records.write(json.dumps(rec) + "\n")
            records.flush()
            os.fsync(records.fileno())
            print(f"  {rec['task']:32s} attempt {rec['attempt']:2d}  {'resolved' if rec['resolved'] else 'failed  '}"
                  f"  tests {rec['passed']}/{rec['total']}  turns {rec['turns']:3d}  tokens {rec['tokens']:6d}  "
                  f"{rec['time_s']:.1f}s  {rec['why']}", flush=True)

    engine, tok = open_engine(args, config)
    try:
        with engine:
            run_episodes(engine, tok, specs, config=agent, num_parallel=config.rollout.concurrency,
                         pool_size=config.sandbox.pool_size, on_done=on_done)
    finally:
        records.close()


def write_report(out: Path, settings: dict[str, Any], records: list[dict[str, Any]],
                 unscored: list[tuple[str, int]]) -> dict[str, Any]:
    """report.json and tasks.tsv of the recorded attempts; `unscored`: the (task, attempt) pairs not recorded."""
    rows = scorecard.task_table(records)
    summary = scorecard.summarize(records) | {"unscored": float(len(unscored))}
    report = {"settings": settings, "summary": summary, "tasks": rows,
              "unscored": [{"task": t, "attempt": a} for t, a in unscored]}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "tasks.tsv").write_text(scorecard.format_table(rows, sep="\t"))
    return report


def main(argv: list[str] | None = None) -> int:
    args, config = _parse_args(argv)
    r = config.rollout
    out = Path(args.out)
    settings = settings_of(args, config)
    with bad_input(_parser()):  # missing checkpoint, malformed task, another evaluation in --out: the user's
        budget.engine_slot(r.max_tokens, r.max_new_tokens_per_turn, read_config(args.checkpoint).max_positions)
        tasks = load_task_dirs(args.tasks)
        check_resumable(out, settings)
        done = scorecard.read_records(out / "attempts.jsonl")
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    scorecard.write_records(out / "attempts.jsonl", done)  # drops a line an interruption cut short
    finished = {(r["task"], r["attempt"]) for r in done}
    todo = [(t, a) for t in tasks for a in range(args.attempts) if (t.name, a) not in finished]
    print(f"evaluate: {len(tasks)} tasks x {args.attempts} attempts at T={args.temperature:g}: "
          f"{len(todo)} to run, {len(tasks) * args.attempts - len(todo)} already done; {args.checkpoint} on "
          f"{r.engine} ({args.device}), {r.concurrency} at once", flush=True)
    if todo:
        run_attempts(args, config, todo, out)
    names = {t.name for t in tasks}
    records = [r for r in scorecard.read_records(out / "attempts.jsonl")
               if r["task"] in names and r["attempt"] < args.attempts]
    recorded = {(r["task"], r["attempt"]) for r in records}
    unscored = [(t.name, a) for t in tasks for a in range(args.attempts) if (t.name, a) not in recorded]
    if not records:
        print(f"evaluate: no attempt was scored: the infrastructure ended all {len(unscored)} on every try; run the "
              "same command again to retry them", file=sys.stderr)
        return 1
    report = write_report(out, settings, records, unscored)
    s = report["summary"]
    print(scorecard.format_table(report["tasks"]))
    print(f"resolved {s['resolved_rate']:.3f}, 95% bootstrap [{s['ci_low']:.3f}, {s['ci_high']:.3f}] over "
          f"{s['tasks']:.0f} tasks x {s['attempts']:.0f} attempts at T={args.temperature:g}; verifier fraction "
          f"{s['verifier_frac']:.3f}" + (f"; {len(unscored)} attempts unscored (the infrastructure failed on every "
                                         "try): run the same command again to retry them" if unscored else ""))
    print((out / "report.json").resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
