"""Expert parallelism (EP): each MoE layer's experts split over N ranks, routed tokens carried by all-to-all.

Legend: T tokens, D model dim, E experts, El = E / N experts per EP rank, K top-k, P = T*K (token, slot) pairs in
flat order t * K + k, S the pairs sorted by owning rank, R rows this rank receives, N EP ranks, W world size.

The W ranks form a 2-D mesh (dp x ep) with W = dp * N, ranks row-major: an EP group is N consecutive ranks (one
node's GPUs, on NVLink, when N <= GPUs per node). EP rank j of every group holds experts [j El, (j + 1) El) of every
MoE layer as plain local parameters, which FSDP2 ignores; attention, dense layers, routers and the root stay
FSDP2-sharded over all W ranks (`t1core.distributed.shard_`). The El experts are whole on each of the W / N dp
replicas, or (parallel.shard_experts) further sharded over them: dp rank i holds columns [i c, (i + 1) c) of dim 1
(c = ceil(dim1 / dp), torch.chunk's split, the last chunks shorter or empty) of every local expert tensor, and the
layer all-gathers them over dp before its experts run and reduce-scatters their gradient over dp in the backward
(`_GatherExperts`, FSDP2's pattern on the dp sub-mesh, written by hand because the experts are read as tensors,
not through a module's forward). Dim 1 rather than dim 0: El need not divide by dp (32 experts over 3 replicas in
the 122B preset), and a (Shard(1) over dp, Shard(0) over ep) DTensor describes the shards to checkpoints.

A layer's forward (`ExpertDispatch`): route as always (the replayed R3 ids in training; the gate weights are the
softmax of this rank's router logits over them, so the router keeps its gradient); count the pairs per owning rank,
exchange the counts (one small all-to-all and one host read: the split sizes; with a replayed routing all layers'
plans are made before the forward in one exchange, `prepare_plans`), send each pair's input row to its
expert's owner (`all_to_all_single`, uneven splits), run the local experts with the project's fused MoE on the
received rows (one expert per row, weight 1), send the outputs back by the reverse all-to-all, and combine them
with the gate weights exactly as `t1kernels.moe_torch` combines (fp32 sum over k in index order). The all-to-alls
are one autograd Function (`_Exchange`) whose backward is the same exchange with the splits swapped: the backward
runs the forward's plans reversed. In the batch-invariant CPU mode every row's expert
output does not depend on how many rows its expert received, so the EP forward is bitwise the single-rank one.

Gradients: an expert's weight gradient on its owner is the sum over the N ranks of its EP group (the reverse
all-to-all carried their output gradients there). `_ExpertGrad` then sums it over the dp replicas and divides by
W, which is what FSDP2 does to every other parameter (the mean of the W ranks' losses). The optimizer holds only
this rank's experts. With shard_experts the dp sum is a reduce-scatter (`_GatherExperts`). One row is sent per (token, slot) pair; a token with two experts on one rank travels twice
(what the planner counts, `t1cli.plan`). Public designs do the same: torchtitan's EP all-to-all dispatch
(torchtitan/distributed/expert_parallel.py) also splits by the routed counts exchanged first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from t1kernels.moe import fused_moe

__all__ = ["ExpertParallel", "check_expert_parallel", "make_expert_parallel", "apply_expert_parallel_",
           "expert_parallel_of", "ExpertDispatch", "whole_experts", "is_expert_param", "expert_slice", "tag_experts_"]


def check_expert_parallel(n: int, *, num_experts: int, world: int) -> None:
    """ValueError (one line, naming parallel.expert_parallel) unless N divides both E and the world size."""
    if n == 1:
        return
    if num_experts == 0 or num_experts % n:
        raise ValueError(f"parallel.expert_parallel: expected a divisor of the model's num_experts={num_experts}, "
                         f"got {n}")
    if world % n:
        raise ValueError(f"parallel.expert_parallel: expected a divisor of the world size {world} (torchrun's "
                         f"ranks), got {n}")


@dataclass(frozen=True, eq=False)
class ExpertParallel:
    """This rank's place on the (dp x ep) mesh."""

    size: int
    """N: ranks sharing one layer's experts."""
    rank: int
    """This rank's index in its EP group (which El experts it holds)."""
    world: int
    """W: all ranks."""
    group: dist.ProcessGroup
    """The N ranks of this rank's EP group (the all-to-alls)."""
    dp_group: dist.ProcessGroup
    """The W / N ranks holding the same experts (their gradients are summed)."""
    mesh: object
    """The 2-D DeviceMesh ("dp", "ep") (checkpoints describe the experts on it)."""
    dp_rank: int = 0
    """This rank's index in its dp group."""
    shard: bool = False
    """parallel.shard_experts: the local experts further sharded over the dp group (dim 1)."""

    @property
    def dp_size(self) -> int:
        return self.world // self.size

    def expert_rows(self, num_experts: int) -> tuple[int, int]:
        """[first, end) of the global experts this rank holds."""
        per = num_experts // self.size
        return self.rank * per, (self.rank + 1) * per

    def dp_cols(self, n: int) -> tuple[int, int] | None:
        """[first, end) of dim 1 (size n) this rank holds of its local experts under shard_experts (torch.chunk's
        split over the dp group: ceil(n / dp) each, the last ones shorter or empty); None when not sharded."""
        if not self.shard:
            return None
        c = -(-n // self.dp_size)
        start = min(self.dp_rank * c, n)
        return start, min(start + c, n)


_MESHES: dict[tuple[int, int, str, bool], ExpertParallel] = {}


def make_expert_parallel(n: int, *, shard: bool = False) -> ExpertParallel:
    """The (dp x ep) mesh over the initialised process group (collective on first use; cached per process)."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    check_expert_parallel(n, num_experts=n, world=world)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (n, world, device_type, shard)
    if key not in _MESHES:
        same = next((m for k, m in _MESHES.items() if k[:3] == key[:3]), None)  # one mesh for both modes
        mesh = same.mesh if same else init_device_mesh(device_type, (world // n, n), mesh_dim_names=("dp", "ep"))
        _MESHES[key] = ExpertParallel(size=n, rank=mesh.get_local_rank("ep"), world=world,
                                      group=mesh.get_group("ep"), dp_group=mesh.get_group("dp"), mesh=mesh,
                                      dp_rank=mesh.get_local_rank("dp"), shard=shard)
    return _MESHES[key]


class _ExpertGrad(torch.autograd.Function):
    """Identity forward; backward: sum the expert gradient over the dp replicas and divide by W (FSDP2's mean)."""

    @staticmethod
    def forward(ctx, w, ep):  # type: ignore[override]
        ctx.ep = ep
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ep = ctx.ep
        g = g / ep.world
        if ep.dp_size > 1:
            g = g.contiguous()
            dist.all_reduce(g, group=ep.dp_group)
        return g, None


def _gather_cols(w: torch.Tensor, ep: ExpertParallel, n: int) -> torch.Tensor:
    """The dp group's dim-1 shards of the local experts [El, c_i, .] -> [El, n, .] (collective over dp)."""
    c = -(-n // ep.dp_size)
    w = w.movedim(1, 0)  # [c_i, El, .]: the collectives split dim 0
    if w.shape[0] < c:
        w = torch.cat([w, w.new_zeros(c - w.shape[0], *w.shape[1:])])
    out = w.new_empty(c * ep.dp_size, *w.shape[1:])
    dist.all_gather_into_tensor(out, w.contiguous(), group=ep.dp_group)
    return out[:n].movedim(0, 1)


class _GatherExperts(torch.autograd.Function):
    """shard_experts: forward all-gathers this rank's dim-1 shard of the local experts over dp, in the compute dtype;
    backward reduce-scatters the gradient over dp in fp32 and divides by W (FSDP2's mean), as FSDP2 does for its
    units with reduce_dtype float32."""

    @staticmethod
    def forward(ctx, w, ep, n, dtype):  # type: ignore[override]
        ctx.ep, ctx.cols, ctx.dtype = ep, ep.dp_cols(n), w.dtype
        return _gather_cols(w.to(dtype), ep, n)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ep, (lo, hi) = ctx.ep, ctx.cols
        n, c = g.shape[1], -(-g.shape[1] // ep.dp_size)
        g_C = g.to(torch.float32).movedim(1, 0) / ep.world  # [n, El, .]
        g_C = torch.cat([g_C, g_C.new_zeros(c * ep.dp_size - n, *g_C.shape[1:])]).contiguous()
        mine = g_C.new_empty(c, *g_C.shape[1:])
        dist.reduce_scatter_tensor(mine, g_C, group=ep.dp_group)
        return mine[:hi - lo].movedim(0, 1).to(ctx.dtype), None, None, None


@dataclass(frozen=True)
class DispatchPlan:
    """Where one layer's pairs go and come from: built from the routing before any activation moves."""

    token_S: torch.Tensor
    """Token of each sent row (pairs sorted by owning rank, stable: pair order kept per owner)."""
    slot_P: torch.Tensor
    """Sent-row index of each pair (the inverse of the sort)."""
    local_ids_R: torch.Tensor
    """Local expert id (in [0, El)) of each received row."""
    send: list[int]
    """Rows sent to each EP rank."""
    recv: list[int]
    """Rows received from each EP rank."""

    def to(self, device: torch.device) -> DispatchPlan:
        return DispatchPlan(token_S=self.token_S.to(device), slot_P=self.slot_P.to(device),
                            local_ids_R=self.local_ids_R.to(device), send=self.send, recv=self.recv)


def dispatch_plan(ids_TK: torch.Tensor, *, num_local: int, ep: ExpertParallel) -> DispatchPlan:
    """Count the pairs per owner from the routing, exchange the counts and the local expert ids (collective)."""
    K = ids_TK.shape[1]
    ids_P = ids_TK.reshape(-1).long()
    owner_P = torch.div(ids_P, num_local, rounding_mode="floor")
    order_S = torch.sort(owner_P, stable=True).indices
    send_N = torch.bincount(owner_P, minlength=ep.size)
    recv_N = torch.empty_like(send_N)
    dist.all_to_all_single(recv_N, send_N, group=ep.group)
    send, recv = send_N.tolist(), recv_N.tolist()  # sync: the split sizes live on the host
    local_S = ids_P.index_select(0, order_S) - owner_P.index_select(0, order_S) * num_local
    local_R = torch.empty(sum(recv), dtype=local_S.dtype, device=local_S.device)
    dist.all_to_all_single(local_R, local_S, output_split_sizes=recv, input_split_sizes=send, group=ep.group)
    slot_P = torch.empty_like(order_S).scatter_(0, order_S, torch.arange(order_S.numel(), device=order_S.device))
    return DispatchPlan(token_S=order_S // K, slot_P=slot_P, local_ids_R=local_R, send=send, recv=recv)


def prepare_plans(routing_TLK: torch.Tensor, *, num_local: int, ep: ExpertParallel) -> list[DispatchPlan]:
    """Every MoE layer's `DispatchPlan` from a replayed routing [T, L_moe, K], before the forward: the counts of all
    layers in one all-to-all and one host read, the local expert ids of all layers in one more (instead of two
    collectives and a host read per layer). Collective."""
    T, L, K = routing_TLK.shape
    ids_LP = routing_TLK.to(_collective_device()).long().permute(1, 0, 2).reshape(L, T * K)
    owner_LP = torch.div(ids_LP, num_local, rounding_mode="floor")
    order_LS = torch.sort(owner_LP, dim=1, stable=True).indices
    send_NL = torch.stack([torch.bincount(o, minlength=ep.size) for o in owner_LP], dim=1)  # [N, L]
    recv_NL = torch.empty_like(send_NL)
    dist.all_to_all_single(recv_NL, send_NL, group=ep.group)  # L counts to and from every EP rank
    send, recv = send_NL.tolist(), recv_NL.tolist()  # sync: all layers' split sizes, once
    local_LS = (ids_LP.gather(1, order_LS) - owner_LP.gather(1, order_LS) * num_local)
    # Per destination j, its rows of layer 0, then layer 1, ...: one uneven all-to-all for all layers.
    starts = [[sum(send[i][l] for i in range(j)) for j in range(ep.size)] for l in range(L)]
    out = torch.cat([local_LS[l, starts[l][j]:starts[l][j] + send[j][l]] for j in range(ep.size) for l in range(L)])
    got = torch.empty(sum(map(sum, recv)), dtype=out.dtype, device=out.device)
    dist.all_to_all_single(got, out, output_split_sizes=[sum(r) for r in recv],
                           input_split_sizes=[sum(r) for r in send], group=ep.group)
    pieces = list(torch.split(got, [recv[j][l] for j in range(ep.size) for l in range(L)]))
    plans = []
    arange = torch.arange(T * K, device=order_LS.device)
    for l in range(L):
        order_S = order_LS[l]
        local_R = torch.cat([pieces[j * L + l] for j in range(ep.size)])
        slot_P = torch.empty_like(order_S).scatter_(0, order_S, arange)
        plans.append(DispatchPlan(token_S=order_S // K, slot_P=slot_P, local_ids_R=local_R,
                                  send=[send[j][l] for j in range(ep.size)], recv=[recv[j][l] for j in range(ep.size)]))
    return plans


class _Exchange(torch.autograd.Function):
    """Uneven all-to-all of rows; the backward sends the gradients back along the same plan reversed (splits
    swapped)."""

    @staticmethod
    def forward(ctx, x_RD, out_rows, in_rows, group):  # type: ignore[override]
        ctx.plan = (out_rows, in_rows, group)
        out = x_RD.new_empty(sum(out_rows), x_RD.shape[1])
        dist.all_to_all_single(out, x_RD.contiguous(), output_split_sizes=out_rows, input_split_sizes=in_rows,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        out_rows, in_rows, group = ctx.plan
        dx = g.new_empty(sum(in_rows), g.shape[1])
        dist.all_to_all_single(dx, g.contiguous(), output_split_sizes=in_rows, input_split_sizes=out_rows,
                               group=group)
        return dx, None, None, None


def _exchange(x_RD: torch.Tensor, *, out_rows: list[int], in_rows: list[int], ep: ExpertParallel) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: `in_rows[j]` rows go to EP rank j, `out_rows[j]` come from it."""
    return _Exchange.apply(x_RD, out_rows, in_rows, ep.group)


class ExpertDispatch:
    """A MoE layer's expert call under EP (`SparseMoE.dispatch`; `fused_moe`'s signature): w13/w2 are the layer's
    local experts [El, ., .], topk_ids global expert ids. Collective: every EP rank calls it for every layer."""

    def __init__(self, ep: ExpertParallel) -> None:
        self.ep = ep
        self.prepared: DispatchPlan | None = None  # set from the replayed routing before the forward, used once
        # name -> (rows, cols, whole shape) of the layer's expert tensors: the tags `tag_experts_` puts back on
        # parameters that `Module.to_empty` replaced (it drops a tensor's attributes)
        self.tags: dict[str, tuple] = {}

    def __call__(self, x_TD: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, *, validate: bool = True, recompute: bool = False) -> torch.Tensor:
        ep = self.ep
        T, K = topk_ids.shape
        num_local = w13.shape[0]
        if validate and topk_ids.numel() and int(topk_ids.max()) >= num_local * ep.size:  # sync: boundary check
            raise ValueError(f"topk_ids: expected expert ids in [0, {num_local * ep.size}), got {int(topk_ids.max())}")
        plan, self.prepared = self.prepared, None
        if plan is None or plan.token_S.shape[0] != T * K:  # no replay, or a recomputed forward: plan here
            plan = dispatch_plan(topk_ids, num_local=num_local, ep=ep)
        elif plan.token_S.device != x_TD.device:
            plan = plan.to(x_TD.device)
        x_RD = _exchange(x_TD.index_select(0, plan.token_S), out_rows=plan.recv, in_rows=plan.send, ep=ep)
        # The local experts are fp32 masters outside FSDP2, in host memory under parallel.cpu_offload: copied to
        # the activations' device (their gradient comes back by the same copy, reversed), reduced there over the
        # dp replicas in fp32, and computed in the activations' dtype (mixed precision).
        # shard_experts: the dp replicas' column shards all-gathered first (in the compute dtype), the gradient
        # reduce-scattered back to them.
        if ep.shard:
            w13_c, w2_c = (_GatherExperts.apply(w.to(x_TD.device), ep, self.tags[name][2][1], x_TD.dtype)
                           for name, w in (("w13", w13), ("w2", w2)))
        else:
            w13_c, w2_c = (_ExpertGrad.apply(w.to(x_TD.device), ep).to(x_TD.dtype) for w in (w13, w2))
        ones_R1 = torch.ones(x_RD.shape[0], 1, dtype=torch.float32, device=x_RD.device)
        y_RD = fused_moe(x_RD, w13_c, w2_c, plan.local_ids_R[:, None], ones_R1, validate=False, recompute=recompute)
        y_SD = _exchange(y_RD, out_rows=plan.send, in_rows=plan.recv, ep=ep)
        y_TKD = y_SD.index_select(0, plan.slot_P).view(T, K, -1)
        # The combine of t1kernels.moe_torch._combine, op for op (fp32 or fp64 accumulation, k in index order).
        acc = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
        w_TK = topk_weights.to(acc)
        out_TD = None
        for k in range(K):
            r_TD = y_TKD[:, k].to(acc)
            out_TD = r_TD * w_TK[:, k, None] if out_TD is None else torch.addcmul(out_TD, r_TD, w_TK[:, k, None])
        return out_TD.to(x_TD.dtype)


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    from t1model.model import SparseMoE
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def apply_expert_parallel_(model: nn.Module, ep: ExpertParallel) -> nn.Module:
    """In place: every MoE layer keeps only this rank's El experts (sliced from the whole, so a seeded model's
    experts are the single-process bits; with ep.shard this dp rank's columns of them) and dispatches through
    `ExpertDispatch`. Before FSDP2 (`shard_`)."""
    num_experts = model.config.num_experts
    check_expert_parallel(ep.size, num_experts=num_experts, world=ep.world)
    lo, hi = ep.expert_rows(num_experts)
    for moe in _moe_layers(model):
        moe.dispatch = ExpertDispatch(ep)
        for name in ("w13", "w2"):
            old = getattr(moe.experts, name)
            cols = ep.dp_cols(old.shape[1])
            local = old.detach()[lo:hi] if cols is None else old.detach()[lo:hi, cols[0]:cols[1]]
            setattr(moe.experts, name, nn.Parameter(local.clone(), requires_grad=old.requires_grad))
            moe.dispatch.tags[name] = ((lo, hi), cols, tuple(old.shape))  # the whole [E, ., .]
    tag_experts_(model)
    model.expert_parallel = ep
    model.model.register_forward_pre_hook(_prepare_hook, with_kwargs=True)
    return model


def tag_experts_(model: nn.Module) -> nn.Module:
    """Mark every MoE layer's local expert parameters (`is_expert_param`) with their EP group, their rows of the whole
    [E, ., .], their dp columns (shard_experts) and the whole shape. Again after `Module.to_empty`, which replaces
    the parameters and drops these attributes."""
    for moe in _moe_layers(model):
        if isinstance(moe.dispatch, ExpertDispatch):
            for name, (rows, cols, shape) in moe.dispatch.tags.items():
                p = getattr(moe.experts, name)
                p.expert_parallel, p.expert_rows, p.expert_cols, p.expert_shape = moe.dispatch.ep, rows, cols, shape
    return model


def _prepare_hook(trunk: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before a trunk's forward with a replayed routing: every MoE layer's dispatch plan in one exchange (R3 fixes
    the whole routing before the forward; `prepare_plans`). An invalid routing is left to the trunk's own check."""
    from t1kernels.moe import check_routing
    routing = kwargs.get("replay_routing")
    layers = _moe_layers(trunk)
    for moe in layers:  # nothing left over from a forward that raised
        moe.dispatch.prepared = None
    if routing is None or not layers:
        return
    cfg = trunk.config
    if routing.dim() != 3 or routing.shape[1:] != (len(layers), cfg.num_experts_per_tok):
        return
    check_routing(routing, num_experts=cfg.num_experts)
    ep: ExpertParallel = layers[0].dispatch.ep
    plans = prepare_plans(routing, num_local=cfg.num_experts // ep.size, ep=ep)
    for moe, plan in zip(layers, plans):
        moe.dispatch.prepared = plan


def expert_parallel_of(model: nn.Module) -> ExpertParallel | None:
    return getattr(model, "expert_parallel", None)


def is_expert_param(p: torch.Tensor) -> bool:
    """A parameter holding this rank's share of a layer's experts (outside FSDP2)."""
    return getattr(p, "expert_parallel", None) is not None


def expert_slice(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of expert parameter `p` in a whole [E, ., .] tensor (a view): its experts' rows and, under
    shard_experts, its dp columns."""
    t = whole[slice(*p.expert_rows)]
    return t if p.expert_cols is None else t[:, slice(*p.expert_cols)]


def whole_experts(t: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's whole [E, ., .] expert tensor from this rank's part `t` of expert parameter `p` (default: t itself;
    e.g. its gradient): gathered over the dp group under shard_experts, then from the N owners (collective)."""
    p = t if p is None else p
    ep: ExpertParallel = p.expert_parallel
    local = t.detach().contiguous().to(_collective_device())  # offloaded experts: NCCL gathers on the GPU
    if p.expert_cols is not None:
        local = _gather_cols(local, ep, p.expert_shape[1]).contiguous()
    parts = [torch.empty_like(local) for _ in range(ep.size)]
    dist.all_gather(parts, local, group=ep.group)
    return torch.cat(parts)


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def expert_dtensor(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part `t` (the parameter's shape) of expert parameter `p` as a DTensor of the whole [E, ., .]
    (Shard(0) over ep; replicated over dp, or Shard(1) over dp under shard_experts), sharing storage: what
    checkpoints save and load, so that DCP reshards to any other EP size or sharding."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    ep: ExpertParallel = p.expert_parallel
    shape = torch.Size(p.expert_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, ep.mesh, [Shard(1) if ep.shard else Replicate(), Shard(0)], run_check=False,
                              shape=shape, stride=stride)


def expert_grad_norm_sq(params: list[torch.Tensor]) -> torch.Tensor | None:
    """Sum of squares of the expert gradients over the whole model (each expert counted once: summed over the EP
    group, not over the dp replicas, which hold equal copies; under shard_experts over all ranks, which hold
    disjoint parts). None when there are no expert parameters."""
    grads = [p.grad for p in params if is_expert_param(p) and p.grad is not None]
    mine = [p for p in params if is_expert_param(p)]
    if not mine:
        return None
    ep: ExpertParallel = mine[0].expert_parallel
    dev = _collective_device()
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for g in grads:
        sq = sq + g.detach().float().pow(2).sum().to(dev)
    dist.all_reduce(sq, group=None if ep.shard else ep.group)
    return sq
