"""Data-parallel training over torch.distributed: torchrun ranks, FSDP2-sharded policy and critic.

    torchrun --nproc_per_node=N -m t1core.train [...]      (one process per GPU; gloo ranks on CPU)

Every rank runs the same training loop. Rollouts are split across the ranks: each has its own engine (a whole copy
of the policy, refreshed after every update from a stream of one gathered decoder layer at a time) and its own
sandboxes, runs every W-th episode, and the trajectories
are gathered on every rank (a disaggregated vLLM engine is rank 0's alone: it runs them all, t1core.rollout_ranks). With the batch-invariant engine an episode's tokens do not depend on which rank ran it,
so the trajectories equal a single process's. The main rank (0) writes every file of the run and builds the images;
the SFT transcripts (reference solutions) are split and gathered like the episodes. The updates are data-parallel:
an optimizer step takes one minibatch per rank (`DataParallel.rounds`), and FSDP2 (`fully_shard`: parameters,
gradients and optimizer state split across ranks, each decoder layer all-gathered around its use) averages the
gradients. Equivalence: one step over W minibatches equals one single-process step on the mean of their losses
(tests/test_distributed.py compares the two). A round with fewer minibatches than ranks gives its idle ranks one of
the round's minibatches at loss weight 0 (FSDP's collectives need every rank in every forward and backward) and
scales the others by W / (minibatches in the round), so that the average stays the mean of the real ones.

No whole model is gathered onto one rank on the training path: checkpoints are each rank's shards (DCP,
t1core.checkpoint.save), HF exports (t1core.checkpoint.hf) and engine syncs stream one layer at a time
(`iter_hf_tensors`), the KL anchor and a policy loaded from a checkpoint are filled shard by shard (`frozen_shards`,
`sharded_from_pretrained`).
Mixed precision (model.dtype bf16) keeps fp32 master shards under FSDP2's MixedPrecisionPolicy.

Without torchrun (WORLD_SIZE unset or 1) `DataParallel.single()` stands in: no sharding, and every helper is the
identity, so a single-process fp32 run computes exactly what it did before this module existed. A single bf16 (or
CPU-offloaded) process shards over a one-rank group, to keep fp32 masters exactly as W ranks do.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from t1model.device import check_device

T = TypeVar("T")
R = TypeVar("R")

# Ranks wait in a collective while rank 0 alone builds the task images, or while the slowest rank finishes its
# episodes or reference solutions: the default NCCL watchdog (10 min) would kill a run whose rollouts take longer.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel ranks (world_size 1: a plain single-process run)."""

    rank: int
    world_size: int

    @classmethod
    def single(cls) -> DataParallel:
        return cls(rank=0, world_size=1)

    @property
    def is_main(self) -> bool:
        """Rank 0: files, logging, images."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rounds(self, num_items: int) -> list[tuple[int, float]]:
        """Per optimizer step, (item index this rank runs, its loss weight) for items 0..num_items-1 taken W at
        a time in order. A rank past the last item of the final round gets that round's first item at weight 0;
        the others get W / (items in the round) (1.0 whenever the round is full, and always when W = 1)."""
        if num_items < 0:
            raise ValueError(f"num_items: expected >= 0, got {num_items}")
        out = []
        for start in range(0, num_items, self.world_size):
            real = min(self.world_size, num_items - start)
            mine = start + self.rank
            out.append((mine, self.world_size / real) if mine < num_items else (start, 0.0))
        return out

    def map(self, items: Sequence[T], fn: Callable[[T], R]) -> list[R]:
        """[fn(x) for x in items], each computed on one rank (round-robin by `rounds`), the results gathered on
        every rank in order. fn must be collective-safe: every rank calls it once per round (idle ranks on a
        duplicate item whose result is dropped). Results travel pickled: keep them small and on the CPU."""
        if not self.distributed:
            return [fn(x) for x in items]
        out: list[Any] = [None] * len(items)
        for i, weight in self.rounds(len(items)):
            result = fn(items[i])
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (i, result) if weight > 0 else None)
            for entry in gathered:
                if entry is not None:
                    out[entry[0]] = entry[1]
        return out

    def broadcast(self, obj: T) -> T:
        """The main rank's `obj` on every rank (pickled; others pass anything, e.g. None)."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_strided(self, mine: list[T], total: int) -> list[T]:
        """Every rank's `items[rank::world_size]` results put back in the order of the full list, on every rank."""
        if not self.distributed:
            return mine
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        out: list[Any] = [None] * total
        for rank, part in enumerate(parts):
            out[rank::self.world_size] = part
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank (a decision all ranks must take together)."""
        if not self.distributed:
            return flag
        # NCCL reduces CUDA tensors only; gloo takes CPU ones.
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        t = torch.tensor([float(flag)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather_lists(self, metrics: dict[str, list[float]]) -> dict[str, list[float]]:
        """Per-key concatenation of every rank's metric lists (rank order), so summaries cover all ranks."""
        if not self.distributed:
            return metrics
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, dict(metrics))
        merged: dict[str, list[float]] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, []).extend(v)
        return merged


def init_from_env(device: str) -> DataParallel:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU), with this rank's GPU
    (cuda:LOCAL_RANK) made the current device; otherwise the single-process stand-in."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(device)
    check_device(dev)
    if world <= 1:
        return DataParallel.single()
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ValueError(f"run.device={device!r}: data-parallel runs take 'cpu' (gloo) or 'cuda' (NCCL)")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size())


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is managed by FSDP2 (its parameters are DTensors), on any number of ranks."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def _ensure_group(device: torch.device) -> None:
    """A one-rank process group for FSDP2 in a single process (mixed precision or CPU offload without torchrun)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def shard_(model: nn.Module, dp: DataParallel, *, param_dtype: torch.dtype | None = None,
           cpu_offload: bool = False, expert_parallel: int = 1, shard_experts: bool = False) -> nn.Module:
    """FSDP2 in place: each decoder layer its own unit (all-gathered for its forward and backward), then the root
    (embedding, final norm, heads). Build optimizers after this call: it replaces the parameters by sharded DTensors.

    param_dtype (e.g. bfloat16): `MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)` over the model's fp32
    parameters, which stay the sharded master weights AdamW updates (its state fp32 too); layers are gathered and
    computed in param_dtype and gradients reduced in fp32. cpu_offload: `CPUOffloadPolicy`, shards, gradients and
    optimizer state in host memory. Either one shards a single process too (a one-rank group): the same numerics
    as on W ranks. Neither, single process: no-op (the model stays plain). expert_parallel N > 1: each MoE layer
    keeps E/N whole experts per rank, outside FSDP2, dispatched by all-to-all (t1core.expert_parallel);
    shard_experts: those further sharded over the dp replicas."""
    if is_sharded(model) or not (dp.distributed or param_dtype is not None or cpu_offload):
        return model  # already sharded (e.g. `sharded_from_pretrained`), or nothing to do
    if param_dtype is not None and any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(f"param_dtype={param_dtype}: mixed precision keeps fp32 masters; build the model in float32")
    _ensure_group(next(model.parameters()).device)
    if expert_parallel > 1:
        from t1core.expert_parallel import apply_expert_parallel_, make_expert_parallel
        apply_expert_parallel_(model, make_expert_parallel(expert_parallel, shard=shard_experts))
        if cpu_offload:  # the experts' masters, gradients and AdamW state in host memory, as FSDP2 offloads
            for p in model.parameters():
                if getattr(p, "expert_rows", None) is not None:
                    p.data = p.data.cpu()
    _fully_shard(model, param_dtype=param_dtype, cpu_offload=cpu_offload)
    # read by compute_dtype(): what exports, engine syncs and the KL anchor carry
    model.compute_dtype = param_dtype or next(model.parameters()).dtype
    return model


def _fully_shard(model: nn.Module, *, param_dtype: torch.dtype | None, cpu_offload: bool) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from t1core.expert_parallel import is_expert_param
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    experts = {p for p in model.parameters() if is_expert_param(p)} or None  # EP experts: whole, not sharded
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload, ignored_params=experts)
    fully_shard(model, mp_policy=mp, offload_policy=offload, ignored_params=experts)


def _tag_experts(model: nn.Module) -> None:
    from t1core.expert_parallel import tag_experts_
    tag_experts_(model)


def _shard_rows(p: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of dim 0 this rank holds of an FSDP2 parameter (Shard(0): ceil(d0 / W)-row chunks in rank
    order, the last ones shorter or empty)."""
    from torch.distributed.tensor import DTensor
    if getattr(p, "expert_rows", None) is not None:  # expert parallelism: this rank's experts (`_fill_rows_`)
        return p.expert_rows
    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    mesh = p.device_mesh
    chunk = -(-p.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * chunk, p.shape[0])
    return start, start + p.to_local().shape[0]


def _local_device(cpu_offload: bool) -> torch.device:
    """Where this rank's shards live: its GPU under NCCL (host memory with CPU offload), the CPU under gloo."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl and not cpu_offload else torch.device("cpu")


def _fill_rows_(model: nn.Module, hf_dir: Path) -> None:
    """Each of `model`'s (sharded) parameters takes its own rows from the HF checkpoint `hf_dir`."""
    from torch.distributed.tensor import DTensor
    from t1model.hf_io import row_reader
    with torch.no_grad(), row_reader(hf_dir) as read:
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.shape[0]:
                rows = read(model.config, name, *_shard_rows(p))
                cols = getattr(p, "expert_cols", None)  # shard_experts: this dp rank's columns of its experts
                local.copy_(rows if cols is None else rows[:, slice(*cols)])


def sharded_from_pretrained(path: Path, dp: DataParallel, *, dtype: torch.dtype,
                            param_dtype: torch.dtype | None = None, cpu_offload: bool = False,
                            expert_parallel: int = 1,
                            shard_experts: bool = False) -> nn.Module:
    """`t1model.hf_io.load_pretrained(path)` already sharded (see `shard_` for the keywords), built on the meta device:
    each rank reads only its own rows of every tensor, so no rank ever holds the whole model. Collective."""
    from t1model.hf_io import read_config
    from t1model.model import MoEModel
    model = MoEModel(read_config(path), seed=None, dtype=dtype, device="meta")
    shard_(model, dp, param_dtype=param_dtype, cpu_offload=cpu_offload, expert_parallel=expert_parallel,
           shard_experts=shard_experts)
    model.to_empty(device=_local_device(cpu_offload))
    _tag_experts(model)  # to_empty dropped the EP experts' tags, which say which rows each rank reads
    _fill_rows_(model, path)
    return model


def sharded_critic(policy: nn.Module, dp: DataParallel, *, param_dtype: torch.dtype | None = None,
                   cpu_offload: bool = False, expert_parallel: int = 1,
                   shard_experts: bool = False) -> nn.Module:
    """`ValueModel.from_policy(policy)` for a sharded policy: sharded the same way, its trunk copied shard by shard
    from the policy's, its head zero. Collective."""
    from torch.distributed.tensor import DTensor
    from t1model.model import ValueModel
    dtype = next(p for p in policy.parameters()).dtype
    critic = ValueModel(policy.config, seed=None, dtype=dtype, device="meta")
    shard_(critic, dp, param_dtype=param_dtype, cpu_offload=cpu_offload, expert_parallel=expert_parallel,
           shard_experts=shard_experts)
    critic.to_empty(device=_local_device(cpu_offload))
    _tag_experts(critic)
    mine = dict(policy.named_parameters())
    with torch.no_grad():
        for name, p in critic.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if name.startswith("value_head."):
                local.zero_()
            else:
                src = mine[name]
                local.copy_(src.to_local() if isinstance(src, DTensor) else src)
    return critic


def frozen_shards(model: nn.Module, *, hf_dir: Path | None = None) -> nn.Module:
    """A frozen copy of a sharded `model`, sharded the same way and stored in its compute dtype (no master weights,
    no offload): each rank fills only its own shards, from the model's shards or, with `hf_dir`, from the rows of a
    HF checkpoint it reads (no rank reads or holds the whole model). Collective (it shards)."""
    from torch.distributed.tensor import DTensor
    dtype = compute_dtype(model)
    model.reshard()  # after a forward without backward the root holds gathered tensors; we copy shards
    from t1core.expert_parallel import apply_expert_parallel_, expert_parallel_of
    ref = type(model)(model.config, seed=None, dtype=dtype, device="meta")
    mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
    if expert_parallel_of(model) is not None:  # the same experts on the same ranks
        apply_expert_parallel_(ref, expert_parallel_of(model))
    _fully_shard(ref, param_dtype=None, cpu_offload=False)
    ref.to_empty(device=torch.device(mesh.device_type, torch.cuda.current_device())
                 if mesh.device_type == "cuda" else torch.device("cpu"))
    _tag_experts(ref)
    ref.compute_dtype = dtype
    if hf_dir is not None:
        _fill_rows_(ref, hf_dir)
        return ref
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            src = mine[name]
            (p.to_local() if isinstance(p, DTensor) else p).copy_(src.to_local() if isinstance(src, DTensor) else src)
    return ref


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in: the mixed-precision param_dtype of a sharded model, else its weights'."""
    return getattr(model, "compute_dtype", None) or next(model.parameters()).dtype


def checkpoint_layers_(model: nn.Module) -> nn.Module:
    """Activation checkpointing per decoder layer, in place: a layer's forward keeps only its inputs and runs again
    in the backward (torch.utils.checkpoint, non-reentrant). Parameter names stay as they are (no wrapper module).
    Apply to a model the engine does not share (its copy is taken before) and before or after `shard_`: FSDP2
    gathers the layer's parameters for the backward, where the recompute runs."""
    from torch.utils.checkpoint import checkpoint
    for layer in model.model.layers:
        forward = layer.forward

        def checkpointed(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # scoring passes and the engine keep nothing: nothing to recompute
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    return model


def reshard_(models: Sequence[nn.Module | None], dp: DataParallel) -> None:
    """Reshard FSDP2 roots after forwards without autograd (a scoring pass). FSDP2 keeps the root's parameters
    (embedding, final norm, heads) unsharded after its forward, to reshard them in the backward; without a
    backward they stay so, and the next training backward then produced a wrong update (measured in
    tests/test_distributed.py). No-op for a single process."""
    for model in models:
        if model is not None and is_sharded(model):
            model.reshard()


def _unit_groups(model: nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's parameters grouped as FSDP2 gathers them: each decoder layer one group, every other parameter
    (embedding, final norm, heads) a group of its own."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        key = ".".join(parts[:3]) + "." if parts[:2] == ["model", "layers"] else name
        groups.setdefault(key, []).append((name, p))
    return list(groups.values())


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: a DTensor all-gathered (collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    from t1core.expert_parallel import is_expert_param, whole_experts
    if is_expert_param(t):  # the layer's experts from their EP owners (only this layer's)
        return whole_experts(t)
    if not isinstance(t, DTensor):
        return t.detach()
    if t.device.type == "cpu" and dist.get_backend() == "nccl":  # CPU-offloaded shards: NCCL gathers on the GPU
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    return t.detach().full_tensor()


def iter_hf_tensors(model: nn.Module, *, dtype: torch.dtype | None = None,
                    sorted_names: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF Qwen3-MoE name, whole tensor) of every weight of `model`, one FSDP2 unit gathered at a time: a decoder
    layer's parameters are all-gathered, converted to HF names (stacked experts split per expert,
    `t1model.hf_io.hf_items`), cast to `dtype`, yielded and dropped before the next layer is gathered, so a
    rank never holds more than its own shards and one layer (plus whatever the consumer keeps).

    Collective when the model is sharded: every rank must run the iterator to its end, in step. `sorted_names`
    yields in sorted name order (what a sharded safetensors export needs); else in the model's layer order."""
    from t1model.hf_io import hf_items
    from t1core.expert_parallel import is_expert_param
    groups = _unit_groups(model)
    if sorted_names:
        def names(name: str, p: torch.Tensor) -> list[str]:  # on a meta stand-in: slicing a DTensor communicates
            shape = (model.config.num_experts, *p.shape[1:]) if is_expert_param(p) else p.shape  # EP: whole
            return [h for h, _ in hf_items(model.config, name, torch.empty(shape, device="meta"))] or [name]
        first = {id(g): min(h for n, p in g for h in names(n, p)) for g in groups}
        groups.sort(key=lambda g: first[id(g)])
    for group in groups:
        items = []
        for name, p in group:
            whole = _whole(p)
            items += hf_items(model.config, name, whole if dtype is None else whole.to(dtype))
        for item in sorted(items, key=lambda kv: kv[0]) if sorted_names else items:
            yield item
        del items, whole


def _full_options(**kw: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_state_dict(model: nn.Module, dp: DataParallel) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the main rank's CPU ({} on the others; collective when sharded). For tests
    and benchmarks only: the training path streams (`iter_hf_tensors`) or saves shards (DCP) instead."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from t1core.expert_parallel import is_expert_param, whole_experts
    state = get_model_state_dict(model, options=_full_options())
    for name, p in model.named_parameters():
        if is_expert_param(p):  # one layer's experts at a time, from their EP owners
            whole = whole_experts(p).cpu()
            state.pop(name, None)
            if dp.is_main:
                state[name] = whole
    return state


class ModelOptimizer:
    """An optimizer together with the model it updates, as checkpoints save it: whole (`state_dict`, the format of
    a single-process run) while the model is plain, else as each rank's own shards of the moments under parameter
    names (`sharded_state`, written and read with torch.distributed.checkpoint) plus the parameter groups
    (`param_groups`, the same on every rank). Loads either format into either: a whole state into shards (a
    single-process checkpoint resumed on W ranks) or shards into a plain model (DCP reshards).

    The states are taken as they are: a parameter with no state yet (frozen, or an actor before its first step)
    has none after a resume either. (`torch.distributed.checkpoint.state_dict`'s helpers would first take a zero
    step to create every state, which changes the run: AdamW's step count enters its bias correction.)"""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    def _order(self) -> list[str]:
        """Parameter names in the optimizer's order (its state is keyed by position in this list)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for g in self.opt.param_groups for p in g["params"]]

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A whole optimizer state (parameters by index, as `torch.optim` saves it); sharded: each rank keeps the
        rows of every moment that match its shard of the parameter."""
        if not self.sharded:
            self.opt.load_state_dict(state)
            return
        from torch.distributed.tensor import DTensor, distribute_tensor
        from t1core.expert_parallel import expert_slice, is_expert_param
        order, params = self._order(), self._params()
        local = {}
        for i, entry in state["state"].items():
            p = params[order[i]]
            if is_expert_param(p):  # expert parallelism: this rank's experts' rows of each moment
                local[i] = {k: expert_slice(p, v).to(p.device).clone() if torch.is_tensor(v) and v.dim() else v
                            for k, v in entry.items()}
                continue
            local[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                        if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape else v
                        for k, v in entry.items()}
        self.opt.load_state_dict({"state": local, "param_groups": state["param_groups"]})

    def sharded_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's state tensors by parameter name (moments as DTensors of this rank's shards; an EP expert's as
        a DTensor view of the whole, `t1core.expert_parallel.expert_dtensor`)."""
        from t1core.expert_parallel import expert_dtensor, is_expert_param
        order, params = self._order(), self._params()
        out = {}
        for i, v in self.opt.state_dict()["state"].items():
            p = params[order[i]]
            out[order[i]] = {k: expert_dtensor(t, p) if is_expert_param(p) and torch.is_tensor(t)
                             and t.shape == p.shape else t for k, t in v.items()}
        return out

    def param_groups(self) -> list[dict[str, Any]]:
        """The parameter groups (hyperparameters), parameters by name."""
        order = self._order()
        return [{**g, "params": [order[i] for i in g["params"]]} for g in self.opt.state_dict()["param_groups"]]

    def sharded_template(self, saved: dict[str, dict[str, tuple[torch.Size, torch.dtype]]]) -> dict[str, Any]:
        """Tensors `dcp.load` fills, for the saved state entries (name -> key -> (shape, dtype)): moments shaped and
        sharded like this rank's parameter, scalars (AdamW's step) as they were saved."""
        from t1core.expert_parallel import expert_dtensor, is_expert_param
        params = self._params()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, keys in saved.items():
            if name not in params:
                raise ValueError(f"optimizer state: the checkpoint has state for {name!r}, which this model lacks")
            p = params[name]
            if is_expert_param(p):  # the whole [E, ., .] saved; this rank reads its own experts' rows
                out[name] = {k: expert_dtensor(torch.zeros_like(p, dtype=dtype), p)
                             if len(shape) == p.dim() else torch.zeros(shape, dtype=dtype)
                             for k, (shape, dtype) in keys.items()}
                continue
            out[name] = {k: torch.zeros_like(p, dtype=dtype) if shape == p.shape else torch.zeros(shape, dtype=dtype)
                         for k, (shape, dtype) in keys.items()}
        return out

    def load_sharded(self, state: dict[str, dict[str, torch.Tensor]], param_groups: list[dict[str, Any]]) -> None:
        """Load what `sharded_state` and `param_groups` saved (filled in by `dcp.load` at this world size)."""
        from torch.distributed.tensor import DTensor
        from t1core.expert_parallel import is_expert_param
        index, params = {n: i for i, n in enumerate(self._order())}, self._params()
        state = {n: {k: t.to_local() if is_expert_param(params[n]) and isinstance(t, DTensor) else t
                     for k, t in v.items()} for n, v in state.items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in param_groups]
        self.opt.load_state_dict({"state": {index[n]: v for n, v in state.items()}, "param_groups": groups})


def _load_full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True)


def model_state(model: nn.Module) -> dict[str, Any]:
    """This rank's shards of the model's state (plain tensors for a plain model): what DCP saves, and the template
    it loads into. Under expert parallelism a layer's local experts are a DTensor view of the whole [E, ., .]
    (sharing their storage), so the checkpoint holds every expert once and loads at any EP size."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from t1core.expert_parallel import expert_dtensor, is_expert_param
    state = get_model_state_dict(model)
    for name, p in model.named_parameters():
        if is_expert_param(p):
            state[name] = expert_dtensor(p.detach(), p)
    return state


def _local_experts(model: nn.Module, state: dict[str, Any], *, whole: bool) -> dict[str, Any]:
    """`state` with each EP expert entry made this rank's plain rows: a DTensor's local part, or (`whole`) the
    rows of the whole tensor this rank owns."""
    from torch.distributed.tensor import DTensor
    from t1core.expert_parallel import expert_slice, is_expert_param
    out = dict(state)
    for name, p in model.named_parameters():
        if is_expert_param(p) and name in out:
            v = out[name]
            out[name] = v.to_local() if isinstance(v, DTensor) else expert_slice(p, v) if whole else v
    return out


def load_model_state(model: nn.Module, state: dict[str, Any], *, whole: bool) -> None:
    """Load `state` into `model`: this rank's shards (`whole` False, from DCP) or a whole state dict (`whole`,
    a single-process checkpoint), each rank taking its own shards of it."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    state = _local_experts(model, state, whole=whole)
    set_model_state_dict(model, state, options=_load_full_options() if whole else None)


def close(dp: DataParallel) -> None:
    """Leave the process group (torchrun's, or the one-rank group `shard_` made for a single process)."""
    if dist.is_initialized():
        dist.destroy_process_group()
