"""What a run is built from: tasks with their images, tokenizer, policy, critic, engine, optimizers.

Kept out of `t1core.train` so that the loop there reads like the algorithm.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollout import vllm_api
from rollout.agent import AgentConfig, SandboxLimits
from rollout.compaction import COMPACT_AT, Compaction
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.vllm_convert import check_temperature
from rollout.vllm_engine import VLLMEngine, VLLMSettings
from sandbox.images.task_images import TaskImage, build_task_images, default_base_image_overrides
from sandbox.images.base_image import ensure_base_image
from sandbox.tasks.overlap import check_disjoint
from sandbox.tasks.suite import family_tasks, fixed_tasks, heldout_tasks, train_tasks
from sandbox.tasks.format import Task, load_task, load_task_dirs
from sandbox.cli import bad_input
from sandbox.runtime.hosts import use_hosts
from t1core import cli, distributed, evaluation
from t1core.config import RunConfig
from t1core.expert_parallel import check_expert_parallel
from t1core.positions import check_positions, engine_length
from t1core.step import SeedBlock
from t1model.device import check_device
from t1model.dtypes import DTYPES
from t1model.hf_io import config_from_hf, load_pretrained
from t1model.model import PRESETS, ModelConfig, MoEModel, ValueModel, set_moe_recompute
from t1core.rollout_ranks import RolloutRanks
from t1model.tokenizer import ChatTokenizer


@dataclass
class TaskSets:
    train: list[Task]           # SFT: reference transcripts of these
    rl: list[Task]              # RL episodes (the SFT instances themselves when no separate RL set is drawn)
    heldout_family: list[Task]
    heldout_fixed: list[Task]
    images: dict[str, TaskImage] = field(default_factory=dict)   # task name -> image (and preloaded files)
    benchmarks: dict[str, list[Task]] = field(default_factory=dict)  # eval.source's directories by name

    @property
    def num_eval_tasks(self) -> int:
        """Tasks an evaluation runs: the built-in held-out split's and the benchmarks'."""
        return len(self.heldout_family) + len(self.heldout_fixed) + sum(map(len, self.benchmarks.values()))

    def all(self) -> list[Task]:
        bench = [t for ts in self.benchmarks.values() for t in ts]
        unique = {t.name: t for t in self.train + self.rl + self.heldout_family + self.heldout_fixed + bench}
        return list(unique.values())


def load_tasks(cfg: RunConfig, run_dir: Path) -> TaskSets:
    """The built-in suite (families written under run_dir/tasks) or a directory of task dirs (all train).

    Built-in: SFT instances, RL instances (fresh seeds: RL then practises on instances the warm start has not
    memorised, which is what held-out success measures; the fixed train tasks too if tasks.fixed_tasks='rl') and
    held-out instances, no instruction repeated across the three. Then eval.source's directories, refused when
    they overlap the training tasks (t1core.evaluation)."""
    sets = _training_tasks(cfg, run_dir)
    everything = list({t.name: t for t in sets.train + sets.rl}.values())
    sets.benchmarks, keep = evaluation.load_benchmarks(cfg, everything)
    for d in cfg.tasks.decontaminate_against:
        keep = check_disjoint(keep, load_task_dirs(d), train_what="the training tasks",
                              held_out_what=f"tasks.decontaminate_against {d!r}", policy=cfg.tasks.decontaminate)
    kept = {t.name for t in keep}
    sets.train, sets.rl = [t for t in sets.train if t.name in kept], [t for t in sets.rl if t.name in kept]
    if len(keep) < len(everything) and not (sets.train and sets.rl):
        raise ValueError("tasks.decontaminate='drop': no training tasks left once those overlapping the evaluation "
                         "tasks are dropped")
    return sets


def _training_tasks(cfg: RunConfig, run_dir: Path) -> TaskSets:
    t = cfg.tasks
    families = list(t.families) or None
    if t.source == "builtin":
        out = run_dir / "tasks"
        train = train_tasks(out, num_per_family=t.num_per_family, seed=int(SeedBlock.TRAIN), families=families,
                            include_fixed=t.fixed_tasks != "off")
        rl = train
        if t.num_rl_per_family:
            rl = family_tasks(out, split="train", num_per_family=t.num_rl_per_family, seed=int(SeedBlock.RL),
                              families=families, avoid=train) + (fixed_tasks("train") if t.fixed_tasks == "rl" else [])
        if evaluation.BUILTIN not in cfg.eval.source:
            return TaskSets(train, rl, [], [])
        fam, fixed = heldout_tasks(out, num_per_family=t.num_heldout_per_family, seed=int(SeedBlock.HELDOUT),
                                   families=families, avoid=train + rl)
        return TaskSets(train, rl, fam, fixed if t.fixed_tasks != "off" else [])
    root = Path(t.source)
    if not root.is_dir():
        raise ValueError(f"tasks.source: expected 'builtin' or a directory of tasks, got {t.source!r}")
    tasks = [load_task(p) for p in sorted(root.iterdir()) if p.is_dir()]
    return TaskSets(tasks, tasks, [], [])


def prepare_tasks(cfg: RunConfig, run_dir: Path, dp: distributed.DataParallel) -> TaskSets:
    """The run's task sets on every rank: the main rank writes the task directories (a malformed task, or eval.source
    overlapping tasks.source, is the user's input: one line, exit 2), removes containers left by crashed runs and
    builds the images (and loads them into every host of sandbox.hosts); all ranks then run sandboxes on those hosts.
    Says so when the run will evaluate nothing."""
    tasks = None
    hosts = use_hosts(cfg.sandbox.hosts)  # every rank: the provider its sandbox pools start from
    if dp.is_main:
        with bad_input(cli.parser()):
            tasks = load_tasks(cfg, run_dir)
        hosts.reap()
        build_images(tasks, cfg)
        if cfg.sandbox.hosts:
            hosts.distribute({image.ref for image in tasks.images.values()})
        if not tasks.num_eval_tasks:
            print(f"evaluation: none ({evaluation.nothing_reason(cfg)})", flush=True)
    return dp.broadcast(tasks)


def build_images(tasks: TaskSets, cfg: RunConfig) -> None:
    """Build (or find cached) every task image; user overrides take precedence over the defaults."""
    ensure_base_image()
    overrides = cfg.tasks.base_image_map()  # user patterns first: the first matching pattern wins
    for pattern, image in default_base_image_overrides().items():
        overrides.setdefault(pattern, image)
    tasks.images.update(build_task_images(tasks.all(), base_image_overrides=overrides))


def shard_options(cfg: RunConfig) -> dict:
    """`distributed.shard_`'s keywords for this run: a half-precision model.dtype is mixed precision over fp32
    masters (`load_models` builds the models in fp32 then); parallel.cpu_offload the CPUOffloadPolicy. Computed
    once per run (`ModelBuilder`) and checked before anything is built (`check_config`)."""
    dtype = DTYPES[cfg.model.dtype]
    if cfg.parallel.cpu_offload and torch.device(cfg.run.device).type != "cuda":
        raise ValueError(f"parallel.cpu_offload=true: offloads GPU memory to the host, expected run.device='cuda', "
                         f"got {cfg.run.device!r}")
    return {"param_dtype": None if dtype == torch.float32 else dtype, "cpu_offload": cfg.parallel.cpu_offload,
            "expert_parallel": cfg.parallel.expert_parallel, "shard_experts": cfg.parallel.shard_experts}


def load_models(cfg: RunConfig, tok: ChatTokenizer, dp: distributed.DataParallel | None = None, *,
                shard: dict | None = None) -> tuple[MoEModel, ValueModel]:
    """Policy (a preset, initialised from the run seed, or a HF checkpoint) and a critic from its weights; in fp32
    (the master weights) when model.dtype is half precision, which `distributed.shard_` then computes in.
    A checkpoint on W ranks loads already sharded: each rank reads only its own rows (collective). `shard`: this
    run's `shard_options` (computed here when not given)."""
    shard = shard if shard is not None else shard_options(cfg)
    dtype, device = DTYPES[cfg.model.dtype], torch.device(cfg.run.device)
    dtype = torch.float32 if shard["param_dtype"] is not None else dtype
    name = cfg.model.name
    if Path(name).is_dir() and dp is not None and dp.distributed:
        policy = distributed.sharded_from_pretrained(Path(name), dp, dtype=dtype, **shard)
        critic = distributed.sharded_critic(policy, dp, **shard)
        for model in (policy, critic):
            set_moe_recompute(model, cfg.model.moe_recompute)
        return policy, critic
    if Path(name).is_dir():
        policy = load_pretrained(name, dtype=dtype)
    elif _is_preset(name):
        mcfg = PRESETS[name]()
        if mcfg.vocab_size < tok.vocab_size:
            raise ValueError(f"model.name={name!r}: vocab_size {mcfg.vocab_size} < tokenizer's {tok.vocab_size}")
        policy = MoEModel(mcfg, seed=cfg.run.seed, dtype=dtype)
    else:
        raise ValueError(f"model.name: expected a preset {sorted(PRESETS)} or a checkpoint directory, got {name!r}")
    policy = policy.to(device)
    critic = ValueModel.from_policy(policy).to(device)
    for model in (policy, critic):
        set_moe_recompute(model, cfg.model.moe_recompute)
    return policy, critic


def _is_preset(name: str) -> bool:
    """model.name names a preset (a model built from scratch), not a checkpoint directory."""
    return not Path(name).is_dir() and name in PRESETS


def check_config(cfg: RunConfig) -> None:
    """What the config names exists and fits together (ValueError naming the key otherwise): checked before
    anything is built, so that bad input costs no image build and prints no traceback."""
    check_device(torch.device(cfg.run.device))
    name = cfg.model.name
    if Path(name).is_dir():
        if not (Path(name) / "config.json").is_file():
            raise ValueError(f"model.name={name!r}: a directory without config.json (not a HF checkpoint)")
    elif name not in PRESETS:
        raise ValueError(f"model.name: expected a preset {sorted(PRESETS)} or a checkpoint directory, got {name!r}")
    if cfg.tasks.source != "builtin" and not Path(cfg.tasks.source).is_dir():
        raise ValueError(f"tasks.source: expected 'builtin' or a directory of tasks, got {cfg.tasks.source!r}")
    for source in cfg.eval.source:
        if source != evaluation.BUILTIN and not Path(source).is_dir():
            raise ValueError(f"eval.source: expected 'builtin' or directories of tasks, got {source!r}")
    mcfg, source = _shape(cfg)
    check_positions(cfg, mcfg, source=source)
    check_expert_parallel(cfg.parallel.expert_parallel, num_experts=mcfg.num_experts,
                          world=int(os.environ.get("WORLD_SIZE", "1")))
    pretrains(cfg)
    shard_options(cfg)
    if cfg.rollout.engine == "vllm":
        check_temperature(cfg.rollout.temperature, key="rollout.temperature")
        line = vllm_api.require_vllm()
        if cfg.rollout.r3 == "on" and not line.routed_experts:
            raise ValueError(vllm_api.unavailable(line, "routed experts (rollout.r3='on')", "rollout.r3='auto' "
                                                  "trains with the trainer's own routing"))
        if line.platform == "cpu" and cfg.vllm.placement != "colocated":
            raise ValueError(vllm_api.unavailable(line, f"vllm.placement={cfg.vllm.placement!r} (NCCL weight "
                                                  "transfer)", "use vllm.placement='colocated'"))
    if (cfg.rollout.max_staleness and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and not (cfg.rollout.engine == "vllm" and cfg.vllm.placement == "disaggregated")):
        raise ValueError(f"rollout.max_staleness: expected 0 under torchrun unless one engine serves every rank "
                         f"(rollout.engine='vllm', vllm.placement='disaggregated': the collector runs on rank 0), got "
                         f"{cfg.rollout.max_staleness}")
    if cfg.tasks.decontaminate_against:
        check_decontaminated(cfg)


def check_decontaminated(cfg: RunConfig) -> None:
    """With tasks.decontaminate='refuse': the training tasks (the built-in suite's written to a scratch directory
    first) overlap none of tasks.decontaminate_against's (`load_tasks`); ValueError otherwise, before any build."""
    if cfg.tasks.decontaminate == "refuse":
        with tempfile.TemporaryDirectory(prefix="t1-decontaminate-") as tmp:
            load_tasks(cfg, Path(tmp))


def _shape(cfg: RunConfig) -> tuple[ModelConfig, str]:
    """The policy's shape without its weights, and where it came from."""
    name = cfg.model.name
    if Path(name).is_dir():
        return config_from_hf(json.loads((Path(name) / "config.json").read_text())), f"{name}/config.json"
    return PRESETS[name](), f"preset {name}"


def pretrains(cfg: RunConfig) -> bool:
    """Whether the run pretrains its base (t1core.pretrain): a from-scratch preset and pretrain_steps > 0.

    The corpus comes from the built-in families, so a from-scratch model on a task directory must say
    `warmstart.pretrain_steps=0` explicitly rather than silently start RL from random weights."""
    if cfg.warmstart.pretrain_steps == 0 or not _is_preset(cfg.model.name):
        return False
    if cfg.tasks.source != "builtin":
        raise ValueError(f"warmstart.pretrain_steps={cfg.warmstart.pretrain_steps} pretrains a from-scratch "
                         f"model on the built-in families' text, but tasks.source={cfg.tasks.source!r}: use "
                         "tasks.source='builtin', start from a checkpoint (model.name=DIR), or set "
                         "warmstart.pretrain_steps=0")
    return True


def load_tokenizer(cfg: RunConfig) -> ChatTokenizer:
    name = cfg.model.name
    return ChatTokenizer.from_pretrained(name) if Path(name).is_dir() else ChatTokenizer.builtin()


def make_engine(policy: MoEModel, cfg: RunConfig,
                dp: distributed.DataParallel | None = None) -> TorchEngine | VLLMEngine | None:
    """The rollout engine over its own copy of the policy (synced after every update): rollout.engine picks
    TorchEngine or VLLMEngine (vLLM loads the policy from a HF checkpoint it is handed). None on a rank that owns
    no engine (`rollout_ranks`)."""
    r = cfg.rollout
    if r.engine == "vllm":
        return _make_vllm_engine(policy, cfg, dp or distributed.DataParallel.single())
    ecfg = EngineConfig.for_parallel(r.concurrency, max_seq_len=engine_length(cfg, policy.config),
                                     batch_invariant=r.batch_invariant)
    dtype = DTYPES[cfg.model.dtype]
    if distributed.is_sharded(policy):  # loaded as shards: the engine's whole copy comes from the checkpoint
        engine_model = load_pretrained(cfg.model.name, dtype=dtype, device=cfg.run.device)
    else:
        engine_model = copy.deepcopy(policy).to(dtype)  # fp32 masters: the engine serves model.dtype
    return TorchEngine(engine_model.eval().requires_grad_(False), ecfg)


class ModelBuilder:
    """Policy, critic and the rollout engine, built in the one order that works; each stage refuses to run out of it.

    1. `__init__` loads the plain models (`load_models`).
    2. `take_engine_copy` gives the engine its copy of the plain policy (`make_engine`): it must see the model
       before activation checkpointing wraps its forwards and before sharding replaces its parameters.
    3. `wrap_and_shard` checkpoints the layers (parallel.activation_checkpointing) and shards both models
       (`distributed.shard_`); optimizers are built from its result.
    """

    _ORDER = ("loaded", "engine_copied", "sharded")

    def __init__(self, cfg: RunConfig, tok: ChatTokenizer, dp: distributed.DataParallel) -> None:
        self.cfg, self.dp = cfg, dp
        self.shard = shard_options(cfg)  # the one computation of it for this run
        self.policy, self.critic = load_models(cfg, tok, dp, shard=self.shard)
        self._stage = "loaded"

    def _advance(self, to: str) -> None:
        want = self._ORDER[self._ORDER.index(to) - 1]
        if self._stage != want:
            raise RuntimeError(f"ModelBuilder: {to!r} comes after {want!r}, but this builder is at {self._stage!r}")
        self._stage = to

    def take_engine_copy(self) -> TorchEngine | VLLMEngine | None:
        """This rank's rollout engine over its own copy of the still plain policy (None on a rank without one)."""
        self._advance("engine_copied")
        return make_engine(self.policy, self.cfg, self.dp)

    def wrap_and_shard(self) -> tuple[MoEModel, ValueModel]:
        """(policy, critic), activation-checkpointed if asked and sharded: what the optimizers are built from."""
        self._advance("sharded")
        if self.cfg.parallel.activation_checkpointing:
            distributed.checkpoint_layers_(self.policy)
            distributed.checkpoint_layers_(self.critic)
        distributed.shard_(self.policy, self.dp, **self.shard)
        distributed.shard_(self.critic, self.dp, **self.shard)
        return self.policy, self.critic


def rollout_ranks(cfg: RunConfig, dp: distributed.DataParallel) -> RolloutRanks:
    """Which ranks own an engine: all of them, except with a disaggregated vLLM on several ranks (rank 0's serves
    them all: t1core.rollout_ranks)."""
    single = cfg.rollout.engine == "vllm" and cfg.vllm.placement == "disaggregated" and dp.distributed
    return RolloutRanks(dp=dp, single_engine=single)


def _make_vllm_engine(policy: MoEModel, cfg: RunConfig, dp: distributed.DataParallel) -> VLLMEngine | None:
    """Colocated: this rank's own vLLM on its own GPU. Disaggregated: rank 0's vLLM on GPUs no trainer rank holds
    (tensor parallel; vllm.executor='ray': wherever vLLM's Ray executor places it); None elsewhere. A sharded policy
    (read from a checkpoint as shards) is never gathered here: vLLM reads the checkpoint itself."""
    r, v = cfg.rollout, cfg.vllm
    if not rollout_ranks(cfg, dp).owns_engine:
        return None
    max_len = engine_length(cfg, policy.config)
    nccl = None
    if v.placement == "disaggregated":  # the owning trainer rank is NCCL rank 0, vLLM's workers the others
        host, port = v.nccl_host_port
        nccl = {"master_address": host, "master_port": port, "world_size": 1 + v.tensor_parallel_size}
    settings = VLLMSettings(tensor_parallel_size=v.tensor_parallel_size,
                            gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=max_len,
                            enforce_eager=v.enforce_eager, placement=v.placement, dtype=DTYPES[cfg.model.dtype],
                            seed=cfg.run.seed, nccl_init=nccl, trainer_device=_trainer_device(cfg),
                            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), executor=v.executor)
    if distributed.is_sharded(policy):
        return VLLMEngine.from_pretrained(cfg.model.name, policy.config, settings)
    return VLLMEngine.from_model(policy, settings)


def _trainer_device(cfg: RunConfig) -> torch.device:
    """This process's device: 'cuda' means the current CUDA device (cuda:LOCAL_RANK under torchrun)."""
    dev = torch.device(cfg.run.device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def routing_replay(cfg: RunConfig) -> tuple[bool, str | None]:
    """(whether the update replays the rollout's routing (R3), the one-line notice when it cannot). Every engine
    records routing except vLLM's CPU build (`rollout.vllm_api.Line.routed_experts`); rollout.r3='on' refused that
    one in `check_config`. Decided from the installed vLLM's metadata, alike on every rank."""
    if cfg.rollout.engine != "vllm":
        return True, None
    line = vllm_api.require_vllm()
    if line.routed_experts:
        return True, None
    return False, ("R3: " + vllm_api.unavailable(line, "routed experts", "the update routes with the trainer's own "
                                                 "router (rollout.r3='auto'); no sleep mode either: the engine keeps "
                                                 "its memory through updates"))


def agent_config(cfg: RunConfig, *, temperature: float | None = None, task_timeouts: bool = False) -> AgentConfig:
    """The agent's limits and sampling; `task_timeouts`: each episode is cut at its own task's agent timeout
    (task.toml) instead of rollout.wall_clock_limit_s (benchmark tasks: their timeouts are part of the benchmark)."""
    r, s, c = cfg.rollout, cfg.sandbox, cfg.context
    compaction = None if c.compaction == "off" else Compaction(at_tokens=int(COMPACT_AT * r.max_tokens),
                                                               keep_turns=c.keep_turns, summary=c.compaction)
    limits = SandboxLimits(cpus=s.cpus, memory_mb=s.memory_mb, pids=s.pids, output_cap_bytes=s.output_cap_bytes)
    return AgentConfig(max_turns=r.max_turns, max_tokens=r.max_tokens, max_reply_tokens=r.max_new_tokens_per_turn,
                       wall_clock_s=None if task_timeouts else r.wall_clock_limit_s,
                       command_timeout_s=s.command_timeout_s,
                       temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                       sandbox=limits, compaction=compaction, observation_max_tokens=c.observation_max_tokens,
                       infra_retries=r.infra_retries, return_routing=routing_replay(cfg)[0])


def frozen_parameters(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of `model`'s parameters that match any fnmatch pattern (`optim.actor_frozen`); a pattern that matches
    nothing is a ValueError naming it (a typo would otherwise train everything without a word)."""
    names = [n for n, _ in model.named_parameters()]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"optim.actor_frozen: {unmatched} match no parameter of the policy "
                         f"(names look like {names[:3]})")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def freeze(model: torch.nn.Module, names: Sequence[str]) -> None:
    """No gradient (so no optimizer step) for the parameters `names` (`frozen_parameters`); all others train."""
    frozen = set(names)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def make_optimizer(model: torch.nn.Module, *, lr: float, cfg: RunConfig, decay_steps: int | None = None,
                   progress: Callable[[], float] | None = None,
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a linear warmup over `optim.warmup_steps`; with `decay_steps`, times a linear decay that reaches
    0 at optimizer step `decay_steps` (the LambdaLR must be stepped once per optimizer step); with `progress`,
    times 1 - progress() (a fraction of the run done, read whenever the rate is set: `refresh_lr`)."""
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=o.betas, weight_decay=o.weight_decay,
                            foreach=False)  # foreach=False: one fixed reduction order per parameter
    warmup = o.warmup_steps

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        if progress is not None:
            ramp *= max(0.0, 1.0 - progress())
        return ramp * max(0.0, 1.0 - step / decay_steps) if decay_steps else ramp

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def refresh_lr(sched: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the rates from the schedule's factor now (a `progress` factor moves between optimizer steps)."""
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)

