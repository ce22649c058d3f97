"""Long-horizon episodes on the CPU: a 300-turn episode through the real agent loop with compaction on, and the
memory of training one 32k-token episode in bitwise mode.

Run: `python -m pytest bench/test_bench_long_episode.py -q -s` (T1_LONG_TURNS, T1_LONG_TOKENS change the sizes).
Gates on correctness first (every segment: drift 0 against the engine's completions, trainer-vs-rollout gap exactly
0 with the segment's routing replayed), then prints time per turn at turns 10, 100 and 300 (process CPU seconds
and wall seconds: the box is shared), the peak memory and the segments. Never asserts on speed or memory.

The episode: the tiny model in the batch-invariant TorchEngine, contexts of at most 2,048 tokens folded at 1,280
(keep 2 turns), replies of up to 16 tokens, a shell that answers without a container (tests/long_episode.py).
The 32k part: one episode whose prompt is 32k tokens, prefilled (4k tokens at a time) and answered by the engine, then scored and
back-propagated by the trainer's bitwise forward, in a child process whose peak RSS is the figure.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import resource
import time

import torch

from tests.episodes import Episode
from tests.long_episode import long_episode, segment_gaps

TURNS = int(os.environ.get("T1_LONG_TURNS", "300"))
TOKENS = int(os.environ.get("T1_LONG_TOKENS", "32768"))


def _per_turn(stamps: list[tuple[float, float]], turn: int) -> str:
    if not 2 <= turn <= len(stamps):
        return f"turn {turn}: -"
    (w0, c0), (w1, c1) = stamps[turn - 2], stamps[turn - 1]
    return f"turn {turn}: {c1 - c0:.3f} s CPU / {w1 - w0:.3f} s wall"


def test_bench_300_turn_episode_with_compaction() -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    traj, policy, log = long_episode(max_turns=TURNS, max_tokens=2048, at_tokens=1280, keep_turns=2, max_reply=16)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    segs = traj.segments()
    drift = [log.drift(s) for s in segs]
    gaps = segment_gaps(policy, traj)
    assert traj.metrics["turns"] == TURNS and traj.finish_reason == "max_turns"
    assert max(s.num_tokens for s in segs) <= 2048
    assert drift == [0] * len(segs) and gaps == [0.0] * len(segs)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n[long episode] {TURNS} turns in {len(segs)} segments (largest {max(s.num_tokens for s in segs)} tokens, "
          f"{sum(s.num_tokens for s in segs)} in all); drift 0 and gap exactly 0 in every segment; "
          f"{', '.join(_per_turn(log.stamps, t) for t in (10, 100, 300))}; whole episode {cpu:.1f} s CPU / "
          f"{wall:.1f} s wall; peak RSS {peak_mib:.0f} MiB")


def _train_one_long_episode(tokens: int, out: mp.Queue) -> None:
    from rollout.engine import SamplingParams
    from rollout.torch_engine import EngineConfig, TorchEngine
    from t1core.batch import pack
    from t1core.update import policy_logprobs
    from t1model.model import ModelConfig, MoEModel

    torch.set_num_threads(2)
    cfg = ModelConfig.tiny().replace(max_position_embeddings=tokens + 64)  # the tiny shape, more positions
    policy = MoEModel(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    ep = Episode(torch.randint(8, cfg.vocab_size, (tokens - 16,), generator=g).tolist(), 0)
    with TorchEngine(copy.deepcopy(policy).eval().requires_grad_(False),
                     EngineConfig(max_batch=1, num_slots=1, max_seq_len=tokens + 32, batch_invariant=True)) as eng:
        # The prompt enters the KV cache 4,096 tokens at a time (one-token requests, reused as a cached prefix), as
        # a long episode's turns fill it; a 32k prompt in one chunk would hold a 32k x 32k mask in the engine.
        for end in range(4096, len(ep.ids), 4096):
            eng.submit(ep.ids[:end], SamplingParams(max_new_tokens=1, temperature=1.0)).result()
        ep.add_reply(eng.submit(ep.ids, ep.params(16, 1.0)).result())
    traj = ep.trajectory()
    rss_engine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    c0 = time.process_time()
    batch = pack([traj])
    logp_T, _ = policy_logprobs(policy, batch, temperature=1.0, replay=True, bitwise=True)
    logp_T[batch.loss_mask_T].sum().backward()
    d = (logp_T.detach() - batch.rollout_logp_T)[batch.loss_mask_T]
    out.put((traj.num_tokens, float(d.abs().max()), rss_engine,
             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.process_time() - c0))


def test_bench_memory_of_training_one_32k_token_episode() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_train_one_long_episode, args=(TOKENS, q))
    p.start()
    n, gap, rss_engine, rss, cpu = q.get()
    p.join()
    assert gap == 0.0
    print(f"\n[long episode] one {n}-token episode, bitwise forward + backward (tiny model, 2 threads): gap exactly 0; "
          f"peak RSS {rss / 1024:.2f} GiB (after the engine's prefill {rss_engine / 1024:.2f} GiB); "
          f"train {cpu:.0f} s CPU")
