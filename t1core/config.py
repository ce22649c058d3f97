"""The one typed config tree of a T1 run: `RunConfig`, composed of sections (frozen keyword-only dataclasses,
`t1config.schema`). Each component defines its own section beside its code: [sandbox] in
`sandbox.runtime.settings`, [rollout], [context] and [vllm] in `rollout.config`; the trainer's own sections are
here. Reading and writing TOML and `--section.key=value` overrides live in `t1core.config_toml`.

Every field carries its help text in `metadata["help"]` (printed by `format_config(cfg, with_help=True)` and
written as a comment above each key by `config_to_toml`). The defaults ARE the embedded default run: the tiny
model on the built-in tasks, sized for a 2-core CPU. Optional fields take the string "none" in TOML and on
the command line (TOML has no null). Values that depend on other fields ('auto') are resolved by `resolved`
into a copy; a config is never changed after construction.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout.config import ContextSection, RolloutSection, VllmSection
from sandbox.runtime.settings import SandboxSection  # plain values: no Docker SDK is loaded
from t1config import check, check_types, knob

__all__ = ["AlgoSection", "ContextSection", "EvalSection", "ModelSection", "OptimSection", "ParallelSection",
           "RolloutSection", "RunConfig", "RunSection", "SandboxSection", "TasksSection", "VllmSection",
           "WarmstartSection", "num_fields", "resolved", "sections"]

Dtype = Literal["float32", "bfloat16", "float16"]
ActorPush = Literal["group_positive", "group", "center", "whiten", "raw"]
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    name: str = knob("tiny", "model preset name (e.g. 'tiny') or path to a HF Qwen3-MoE checkpoint directory")
    dtype: Dtype = knob(
        "float32", "parameter/compute dtype; on CUDA use bfloat16: float32 sends the MoE and log-prob kernels down "
        "their IEEE fp32 path (no tensor cores), and the run says so in its first lines")
    moe_recompute: bool = knob(
        False, "MoE layers keep only their inputs for the backward and recompute the expert pre-activations there "
        "(one more [T*K, 2F] GEMM per layer) instead of holding [T*K, 2F] per layer from forward to backward "
        "(~78 GB at the 30B shape and T = 64k in bf16); same numerics")

    def __post_init__(self) -> None:
        check_types(self)
        check(bool(self.name), "model.name", "a preset name or a path", self.name)


@dataclass(frozen=True, kw_only=True)
class TasksSection:
    source: str = knob("builtin", "'builtin' for the repo's suite, or a directory of Harbor/Terminal-Bench tasks")
    families: tuple[str, ...] = knob(
        (), "seeded task families to train on; empty = every built-in family but the long ones (sandbox.tasks.families."
        "LONG_FAMILIES, e.g. follow_chain: named here to be used)")
    num_per_family: int = knob(24, "training (SFT) instances synthesized per family (seed block SeedBlock.TRAIN)")
    num_heldout_per_family: int = knob(8, "held-out instances per family (seed block SeedBlock.HELDOUT)")
    num_rl_per_family: int = knob(
        16, "RL instances per family (seed block SeedBlock.RL): instances the warm start never saw; 0 = RL on the "
        "SFT instances")
    fixed_tasks: Literal["on", "rl", "off"] = knob(
        "on", "the built-in fixed tasks (tasks/fixed/): 'on' they join the families, their train split in SFT and "
        "their held-out split in the evaluation, RL practising the unseen family instances only; 'rl' RL also "
        "practises their train split (SFT'd already; long multi-turn episodes whose many sampled tokens weigh heavily "
        "in a step's loss); 'off' the families alone (e.g. a long-horizon family on its own)")
    base_image_overrides: tuple[str, ...] = knob(
        (), "'PATTERN=IMAGE' pairs mapping a Dockerfile FROM (glob, e.g. 'debian:*') onto a local image")
    decontaminate_against: tuple[str, ...] = knob(
        (), "directories of evaluation tasks the training tasks (SFT and RL) must not overlap (as eval.source's may "
        "not): the same name or instruction, a shared 13-token instruction span, 5-gram Jaccard >= 0.5 or an "
        "identical task-specific file (python -m sandbox.decontaminate lists them all); tasks.decontaminate says what "
        "then happens")
    decontaminate: Literal["refuse", "warn", "drop"] = knob(
        "refuse", "when training tasks overlap evaluation tasks (eval.source, tasks.decontaminate_against): 'refuse' "
        "to start (one line naming the pairs and the rule that fired), 'warn' and train on them, or 'drop' the "
        "overlapping training tasks and go on")

    def __post_init__(self) -> None:
        check_types(self)
        check(bool(self.source), "tasks.source", "'builtin' or a directory", self.source)
        check(self.num_per_family >= 1, "tasks.num_per_family", ">= 1", self.num_per_family)
        check(self.num_heldout_per_family >= 0, "tasks.num_heldout_per_family", ">= 0",
              self.num_heldout_per_family)
        check(self.num_rl_per_family >= 0, "tasks.num_rl_per_family", ">= 0", self.num_rl_per_family)
        for pair in self.base_image_overrides:
            pattern, sep, image = pair.partition("=")
            check(bool(sep and pattern and image), "tasks.base_image_overrides", "'PATTERN=IMAGE' items", pair)

    def base_image_map(self) -> dict[str, str]:
        """The overrides as {pattern: image}, in the given order."""
        return dict(pair.split("=", 1) for pair in self.base_image_overrides)


@dataclass(frozen=True, kw_only=True)
class AlgoSection:
    gamma: float = knob(1.0, "discount per sampled token in GAE")
    gae_lambda: float = knob(1.0, "GAE lambda of the policy's advantages")
    critic_lambda: float = knob(
        1.0, "GAE lambda of the critic's value targets (decoupled from the policy's, as in VAPO; 1.0 = the "
        "Monte-Carlo return, which stays unbiased however poor the critic still is)")
    clip_eps: float = knob(0.2, "PPO ratio clip: ratios outside [1-eps, 1+eps] get no gradient")
    value_clip_eps: float | None = knob(0.2, "value clip around the rollout-time values; none = unclipped")
    vf_coef: float = knob(0.5, "weight of the value loss")
    entropy_coef: float = knob(0.0, "weight of the entropy bonus; 0 = reported only")
    kl_coef: float = knob(0.1, "weight of the k3 KL penalty to the warm-started reference policy; 0 = off")
    tis_cap: float | None = knob(2.0, "truncated importance sampling cap on pi_old/pi_rollout; none = off")
    icepop: tuple[float, float] | None = knob(
        None, "mask tokens whose pi_old/pi_rollout leaves [lo, hi], e.g. [0.5, 5.0]; none = off")
    outcome_bonus: float = knob(1.0, "reward added when every verifier passes (on top of the verifier count)")
    turn_penalty: float = knob(0.0, "reward subtracted per assistant turn (>= 0); 0 = off")
    format_penalty: float = knob(0.0, "reward subtracted per reply without a parsable tool call (>= 0); 0 = off")
    cut_episodes: Literal["bootstrap", "terminal", "mask"] = knob(
        "bootstrap", "how an episode cut by rollout.max_turns, the token budget or the wall clock trains: 'bootstrap' "
        "(no outcome yet: its return is the critic's value at the cut, the actor-critic way), 'terminal' (scored by "
        "its verifiers where it stopped, as finished ones), 'mask' (left out of the update)")
    bitwise: Literal["auto", "on", "off"] = knob(
        "auto", "'on': the trainer's policy forward runs the batch-invariant engine's products, attention and "
        "log-softmax (t1kernels.rows), so its log-probs and routing equal the rollout's bit for bit; every step checks "
        "mismatch/max_abs == 0 and stops the run at the first token that differs. Needs run.device='cpu', "
        "model.dtype='float32', rollout.engine='torch' and rollout.batch_invariant (GPU plan: ARCHITECTURE.md). "
        "'auto': 'on' where those hold, else 'off' (resolved into the run's copy of the config: `resolved`)")
    actor_push: ActorPush = knob(
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
    ppo_epochs: int = knob(1, "passes over each step's batch")
    minibatch_tokens: int = knob(2048, "tokens per optimizer step (whole trajectories are packed)")

    def __post_init__(self) -> None:
        check_types(self)
        check(0 < self.gamma <= 1, "algo.gamma", "in (0, 1]", self.gamma)
        check(0 <= self.gae_lambda <= 1, "algo.gae_lambda", "in [0, 1]", self.gae_lambda)
        check(0 <= self.critic_lambda <= 1, "algo.critic_lambda", "in [0, 1]", self.critic_lambda)
        check(0 < self.clip_eps < 1, "algo.clip_eps", "in (0, 1)", self.clip_eps)
        check(self.value_clip_eps is None or self.value_clip_eps > 0, "algo.value_clip_eps", "> 0 or none",
              self.value_clip_eps)
        for name in ("vf_coef", "entropy_coef", "kl_coef", "outcome_bonus", "turn_penalty", "format_penalty"):
            check(getattr(self, name) >= 0, f"algo.{name}", ">= 0", getattr(self, name))
        check(self.tis_cap is None or self.tis_cap >= 1, "algo.tis_cap", ">= 1 or none", self.tis_cap)
        check(self.icepop is None or 0 < self.icepop[0] < 1 < self.icepop[1], "algo.icepop",
              "[lo, hi] with 0 < lo < 1 < hi, or none", self.icepop)
        check(self.ppo_epochs >= 1, "algo.ppo_epochs", ">= 1", self.ppo_epochs)
        check(self.minibatch_tokens >= 1, "algo.minibatch_tokens", ">= 1", self.minibatch_tokens)


@dataclass(frozen=True, kw_only=True)
class WarmstartSection:
    pretrain_steps: int = knob(
        300, "base pretraining steps of a from-scratch model (a preset such as 'tiny') on synthetic instruction -> "
        "tool-call text from the built-in families, before SFT (see t1core/pretrain.py); 0 = off; a model loaded "
        "from a checkpoint is never pretrained")
    pretrain_lr: float = knob(1e-3, "learning rate of base pretraining")
    pretrain_row_tokens: int = knob(2048, "tokens per pretraining step (whole instruction/command pairs)")
    sft_epochs: int = knob(
        4, "passes of supervised fine-tuning over the reference-solution transcripts before RL; 0 = no SFT")
    sft_max_steps: int | None = knob(None, "stop SFT after this many optimizer steps; none = run all epochs")
    sft_lr: float = knob(1e-3, "SFT learning rate of the actor")
    sft_minibatch_tokens: int = knob(4096, "tokens per SFT optimizer step (separate from algo.minibatch_tokens)")
    critic_steps: int = knob(
        2, "the warm start's last phase: RL steps that update only the critic (episodes of the warm-started policy) "
        "before the first actor update, so the actor's first advantages come from a critic fitted to its returns")
    verify_references: bool = knob(
        False, "run the verifiers on every reference transcript and drop those that fail (slower; the test "
        "suite already checks every built-in reference solution)")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.pretrain_steps >= 0, "warmstart.pretrain_steps", ">= 0", self.pretrain_steps)
        check(self.pretrain_lr > 0, "warmstart.pretrain_lr", "> 0", self.pretrain_lr)
        check(self.pretrain_row_tokens >= 64, "warmstart.pretrain_row_tokens", ">= 64", self.pretrain_row_tokens)
        check(self.sft_epochs >= 0, "warmstart.sft_epochs", ">= 0", self.sft_epochs)
        check(self.sft_max_steps is None or self.sft_max_steps >= 1, "warmstart.sft_max_steps", ">= 1 or none",
              self.sft_max_steps)
        check(self.sft_lr > 0, "warmstart.sft_lr", "> 0", self.sft_lr)
        check(self.sft_minibatch_tokens >= 1, "warmstart.sft_minibatch_tokens", ">= 1", self.sft_minibatch_tokens)
        check(self.critic_steps >= 0, "warmstart.critic_steps", ">= 0", self.critic_steps)


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr_actor: float = knob(1e-4, "AdamW learning rate of the policy in RL")
    lr_critic: float = knob(1e-3, "AdamW learning rate of the critic")
    betas: tuple[float, float] = knob((0.9, 0.95), "AdamW betas")
    weight_decay: float = knob(0.0, "AdamW decoupled weight decay")
    grad_clip: float | None = knob(1.0, "global grad-norm clip per model; none = off")
    warmup_steps: int = knob(
        10, "linear LR warmup in optimizer steps (Adam's first steps move every weight by ~lr whatever its gradient)")
    lr_decay: bool = knob(
        True, "decay the learning rates linearly towards 0 after the warmup: SFT's over its optimizer steps, the "
        "actor's RL rate over run.steps (by RL step), so that the last minibatches and the last steps' episodes "
        "leave no mark of their own; false = constant (pretraining and the critic are never decayed)")
    actor_frozen: tuple[str, ...] = knob(
        (), "policy parameters RL leaves as warm-started: fnmatch patterns over parameter names, e.g. "
        "['lm_head.*', 'model.embed_tokens.*'] or ['*.mlp.gate.*'] (the routers); pretraining and SFT train them "
        "all; a pattern that matches nothing is an error")

    def __post_init__(self) -> None:
        check_types(self)
        check(all(self.actor_frozen), "optim.actor_frozen", "non-empty patterns", self.actor_frozen)
        check(self.lr_actor > 0, "optim.lr_actor", "> 0", self.lr_actor)
        check(self.lr_critic > 0, "optim.lr_critic", "> 0", self.lr_critic)
        check(all(0 <= b < 1 for b in self.betas), "optim.betas", "two values in [0, 1)", self.betas)
        check(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        check(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", "> 0 or none", self.grad_clip)
        check(self.warmup_steps >= 0, "optim.warmup_steps", ">= 0", self.warmup_steps)


@dataclass(frozen=True, kw_only=True)
class RunSection:
    seed: int = knob(0, "seed of every generator of the run (model init, sampling, task order)")
    steps: int = knob(24, "RL steps (critic-only iterations included)")
    device: str = knob("cpu", "'cpu', 'cuda' or 'cuda:N'")
    checkpoint_every: int = knob(3, "checkpoint every N RL steps (the final step is always saved); 0 = final only")
    routing_agreement_every: int = knob(
        4, "measure fidelity/routing_agreement (how often the trainer's own router picks the replayed experts) every "
        "N RL steps: it costs one more policy forward per minibatch; 0 = never")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.steps >= 0, "run.steps", ">= 0", self.steps)
        check(bool(_DEVICE_RE.match(self.device)), "run.device", "'cpu', 'cuda' or 'cuda:N'", self.device)
        check(self.checkpoint_every >= 0, "run.checkpoint_every", ">= 0", self.checkpoint_every)
        check(self.routing_agreement_every >= 0, "run.routing_agreement_every", ">= 0", self.routing_agreement_every)


@dataclass(frozen=True, kw_only=True)
class EvalSection:
    """What the run is evaluated on, before RL, every `every` steps and after RL (same tasks and sampling seeds
    each time; the change after RL is paired per task): one greedy attempt per task (temperature 0, pass@1:
    `t1core.evaluation.GREEDY`) and `attempts` more at rollout.temperature."""

    source: tuple[str, ...] = knob(
        ("builtin",), "task directories to evaluate on (each a task dir or a dir of task dirs, e.g. a benchmark; "
        "none may share a task name or instruction with tasks.source) and/or 'builtin': the built-in suite's "
        "held-out split (with tasks.source='builtin' only); empty = no evaluation")
    every: int = knob(0, "evaluation every N RL steps; 0 = only before and after RL")
    attempts: int = knob(
        2, "attempts per task at rollout.temperature besides the greedy one (the sampled resolved rate is the mean "
        "over tasks of each task's rate over its attempts; same sampling seeds at every evaluation); 0 = greedy only")

    def __post_init__(self) -> None:
        check_types(self)
        check(all(self.source), "eval.source", "non-empty items (a directory or 'builtin')", self.source)
        check(len(set(self.source)) == len(self.source), "eval.source", "no item twice", self.source)
        check(self.every >= 0, "eval.every", ">= 0", self.every)
        check(self.attempts >= 0, "eval.attempts", ">= 0", self.attempts)


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    """How the trainer spreads its memory (torchrun sets the ranks; the hardware a plan is made for is the planner's
    own [plan] table: t1 plan)."""

    activation_checkpointing: bool = knob(
        False, "recompute each decoder layer's activations in the backward (torch.utils.checkpoint per layer): "
        "only the layers' inputs stay alive between forward and backward")
    cpu_offload: bool = knob(
        False, "FSDP2 CPUOffloadPolicy on sharded runs: sharded parameters, gradients and AdamW state live in host "
        "memory; each layer is copied to the GPU around its use")
    expert_parallel: int = knob(
        1, "N ranks share each MoE layer's experts (expert parallelism, t1core.expert_parallel): each holds E/N whole "
        "experts and routed tokens travel by all-to-all; attention and dense weights stay FSDP2-sharded over all "
        "ranks. N divides model.num_experts and the world size; 1: off")
    shard_experts: bool = knob(
        False, "with expert_parallel N > 1: each rank's E/N experts further sharded over the W/N data-parallel "
        "replicas, all-gathered around their use and their gradients reduce-scattered (the memory of one copy "
        "split W/N ways); off: whole on every replica")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.expert_parallel >= 1, "parallel.expert_parallel", ">= 1", self.expert_parallel)
        check(not self.shard_experts or self.expert_parallel > 1, "parallel.shard_experts",
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
        check_types(self)
        # The update trains the log-probs of sampled tokens: a greedy "sample" has none to match.
        check(self.rollout.temperature > 0, "rollout.temperature", "> 0 in a training run (0, greedy, is for "
              "evaluation: rollout.evaluate)", self.rollout.temperature)
        # Minibatches pack whole trajectories, so the longest one must fit in one.
        check(self.algo.minibatch_tokens >= self.rollout.max_tokens, "algo.minibatch_tokens",
              f">= rollout.max_tokens ({self.rollout.max_tokens})", self.algo.minibatch_tokens)
        check(self.warmstart.sft_minibatch_tokens >= self.rollout.max_tokens, "warmstart.sft_minibatch_tokens",
              f">= rollout.max_tokens ({self.rollout.max_tokens})", self.warmstart.sft_minibatch_tokens)
        check(not self.algo.actor_push.startswith("group") or self.rollout.group_size >= 2, "algo.actor_push",
              "a rule without the group baseline when rollout.group_size is 1 (a lone episode would be its own "
              "baseline)", self.algo.actor_push)
        # A colocated vLLM sleeps through every update (it gives the GPU back): nothing would sample meanwhile.
        check(self.rollout.max_staleness == 0 or self.rollout.engine == "torch"
              or self.vllm.placement == "disaggregated", "rollout.max_staleness",
              "0 with vllm.placement='colocated' (the engine sleeps while the trainer updates; asynchronous RL needs "
              "vllm.placement='disaggregated')", self.rollout.max_staleness)
        if self.algo.bitwise == "on":
            for name, (got, want) in _bitwise_needs(self).items():
                check(got == want, name, f"{want!r} with algo.bitwise='on' (bit-equal log-probs are built for the "
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
