"""Bytes a rank moves per optimizer step, and the time they take at least (`t1 plan`).

Legend: W ranks, G GPUs per node, N expert-parallel ranks (dp = W / N), T tokens of one micro-batch per rank, L_moe
MoE layers, D model dim, K top-k, c compute-dtype bytes, r gradient-reduce bytes (fp32 under mixed precision).

One optimizer step is one micro-batch of T tokens per rank through the forward and backward of one model (the
policy; the critic's step costs the same again), as `t1core.update` runs it. Counted per rank, what it receives
(a ring collective moves (W - 1) / W of the whole through every rank):
- FSDP2 (t1core.distributed): each unit all-gathered for the forward and each decoder layer again for the
  backward (the root stays gathered), in the compute dtype; gradients reduce-scattered in r bytes. With EP only
  the parameters that are not experts.
- EP (t1core.expert_parallel): per MoE layer, T K rows of D in the compute dtype leave for their experts and come
  back, in the forward and again in the backward (and once more for the recomputed forward under activation
  checkpointing), (N - 1) / N of them to other ranks under uniform routing; the experts' fp32 gradients are
  all-reduced over the dp replicas (2 (dp - 1) / dp of them). With parallel.shard_experts instead: the local
  experts' dp shards all-gathered in the compute dtype for each forward (twice under activation checkpointing: the
  recompute gathers again; without it the gathered copy lives until the backward) and their fp32 gradients
  reduce-scattered, (dp - 1) / dp of each.
- CPU offload: FSDP2 copies each fp32 shard to the GPU before every gather and the sharded fp32 gradients back;
  EP's host-resident experts (their dp shards under shard_experts) are copied up in fp32 for each forward (twice
  under activation checkpointing) and their gradients down.
Links: a group within one node runs at NVLink speed, one spanning nodes at InfiniBand speed (one NIC per GPU),
host copies at PCIe speed. The lower bound is the busiest link's bytes over its bandwidth (everything else
overlapped); nothing here is measured on GPUs (bench/test_bench_ep.py compares the bytes with gloo runs).
Per-GPU bandwidths by default: NVLink 4 (H100/H200 SXM) 450 GB/s each way, a 400 Gb/s NDR NIC 50 GB/s, PCIe 5 x16
~55 GB/s of its 64 (NVIDIA's H200 and ConnectX-7 datasheets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from t1model.model import ModelConfig

LINKS = ("nvlink", "ib", "pcie")


@dataclass(frozen=True)
class CommRow:
    name: str
    bytes: int
    link: str  # one of LINKS


def is_expert(name: str) -> bool:
    return name.endswith(("mlp.experts.w13", "mlp.experts.w2"))


def _split(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int]:
    """(parameters outside experts, of which in decoder layers, expert parameters) in elements."""
    other = layers = experts = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        if is_expert(name):
            experts += n
        else:
            other += n
            layers += n if name.startswith("model.layers.") else 0
    return other, layers, experts


def comm_rows(mcfg: ModelConfig, shapes: dict[str, tuple[int, ...]], *, world: int, gpus_per_node: int, ep: int,
              tokens: int, compute: int, mixed: bool, checkpointing: bool, offload: bool,
              shard_experts: bool = False) -> list[CommRow]:
    """What one rank moves in one optimizer step of one model, by link (see the module docstring)."""
    other, layers, experts = _split(shapes)
    fsdp_params = other if ep > 1 else other + experts
    fsdp_layers = layers if ep > 1 else layers + experts
    reduce = 4 if mixed else compute
    stored = 4 if mixed else compute
    ring = (world - 1) / world
    across = "ib" if world > gpus_per_node else "nvlink"
    rows = [CommRow("FSDP all-gather, forward (compute dtype)", int(compute * fsdp_params * ring), across),
            CommRow("FSDP all-gather, backward (decoder layers)", int(compute * fsdp_layers * ring), across),
            CommRow(f"FSDP reduce-scatter of gradients ({'fp32' if reduce == 4 else 'compute dtype'})",
                    int(reduce * fsdp_params * ring), across)]
    if ep > 1:
        dp = world // ep
        passes = 6 if checkpointing else 4
        rows_per_pass = tokens * mcfg.num_experts_per_tok * mcfg.hidden_size * compute * (ep - 1) / ep
        rows.append(CommRow(f"EP all-to-all ({passes} per MoE layer: dispatch + combine, forward"
                            f"{', recompute' if checkpointing else ''} and backward)",
                            int(passes * len(mcfg.moe_layer_ids) * rows_per_pass), "nvlink" if ep <= gpus_per_node
                            else "ib"))
        dp_link = "ib" if world > gpus_per_node else "nvlink"
        gathers = 2 if checkpointing else 1
        if shard_experts:
            rows.append(CommRow(f"EP expert shards all-gathered over dp={dp} ({gathers} per layer, compute dtype)",
                                int(gathers * (dp - 1) / dp * compute * experts / ep), dp_link))
            rows.append(CommRow(f"EP expert gradients reduce-scattered over dp={dp} (fp32)",
                                int((dp - 1) / dp * 4 * experts / ep), dp_link))
        else:
            rows.append(CommRow(f"EP expert gradients all-reduced over dp={dp} (fp32)",
                                int(2 * (dp - 1) / dp * 4 * experts / ep), dp_link))
    if offload:
        shard = fsdp_params / world
        rows.append(CommRow("offload: FSDP shards to the GPU (fp32, forward + backward)",
                            int(stored * (shard + fsdp_layers / world)), "pcie"))
        rows.append(CommRow("offload: FSDP sharded gradients to the host", int(reduce * shard), "pcie"))
        if ep > 1:
            local = experts / ep / (world // ep if shard_experts else 1)
            rows.append(CommRow(f"offload: local expert{' shard' if shard_experts else ''}s to the GPU (fp32, "
                                f"{2 if checkpointing else 1} per layer) and their gradients back",
                                int((3 if checkpointing else 2) * 4 * local), "pcie"))
    return rows


def link_seconds(rows: list[CommRow], bandwidth_gbs: dict[str, float]) -> dict[str, float]:
    """Seconds each link needs for its bytes at `bandwidth_gbs` (GB/s = 1e9 bytes/s per GPU)."""
    out = {link: 0.0 for link in LINKS}
    for row in rows:
        out[row.link] += row.bytes / (bandwidth_gbs[row.link] * 1e9)
    return out


def lower_bound_s(rows: list[CommRow], bandwidth_gbs: dict[str, float]) -> float:
    """The busiest link's time: no step moves these bytes faster."""
    return max(link_seconds(rows, bandwidth_gbs).values())


def ep_choices(num_experts: int, world: int) -> list[int]:
    """Every valid parallel.expert_parallel for this model and world (1 included)."""
    return [n for n in range(1, world + 1) if world % n == 0 and num_experts and num_experts % n == 0] or [1]
