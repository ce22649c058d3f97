"""One optimisation step of the actor-critic: score a batch of trajectories, then PPO / value / SFT updates.

Legend: T packed tokens, B trajectories, L_moe MoE layers, K top-k.

The trainer's forward always runs over the exact token IDs of the trajectories (TITO) and replays the routing
recorded at rollout (R3; `replay=False` is for hand-built trajectories without routing, and the ablation lives in
`t1cli.experiments.mismatch`). The scoring pass (no grad) gives pi_old, the critic's
V_old, GAE advantages and the train-vs-rollout mismatch metrics; then `ppo_epochs` passes update the actor
(unless critic-only) and the critic. A non-finite loss or gradient skips that optimizer step and says why.
Under torchrun (`dp`, t1core.distributed) each optimizer step takes one minibatch per rank and scoring is
split across the ranks; with the default single-process `dp` every step is one minibatch, as before.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from t1kernels.logprob import token_logprobs
from t1kernels.rows import batch_invariant_mode, token_logprobs_rows
from t1core.batch import PackedBatch, pack, split_by_tokens, tensors_to
from t1core.config import AlgoSection, OptimSection
from t1core.advantages import PushPlan, gae, place_terminal_rewards, shape_advantages
from t1core.step import StepBatch
from t1core.distributed import DataParallel, reshard_
from t1core.expert_parallel import expert_grad_norm_sq, is_expert_param
from t1core.segments import bootstrap_flags
from t1core.losses import (entropy_bonus, first_mismatch, kl_penalty, mismatch_metrics, ppo_policy_loss,
                           routing_agreement, sft_loss, value_loss)


@dataclass
class Scored:
    """A packed minibatch with what the scoring pass computed for it (all [T], no grad)."""

    batch: PackedBatch
    old_logp_T: torch.Tensor
    old_values_T: torch.Tensor
    advantages_T: torch.Tensor
    returns_T: torch.Tensor
    ref_logp_T: torch.Tensor | None
    traj_ids: list[int] = field(default_factory=list)
    """Index, in the step's trajectory list, of each trajectory packed here (in packing order)."""
    mismatch: tuple[int, int, float, float] | None = None
    """algo.bitwise='on': `losses.first_mismatch` with the step's trajectory index, or None (all bits equal)."""

    def to(self, device: torch.device | str) -> Scored:
        return tensors_to(self, device)


def _device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes (under FSDP2 the device of its local shards)."""
    return next(model.parameters()).device


def policy_logprobs(policy: torch.nn.Module, batch: PackedBatch, *, temperature: float, replay: bool,
                    return_entropy: bool = False, bitwise: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_T, entropy_T | None) of each position's target under the policy; 0 where nothing is trained.

    Only the loss rows go through the LM head: prompt and observation positions are most of an agent
    trajectory (~80% of the default run's tokens), and their [V]-wide logits would be computed for nothing.
    `bitwise` (algo.bitwise, CPU): the forward runs the batch-invariant engine's products, attention and
    sampler log-softmax (`t1kernels.rows`), so each log-prob is the bits the engine sampled with.
    """
    routing = batch.routing_TLK if replay else None
    with batch_invariant_mode(bitwise, cache_weights=False):  # sharded weights are refilled in place
        hidden_TD = policy(batch.input_ids_T, cu_seqlens=batch.cu_seqlens, replay_routing=routing)
        rows_N = batch.loss_mask_T.nonzero().squeeze(1)
        head = token_logprobs_rows if bitwise else token_logprobs
        out = head(hidden_TD.index_select(0, rows_N), policy.lm_head.weight, batch.targets_T[rows_N],
                   temperature=temperature, return_entropy=return_entropy)
    T = hidden_TD.shape[0]
    if return_entropy:
        return _to_rows(out[0], rows_N, T), _to_rows(out[1], rows_N, T)
    return _to_rows(out, rows_N, T), None


def _to_rows(x_N: torch.Tensor, rows_N: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N] values of the selected rows -> [num_rows], zero elsewhere (differentiable w.r.t. x_N)."""
    return x_N.new_zeros(num_rows).index_copy(0, rows_N, x_N)


def entropy_term(ent_T: torch.Tensor, mask_T: torch.Tensor, *, coef: float
                 ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(coef * entropy loss, or None when coef is 0; the entropy metrics either way).

    With coef 0 the entropy is detached, so no gradient reaches it and the log-prob backward skips the entropy
    term (the costlier kernel variant) instead of computing a gradient that is then multiplied by 0. Loss and
    gradients are the same values as adding 0 * entropy loss (signed zeros aside)."""
    if coef == 0:
        return None, entropy_bonus(ent_T.detach(), mask_T)[1]
    ent_loss, metrics = entropy_bonus(ent_T, mask_T)
    return coef * ent_loss, metrics


def critic_values(critic: torch.nn.Module, batch: PackedBatch, *, replay: bool) -> torch.Tensor:
    routing = batch.routing_TLK if replay else None
    return critic(batch.input_ids_T, cu_seqlens=batch.cu_seqlens, replay_routing=routing).float()


_SINGLE = DataParallel.single()


@torch.no_grad()
def score(batch: StepBatch, plan: PushPlan, ac: ActorCritic, *, algo: AlgoSection, temperature: float,
          routing_agreement: bool = True, replay: bool = True, dp: DataParallel = _SINGLE,
          ) -> tuple[list[Scored], dict[str, float]]:
    """Pack, compute pi_old / V_old / GAE per minibatch, shape advantages over the whole step as `plan` says.

    `plan.baseline` normalises the advantages (`batch.group_ids` are the task instances 'group' needs);
    `plan.no_push[i]`: trajectory i gets advantage 0 on every token after normalisation
    (`t1core.advantages.flat_groups`), its values still train the critic; `plan.negative_scale` then scales negative
    advantages (`t1core.advantages.shape_advantages`).
    `routing_agreement`: also measure how often the trainer's own router picks the replayed experts (one more
    policy forward per minibatch, without replay). `replay=False`: no routing replay (trajectories without routing).
    With several ranks each minibatch is scored on one of them and every rank gets all results.

    Each minibatch is scored on the policy's device and its Scored comes back on the host: a step's batches do
    not all sit in device memory, ranks exchange host tensors, and `ppo_update` moves one minibatch at a time."""
    trajectories, rewards = batch.trajs, batch.rewards
    policy, critic, ref_policy = ac.policy, ac.critic, ac.ref_policy
    groups = split_by_tokens([t.num_tokens for t in trajectories], max_tokens=algo.minibatch_tokens)
    device = _device(policy)
    bitwise = algo.bitwise == "on"

    def score_group(group: list[int]) -> tuple[Scored, dict[str, list[tuple[float, int]]]]:
        metrics = defaultdict(list)
        packed = pack([trajectories[i] for i in group], rewards=[rewards[i] for i in group],
                      with_routing=replay).to(device)
        old_logp_T, _ = policy_logprobs(policy, packed, temperature=temperature, replay=replay,
                                        bitwise=bitwise)
        mismatch = None
        if bitwise:
            mismatch = first_mismatch(old_logp_T, packed.rollout_logp_T, packed.loss_mask_T, packed.cu_seqlens)
            mismatch = mismatch and (group[mismatch[0]], *mismatch[1:])
        values_T = critic_values(critic, packed, replay=replay)
        rewards_T = place_terminal_rewards(packed.reward_B, packed.loss_mask_T, packed.cu_seqlens)
        boot = bootstrap_flags([trajectories[i] for i in group], algo.cut_episodes)
        boot_B = None if boot is None else torch.tensor(boot)
        adv_T, ret_T = gae(rewards_T, values_T, packed.loss_mask_T, packed.cu_seqlens, gamma=algo.gamma,
                           lam=algo.gae_lambda, bootstrap_N=boot_B)
        if algo.critic_lambda != algo.gae_lambda:
            # Decoupled GAE: the actor's advantages use gae_lambda, the critic's targets critic_lambda.
            _, ret_T = gae(rewards_T, values_T, packed.loss_mask_T, packed.cu_seqlens, gamma=algo.gamma,
                           lam=algo.critic_lambda, bootstrap_N=boot_B)
        ref_T = None
        if ref_policy is not None:
            ref_T, _ = policy_logprobs(ref_policy, packed, temperature=temperature, replay=replay,
                                       bitwise=bitwise)  # KL exactly 0 while the anchor's weights
        for k, v in _fidelity_metrics(policy, packed, old_logp_T, replayed=replay and routing_agreement,
                                      bitwise=bitwise).items():
            metrics[k].append((v, packed.reward_B.numel()))
        if batch.version is not None:
            for k, v_n in gap_per_lag([trajectories[i] for i in group], old_logp_T, packed,
                                      version=batch.version).items():
                metrics[k].append(v_n)
        return Scored(packed, old_logp_T, values_T, adv_T, ret_T, ref_T, group, mismatch).to("cpu"), dict(metrics)

    scored, metrics = [], defaultdict(list)
    for one, rows in dp.map(groups, score_group):
        scored.append(one)
        for k, v in rows.items():
            metrics[k].extend(v)
    reshard_([policy, critic, ref_policy], dp)
    if bitwise:  # every rank holds every minibatch's result here, so all ranks raise together
        _check_bitwise(scored, trajectories, metrics)
    shape_advantages(scored, plan, batch.group_ids)
    return scored, {k: max(v for v, _ in rows) if k == "mismatch/max_abs"
                    else sum(v * n for v, n in rows) / sum(n for _, n in rows) for k, rows in metrics.items()}


class BitwiseMismatch(RuntimeError):
    """algo.bitwise='on' found a loss token whose train and rollout log-probs differ, or a router that left the
    rollout's experts: a bug in the bitwise path, never noise."""


def _check_bitwise(scored: list[Scored], trajectories: Sequence, metrics: dict[str, list]) -> None:
    found = sorted(s.mismatch for s in scored if s.mismatch is not None)
    if found:
        i, token, train, rollout = found[0]
        t = trajectories[i]
        turn = next((n for n, tn in enumerate(t.turns) if tn.start <= token < tn.end), None)
        raise BitwiseMismatch(
            f"algo.bitwise: logp_train != logp_rollout first at trajectory {i} of the step (task {t.task_name!r}), "
            f"token {token} (turn {turn}, id {int(t.token_ids[token])}): train {train!r} vs rollout {rollout!r} "
            f"(|d| = {abs(train - rollout):.3g}; {len(found)} minibatch(es) affected). The trainer's forward left "
            "the engine's reduction order somewhere (t1kernels.rows); set algo.bitwise='off' to train regardless")
    agree = [v for v, _ in metrics.get("fidelity/routing_agreement", [])]
    if agree and min(agree) != 1.0:
        raise BitwiseMismatch(f"algo.bitwise: the trainer's own router picked other experts than the rollout "
                              f"recorded (routing agreement {min(agree)!r} in a minibatch, expected exactly 1.0): "
                              "its router logits are not the engine's bits")


def _fidelity_metrics(policy: torch.nn.Module, batch: PackedBatch, logp_train_T: torch.Tensor, *,
                      replayed: bool, bitwise: bool = False) -> dict[str, float]:
    """Train-vs-rollout gap of the logp the update uses; with R3 also how often the trainer's own router
    agrees with the replayed experts (a forward without replay, in the same numerics as the scoring one)."""
    n = int(batch.reward_B.numel())
    out = {k: float(v) for k, v in mismatch_metrics(logp_train_T, batch.rollout_logp_T, batch.loss_mask_T,
                                                     batch.traj_index_T, num_trajectories=n).items()}
    if replayed:
        with batch_invariant_mode(bitwise, cache_weights=False):
            _, own_TLK = policy(batch.input_ids_T, cu_seqlens=batch.cu_seqlens, return_routing=True)
        out["fidelity/routing_agreement"] = float(routing_agreement(own_TLK, batch.routing_TLK))
    return out


def gap_per_lag(trajectories: Sequence, logp_train_T: torch.Tensor, batch: PackedBatch, *, version: int,
                ) -> dict[str, tuple[float, int]]:
    """Asynchronous steps: {"fidelity/gap_lag{n}": (mean |logp_train - logp_rollout| over the loss tokens sampled n
    weight versions before `version`, their count)} for the `trajectories` packed in `batch`, in order. Lag 0 is the
    engine-vs-trainer gap alone; a larger lag adds the policy's own movement since those weights."""
    versions = []
    for t in trajectories:  # shifted like pack's targets: position i scores token i + 1
        v_T = t.token_versions()
        versions.append(torch.cat([v_T[1:], v_T.new_full((1,), -1)]))
    lag_T = version - torch.cat(versions)
    mask_T = batch.loss_mask_T.cpu()
    d_T = (logp_train_T.detach().double().cpu() - batch.rollout_logp_T.double().cpu()).abs()
    out = {}
    for lag in lag_T[mask_T].unique().tolist():
        m_T = mask_T & (lag_T == lag)
        out[f"fidelity/gap_lag{lag}"] = (float(d_T[m_T].mean()), int(m_T.sum()))
    return out


def _step(loss: torch.Tensor, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler | None, grad_clip: float | None, what: str,
          metrics: dict[str, list[float]], *, dp: DataParallel = _SINGLE, weight: float = 1.0) -> None:
    """Backward + clip + step, unless the loss or the gradient is not finite (then skip and log why).

    `weight` scales this rank's loss (`DataParallel.rounds`); all ranks take the skip decision together, and the
    step's counters and gradient norm are logged by the main rank only (they are the same on every rank)."""
    opt.zero_grad(set_to_none=True)
    if dp.any(not torch.isfinite(loss)):  # sync: one scalar per optimizer step
        if dp.is_main:
            metrics[f"skipped/{what}_nonfinite_loss"].append(1.0)
        return
    (loss if weight == 1.0 else loss * weight).backward()
    norm = _clip_grad_norm(params, grad_clip, dp)
    if not torch.isfinite(norm):
        opt.zero_grad(set_to_none=True)
        if dp.is_main:
            metrics[f"skipped/{what}_nonfinite_grad"].append(1.0)
        return
    if dp.is_main:
        metrics[f"{what}/grad_norm"].append(float(norm))
    opt.step()
    if sched is not None:
        sched.step()


def _clip_grad_norm(params: list[torch.nn.Parameter], grad_clip: float | None, dp: DataParallel) -> torch.Tensor:
    """Clip to `grad_clip` (None: no clipping); returns the total norm before clipping. Over FSDP2's sharded
    gradients the norm is reduced across ranks first, so every rank clips by the same global factor."""
    max_norm = grad_clip if grad_clip is not None else float("inf")
    if not dp.distributed:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    experts = [p for p in params if is_expert_param(p)]  # expert parallelism: plain tensors outside FSDP2
    params = [p for p in params if not is_expert_param(p)]
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor -> the global value
    if experts:  # each expert's gradient once, from its owner
        norm = (norm.float().square() + expert_grad_norm_sq(experts)).sqrt().to(norm.dtype)
        torch.nn.utils.clip_grads_with_norm_(experts, max_norm, norm)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _summarise(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Means over the optimizer steps; `skipped/*` counters are summed."""
    return {k: sum(v) if k.startswith("skipped/") else sum(v) / len(v) for k, v in metrics.items()}


@dataclass
class ActorCritic:
    """What an RL update moves: the policy and the critic with their optimizers and schedulers, and the frozen
    KL anchor (None until the warm start is done, or when algo.kl_coef is 0)."""

    policy: torch.nn.Module
    critic: torch.nn.Module
    opt_actor: torch.optim.Optimizer
    opt_critic: torch.optim.Optimizer
    sched_actor: torch.optim.lr_scheduler.LRScheduler | None
    sched_critic: torch.optim.lr_scheduler.LRScheduler | None
    ref_policy: torch.nn.Module | None = None


def ppo_update(scored: list[Scored], plan: PushPlan, ac: ActorCritic, *, algo: AlgoSection, optim: OptimSection,
               temperature: float, generator: torch.Generator, replay: bool = True,
               dp: DataParallel = _SINGLE) -> dict[str, float]:
    """`algo.ppo_epochs` passes over the scored minibatches (shuffled by `generator`, one per rank per step); the
    actor moves only when `plan.update_actor`, the critic always."""
    update_actor = plan.update_actor
    metrics: dict[str, list[float]] = defaultdict(list)
    policy, critic = ac.policy, ac.critic
    actor_params = [p for p in policy.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    device = _device(policy)
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(len(scored), generator=generator).tolist()
        for j, weight in dp.rounds(len(order)):
            s = scored[order[j]].to(device)
            b = s.batch
            if update_actor:
                logp_T, ent_T = policy_logprobs(policy, b, temperature=temperature, replay=replay,
                                                return_entropy=True, bitwise=algo.bitwise == "on")
                loss, m = ppo_policy_loss(logp_T, s.old_logp_T, b.rollout_logp_T, s.advantages_T, b.loss_mask_T,
                                          clip_eps=algo.clip_eps, tis_cap=algo.tis_cap, icepop=algo.icepop)
                ent_term, m_ent = entropy_term(ent_T, b.loss_mask_T, coef=algo.entropy_coef)
                if ent_term is not None:
                    loss = loss + ent_term
                if s.ref_logp_T is not None:
                    kl, m_kl = kl_penalty(logp_T, s.ref_logp_T, b.loss_mask_T)
                    loss, m = loss + algo.kl_coef * kl, {**m, **m_kl}
                _step(loss, actor_params, ac.opt_actor, ac.sched_actor, optim.grad_clip, "policy", metrics, dp=dp,
                      weight=weight)
                if weight:
                    for k, v in {**m, **m_ent}.items():
                        metrics[k].append(float(v))
            values_T = critic_values(critic, b, replay=replay)
            v_loss, m = value_loss(values_T, s.old_values_T, s.returns_T, b.loss_mask_T, algo.value_clip_eps)
            _step(algo.vf_coef * v_loss, critic_params, ac.opt_critic, ac.sched_critic, optim.grad_clip, "value", metrics,
                  dp=dp, weight=weight)
            if weight:
                for k, v in m.items():
                    metrics[k].append(float(v))
    return _summarise(dp.gather_lists(metrics))


def _sft_minibatches(lengths: Sequence[int], minibatch_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch's minibatches (trajectory indices), in a random order drawn from `generator`."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    return [[order[j] for j in g] for g in split_by_tokens([lengths[i] for i in order], max_tokens=minibatch_tokens)]


def sft_num_steps(lengths: Sequence[int], *, epochs: int, minibatch_tokens: int, generator: torch.Generator,
                  dp: DataParallel = _SINGLE) -> int:
    """Optimizer steps that `epochs` calls of `sft_update` will take (the minibatch count depends on each epoch's
    order; with W ranks a step takes W minibatches); `generator` is left as it was."""
    state = generator.get_state()
    try:
        return sum(len(dp.rounds(len(_sft_minibatches(lengths, minibatch_tokens, generator)))) for _ in range(epochs))
    finally:
        generator.set_state(state)


def sft_update(trajectories: Sequence, *, policy: torch.nn.Module, opt: torch.optim.Optimizer,
               sched: torch.optim.lr_scheduler.LRScheduler | None, grad_clip: float | None, minibatch_tokens: int,
               generator: torch.Generator, max_steps: int | None = None, dp: DataParallel = _SINGLE,
               ) -> dict[str, float]:
    """One epoch of supervised fine-tuning on reference transcripts: NLL of the loss-mask tokens, no replay
    (the reference tokens were written, not sampled by the model, so there is no routing to replay).
    Stops early after `max_steps` optimizer steps (of one minibatch per rank); "sft/steps" in the result counts
    the steps taken."""
    metrics: dict[str, list[float]] = defaultdict(list)
    params = [p for p in policy.parameters() if p.requires_grad]
    minibatches = _sft_minibatches([t.num_tokens for t in trajectories], minibatch_tokens, generator)
    rounds = dp.rounds(len(minibatches))[:max_steps]
    device = _device(policy)
    for i, weight in rounds:
        batch = pack([trajectories[j] for j in minibatches[i]], with_routing=False).to(device)
        logp_T, _ = policy_logprobs(policy, batch, temperature=1.0, replay=False)
        loss, m = sft_loss(logp_T, batch.loss_mask_T)
        _step(loss, params, opt, sched, grad_clip, "sft", metrics, dp=dp, weight=weight)
        if weight:
            for k, v in m.items():
                metrics[k].append(float(v))
    return {**_summarise(dp.gather_lists(metrics)), "sft/steps": float(len(rounds))}
