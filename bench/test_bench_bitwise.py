"""What algo.bitwise costs on the CPU: the trainer's step (score + PPO update) with the bitwise forward vs the
default fused one, on the same trajectories and weights.

Run: `python -m pytest bench/test_bench_bitwise.py -q -s`. Gates on correctness first (bitwise: gap and max |d|
exactly 0; default: small, not 0), prints seconds per step and the ratio, never asserts on speed.

The trajectories are sampled by the batch-invariant `TorchEngine` (the default engine, so the rollout side costs
the same in both modes; its price against plain products is in bench/test_bench_rollout.py) from the tiny model:
8 episodes shaped like the default run's (a few hundred prompt tokens, replies of up to 96 tokens, 2 turns).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory
from t1core.config import AlgoSection, OptimSection
from t1model.model import ModelConfig, MoEModel, ValueModel
from t1core.update import ppo_update, score
from tests.episodes import Episode
from tests.step_objects import actor_critic, plan, step_batch

EPISODES, ROUNDS = 8, 3


def _episodes(policy: MoEModel) -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    engine_model = copy.deepcopy(policy).eval().requires_grad_(False)
    eps = [Episode(torch.randint(8, 4096, (int(torch.randint(250, 600, (1,), generator=g)),), generator=g).tolist(),
                   i) for i in range(EPISODES)]
    with TorchEngine(engine_model, EngineConfig(max_batch=8, num_slots=16, max_seq_len=2048,
                                                batch_invariant=True)) as engine:
        for turn in range(2):
            futures = [engine.submit(e.ids, e.params(96, 1.0)) for e in eps]
            for e, f in zip(eps, futures):
                e.add_reply(f.result())
                if turn == 0:  # an observation the engine never sampled
                    e.add_observation(torch.randint(8, 4096, (60,), generator=g).tolist())
    return [e.trajectory() for e in eps]


def _step(policy: MoEModel, critic: ValueModel, trajs: list[Trajectory], bitwise: str
          ) -> tuple[float, float, dict]:
    """One trainer step (score + one PPO epoch) on copies of the models; (wall s, process CPU s, score metrics)."""
    pol, cri = copy.deepcopy(policy).train(), copy.deepcopy(critic).train()
    ac = actor_critic(pol, cri)
    algo = AlgoSection(bitwise=bitwise)
    batch, push = step_batch(trajs, [float(i % 3) for i in range(len(trajs))]), plan(negative_scale=0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    scored, metrics = score(batch, push, ac, algo=algo, temperature=1.0)
    ppo_update(scored, push, ac, algo=algo, optim=OptimSection(), temperature=1.0,
               generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - t0, time.process_time() - c0, metrics


def test_bench_bitwise_trainer_step() -> None:
    policy = MoEModel(ModelConfig.tiny(), seed=0)
    critic = ValueModel.from_policy(policy)
    trajs = _episodes(policy)
    tokens = sum(t.num_tokens for t in trajs)
    sampled = sum(int(t.loss_mask.sum()) for t in trajs)
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    gap = {}
    for _ in range(ROUNDS):
        for mode in ("off", "on"):
            seconds, cpu_s, metrics = _step(policy, critic, trajs, mode)
            times[mode].append(seconds)
            cpu[mode].append(cpu_s)
            gap[mode] = metrics["mismatch/gap"]
            if mode == "on":
                assert metrics["mismatch/gap"] == 0.0 and metrics["mismatch/max_abs"] == 0.0
            else:
                assert 0.0 < metrics["mismatch/max_abs"] < 1e-3
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    c_off, c_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    # CPU seconds beside wall seconds: on a shared box the wall clock also counts other processes' turns.
    print(f"\n[bitwise] {EPISODES} episodes, {tokens} tokens, {sampled} sampled; trainer step (score + 1 PPO epoch, "
          f"{torch.get_num_threads()} threads), median of {ROUNDS}: wall default {off:.2f} s, bitwise {on:.2f} s "
          f"(x{on / off:.2f}); process CPU default {c_off:.2f} s, bitwise {c_on:.2f} s (x{c_on / c_off:.2f}); "
          f"gap default {gap['off']:.2e}, bitwise {gap['on']:.1f}")
