"""Weight sync and sharded checkpoints on 2 gloo ranks (FSDP2), per GiB of fp32 weights.

Run: `python -m pytest bench/test_bench_sync.py -q -s`. Prints seconds per GiB for
- engine sync streamed one decoder layer at a time (`distributed.iter_hf_tensors` -> `TorchEngine.update_weights`)
  against gathering the whole state dict on every rank first (the path the trainer took before);
- a DCP checkpoint save (each rank its shards of policy, critic and both AdamW states, plus the streamed HF export)
  and its load into fresh sharded models.
Gates on correctness (every engine holds the trainer's weights; the resumed models equal the saved ones), never
asserts on time.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout.torch_engine import EngineConfig, TorchEngine
from t1model.hf_io import hf_state_dict
from t1core.checkpoint.save import load_checkpoint, save_checkpoint
from t1core.config import RunConfig
from t1core.config_toml import load_config
from t1core.distributed import (DataParallel, ModelOptimizer, full_state_dict, iter_hf_tensors, shard_)
from t1model.model import ModelConfig, MoEModel, ValueModel
from t1core.optimizer import make_optimizer
from tests.machine import gloo_rank

CFG = ModelConfig.tiny().replace(num_hidden_layers=8)
REPEATS = 3
GIB = 2**30


def _parts(dp: DataParallel, seed: int):
    cfg = load_config(None, [])
    policy = shard_(MoEModel(CFG, seed=seed), dp)
    critic = shard_(ValueModel.from_policy(MoEModel(CFG, seed=seed + 1)), dp)
    opts = {}
    for name, model in (("actor", policy), ("critic", critic)):
        opt, sched = make_optimizer(model, lr=1e-3, cfg=cfg)
        ids = torch.arange(32) % CFG.vocab_size
        out = model.compute_logits(ids) if name == "actor" else model(ids)
        out.square().mean().backward()
        opt.step()  # AdamW state exists: the checkpoint carries it
        opts[name], opts[f"sched_{name}"] = ModelOptimizer(model, opt), sched
    return policy, critic, opts


def _whole_everywhere(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, port: int, out: str) -> None:
    with gloo_rank(rank, 2, port, timeout_s=300):
        dp, out = DataParallel(rank=rank, world_size=2), Path(out)
        policy, critic, opts = _parts(dp, seed=0)
        engine = TorchEngine(MoEModel(CFG, seed=9), EngineConfig(max_batch=1, num_slots=1, max_seq_len=64))
        streamed, whole = [], []
        for _ in range(REPEATS):
            streamed.append(_timed(lambda: engine.update_weights(iter_hf_tensors(policy))))
            synced_streamed = hf_state_dict(engine.model)
            whole.append(_timed(lambda: engine.update_weights(
                (n, t) for n, t in hf_state_dict(_load(MoEModel(CFG, seed=None), _whole_everywhere(policy))).items())))
        engine.close()
        gathered = full_state_dict(policy, dp)
        saves, loads = [], []
        for i in range(REPEATS):
            saves.append(_timed(lambda: save_checkpoint(out / "ckpt", step=i, policy=policy, critic=critic,
                                                        optimizers=opts, rng_states={}, data_state=None,
                                                        config=RunConfig(), keep_last=1, dp=dp)))
            fresh = _parts(dp, seed=3)
            loads.append(_timed(lambda: load_checkpoint(out / "ckpt", policy=fresh[0], critic=fresh[1],
                                                        optimizers=fresh[2], restore_rng=False)))
        resumed = full_state_dict(fresh[0], dp)
        if rank == 0:
            ref = _load(MoEModel(CFG, seed=None), gathered)
            want = hf_state_dict(ref)
            assert all(torch.equal(synced_streamed[k], v) for k, v in want.items())
            assert all(torch.equal(resumed[k], v) for k, v in gathered.items())
            dcp_bytes = sum(p.stat().st_size for p in (out / "ckpt").glob("step_*/dcp/*"))
            (out / "figures.json").write_text(json.dumps({
                "weights_bytes": sum(t.numel() * t.element_size() for t in want.values()), "dcp_bytes": dcp_bytes,
                "streamed_s": min(streamed), "whole_s": min(whole), "save_s": min(saves), "load_s": min(loads)}))


def _load(model: MoEModel, state: dict[str, torch.Tensor]) -> MoEModel:
    model.load_state_dict(state)
    return model


def test_sync_and_checkpoint_per_gib(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    f = json.loads((tmp_path / "figures.json").read_text())
    w, c = f["weights_bytes"] / GIB, f["dcp_bytes"] / GIB
    print(f"\nsync, 2 gloo ranks, {w * 1024:.0f} MiB of fp32 weights ({CFG.num_hidden_layers} layers, best of "
          f"{REPEATS}): streamed per layer {f['streamed_s'] / w:.2f} s/GiB, whole state dict on every rank first "
          f"{f['whole_s'] / w:.2f} s/GiB")
    print(f"checkpoint (DCP shards of policy, critic, AdamW; {c * 1024:.0f} MiB on disk + streamed HF export): "
          f"save {f['save_s'] / c:.2f} s/GiB, load {f['load_s'] / c:.2f} s/GiB")
