"""Atomic training checkpoints holding everything needed to continue a run bit for bit (the run's own save and
resume: t1core.checkpoint.resume; RNG states: .rng; the policy_hf/ export: .hf).

Layout under a checkpoint root (e.g. RUN_DIR/checkpoints):
    step_00000004/
        state.pt      step, policy and critic state dicts, optimizer/scheduler states, RNG states, data state
        dcp/          FSDP2-sharded runs: policy, critic and their optimizers' states, each rank's own shards
                      (torch.distributed.checkpoint: one file per rank + .metadata); state.pt then holds the rest
        config.toml   the run's resolved config
        policy_hf/    the policy in HF format (only when the policy has `save_pretrained` or is an MoEModel)
    latest            the name of the newest complete step directory
A step directory is written as `.tmp-<name>-<pid>` beside its final place, fsynced, then renamed; `latest` is
replaced atomically after that. A crash at any point leaves `latest` naming a complete checkpoint, and the
loader never looks at `.tmp-*` directories. On W ranks every rank writes its shards into the main rank's temporary
directory (a file system all ranks share), and the main rank renames it only after every rank has written.

Sharded checkpoints load at any world size: DCP reshards on load (W -> W' ranks, or into a plain single-process
model), and a whole (single-process) checkpoint loads into W ranks' shards.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from t1core import distributed
from t1core.checkpoint.hf import save_hf, save_hf_unsharded
from t1core.checkpoint.rng import AnyGenerator, restore_rng_state
from t1core.config import RunConfig
from t1core.config_toml import config_to_toml, load_config
from t1core.distributed import DataParallel

LATEST = "latest"
_TMP_PREFIX = ".tmp-"
DCP_DIR = "dcp"

class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under root to disk (children before the directories naming them)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _read_latest(root: Path) -> str | None:
    latest = root / LATEST
    return latest.read_text().strip() if latest.exists() else None


def _sharded_parts(policy: torch.nn.Module, critic: torch.nn.Module | None,
                   optimizers: Mapping[str, Stateful]) -> dict[str, Any] | None:
    """What DCP saves when the policy is FSDP2-sharded (None otherwise): this rank's shards of both models and of
    every optimizer that knows its model (`distributed.ModelOptimizer`)."""
    if not distributed.is_sharded(policy):
        return None
    opts = {name: {"state": o.sharded_state()} for name, o in optimizers.items()
            if isinstance(o, distributed.ModelOptimizer)}
    return {"policy": distributed.model_state(policy),
            "critic": distributed.model_state(critic) if critic is not None else None, "optimizers": opts}


def _write_step_dir(tmp: Path, *, step: int, policy: torch.nn.Module, critic: torch.nn.Module | None,
                    optimizers: Mapping[str, Stateful], rng_states: Mapping[str, Any], data_state: Any,
                    config: RunConfig, dp: DataParallel) -> None:
    """Every rank: its DCP shards and its part of the streamed HF export (collectives); the main rank the rest."""
    sharded = _sharded_parts(policy, critic, optimizers)
    if sharded is not None:
        import torch.distributed.checkpoint as dcp
        dcp.save({k: v for k, v in sharded.items() if v is not None}, checkpoint_id=str(tmp / DCP_DIR))
    if distributed.is_sharded(policy):
        save_hf(policy, tmp / "policy_hf", dp)
    elif dp.is_main:
        save_hf_unsharded(policy, tmp / "policy_hf")
    if not dp.is_main:
        return
    in_dcp = set() if sharded is None else set(sharded["optimizers"])
    state = {
        "step": step,
        "policy": None if sharded else policy.state_dict(),
        "critic": None if sharded or critic is None else critic.state_dict(),
        # DCP optimizers: their tensors are in dcp/, their parameter groups (the same on every rank) here
        "optimizers": {name: {"param_groups": opt.param_groups()} if name in in_dcp else opt.state_dict()
                       for name, opt in optimizers.items()},
        "rng_states": dict(rng_states),
        "data_state": data_state,
        # DCP: which parts live in dcp/ (the loader takes them from there)
        "sharded": None if sharded is None else {"critic": critic is not None, "optimizers": sorted(in_dcp)},
    }
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
    (tmp / "config.toml").write_text(config_to_toml(config))


def save_checkpoint(root: str | os.PathLike[str], *, step: int, policy: torch.nn.Module,
                    critic: torch.nn.Module | None, optimizers: Mapping[str, Stateful],
                    rng_states: Mapping[str, Any], data_state: Any, config: RunConfig,
                    keep_last: int | None = None, dp: DataParallel | None = None) -> Path | None:
    """Write checkpoint `step` under `root` atomically, point `latest` at it, and return its directory.

    optimizers: everything with state_dict/load_state_dict by name (optimizers, LR schedulers, grad scalers);
    a `distributed.ModelOptimizer` of a sharded model is saved as shards. rng_states: from `capture_rng_state`.
    data_state: the data order/cursor (plain values and tensors only). keep_last: afterwards delete all but the
    newest `keep_last` step directories (None keeps all). Re-saving a step that exists but is not `latest` (left by a
    crash between rename and pointer update) replaces it; re-saving the step `latest` names is refused.
    dp: on W ranks every rank calls this (collective) and the main rank gets the directory, the others None.
    """
    dp = dp or DataParallel.single()
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last: expected >= 1 or None, got {keep_last}")
    if not isinstance(config, RunConfig):
        raise TypeError(f"config: expected RunConfig, got {type(config).__name__}")
    root = Path(root)
    name = f"step_{step:08d}"
    started: Path | ValueError | None = None
    if dp.is_main:
        try:
            started = _start_step_dir(root, name)
        except ValueError as e:  # every rank raises it, none waits in a collective for the main rank
            started = e
    tmp = dp.broadcast(started)
    if isinstance(tmp, ValueError):
        raise tmp
    error: BaseException | None = None
    try:
        _write_step_dir(tmp, step=step, policy=policy, critic=critic, optimizers=optimizers,
                        rng_states=rng_states, data_state=data_state, config=config, dp=dp)
    except BaseException as e:  # re-raised below, on every rank
        error = e
    # sync: every rank has written its part before the main rank publishes the directory
    if dp.any(error is not None):
        if dp.is_main:  # only our own half-written directory goes
            shutil.rmtree(tmp, ignore_errors=True)
        raise error if error is not None else RuntimeError("checkpoint: another rank failed to write its part")
    if not dp.is_main:
        return None
    try:
        final = _publish(root, tmp, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for old in sorted(root.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old)
    return final


def _start_step_dir(root: Path, name: str) -> Path:
    """The empty temporary directory a step is written into (stale ones of killed saves removed first)."""
    root.mkdir(parents=True, exist_ok=True)
    if _read_latest(root) == name:
        raise ValueError(f"step: {root / name} is the latest checkpoint; refusing to overwrite it")
    for stale in root.glob(f"{_TMP_PREFIX}*"):  # leftovers of a save that was killed
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    tmp = root / f"{_TMP_PREFIX}{name}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def _publish(root: Path, tmp: Path, name: str) -> Path:
    """fsync the written directory, rename it into place, then move `latest` to it."""
    _fsync_tree(tmp)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, name + "\n")
    return final


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The directory `latest` names under root, or None when root holds no checkpoint yet."""
    name = _read_latest(Path(root))
    return None if name is None else Path(root) / name


def _resolve(path: Path) -> Path:
    if (path / LATEST).exists():
        path = path / _read_latest(path)
    if path.name.startswith(_TMP_PREFIX) or not (path / "state.pt").exists():
        raise FileNotFoundError(f"checkpoint: expected a checkpoint root with a `{LATEST}` file or a complete "
                                f"step directory, got {path}")
    return path


def load_checkpoint(path: str | os.PathLike[str], *, policy: torch.nn.Module | None = None,
                    critic: torch.nn.Module | None = None, optimizers: Mapping[str, Stateful] | None = None,
                    generators: Mapping[str, AnyGenerator] | None = None, restore_rng: bool = True,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint (a root, following `latest`, or one step directory) and return its contents:
    {"path", "step", "policy", "critic", "optimizers", "rng_states", "data_state", "config"}.

    Objects passed in are loaded in place (optimizers by name, which must match the saved names). With
    restore_rng, the global RNG states and the given `generators` are restored (see restore_rng_state).
    Sharded checkpoints (dcp/): models and `distributed.ModelOptimizer`s passed in take their shards at this world
    size (collective when they are sharded); nothing passed in at all returns the whole state dicts (for
    inspection, one process), else the sharded parts come back as None.
    """
    ckpt_dir = _resolve(Path(path))
    with open(ckpt_dir / "state.pt", "rb") as f:
        state = torch.load(f, map_location=map_location, weights_only=True)
    if optimizers is not None and set(optimizers) != set(state["optimizers"]):
        raise ValueError(f"optimizers: expected the saved names {sorted(state['optimizers'])}, got {sorted(optimizers)}")
    if critic is not None and not _has_critic(state):
        raise ValueError(f"critic: the checkpoint {ckpt_dir} holds no critic")
    if state.get("sharded") is not None:
        inspect = policy is None and critic is None and optimizers is None
        state.update(_read_sharded(ckpt_dir / DCP_DIR, state, policy=policy, critic=critic,
                                   optimizers=optimizers or {}, whole=inspect))
    else:
        if policy is not None:
            distributed.load_model_state(policy, state["policy"], whole=True)
        if critic is not None:
            distributed.load_model_state(critic, state["critic"], whole=True)
    if optimizers is not None:
        for name, opt in optimizers.items():
            if name in state["optimizers"] and name not in _dcp_optimizers(state):
                opt.load_state_dict(state["optimizers"][name])
    if restore_rng:
        restore_rng_state(state["rng_states"], generators)
    state.pop("sharded", None)
    return {**state, "path": ckpt_dir, "config": load_config(str(ckpt_dir / "config.toml"), [])}


def _dcp_optimizers(state: Mapping[str, Any]) -> list[str]:
    return list(state["sharded"]["optimizers"]) if state.get("sharded") else []


def _has_critic(state: Mapping[str, Any]) -> bool:
    return state["sharded"]["critic"] if state.get("sharded") else state["critic"] is not None


def _read_sharded(dcp_dir: Path, state: Mapping[str, Any], *, policy: torch.nn.Module | None,
                  critic: torch.nn.Module | None, optimizers: Mapping[str, Stateful], whole: bool) -> dict[str, Any]:
    """The dcp/ parts: loaded into the objects given (each rank its own shards), or read whole (`whole`)."""
    import torch.distributed.checkpoint as dcp
    if whole:  # one process reading everything (inspection): no process group
        import warnings
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            got = _load_state_dict_from_keys(checkpoint_id=str(dcp_dir))
        opts = {name: {**state["optimizers"][name], **got.get("optimizers", {}).get(name, {"state": {}})}
                if name in _dcp_optimizers(state) else o for name, o in state["optimizers"].items()}
        return {"policy": got["policy"], "critic": got.get("critic"), "optimizers": opts}
    template: dict[str, Any] = {}
    if policy is not None:
        template["policy"] = distributed.model_state(policy)
    if critic is not None:
        template["critic"] = distributed.model_state(critic)
    sharded_opts = {}
    saved = _saved_optimizer_entries(dcp_dir)
    for name in _dcp_optimizers(state):
        opt = optimizers.get(name)
        if opt is None:
            continue
        if not isinstance(opt, distributed.ModelOptimizer):
            raise TypeError(f"optimizers[{name!r}]: saved as shards, so it loads through a distributed.ModelOptimizer "
                            f"(the optimizer with its model), got {type(opt).__name__}")
        sharded_opts[name] = {"state": opt.sharded_template(saved.get(name, {}))}
    if any(o["state"] for o in sharded_opts.values()):
        template["optimizers"] = {name: o for name, o in sharded_opts.items() if o["state"]}
    if template:  # no process group: a plain single process reads the shards it needs (W -> 1)
        import warnings
        import torch.distributed as dist
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(template, checkpoint_id=str(dcp_dir), no_dist=not dist.is_initialized())
    if policy is not None:
        distributed.load_model_state(policy, template["policy"], whole=False)
    if critic is not None:
        distributed.load_model_state(critic, template["critic"], whole=False)
    for name, opt_state in sharded_opts.items():
        optimizers[name].load_sharded(opt_state["state"], state["optimizers"][name]["param_groups"])
    return {"policy": None, "critic": None}


def _saved_optimizer_entries(dcp_dir: Path) -> dict[str, dict[str, dict[str, tuple[torch.Size, torch.dtype]]]]:
    """optimizer name -> parameter name -> state key -> (shape, dtype), from the DCP metadata (no data read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    out: dict[str, dict[str, dict[str, tuple[torch.Size, torch.dtype]]]] = {}
    for key, md in FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata.items():
        if not key.startswith("optimizers.") or not isinstance(md, TensorStorageMetadata):
            continue
        opt_name, rest = key[len("optimizers."):].split(".", 1)
        assert rest.startswith("state."), key  # only the state tensors go to dcp/
        param, state_key = rest[len("state."):].rsplit(".", 1)
        out.setdefault(opt_name, {}).setdefault(param, {})[state_key] = (md.size, md.properties.dtype)
    return out
