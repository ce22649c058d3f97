"""A long episode through the real agent loop with compaction on, for tests/test_long_episode.py and
bench/test_bench_long_episode.py: the tiny model in the real batch-invariant `TorchEngine`, the real `run_episode`,
a built-in task, and a shell that answers every command without a container (the sandbox is not under test)."""

from __future__ import annotations

import copy
import time

import torch

from rollout.agent import AgentConfig, run_episode
from rollout.budget import slot_length
from rollout.compaction import Compaction
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory
from sandbox.docker_sandbox import CommandResult
from sandbox.suite import fixed_tasks
from t1core.batch import pack
from t1core.drift import CompletionLog
from t1core.update import policy_logprobs
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer


class EchoShell:
    """Stands in for the sandbox: each command 'prints' a few lines naming it."""

    def run(self, command: str, *, timeout: float) -> CommandResult:
        out = "\n".join(f"{command[:40]} line {i}" for i in range(4))
        return CommandResult(exit_code=0, output=out, timed_out=False, truncated=False, duration_s=0.0)


class TimedEngine(CompletionLog):
    """The completion log (drift is checked against it) that also stamps each completion's arrival (wall clock,
    process CPU time)."""

    def __init__(self, engine: TorchEngine) -> None:
        super().__init__(engine)
        self.stamps: list[tuple[float, float]] = []

    def submit(self, prompt, params):
        fut = super().submit(prompt, params)
        fut.add_done_callback(lambda _: self.stamps.append((time.perf_counter(), time.process_time())))
        return fut


def long_episode(*, max_turns: int = 300, max_tokens: int = 1024, at_tokens: int = 768, keep_turns: int = 2,
                 max_reply: int = 24, seed: int = 0, observation_max_tokens: int | None = 64,
                 ) -> tuple[Trajectory, MoEModel, TimedEngine]:
    """One episode of `max_turns` turns in contexts of at most `max_tokens` tokens (the tiny model samples mostly
    malformed replies: each answered with an error observation, which grows the context like a command's output)."""
    tok = ChatTokenizer.builtin()
    policy = MoEModel(ModelConfig.tiny(), seed=seed).eval()
    engine = TorchEngine(copy.deepcopy(policy).requires_grad_(False),
                         EngineConfig(max_batch=1, num_slots=2, max_seq_len=slot_length(max_tokens, max_reply),
                                      batch_invariant=True))
    log = TimedEngine(engine)
    task = fixed_tasks("train")[0]
    cfg = AgentConfig(max_turns=max_turns, max_tokens=max_tokens, max_reply_tokens=max_reply, wall_clock_s=3600.0,
                      verify=False, compaction=Compaction(at_tokens=at_tokens, keep_turns=keep_turns),
                      observation_max_tokens=observation_max_tokens)
    try:
        traj = run_episode(log, tok, EchoShell(), task, config=cfg, seed=seed)
    finally:
        engine.close()
    return traj, policy, log


def segment_gaps(policy: MoEModel, traj: Trajectory) -> list[float]:
    """Per segment, max |logp_train - logp_rollout| over its loss tokens: the trainer's bitwise forward with the
    segment's own routing replayed (`t1core.update.policy_logprobs`, what the PPO step scores with)."""
    gaps = []
    for seg in traj.segments():
        batch = pack([seg])
        with torch.no_grad():
            logp_T, _ = policy_logprobs(policy, batch, temperature=1.0, replay=True, bitwise=True)
        d = (logp_T - batch.rollout_logp_T)[batch.loss_mask_T]
        gaps.append(float(d.abs().max()) if d.numel() else 0.0)
    return gaps
