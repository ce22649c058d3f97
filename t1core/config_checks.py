"""`check_config`: what a run's config names exists and fits together, checked before anything is built (the
config's own fields check themselves in t1core.config; these checks need the files, the model's shape, the installed
vLLM and the world size)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rollout import vllm_api
from rollout.vllm_convert import check_temperature
from t1core.config import RunConfig
from t1core.expert_parallel import check_expert_parallel
from t1core.models import shard_options
from t1core.positions import check_positions
from t1core.pretrain import pretrains
from t1core.tasks import BUILTIN, check_decontaminated
from t1model.device import check_device
from t1model.hf_io import config_from_hf
from t1model.model import PRESETS, ModelConfig


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
        if source != BUILTIN and not Path(source).is_dir():
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


def _shape(cfg: RunConfig) -> tuple[ModelConfig, str]:
    """The policy's shape without its weights, and where it came from."""
    name = cfg.model.name
    if Path(name).is_dir():
        return config_from_hf(json.loads((Path(name) / "config.json").read_text())), f"{name}/config.json"
    return PRESETS[name](), f"preset {name}"
