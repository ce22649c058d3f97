"""Expert parallelism on 2 gloo CPU ranks: step time and bytes moved with and without EP, beside the planner's bytes.

Run: `python -m pytest bench/test_bench_ep.py -q -s`. A small MoE (E=16 experts of F=256, top-2, D=256, 4 layers),
T tokens per rank with a random replayed routing; one optimizer step = forward + backward + clip + AdamW step of the
policy on every rank. Bytes are counted by wrapping torch.distributed's collectives (what each rank receives: a
gather's output less its own part, a reduce-scatter's input less its own part, an all-to-all's output less what it
sent itself, 2 (n - 1) / n of an all-reduce), then set beside `t1cli.plan_comm.comm_rows` for the same shapes
(uniform routing assumed there). Gates on correctness only: the EP run's losses equal the non-EP run's (fp32
round-off) and the counted FSDP bytes match the planner's to 2%.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from t1model.model import ModelConfig, MoEModel
from tests.machine import free_port, gloo_rank

CFG = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                  num_experts_per_tok=2)
TOKENS = 1024
WORLD = 2
STEPS = 4


class _Counter:
    """Bytes this rank receives per kind of collective, while installed over torch.distributed's functions."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = {}
        self._saved: dict[str, object] = {}

    def _add(self, kind: str, n: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0.0) + n

    def install(self) -> None:
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def wrap(name: str, count):
            orig = getattr(dist, name)
            self._saved[name] = orig
            sig = inspect.signature(orig)

            def fn(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)  # callers pass positions or keywords
                bound.apply_defaults()
                count(**bound.arguments)
                return orig(*args, **kwargs)
            setattr(dist, name, fn)

        def gather(*, group, **kw):
            out, inp = kw.get("output_tensor"), kw.get("input_tensor")
            self._add("fsdp_all_gather", nbytes(out) - nbytes(inp))

        def scatter(*, output, input, **_):
            self._add("fsdp_reduce_scatter", nbytes(input) - nbytes(output))

        def a2a(*, output, input, output_split_sizes, group, **_):
            n = dist.get_world_size(group)
            mine = output_split_sizes[dist.get_rank(group)] if output_split_sizes else output.shape[0] // n
            row = nbytes(output) // max(output.shape[0], 1)
            self._add("ep_all_to_all", nbytes(output) - mine * row)

        def reduce(*, tensor, group, **_):
            n = dist.get_world_size(group)
            self._add("all_reduce", 2 * (n - 1) / n * nbytes(tensor))

        for name, count in (("all_gather_single", gather), ("all_gather_into_tensor", gather),
                            ("reduce_scatter_single", scatter), ("reduce_scatter_tensor", scatter),
                            ("all_to_all_single", a2a), ("all_reduce", reduce)):
            wrap(name, count)

    def remove(self) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        self._saved.clear()


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, CFG.vocab_size, (TOKENS,), generator=g)
    L, K = len(CFG.moe_layer_ids), CFG.num_experts_per_tok
    routing = torch.rand(TOKENS * L, CFG.num_experts, generator=g).argsort(dim=1)[:, :K].view(TOKENS, L, K)
    return ids, routing.to(torch.uint8)


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, WORLD, port, timeout_s=300):
        from t1core.optimizer import make_optimizer
        from t1core.config_toml import load_config
        from t1core.distributed import DataParallel
        from t1core.distributed import shard_
        from t1core.update import _clip_grad_norm
        torch.set_num_threads(1)
        dp = DataParallel(rank=rank, world_size=WORLD)
        ids, routing = _batch(rank)
        results = {}
        for ep in (1, 2):
            model = shard_(MoEModel(CFG, seed=0), dp, expert_parallel=ep)
            opt, _ = make_optimizer(model, lr=1e-3, cfg=load_config(None, ["--optim.warmup_steps=0"]))
            params = list(model.parameters())
            losses, times, counted = [], [], None
            for step in range(STEPS):
                counter = _Counter()
                if step == 1:
                    counter.install()
                dist.barrier()
                t0 = time.perf_counter()
                logits = model.compute_logits(ids, replay_routing=routing)
                loss = F.cross_entropy(logits[:-1], ids[1:])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                _clip_grad_norm(params, 1.0, dp)
                opt.step()
                dist.barrier()
                times.append(time.perf_counter() - t0)
                counter.remove()
                if step == 1:
                    counted = counter.bytes
                losses.append(loss.item())
            results[ep] = {"losses": losses, "step_s": min(times[1:]), "bytes": counted}
        (Path(out_dir) / f"{rank}.json").write_text(json.dumps(results))


@pytest.mark.torchrun
def test_bench_expert_parallel_bytes_and_time(tmp_path: Path) -> None:
    from t1cli.plan import policy_shapes
    from t1cli.plan_comm import comm_rows
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    for r in got:  # correctness: EP trains the same model
        assert r["1"]["losses"] == pytest.approx(r["2"]["losses"], rel=1e-5)
    print(f"\nEP on {WORLD} gloo ranks, {TOKENS} tokens per rank, E={CFG.num_experts}, K={CFG.num_experts_per_tok}, "
          f"D={CFG.hidden_size}, F={CFG.moe_intermediate_size}, {CFG.num_hidden_layers} layers, fp32 "
          f"(rank 0; MB received per optimizer step)")
    print(f"{'':>6} {'step s':>8} {'kind':<24} {'counted MB':>11} {'planned MB':>11}")
    for ep in (1, 2):
        rows = comm_rows(CFG, policy_shapes(CFG), world=WORLD, gpus_per_node=WORLD, ep=ep, tokens=TOKENS,
                         compute=4, mixed=False, checkpointing=False, offload=False)
        planned = {"fsdp_all_gather": sum(r.bytes for r in rows if "all-gather" in r.name),
                   "fsdp_reduce_scatter": sum(r.bytes for r in rows if "reduce-scatter" in r.name),
                   "ep_all_to_all": sum(r.bytes for r in rows if "all-to-all" in r.name),
                   "all_reduce": sum(r.bytes for r in rows if "all-reduced" in r.name)}
        counted = got[0][str(ep)]["bytes"]
        for i, kind in enumerate(planned):
            c = counted.get(kind, 0.0)
            head = f"{'EP ' + str(ep) if ep > 1 else 'EP off':>6} {got[0][str(ep)]['step_s']:>8.3f}" if i == 0 \
                else f"{'':>6} {'':>8}"
            print(f"{head} {kind:<24} {c / 1e6:>11.2f} {planned[kind] / 1e6:>11.2f}")
        print(f"{'':>6} {'':>8} {'total':<24} {sum(counted.values()) / 1e6:>11.2f} "
              f"{sum(planned.values()) / 1e6:>11.2f}")
        for kind in ("fsdp_all_gather", "fsdp_reduce_scatter"):
            assert counted[kind] == pytest.approx(planned[kind], rel=0.02), kind
