"""Data-parallel training (t1core.distributed): 2 gloo ranks with FSDP2-sharded models against one process.

The reference is written out here, not taken from the data-parallel code: one optimizer step on the mean of the
round's minibatch losses, in a plain unsharded model. Scoring split across ranks must equal scoring in one process.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from t1core.config import AlgoSection
from t1core.config_toml import load_config
from rollout.torch_engine import EngineConfig, TorchEngine
from t1model.hf_io import hf_state_dict
from t1core.distributed import DataParallel, full_state_dict, iter_hf_tensors, shard_
from t1core.losses import sft_loss
from t1model.model import ModelConfig, MoEModel, ValueModel
from t1core.update import policy_logprobs, score, sft_update
from t1core.optimizer import make_optimizer
from tests.step_objects import actor_critic, plan, step_batch
from tests.machine import free_port, gloo_rank, needs_docker

SMALL = ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=4, num_experts_per_tok=2)
WORLD = 2


def _trajectories() -> list[SimpleNamespace]:
    """Five episodes of different lengths: three minibatches of <= 80 tokens (two full rounds' worth and one
    round with a single minibatch, where rank 1 idles at weight 0)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, reward in ((40, 3.0), (33, 1.0), (45, 0.0), (30, 2.0), (38, 1.0)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2:] = True
        out.append(SimpleNamespace(token_ids=torch.randint(0, 301, (n,), generator=g).tolist(), loss_mask=mask,
                                   rollout_logprobs=torch.where(mask, -1.0, 0.0), routing=None, reward=reward,
                                   num_tokens=n, turns=[SimpleNamespace(start=n // 2, end=n, tool_error=None)],
                                   finish_reason="done"))
    return out


def _optimizer(model: torch.nn.Module):
    cfg = load_config(None, ["--optim.warmup_steps=0", "--optim.grad_clip=0.05"])  # small clip: it must bind
    return make_optimizer(model, lr=1e-2, cfg=cfg)


def _worker(rank: int, port: int, out_path: str) -> None:
    # A short collective timeout: a rank left waiting fails the test instead of hanging CI.
    with gloo_rank(rank, WORLD, port, timeout_s=120):
        dp = DataParallel(rank=rank, world_size=WORLD)
        trajs = _trajectories()
        policy = shard_(MoEModel(SMALL, seed=0), dp)
        critic = shard_(ValueModel.from_policy(MoEModel(SMALL, seed=1)), dp)
        algo = AlgoSection(minibatch_tokens=80)
        scored, fidelity = score(step_batch(trajs, [t.reward for t in trajs]), plan(negative_scale=0.0),
                                 actor_critic(policy, critic), algo=algo, temperature=1.0, replay=False, dp=dp)
        opt, sched = _optimizer(policy)
        gen = torch.Generator().manual_seed(5)
        m = sft_update(trajs, policy=policy, opt=opt, sched=sched, grad_clip=0.05, minibatch_tokens=80,
                       generator=gen, dp=dp)
        state = full_state_dict(policy, dp)
        # Streamed sync: each rank's engine (other weights to start with) fed one gathered layer at a time.
        with TorchEngine(MoEModel(SMALL, seed=7), EngineConfig(max_batch=1, num_slots=1, max_seq_len=64)) as engine:
            engine.update_weights(iter_hf_tensors(policy))
            synced = hf_state_dict(engine.model)
        critic.copy_trunk_from(policy)  # the trainer's warm start, between two sharded models
        critic_state = full_state_dict(critic, dp)
        if rank == 0:
            torch.save({"state": state, "critic": critic_state, "synced": synced, "sft": m, "fidelity": fidelity,
                        "scored": [(s.old_logp_T, s.old_values_T, s.advantages_T) for s in scored]}, out_path)


def test_rounds_give_each_rank_its_minibatch_and_weight() -> None:
    assert DataParallel.single().rounds(3) == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert DataParallel(rank=0, world_size=2).rounds(3) == [(0, 1.0), (2, 2.0)]
    assert DataParallel(rank=1, world_size=2).rounds(3) == [(1, 1.0), (2, 0.0)]  # idles on a copy, weight 0
    assert DataParallel(rank=2, world_size=4).rounds(2) == [(0, 0.0)]
    with pytest.raises(ValueError, match="num_items"):
        DataParallel.single().rounds(-1)


@pytest.mark.torchrun
def test_two_sharded_ranks_take_the_single_process_step(tmp_path) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    got = torch.load(out, weights_only=False)

    # Reference, one process, no sharding: scoring as it always ran ...
    trajs = _trajectories()
    policy, critic = MoEModel(SMALL, seed=0), ValueModel.from_policy(MoEModel(SMALL, seed=1))
    algo = AlgoSection(minibatch_tokens=80)
    scored, fidelity = score(step_batch(trajs, [t.reward for t in trajs]), plan(negative_scale=0.0),
                             actor_critic(policy, critic), algo=algo, temperature=1.0, replay=False)
    assert len(scored) == len(got["scored"]) == 3
    for s, (logp, values, adv) in zip(scored, got["scored"]):
        torch.testing.assert_close(logp, s.old_logp_T, rtol=0, atol=0)
        torch.testing.assert_close(values, s.old_values_T, rtol=0, atol=0)
        torch.testing.assert_close(adv, s.advantages_T, rtol=0, atol=0)
    assert got["fidelity"] == pytest.approx(fidelity)

    # ... and SFT written out by hand: the epoch's minibatches in sft_update's order, two per optimizer step.
    from t1core.batch import pack
    from t1core.update import _sft_minibatches
    minibatches = _sft_minibatches([t.num_tokens for t in trajs], 80, torch.Generator().manual_seed(5))
    assert len(minibatches) == 3
    opt, sched = _optimizer(policy)
    params = list(policy.parameters())
    for step_groups in (minibatches[:2], minibatches[2:]):
        opt.zero_grad(set_to_none=True)
        losses = [sft_loss(policy_logprobs(policy, pack([trajs[i] for i in g], with_routing=False),
                                           temperature=1.0, replay=False)[0],
                           pack([trajs[i] for i in g], with_routing=False).loss_mask_T)[0] for g in step_groups]
        (sum(losses) / len(losses)).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
        assert norm > 0.05  # the clip binds, so a wrong (per-shard) norm would show
        opt.step()
        sched.step()
    assert got["sft"]["sft/steps"] == 2.0
    want = policy.state_dict()
    assert got["state"].keys() == want.keys()
    moved = max(float((MoEModel(SMALL, seed=0).state_dict()[k] - want[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the step did something measurable
    for k in want:  # the ranks' gradient sums differ from one process's only in rounding
        torch.testing.assert_close(got["state"][k], want[k], rtol=1e-4, atol=1e-6, msg=k)
    gathered = MoEModel(SMALL, seed=None)
    gathered.load_state_dict(got["state"])
    want_hf = hf_state_dict(gathered)  # the engine holds exactly the trainer's weights
    assert got["synced"].keys() == want_hf.keys() and all(torch.equal(got["synced"][k], v) for k, v in want_hf.items())
    trunk = {k: v for k, v in got["state"].items() if k.startswith("model.")}
    assert trunk and all(torch.equal(got["critic"][k], v) for k, v in trunk.items())


def _loss_curve(*, mixed: bool, steps: int = 20) -> tuple[list[float], torch.optim.Optimizer, MoEModel, torch.dtype]:
    """Next-token loss of the tiny model over `steps` AdamW steps on one fixed row (fp32, or bf16 mixed precision
    over fp32 masters on a one-rank FSDP2 group)."""
    from t1core.distributed import shard_ as shard
    model = MoEModel(ModelConfig.tiny(), seed=0)
    if mixed:
        shard(model, DataParallel.single(), param_dtype=torch.bfloat16)
    opt, _ = make_optimizer(model, lr=1e-3, cfg=load_config(None, ["--optim.warmup_steps=0"]))
    ids = torch.randint(0, 4096, (33,), generator=torch.Generator().manual_seed(0))
    losses, compute = [], None
    for _ in range(steps):
        hidden = model(ids[:-1])
        compute = hidden.dtype
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), ids[1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt, model, compute


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_masters_and_tracks_fp32() -> None:
    """model.dtype bf16: layers compute in bf16 while parameters (the masters) and AdamW moments stay fp32, and the
    loss over 20 steps follows the fp32 run's. Tolerance: bf16 rounds activations to 8 bits of mantissa (~0.4%),
    which compounds over 20 steps of Adam; every step within 10% of fp32's loss and 3% on average."""
    import torch.distributed as dist
    want, _, _, compute32 = _loss_curve(mixed=False)
    try:
        got, opt, model, compute = _loss_curve(mixed=True)
    finally:
        dist.destroy_process_group()  # the one-rank group shard_ made
    assert compute32 == torch.float32 and compute == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moments = [t for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    assert want[-1] < 0.5 * want[0]  # it learns
    gaps = [abs(a - b) / a for a, b in zip(want, got)]
    assert max(gaps) < 0.10 and sum(gaps) / len(gaps) < 0.03, gaps


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    """Per-layer recompute changes what is stored, not what is computed: gradients equal bit for bit, and the
    parameter names stay the model's own."""
    from t1core.distributed import checkpoint_layers_
    ids = torch.randint(0, 301, (40,), generator=torch.Generator().manual_seed(1))
    grads, runs = [], []
    for ac in (False, True):
        model = MoEModel(SMALL, seed=0)
        if ac:
            checkpoint_layers_(model)
        calls = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        model.compute_logits(ids, cu_seqlens=[0, 15, 40]).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        runs.append(len(calls))
    assert runs == [1, 2]  # with checkpointing the layer ran again in the backward
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.docker
@needs_docker
def test_bf16_run_with_checkpointed_layers_resumes_bit_for_bit(tmp_path) -> None:
    """The trainer in one process with model.dtype=bfloat16 (fp32 masters on a one-rank FSDP2 group: DCP checkpoints,
    streamed sync and exports, a sharded KL anchor) and per-layer activation checkpointing: 2 steps straight and
    1 + --resume + 1 end with the same policy, critic and AdamW state, and the exports are bf16."""
    import json
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks
    from t1core import train
    from t1core.checkpoint.save import load_checkpoint
    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    common = [f"--tasks.source={tasks}", "--rollout.episodes_per_step=2", "--rollout.group_size=2",
              "--rollout.concurrency=1", "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8",
              "--rollout.max_tokens=640", "--algo.minibatch_tokens=1400", "--warmstart.pretrain_steps=0",
              "--warmstart.sft_epochs=0", "--warmstart.critic_steps=0", "--run.checkpoint_every=1",
              "--algo.kl_coef=0.1", "--algo.actor_push=center",
              "--optim.lr_decay=false", "--model.dtype=bfloat16", "--parallel.activation_checkpointing=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(["--out", str(straight), "--run.steps=2", *common]) == 0
    assert train.main(["--out", str(split), "--run.steps=1", *common]) == 0
    assert train.main(["--resume", str(split), "--run.steps=2"]) == 0
    a, b = (load_checkpoint(d / "checkpoints", restore_rng=False) for d in (straight, split))
    for part in ("policy", "critic"):
        assert a[part].keys() == b[part].keys()
        assert all(v.dtype == torch.float32 and torch.equal(v, b[part][k]) for k, v in a[part].items()), part
    moments = a["optimizers"]["actor"]["state"]
    assert moments and all(torch.equal(s["exp_avg"], b["optimizers"]["actor"]["state"][n]["exp_avg"])
                           for n, s in moments.items())
    assert json.loads((straight / "final" / "config.json").read_text())["dtype"] == "bfloat16"


def test_shard_options_follow_the_config() -> None:
    """bf16 is mixed precision over fp32 masters, fp32 plain; CPU offload is refused off CUDA, naming why."""
    from t1core.models import shard_options
    assert shard_options(load_config(None, [])) == {"param_dtype": None, "cpu_offload": False, "expert_parallel": 1,
                                                    "shard_experts": False}
    assert shard_options(load_config(None, ["--model.dtype=bfloat16"]))["param_dtype"] == torch.bfloat16
    with pytest.raises(ValueError, match="parallel.cpu_offload=true.*run.device='cuda'"):
        shard_options(load_config(None, ["--parallel.cpu_offload=true"]))
