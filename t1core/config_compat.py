"""Old config fields, read into the current ones: a config written before a field moved or merged still loads, and
each old field it sets prints one line naming its replacement (`deprecated: ...`, on stderr).

An old value the current config cannot express exactly (a knob combination no `algo.actor_push` rule is, a seed
block that is fixed now) is a ValueError naming the new field, never a silent change of what the run does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from t1core.step import PUSH_RULES, SeedBlock

Raw = dict[str, dict[str, Any]]

PLAN_KEYS = ("nodes", "gpus_per_node", "gpu_mem_gib", "host_mem_gib")
"""[parallel] keys read only by the planner: they live in the TOML's own [plan] table now (`t1core.plan`)."""

_OLD_PUSH = {"advantage_norm": "group", "negative_adv_scale": 0.0, "skip_flat_steps": True, "skip_flat_groups": True}
"""The four actor knobs `algo.actor_push` replaced, with their old defaults."""

_FIXED_BLOCKS = {("tasks", "train_seed"): SeedBlock.TRAIN, ("tasks", "rl_seed"): SeedBlock.RL,
                 ("tasks", "heldout_seed"): SeedBlock.HELDOUT, ("warmstart", "pretrain_seed_block"): SeedBlock.PRETRAIN}


_MOVED = {("run", "eval_every"): ("eval", "every"), ("run", "eval_temperature"): ("eval", "temperature"),
          ("run", "eval_samples"): ("eval", "attempts"),
          ("algo", "critic_only_iterations"): ("warmstart", "critic_steps")}
"""Fields that moved with their meaning unchanged: old (section, key) -> new (section, key)."""


def _say(line: str) -> None:
    print(f"deprecated: {line}", file=sys.stderr, flush=True)


def _value(text: Any, parse: Callable[[str], Any]) -> Any:
    """A TOML value as is; a command-line string parsed."""
    return parse(text.strip()) if isinstance(text, str) else text


def parse_bool(text: str) -> bool:
    """A config bool from the command line (config_toml's parser uses it too)."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected a bool (true/false), got {text!r}")


def migrate(raw: Raw, origin: str) -> Raw:
    """`raw` (TOML tables or one override) with every old field replaced by its current one. Returns a new dict."""
    raw = {name: dict(table) if isinstance(table, dict) else table for name, table in raw.items()}
    _migrate_push(raw, origin)
    _migrate_fixed(raw, origin)
    _migrate_switches(raw, origin)
    _migrate_lr_decay(raw, origin)
    _migrate_vllm(raw, origin)
    _migrate_moved(raw, origin)
    parallel = raw.get("parallel")
    if isinstance(parallel, dict):
        for key in [k for k in PLAN_KEYS if k in parallel]:
            del parallel[key]
            _say(f"{origin}: parallel.{key} moved to the planner's own [plan] table (python -m t1core.plan reads "
                 f"plan.{key}); the trainer ignores it")
    return raw


def _migrate_push(raw: Raw, origin: str) -> None:
    algo = raw.get("algo")
    if not isinstance(algo, dict) or not any(k in algo for k in _OLD_PUSH):
        return
    given = {k: algo.pop(k) for k in list(_OLD_PUSH) if k in algo}
    parse = {"advantage_norm": str, "negative_adv_scale": float, "skip_flat_steps": parse_bool,
             "skip_flat_groups": parse_bool}
    old = {**_OLD_PUSH, **{k: _value(v, parse[k]) for k, v in given.items()}}
    names = ", ".join(f"algo.{k}" for k in given)
    match = [name for name, r in PUSH_RULES.items()
             if (r.baseline, r.negative_scale, r.skip_flat_steps, r.skip_flat_groups) == tuple(old.values())]
    if not match:
        raise ValueError(f"{origin}: {names}: replaced by algo.actor_push, and no rule of it is {old}; choose "
                         f"algo.actor_push from {list(PUSH_RULES)}")
    if "actor_push" in algo and algo["actor_push"] != match[0]:
        raise ValueError(f"{origin}: {names} (= algo.actor_push={match[0]!r}) contradict algo.actor_push="
                         f"{algo['actor_push']!r}; keep only algo.actor_push")
    algo["actor_push"] = match[0]
    _say(f"{origin}: {names}: replaced by algo.actor_push (read as {match[0]!r})")


def _migrate_fixed(raw: Raw, origin: str) -> None:
    for (section, key), block in _FIXED_BLOCKS.items():
        table = raw.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        value = _value(table.pop(key), int)
        if value != int(block):
            raise ValueError(f"{origin}: {section}.{key}={value} is no longer a setting: the seed blocks of the task "
                             f"splits are fixed (t1core.step.SeedBlock.{block.name} = {int(block)})")
        _say(f"{origin}: {section}.{key} is fixed now (t1core.step.SeedBlock.{block.name}); remove it")


def _migrate_switches(raw: Raw, origin: str) -> None:
    algo = raw.get("algo")
    for key, what in (("use_tito", "training on re-tokenized transcripts"), ("use_r3", "training without routing "
                      "replay")):
        if not isinstance(algo, dict) or key not in algo:
            continue
        if not _value(algo.pop(key), parse_bool):
            raise ValueError(f"{origin}: algo.{key}=false: {what} is an ablation of python -m "
                             "t1core.experiments.mismatch now (its conditions (a) and (b)), not a training setting")
        _say(f"{origin}: algo.{key} is always on in training (the ablation: python -m t1core.experiments.mismatch)")
    warm = raw.get("warmstart")
    if isinstance(warm, dict) and "sft_enabled" in warm:
        if not _value(warm.pop("sft_enabled"), parse_bool):
            if _value(warm.get("sft_epochs", 0), int) != 0:
                raise ValueError(f"{origin}: warmstart.sft_enabled=false with warmstart.sft_epochs > 0; "
                                 "warmstart.sft_epochs=0 turns SFT off")
            warm["sft_epochs"] = 0
        _say(f"{origin}: warmstart.sft_enabled is replaced by warmstart.sft_epochs (0 = no SFT)")


def _migrate_lr_decay(raw: Raw, origin: str) -> None:
    old = {("optim", "actor_lr_decay"): True, ("warmstart", "sft_lr_decay"): True}
    given = {}
    for (section, key) in old:
        table = raw.get(section)
        if isinstance(table, dict) and key in table:
            given[(section, key)] = old[(section, key)] = _value(table.pop(key), parse_bool)
    if not given:
        return
    names = ", ".join(f"{s}.{k}" for s, k in given)
    if len(set(old.values())) != 1:
        raise ValueError(f"{origin}: {names}: the SFT and RL decays are one setting now, optim.lr_decay; an old "
                         f"config that decays only one of them ({old}) cannot be read as it")
    raw.setdefault("optim", {})["lr_decay"] = next(iter(old.values()))
    _say(f"{origin}: {names} replaced by optim.lr_decay (read as {str(raw['optim']['lr_decay']).lower()})")


def _migrate_vllm(raw: Raw, origin: str) -> None:
    vllm = raw.get("vllm")
    if not isinstance(vllm, dict):
        return
    if "max_model_len" in vllm:
        value = vllm.pop("max_model_len")
        if not (value is None or str(value).strip().lower() == "none"):
            raise ValueError(f"{origin}: vllm.max_model_len={value} is no longer a setting: it is derived from "
                             "rollout.max_tokens + rollout.max_new_tokens_per_turn (rollout.budget.slot_length)")
        _say(f"{origin}: vllm.max_model_len is derived now (rollout.budget.slot_length); remove it")
    if "nccl_address" in vllm or "nccl_port" in vllm:
        host = str(vllm.pop("nccl_address", "127.0.0.1")).strip()
        port = _value(vllm.pop("nccl_port", 29650), int)
        vllm["nccl_endpoint"] = f"{host}:{port}"
        _say(f"{origin}: vllm.nccl_address and vllm.nccl_port are replaced by vllm.nccl_endpoint "
             f"(read as {vllm['nccl_endpoint']!r})")


def _migrate_moved(raw: Raw, origin: str) -> None:
    for (section, key), (new_section, new_key) in _MOVED.items():
        table = raw.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        target = raw.setdefault(new_section, {})
        value = table.pop(key)
        if new_key in target and target[new_key] != value:
            raise ValueError(f"{origin}: {section}.{key}={value!r} contradicts {new_section}.{new_key}="
                             f"{target[new_key]!r}; keep only {new_section}.{new_key}")
        target[new_key] = value
        _say(f"{origin}: {section}.{key} moved to {new_section}.{new_key}")
