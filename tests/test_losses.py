"""Losses and metrics against float64 Python loops and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from t1core.advantages import gae, place_terminal_rewards, traj_index_from_cu_seqlens
from t1core.losses import (entropy_bonus, kl_penalty, mismatch_metrics, ppo_policy_loss, routing_agreement, sft_loss,
                           value_loss)


def _gae_reference(rewards, values, mask, cu, gamma, lam, bootstrap=None):
    """Per trajectory, walk its sampled tokens backwards (plain Python floats)."""
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        steps = [t for t in range(start, end) if mask[t]]
        running, next_value = 0.0, values[steps[-1]] if steps and bootstrap and bootstrap[n] else 0.0
        for t in reversed(steps):
            delta = rewards[t] + gamma * next_value - values[t]
            running = delta + gamma * lam * running
            adv[t], ret[t] = running, running + values[t]
            next_value = values[t]
    return adv, ret


def _random_batch(gen: torch.Generator, lengths: list[int]):
    T = sum(lengths)
    mask = torch.rand(T, generator=gen) < 0.6
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    values = torch.randn(T, generator=gen)
    values[~mask] = float("nan")  # values off the mask must not matter
    rewards_N = torch.randint(0, 5, (len(lengths),), generator=gen).float()
    mask[cu[1]:cu[2]] = False  # trajectory 1 has no sampled token (and must get no reward)
    has_sampled_N = torch.tensor([bool(mask[s:e].any()) for s, e in zip(cu[:-1], cu[1:])])
    rewards_N[~has_sampled_N] = 0.0
    return place_terminal_rewards(rewards_N, mask, cu), values, mask, cu, rewards_N


def test_gae_hand_built():
    # [prompt, s, s, obs, obs, s] then a second trajectory [s, obs]; reward 10 on the last sampled token.
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    values = torch.tensor([9.0, 1.0, 2.0, 9.0, 9.0, 3.0, 0.5, 9.0])
    cu = torch.tensor([0, 6, 8])
    rewards = place_terminal_rewards(torch.tensor([10.0, 4.0]), mask, cu)
    assert rewards.tolist() == [0, 0, 0, 0, 0, 10, 4, 0]
    adv, ret = gae(rewards, values, mask, cu, gamma=1.0, lam=1.0)
    # gamma=lam=1: A_i = R - V_i, observations cost no discount and get A = 0.
    assert adv.tolist() == [0, 9, 8, 0, 0, 7, 3.5, 0]
    assert ret.tolist() == [0, 10, 10, 0, 0, 10, 4, 0]
    adv, _ = gae(rewards, values, mask, cu, gamma=0.5, lam=0.5)
    # last: 10-3=7; middle: 0+0.5*3-2=-0.5, A=-0.5+0.25*7=1.25; first: 0+0.5*2-1=0, A=0.25*1.25
    assert adv.tolist() == [0, 0.3125, 1.25, 0, 0, 7, 3.5, 0]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_reference_loop(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    rewards, values, mask, cu, _ = _random_batch(gen, [37, 5, 1, 0, 64, 200, 3])
    adv, ret = gae(rewards.double(), values.double(), mask, cu, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), cu.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # float32 inputs: same numbers to float32 precision, float32 out
    adv32, _ = gae(rewards, values, mask, cu, gamma=gamma, lam=lam)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32, torch.tensor(ref_adv, dtype=torch.float32), rtol=1e-5, atol=1e-5)


def test_gae_rejects_bad_input():
    mask = torch.tensor([False, True, False])
    cu = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="outside the mask"):
        gae(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3), mask, cu, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gae(torch.zeros(3), torch.zeros(3), mask, torch.tensor([0, 2]), gamma=1.0, lam=1.0)
    with pytest.raises(TypeError, match="bool"):
        gae(torch.zeros(3), torch.zeros(3), mask.float(), cu, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="no sampled token"):
        place_terminal_rewards(torch.tensor([1.0]), torch.zeros(3, dtype=torch.bool), cu)


def _ppo_reference(logp, old, rollout, adv, mask, eps, tis_cap, icepop):
    """Per-token float64 loss and d(loss)/d(logp), by the textbook formulas."""
    n = sum(mask)
    loss, grad = 0.0, [0.0] * len(logp)
    for t in range(len(logp)):
        if not mask[t]:
            continue
        ratio, w = math.exp(logp[t] - old[t]), math.exp(old[t] - rollout[t])
        if icepop is not None and not icepop[0] <= w <= icepop[1]:
            continue
        weight = min(w, tis_cap) if tis_cap is not None else 1.0
        unclipped, clipped = ratio * adv[t], min(max(ratio, 1 - eps), 1 + eps) * adv[t]
        loss -= weight * min(unclipped, clipped) / n
        if unclipped <= clipped:  # the unclipped branch is the active one: it carries the gradient
            grad[t] = -weight * ratio * adv[t] / n
    return loss, grad


@pytest.mark.parametrize("tis_cap,icepop", [(None, None), (2.0, None), (None, (0.5, 5.0)), (1.5, (0.8, 1.25))])
def test_ppo_policy_loss_matches_reference(tis_cap, icepop):
    gen = torch.Generator().manual_seed(1)
    T = 300
    old = -torch.rand(T, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(T, generator=gen, dtype=torch.float64)  # many ratios outside 1 +- eps
    rollout = old + 0.8 * torch.randn(T, generator=gen, dtype=torch.float64)  # many w outside the bounds
    adv = torch.randn(T, generator=gen, dtype=torch.float64)
    mask = torch.rand(T, generator=gen) < 0.7
    logp_nan = torch.where(mask, logp, float("nan")).requires_grad_()  # junk off the mask must not leak
    loss, metrics = ppo_policy_loss(logp_nan, old, torch.where(mask, rollout, float("nan")), adv, mask,
                                    clip_eps=0.2, tis_cap=tis_cap, icepop=icepop)
    loss.backward()
    ref_loss, ref_grad = _ppo_reference(logp.tolist(), old.tolist(), rollout.tolist(), adv.tolist(),
                                        mask.tolist(), 0.2, tis_cap, icepop)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logp_nan.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    w = torch.exp(old - rollout)[mask]
    if icepop is not None:
        outside = ((w < icepop[0]) | (w > icepop[1])).double().mean().item()
        assert 0 < outside < 1 and metrics["policy/icepop_masked_frac"].item() == pytest.approx(outside)
    if tis_cap is not None:
        assert metrics["policy/tis_truncated_frac"].item() == pytest.approx((w > tis_cap).double().mean().item())


def test_ppo_clip_behaviour_hand_built():
    eps = 0.2
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    old = torch.zeros(5, dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    mask = torch.ones(5, dtype=torch.bool)
    loss, metrics = ppo_policy_loss(logp, old, old, adv, mask, clip_eps=eps)
    loss.backward()
    # A>0, r>1+eps: clipped (1.2*1). A<0, r>1+eps: unclipped (-1.5). A>0, r<1-eps: unclipped (0.5).
    # A<0, r<1-eps: clipped (-0.8). inside: 1.1*2.
    assert loss.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8 + 2.2) / 5)
    assert logp.grad.tolist() == pytest.approx([0.0, 1.5 / 5, -0.5 / 5, 0.0, -2.2 / 5])
    assert metrics["policy/clip_frac"].item() == pytest.approx(2 / 5)
    k3 = [r - 1 - math.log(r) for r in ratio.tolist()]
    assert metrics["policy/approx_kl"].item() == pytest.approx(sum(k3) / 5)
    assert metrics["policy/ratio_max"].item() == pytest.approx(1.5)
    assert metrics["policy/ratio_min"].item() == pytest.approx(0.5)


def test_ppo_micro_batches_sum_to_minibatch():
    gen = torch.Generator().manual_seed(2)
    logp, old, adv = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    mask = torch.rand(40, generator=gen) < 0.5
    full, _ = ppo_policy_loss(logp, old, old, adv, mask, clip_eps=0.2)
    n = mask.sum()
    parts = [ppo_policy_loss(logp[s], old[s], old[s], adv[s], mask[s], clip_eps=0.2, num_tokens=n)[0]
             for s in (slice(0, 13), slice(13, 40))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_value_loss_clipping():
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0], dtype=torch.float64)
    values = torch.tensor([1.0, 1.0, -0.1, 3.0, 7.0], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([2.0, -1.0, 0.0, 3.0, 9.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    loss, metrics = value_loss(values, old, returns, mask, 0.5)
    loss.backward()
    # token 0: V=1 -> (1-2)^2=1, Vclip=0.5 -> 2.25: the clipped term wins, no gradient.
    # token 1: (1+1)^2=4 vs (0.5+1)^2=2.25: unclipped wins.  token 2: inside the clip.  token 3: 0 vs (0.5-3)^2.
    per_token = [2.25, 4.0, 0.01, 6.25]
    assert loss.item() == pytest.approx(0.5 * sum(per_token) / 4)
    assert values.grad.tolist() == pytest.approx([0.0, 0.5 * 2 * 2 / 4, 0.5 * 2 * -0.1 / 4, 0.0, 0.0])
    assert metrics["value/clip_frac"].item() == pytest.approx(2 / 4)
    plain, _ = value_loss(values, old, returns, mask, None)
    assert plain.item() == pytest.approx(0.5 * (1 + 4 + 0.01 + 0) / 4)
    ret, v = returns[mask], values.detach()[mask]
    assert metrics["value/explained_var"].item() == pytest.approx(
        1 - (ret - v).var(unbiased=False).item() / ret.var(unbiased=False).item())


def test_sft_entropy_kl():
    logp = torch.tensor([-1.0, -2.0, float("nan"), -0.5], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.bool)
    loss, metrics = sft_loss(logp, mask)
    assert loss.item() == pytest.approx(3.5 / 3) and metrics["sft/tokens"].item() == 3
    ent = torch.tensor([1.0, 2.0, 100.0, 3.0])
    loss, metrics = entropy_bonus(ent, mask)
    assert loss.item() == pytest.approx(-2.0) and metrics["policy/entropy"].item() == pytest.approx(2.0)
    ref = torch.tensor([-1.5, -2.0, 0.0, 0.0], dtype=torch.float64)
    loss, _ = kl_penalty(logp, ref, mask)
    d = [-0.5, 0.0, 0.5]
    assert loss.item() == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)


def test_mismatch_metrics_hand_built():
    # trajectory 0: three loss tokens d=[0.1,-0.2,0.3] (+ one observation with junk); trajectory 1: one
    # loss token d=1.0; trajectory 2: no loss token (left out of the per-trajectory average).
    train = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    rollout = torch.tensor([-1.1, -0.8, float("nan"), -1.3, -2.0, -9.0, -9.0])
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 0], dtype=torch.bool)
    traj = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    m = mismatch_metrics(train, rollout, mask, traj)
    d = [0.1, -0.2, 0.3, 1.0]
    assert m["mismatch/gap"].item() == pytest.approx((0.2 + 1.0) / 2, rel=1e-6)
    assert m["mismatch/k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4, rel=1e-5)
    assert m["mismatch/extreme_frac"].item() == pytest.approx(1 / 4)
    assert m["mismatch/max_abs"].item() == pytest.approx(1.0, rel=1e-6)
    same = mismatch_metrics(train, train, mask, traj, num_trajectories=3)
    assert all(v.item() == 0 for v in same.values())


def test_traj_index_and_routing_agreement():
    assert traj_index_from_cu_seqlens(torch.tensor([0, 2, 2, 5]), 5).tolist() == [0, 0, 2, 2, 2]
    replayed = torch.tensor([[[1, 2], [3, 4]], [[0, 5], [6, 7]], [[1, 2], [1, 3]]], dtype=torch.uint8)
    mine = torch.tensor([[[2, 1], [3, 4]], [[0, 4], [7, 6]], [[1, 2], [1, 2]]])  # order ignored; 2 pairs differ
    assert routing_agreement(mine, replayed).item() == pytest.approx(4 / 6)
    mask = torch.tensor([True, True, False])
    assert routing_agreement(mine, replayed, mask_T=mask).item() == pytest.approx(3 / 4)
    with pytest.raises(ValueError):
        routing_agreement(mine[:, :, :1], replayed)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_bootstraps_cut_trajectories_from_the_value_at_the_cut(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    rewards, values, mask, cu, _ = _random_batch(gen, [37, 5, 1, 0, 64, 200, 3])
    boot = [True, False, True, True, False, True, False]
    adv, ret = gae(rewards.double(), values.double(), mask, cu, gamma=gamma, lam=lam, bootstrap_N=torch.tensor(boot))
    ref_adv, ref_ret = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), cu.tolist(), gamma, lam, boot)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    plain, _ = gae(rewards.double(), values.double(), mask, cu, gamma=gamma, lam=lam)
    assert not torch.equal(plain, adv)  # the flag changes what it should
