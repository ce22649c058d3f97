"""Long-horizon episodes on the CPU: a 300-turn episode through the real agent loop with compaction on (an echo shell,
and a real container), a 1,000-turn stress episode in a real container, and the memory of training one 32k-token
episode in bitwise mode.

Run: `python -m pytest bench/test_bench_long_episode.py -q -s` (T1_LONG_TURNS, T1_LONG_TOKENS, T1_STRESS_TURNS change
the sizes; T1_BENCH_QUICK=1: 110 turns in the container, a stress episode of 150 turns, the same checks).
Gates on correctness first (every segment: drift 0 against the engine's completions, trainer-vs-rollout gap exactly
0 with the segment's routing replayed), then prints time per turn at turns 10, 100 and 300 (process CPU seconds
and wall seconds: the box is shared), the prompt tokens the engine served from its prefix cache, the peak memory and
the segments. Never asserts on speed or memory; the stress episode asserts that open file descriptors, threads and
the sandbox's processes do not grow between turn 100 and its end.

The echo episode: the tiny model in the batch-invariant TorchEngine, contexts of at most 2,048 tokens folded at 1,280
(keep 2 turns), replies of up to 16 tokens, a shell that answers without a container (tests/long_episode.py).
The container episodes: a follow_chain task (sandbox.tasks.families.chain) of as many links as turns, in its real
container, contexts of 1,024 tokens folded at 819 (keep 2 turns), observations capped at 32 tokens; a scripted policy
writes each command from the last output and the real engine teacher-forces it (log-probs and routing as for a draw), so
every turn runs a real command whose output the next one needs; verified at the end.
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

import pytest

from tests.episodes import Episode
from tests.long_episode import chain_episode, long_episode, segment_gaps

QUICK = os.environ.get("T1_BENCH_QUICK") == "1"
TURNS = int(os.environ.get("T1_LONG_TURNS", "300"))
TOKENS = int(os.environ.get("T1_LONG_TOKENS", "32768"))
CONTAINER_TURNS = 110 if QUICK else TURNS
STRESS_TURNS = int(os.environ.get("T1_STRESS_TURNS", "150" if QUICK else "1000"))


def _per_turn(stamps: list[tuple[float, float]], turn: int) -> str:
    if not 2 <= turn <= len(stamps):
        return f"turn {turn}: -"
    (w0, c0), (w1, c1) = stamps[turn - 2], stamps[turn - 1]
    return f"turn {turn}: {c1 - c0:.3f} s CPU / {w1 - w0:.3f} s wall"


def _window(stamps: list[tuple[float, float]], turn: int, half: int = 5) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of the turns around `turn` (one turn: from the completion before it to its
    own; the process runs this one episode, so its CPU time is the turn's on a shared box)."""
    lo, hi = max(2, turn - half), min(len(stamps), turn + half)
    wall = sorted(stamps[t - 1][0] - stamps[t - 2][0] for t in range(lo, hi + 1))
    cpu = sorted(stamps[t - 1][1] - stamps[t - 2][1] for t in range(lo, hi + 1))
    return wall[len(wall) // 2], cpu[len(cpu) // 2]


def _exact_segments(traj, policy, log) -> list:
    segs = traj.segments()
    assert [log.drift(s) for s in segs] == [0] * len(segs)
    assert segment_gaps(policy, traj) == [0.0] * len(segs)
    return segs


def _chain_report(name: str, traj, log, segs, wall: float) -> str:
    m = traj.metrics
    cached, prefilled = m["cached_prompt_tokens"], m["prefilled_prompt_tokens"]
    turns = [t for t in (10, 100, 300, 1000) if t <= len(log.stamps)]
    per = ", ".join("turn {}: {:.3f} s CPU / {:.3f} s wall".format(t, *_window(log.stamps, t)[::-1]) for t in turns)
    first, last = _window(log.stamps, 10)[1], _window(log.stamps, turns[-1])[1]
    return (f"\n[long episode, container] {name}: {m['turns']:.0f} turns, {m['commands']:.0f} real commands, verifiers "
            f"{traj.verifier['passed']}/{traj.verifier['total']}; {len(segs)} segments (largest "
            f"{max(s.num_tokens for s in segs)} tokens); drift 0 and gap exactly 0 in every segment; per turn "
            f"(median of the 11 around it) {per}; turn {turns[-1]} / turn 10 = {last / first:.2f}x CPU; prompt tokens "
            f"from the prefix cache {cached:.0f} of {cached + prefilled:.0f} ({cached / (cached + prefilled):.1%}); "
            f"whole episode {wall:.0f} s wall; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


@pytest.mark.docker
def test_bench_300_turn_episode_in_a_container() -> None:
    t0 = time.perf_counter()
    traj, policy, log, _ = chain_episode(links=CONTAINER_TURNS - 1)
    wall = time.perf_counter() - t0
    assert traj.finish_reason == "done" and traj.metrics["commands"] == CONTAINER_TURNS - 1
    assert traj.verifier["outcome"], traj.verifier
    segs = _exact_segments(traj, policy, log)
    print(_chain_report(f"{CONTAINER_TURNS}-turn chain", traj, log, segs, wall))


@pytest.mark.docker
def test_bench_1000_turn_stress_episode_in_a_container() -> None:
    """Drift 0 and gap exactly 0 in every segment, and no growth in open fds, threads or sandbox processes between
    turn 100 and the last turn."""
    t0 = time.perf_counter()
    traj, policy, log, probes = chain_episode(links=STRESS_TURNS - 1, probe_turns=(100, STRESS_TURNS))
    wall = time.perf_counter() - t0
    assert traj.finish_reason == "done" and traj.metrics["commands"] == STRESS_TURNS - 1
    assert traj.verifier["outcome"], traj.verifier
    segs = _exact_segments(traj, policy, log)
    at100, end = probes[100], probes[STRESS_TURNS]
    grew = {k: (at100[k], end[k]) for k in at100 if end[k] > at100[k]}
    assert not grew, f"grew between turn 100 and turn {STRESS_TURNS}: {grew}"
    print(_chain_report(f"{STRESS_TURNS}-turn stress", traj, log, segs, wall)
          + f"; at turn 100 / turn {STRESS_TURNS}: " + ", ".join(f"{k} {at100[k]} / {end[k]}" for k in at100))


def test_bench_300_turn_episode_with_compaction() -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    traj, policy, log = long_episode(max_turns=TURNS, max_tokens=2048, keep_turns=2, max_reply=16)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    segs = traj.segments()
    drift = [log.drift(s) for s in segs]
    gaps = segment_gaps(policy, traj)
    assert traj.metrics["turns"] == TURNS and traj.finish_reason == "max_turns"
    assert max(s.num_tokens for s in segs) <= 2048
    assert drift == [0] * len(segs) and gaps == [0.0] * len(segs)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cached, prefilled = traj.metrics["cached_prompt_tokens"], traj.metrics["prefilled_prompt_tokens"]
    print(f"\n[long episode] {TURNS} turns in {len(segs)} segments (largest {max(s.num_tokens for s in segs)} tokens, "
          f"{sum(s.num_tokens for s in segs)} in all); drift 0 and gap exactly 0 in every segment; "
          f"{', '.join(_per_turn(log.stamps, t) for t in (10, 100, 300))}; whole episode {cpu:.1f} s CPU / "
          f"{wall:.1f} s wall; prompt tokens from the prefix cache {cached:.0f} of {cached + prefilled:.0f}; "
          f"peak RSS {peak_mib:.0f} MiB")


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
