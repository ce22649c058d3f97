"""Standalone GPU check of the model, engine and R3 on CUDA: the pieces that only ran on CPU in the test suite.

Run from the repository root on an H100/H200:  python bench/gpu_check_model.py [--device cuda] [--small]
(`--device cpu --small` runs the same code on the CPU torch path: a smoke test of this script, not a GPU check.)

  1. parity   tiny model, fp32 on the device (Triton MoE + log-prob kernels, cuBLAS, SDPA) against the same
              weights in float64 on the CPU torch path, with the fp64 routing replayed so that both sides use the
              same experts: hidden states, log-probs and every parameter gradient, packed documents.
  2. replay   return_routing then replay_routing of the same input: bitwise-equal hidden states (bf16 and fp32);
              replaying other experts changes the output and the router gradient lands on replayed columns only.
  3. decode   KV-cache prefill + one-token decode steps against the full forward (fp32, full-forward routing
              replayed in decode: tolerance 1e-4; without replay: routing agreement reported).
  4. engine   TorchEngine on the device: continuous batching, sampled tokens with routing; then the trainer's
              fp32 full forward on the same tokens with and without replaying the engine's bf16 routing (R3),
              at a Qwen3-30B-A3B layer shape: the train/rollout log-prob gap with and without R3.
  5. speed    training fwd+bwd (hidden -> token_logprobs -> backward) at the Qwen3-30B-A3B layer shape, 4 layers,
              16k packed tokens, bf16: tokens/s, model TFLOP/s, peak memory; Triton kernels vs the torch path,
              with and without replay.
  6. repeat   bf16 training fwd+bwd twice (flash-attn when installed, deterministic=True under deterministic
              mode): every gradient bitwise equal; and the host syncs of a replayed forward (the routing is
              checked once per batch: at most one more sync than without replay).
  7. nvml     t1core.metrics.gpu_stats() through nvidia-ml-py.
--deterministic runs everything under torch.use_deterministic_algorithms(True), as the trainer does; --dry-run
prints the plan as JSON and exits. Prints one line per check and a summary; exits 1 when a correctness check
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import t1model.cpu_threads  # noqa: E402,F401  (thread settings before torch)
import torch  # noqa: E402

from t1kernels.logprob import token_logprobs  # noqa: E402
from bench import Verdicts  # noqa: E402
from t1model.model import ModelConfig, MoEModel  # noqa: E402

VERDICTS = Verdicts()
record = VERDICTS.record


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[None]:
    old = os.environ.get("T1_KERNEL_BACKEND")
    if name is None:
        os.environ.pop("T1_KERNEL_BACKEND", None)
    else:
        os.environ["T1_KERNEL_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("T1_KERNEL_BACKEND", None)
        else:
            os.environ["T1_KERNEL_BACKEND"] = old


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def packed_ids(doc_lens: list[int], vocab: int, seed: int, device: str) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(doc_lens),), generator=gen)
    cu = [0]
    for n in doc_lens:
        cu.append(cu[-1] + n)
    return ids.to(device), cu


def next_token_targets(ids_T: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Target of position t is token t+1 of the same document; each document's last position is ignored."""
    tgt = torch.full_like(ids_T, -100)
    for a, b in zip(cu, cu[1:]):
        tgt[a:b - 1] = ids_T[a + 1:b]
    return tgt


def loss_and_grads(model: MoEModel, ids: torch.Tensor, cu: list[int], replay: torch.Tensor | None,
                   g_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    hidden = model(ids, cu_seqlens=cu, replay_routing=replay)
    logp, ent = token_logprobs(hidden, model.lm_head.weight, next_token_targets(ids, cu), return_entropy=True)
    ((logp * g_T.to(logp.device)).sum() + 0.1 * ent.sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), logp.detach(), grads


def check_parity(device: str) -> None:
    cfg = ModelConfig.tiny()
    ids, cu = packed_ids([300, 517, 211, 64], cfg.vocab_size, seed=1, device="cpu")
    g_T = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(2))
    ref = MoEModel(cfg, seed=0, dtype=torch.float64)
    with backend("torch"), torch.no_grad():
        _, routing = ref(ids, cu_seqlens=cu, return_routing=True)
    with backend("torch"):
        h_ref, lp_ref, g_ref = loss_and_grads(ref, ids, cu, routing, g_T.double())
    model = MoEModel(cfg, seed=0, dtype=torch.float32, device=device)
    h, lp, g = loss_and_grads(model, ids.to(device), cu, routing.to(device), g_T)
    worst = max(g_ref, key=lambda n: rel(g[n], g_ref[n]))
    errs = dict(hidden=rel(h, h_ref), logp=rel(lp, lp_ref), grad_worst=rel(g[worst], g_ref[worst]))
    ok = errs["hidden"] < 1e-5 and errs["logp"] < 1e-5 and errs["grad_worst"] < 1e-4 and len(g) == len(g_ref)
    record("parity fp32 vs fp64 (norm-rel)", ok, f"hidden {errs['hidden']:.1e}, logp {errs['logp']:.1e}, worst "
           f"grad {errs['grad_worst']:.1e} ({worst}), {len(g)} grads")


def check_replay(device: str) -> None:
    cfg = ModelConfig.tiny()
    ids, cu = packed_ids([400, 123, 377], cfg.vocab_size, seed=3, device=device)
    for dtype in (torch.bfloat16, torch.float32):
        model = MoEModel(cfg, seed=0, dtype=dtype, device=device)
        with torch.no_grad():
            h1, routing = model(ids, cu_seqlens=cu, return_routing=True)
            h2, routing2 = model(ids, cu_seqlens=cu, replay_routing=routing, return_routing=True)
        record(f"replay own routing bitwise ({dtype})", torch.equal(h1, h2) and torch.equal(routing, routing2),
               f"max |diff| {float((h1.float() - h2.float()).abs().max()):.1e}, routing {routing.dtype} "
               f"{list(routing.shape)}")
    # Other experts: the output changes and the router of layer 0 gets gradient only at replayed columns.
    model = MoEModel(cfg, seed=0, dtype=torch.float32, device=device)
    with torch.no_grad():
        h_own_fp32 = model(ids, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(4)
    T, L, K, E = ids.shape[0], len(cfg.moe_layer_ids), cfg.num_experts_per_tok, cfg.num_experts
    other = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T * L)]).view(T, L, K)
    other = other.to(cfg.routing_dtype).to(device)
    h_other = model(ids, cu_seqlens=cu, replay_routing=other)
    h_other.float().pow(2).sum().backward()
    gate_grad_ED = model.model.layers[0].mlp.gate.weight.grad  # row e is hit when any token replays expert e
    used_E = torch.zeros(E, dtype=torch.bool, device=device)
    used_E[other[:, 0].long().flatten()] = True
    # Use a single token to see per-column sparsity: replay one token, check its router-logit gradient.
    one = ids[:1]
    logits_hook: list[torch.Tensor] = []
    gate = model.model.layers[0].mlp.gate

    def keep(_module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> None:  # returns None: output kept
        out.retain_grad()
        logits_hook.append(out)

    handle = gate.register_forward_hook(keep)
    try:
        model.zero_grad(set_to_none=True)
        model(one, replay_routing=other[:1]).pow(2).sum().backward()
    finally:
        handle.remove()
    g_E = logits_hook[0].grad[0]
    chosen = torch.zeros(E, dtype=torch.bool, device=device)
    chosen[other[0, 0].long()] = True
    changed = float((h_other.detach() - h_own_fp32).abs().max())
    ok = changed > 1e-3 and bool((g_E[~chosen] == 0).all()) and bool((g_E[chosen] != 0).all()) \
        and bool((gate_grad_ED[~used_E] == 0).all())
    record("replay other experts", ok, f"output moved by {changed:.2e}; router-logit grad nonzero at "
           f"{int((g_E != 0).sum())} of {E} columns (K={K}, replayed {other[0, 0].tolist()})")


def check_decode(device: str) -> None:
    cfg = ModelConfig.tiny()
    model = MoEModel(cfg, seed=0, dtype=torch.float32, device=device).eval()
    lens, prefill = [96, 150, 64], [40, 77, 64]
    ids, cu = packed_ids(lens, cfg.vocab_size, seed=5, device=device)
    with torch.no_grad():
        h_full, routing = model(ids, cu_seqlens=cu, return_routing=True)
    for replay in (True, False):
        cache = model.new_kv_cache(num_slots=4, max_seq_len=256)
        h_dec = torch.empty_like(h_full)
        agree = total = 0
        # Prefill all documents in one chunked extend, then decode the rest one token per live slot per step.
        chunks = [ids[a:a + p] for a, p in zip(cu, prefill)]
        rows = torch.cat([torch.arange(a, a + p) for a, p in zip(cu, prefill)]).to(device)
        h, r = model.extend(torch.cat(chunks), cache=cache, slot_ids=[0, 1, 2],
                            cu_seqlens=[0, *torch.tensor(prefill).cumsum(0).tolist()],
                            replay_routing=routing[rows] if replay else None)
        h_dec[rows] = h
        agree += int((r == routing[rows]).all(-1).sum())
        total += r.shape[0] * r.shape[1]
        pos = list(prefill)
        while True:
            live = [b for b in range(3) if pos[b] < lens[b]]
            if not live:
                break
            rows = torch.tensor([cu[b] + pos[b] for b in live], device=device)
            h, r = model.extend(ids[rows], cache=cache, slot_ids=live, cu_seqlens=list(range(len(live) + 1)),
                                replay_routing=routing[rows] if replay else None)
            h_dec[rows] = h
            agree += int((r == routing[rows]).all(-1).sum())
            total += r.shape[0] * r.shape[1]
            for b in live:
                pos[b] += 1
        tgt = next_token_targets(ids, cu)
        with torch.no_grad():
            lp_full = token_logprobs(h_full, model.lm_head.weight, tgt)
            lp_dec = token_logprobs(h_dec, model.lm_head.weight, tgt)
        err = float((lp_full - lp_dec).abs().max())
        if replay:
            record("decode vs full forward (fp32, replayed)", err < 1e-4, f"max |dlogp| {err:.1e}")
        else:
            record("decode vs full forward (fp32, own routing)", None,
                   f"max |dlogp| {err:.1e}, routing agreement {agree / total:.5f}")


def _engine_model_cfg(small: bool) -> ModelConfig:
    base = ModelConfig.qwen3_30b_a3b().replace(num_hidden_layers=4, max_position_embeddings=4096)
    if small:  # the CPU smoke run: same code, a shape the torch path does in seconds
        return base.replace(vocab_size=4096, hidden_size=256, moe_intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4)
    return base


def check_engine_gap(device: str, small: bool) -> None:
    from rollout.engine import SamplingParams
    from rollout.torch_engine import EngineConfig, TorchEngine
    cfg = _engine_model_cfg(small)
    trainer = MoEModel(cfg, seed=0, dtype=torch.float32, device=device)
    rollout_model = MoEModel(cfg, seed=0, dtype=torch.bfloat16, device=device).eval().requires_grad_(False)
    num, prompt_len, new = (4, 32, 16) if small else (8, 256, 256)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7, return_routing=True)
    with TorchEngine(rollout_model, EngineConfig(max_batch=num, num_slots=num, max_seq_len=1024)) as engine:
        engine.generate(prompts[:1], params.replace(max_new_tokens=2))  # warm-up (kernel compiles)
        sync(device)
        t0 = time.perf_counter()
        comps = engine.generate(prompts, params)
        sync(device)
        dt = time.perf_counter() - t0
    n_tok = sum(len(c.token_ids) for c in comps)
    record("engine on device (bf16, batch %d)" % num, all(c.routing is not None for c in comps),
           f"{n_tok} tokens in {dt:.2f} s = {n_tok / dt:.0f} tok/s, routing {list(comps[0].routing.shape)}")
    # Trainer side: fp32 full forward over prompt + completion, with and without the engine's routing.
    gaps: dict[str, list[float]] = {"tito": [], "tito_r3": []}
    agree = total = 0
    for p, c in zip(prompts, comps):
        ids = torch.tensor(p + c.token_ids, device=device)
        routing = torch.cat([c.prompt_routing, c.routing]).to(device)
        targets = torch.full_like(ids, -100)
        targets[len(p) - 1:-1] = ids[len(p):]
        with torch.no_grad():
            for name, replay in (("tito", None), ("tito_r3", routing)):
                h, own = trainer(ids, replay_routing=replay, return_routing=True)
                lp = token_logprobs(h, trainer.lm_head.weight, targets)[len(p) - 1:-1]
                gaps[name].append(float((lp.cpu() - c.logprobs).abs().mean()))
                if replay is None:
                    same = (own.sort(-1).values == routing.sort(-1).values).all(-1)[:-1]
                    agree += int(same.sum())
                    total += same.numel()
    g_b, g_c = (sum(v) / len(v) for v in (gaps["tito"], gaps["tito_r3"]))
    record("train/rollout gap, bf16 engine vs fp32 trainer", g_c < g_b,
           f"TITO {g_b:.2e} -> TITO+R3 {g_c:.2e}; trainer's own routing agrees with the engine's on "
           f"{agree / total:.4f} of (token, layer) pairs")


def _time(fn: Callable[[], object], device: str, iters: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def check_speed(device: str, small: bool) -> None:
    cfg = _engine_model_cfg(small)
    doc_len, num_docs = (256, 2) if small else (2048, 8)
    model = MoEModel(cfg, seed=0, dtype=torch.bfloat16, device=device)
    ids, cu = packed_ids([doc_len] * num_docs, cfg.vocab_size, seed=8, device=device)
    T = ids.shape[0]
    tgt = next_token_targets(ids, cu)
    with torch.no_grad():
        _, routing = model(ids, cu_seqlens=cu, return_routing=True)
    D, F, K, L, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_hidden_layers, \
        cfg.vocab_size
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_tok = L * (D * (H + 2 * Hkv) * Dh + H * Dh * D + D * cfg.num_experts + 3 * K * D * F) + V * D
    attn = L * 4 * H * Dh * doc_len * T / 2  # QK^T and PV, causal half
    flops = 6 * per_tok * T + 3 * attn  # fwd + bwd (2x)

    def step(replay: torch.Tensor | None) -> Callable[[], None]:
        def go() -> None:
            model.zero_grad(set_to_none=True)
            hidden = model(ids, cu_seqlens=cu, replay_routing=replay)
            token_logprobs(hidden, model.lm_head.weight, tgt).sum().backward()
        return go

    for name, kind, replay in (("triton", None, None), ("triton + R3 replay", None, routing),
                               ("torch path", "torch", None)):
        if small and kind is None and device == "cpu":
            continue  # no Triton on CPU without the interpreter
        with backend(kind):
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            s = _time(step(replay), device, 3 if small else 5)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
        record(f"train fwd+bwd {name}", None, f"T={T} ({num_docs}x{doc_len}), {L} layers, {s * 1e3:.1f} ms, "
               f"{T / s:,.0f} tok/s, {flops / s / 1e12:.1f} model TFLOP/s, peak {peak:.1f} GiB")


def _count_syncs(fn: Callable[[], object]) -> int:
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing" in str(c.message) for c in caught)


def check_repeat(device: str, small: bool) -> None:
    from t1model.attention import uses_flash_attn
    cfg = _engine_model_cfg(small)
    model = MoEModel(cfg, seed=0, dtype=torch.bfloat16, device=device)
    ids, cu = packed_ids([512, 300, 700] if not small else [64, 40], cfg.vocab_size, seed=9, device=device)
    g_T = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, routing = model(ids, cu_seqlens=cu, return_routing=True)
    runs = [loss_and_grads(model, ids, cu, routing, g_T)[2] for _ in range(2)]
    same = runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    flash = uses_flash_attn(torch.empty(1, dtype=torch.bfloat16, device=device))
    record("repeat bf16 fwd+bwd bitwise", same, f"{len(runs[0])} grads, flash-attn {'on' if flash else 'off'}, "
           f"deterministic mode {torch.are_deterministic_algorithms_enabled()}")
    if not device.startswith("cuda"):
        return
    with torch.no_grad():
        plain = _count_syncs(lambda: model(ids, cu_seqlens=cu))
        replay_dev = _count_syncs(lambda: model(ids, cu_seqlens=cu, replay_routing=routing))
        replay_cpu = _count_syncs(lambda: model(ids, cu_seqlens=cu, replay_routing=routing.cpu()))
    record("host syncs per forward (replay adds <= 1)", replay_dev - plain <= 1 and replay_cpu - plain <= 1,
           f"no replay {plain}, replay (device routing) {replay_dev}, replay (host routing) {replay_cpu}, "
           f"{len(cfg.moe_layer_ids)} MoE layers")


def check_nvml() -> None:
    from t1core.metrics import gpu_stats
    stats = gpu_stats()
    record("gpu_stats via nvidia-ml-py", bool(stats) if torch.cuda.is_available() else None,
           ", ".join(f"{k} {v:.1f}" for k, v in stats.items()) or "(empty)")


CHECKS = ("parity", "replay", "decode", "engine", "speed", "repeat", "nvml")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes (the CPU smoke run)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(CHECKS)}")
    ap.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    args = ap.parse_args()
    only = [c for c in args.only.split(",") if c]
    bad = [c for c in only if c not in CHECKS]
    if bad:
        ap.error(f"--only: expected names from {list(CHECKS)}, got {bad}")
    import json
    print(json.dumps(dict(script="model", device=args.device, small=args.small, deterministic=args.deterministic,
                          checks=[c for c in CHECKS if not only or c in only])), flush=True)
    if args.dry_run:
        return 0
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    checks: dict[str, Callable[[], None]] = {
        "parity": lambda: check_parity(args.device), "replay": lambda: check_replay(args.device),
        "decode": lambda: check_decode(args.device), "engine": lambda: check_engine_gap(args.device, args.small),
        "speed": lambda: check_speed(args.device, args.small), "repeat": lambda: check_repeat(args.device, args.small),
        "nvml": check_nvml}
    for name, fn in checks.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            traceback.print_exc()
            record(name, False, "raised (traceback above)")
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    return VERDICTS.summary()


if __name__ == "__main__":
    sys.exit(main())
