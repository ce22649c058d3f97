"""The scoring pass's advantage handling: decoupled GAE lambdas and the per-step normalisation modes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from t1core.batch import pack
from t1core.config import AlgoSection
from t1core.config_toml import load_config
from tests.step_objects import actor_critic, plan, step_batch
from t1core.advantages import flat_groups, gae, normalise_advantages, place_terminal_rewards
from t1model.model import ModelConfig, MoEModel, ValueModel
from t1kernels.logprob import token_logprobs
from t1core.update import Scored, policy_logprobs, score, sft_num_steps, sft_update
from t1core.optimizer import make_optimizer

SMALL = ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=4, num_experts_per_tok=2)


def _trajectory(g: torch.Generator, n: int, reward: float) -> SimpleNamespace:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[n // 3: n // 2] = True   # two sampled turns with an observation between them
    mask[2 * n // 3:] = True
    turns = [SimpleNamespace(start=n // 3, end=n // 2, tool_error=None),
             SimpleNamespace(start=2 * n // 3, end=n, tool_error=None)]
    return SimpleNamespace(token_ids=torch.randint(0, 301, (n,), generator=g).tolist(), loss_mask=mask,
                           rollout_logprobs=torch.where(mask, -1.0, 0.0), routing=None, reward=reward, num_tokens=n,
                           turns=turns, finish_reason="done")


def test_decoupled_lambdas_give_policy_advantages_and_monte_carlo_value_targets() -> None:
    g = torch.Generator().manual_seed(0)
    trajs = [_trajectory(g, 30, 3.0), _trajectory(g, 24, 1.0), _trajectory(g, 27, 0.0)]
    policy = MoEModel(SMALL, seed=0)
    critic = ValueModel.from_policy(policy)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=g)  # non-constant values
    algo = AlgoSection(gae_lambda=0.8, critic_lambda=1.0)
    (s,), _ = score(step_batch(trajs, [t.reward for t in trajs]), plan(baseline="none"), actor_critic(policy, critic),
                    algo=algo, temperature=1.0, replay=False)
    b = s.batch
    rewards_T = place_terminal_rewards(b.reward_B, b.loss_mask_T, b.cu_seqlens)
    adv_ref, _ = gae(rewards_T, s.old_values_T, b.loss_mask_T, b.cu_seqlens, gamma=1.0, lam=0.8)
    torch.testing.assert_close(s.advantages_T, adv_ref)
    # lambda = 1, gamma = 1: every sampled token's value target is its episode's final reward.
    target_T = torch.where(b.loss_mask_T, b.reward_B[b.traj_index_T], 0.0)
    torch.testing.assert_close(s.returns_T, target_T, rtol=0, atol=1e-6)


def test_a_cut_episode_bootstraps_from_the_critic_at_its_last_sampled_token() -> None:
    """algo.cut_episodes='bootstrap': a trajectory cut by the turn limit (reward 0, as `t1core.segments` passes it)
    has value targets equal to the critic's value at its last sampled token (gamma = lambda = 1); a finished one
    still targets its reward."""
    g = torch.Generator().manual_seed(0)
    trajs = [_trajectory(g, 30, 0.0), _trajectory(g, 24, 2.0)]
    trajs[0].finish_reason = "max_turns"
    policy = MoEModel(SMALL, seed=0)
    critic = ValueModel.from_policy(policy)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=g)
    algo = AlgoSection(cut_episodes="bootstrap")
    (s,), _ = score(step_batch(trajs, [0.0, 2.0]), plan(baseline="none"), actor_critic(policy, critic), algo=algo,
                    temperature=1.0, replay=False)
    b = s.batch
    cut = b.loss_mask_T & (b.traj_index_T == 0)
    last_value = s.old_values_T[cut.nonzero()[-1]]
    torch.testing.assert_close(s.returns_T[cut], last_value.expand(int(cut.sum())), rtol=0, atol=1e-6)
    done = b.loss_mask_T & (b.traj_index_T == 1)
    torch.testing.assert_close(s.returns_T[done], torch.full((int(done.sum()),), 2.0), rtol=0, atol=1e-6)


def test_policy_logprobs_on_loss_rows_only_match_the_full_head() -> None:
    g = torch.Generator().manual_seed(3)
    b = pack([_trajectory(g, 30, 1.0), _trajectory(g, 21, 0.0)], with_routing=False)
    policy = MoEModel(SMALL, seed=0)
    logp_T, ent_T = policy_logprobs(policy, b, temperature=0.7, replay=False, return_entropy=True)
    (logp_T.sum() + ent_T.sum()).backward()
    ours = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    hidden_TD = policy(b.input_ids_T, cu_seqlens=b.cu_seqlens)
    full_T, full_ent_T = token_logprobs(hidden_TD, policy.lm_head.weight, b.targets_T, temperature=0.7,
                                        return_entropy=True)  # every row, ignore_index off the mask
    (full_T.sum() + full_ent_T.sum()).backward()
    torch.testing.assert_close(logp_T, full_T)
    torch.testing.assert_close(ent_T, full_ent_T)
    assert bool((logp_T[~b.loss_mask_T] == 0).all()) and bool((logp_T[b.loss_mask_T] < 0).all())
    for a, p in zip(ours, policy.parameters()):
        torch.testing.assert_close(a, p.grad)


def _scored(adv_T: torch.Tensor, mask_T: torch.Tensor) -> Scored:
    batch = SimpleNamespace(loss_mask_T=mask_T)
    return Scored(batch, adv_T * 0, adv_T * 0, adv_T.clone(), adv_T * 0, None)


@pytest.mark.parametrize("mode", ["center", "whiten", "none"])
def test_advantage_normalisation_modes(mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    mask = [torch.rand(40, generator=g) < 0.6, torch.rand(25, generator=g) < 0.6]
    raw = [torch.randn(40, generator=g, dtype=torch.float64) * 2 + 1, torch.randn(25, generator=g, dtype=torch.float64)]
    scored = [_scored(torch.where(m, a, 0.0), m) for a, m in zip(raw, mask)]
    normalise_advantages(scored, mode)
    flat_raw = torch.cat([a[m] for a, m in zip(raw, mask)])
    flat = torch.cat([s.advantages_T[m] for s, m in zip(scored, mask)])
    expected = {"none": flat_raw, "center": flat_raw - flat_raw.mean(),
                "whiten": (flat_raw - flat_raw.mean()) / flat_raw.std()}[mode]
    torch.testing.assert_close(flat, expected)
    assert all(bool((s.advantages_T[~m] == 0).all()) for s, m in zip(scored, mask))


def test_centering_keeps_a_step_without_signal_small() -> None:
    # Every episode scored alike: what is left is critic noise of size 1e-3. Whitening would make it a unit-size
    # signal; centering keeps it at its own size.
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(200, dtype=torch.bool)
    noise = 1.0 + 1e-3 * torch.randn(200, generator=g, dtype=torch.float64)
    centred, whitened = [_scored(noise, mask)], [_scored(noise, mask)]
    normalise_advantages(centred, "center")
    normalise_advantages(whitened, "whiten")
    assert centred[0].advantages_T.abs().max() < 5e-3
    assert whitened[0].advantages_T.std().item() == pytest.approx(1.0)


def test_sft_steps_the_warmup_schedule() -> None:
    # A LambdaLR sets lr = base * factor(0) when it is made; an SFT loop that never stepped it trained at
    # lr / warmup_steps throughout (a bug this guards against).
    g = torch.Generator().manual_seed(4)
    trajs = [_trajectory(g, 30, 0.0) for _ in range(6)]
    policy = MoEModel(SMALL, seed=0)
    cfg = load_config(None, ["--optim.warmup_steps=3"])
    opt, sched = make_optimizer(policy, lr=1e-3, cfg=cfg)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 3)
    sft_update(trajs, policy=policy, opt=opt, sched=sched, grad_clip=1.0, minibatch_tokens=60, generator=g)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # 6 optimizer steps > 3 warmup steps


def test_negative_advantages_are_scaled_after_normalisation() -> None:
    g = torch.Generator().manual_seed(5)
    trajs = [_trajectory(g, 30, 3.0), _trajectory(g, 24, 1.0), _trajectory(g, 27, 0.0)]
    policy = MoEModel(SMALL, seed=0)
    critic = ValueModel.from_policy(policy)
    runs = {}
    for scale in (1.0, 0.25):
        (s,), _ = score(step_batch(trajs, [t.reward for t in trajs]), plan(baseline="center", negative_scale=scale),
                        actor_critic(policy, critic), algo=AlgoSection(), temperature=1.0, replay=False)
        runs[scale] = s.advantages_T
    full = runs[1.0]
    assert bool((full < 0).any()) and bool((full > 0).any())
    torch.testing.assert_close(runs[0.25], torch.where(full < 0, full * 0.25, full))


def test_group_normalisation_subtracts_each_instance_mean_across_minibatches() -> None:
    # Trajectories 0, 2 are one instance and 1, 3 another; small minibatches put each group in two of them.
    g = torch.Generator().manual_seed(6)
    trajs = [_trajectory(g, n, r) for n, r in ((30, 3.0), (24, 1.0), (27, 0.0), (22, 2.0))]
    policy = MoEModel(SMALL, seed=0)
    critic = ValueModel.from_policy(policy)
    group_ids = [0, 1, 0, 1]
    out = {}
    for mode in ("none", "group"):
        scored, _ = score(step_batch(trajs, [t.reward for t in trajs], group_ids), plan(baseline=mode),
                          actor_critic(policy, critic), algo=AlgoSection(minibatch_tokens=60), temperature=1.0,
                          replay=False)
        assert len(scored) > 1
        # Back to per-trajectory advantage vectors (masked positions only), in the step's order.
        per = {}
        for s in scored:
            for j, i in enumerate(s.traj_ids):
                rows = (s.batch.traj_index_T == j) & s.batch.loss_mask_T
                per[i] = s.advantages_T[rows].double()
        out[mode] = [per[i] for i in range(len(trajs))]
    for grp in (0, 1):
        members = [i for i, gid in enumerate(group_ids) if gid == grp]
        mean = torch.cat([out["none"][i] for i in members]).mean()
        for i in members:
            torch.testing.assert_close(out["group"][i], out["none"][i] - mean, rtol=0, atol=1e-5)


def test_flat_groups_get_no_push_and_the_others_keep_their_advantages() -> None:
    # Instance 0 scored 2, 2 (flat), instance 1 scored 3, 0, instance 2 has one episode (not flat: no group to
    # tell). With the group baseline, the flat group's advantages are the critic's error alone: non-zero here.
    rewards, group_ids = [2.0, 3.0, 2.0, 0.0, 1.0], [0, 1, 0, 1, 2]
    assert flat_groups(rewards, group_ids) == [True, False, True, False, False]
    assert flat_groups([1.0, 1.0], [0, 1]) == [False, False]  # lone episodes (group_size 1) are never flat
    with pytest.raises(ValueError):
        flat_groups([1.0], [0, 1])
    g = torch.Generator().manual_seed(11)
    trajs = [_trajectory(g, n, r) for n, r in zip((30, 24, 27, 22, 26), rewards)]
    policy = MoEModel(SMALL, seed=0)
    critic = ValueModel.from_policy(policy)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=g)  # values vary along each episode
    out = {}
    for no_push in (None, flat_groups(rewards, group_ids)):
        (s,), _ = score(step_batch(trajs, rewards, group_ids),
                        plan(baseline="group", negative_scale=0.0, no_push=no_push), actor_critic(policy, critic),
                        algo=AlgoSection(), temperature=1.0, replay=False)
        out[no_push is None] = s
    plain, skipped = out[True], out[False]
    # traj_index_T counts in packing order; traj_ids maps it back to the step's order.
    flat_T = torch.tensor(flat_groups(rewards, group_ids))[torch.tensor(plain.traj_ids)][plain.batch.traj_index_T]
    assert bool((plain.advantages_T[flat_T] > 0).any())  # the critic's error, half of it kept by the x0 scale
    assert bool((skipped.advantages_T[flat_T] == 0).all())
    assert torch.equal(skipped.advantages_T[~flat_T], plain.advantages_T[~flat_T])
    assert torch.equal(skipped.returns_T, plain.returns_T)  # the critic's targets are untouched


def test_sft_decay_plans_its_steps_and_reaches_zero() -> None:
    g = torch.Generator().manual_seed(9)
    trajs = [_trajectory(g, n, 0.0) for n in (30, 24, 27, 22, 29, 25, 21)]
    lengths = [t.num_tokens for t in trajs]
    gen = torch.Generator().manual_seed(10)
    state = gen.get_state()
    planned = sft_num_steps(lengths, epochs=3, minibatch_tokens=60, generator=gen)
    assert torch.equal(gen.get_state(), state)  # planning draws nothing from the run's generator
    policy = MoEModel(SMALL, seed=0)
    cfg = load_config(None, ["--optim.warmup_steps=2"])
    opt, sched = make_optimizer(policy, lr=1e-3, cfg=cfg, decay_steps=planned)
    lrs, taken = [], 0
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        taken += int(sft_update(trajs, policy=policy, opt=opt, sched=sched, grad_clip=1.0, minibatch_tokens=60,
                                generator=gen)["sft/steps"])
    assert taken == planned and planned > 3
    # warmup ramp x linear decay, evaluated at each epoch's first step; 0 once the planned steps are done
    assert lrs[0] == pytest.approx(1e-3 / 2)
    assert opt.param_groups[0]["lr"] == 0.0
    # max_steps cuts an epoch short
    m = sft_update(trajs, policy=policy, opt=opt, sched=None, grad_clip=1.0, minibatch_tokens=60, generator=gen,
                   max_steps=1)
    assert m["sft/steps"] == 1.0


def test_scored_minibatches_move_to_a_device_whole_and_stay_put_when_already_there() -> None:
    """The trainer packs on the host and moves each minibatch to the model's device: every tensor of a Scored, its
    PackedBatch's included, must go (a field left on the host fails the first GPU forward); here "meta" stands
    for the GPU this box lacks."""
    g = torch.Generator().manual_seed(5)
    trajs = [_trajectory(g, 20, 1.0), _trajectory(g, 17, 0.0)]
    for t in trajs:
        t.routing = torch.zeros(t.num_tokens, 2, 2, dtype=torch.uint8)
    b = pack(trajs)
    zeros_T = torch.zeros_like(b.rollout_logp_T)
    s = Scored(b, zeros_T, zeros_T, zeros_T, zeros_T, zeros_T.clone(), [3, 4])
    moved = s.to("meta")
    tensors = {f"batch.{k}": v for k, v in vars(moved.batch).items()}
    tensors.update({k: v for k, v in vars(moved).items() if k != "batch"})
    on_host = [k for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    assert not on_host, f"left on the host: {on_host}"
    assert sum(isinstance(v, torch.Tensor) for v in tensors.values()) == 13  # 8 batch fields + 5 of Scored
    assert moved.traj_ids == [3, 4] and s.batch.input_ids_T.device.type == "cpu"  # the original is untouched
    same = s.to("cpu")
    assert same.batch.input_ids_T is b.input_ids_T and same.old_logp_T is s.old_logp_T  # no copy on the host
