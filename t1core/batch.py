"""Pack token-native trajectories into one training row, shifted for next-token prediction.

Legend: T packed tokens (all trajectories back to back), B trajectories, L_moe MoE layers, K top-k.

Token i of a trajectory is predicted from the hidden state at i-1 of the same trajectory, so every per-action
field lives at the *input* position that predicts it: `targets_T[i] = ids[i+1]`, `loss_mask_T[i] =
mask[i+1]`, `rollout_logp_T[i] = rollout_logprobs[i+1]`. The last position of each trajectory predicts
nothing (mask 0, target = ignore). Routing is per input token and is replayed for every position, prompt
and observation tokens included, because the trainer's forward runs over the whole sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    input_ids_T: torch.Tensor       # int64 [T]
    cu_seqlens: torch.Tensor        # int64 [B+1]: document boundaries in the packed row
    targets_T: torch.Tensor         # int64 [T]: next token, IGNORE_INDEX where nothing is trained
    loss_mask_T: torch.Tensor       # bool [T]: True where targets_T is a sampled (trainable) token
    rollout_logp_T: torch.Tensor    # float32 [T]: behaviour log-prob of targets_T (0 off the mask)
    routing_TLK: torch.Tensor | None  # compact int [T, L_moe, K] recorded at rollout, or None
    traj_index_T: torch.Tensor      # int64 [T]: which trajectory each position belongs to
    reward_B: torch.Tensor          # float32 [B]: scalar reward of each trajectory

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch with every tensor on `device` (`pack` builds on the host; the trainer moves each minibatch to
        the model's device when it is used). Tensors already there are kept as they are, not copied."""
        return tensors_to(self, device)


def tensors_to(obj, device: torch.device | str):
    """A copy of dataclass `obj` with every tensor or PackedBatch field moved to `device`, the other fields as they
    are. Generic over the fields, so that a field added later cannot be left behind on the host."""
    moved = {f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
             if isinstance(getattr(obj, f.name), (torch.Tensor, PackedBatch))}
    return dataclasses.replace(obj, **moved)


def pack(trajectories: Sequence, *, rewards: Sequence[float] | None = None,
         with_routing: bool = True) -> PackedBatch:
    """Pack trajectories (objects with token_ids, loss_mask, rollout_logprobs, routing, reward) into a row.

    `rewards` overrides each trajectory's `.reward` (the trainer shapes rewards before packing).
    `with_routing=False` drops the recorded routing (the no-R3 ablation).
    """
    if not trajectories:
        raise ValueError("pack: got no trajectories")
    ids, tgt, mask, lp, route, owner, lens = [], [], [], [], [], [], [0]
    for b, tr in enumerate(trajectories):
        ids_S = torch.as_tensor(tr.token_ids, dtype=torch.long)
        m_S = torch.as_tensor(tr.loss_mask, dtype=torch.bool)
        lp_S = torch.as_tensor(tr.rollout_logprobs, dtype=torch.float32)
        s = ids_S.numel()
        if s < 2 or m_S.numel() != s or lp_S.numel() != s:
            raise ValueError(f"pack: trajectory {b} has {s} tokens, loss_mask {m_S.numel()}, "
                             f"logprobs {lp_S.numel()}; expected equal lengths >= 2")
        ids.append(ids_S)
        tgt.append(torch.cat([ids_S[1:], ids_S.new_full((1,), IGNORE_INDEX)]))
        mask.append(torch.cat([m_S[1:], m_S.new_zeros(1)]))
        lp.append(torch.cat([lp_S[1:], lp_S.new_zeros(1)]) * mask[-1].float())
        owner.append(torch.full((s,), b, dtype=torch.long))
        lens.append(lens[-1] + s)
        if with_routing:
            if tr.routing is None:
                raise ValueError(f"pack: trajectory {b} has no routing but with_routing=True")
            r = torch.as_tensor(tr.routing)
            if r.shape[0] != s:
                raise ValueError(f"pack: trajectory {b} routing has {r.shape[0]} rows, expected {s}")
            route.append(r)
    targets_T = torch.cat(tgt)
    loss_mask_T = torch.cat(mask)
    targets_T = torch.where(loss_mask_T, targets_T, torch.full_like(targets_T, IGNORE_INDEX))
    rew = [float(r) for r in rewards] if rewards is not None else [float(t.reward) for t in trajectories]
    if len(rew) != len(trajectories):
        raise ValueError(f"pack: {len(rew)} rewards for {len(trajectories)} trajectories")
    return PackedBatch(
        input_ids_T=torch.cat(ids),
        cu_seqlens=torch.tensor(lens, dtype=torch.long),
        targets_T=targets_T,
        loss_mask_T=loss_mask_T,
        rollout_logp_T=torch.cat(lp),
        routing_TLK=torch.cat(route) if with_routing else None,
        traj_index_T=torch.cat(owner),
        reward_B=torch.tensor(rew, dtype=torch.float32),
    )


def split_by_tokens(lengths: Sequence[int], *, max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving groups of indices whose summed `lengths` stay within `max_tokens`
    (a single longer item forms a group of its own)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [g for g in groups if g]
