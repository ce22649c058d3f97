"""The run's models: tokenizer, policy and critic (a preset from the run seed, or a HF checkpoint; loaded as shards
on several ranks), and `ModelBuilder`, the one order in which they get an engine copy, activation checkpointing
and sharding."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.torch_engine import TorchEngine
from rollout.vllm_engine import VLLMEngine
from t1core import distributed
from t1core.config import RunConfig
from t1core.rollout_ranks import make_engine
from t1model.dtypes import DTYPES
from t1model.hf_io import load_pretrained
from t1model.model import PRESETS, MoEModel, ValueModel, set_moe_recompute
from t1model.tokenizer import ChatTokenizer


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
    elif is_preset(name):
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


def is_preset(name: str) -> bool:
    """model.name names a preset (a model built from scratch), not a checkpoint directory."""
    return not Path(name).is_dir() and name in PRESETS


def load_tokenizer(cfg: RunConfig) -> ChatTokenizer:
    name = cfg.model.name
    return ChatTokenizer.from_pretrained(name) if Path(name).is_dir() else ChatTokenizer.builtin()


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
