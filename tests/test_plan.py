"""The memory planner (t1cli.plan): parameter counts of a real shape, per-rank bytes against what gloo ranks
allocate, the command line's verdicts and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from t1model.hf_io import config_from_hf, config_to_hf
from t1model.model import ModelConfig
from t1cli.plan import Hardware, count_params, hardware_from, plan, policy_shapes
from t1core.config_toml import load_config
from tests.machine import free_port, gloo_rank

REPO = Path(__file__).resolve().parents[1]

# Qwen/Qwen3-30B-A3B's config.json (the fields the model reads).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "use_sliding_window": False,
}

# Awkward for 2 and 4 ranks: V=301, E=6 and F=24 rows do not divide evenly.
SMALL = ModelConfig(vocab_size=301, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    num_experts=6, num_experts_per_tok=2)


def test_qwen3_30b_a3b_counts_are_the_real_ones() -> None:
    cfg = config_from_hf(QWEN3_30B_A3B)
    got = count_params(cfg)
    # Written out from the shape: per layer q, k, v, o projections, q/k norms, two RMSNorms, router, E experts of
    # three D x F matrices; embedding and an untied LM head.
    d, f, e, k, v, layers = 2048, 768, 128, 8, 151936, 48
    attn = d * 32 * 128 + 2 * d * 4 * 128 + 32 * 128 * d + 2 * 128 + 2 * d
    expert = 3 * d * f
    total = layers * (attn + d * e + e * expert) + 2 * v * d + d
    active = layers * (attn + d * e + k * expert) + 2 * v * d + d
    assert (got.total, got.active) == (total, active)
    # Qwen's model card: 30.5B total, 3.3B activated (3.35B: the card truncates).
    assert round(got.total / 1e9, 1) == 30.5 and 3.3e9 <= got.active < 3.4e9


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (padding included: what the rank allocated)."""
    seen = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _measure_worker(rank: int, world: int, port: int, out_dir: str, ep: int = 1, shard: bool = False) -> None:
    with gloo_rank(rank, world, port, timeout_s=60):
        from t1core.distributed import DataParallel, shard_
        from t1model.model import MoEModel
        from t1core.optimizer import make_optimizer
        model = shard_(MoEModel(SMALL, seed=0), DataParallel(rank=rank, world_size=world), expert_parallel=ep,
                       shard_experts=shard)
        opt, _ = make_optimizer(model, lr=1e-3, cfg=load_config(None, []))
        ids = torch.arange(40) % SMALL.vocab_size
        model.compute_logits(ids).square().mean().backward()
        opt.step()
        params = list(model.parameters())
        state = [t for s in opt.state.values() for name, t in s.items() if name in ("exp_avg", "exp_avg_sq")]
        (Path(out_dir) / f"{rank}.json").write_text(json.dumps(
            {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params),
             "optimizer": _storage_bytes(state), "state_fp32": all(t.dtype == torch.float32 for t in state)}))


@pytest.mark.torchrun
@pytest.mark.parametrize(("world", "ep", "shard"), [(2, 1, False), (4, 1, False), (4, 2, False), (4, 2, True)])
def test_planned_shard_bytes_equal_what_gloo_ranks_allocate(tmp_path: Path, world: int, ep: int, shard: bool) -> None:
    """ep > 1: each rank holds E/N whole experts (E=6 over 2) and FSDP2 shards of the rest; shard: half of their
    columns (dp = 2)."""
    mp.spawn(_measure_worker, args=(world, free_port(), str(tmp_path), ep, shard), nprocs=world, join=True)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    # The planner reads the shape from a checkpoint's config.json (no weights there).
    ckpt = tmp_path / "small"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config_to_hf(SMALL, dtype=torch.float32)))
    run = load_config(None, [f"--model.name={ckpt}", f"--parallel.expert_parallel={ep}",
                             f"--parallel.shard_experts={str(shard).lower()}"])
    rows = {r.name: r.bytes for r in plan(run, Hardware(gpus_per_node=world)).rows}
    planned = {"params": rows["policy parameters (sharded, fp32)"], "grads": rows["policy gradients (sharded)"],
               "optimizer": rows["policy optimizer state (AdamW moments, fp32)"]}
    # Rank 0 holds the largest chunks: exactly the planned bytes; every rank at most those.
    assert {k: got[0][k] for k in planned} == planned
    assert all(g[k] <= planned[k] for g in got for k in planned)
    assert all(g["state_fp32"] for g in got)
    shapes = policy_shapes(SMALL)
    # Resident parameter + optimizer bytes per rank: at most the whole model's over W plus one decoder layer.
    whole = sum(4 * torch.Size(s).numel() for s in shapes.values())
    layer = max(sum(4 * torch.Size(s).numel() for n, s in shapes.items() if n.startswith(f"model.layers.{i}."))
                for i in range(SMALL.num_hidden_layers))
    # With EP the experts are not sharded over W but split over N (whole experts, replicated over dp = W / N).
    experts = sum(4 * torch.Size(s).numel() for n, s in shapes.items() if ".experts." in n) if ep > 1 else 0
    per = ep * (world // ep if shard else 1)  # with shard_experts split over all W ranks
    assert all(g["params"] + g["optimizer"] <= 3 * (whole - experts) / world + 3 * experts / per + layer for g in got)


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "t1cli.plan", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


@pytest.mark.slow
def test_cli_verdicts_and_fixes() -> None:
    ok = _plan_cli("--model.name=tiny")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("fits: yes (peak ")
    tight = _plan_cli("--model.name=tiny", "--gpu-mem-gib=3")  # below the flat 3 GiB reserve alone
    assert tight.returncode == 1 and tight.stdout.splitlines()[-1].startswith("fits: no (peak ")
    assert "would fit with: none" in tight.stdout
    big = _plan_cli("--config", str(REPO / "t1core/configs/qwen3_30b_a3b_harbor.toml"),
                    "--parallel.activation_checkpointing=false", "--parallel.cpu_offload=false")
    assert big.returncode == 1 and "would fit with: --parallel.activation_checkpointing=true" in big.stdout


def test_shipped_30b_preset_fits_its_stated_hardware() -> None:
    out = _plan_cli("--config", str(REPO / "t1core/configs/qwen3_30b_a3b_harbor.toml"))
    assert out.returncode == 0, out.stdout
    assert "30.53B parameters, 3.35B active" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--config", "/nonexistent.toml"], "no such file"),
    (["--model.name=not_a_model"], "model.name='not_a_model'"),
    (["--run.steps=-1"], "run.steps"),
    (["--nodes", "0"], "plan.nodes"),
    (["--parallel.bogus=1"], "unknown key parallel.bogus"),
    (["--parallel.expert_parallel=3"], "parallel.expert_parallel: expected a divisor of the model's num_experts=16"),
    (["--parallel.expert_parallel=2"], "parallel.expert_parallel: expected a divisor of the world size 1"),
    (["--ib-gbs", "0"], "plan.ib_gbs"),
    (["stray"], "unrecognised arguments"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = _plan_cli(*args)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_122b_preset_is_planned_and_names_what_it_lacks() -> None:
    """A 120.7B policy is more than one H200 in bf16: with TorchEngine (a whole copy per rank) it cannot fit, and
    the planner says why rather than suggest settings that cannot help; the preset's disaggregated vLLM engine
    (tensor parallel 8, on GPUs of its own) fits, and its GPUs are planned beside the trainer's."""
    preset = str(REPO / "t1core/configs/moe_122b_harbor.toml")
    out = _plan_cli("--config", preset, "--rollout.engine=torch")
    assert out.returncode == 1
    assert "120.68B parameters" in out.stdout and "needs a tensor-parallel rollout engine" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("fits: no")
    out = _plan_cli("--config", preset)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("fits: yes")
    engine_gpu = [line for line in out.stdout.splitlines() if line.startswith("each of the vLLM engine GPUs (8")]
    assert "one vLLM engine owned by rank 0" in out.stdout and "rank 0 runs every episode, 48 at once" in out.stdout
    assert "never run against a real vLLM" in out.stdout
    assert len(engine_gpu) == 1 and float(engine_gpu[0].split()[-3]) <= 140
    trainer = plan(load_config(preset, []), hardware_from(preset))
    assert trainer.engine_gpu_bytes > 0 and not any(r.where == "gpu" and r.name.startswith("engine") for r in trainer.rows)


def test_hardware_comes_from_the_plan_table_then_the_flags(tmp_path: Path) -> None:
    """The planner's own [plan] table (skipped by the trainer's config), an old config's [parallel] keys (read by the
    planner; unknown keys to the trainer since issue 59), and the flags over both."""
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nnodes = 2\ngpus_per_node = 4\n[plan]\ngpus_per_node = 8\n")
    assert hardware_from(str(path)) == Hardware(nodes=2, gpus_per_node=8)
    assert hardware_from(str(path), nodes=5, gpu_mem_gib=80.0) == Hardware(nodes=5, gpus_per_node=8, gpu_mem_gib=80.0)
    with pytest.raises(ValueError, match=r"unknown key parallel\.nodes"):
        load_config(str(path), [])
    path.write_text("[plan]\ngpus_per_node = 8\n")
    assert load_config(str(path), []) == load_config(None, [])  # the trainer skips the planner's table
    path.write_text("[plan]\nnodez = 2\n")
    with pytest.raises(ValueError, match=r"\[plan\] takes the keys"):
        hardware_from(str(path))


def test_communication_with_and_without_expert_parallelism() -> None:
    """The 122B preset's bytes per optimizer step with EP off and with the fastest valid EP, by a hand count of the
    FSDP2 collectives (ring: (W - 1) / W of the whole through each rank), and the lower bound at the stated links.
    The preset runs EP 8 with its experts sharded over dp = 3: the planner says it is faster and fits, EP 8 with
    whole experts does not fit."""
    from t1cli.plan import format_comm, step_comm
    preset = str(REPO / "t1core/configs/moe_122b_harbor.toml")
    cfg, hw = load_config(preset, []), hardware_from(preset)
    mcfg = ModelConfig.moe_120b_a8b()
    shapes = policy_shapes(mcfg)
    experts = sum(torch.Size(s).numel() for n, s in shapes.items() if ".experts." in n)
    every = sum(torch.Size(s).numel() for s in shapes.values())
    layers = sum(torch.Size(s).numel() for n, s in shapes.items() if n.startswith("model.layers."))
    ring = 23 / 24
    off = {r.name: r for r in step_comm(cfg, hw, 1)}
    assert off["FSDP all-gather, forward (compute dtype)"].bytes == int(2 * every * ring)  # bf16
    assert off["FSDP all-gather, backward (decoder layers)"].bytes == int(2 * layers * ring)
    assert off["FSDP reduce-scatter of gradients (fp32)"].bytes == int(4 * every * ring)
    on = {r.name: r for r in step_comm(cfg, hw, 8)}
    assert on["FSDP all-gather, forward (compute dtype)"].bytes == int(2 * (every - experts) * ring)
    a2a = next(r for n, r in on.items() if n.startswith("EP all-to-all"))
    # 6 passes (activation checkpointing recomputes the forward), 48 layers, 65536 x 8 rows of 4096 bf16, 7/8 away
    assert a2a.bytes == int(6 * 48 * 65536 * 8 * 4096 * 2 * 7 / 8) and a2a.link == "nvlink"
    # shard_experts: the 32 local experts' dp shards all-gathered twice (forward and recompute, bf16) and their fp32
    # gradients reduce-scattered, 2/3 of each through every rank, instead of the all-reduce of whole experts
    assert on["EP expert shards all-gathered over dp=3 (2 per layer, compute dtype)"].bytes == int(
        2 * (2 / 3) * 2 * experts / 8)
    assert on["EP expert gradients reduce-scattered over dp=3 (fp32)"].bytes == int((2 / 3) * 4 * experts / 8)
    whole = {r.name: r for r in step_comm(cfg, hw, 8, False)}
    assert whole["EP expert gradients all-reduced over dp=3 (fp32)"].bytes == int(2 * (2 / 3) * 4 * experts / 8)
    text = "\n".join(format_comm(cfg, hw))
    assert "EP 8 sharded (this run)" in text and "EP off" in text and "lower bound (the busiest link)" in text
    assert ("expert parallelism: EP 8 is faster than EP off by the lower bound (3.20 s vs 18.46 s per step) and its "
            "memory plan does not fit") in text
    assert ("expert parallelism: EP 8 sharded over dp is faster than EP off by the lower bound (2.41 s vs 18.46 s "
            "per step) and its memory plan fits\n") in text + "\n"
    p = plan(cfg, hw)
    assert p.fits and p.host_bytes_per_node < p.host_limit
    slow_ib = "\n".join(format_comm(cfg, Hardware(nodes=3, gpus_per_node=8, ib_gbs=5.0)))
    assert slow_ib != text  # the link speeds enter the bounds
