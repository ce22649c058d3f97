"""`python -m t1cli.async_sim [--preset 30b|122b|all] [--steps N] [--seed S] [--section.key=value ...]`

Predicts what asynchronous collection (rollout.max_staleness, t1core.async_collect) buys over the synchronous loop,
from an episode-time distribution, the trainer's step time and the weight-sync time, by simulating both schedules
event by event (the same rules as the trainer: groups of k episodes on C engine slots; a step trains G groups; the
async buffer holds (N + 1) * G groups from start to retirement; a group older than N versions at take time is
dropped and its slot refilled; generation stalls during a sync).

Assumptions (each is a field of `SimInputs`, printed with the result):
- Rollout and training have their own devices (a disaggregated engine, vLLM on other GPUs): the update does not slow
  the episodes. On shared GPUs (colocated) the overlap buys much less.
- Episode length: turns log-uniform in [min_turns, max_turns] (heavy tail: few long episodes); each turn takes
  turn_s (reply decode + command), log-normal with sigma turn_sigma. Episode wall time = the sum of its turns.
- Trainer step: flop_per_token x active parameters x trained tokens / (GPUs x mfu x peak), trained tokens =
  episodes x turns x tokens_per_turn; flop_per_token = 20: scoring forward (2) and update forward, recompute and
  backward (8) for the policy and the critic alike (activation checkpointing on, one PPO epoch).
- Weight sync: bf16 bytes of all parameters / SYNC_BYTES_PER_S, fitted to verl's measured 15.76 s per sync for
  Qwen3-30B-A3B (61 GB, 16 trainer + 16 rollout H20s; 4.38 s with its checkpoint engine): verl-project/verl,
  docs/advance/fully_async.md, "checkpoint-engine Ablation Experiment".
The planner presets take the parameter counts of the model presets (t1cli.plan.count_params) and episodes per step,
concurrency and GPUs from the shipped configs (t1core/configs/*.toml), and say whether the preset's layout can run
rollout.max_staleness at all (`layout`): the prediction is for disaggregated engines, which a preset with an engine
per torchrun rank does not have (t1core.config_checks refuses max_staleness there).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import t1core
from sandbox.cli import Parser, bad_input
from t1config import check, knob

PEAK_FLOPS = 706e12
"""H200 bf16 FLOP/s of a large GEMM, measured in this repo: the LM-head matmul (8192 x 4096 x 151,936) in
bench/gpu_logs/h200-2026-11-29/run1-logprob.log (NVIDIA's datasheet peak: 989 TFLOP/s dense)."""
SYNC_BYTES_PER_S = 2 * 30.53e9 / 15.76
"""Weight-sync bandwidth: Qwen3-30B-A3B's bf16 bytes over verl's 15.76 s per sync (module docstring): ~3.9 GB/s."""
CONFIGS = Path(t1core.__file__).parent / "configs"
"""The GPU presets, packaged with the trainer (setup.py package_data)."""
PRESETS = {"30b": ("qwen3_30b_a3b_harbor.toml", "qwen3_30b_a3b"), "122b": ("moe_122b_harbor.toml", "moe_120b_a8b")}


@dataclass(frozen=True, kw_only=True)
class SimInputs:
    """What the prediction rests on (module docstring)."""

    episodes_per_step: int = knob(64, "episodes a step trains (rollout.episodes_per_step)")
    group_size: int = knob(4, "episodes per task instance (rollout.group_size)")
    slots: int = knob(24, "episodes the engines run at once (rollout.concurrency x engine ranks)")
    min_turns: int = knob(2, "turns of the shortest episode")
    max_turns: int = knob(40, "turns of the longest episode (log-uniform between)")
    turn_s: float = knob(8.0, "median seconds per turn (reply decode + command)")
    turn_sigma: float = knob(0.5, "log-normal sigma of a turn's time")
    train_s: float = knob(60.0, "trainer seconds per step (score + update)")
    sync_s: float = knob(15.8, "seconds per weight sync (generation stalls meanwhile)")

    def __post_init__(self) -> None:
        for name in ("episodes_per_step", "group_size", "slots", "min_turns"):
            check(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))
        check(self.episodes_per_step % self.group_size == 0, "group_size", "a divisor of episodes_per_step",
              self.group_size)
        check(self.max_turns >= self.min_turns, "max_turns", f">= min_turns ({self.min_turns})", self.max_turns)
        for name in ("turn_s", "train_s", "sync_s", "turn_sigma"):
            check(getattr(self, name) >= 0, name, ">= 0", getattr(self, name))


@dataclass(frozen=True)
class SimResult:
    max_staleness: int
    step_s: float
    slot_busy_frac: float
    trainer_idle_frac: float
    staleness_mean: float
    dropped_frac: float


def _episode_s(rng: random.Random, x: SimInputs) -> float:
    turns = round(math.exp(rng.uniform(math.log(x.min_turns), math.log(x.max_turns))))
    return sum(x.turn_s * math.exp(rng.gauss(0.0, x.turn_sigma)) for _ in range(turns))


def simulate(x: SimInputs, *, max_staleness: int, steps: int, seed: int = 0) -> SimResult:
    """Both schedules over `steps` steps: max_staleness 0 is the synchronous loop."""
    rng = random.Random(seed)
    k, G = x.group_size, x.episodes_per_step // x.group_size
    if max_staleness == 0:
        now = busy = idle = 0.0
        for _ in range(steps):
            free = [now] * x.slots  # list scheduling of the step's episodes on the slots
            for _ in range(G * k):
                d = _episode_s(rng, x)
                t = heapq.heappop(free)
                heapq.heappush(free, t + d)
                busy += d
            collect = max(free) - now
            idle += collect
            now += collect + x.train_s + x.sync_s
        return SimResult(0, now / steps, busy / (x.slots * now), idle / now, 0.0, 0.0)
    return _simulate_async(x, rng, N=max_staleness, steps=steps, k=k, G=G)


def _simulate_async(x: SimInputs, rng: random.Random, *, N: int, steps: int, k: int, G: int) -> SimResult:
    """Event loop: episodes on slots, groups finishing into a FIFO, the trainer taking G fresh groups per step."""
    now = busy = wait = 0.0
    version = started = retired = dropped = 0
    queue: list[tuple[int, int]] = []  # (group, episode) waiting for a slot, in start order
    running: list[tuple[float, int]] = []  # heap of (finish time, group)
    free_slots, left, first_v, ready = x.slots, {}, {}, []
    lags: list[int] = []
    trained = 0

    def start_groups() -> None:
        nonlocal started
        while started - retired < (N + 1) * G:
            left[started] = k
            queue.extend((started, e) for e in range(k))
            started += 1

    def fill(t: float) -> None:
        nonlocal free_slots, busy
        while free_slots and queue:
            g, _ = queue.pop(0)
            first_v.setdefault(g, version)  # the version of the group's oldest token
            d = _episode_s(rng, x)
            busy += d
            heapq.heappush(running, (t + d, g))
            free_slots -= 1

    def advance(until: float) -> None:  # episodes finishing before `until`
        nonlocal free_slots
        while running and running[0][0] <= until:
            t, g = heapq.heappop(running)
            free_slots += 1
            left[g] -= 1
            if left[g] == 0:
                ready.append((t, g))
            fill(t)

    start_groups()
    fill(0.0)
    while trained < steps:
        taken, t0 = 0, now
        while taken < G:
            if not ready:
                advance(running[0][0])
                continue
            t, g = ready.pop(0)
            now = max(now, t)
            if version - first_v[g] > N:
                dropped += 1
                retired += 1
                start_groups()
                fill(now)
            else:
                lags.append(version - first_v[g])
                taken += 1
        wait += now - t0
        advance(now + x.train_s)  # the update overlaps generation
        now += x.train_s
        # Sync: generation stalls; every running episode ends sync_s later.
        running = [(t + x.sync_s, g) for t, g in running]
        heapq.heapify(running)
        advance(now)  # (finished before the sync began: already counted)
        now += x.sync_s
        version += 1
        retired += G
        trained += 1
        start_groups()
        fill(now)
    total = now
    return SimResult(N, total / steps, busy / (x.slots * total), wait / total, sum(lags) / len(lags),
                     dropped / (dropped + trained * G))


def planner_inputs(preset: str) -> tuple[SimInputs, str]:
    """SimInputs of a shipped config (t1core/configs) with its model preset's parameter counts, and how they were
    derived (module docstring)."""
    from t1core.config_toml import load_config
    from t1cli.plan import count_params, hardware_from
    from t1model.model import PRESETS as MODEL_PRESETS

    toml, model = PRESETS[preset]
    cfg, hw = load_config(str(CONFIGS / toml), []), hardware_from(str(CONFIGS / toml))
    params = count_params(MODEL_PRESETS[model]())
    gpus = hw.nodes * hw.gpus_per_node
    base = SimInputs()
    tokens = cfg.rollout.episodes_per_step * (base.min_turns + base.max_turns) / 2 * 600  # ~600 tokens per turn
    train_s = 20 * params.active * tokens / (gpus * 0.25 * PEAK_FLOPS)  # MFU 25%
    sync_s = 2 * params.total / SYNC_BYTES_PER_S
    x = dataclasses.replace(base, episodes_per_step=cfg.rollout.episodes_per_step, group_size=cfg.rollout.group_size,
                            slots=cfg.rollout.concurrency * gpus, train_s=round(train_s, 1), sync_s=round(sync_s, 1))
    how = (f"{model}: {params.total / 1e9:.1f}B total, {params.active / 1e9:.1f}B active; {gpus} GPUs; "
           f"{x.episodes_per_step} episodes/step in groups of {x.group_size} on {x.slots} slots\n"
           f"  layout: {layout(cfg)}")
    return x, how


def layout(cfg) -> str:
    """The preset's engine layout, and whether rollout.max_staleness runs on it (t1core.config_checks.check_config)."""
    if cfg.rollout.engine == "vllm" and cfg.vllm.placement == "disaggregated":
        return "disaggregated vLLM engines: max_staleness runs, as simulated"
    return (f"rollout.engine={cfg.rollout.engine!r}, an engine per torchrun rank on the training GPUs: max_staleness "
            "is refused there, so this preset runs the synchronous row (max_staleness 0); the other rows are for "
            "disaggregated engines it does not have")


def report(x: SimInputs, *, staleness: tuple[int, ...] = (0, 1, 2), steps: int = 200, seed: int = 0) -> list[str]:
    results = [simulate(x, max_staleness=n, steps=steps, seed=seed) for n in staleness]
    base = results[0].step_s
    lines = ["max_staleness  s/step  speedup  engine busy  trainer idle  staleness  dropped"]
    for r in results:
        lines.append(f"{r.max_staleness:>13}  {r.step_s:6.0f}  {base / r.step_s:6.2f}x  {r.slot_busy_frac:10.0%}  "
                     f"{r.trainer_idle_frac:12.0%}  {r.staleness_mean:9.2f}  {r.dropped_frac:7.1%}")
    return lines


def main(argv: list[str] | None = None) -> int:
    fields = "\n".join(f"  --{f.name}=VALUE  {f.metadata.get('help', '')} (preset or {f.default})"
                        for f in dataclasses.fields(SimInputs))
    p = Parser(prog="python -m t1cli.async_sim", description=__doc__.split("\n\n")[1],
               epilog=f"assumptions, each overridable:\n{fields}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=[*PRESETS, "all", "none"], default="all",
                   help="the planner's config to simulate ('none': SimInputs' defaults and the overrides)")
    p.add_argument("--steps", type=int, default=200, help="steps simulated per schedule")
    p.add_argument("--seed", type=int, default=0)
    with bad_input(p):
        args, rest = p.parse_known_args(argv)
        overrides = {}
        for a in rest:
            key, sep, value = a.removeprefix("--").partition("=")
            if not sep or key not in {f.name for f in dataclasses.fields(SimInputs)}:
                raise ValueError(f"{a}: expected --FIELD=VALUE with FIELD one of "
                                 f"{[f.name for f in dataclasses.fields(SimInputs)]}")
            kind = type(getattr(SimInputs(), key))
            overrides[key] = kind(value)
        check(args.steps >= 1, "--steps", ">= 1", args.steps)
        runs = []
        for preset in (list(PRESETS) if args.preset == "all" else [args.preset]):
            x, how = planner_inputs(preset) if preset != "none" else (SimInputs(), "SimInputs defaults")
            runs.append((dataclasses.replace(x, **overrides), how))
    for x, how in runs:
        print(how)
        print("  " + ", ".join(f"{f.name}={getattr(x, f.name)}" for f in dataclasses.fields(SimInputs)))
        print("\n".join("  " + line for line in report(x, steps=args.steps, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
