"""algo.bitwise: the trainer's log-probs and routing are the engine's bits (`torch.equal`, no tolerance).

The engine is the real `TorchEngine` in its batch-invariant mode (prefill, one-token decode steps against the KV
cache, continuous batching, prefix reuse); the trainer side is `t1core.update.policy_logprobs` over packed
trajectories, the function the PPO step calls. Each test builds episodes token by token the way the agent loop
does (sampled replies, then observation tokens the engine never sampled, routing asked for from the first token
it does not have yet), so the comparison covers what training sees. The last test changes one reduction order in
the trainer and checks that the step's check names the first token that moved.
"""

from __future__ import annotations

import copy

import pytest
import torch

from t1kernels.moe import route
from t1kernels.rows import batch_invariant_mode
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory
from t1model import model as model_module
from t1core.batch import pack
from t1core.config import AlgoSection
from t1core.distributed import iter_hf_tensors
from t1core.losses import mismatch_metrics
from t1model.model import ModelConfig, MoEModel, ValueModel
from t1core.update import BitwiseMismatch, policy_logprobs, score
from tests.episodes import Episode
from tests.step_objects import actor_critic, plan, step_batch

CFG = ModelConfig.tiny().replace(num_hidden_layers=2, hidden_size=128, moe_intermediate_size=64, vocab_size=512,
                                 head_dim=32, num_experts=8)
STOP = 7  # a frequent enough id at this vocabulary that replies end at different steps


@pytest.fixture(scope="module")
def policy() -> MoEModel:
    return MoEModel(CFG, seed=3).eval()


def _engine(policy: MoEModel, max_batch: int = 4) -> TorchEngine:
    model = copy.deepcopy(policy).requires_grad_(False)
    return TorchEngine(model, EngineConfig.for_parallel(max_batch, max_seq_len=512, batch_invariant=True))


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, CFG.vocab_size, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _trainer_logp(policy: MoEModel, trajs: list[Trajectory], temperature: float) -> list[torch.Tensor]:
    """Each trajectory's trainer log-probs over its loss tokens, from one packed forward of all of them."""
    batch = pack(trajs)
    with torch.no_grad():
        logp_T, _ = policy_logprobs(policy, batch, temperature=temperature, replay=True, bitwise=True)
    out = []
    for b in range(len(trajs)):
        lo, hi = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
        out.append(logp_T[lo:hi][batch.loss_mask_T[lo:hi]])
    return out


def _assert_bitwise(policy: MoEModel, trajs: list[Trajectory], temperature: float = 1.0) -> None:
    for traj, logp in zip(trajs, _trainer_logp(policy, trajs, temperature)):
        rollout = traj.rollout_logprobs[traj.loss_mask]
        assert logp.numel() == rollout.numel() > 0
        assert torch.equal(logp, rollout), f"{traj.task_name}: max |d| {float((logp - rollout).abs().max())}"


def _one_turn(engine: TorchEngine, prompts: list[list[int]], max_new: list[int], temperature: float = 1.0,
              seed: int = 0) -> list[Trajectory]:
    eps = [Episode(p, seed + i, stop_token_ids=(STOP,)) for i, p in enumerate(prompts)]
    futures = [engine.submit(e.ids, e.params(m, temperature)) for e, m in zip(eps, max_new)]
    for e, f in zip(eps, futures):
        e.add_reply(f.result())
    return [e.trajectory() for e in eps]


def test_a_single_sequence_and_its_routing_and_gate_weights_are_the_engine_bits(policy: MoEModel) -> None:
    engine_logits: list[list[torch.Tensor]] = [[] for _ in policy.model.layers]
    with _engine(policy) as engine:
        gates = [layer.mlp.gate for layer in engine.model.model.layers]
        hooks = [g.register_forward_hook(lambda _m, _i, out, i=i: engine_logits[i].append(out.clone()))
                 for i, g in enumerate(gates)]
        (traj,) = _one_turn(engine, _prompts(1, 0), [40])
        for h in hooks:
            h.remove()
    _assert_bitwise(policy, [traj])
    # Experts and gate weights: the trainer's own router, left alone, picks the recorded experts, from router
    # logits that are the engine's bits row for row (prefill rows, then one per decode step and the flush).
    trainer_logits: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: trainer_logits.append(out))
             for layer in policy.model.layers]
    with torch.no_grad(), batch_invariant_mode(True):
        _, own_TLK = policy(traj.token_ids, return_routing=True)
    for h in hooks:
        h.remove()
    assert torch.equal(own_TLK, traj.routing)
    for layer_idx, logits_TE in enumerate(trainer_logits):
        engine_TE = torch.cat(engine_logits[layer_idx])
        assert torch.equal(logits_TE, engine_TE)
        w_engine, ids_engine = route(engine_TE, CFG.num_experts_per_tok)
        w_replay, _ = route(logits_TE, CFG.num_experts_per_tok, replay_ids=traj.routing[:, layer_idx])
        assert torch.equal(w_replay, w_engine) and torch.equal(ids_engine.to(traj.routing.dtype),
                                                               traj.routing[:, layer_idx])


def test_a_batch_of_8_continuously_batched_finishing_at_different_steps(policy: MoEModel) -> None:
    with _engine(policy, max_batch=3) as engine:  # 8 requests through 3 rows: they join as others leave
        trajs = _one_turn(engine, _prompts(8, 1), [5, 60, 17, 33, 2, 48, 25, 9], temperature=0.7)
    lengths = {int(t.loss_mask.sum()) for t in trajs}
    assert len(lengths) >= 5  # different finishing steps (stop token or budget)
    _assert_bitwise(policy, trajs, temperature=0.7)


def _three_turn_episodes(engine: TorchEngine, n: int, seed: int) -> list[Episode]:
    """n episodes of 3 turns run side by side; each later turn's prompt extends the last one (prefix reuse)."""
    eps = [Episode(p, seed + i, stop_token_ids=(STOP,)) for i, p in enumerate(_prompts(n, seed))]
    obs = _prompts(3 * n, seed + 100)
    for turn in range(3):
        futures = [engine.submit(e.ids, e.params(24, 1.0)) for e in eps]
        for i, (e, f) in enumerate(zip(eps, futures)):
            e.add_reply(f.result())
            if turn < 2:
                e.add_observation(obs[3 * i + turn][:20])
    return eps


def test_a_three_turn_episode_with_prefix_reuse(policy: MoEModel) -> None:
    with _engine(policy) as engine:
        eps = _three_turn_episodes(engine, 2, seed=5)
    for e in eps:
        assert e.cached[0] == 0 and all(c > 0 for c in e.cached[1:])  # turns 2 and 3 started from cached KV
    _assert_bitwise(policy, [e.trajectory() for e in eps])


def test_any_packing_order_and_minibatch_split_gives_the_same_bits(policy: MoEModel) -> None:
    with _engine(policy) as engine:
        trajs = [e.trajectory() for e in _three_turn_episodes(engine, 4, seed=11)]
    alone = [_trainer_logp(policy, [t], 1.0)[0] for t in trajs]
    reordered = _trainer_logp(policy, trajs[::-1], 1.0)[::-1]
    split = _trainer_logp(policy, trajs[:1], 1.0) + _trainer_logp(policy, trajs[1:], 1.0)
    for t, a, r, s in zip(trajs, alone, reordered, split):
        rollout = t.rollout_logprobs[t.loss_mask]
        assert torch.equal(a, rollout) and torch.equal(r, rollout) and torch.equal(s, rollout)


def test_after_a_weight_update(policy: MoEModel) -> None:
    trained = copy.deepcopy(policy).train()
    with _engine(policy) as engine:
        before = _one_turn(engine, _prompts(3, 21), [30, 30, 30])
        opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        logp_T, _ = policy_logprobs(trained, pack(before), temperature=1.0, replay=True, bitwise=True)
        (-logp_T.sum()).backward()
        opt.step()
        trained.eval()
        assert engine.update_weights(iter_hf_tensors(trained, dtype=torch.float32)) == 1
        after = _one_turn(engine, _prompts(3, 21), [30, 30, 30])
    assert any(not torch.equal(a.rollout_logprobs, b.rollout_logprobs) for a, b in zip(after, before))
    _assert_bitwise(trained, after)


def test_the_step_check_catches_one_changed_reduction_order(policy: MoEModel, monkeypatch) -> None:
    """Sum the o_proj product of the last layer in two halves of its inner dimension (the same math, another
    order): `score` must stop with the first trajectory and token that moved; with the engine's order the same
    step passes and reports a gap and max |d| of exactly 0."""
    with _engine(policy) as engine:
        trajs = [e.trajectory() for e in _three_turn_episodes(engine, 2, seed=31)]
    critic = ValueModel.from_policy(policy)
    algo = AlgoSection(bitwise="on", minibatch_tokens=4096)
    step = (step_batch(trajs, [1.0, 0.0]), plan(negative_scale=0.0), actor_critic(policy, critic))
    _, metrics = score(*step, algo=algo, temperature=1.0)
    assert metrics["mismatch/max_abs"] == 0.0 and metrics["mismatch/gap"] == 0.0

    o_proj = policy.model.layers[-1].self_attn.o_proj
    plain = model_module.linear_rows

    def split_k(x_MK, weight_NK, bias_N=None):
        if weight_NK is not o_proj.weight:
            return plain(x_MK, weight_NK, bias_N)
        half = x_MK.shape[-1] // 2
        return plain(x_MK[..., :half], weight_NK[:, :half]) + plain(x_MK[..., half:], weight_NK[:, half:])

    monkeypatch.setattr(model_module, "linear_rows", split_k)
    with pytest.raises(BitwiseMismatch) as err:
        score(*step, algo=algo, temperature=1.0)
    batch = pack(trajs)
    with torch.no_grad():
        logp_T, _ = policy_logprobs(policy, batch, temperature=1.0, replay=True, bitwise=True)
    bad_T = batch.loss_mask_T & (logp_T != batch.rollout_logp_T)
    first = int(bad_T.nonzero()[0, 0])
    traj = int(batch.traj_index_T[first])
    token = first + 1 - int(batch.cu_seqlens[traj])
    assert f"trajectory {traj} of the step" in str(err.value) and f"token {token} " in str(err.value)
    m = mismatch_metrics(logp_T, batch.rollout_logp_T, batch.loss_mask_T, batch.traj_index_T)
    assert 0 < float(m["mismatch/max_abs"]) < 1e-3  # caught although it is rounding-sized


def test_the_bitwise_forward_trains_with_the_default_forwards_gradients(policy: MoEModel) -> None:
    """Only the forward's order changes: the gradients of a PPO-style loss agree with the default path's (same
    math, other rounding) for every parameter, attention and expert weights included."""
    with _engine(policy) as engine:
        trajs = [e.trajectory() for e in _three_turn_episodes(engine, 2, seed=41)]
    batch = pack(trajs)
    grads = {}
    for bitwise in (False, True):
        model = copy.deepcopy(policy).train()
        logp_T, ent_T = policy_logprobs(model, batch, temperature=0.8, replay=True, return_entropy=True,
                                        bitwise=bitwise)
        (-(logp_T * torch.linspace(-1, 1, logp_T.numel())).sum() - 0.1 * ent_T.sum()).backward()
        grads[bitwise] = {n: p.grad for n, p in model.named_parameters()}
    for name, g_default in grads[False].items():
        g_bitwise = grads[True][name]
        scale = float(g_default.abs().max()) + 1e-12
        assert float((g_bitwise - g_default).abs().max()) <= 1e-4 * scale, name
