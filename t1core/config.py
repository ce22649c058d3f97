"""The one typed config tree of a T1 run: frozen keyword-only dataclasses, TOML + `--section.key=value`.

Every field carries its help text in `metadata["help"]` (printed by `format_config(cfg, with_help=True)` and
written as a comment above each key by `config_to_toml`). The defaults ARE the embedded default run: the tiny
model on the built-in tasks, sized for a 2-core CPU. Optional fields take the string "none" in TOML and on
the command line (TOML has no null).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser (needs `pip install tomli`).
    import tomli as tomllib

Dtype = Literal["float32", "bfloat16", "float16"]
AdvantageNorm = Literal["center", "group", "whiten", "none"]
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _field(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {got!r}")


def _check_types(section: Any) -> None:
    """Every field's value matches its annotation (catches e.g. a string where a float belongs)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if not _matches(value, hints[f.name]):
            where = type(section).__name__.removesuffix("Section").lower()  # ModelSection -> model
            raise ValueError(f"{where}.{f.name}: expected {_type_name(hints[f.name])}, "
                             f"got {value!r} ({type(value).__name__})")


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
    if tp is float:  # an int is a fine float; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "") if typing.get_args(tp) else tp.__name__


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    name: str = _field("tiny", "model preset name (e.g. 'tiny') or path to a HF Qwen3-MoE checkpoint directory")
    dtype: Dtype = _field(
        "float32", "parameter/compute dtype; on CUDA use bfloat16: float32 sends the MoE and log-prob kernels down "
        "their IEEE fp32 path (no tensor cores), and the run says so in its first lines")
    moe_recompute: bool = _field(
        False, "MoE layers keep only their inputs for the backward and recompute the expert pre-activations there "
        "(one more [T*K, 2F] GEMM per layer) instead of holding [T*K, 2F] per layer from forward to backward "
        "(~78 GB at the 30B shape and T = 64k in bf16); same numerics")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(bool(self.name), "model.name", "a preset name or a path", self.name)


@dataclass(frozen=True, kw_only=True)
class TasksSection:
    source: str = _field("builtin", "'builtin' for the repo's suite, or a directory of Harbor/Terminal-Bench tasks")
    families: tuple[str, ...] = _field((), "seeded task families to train on; empty = every built-in family")
    num_per_family: int = _field(24, "training (SFT) instances synthesized per family, from seed block train_seed")
    num_heldout_per_family: int = _field(8, "held-out instances per family, from seed block heldout_seed")
    num_rl_per_family: int = _field(
        16, "RL instances per family, from seed block rl_seed: instances the warm start never saw; 0 = RL on the "
        "SFT instances")
    rl_fixed_tasks: bool = _field(
        False, "RL also practises the fixed train tasks (SFT'd already; long multi-turn episodes whose many "
        "sampled tokens weigh heavily in a step's loss); false = RL on the unseen family instances only")
    train_seed: int = _field(0, "seed block of the training instances (block b draws seeds b*100000, b*100000+1, ...)")
    rl_seed: int = _field(1, "seed block of the RL instances (train split, so it must differ from train_seed)")
    heldout_seed: int = _field(100_000, "seed block of the held-out instances (held-out split)")
    base_image_overrides: tuple[str, ...] = _field(
        (), "'PATTERN=IMAGE' pairs mapping a Dockerfile FROM (glob, e.g. 'debian:*') onto a local image")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(bool(self.source), "tasks.source", "'builtin' or a directory", self.source)
        _check(self.num_per_family >= 1, "tasks.num_per_family", ">= 1", self.num_per_family)
        _check(self.num_heldout_per_family >= 0, "tasks.num_heldout_per_family", ">= 0",
               self.num_heldout_per_family)
        _check(self.num_rl_per_family >= 0, "tasks.num_rl_per_family", ">= 0", self.num_rl_per_family)
        for name in ("train_seed", "rl_seed", "heldout_seed"):
            _check(getattr(self, name) >= 0, f"tasks.{name}", ">= 0", getattr(self, name))
        # Both are train-split blocks: one block would give the RL the SFT instances again.
        _check(self.num_rl_per_family == 0 or self.rl_seed != self.train_seed, "tasks.rl_seed",
               "a seed block other than tasks.train_seed", self.rl_seed)
        for pair in self.base_image_overrides:
            pattern, sep, image = pair.partition("=")
            _check(bool(sep and pattern and image), "tasks.base_image_overrides", "'PATTERN=IMAGE' items", pair)

    def base_image_map(self) -> dict[str, str]:
        """The overrides as {pattern: image}, in the given order."""
        return dict(pair.split("=", 1) for pair in self.base_image_overrides)


@dataclass(frozen=True, kw_only=True)
class SandboxSection:
    cpus: float | None = _field(
        None, "CPU quota of every sandbox container; none = each task's own [environment] cpus (task.toml; 1 when "
        "it sets none; the built-in tasks ask for 1)")
    memory_mb: int | None = _field(
        None, "memory limit of every sandbox container in MiB, swap included; none = each task's own [environment] "
        "memory_mb (2048 when it sets none; the built-in families ask for 512, the fixed tasks for 1024)")
    pids: int = _field(256, "process limit per sandbox container (a fork bomb stops there)")
    command_timeout_s: float = _field(10.0, "wall-clock limit of one agent command; it is killed after that")
    output_cap_bytes: int = _field(
        16384, "bytes of a command's output shown to the agent: its first and last halves, the middle cut")
    pool_size: int = _field(4, "sandboxes kept started ahead of need, per environment (image and limits); never "
                                  "more than the episodes it still has to serve")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.cpus is None or self.cpus > 0, "sandbox.cpus", "> 0 or none", self.cpus)
        _check(self.memory_mb is None or self.memory_mb >= 16, "sandbox.memory_mb", ">= 16 or none", self.memory_mb)
        # 16 and 256 mirror sandbox.docker_sandbox.MIN_PIDS / MIN_OUTPUT_CAP (importing the sandbox package here
        # would load the Docker SDK for every config parse; tests/test_config.py checks that they agree).
        _check(self.pids >= 16, "sandbox.pids", ">= 16 (the shell machinery needs a few)", self.pids)
        _check(self.command_timeout_s > 0, "sandbox.command_timeout_s", "> 0", self.command_timeout_s)
        _check(self.output_cap_bytes >= 256, "sandbox.output_cap_bytes", ">= 256", self.output_cap_bytes)
        _check(self.pool_size >= 1, "sandbox.pool_size", ">= 1", self.pool_size)


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    episodes_per_step: int = _field(16, "episodes collected per RL step")
    group_size: int = _field(
        4, "episodes per task instance in a step (episodes_per_step / group_size instances, each sampled "
        "group_size times); with algo.advantage_norm='group' the episodes of one instance are each other's baseline")
    concurrency: int = _field(8, "episodes run at once (each holds one sandbox and one engine slot)")
    max_turns: int = _field(6, "assistant turns per episode before it is cut")
    max_new_tokens_per_turn: int = _field(
        384, "tokens sampled per assistant turn at most (a cut reply is an unclosed tool call: keep it above the "
        "longest reference reply, 323 tokens in the built-in suite; the trainer warns when SFT teaches longer ones)")
    max_tokens: int = _field(2048, "token budget of an episode: prompt, replies and observations together")
    wall_clock_limit_s: float = _field(120.0, "wall-clock limit of one episode, verification excluded")
    temperature: float = _field(1.0, "sampling temperature (log-probs for training use the same one)")
    top_p: float = _field(1.0, "nucleus sampling mass; 1.0 = off")
    batch_invariant: bool = _field(
        True, "CPU engine: each token's sample, log-prob and routing independent of what the engine batched beside "
        "it, so a seeded run at any concurrency is bit for bit (t1kernels.rows); costs decode speed; false = plain "
        "products")
    engine: Literal["torch", "vllm"] = _field(
        "torch", "rollout engine: 'torch' (the built-in TorchEngine, any device) or 'vllm' (vLLM's AsyncLLM on "
        "CUDA with routed-experts capture; settings in [vllm]; needs pip install -e '.[gpu]')")

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("episodes_per_step", "concurrency", "max_turns", "max_new_tokens_per_turn"):
            _check(getattr(self, name) >= 1, f"rollout.{name}", ">= 1", getattr(self, name))
        _check(self.group_size >= 1 and self.episodes_per_step % self.group_size == 0, "rollout.group_size",
               f">= 1 and a divisor of episodes_per_step ({self.episodes_per_step})", self.group_size)
        _check(self.max_tokens > self.max_new_tokens_per_turn, "rollout.max_tokens",
               f"> max_new_tokens_per_turn ({self.max_new_tokens_per_turn})", self.max_tokens)
        _check(self.wall_clock_limit_s > 0, "rollout.wall_clock_limit_s", "> 0", self.wall_clock_limit_s)
        _check(self.temperature > 0, "rollout.temperature", "> 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.engine != "vllm" or self.top_p == 1, "rollout.top_p",
               "1.0 with rollout.engine='vllm' (vLLM's log-prob of a top-p sample is renormalised, T1's is not)",
               self.top_p)


@dataclass(frozen=True, kw_only=True)
class ContextSection:
    compaction: Literal["off", "extractive", "policy"] = _field(
        "off", "fold the history when a context reaches 0.8 x rollout.max_tokens (the task, a summary, the last "
        "keep_turns turns verbatim) and go on in the new context, each context trained as a segment sharing the "
        "episode's reward; the summary is 'extractive' (each command, exit code, first output line; deterministic) "
        "or written by the 'policy' (not trained on); rollout.max_tokens then bounds each context, not the episode; "
        "'off': the episode ends at rollout.max_tokens")
    keep_turns: int = _field(4, "turns a compacted context keeps verbatim after the summary")
    observation_max_tokens: int | None = _field(
        None, "tokens of a command's output the agent is shown (head and tail, a marker between); none = no cap "
        "beyond sandbox.output_cap_bytes")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.keep_turns >= 1, "context.keep_turns", ">= 1", self.keep_turns)
        _check(self.observation_max_tokens is None or self.observation_max_tokens >= 16,
               "context.observation_max_tokens", ">= 16 or none", self.observation_max_tokens)


@dataclass(frozen=True, kw_only=True)
class VllmSection:
    """Settings of the vLLM rollout engine (read only with rollout.engine='vllm')."""

    placement: Literal["colocated", "disaggregated"] = _field(
        "colocated", "'colocated': vLLM shares the trainer's GPUs (CUDA IPC weight transfer, sleep mode); "
        "'disaggregated': vLLM on GPUs of its own (NCCL weight transfer from the trainer)")
    tensor_parallel_size: int = _field(1, "GPUs one vLLM instance spreads the model over (tensor parallel)")
    gpu_memory_utilization: float = _field(
        0.5, "fraction of each GPU vLLM may take for weights and KV cache (colocated: leave the trainer its share)")
    max_model_len: int | None = _field(
        None, "longest sequence vLLM serves; none = rollout.max_tokens + rollout.max_new_tokens_per_turn + 8")
    enforce_eager: bool = _field(False, "no CUDA graphs (faster start, slower decode)")
    dtype: Literal["bfloat16", "float16", "float32"] = _field("bfloat16", "vLLM's weight dtype")
    executor: Literal["mp", "ray"] = _field(
        "mp", "where vLLM's workers run: 'mp' vLLM's local executor, on the owning trainer rank's node (colocated: "
        "its GPU; disaggregated: GPUs no trainer rank holds); 'ray' (disaggregated) vLLM's Ray executor, on a Ray "
        "cluster started beforehand, e.g. engine nodes of their own (pip install ray)")
    nccl_address: str = _field("127.0.0.1", "disaggregated: address of the trainer-vLLM NCCL rendezvous")
    nccl_port: int = _field(29650, "disaggregated: port of the trainer-vLLM NCCL rendezvous")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.tensor_parallel_size >= 1, "vllm.tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        # CUDA IPC hands vLLM handles to the trainer's one GPU: every vLLM worker must live on it.
        _check(self.placement == "disaggregated" or self.tensor_parallel_size == 1, "vllm.tensor_parallel_size",
               "1 with vllm.placement='colocated' (more GPUs: placement='disaggregated')", self.tensor_parallel_size)
        _check(0 < self.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.max_model_len is None or self.max_model_len >= 3, "vllm.max_model_len", ">= 3 or none",
               self.max_model_len)
        _check(1 <= self.nccl_port < 65536, "vllm.nccl_port", "in [1, 65535]", self.nccl_port)
        _check(self.executor == "mp" or self.placement == "disaggregated", "vllm.executor",
               "'mp' with vllm.placement='colocated' (a colocated engine shares its trainer rank's GPU)", self.executor)


@dataclass(frozen=True, kw_only=True)
class AlgoSection:
    gamma: float = _field(1.0, "discount per sampled token in GAE")
    gae_lambda: float = _field(1.0, "GAE lambda of the policy's advantages")
    critic_lambda: float = _field(
        1.0, "GAE lambda of the critic's value targets (decoupled from the policy's, as in VAPO; 1.0 = the "
        "Monte-Carlo return, which stays unbiased however poor the critic still is)")
    clip_eps: float = _field(0.2, "PPO ratio clip: ratios outside [1-eps, 1+eps] get no gradient")
    value_clip_eps: float | None = _field(0.2, "value clip around the rollout-time values; none = unclipped")
    vf_coef: float = _field(0.5, "weight of the value loss")
    entropy_coef: float = _field(0.0, "weight of the entropy bonus; 0 = reported only")
    kl_coef: float = _field(0.1, "weight of the k3 KL penalty to the warm-started reference policy; 0 = off")
    tis_cap: float | None = _field(2.0, "truncated importance sampling cap on pi_old/pi_rollout; none = off")
    icepop: tuple[float, float] | None = _field(
        None, "mask tokens whose pi_old/pi_rollout leaves [lo, hi], e.g. [0.5, 5.0]; none = off")
    outcome_bonus: float = _field(1.0, "reward added when every verifier passes (on top of the verifier count)")
    turn_penalty: float = _field(0.0, "reward subtracted per assistant turn (>= 0); 0 = off")
    format_penalty: float = _field(0.0, "reward subtracted per reply without a parsable tool call (>= 0); 0 = off")
    cut_episodes: Literal["bootstrap", "terminal", "mask"] = _field(
        "bootstrap", "how an episode cut by rollout.max_turns, the token budget or the wall clock trains: 'bootstrap' "
        "(no outcome yet: its return is the critic's value at the cut), 'terminal' (scored where it stopped, as "
        "finished ones), 'mask' (left out of the update)")
    use_tito: bool = _field(True, "train on the exact sampled token IDs (false: re-tokenize the transcript)")
    use_r3: bool = _field(True, "replay the rollout's expert routing in every training forward")
    bitwise: Literal["auto", "on", "off"] = _field(
        "auto", "'on': the trainer's policy forward runs the batch-invariant engine's products, attention and "
        "log-softmax (t1kernels.rows), so its log-probs and routing equal the rollout's bit for bit; every step checks "
        "mismatch/max_abs == 0 and stops the run at the first token that differs. Needs run.device='cpu', "
        "model.dtype='float32', rollout.engine='torch', rollout.batch_invariant and algo.use_tito (GPU plan: "
        "ARCHITECTURE.md). 'auto': 'on' where those hold, else 'off'")
    advantage_norm: AdvantageNorm = _field(
        "group", "per-step advantage normalisation: 'center' subtracts the token mean, 'group' subtracts the "
        "token mean of the episodes of the same task instance (needs rollout.group_size >= 2: tokens the "
        "episodes share then get no net push, the ones that differ carry the signal), 'whiten' also divides by "
        "the std (a step whose episodes all scored alike then gets a full-size update from critic noise alone), "
        "'none' keeps GAE's raw advantages")
    negative_adv_scale: float = _field(
        0.0, "multiplier of negative advantages after normalisation (1 = plain PPO; 0 = only episodes better than "
        "their group push, so a failed near-miss, whose tokens were mostly right, pushes nothing down)")
    skip_flat_steps: bool = _field(
        True, "no actor update in a step whose episodes all got the same reward: its advantages hold nothing but "
        "the critic's error (the critic still trains on it)")
    skip_flat_groups: bool = _field(
        True, "no policy-gradient push from the episodes of a task instance whose group (>= 2 episodes) all got "
        "the same reward (half of the tiny default's groups): with the group as baseline their advantages are the "
        "critic's error alone, and with negative_adv_scale < 1 the positive half of that error is kept, a push up "
        "on whatever was sampled. The critic still trains on them, the KL term still applies, and a step with no "
        "other group takes no actor step")
    critic_only_iterations: int = _field(
        2, "RL steps that update only the critic before the first actor update (the critic's warm start)")
    ppo_epochs: int = _field(1, "passes over each step's batch")
    minibatch_tokens: int = _field(2048, "tokens per optimizer step (whole trajectories are packed)")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(0 < self.gamma <= 1, "algo.gamma", "in (0, 1]", self.gamma)
        _check(0 <= self.gae_lambda <= 1, "algo.gae_lambda", "in [0, 1]", self.gae_lambda)
        _check(0 <= self.critic_lambda <= 1, "algo.critic_lambda", "in [0, 1]", self.critic_lambda)
        _check(0 < self.clip_eps < 1, "algo.clip_eps", "in (0, 1)", self.clip_eps)
        _check(self.value_clip_eps is None or self.value_clip_eps > 0, "algo.value_clip_eps", "> 0 or none",
               self.value_clip_eps)
        for name in ("vf_coef", "entropy_coef", "kl_coef", "outcome_bonus", "turn_penalty", "format_penalty"):
            _check(getattr(self, name) >= 0, f"algo.{name}", ">= 0", getattr(self, name))
        _check(self.tis_cap is None or self.tis_cap >= 1, "algo.tis_cap", ">= 1 or none", self.tis_cap)
        _check(self.icepop is None or 0 < self.icepop[0] < 1 < self.icepop[1], "algo.icepop",
               "[lo, hi] with 0 < lo < 1 < hi, or none", self.icepop)
        _check(self.critic_only_iterations >= 0, "algo.critic_only_iterations", ">= 0", self.critic_only_iterations)
        _check(0 <= self.negative_adv_scale <= 1, "algo.negative_adv_scale", "in [0, 1]", self.negative_adv_scale)
        _check(self.ppo_epochs >= 1, "algo.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(self.minibatch_tokens >= 1, "algo.minibatch_tokens", ">= 1", self.minibatch_tokens)


@dataclass(frozen=True, kw_only=True)
class WarmstartSection:
    pretrain_steps: int = _field(
        300, "base pretraining steps of a from-scratch model (a preset such as 'tiny') on synthetic instruction -> "
        "tool-call text from the built-in families, before SFT (see t1core/pretrain.py); 0 = off; a model loaded "
        "from a checkpoint is never pretrained")
    pretrain_lr: float = _field(1e-3, "learning rate of base pretraining")
    pretrain_row_tokens: int = _field(2048, "tokens per pretraining step (whole instruction/command pairs)")
    pretrain_seed_block: int = _field(
        2, "seed block of the pretraining corpus (train split; must differ from tasks.train_seed and tasks.rl_seed)")
    sft_enabled: bool = _field(True, "supervised fine-tuning on reference-solution transcripts before RL")
    sft_epochs: int = _field(4, "passes over the SFT transcripts")
    sft_max_steps: int | None = _field(None, "stop SFT after this many optimizer steps; none = run all epochs")
    sft_lr: float = _field(1e-3, "SFT learning rate of the actor")
    sft_lr_decay: bool = _field(
        True, "decay the SFT learning rate linearly to 0 over its optimizer steps (after the warmup), so that the "
        "last minibatches leave no mark of their own; false = constant")
    sft_minibatch_tokens: int = _field(4096, "tokens per SFT optimizer step (separate from algo.minibatch_tokens)")
    verify_references: bool = _field(
        False, "run the verifiers on every reference transcript and drop those that fail (slower; the test "
        "suite already checks every built-in reference solution)")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.pretrain_steps >= 0, "warmstart.pretrain_steps", ">= 0", self.pretrain_steps)
        _check(self.pretrain_lr > 0, "warmstart.pretrain_lr", "> 0", self.pretrain_lr)
        _check(self.pretrain_row_tokens >= 64, "warmstart.pretrain_row_tokens", ">= 64", self.pretrain_row_tokens)
        _check(self.pretrain_seed_block >= 0, "warmstart.pretrain_seed_block", ">= 0", self.pretrain_seed_block)
        _check(self.sft_epochs >= 1, "warmstart.sft_epochs", ">= 1", self.sft_epochs)
        _check(self.sft_max_steps is None or self.sft_max_steps >= 1, "warmstart.sft_max_steps", ">= 1 or none",
               self.sft_max_steps)
        _check(self.sft_lr > 0, "warmstart.sft_lr", "> 0", self.sft_lr)
        _check(self.sft_minibatch_tokens >= 1, "warmstart.sft_minibatch_tokens", ">= 1", self.sft_minibatch_tokens)


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr_actor: float = _field(1e-4, "AdamW learning rate of the policy in RL")
    lr_critic: float = _field(1e-3, "AdamW learning rate of the critic")
    betas: tuple[float, float] = _field((0.9, 0.95), "AdamW betas")
    weight_decay: float = _field(0.0, "AdamW decoupled weight decay")
    grad_clip: float | None = _field(1.0, "global grad-norm clip per model; none = off")
    warmup_steps: int = _field(
        10, "linear LR warmup in optimizer steps (Adam's first steps move every weight by ~lr whatever its gradient)")
    actor_lr_decay: bool = _field(
        True, "decay the actor's RL learning rate linearly towards 0 over run.steps (by RL step, times the warmup): "
        "the last steps' episodes then leave no mark of their own, as the SFT decay does for its last minibatches")
    actor_frozen: tuple[str, ...] = _field(
        (), "policy parameters RL leaves as warm-started: fnmatch patterns over parameter names, e.g. "
        "['lm_head.*', 'model.embed_tokens.*'] or ['*.mlp.gate.*'] (the routers); pretraining and SFT train them "
        "all; a pattern that matches nothing is an error")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(all(self.actor_frozen), "optim.actor_frozen", "non-empty patterns", self.actor_frozen)
        _check(self.lr_actor > 0, "optim.lr_actor", "> 0", self.lr_actor)
        _check(self.lr_critic > 0, "optim.lr_critic", "> 0", self.lr_critic)
        _check(all(0 <= b < 1 for b in self.betas), "optim.betas", "two values in [0, 1)", self.betas)
        _check(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        _check(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", "> 0 or none", self.grad_clip)
        _check(self.warmup_steps >= 0, "optim.warmup_steps", ">= 0", self.warmup_steps)


@dataclass(frozen=True, kw_only=True)
class RunSection:
    seed: int = _field(0, "seed of every generator of the run (model init, sampling, task order)")
    steps: int = _field(24, "RL steps (critic-only iterations included)")
    eval_every: int = _field(0, "held-out evaluation every N RL steps; 0 = only before and after RL")
    eval_temperature: float = _field(0.0, "sampling temperature of held-out evaluation; 0 = greedy (pass@1)")
    eval_samples: int = _field(
        2, "held-out family instances are also sampled this many times each at rollout.temperature (the sampled "
        "success is the mean over them, with the same sampling seeds before and after RL); 0 = only the "
        "evaluation at eval_temperature")
    device: str = _field("cpu", "'cpu', 'cuda' or 'cuda:N'")
    checkpoint_every: int = _field(3, "checkpoint every N RL steps (the final step is always saved); 0 = final only")
    routing_agreement_every: int = _field(
        4, "measure fidelity/routing_agreement (how often the trainer's own router picks the replayed experts) every "
        "N RL steps: it costs one more policy forward per minibatch; 0 = never")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.steps >= 0, "run.steps", ">= 0", self.steps)
        _check(self.eval_every >= 0, "run.eval_every", ">= 0", self.eval_every)
        _check(self.eval_temperature >= 0, "run.eval_temperature", ">= 0", self.eval_temperature)
        _check(self.eval_samples >= 0, "run.eval_samples", ">= 0", self.eval_samples)
        _check(bool(_DEVICE_RE.match(self.device)), "run.device", "'cpu', 'cuda' or 'cuda:N'", self.device)
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", ">= 0", self.checkpoint_every)
        _check(self.routing_agreement_every >= 0, "run.routing_agreement_every", ">= 0", self.routing_agreement_every)


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    nodes: int = _field(1, "nodes the run is planned for (python -m t1core.plan); torchrun sets the real ranks")
    gpus_per_node: int = _field(1, "GPUs (ranks) per node the run is planned for (python -m t1core.plan)")
    gpu_mem_gib: float = _field(140.0, "memory of one GPU in GiB the plan must fit (H200: 140)")
    host_mem_gib: float = _field(
        1800.0, "host memory per node in GiB the plan must fit (what parallel.cpu_offload moves there)")
    activation_checkpointing: bool = _field(
        False, "recompute each decoder layer's activations in the backward (torch.utils.checkpoint per layer): "
        "only the layers' inputs stay alive between forward and backward")
    cpu_offload: bool = _field(
        False, "FSDP2 CPUOffloadPolicy on sharded runs: sharded parameters, gradients and AdamW state live in host "
        "memory; each layer is copied to the GPU around its use")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.nodes >= 1, "parallel.nodes", ">= 1", self.nodes)
        _check(self.gpus_per_node >= 1, "parallel.gpus_per_node", ">= 1", self.gpus_per_node)
        _check(self.gpu_mem_gib > 0, "parallel.gpu_mem_gib", "> 0", self.gpu_mem_gib)
        _check(self.host_mem_gib > 0, "parallel.host_mem_gib", "> 0", self.host_mem_gib)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    tasks: TasksSection = field(default_factory=TasksSection)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    context: ContextSection = field(default_factory=ContextSection)
    vllm: VllmSection = field(default_factory=VllmSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    warmstart: WarmstartSection = field(default_factory=WarmstartSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def __post_init__(self) -> None:
        _check_types(self)
        # Minibatches pack whole trajectories, so the longest one must fit in one.
        _check(self.algo.minibatch_tokens >= self.rollout.max_tokens, "algo.minibatch_tokens",
               f">= rollout.max_tokens ({self.rollout.max_tokens})", self.algo.minibatch_tokens)
        _check(self.warmstart.sft_minibatch_tokens >= self.rollout.max_tokens, "warmstart.sft_minibatch_tokens",
               f">= rollout.max_tokens ({self.rollout.max_tokens})", self.warmstart.sft_minibatch_tokens)
        _check(self.algo.advantage_norm != "group" or self.rollout.group_size >= 2, "algo.advantage_norm",
               "'group' only with rollout.group_size >= 2 (a lone episode would be its own baseline)",
               self.algo.advantage_norm)
        needs = {"run.device": (self.run.device, "cpu"), "model.dtype": (self.model.dtype, "float32"),
                 "rollout.engine": (self.rollout.engine, "torch"),
                 "rollout.batch_invariant": (self.rollout.batch_invariant, True),
                 "algo.use_tito": (self.algo.use_tito, True)}
        if self.algo.bitwise == "on":
            for name, (got, want) in needs.items():
                _check(got == want, name, f"{want!r} with algo.bitwise='on' (bit-equal log-probs are built for the "
                       "CPU engine; set algo.bitwise='off')", got)
        elif self.algo.bitwise == "auto":  # resolved here, so the run's config.toml says what ran
            on = all(got == want for got, want in needs.values())
            object.__setattr__(self, "algo", dataclasses.replace(self.algo, bitwise="on" if on else "off"))
        w, t = self.warmstart, self.tasks
        _check(w.pretrain_steps == 0 or w.pretrain_seed_block not in (t.train_seed, t.rl_seed),
               "warmstart.pretrain_seed_block", "a seed block other than tasks.train_seed and tasks.rl_seed",
               w.pretrain_seed_block)


def _sections() -> dict[str, type]:
    return typing.get_type_hints(RunConfig)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """A TOML value (or a string from the command line) converted to the field type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value.strip() if isinstance(value, str) else value  # membership is checked by __post_init__
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is tuple:
        if isinstance(value, str):
            text = value.strip().strip("[]()").strip()
            value = [] if not text else [item.strip().strip("'\"") for item in text.split(",")]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(value)} ({value!r})")
        return tuple(_coerce(v, t, where) for v, t in zip(value, item_types))
    if isinstance(value, str) and tp is not str:
        return _parse_scalar(value, tp, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value  # type errors are reported by the section's __post_init__


def _parse_scalar(text: str, tp: Any, where: str) -> Any:
    text = text.strip()
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{where}: expected a bool (true/false), got {text!r}")
    try:
        return tp(text)
    except ValueError:
        raise ValueError(f"{where}: expected {_type_name(tp)}, got {text!r}") from None


def _build(raw: dict[str, dict[str, Any]]) -> RunConfig:
    sections = {}
    for name, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        values = {key: _coerce(v, hints[key], f"{name}.{key}") for key, v in raw.get(name, {}).items()}
        sections[name] = cls(**values)
    return RunConfig(**sections)


def _check_keys(raw: dict[str, Any], origin: str) -> None:
    sections = _sections()
    for name, values in raw.items():
        if name not in sections:
            raise ValueError(f"{origin}: unknown section {name!r}; valid sections: {sorted(sections)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: expected [{name}] to be a table, got {values!r}")
        valid = [f.name for f in dataclasses.fields(sections[name])]
        for key in values:
            if key not in valid:
                raise ValueError(f"{origin}: unknown key {name}.{key}; valid keys of [{name}]: {valid}")


def parse_override(arg: str) -> tuple[str, str, str]:
    """'--section.key=value' -> (section, key, value); the value stays a string until it meets its field."""
    match = re.fullmatch(r"--([A-Za-z_]\w*)\.([A-Za-z_]\w*)=(.*)", arg, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"override: expected '--section.key=value', got {arg!r}")
    return match.group(1), match.group(2), match.group(3)


def load_config(toml_path: str | None, overrides: list[str]) -> RunConfig:
    """The embedded defaults, updated by a TOML file (if given), then by `--section.key=value` overrides."""
    raw: dict[str, dict[str, Any]] = {}
    if toml_path is not None:
        with open(toml_path, "rb") as f:
            raw = tomllib.load(f)
        _check_keys(raw, toml_path)
    for arg in overrides:
        section, key, value = parse_override(arg)
        _check_keys({section: {key: value}}, arg)
        raw.setdefault(section, {})[key] = value
    return _build(raw)


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form; always has '.', 'e' or is inf/nan
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"config value of unsupported type {type(value).__name__}: {value!r}")


def config_to_toml(cfg: RunConfig) -> str:
    """TOML text that `load_config` reads back to an equal config; each key carries its help as a comment."""
    lines: list[str] = []
    for name in _sections():
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in dataclasses.fields(section):
            lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _display(value: Any) -> str:
    return "none" if value is None else _toml_value(value)


def format_config(cfg: RunConfig, *, with_help: bool = False) -> str:
    """One 'section.key = value' line per field, for printing at the start of a run."""
    rows = [(f"{name}.{f.name}", _display(getattr(getattr(cfg, name), f.name)), f.metadata["help"])
            for name in _sections() for f in dataclasses.fields(getattr(cfg, name))]
    width = max(len(key) for key, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    if with_help:
        return "\n".join(f"{k:<{width}} = {v:<{value_width}}  # {h}" for k, v, h in rows)
    return "\n".join(f"{k:<{width}} = {v}" for k, v, _ in rows)
