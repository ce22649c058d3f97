"""Checkpoints: atomic under crashes, exact resume (parameters, optimizer, every RNG), HF export."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from t1model.hf_io import save_pretrained
from t1core.checkpoint.rng import capture_rng_state, restore_rng_state
from t1core.checkpoint.save import latest_checkpoint, load_checkpoint, save_checkpoint
from t1core.config import RunConfig
from t1core.config_toml import load_config
from tests.machine import gloo_rank

REPO = Path(__file__).resolve().parents[1]


def _parts(seed: int):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    critic = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW([*policy.parameters(), *critic.parameters()], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    gens = {"sampler": torch.Generator().manual_seed(seed + 1), "tasks": np.random.default_rng(seed + 2),
            "order": random.Random(seed + 3)}
    return policy, critic, opt, sched, gens


def _train_step(policy, critic, opt, sched, gens) -> None:
    """Draws from every RNG the checkpoint must restore (global torch/numpy/python and the named ones)."""
    x = torch.randn(5, 4, generator=gens["sampler"]) + torch.randn(5, 4)  # named + global torch
    x = x * float(gens["tasks"].uniform(0.5, 1.5)) * float(np.random.uniform(0.5, 1.5))
    x = x * (1 + gens["order"].random() + random.random())
    loss = policy(x).square().mean() + critic(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def _save(root, step, policy, critic, opt, sched, gens, **kwargs):
    return save_checkpoint(root, step=step, policy=policy, critic=critic,
                           optimizers={"adamw": opt, "sched": sched}, rng_states=capture_rng_state(gens),
                           data_state={"cursor": step, "order": [3, 1, 2]}, config=RunConfig(), **kwargs)


def _params(*modules) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def test_resume_is_bitwise_exact(tmp_path):
    policy, critic, opt, sched, gens = _parts(0)
    for _ in range(4):
        _train_step(policy, critic, opt, sched, gens)
    straight = _params(policy, critic)

    policy, critic, opt, sched, gens = _parts(0)
    for step in range(2):
        _train_step(policy, critic, opt, sched, gens)
    _save(tmp_path, 2, policy, critic, opt, sched, gens)
    for _ in range(3):  # wander off: the resume must not depend on anything done after the save
        _train_step(policy, critic, opt, sched, gens)

    policy, critic, opt, sched, gens = _parts(123)  # fresh objects, different init and RNG
    ckpt = load_checkpoint(tmp_path, policy=policy, critic=critic, optimizers={"adamw": opt, "sched": sched},
                           generators=gens)
    assert ckpt["step"] == 2 and ckpt["data_state"] == {"cursor": 2, "order": [3, 1, 2]}
    assert ckpt["config"] == RunConfig() and ckpt["path"] == tmp_path / "step_00000002"
    for _ in range(2):
        _train_step(policy, critic, opt, sched, gens)
    resumed = _params(policy, critic)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_rng_restore_reproduces_draws():
    gens = {"t": torch.Generator().manual_seed(5), "n": np.random.default_rng(5), "p": random.Random(5)}
    state = capture_rng_state(gens)

    def draws():
        return (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random(),
                torch.rand(2, generator=gens["t"]).tolist(), gens["n"].random(2).tolist(), gens["p"].random())

    first = draws()
    restore_rng_state(state, gens)
    assert draws() == first
    with pytest.raises(ValueError, match="captured names"):
        restore_rng_state(state, {"t": gens["t"]})
    with pytest.raises(ValueError, match="expected a torch generator"):
        restore_rng_state(state, {**gens, "t": random.Random(0)})


class _CrashingPolicy(torch.nn.Linear):
    """A policy whose HF export dies after writing part of its file."""

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path)
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"half a file")
        raise RuntimeError("disk full")


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    policy, critic, opt, sched, gens = _parts(0)
    _save(tmp_path, 1, policy, critic, opt, sched, gens)
    saved = _params(policy)
    crashing = _CrashingPolicy(4, 8)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, step=2, policy=crashing, critic=critic, optimizers={}, rng_states={},
                        data_state=None, config=RunConfig())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    fresh, *_ = _parts(9)
    assert load_checkpoint(tmp_path, policy=fresh)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh)))


def test_killed_process_leaves_loadable_checkpoint(tmp_path):
    """A real crash: the saving process dies (no cleanup, no finally) in the middle of writing."""
    policy, critic, opt, sched, gens = _parts(0)
    _save(tmp_path, 1, policy, critic, opt, sched, gens)
    script = textwrap.dedent(f"""
        import os, torch
        from t1core.checkpoint.save import save_checkpoint
        from t1core.config import RunConfig
        class Dying(torch.nn.Linear):
            def save_pretrained(self, path):
                os.makedirs(path)
                open(os.path.join(path, "model.safetensors"), "wb").write(b"partial")
                os._exit(9)
        save_checkpoint({str(tmp_path)!r}, step=2, policy=Dying(2, 2), critic=None, optimizers={{}},
                        rng_states={{}}, data_state=None, config=RunConfig())
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 9
    assert any(p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir())  # the debris is there
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert load_checkpoint(tmp_path, restore_rng=False)["step"] == 1
    with pytest.raises(FileNotFoundError):
        load_checkpoint(next(tmp_path.glob(".tmp-*")), restore_rng=False)
    # the next save clears the debris and moves `latest`
    _save(tmp_path, 2, policy, critic, opt, sched, gens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001", "step_00000002"]


def test_orphan_step_dir_is_replaced_and_latest_is_protected(tmp_path):
    policy, critic, opt, sched, gens = _parts(0)
    _save(tmp_path, 1, policy, critic, opt, sched, gens)
    _save(tmp_path, 2, policy, critic, opt, sched, gens)
    (tmp_path / "latest").write_text("step_00000001\n")  # as if we crashed before the pointer moved
    _train_step(policy, critic, opt, sched, gens)
    _save(tmp_path, 2, policy, critic, opt, sched, gens)  # the resumed run re-saves step 2
    fresh, *_ = _parts(9)
    load_checkpoint(tmp_path, policy=fresh, restore_rng=False)
    assert all(torch.equal(a, b) for a, b in zip(_params(policy), _params(fresh)))
    with pytest.raises(ValueError, match="refusing to overwrite"):
        _save(tmp_path, 2, policy, critic, opt, sched, gens)
    _save(tmp_path, 3, policy, critic, opt, sched, gens, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert load_config(str(tmp_path / "step_00000003" / "config.toml"), []) == RunConfig()


def test_policy_exported_in_hf_format(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    policy = transformers.Qwen3MoeForCausalLM(cfg)
    path = save_checkpoint(tmp_path, step=7, policy=policy, critic=None, optimizers={}, rng_states=capture_rng_state(),
                           data_state=None, config=RunConfig())
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(path / "policy_hf")
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits, rtol=0, atol=0)
    assert load_checkpoint(tmp_path, critic=None)["critic"] is None


# ---- sharded (FSDP2, gloo ranks): DCP checkpoints, resharding, streamed HF export, the sharded KL anchor ----

def _small_cfg():
    from t1model.model import ModelConfig
    # Awkward for 2 ranks: V=301 and E=3 rows do not divide evenly.
    return ModelConfig(vocab_size=301, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       num_experts=3, num_experts_per_tok=2)


def _trainer_parts(dp, seed: int):
    """Policy, critic (sharded when dp is distributed) and their optimizers/schedulers, as the trainer names them."""
    from t1core.distributed import ModelOptimizer, shard_
    from t1model.model import MoEModel, ValueModel
    from t1core.optimizer import make_optimizer
    cfg = load_config(None, ["--optim.warmup_steps=3"])
    policy = shard_(MoEModel(_small_cfg(), seed=seed), dp)
    critic = shard_(ValueModel.from_policy(MoEModel(_small_cfg(), seed=seed + 1)), dp)
    (opt_a, sched_a), (opt_c, sched_c) = (make_optimizer(m, lr=1e-2, cfg=cfg) for m in (policy, critic))
    optimizers = {"actor": ModelOptimizer(policy, opt_a), "critic": ModelOptimizer(critic, opt_c),
                  "sched_actor": sched_a, "sched_critic": sched_c}
    return policy, critic, optimizers


def _sharded_step(policy, critic, optimizers, step: int) -> None:
    """One optimizer step of each model on a row fixed by `step` (the same on every rank: FSDP2's averaged gradient
    is the single-process one up to rounding)."""
    ids = torch.randint(0, 301, (24,), generator=torch.Generator().manual_seed(step))
    for model, loss in ((policy, lambda: policy.compute_logits(ids).square().mean()),
                        (critic, lambda: critic(ids).square().mean())):
        opt = optimizers["actor" if model is policy else "critic"].opt
        opt.zero_grad()
        loss().backward()
        opt.step()
        optimizers["sched_actor" if model is policy else "sched_critic"].step()


def _gathered(policy, critic, dp) -> dict:
    from t1core.distributed import full_state_dict
    return {"policy": full_state_dict(policy, dp), "critic": full_state_dict(critic, dp)}


def _sharded_worker(rank: int, port: int, out: str, phase: str) -> None:
    from t1core.checkpoint.hf import save_hf
    from t1core.distributed import (DataParallel, ModelOptimizer, frozen_shards, sharded_critic,
                                    sharded_from_pretrained)
    with gloo_rank(rank, 2, port, timeout_s=90):
        dp, out = DataParallel(rank=rank, world_size=2), Path(out)
        if phase == "save":  # 2 steps, checkpoint (DCP), 2 more; then resume a fresh copy from the checkpoint
            parts = _trainer_parts(dp, seed=0)
            for step in range(2):
                _sharded_step(*parts, step)
            # An optimizer that has not stepped yet (the actor during critic-only iterations) has no state, and
            # saving must not create any (a zero step would change AdamW's bias correction later).
            parts[2]["idle"] = ModelOptimizer(parts[0], torch.optim.AdamW(parts[0].parameters()))
            save_checkpoint(out / "ckpt2", step=2, policy=parts[0], critic=parts[1], optimizers=parts[2],
                            rng_states={}, data_state={"step": 2}, config=RunConfig(), dp=dp)
            for step in range(2, 4):
                _sharded_step(*parts, step)
            straight = _gathered(parts[0], parts[1], dp)
            save_hf(parts[0], out / "hf", dp, max_shard_bytes=20_000)  # streamed, several shard files
            anchor, anchor_hf = frozen_shards(parts[0]), frozen_shards(parts[0], hf_dir=out / "hf")
            loaded = sharded_from_pretrained(out / "hf", dp, dtype=torch.float32)  # each rank reads its rows
            anchors = [_gathered(a, sharded_critic(loaded, dp), dp) for a in (anchor, anchor_hf, loaded)]
            assert not parts[2]["idle"].opt.state
            fresh = _trainer_parts(dp, seed=5)
            fresh[2]["idle"] = ModelOptimizer(fresh[0], torch.optim.AdamW(fresh[0].parameters()))
            ckpt = load_checkpoint(out / "ckpt2", policy=fresh[0], critic=fresh[1], optimizers=fresh[2],
                                   restore_rng=False)
            assert not fresh[2]["idle"].opt.state
            del fresh[2]["idle"]
            for step in range(2, 4):
                _sharded_step(*fresh, step)
            if rank == 0:
                torch.save({"straight": straight, "resumed": _gathered(fresh[0], fresh[1], dp), "anchors": anchors,
                            "data_state": ckpt["data_state"]}, out / "phase_save.pt")
            else:
                _gathered(fresh[0], fresh[1], dp)
        else:  # resume a single process's (whole) checkpoint on 2 ranks
            fresh = _trainer_parts(dp, seed=5)
            load_checkpoint(out / "ckpt1", policy=fresh[0], critic=fresh[1], optimizers=fresh[2], restore_rng=False)
            for step in range(2, 4):
                _sharded_step(*fresh, step)
            got = _gathered(fresh[0], fresh[1], dp)
            if rank == 0:
                torch.save(got, out / "phase_load.pt")


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_states(got: dict, want: dict, *, exact: bool) -> None:
    for part in ("policy", "critic"):
        assert got[part].keys() == want[part].keys()
        for k, v in want[part].items():
            if exact:
                assert torch.equal(got[part][k], v), (part, k)
            else:  # a different world size sums the gradients in another order
                torch.testing.assert_close(got[part][k], v, rtol=1e-5, atol=1e-6, msg=f"{part}.{k}")


@pytest.mark.torchrun
def test_sharded_checkpoints_resume_and_reshard(tmp_path):
    """DCP: each of 2 ranks writes its shards; a fresh pair resumes bit for bit; one plain process resumes the same
    checkpoint (2 -> 1) and 2 ranks resume a single process's checkpoint (1 -> 2), both equal to the straight runs
    within fp32 rounding. The streamed HF export equals a single process's save_pretrained byte for byte, and the
    sharded KL anchor (from shards or from that export) equals the policy, as does the policy each rank loads from
    its own rows of the export."""
    import torch.multiprocessing as mp
    from t1core.distributed import DataParallel, ModelOptimizer
    from t1model.model import MoEModel
    mp.spawn(_sharded_worker, args=(_port(), str(tmp_path), "save"), nprocs=2, join=True)
    got = torch.load(tmp_path / "phase_save.pt", weights_only=False)
    step_dir = tmp_path / "ckpt2" / "step_00000002"
    assert sorted(p.name for p in (step_dir / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert got["data_state"] == {"step": 2}
    _assert_states(got["resumed"], got["straight"], exact=True)
    moved = max(float((MoEModel(_small_cfg(), seed=0).state_dict()[k] - v).abs().max())
                for k, v in got["straight"]["policy"].items())
    assert moved > 1e-3
    # Inspection in one process: the whole state dicts, optimizer moments by parameter name.
    whole = load_checkpoint(tmp_path / "ckpt2", restore_rng=False)
    assert whole["policy"].keys() == got["straight"]["policy"].keys()
    assert set(whole["optimizers"]["actor"]["state"]) == set(got["straight"]["policy"])

    # Streamed export vs the single-process save of the same weights.
    ref = MoEModel(_small_cfg(), seed=None)
    ref.load_state_dict(got["straight"]["policy"])
    save_pretrained(ref, tmp_path / "ref_hf", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "ref_hf").iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert all((tmp_path / "hf" / f).read_bytes() == (tmp_path / "ref_hf" / f).read_bytes() for f in files)
    for anchor in got["anchors"]:  # the KL anchors and the sharded load of the export; its critic: trunk, zero head
        assert all(torch.equal(anchor["policy"][k], v) for k, v in got["straight"]["policy"].items())
        critic = anchor["critic"]
        assert all(torch.equal(critic[k], got["straight"]["policy"][k]) for k in critic if k.startswith("model."))
        assert not critic["value_head.weight"].any() and not critic["value_head.bias"].any()

    # 2 -> 1: a plain process resumes the sharded checkpoint.
    single = DataParallel.single()
    policy, critic, optimizers = _trainer_parts(single, seed=5)
    idle = ModelOptimizer(policy, torch.optim.AdamW(policy.parameters()))
    load_checkpoint(tmp_path / "ckpt2", policy=policy, critic=critic, optimizers={**optimizers, "idle": idle},
                    restore_rng=False)
    assert not idle.opt.state
    for step in range(2, 4):
        _sharded_step(policy, critic, optimizers, step)
    _assert_states(_gathered(policy, critic, single), got["straight"], exact=False)

    # 1 -> 2: a single process's whole checkpoint resumed on 2 ranks.
    policy, critic, optimizers = _trainer_parts(single, seed=0)
    for step in range(2):
        _sharded_step(policy, critic, optimizers, step)
    save_checkpoint(tmp_path / "ckpt1", step=2, policy=policy, critic=critic, optimizers=optimizers, rng_states={},
                    data_state=None, config=RunConfig())
    assert not (tmp_path / "ckpt1" / "step_00000002" / "dcp").exists()
    for step in range(2, 4):
        _sharded_step(policy, critic, optimizers, step)
    mp.spawn(_sharded_worker, args=(_port(), str(tmp_path), "load"), nprocs=2, join=True)
    _assert_states(torch.load(tmp_path / "phase_load.pt", weights_only=False), _gathered(policy, critic, single),
                   exact=False)
