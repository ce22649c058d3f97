"""A long episode through the real agent loop with compaction on, for tests/test_long_episode.py and
bench/test_bench_long_episode.py: the tiny model in the real batch-invariant `TorchEngine`, the real `run_episode`,
a built-in task, and a shell that answers every command without a container (`long_episode`: the sandbox is not under
test), or a follow_chain task in a real container with a scripted policy whose replies the engine teacher-forces
(`chain_episode`: every command real, each written from the last output)."""

from __future__ import annotations

import copy
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rollout.agent import DONE_MARKER, AgentConfig, run_episode
from rollout.budget import slot_length
from rollout.config import ContextSection, RolloutSection
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory
from sandbox.runtime.docker_sandbox import CommandResult, DockerSandbox
from sandbox.tasks.families.chain import END, chain_task, step_command
from sandbox.tasks.families.common import write_harbor_task
from sandbox.tasks.suite import fixed_tasks
from sandbox.images.task_images import build_task_image, default_base_image_overrides
from sandbox.tasks.format import load_task
from sandbox.runtime.settings import SandboxSettings
from t1core.batch import pack
from t1core.drift import CompletionLog
from t1core.update import policy_logprobs
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer, format_tool_call


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


def _tiny_engine(max_tokens: int, max_reply: int, seed: int) -> tuple[MoEModel, TorchEngine, TimedEngine]:
    policy = MoEModel(ModelConfig.tiny(), seed=seed).eval()
    engine = TorchEngine(copy.deepcopy(policy).requires_grad_(False),
                         EngineConfig(max_batch=1, num_slots=2, max_seq_len=slot_length(max_tokens, max_reply),
                                      batch_invariant=True))
    return policy, engine, TimedEngine(engine)


def long_episode(*, max_turns: int = 300, max_tokens: int = 1024, keep_turns: int = 2,
                 max_reply: int = 24, seed: int = 0, observation_max_tokens: int | None = 64,
                 ) -> tuple[Trajectory, MoEModel, TimedEngine]:
    """One episode of `max_turns` turns in contexts of at most `max_tokens` tokens (the tiny model samples mostly
    malformed replies: each answered with an error observation, which grows the context like a command's output)."""
    tok = ChatTokenizer.builtin()
    policy, engine, log = _tiny_engine(max_tokens, max_reply, seed)
    task = fixed_tasks("train")[0]
    rollout = RolloutSection(max_turns=max_turns, max_tokens=max_tokens, max_new_tokens_per_turn=max_reply,
                             wall_clock_limit_s=3600.0)
    context = ContextSection(compaction="extractive", keep_turns=keep_turns,
                             observation_max_tokens=observation_max_tokens)
    cfg = AgentConfig(rollout=rollout, context=context, verify=False)
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


_OUTPUT = re.compile(r"<tool_response>\s*(\S+)\s*</tool_response>")


class ChainPolicy:
    """A scripted follow_chain policy served by the real engine: each reply is the command the last observation calls
    for (`tee -a done < q/NAME`; the done marker after `end`; the first path from the instruction), teacher-forced
    (`SamplingParams.forced_token_ids`): the engine prefills the prompt and computes the reply's log-probs and
    routing as for a draw. `on_turn(n)` is called before the n-th reply (1-based)."""

    def __init__(self, engine: TimedEngine, tok: ChatTokenizer, on_turn: Callable[[int], None] | None = None) -> None:
        self.engine, self.tok, self.on_turn, self.turns = engine, tok, on_turn, 0

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def submit(self, prompt, params):
        self.turns += 1
        if self.on_turn is not None:
            self.on_turn(self.turns)
        outputs = _OUTPUT.findall(self.tok.decode(prompt[-48:]))  # the last observation (none before the first turn)
        name = outputs[-1] if outputs else re.search(r"starting at (q/\w+)", self.tok.decode(prompt)).group(1)
        reply = DONE_MARKER if name == END else format_tool_call(step_command(name))
        forced = tuple(self.tok.encode(reply) + [self.tok.im_end_id])
        return self.engine.submit(prompt, params.replace(forced_token_ids=forced))


def container_probe(container_id: str) -> dict[str, int]:
    """This process's open file descriptors and threads, and the processes running in the sandbox's container."""
    from sandbox.daemon import docker_client

    processes = len(docker_client().top(container_id)["Processes"])  # first: its connection stays in the pool
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threads, "py_threads": threading.active_count(),
            "sandbox_processes": processes}


def chain_episode(*, links: int, max_tokens: int = 1024, keep_turns: int = 2, observation_max_tokens: int = 32,
                  seed: int = 0, probe_turns: tuple[int, ...] = ()) -> tuple[Trajectory, MoEModel, TimedEngine, dict]:
    """One follow_chain episode of `links` links (links + 1 turns: the last writes the done marker) in a real
    container, contexts of at most `max_tokens` tokens folded at 0.8 of it, verified at the end. Returns the episode,
    the policy (for the gaps), the engine log and `container_probe` taken before each turn in `probe_turns`."""
    tok = ChatTokenizer.builtin()
    max_reply = 40  # a reply is ~29 tokens
    policy, engine, log = _tiny_engine(max_tokens, max_reply, seed)
    with tempfile.TemporaryDirectory() as tmp:
        spec = chain_task(random.Random(f"stress:{seed}"), links)
        task = load_task(write_harbor_task(spec, Path(tmp) / "chain", family="follow_chain", seed=seed, split="train"))
        image = build_task_image(task, base_image_overrides=default_base_image_overrides())
        rollout = RolloutSection(max_turns=links + 1, max_tokens=max_tokens, max_new_tokens_per_turn=max_reply,
                                 wall_clock_limit_s=7200.0)
        context = ContextSection(compaction="extractive", keep_turns=keep_turns,
                                 observation_max_tokens=observation_max_tokens)
        cfg = AgentConfig(rollout=rollout, context=context)
        probes: dict[int, dict[str, int]] = {}
        try:
            with DockerSandbox(image, SandboxSettings.for_run(task)) as sb:
                def on_turn(n: int) -> None:
                    if n in probe_turns:
                        probes[n] = container_probe(sb.id)
                traj = run_episode(ChainPolicy(log, tok, on_turn), tok, sb, task, config=cfg, seed=seed)
        finally:
            engine.close()
    return traj, policy, log, probes
