"""`t1 plan --config FILE [--nodes N] [--gpus-per-node G] [--gpu-mem-gib M] [--host-mem-gib H] [--section.key=value ...]`
(or `python -m t1cli.plan`)

Per-rank memory of a run before renting the nodes: built from the model's shape alone (meta device, no weight is
read), laid out as the trainer lays it out. Ends with `fits: yes|no (peak X GiB of M GiB per rank)`; exit status 0
only when it fits, 1 when it does not (with the settings that would make it fit), 2 on bad input. The hardware is
the planner's own (`Hardware`): the config file's [plan] table (which the trainer skips), then the flags.

Legend: N parameters, W ranks (nodes x GPUs per node), T tokens of one micro-batch, L layers, D model dim, F expert
hidden dim, E experts, K top-k, V vocab, H query heads, Hkv KV heads, Dh head dim, S engine context.

What a rank holds (t1core.distributed, rollout.torch_engine):
- FSDP2 shards dim 0 of every parameter over W ranks: each rank's storage is ceil(d0 / W) rows (padded), its
  gradient and AdamW moments the same rows. With model.dtype bf16 the shards are the fp32 master weights
  (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); with fp32 there is no separate master copy.
- Around its use a decoder layer is all-gathered in the compute dtype (the current one and the prefetched next),
  and the root (embedding, final norm, heads) stays gathered from forward to backward.
- parallel.cpu_offload: shards, gradients and AdamW state in host memory; the GPU keeps the gathered working set.
- Policy and critic (the same trunk plus a scalar head) each have all of the above; their updates run one after
  the other, so activations count once. The KL anchor (algo.kl_coef > 0) is a frozen shard in the compute dtype.
- Each rank's engine: a whole copy of the policy in the compute dtype, an fp32 copy of the LM head for sampling,
  and a KV cache of 2 x rollout.concurrency slots of S = RolloutSection.max_seq_len tokens.
- Activations assume flash-attn varlen (O(T) attention state) and the MoE kernel keeping its pre-activations.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sandbox.cli import Parser, prog_name
from t1config import check, check_types, knob
from t1core.config import RunConfig
from t1config.toml import coerce, read_toml
from t1core.config_toml import PLAN_KEYS, PLANNER_TABLE, load_config
from t1core.expert_parallel import check_expert_parallel
from t1cli.plan_comm import comm_rows, ep_choices, is_expert, link_seconds, lower_bound_s
from t1core.positions import check_positions, describe_context, engine_length
from t1model.model import PRESETS, ModelConfig, MoEModel, ValueModel

GIB = 2**30
RESERVE_BYTES = 3 * GIB
"""CUDA context, NCCL buffers and allocator slack per rank (a flat allowance)."""
# Checkpoint directories that are not on this machine are planned by their (HF repo) name.
KNOWN_CHECKPOINTS = {"qwen3-30b-a3b": "qwen3_30b_a3b", "qwen3-235b-a22b": "qwen3_235b_a22b"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINK_KEYS = ("nvlink_gbs", "ib_gbs", "pcie_gbs")
"""[plan] keys of the link bandwidths (the communication lower bounds, t1cli.plan_comm)."""
PROG = "python -m t1cli.plan"
"""The planner's own name (`t1 plan` runs it under that name: sandbox.cli.invoked_as)."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The machines a plan is made for (read only here; torchrun sets the real ranks)."""

    nodes: int = knob(1, "nodes the run is planned for")
    gpus_per_node: int = knob(1, "GPUs (ranks) per node")
    gpu_mem_gib: float = knob(140.0, "memory of one GPU in GiB the plan must fit (H200: 140)")
    host_mem_gib: float = knob(1800.0, "host memory per node in GiB the plan must fit (what parallel.cpu_offload "
                                         "moves there)")
    nvlink_gbs: float = knob(450.0, "GB/s each way per GPU within a node (NVLink 4 on H100/H200 SXM: 450)")
    ib_gbs: float = knob(50.0, "GB/s per GPU between nodes (one 400 Gb/s NDR InfiniBand NIC per GPU: 50)")
    pcie_gbs: float = knob(55.0, "GB/s host <-> GPU per GPU (PCIe 5 x16: 64 raw, ~55 in practice)")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.nodes >= 1, "plan.nodes", ">= 1", self.nodes)
        check(self.gpus_per_node >= 1, "plan.gpus_per_node", ">= 1", self.gpus_per_node)
        check(self.gpu_mem_gib > 0, "plan.gpu_mem_gib", "> 0", self.gpu_mem_gib)
        check(self.host_mem_gib > 0, "plan.host_mem_gib", "> 0", self.host_mem_gib)
        for key in LINK_KEYS:
            check(getattr(self, key) > 0, f"plan.{key}", "> 0", getattr(self, key))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def bandwidth_gbs(self) -> dict[str, float]:
        return {"nvlink": self.nvlink_gbs, "ib": self.ib_gbs, "pcie": self.pcie_gbs}


def hardware_from(toml_path: str | None, **flags: float | int | None) -> Hardware:
    """The config file's [plan] table (a file written before it existed: its old [parallel] keys), then the flags
    that were given."""
    values: dict[str, object] = {}
    if toml_path is not None:
        raw = read_toml(toml_path)
        old = raw.get("parallel", {}) if isinstance(raw.get("parallel"), dict) else {}
        values = {k: old[k] for k in PLAN_KEYS if k in old}
        table = raw.get(PLANNER_TABLE, {})
        if not isinstance(table, dict) or set(table) - set(PLAN_KEYS + LINK_KEYS):
            raise ValueError(f"{toml_path}: [plan] takes the keys {list(PLAN_KEYS + LINK_KEYS)}, got {table!r}")
        values.update(table)
    values.update({k: v for k, v in flags.items() if v is not None})
    hints = {f.name: f.type for f in dataclasses.fields(Hardware)}
    return Hardware(**{k: coerce(v, {"int": int, "float": float}[hints[k]], f"plan.{k}") for k, v in values.items()})


class PlanError(ValueError):
    """Bad planner input (printed as one line, exit status 2)."""


@dataclass(frozen=True)
class ParamCount:
    total: int
    """Every parameter of the policy (an untied LM head counts)."""
    active: int
    """Parameters one token uses: everything but the experts it is not routed to."""


def model_shape(name: str) -> tuple[ModelConfig, str]:
    """(ModelConfig, where it came from) for model.name: a checkpoint's config.json (read, no weights), a
    ModelConfig preset, or a known checkpoint name when the directory is not on this machine."""
    from t1model.hf_io import config_from_hf
    path = Path(name)
    if (path / "config.json").is_file():
        return config_from_hf(json.loads((path / "config.json").read_text())), f"{path / 'config.json'}"
    if not path.is_dir() and name in PRESETS:
        return PRESETS[name](), f"preset {name}"
    preset = KNOWN_CHECKPOINTS.get(path.name.lower())
    if preset is not None:
        return PRESETS[preset](), f"preset {preset} ({name} is not on this machine)"
    raise PlanError(f"model.name={name!r}: expected a checkpoint directory with config.json, a ModelConfig preset "
                    f"(e.g. 'tiny', 'qwen3_30b_a3b') or one of {sorted(KNOWN_CHECKPOINTS)} by name")


def _meta_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


@functools.lru_cache(maxsize=8)
def policy_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the policy, from a meta-device model (nothing allocated)."""
    return _meta_shapes(MoEModel(cfg, seed=None, device="meta"))


@functools.lru_cache(maxsize=8)
def critic_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return _meta_shapes(ValueModel(cfg, seed=None, device="meta"))


def count_params(cfg: ModelConfig) -> ParamCount:
    """Total and active parameter counts (active: K of E experts per MoE layer)."""
    total = active = 0
    for name, shape in policy_shapes(cfg).items():
        n = math.prod(shape)
        total += n
        is_expert = name.endswith(("mlp.experts.w13", "mlp.experts.w2"))
        active += n * cfg.num_experts_per_tok // cfg.num_experts if is_expert else n
    return ParamCount(total=total, active=active)


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements FSDP2 stores per rank for one parameter: ceil(d0 / W) rows of dim 0 (rank 0's share, padded on the
    others to the same size)."""
    if not shape:
        return 1
    return -(-shape[0] // world) * math.prod(shape[1:])


def _layer_numel(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """(largest decoder layer, root: everything outside the decoder layers) in elements."""
    layers: dict[str, int] = {}
    root = 0
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layers[parts[2]] = layers.get(parts[2], 0) + math.prod(shape)
        else:
            root += math.prod(shape)
    return max(layers.values(), default=0), root


def activation_bytes(cfg: ModelConfig, *, tokens: int, dtype_bytes: int, checkpointing: bool,
                     moe_recompute: bool = False) -> int:
    """Activations one micro-batch of `tokens` keeps for its backward (one model: policy or critic).

    Per token and layer, in the compute dtype: the block's input and norm outputs (3D), q/k before and after their
    norm and RoPE, v, the attention output and its projection input (~3 H Dh + 4 Hkv Dh), the MoE input gathered
    for its K experts, their gate/up pre-activations and products, and their outputs (K (2D + 3F)); fp32 router
    logits and probabilities (2E). With activation checkpointing only each layer's input stays (D per token and
    layer), plus one layer recomputed in full during the backward. `moe_recompute`: the MoE kernel recomputes its
    gate/up pre-activations in the backward instead of keeping them (K 2F per token and layer less)."""
    d, hd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kvd = cfg.num_key_value_heads * cfg.head_dim
    k, f = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    moe = k * (2 * d + (1 if moe_recompute else 3) * f) if cfg.num_experts else 3 * cfg.intermediate_size + d
    per_layer = dtype_bytes * (3 * d + 3 * hd + 4 * kvd + moe) + 4 * 2 * cfg.num_experts
    head = tokens * d * dtype_bytes * 3  # embedding output, final norm, the loss rows' hidden states
    if checkpointing:
        return tokens * (cfg.num_hidden_layers * d * dtype_bytes + per_layer) + head
    return tokens * cfg.num_hidden_layers * per_layer + head


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int
    where: str  # "gpu" | "host" | "-" (shown for information, not counted)


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    source: str
    params: ParamCount
    world: int
    rows: list[Row]
    gpu_bytes: int
    host_bytes_per_node: int
    gpu_limit: int
    host_limit: int
    engine_gpu_bytes: int = 0
    """Per GPU of a disaggregated vLLM engine (0: the engine shares the trainer's GPUs)."""

    @property
    def fits(self) -> bool:
        return (self.gpu_bytes <= self.gpu_limit and self.host_bytes_per_node <= self.host_limit
                and self.engine_gpu_bytes <= self.gpu_limit)


def micro_batch_tokens(cfg: RunConfig) -> int:
    """Tokens one rank forwards and backwards at once: the largest of the RL, SFT and pretraining minibatches."""
    tokens = cfg.algo.minibatch_tokens
    if cfg.warmstart.sft_epochs:
        tokens = max(tokens, cfg.warmstart.sft_minibatch_tokens)
    if cfg.warmstart.pretrain_steps:
        tokens = max(tokens, cfg.warmstart.pretrain_row_tokens)
    return tokens


def _local_numel(name: str, shape: tuple[int, ...], world: int, ep: int, shard_experts: bool = False) -> int:
    """Elements a rank stores of one parameter: an FSDP2 shard, or under expert parallelism (ep > 1) E/N whole
    experts of an expert tensor (t1core.expert_parallel), or with shard_experts their dp rank's ceil(1 / dp) of
    dim 1."""
    if not (ep > 1 and is_expert(name)):
        return shard_numel(shape, world)
    if not shard_experts:
        return math.prod(shape) // ep
    cols = -(-shape[1] // (world // ep))
    return shape[0] // ep * cols * math.prod(shape[2:])


def _ep_local(shapes: dict[str, tuple[int, ...]], ep: int) -> dict[str, tuple[int, ...]]:
    """The shapes with each expert tensor cut to one EP rank's E/N experts (what a layer gathers is then local)."""
    return {n: (s[0] // ep, *s[1:]) if ep > 1 and is_expert(n) else s for n, s in shapes.items()}


def _model_rows(tag: str, shapes: dict[str, tuple[int, ...]], world: int, *, compute: int, mixed: bool,
                where: str, transient: bool, ep: int = 1, shard_experts: bool = False) -> list[Row]:
    """Sharded state of one trained model, and (`transient`) its gathered working set on the GPU: the policy's,
    as the critic's update runs after the policy's and gathers no more. ep > 1: experts whole, E/N per rank (a
    dp shard of them stored with shard_experts; a layer still gathers its E/N whole)."""
    shard = sum(_local_numel(n, s, world, ep, shard_experts) for n, s in shapes.items())
    layer, root = _layer_numel(_ep_local(shapes, ep))
    stored = 4 if mixed else compute  # mixed precision: the fp32 shards are the master weights
    grad_transient = 4 if mixed else compute  # reduce_dtype fp32: unsharded gradients are cast for the reduce
    rows = [
        Row(f"{tag} parameters (sharded, {'fp32' if stored == 4 else 'compute dtype'})", stored * shard, where),
        Row(f"{tag} fp32 master copies ({'= the sharded parameters' if mixed else 'none: fp32 run'})", 0, "-"),
        Row(f"{tag} gradients (sharded)", stored * shard, where),
        Row(f"{tag} optimizer state (AdamW moments, fp32)", 8 * shard, where),
    ]
    if not transient:
        return rows
    return rows + [
        Row(f"{tag} gathered parameters (root + 2 layers, compute dtype)", compute * (root + 2 * layer), "gpu"),
        Row(f"{tag} unsharded gradients (root + 1 layer)", grad_transient * (root + layer), "gpu"),
    ]


def _engine_rows(cfg: RunConfig, mcfg: ModelConfig, *, n_policy: int, compute: int, world: int) -> list[Row]:
    """The rank's rollout engine: TorchEngine holds the whole policy on the rank's GPU; vLLM splits the weights
    over its `vllm.tensor_parallel_size` GPUs and the KV heads over up to Hkv of them. Colocated, vLLM shares the
    trainer's GPU and is counted there (conservatively: it sleeps during updates); disaggregated, it runs on GPUs
    of its own ("engine GPU" rows, not part of the trainer's peak)."""
    r = cfg.rollout
    engine = r.engine
    tp = cfg.vllm.tensor_parallel_size if engine == "vllm" else 1
    where = "engine GPU" if engine == "vllm" and cfg.vllm.placement == "disaggregated" else "gpu"
    split_w, split_kv = (1, 1) if engine == "torch" else (tp, min(tp, mcfg.num_key_value_heads))
    # One engine per rank serves that rank's episodes; a disaggregated vLLM serves every rank's at once.
    # TorchEngine keeps 2 slots per episode (prefix reuse); vLLM pages its cache: one sequence per episode.
    slots = 2 * max(r.concurrency, 1) if where == "gpu" and engine == "torch" else max(r.concurrency, 1)
    slots *= world if where == "engine GPU" else 1
    seq = engine_length(cfg, mcfg)
    kv = 2 * mcfg.num_hidden_layers * slots * mcfg.num_key_value_heads * seq * mcfg.head_dim * compute // split_kv
    head_fp32 = 4 * mcfg.vocab_size * mcfg.hidden_size if compute != 4 and engine == "torch" else 0
    what = "whole policy" if split_w == 1 else f"policy / {split_w} tensor-parallel GPUs"
    return [Row(f"engine weights ({engine}: {what}, compute dtype{', + fp32 LM head' if head_fp32 else ''})",
                compute * n_policy // split_w + head_fp32, where),
            Row(f"engine KV cache ({slots} slots x {seq} tokens)", kv, where)]


def plan(cfg: RunConfig, hw: Hardware) -> Plan:
    """The per-rank memory plan of `cfg` on the hardware `hw`."""
    par = cfg.parallel
    mcfg, source = model_shape(cfg.model.name)
    check_positions(cfg, mcfg, source=source)
    world = hw.world
    compute = _DTYPE_BYTES[cfg.model.dtype]
    mixed = compute != 4
    where = "host" if par.cpu_offload else "gpu"
    pol, cri = policy_shapes(mcfg), critic_shapes(mcfg)
    ep = par.expert_parallel
    try:
        check_expert_parallel(ep, num_experts=mcfg.num_experts, world=world)
    except ValueError as e:
        raise PlanError(str(e)) from None
    se = par.shard_experts
    rows = _model_rows("policy", pol, world, compute=compute, mixed=mixed, where=where,
                       transient=True, ep=ep, shard_experts=se)
    rows += _model_rows("critic", cri, world, compute=compute, mixed=mixed, where=where, transient=False, ep=ep,
                        shard_experts=se)
    if cfg.algo.kl_coef > 0:
        rows.append(Row("KL anchor (frozen shard, compute dtype)",
                        compute * sum(_local_numel(n, s, world, ep, se) for n, s in pol.items()), "gpu"))
    tokens = micro_batch_tokens(cfg)
    recompute = cfg.model.moe_recompute
    for ac in (False, True):
        used = ac == par.activation_checkpointing
        rows.append(Row(f"activations, {tokens} tokens, {'with' if ac else 'without'} activation checkpointing"
                        f"{'' if used else ' (not this run)'}",
                        activation_bytes(mcfg, tokens=tokens, dtype_bytes=compute, checkpointing=ac,
                                         moe_recompute=recompute), "gpu" if used else "-"))
    rows += _engine_rows(cfg, mcfg, n_policy=sum(math.prod(s) for s in pol.values()), compute=compute, world=world)
    rows.append(Row("reserve (CUDA context, NCCL buffers, allocator slack)", RESERVE_BYTES, "gpu"))
    gpu = sum(x.bytes for x in rows if x.where == "gpu")
    host = sum(x.bytes for x in rows if x.where == "host") * hw.gpus_per_node
    engine_gpu = sum(x.bytes for x in rows if x.where == "engine GPU")
    return Plan(model=mcfg, source=source, params=count_params(mcfg), world=world, rows=rows, gpu_bytes=gpu,
                host_bytes_per_node=host, gpu_limit=int(hw.gpu_mem_gib * GIB), host_limit=int(hw.host_mem_gib * GIB),
                engine_gpu_bytes=engine_gpu)


def _with(cfg: RunConfig, section: str, **changes: object) -> RunConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def fixes(cfg: RunConfig, hw: Hardware) -> list[str]:
    """Settings that make a plan fit, each checked by planning again: the first of activation checkpointing, CPU
    offload and a smaller rollout.concurrency (cumulative, in that order) that fits, and the fewest nodes."""
    out, changed, trial = [], [], cfg
    steps = [("parallel", "activation_checkpointing", True), ("parallel", "cpu_offload", True)]
    steps += [("rollout", "concurrency", c) for c in range(cfg.rollout.concurrency - 1, 0, -1)]
    for section, key, value in steps:
        if getattr(getattr(trial, section), key) == value:
            continue
        trial = _with(trial, section, **{key: value})
        changed = [c for c in changed if not c.startswith(f"--{section}.{key}=")]
        changed.append(f"--{section}.{key}={str(value).lower()}")
        p = plan(trial, hw)
        if p.fits:
            out.append(" ".join(changed) + f" (peak {p.gpu_bytes / GIB:.1f} GiB)")
            break
    for nodes in range(hw.nodes + 1, 257):
        p = plan(cfg, dataclasses.replace(hw, nodes=nodes))
        if p.fits:
            out.append(f"--nodes {nodes} (peak {p.gpu_bytes / GIB:.1f} GiB)")
            break
    return out


def vllm_layout(cfg: RunConfig, *, world: int) -> str:
    """One line on how the run's vLLM engines sit among the ranks (t1core.rollout_ranks), and what was run."""
    v, per_rank = cfg.vllm, max(cfg.rollout.concurrency, 1)
    if v.placement == "colocated" or world == 1:
        where = ("one vLLM engine per rank on the rank's own GPU, asleep during updates" if v.placement == "colocated"
                 else f"one vLLM engine (tensor parallel {v.tensor_parallel_size}, executor {v.executor})")
        how = f"{per_rank} episodes at once per rank"
    else:
        where = (f"one vLLM engine owned by rank 0 (tensor parallel {v.tensor_parallel_size}, executor {v.executor}), "
                 "streamed into over NCCL after every all-rank per-layer gather")
        how = f"rank 0 runs every episode, {per_rank * world} at once, and broadcasts the trajectories"
    return (f"rollout: {where}; {how}. Runnable on the trainer side (tested on CPU ranks against a fake vLLM); "
            "never run against a real vLLM")


def step_comm(cfg: RunConfig, hw: Hardware, ep: int, shard_experts: bool | None = None) -> list:
    """`t1cli.plan_comm.comm_rows` for this run with parallel.expert_parallel = ep (and shard_experts, default the
    run's)."""
    mcfg, _ = model_shape(cfg.model.name)
    compute = _DTYPE_BYTES[cfg.model.dtype]
    return comm_rows(mcfg, policy_shapes(mcfg), world=hw.world, gpus_per_node=hw.gpus_per_node, ep=ep,
                     tokens=micro_batch_tokens(cfg), compute=compute, mixed=compute != 4,
                     checkpointing=cfg.parallel.activation_checkpointing, offload=cfg.parallel.cpu_offload,
                     shard_experts=cfg.parallel.shard_experts if shard_experts is None else shard_experts)


def best_expert_parallel(cfg: RunConfig, hw: Hardware) -> int:
    """The valid expert_parallel > 1 with the lowest communication lower bound (1 when there is none)."""
    mcfg, _ = model_shape(cfg.model.name)
    choices = [n for n in ep_choices(mcfg.num_experts, hw.world) if n > 1]
    return min(choices, key=lambda n: (lower_bound_s(step_comm(cfg, hw, n), hw.bandwidth_gbs), n), default=1)


def format_comm(cfg: RunConfig, hw: Hardware) -> list[str]:
    """Bytes per optimizer step and rank with EP off and on (the run's EP, else the fastest valid one; its experts
    whole per dp replica and sharded over dp), their lower bounds at the stated link speeds, and which is faster
    and fits."""
    par = cfg.parallel
    ep = par.expert_parallel if par.expert_parallel > 1 else best_expert_parallel(cfg, hw)
    combos = [(1, False)] + ([(ep, False), (ep, True)] if ep > 1 else [])
    runs = [(n, se, step_comm(cfg, hw, n, se)) for n, se in combos]
    bw = hw.bandwidth_gbs
    heads = [(f"EP {n}{' sharded' if se else ''}" if n > 1 else "EP off")
             + (" (this run)" if (n, se) == (par.expert_parallel, par.shard_experts) else "") for n, se, _ in runs]
    width = max(18, *(len(h) + 2 for h in heads))
    lines = ["", f"communication per optimizer step and rank (a micro-batch of {micro_batch_tokens(cfg)} tokens, "
                 "forward + backward of the policy; the critic's step moves as much again; t1cli.plan_comm):",
             f"{'GB moved':<84}" + "".join(f"{h:>{width}}" for h in heads) + "  link"]
    names = list(dict.fromkeys(r.name for _, _, rows in runs for r in rows))
    for name in names:
        vals = [next((r for r in rows if r.name == name), None) for _, _, rows in runs]
        link = next(r.link for r in vals if r is not None)
        lines.append(f"{name:<84}" + "".join(f"{r.bytes / 1e9:>{width}.1f}" if r else f"{'-':>{width}}" for r in vals)
                     + f"  {link}")
    lines.append(f"{'total':<84}" + "".join(f"{sum(r.bytes for r in rows) / 1e9:>{width}.1f}" for _, _, rows in runs))
    for link in ("nvlink", "ib", "pcie"):
        lines.append(f"{f'seconds on {link} at {bw[link]:g} GB/s':<84}"
                     + "".join(f"{link_seconds(rows, bw)[link]:>{width}.2f}" for _, _, rows in runs))
    bounds = [lower_bound_s(rows, bw) for _, _, rows in runs]
    lines.append(f"{'lower bound (the busiest link)':<84}" + "".join(f"{b:>{width}.2f}" for b in bounds))
    if ep == 1:
        lines.append("expert parallelism: no valid EP size for this model and world (it must divide both)")
    for (n, se, _), bound in list(zip(runs, bounds))[1:]:
        fits = plan(_with(cfg, "parallel", expert_parallel=n, shard_experts=se), hw).fits
        flags = f"--parallel.expert_parallel={n}" + (" --parallel.shard_experts=true" if se else "")
        this = (n, se) == (par.expert_parallel, par.shard_experts)
        lines.append(f"expert parallelism: EP {n}{' sharded over dp' if se else ''} is "
                     f"{'faster' if bound < bounds[0] else 'not faster'} than EP off by the lower bound ({bound:.2f} s "
                     f"vs {bounds[0]:.2f} s per step) and its memory plan {'fits' if fits else 'does not fit'}"
                     + ("" if this else f" ({flags})"))
    return lines


def format_plan(p: Plan, cfg: RunConfig, hw: Hardware) -> str:
    par = cfg.parallel
    lines = [
        f"model: {p.source}: {p.params.total / 1e9:.2f}B parameters, {p.params.active / 1e9:.2f}B active per token "
        f"(D={p.model.hidden_size}, L={p.model.num_hidden_layers}, E={p.model.num_experts}, "
        f"K={p.model.num_experts_per_tok}, F={p.model.moe_intermediate_size}, V={p.model.vocab_size})",
        f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) = {p.world} rank(s), {hw.gpu_mem_gib:g} GiB "
        f"per GPU, {hw.host_mem_gib:g} GiB host per node; model.dtype={cfg.model.dtype}, activation checkpointing "
        f"{'on' if par.activation_checkpointing else 'off'}, CPU offload {'on' if par.cpu_offload else 'off'}, "
        f"expert parallel {par.expert_parallel}{' (experts sharded over dp)' if par.shard_experts else ''}",
        "",
        f"{'per rank':<78} {'GiB':>9}  where",
    ]
    for row in p.rows:
        lines.append(f"{row.name:<78} {row.bytes / GIB:>9.2f}  {row.where}")
    lines.append(f"{'total on each GPU':<78} {p.gpu_bytes / GIB:>9.2f}  of {hw.gpu_mem_gib:g}")
    if p.engine_gpu_bytes:
        lines.append(f"{f'each of the vLLM engine GPUs ({cfg.vllm.tensor_parallel_size}, besides the trainer ranks)':<78} "
                     f"{p.engine_gpu_bytes / GIB:>9.2f}  of {hw.gpu_mem_gib:g}")
    if par.cpu_offload:
        lines.append(f"{'host memory per node (offloaded state of its ranks)':<78} "
                     f"{p.host_bytes_per_node / GIB:>9.2f}  of {hw.host_mem_gib:g}")
    lines += format_comm(cfg, hw)
    lines.append("")
    if cfg.rollout.engine == "vllm":
        lines.append(vllm_layout(cfg, world=p.world))
    lines.append(describe_context(cfg, p.model))
    engine = next(r for r in p.rows if r.name.startswith("engine weights"))
    if engine.bytes > p.gpu_limit:
        lines.append(f"the engine's weights alone ({engine.bytes / GIB:.1f} GiB) exceed one GPU: this model needs a "
                     "tensor-parallel rollout engine (rollout.engine='vllm' with vllm.tensor_parallel_size)")
    if not p.fits:
        found = fixes(cfg, hw)
        lines.append("")
        lines.append("would fit with: " + ("; ".join(found) if found else "none of the single changes tried "
                                            "(activation checkpointing, CPU offload, rollout.concurrency, up to 256 "
                                            "nodes)"))
    where = f"(peak {p.gpu_bytes / GIB:.1f} GiB of {hw.gpu_mem_gib:g} GiB per rank"
    where += f"; host {p.host_bytes_per_node / GIB:.0f} of {hw.host_mem_gib:g} GiB per node)" if par.cpu_offload \
        else ")"
    lines.append(f"fits: {'yes' if p.fits else 'no'} {where}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[RunConfig, Hardware]:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[1].strip(),
               epilog="example: python -m t1cli.plan --config t1core/configs/qwen3_30b_a3b_harbor.toml --nodes 2")
    p.add_argument("--config", help="TOML file of the run (defaults: the embedded CPU run)")
    p.add_argument("--nodes", type=int, help="nodes (default: plan.nodes of the config file, else 1)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: plan.gpus_per_node, else 1)")
    p.add_argument("--gpu-mem-gib", type=float, help="GiB per GPU (default: plan.gpu_mem_gib, else 140)")
    p.add_argument("--host-mem-gib", type=float, help="GiB of host memory per node (default: plan.host_mem_gib, "
                                                        "else 1800)")
    p.add_argument("--nvlink-gbs", type=float, help="GB/s per GPU within a node (default: plan.nvlink_gbs, else 450)")
    p.add_argument("--ib-gbs", type=float, help="GB/s per GPU between nodes (default: plan.ib_gbs, else 50)")
    p.add_argument("--pcie-gbs", type=float, help="GB/s host <-> GPU (default: plan.pcie_gbs, else 55)")
    args, overrides = p.parse_known_args(argv)
    if args.config is not None and not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if bad:
        p.error(f"unrecognised arguments {bad}; config overrides look like --section.key=value")
    try:
        hw = hardware_from(args.config, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                           gpu_mem_gib=args.gpu_mem_gib, host_mem_gib=args.host_mem_gib, nvlink_gbs=args.nvlink_gbs,
                           ib_gbs=args.ib_gbs, pcie_gbs=args.pcie_gbs)
        return load_config(args.config, overrides), hw
    except (ValueError, OSError) as e:
        p.error(str(e).splitlines()[0])
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    cfg, hw = parse_args(argv)
    try:
        p = plan(cfg, hw)
        text = format_plan(p, cfg, hw)
    except ValueError as e:  # PlanError, or a checkpoint's config.json this model cannot load
        print(f"{prog_name(PROG)}: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if p.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
