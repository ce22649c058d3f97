"""Expert parallelism (t1core.expert_parallel) on gloo CPU ranks against one plain process.

The reference is a plain unsharded model in one process running every rank's tokens one rank at a time, the loss
the mean of the ranks' losses (what data parallelism trains on). In the batch-invariant CPU mode the EP forward
(logits, loss) equals it bit for bit; gradients go through other sums (the all-to-all gathers an expert's rows in
another order, FSDP2 sums the ranks' gradients) and agree to fp32 round-off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from t1kernels.rows import batch_invariant_mode
from t1model.model import ModelConfig, MoEModel
from tests.machine import free_port, gloo_rank, needs_docker

SMALL = ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=8, num_experts_per_tok=2)


def _inputs(rank: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens (a different count per rank) and replayed routing [T, L_moe, K]. skew: every token of
    every rank goes to experts 0 and 1 (EP rank 0's): the other EP ranks receive no tokens at all (the skewed runs
    also checkpoint each layer's activations)."""
    g = torch.Generator().manual_seed(100 + rank)
    T, L, K = 19 + 6 * rank, len(SMALL.moe_layer_ids), SMALL.num_experts_per_tok
    ids = torch.randint(0, SMALL.vocab_size, (T,), generator=g)
    if skew:
        routing = torch.tensor([1, 0]).expand(T, L, K).clone()
    else:
        routing = torch.stack([torch.randperm(SMALL.num_experts, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)
    return ids, routing.to(torch.uint8)


def _loss(model: MoEModel, ids: torch.Tensor, routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model.compute_logits(ids, cu_seqlens=[0, 7, ids.shape[0]], replay_routing=routing)
    return F.cross_entropy(logits[:-1].float(), ids[1:]), logits


def _grads(model: MoEModel) -> dict[str, torch.Tensor]:
    """Whole gradients by name (collective: FSDP2 shards and EP experts gathered)."""
    from torch.distributed.tensor import DTensor
    from t1core.expert_parallel import is_expert_param, whole_experts
    out = {}
    for name, p in model.named_parameters():
        if is_expert_param(p):
            out[name] = whole_experts(torch.zeros_like(p) if p.grad is None else p.grad, p)
        elif isinstance(p.grad, DTensor):
            out[name] = p.grad.full_tensor()
        else:
            out[name] = p.grad.clone()
    return out


# The AdamW step the shard_experts case takes on both sides: eps well above the gradients' round-off, so that the
# first step (about lr * g / |g|) does not turn a 1e-9 difference in a near-zero gradient into one of lr.
LR, EPS = 1e-2, 1e-4


def _worker(rank: int, world: int, ep: int, port: int, out_path: str, skew: bool, shard: bool = False) -> None:
    with gloo_rank(rank, world, port, timeout_s=120):
        from t1core.distributed import DataParallel, checkpoint_layers_, iter_hf_tensors, shard_
        model = MoEModel(SMALL, seed=0)
        if skew:  # and per-layer activation checkpointing: the backward recomputes each layer's dispatch
            checkpoint_layers_(model)
        model = shard_(model, DataParallel(rank=rank, world_size=world), expert_parallel=ep, shard_experts=shard)
        local = model.model.layers[0].mlp.experts.w13
        ids, routing = _inputs(rank, skew)
        exchanges, a2a = [], dist.all_to_all_single
        dist.all_to_all_single = lambda *a, **k: (exchanges.append(1), a2a(*a, **k))[1]
        with batch_invariant_mode(cache_weights=False):  # the backward too: checkpointing recomputes in it
            try:
                loss, logits = _loss(model, ids, routing)
            finally:
                dist.all_to_all_single = a2a
            # The replayed routing planned every layer's dispatch before the forward in 2 exchanges; then 2 a layer.
            assert len(exchanges) == 2 + 2 * len(SMALL.moe_layer_ids), len(exchanges)
            loss.backward()
        grads = _grads(model)
        if shard:  # one AdamW step on the shards, then the whole experts out of the stream and a DCP checkpoint
            import torch.distributed.checkpoint as dcp
            from t1core.distributed import model_state
            torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False).step()
            dcp.save(model_state(model), checkpoint_id=out_path + ".dcp")
            # Loaded from a HF checkpoint already sharded: each rank reads only its experts' rows and columns.
            from t1core.distributed import sharded_from_pretrained
            loaded = sharded_from_pretrained(Path(out_path + ".hf"), DataParallel(rank=rank, world_size=world),
                                             dtype=torch.float32, expert_parallel=ep, shard_experts=True)
            loaded_hf = dict(iter_hf_tensors(loaded))
        hf = dict(iter_hf_tensors(model))
        parts: list = [None] * world
        dist.all_gather_object(parts, (loss.detach(), logits.detach(), tuple(local.shape)))
        if rank == 0:
            torch.save({"ranks": parts, "grads": grads, "hf": hf, "loaded": loaded_hf if shard else None}, out_path)


def _reference(world: int, skew: bool,
               model: MoEModel | None = None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    model = model or MoEModel(SMALL, seed=0)
    outs, total = [], 0.0
    with batch_invariant_mode(cache_weights=False):
        for r in range(world):
            loss, logits = _loss(model, *_inputs(r, skew))
            outs.append((loss.detach(), logits.detach()))
            total = total + loss / world
        total.backward()
    return outs, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.torchrun
@pytest.mark.parametrize(("world", "ep", "skew"), [(2, 2, False), (2, 2, True), (4, 4, False), (4, 2, True)])
def test_expert_parallel_equals_one_process(tmp_path, world: int, ep: int, skew: bool) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(world, ep, free_port(), str(out), skew), nprocs=world, join=True)
    got = torch.load(out, weights_only=False)
    want, want_grads = _reference(world, skew)
    E, F2, D = SMALL.num_experts, 2 * SMALL.moe_intermediate_size, SMALL.hidden_size
    for (loss, logits, local_shape), (w_loss, w_logits) in zip(got["ranks"], want):
        assert local_shape == (E // ep, F2, D)  # each rank holds E/N whole experts
        assert torch.equal(logits, w_logits) and torch.equal(loss, w_loss)  # bitwise in the exact mode
    assert got["grads"].keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert g is not None and g.abs().max() > 0 or (skew and "experts" in name), name
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    router = [n for n in want_grads if n.endswith("mlp.gate.weight")]
    assert router and all(want_grads[n].abs().max() > 0 for n in router)  # the router learns through replay
    whole = MoEModel(SMALL, seed=0)
    from t1model.hf_io import hf_state_dict
    want_hf = hf_state_dict(whole)
    assert got["hf"].keys() == want_hf.keys() and all(torch.equal(got["hf"][k], v) for k, v in want_hf.items())


def test_bad_expert_parallel_is_one_line_exit_2(tmp_path) -> None:
    """EP that does not divide the experts (16 in the tiny model) or the world size: one line, exit status 2."""
    env = {**os.environ, "WORLD_SIZE": "2"}
    for value, what in (("3", "num_experts=16"), ("4", "world size 2")):
        r = subprocess.run([sys.executable, "-m", "t1core.train", f"--parallel.expert_parallel={value}",
                            "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert "parallel.expert_parallel" in lines[-1] and what in lines[-1], r.stderr
    from t1core.expert_parallel import check_expert_parallel
    check_expert_parallel(1, num_experts=0, world=1)  # off: nothing to check
    with pytest.raises(ValueError, match="parallel.expert_parallel"):
        check_expert_parallel(2, num_experts=0, world=2)


@pytest.mark.torchrun
@pytest.mark.docker
@needs_docker
def test_expert_parallel_run_equals_one_process_and_resumes_under_ep1(tmp_path) -> None:
    """`torchrun --nproc_per_node=2 -m t1core.train --parallel.expert_parallel=2` against one process: the same
    losses step by step (rounding aside), TITO drift 0, the same final weights; its DCP checkpoint (written by the
    two EP ranks, each with half of every layer's experts) reads whole, equals the run's HF export, and resumes in
    one process without EP."""
    import json
    from pathlib import Path
    from safetensors.torch import load_file
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks
    from t1core import train
    from t1core.checkpoint.save import load_checkpoint
    from t1model.hf_io import hf_state_dict
    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    common = [f"--tasks.source={tasks}", "--rollout.episodes_per_step=2", "--rollout.group_size=2",
              "--rollout.concurrency=1", "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8",
              "--rollout.max_tokens=640", "--algo.minibatch_tokens=700", "--warmstart.pretrain_steps=0",
              "--warmstart.sft_epochs=0", "--warmstart.critic_steps=1", "--run.checkpoint_every=2",
              "--optim.lr_actor=1e-3", "--algo.kl_coef=0.1", "--algo.actor_push=center",
              "--rollout.batch_invariant=true", "--run.steps=3",
              "--algo.cut_episodes=terminal"]  # every episode is cut at max_turns=2: its verifier count must train
    single, ep = tmp_path / "single", tmp_path / "ep2"
    assert train.main(["--out", str(single), *common]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "t1core.train",
           "--out", str(ep), "--parallel.expert_parallel=2", *common]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [{r["step"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}
            for d in (single, ep)]
    assert rows[0].keys() == rows[1].keys()
    losses = 0
    for step, a in rows[0].items():
        b = rows[1][step]
        for key in a:
            if key.endswith(("/loss", "/grad_norm")):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key)
                losses += 1
            if key == "tito/drift_tokens":
                assert a[key] == b[key] == 0.0
    assert losses >= 6 and rows[1][2]["policy/loss"] is not None
    want, got = (load_file(d / "final" / "model.safetensors") for d in (single, ep))
    warm = load_file(single / "warmstart" / "model.safetensors")
    assert want.keys() == got.keys()
    experts = [k for k in want if ".experts." in k]
    assert max(float((want[k] - warm[k]).abs().max()) for k in experts) > 1e-5  # the experts were trained
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)
    saved = load_checkpoint(ep / "checkpoints", restore_rng=False)
    whole = MoEModel(ModelConfig.tiny(), seed=None)
    whole.load_state_dict(saved["policy"])
    assert all(torch.equal(v, got[k]) for k, v in hf_state_dict(whole).items())
    assert train.main(["--resume", str(ep), "--run.steps=4", "--parallel.expert_parallel=1"]) == 0
    assert json.loads((ep / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4


@pytest.mark.torchrun
def test_shard_experts_equals_one_process(tmp_path) -> None:
    """parallel.shard_experts on 4 gloo ranks, EP 2 x dp 2: each rank holds half the columns of its 4 experts,
    all-gathered over dp around their use and their gradients reduce-scattered. Logits and losses bitwise the
    single process's, every gradient to fp32 round-off, one AdamW step the same update; the streamed HF export and
    the DCP checkpoint hold the whole experts."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from t1model.hf_io import hf_state_dict
    world, ep = 4, 2
    from t1model.hf_io import save_pretrained
    out = tmp_path / "rank0.pt"
    save_pretrained(MoEModel(SMALL, seed=0), str(out) + ".hf")
    mp.spawn(_worker, args=(world, ep, free_port(), str(out), False, True), nprocs=world, join=True)
    got = torch.load(out, weights_only=False)
    whole = MoEModel(SMALL, seed=0)
    want, want_grads = _reference(world, False, whole)
    E, F2, D = SMALL.num_experts, 2 * SMALL.moe_intermediate_size, SMALL.hidden_size
    for (loss, logits, local_shape), (w_loss, w_logits) in zip(got["ranks"], want):
        assert local_shape == (E // ep, F2 // (world // ep), D)  # E/N experts, half their columns
        assert torch.equal(logits, w_logits) and torch.equal(loss, w_loss)
    assert got["grads"].keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    before = {k: v.clone() for k, v in hf_state_dict(whole).items()}
    assert got["loaded"].keys() == before.keys() and all(torch.equal(got["loaded"][k], v) for k, v in before.items())
    torch.optim.AdamW(whole.parameters(), lr=LR, eps=EPS, foreach=False).step()
    want_hf = hf_state_dict(whole)
    assert got["hf"].keys() == want_hf.keys()
    moved = max(float((want_hf[k] - before[k]).abs().max()) for k in want_hf if ".experts." in k)
    assert moved > 1e-3  # the step moved the experts (AdamW's first step: about lr)
    for k, v in want_hf.items():
        torch.testing.assert_close(got["hf"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    dcp_to_torch_save(str(out) + ".dcp", tmp_path / "dcp.pt")
    saved = torch.load(tmp_path / "dcp.pt", weights_only=False)
    for name, p in whole.named_parameters():
        assert saved[name].shape == p.shape, name  # the whole [E, ., .] experts
        torch.testing.assert_close(saved[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_shard_experts_without_expert_parallel_is_one_line_exit_2(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "t1core.train", "--parallel.shard_experts=true",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "parallel.shard_experts" in r.stderr.strip().splitlines()[-1], r.stderr
