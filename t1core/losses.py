"""PPO/value/SFT losses and train-vs-rollout mismatch metrics: small pure functions (advantages: t1core.advantages).

Legend: T tokens (trajectories packed back to back; any shape works where no cu_seqlens is taken),
N trajectories, L MoE layers, K top-k. `mask_T` is bool and True exactly on sampled tokens (the loss
region); prompt, observation and template-glue tokens are False and never contribute, whatever their
other fields hold (NaN log-probs there are fine). Per-token fields are aligned: `logp_T[t]` is the
log-prob of token t given the tokens before it, `values_T[t]` the critic's value of that same prefix.

Losses return (loss, metrics): `loss` a 0-d tensor to minimise, not yet multiplied by any coefficient
from the config; `metrics` a flat dict of detached 0-d tensors keyed "group/name". Nothing here calls
`.item()` except the input checks marked `# sync:`; the metrics logger converts.
"""

from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)


def _check_mask(mask_T: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask_T.dtype != torch.bool:
        raise TypeError(f"mask_T: expected dtype torch.bool, got {mask_T.dtype}")
    for name, x in tensors.items():
        if x.shape != mask_T.shape:
            raise ValueError(f"{name}: expected shape {tuple(mask_T.shape)} (the mask's), got {tuple(x.shape)}")


def _masked(x: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """x with positions outside the mask set to 0, so that NaN/inf there cannot leak into sums or grads."""
    return torch.where(mask_T, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(mask_T: torch.Tensor) -> torch.Tensor:
    return mask_T.sum().to(torch.float32)


def _mean(x: torch.Tensor, mask_T: torch.Tensor, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Masked token mean; `num_tokens` replaces the mask's count as the denominator (for micro-batches of
    one minibatch, pass the minibatch's token count so that the accumulated gradient is its token mean)."""
    denom = _count(mask_T).clamp(min=1.0) if num_tokens is None else num_tokens
    return _masked(x, mask_T).sum() / denom


def _masked_max(x: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """Max over the mask; -inf when the mask is empty (including zero-size inputs)."""
    return torch.cat([torch.where(mask_T, x, -math.inf).flatten(), x.new_full((1,), -math.inf)]).max()


def ppo_policy_loss(logp_T: torch.Tensor, old_logp_T: torch.Tensor, rollout_logp_T: torch.Tensor,
                    adv_T: torch.Tensor, mask_T: torch.Tensor, *, clip_eps: float, tis_cap: float | None = None,
                    icepop: tuple[float, float] | None = None,
                    num_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with corrections for the train-vs-rollout mismatch, token mean over the mask.

    Two ratios per token:
      ratio  = pi_theta / pi_old: the PPO ratio, clipped to [1 - clip_eps, 1 + clip_eps]. pi_old is the
               trainer's own log-prob of the batch before this update (same routing replay, no grad).
      w      = pi_old / pi_rollout: the behaviour mismatch between the trainer and the inference engine
               that sampled the tokens, detached.
    per-token loss = -w' * min(ratio * A, clip(ratio) * A), where w' = min(w, tis_cap) with truncated
    importance sampling (tis_cap set) and 1 otherwise. With icepop=(lo, hi), tokens whose w leaves
    [lo, hi] are dropped (no loss, no gradient) but still count in the denominator, so the loss scale does
    not depend on how many were dropped. Passing old_logp_T=rollout_logp_T makes the rollout policy the PPO
    behaviour policy directly (w = 1: tis and icepop then do nothing).
    Asynchronous steps (rollout.max_staleness >= 1) need nothing more: this is decoupled PPO, with pi_old as the
    proximal policy and pi_rollout as the behaviour policy (AReaL's three policies, behave / proximal / theta:
    https://inclusionai.github.io/AReaL/algorithms/async.html; the objective is Hilton et al. 2021, "Batch
    size-invariance for policy optimization"). The trust region stays centred on the policy before this update
    however old the data, so stale tokens are not all clipped from the start, as they would be with the clip centred
    on a behaviour policy N versions back (plain TIS); the detached behaviour weight w, truncated at tis_cap, corrects
    for who sampled. Every token's rollout_logp is the exact log-prob recorded by the weights that sampled it (TITO),
    so a trajectory whose turns came from several versions needs no special case.
    Metrics: clip_frac = share of tokens whose gradient the clip removes; approx_kl = k3 estimate of
    KL(pi_old || pi_theta) = mean(exp(d) - 1 - d), d = logp - old_logp; ratio mean/min/max.
    """
    _check_mask(mask_T, logp_T=logp_T, old_logp_T=old_logp_T, rollout_logp_T=rollout_logp_T, adv_T=adv_T)
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps: expected in (0, 1), got {clip_eps}")
    logp, old = _masked(logp_T, mask_T), _masked(old_logp_T.detach(), mask_T)
    rollout, adv = _masked(rollout_logp_T.detach(), mask_T), _masked(adv_T.detach(), mask_T)

    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    w = torch.exp(old - rollout)  # may overflow to inf on a wild token: the cap or the icepop mask takes it
    weight = w.clamp(max=tis_cap) if tis_cap is not None else torch.ones_like(w)
    keep_T = mask_T
    if icepop is not None:
        lo, hi = icepop
        keep_T = mask_T & (w >= lo) & (w <= hi)
    denom = _count(mask_T).clamp(min=1.0) if num_tokens is None else num_tokens
    loss = -_masked(weight * surrogate, keep_T).sum() / denom

    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        metrics = {
            "policy/loss": loss.detach(),
            "policy/clip_frac": _mean(clipped.float(), mask_T),
            "policy/approx_kl": _mean(torch.expm1(log_ratio) - log_ratio, mask_T),
            "policy/ratio_mean": _mean(ratio, mask_T),
            "policy/ratio_min": -_masked_max(-ratio, mask_T),
            "policy/ratio_max": _masked_max(ratio, mask_T),
            "policy/tis_weight_mean": _mean(weight, mask_T),
            "policy/tis_truncated_frac": (_mean((w > tis_cap).float(), mask_T) if tis_cap is not None
                                          else loss.new_zeros(())),
            "policy/icepop_masked_frac": _mean((mask_T & ~keep_T).float(), mask_T),
        }
    return loss, metrics


def value_loss(values_T: torch.Tensor, old_values_T: torch.Tensor, returns_T: torch.Tensor, mask_T: torch.Tensor,
               clip_eps: float | None, *, num_tokens: float | torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, +-eps).

    V_old are the critic's values at rollout/scoring time (those GAE used). clip_eps=None: plain 0.5 (V-R)^2.
    Metrics: clip_frac (share where the clipped term is the larger, i.e. gradient removed), explained
    variance 1 - Var(R - V) / Var(R) over the mask (NaN when the returns are constant).
    """
    _check_mask(mask_T, values_T=values_T, old_values_T=old_values_T, returns_T=returns_T)
    v, ret = _masked(values_T, mask_T), _masked(returns_T.detach(), mask_T)
    sq = (v - ret) ** 2
    if clip_eps is None:
        per_token, clipped = sq, torch.zeros_like(mask_T)
    else:
        old = _masked(old_values_T.detach(), mask_T)
        sq_clip = (old + (v - old).clamp(-clip_eps, clip_eps) - ret) ** 2
        per_token, clipped = torch.maximum(sq, sq_clip), sq_clip > sq
    loss = 0.5 * _mean(per_token, mask_T, num_tokens)

    with torch.no_grad():
        metrics = {
            "value/loss": loss.detach(),
            "value/clip_frac": _mean(clipped.float(), mask_T),
            "value/mean": _mean(v, mask_T),
            "value/return_mean": _mean(ret, mask_T),
            "value/explained_var": 1.0 - _masked_var(ret - v, mask_T) / _masked_var(ret, mask_T),
        }
    return loss, metrics


def _masked_var(x: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    return _mean((x - _mean(x, mask_T)) ** 2, mask_T)


def entropy_bonus(entropy_T: torch.Tensor, mask_T: torch.Tensor, *,
                  num_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = -(token-mean entropy): adding entropy_coef * loss to the total raises the entropy."""
    _check_mask(mask_T, entropy_T=entropy_T)
    mean_entropy = _mean(entropy_T, mask_T, num_tokens)
    return -mean_entropy, {"policy/entropy": _mean(entropy_T.detach(), mask_T)}


def kl_penalty(logp_T: torch.Tensor, ref_logp_T: torch.Tensor, mask_T: torch.Tensor, *,
               num_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """k3 estimate of KL(pi_theta || pi_ref) on the sampled tokens: mean(exp(d) - 1 - d), d = ref - logp.
    Non-negative per token; the gradient flows through logp_T only."""
    _check_mask(mask_T, logp_T=logp_T, ref_logp_T=ref_logp_T)
    d = _masked(ref_logp_T.detach(), mask_T) - _masked(logp_T, mask_T)
    loss = _mean(torch.expm1(d) - d, mask_T, num_tokens)
    return loss, {"policy/kl_ref": _mean((torch.expm1(d) - d).detach(), mask_T)}


def sft_loss(logp_T: torch.Tensor, mask_T: torch.Tensor, *,
             num_tokens: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the masked (assistant) tokens, token mean."""
    _check_mask(mask_T, logp_T=logp_T)
    loss = -_mean(logp_T, mask_T, num_tokens)
    return loss, {"sft/nll": _mean(-logp_T.detach(), mask_T), "sft/tokens": _count(mask_T)}


def mismatch_metrics(logp_train_T: torch.Tensor, logp_rollout_T: torch.Tensor, mask_T: torch.Tensor,
                     traj_index_T: torch.Tensor, *, num_trajectories: int | None = None) -> dict[str, torch.Tensor]:
    """Train-vs-rollout log-prob mismatch over the loss tokens, d = logp_train - logp_rollout (float64):
      mismatch/gap           mean |d| within each trajectory, then the mean over trajectories that have loss
                             tokens (a long trajectory does not outweigh short ones)
      mismatch/k3            mean(exp(d) - 1 - d) over all loss tokens (k3 estimate of KL(rollout || train))
      mismatch/extreme_frac  share of loss tokens with |d| > ln 2 (probabilities off by more than 2x)
      mismatch/max_abs       max |d|
    `traj_index_T` holds each token's trajectory in [0, N); without num_trajectories, N = max + 1 (a sync).
    """
    _check_mask(mask_T, logp_train_T=logp_train_T, logp_rollout_T=logp_rollout_T, traj_index_T=traj_index_T)
    d = _masked(logp_train_T.detach().double() - logp_rollout_T.detach().double(), mask_T)
    n = num_trajectories if num_trajectories is not None else (
        int(traj_index_T.max()) + 1 if traj_index_T.numel() else 0)  # sync: only without num_trajectories
    traj = traj_index_T.to(torch.int64)
    abs_sum_N = d.new_zeros(n).index_add_(0, traj.flatten(), d.abs().flatten())
    count_N = d.new_zeros(n).index_add_(0, traj.flatten(), mask_T.double().flatten())
    has_tokens_N = count_N > 0
    per_traj_N = abs_sum_N / count_N.clamp(min=1.0)
    return {
        "mismatch/gap": _masked(per_traj_N, has_tokens_N).sum() / has_tokens_N.sum().clamp(min=1),
        "mismatch/k3": _mean(torch.expm1(d) - d, mask_T),
        "mismatch/extreme_frac": _mean((d.abs() > _LN2).double(), mask_T),
        "mismatch/max_abs": _masked_max(d.abs(), mask_T),
    }


def first_mismatch(logp_train_T: torch.Tensor, logp_rollout_T: torch.Tensor, mask_T: torch.Tensor,
                   cu_seqlens_B1: torch.Tensor) -> tuple[int, int, float, float] | None:
    """The first loss token whose train and rollout log-probs are not the same bits, in packing order, as
    (trajectory row b, index of the sampled token within trajectory b, logp_train, logp_rollout); None when every
    loss token is equal. (Position t scores target t + 1, so the sampled token sits one after its row.)"""
    bad_T = mask_T & (logp_train_T.detach().float() != logp_rollout_T.detach().float())
    if not bool(bad_T.any()):  # sync: one flag per minibatch
        return None
    t = int(bad_T.nonzero()[0, 0])
    b = int(torch.searchsorted(cu_seqlens_B1.to(torch.int64), torch.tensor(t), right=True)) - 1
    return b, t + 1 - int(cu_seqlens_B1[b]), float(logp_train_T[t]), float(logp_rollout_T[t])


def routing_agreement(router_topk_TLK: torch.Tensor, replayed_TLK: torch.Tensor, *,
                      mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """Share of (token, layer) pairs whose top-k expert SET (order ignored) matches the replayed one.

    router_topk_TLK: what the trainer's own router picks; replayed_TLK: the rollout's recorded routing
    (any integer dtype, e.g. uint8). mask_T restricts the tokens counted (default: all). A 0-d tensor.
    """
    if router_topk_TLK.shape != replayed_TLK.shape or router_topk_TLK.dim() != 3:
        raise ValueError(f"routing: expected two [T, L, K] tensors of one shape, got "
                         f"{tuple(router_topk_TLK.shape)} and {tuple(replayed_TLK.shape)}")
    mine = router_topk_TLK.to(torch.int64).sort(dim=-1).values
    theirs = replayed_TLK.to(torch.int64).sort(dim=-1).values
    same_TL = (mine == theirs).all(dim=-1).double()
    if mask_T is None:
        mask_T = torch.ones(same_TL.shape[0], dtype=torch.bool, device=same_TL.device)
    if mask_T.dtype != torch.bool or mask_T.shape != same_TL.shape[:1]:
        raise ValueError(f"mask_T: expected bool [{same_TL.shape[0]}], got {mask_T.dtype} {tuple(mask_T.shape)}")
    pairs_TL = mask_T[:, None].expand_as(same_TL)
    return _mean(same_TL, pairs_TL)
