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

from t1core.checkpointing import (capture_rng_state, latest_checkpoint, load_checkpoint, restore_rng_state,
                                  save_checkpoint)
from t1core.config import RunConfig, load_config

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
        from t1core.checkpointing import save_checkpoint
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
