"""Long-horizon episodes: compaction in the real agent loop keeps TITO and R3 exact per segment, observation caps,
cut episodes, and the position check.

The episode tests run the tiny model in the real batch-invariant TorchEngine through the real `run_episode`
(tests/long_episode.py); drift is checked against the engine's own completions and the gap against the trainer's
bitwise forward with each segment's routing replayed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.compaction import cap_observation, extractive_summary, fit_summary
from rollout.trajectory import Trajectory, Turn, load_trajectories, save_trajectories
from t1core.segments import cut_metrics, training_segments
from t1model.tokenizer import ChatTokenizer
from tests.long_episode import long_episode, segment_gaps

REPO = Path(__file__).resolve().parents[1]


def _check_episode(turns: int) -> None:
    traj, policy, log = long_episode(max_turns=turns, max_tokens=2048, keep_turns=2, max_reply=16)
    segs = traj.segments()
    assert traj.finish_reason == "max_turns" and traj.metrics["turns"] == turns
    assert len(segs) >= 2 and max(s.num_tokens for s in segs) <= 2048
    assert sum(len(s.turns) for s in segs) == turns
    assert [log.drift(s) for s in segs] == [0] * len(segs)
    assert segment_gaps(policy, traj) == [0.0] * len(segs)
    for seg in segs[1:]:  # each later context starts with the task and the summary of what was folded
        assert "Summary of your earlier steps" in seg.instruction and seg.routing.shape[0] == seg.num_tokens


def test_compacted_episode_is_exact_in_every_segment() -> None:
    _check_episode(40)


@pytest.mark.slow
def test_300_turns_in_a_small_context_through_compaction() -> None:
    """The issue's bar: 300 turns in contexts of 2,048 tokens (300 turns of history hold ~50k), drift 0 and gap
    exactly 0 in every segment."""
    _check_episode(300)


def _same(a: Trajectory, b: Trajectory) -> None:
    """Every field of the dataclass equal (tensors bit for bit, with their dtypes), earlier segments included."""
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "earlier":
            assert len(x) == len(y)
            for s, t in zip(x, y):
                _same(s, t)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def test_saved_compacted_episode_reloads_whole(tmp_path: Path) -> None:
    """A compacted episode from the real agent loop, saved the way the trainer saves a step's episodes, reloads with
    every segment: its tokens, loss mask, log-probs, routing and the rest."""
    traj, _, _ = long_episode(max_turns=16, max_tokens=1024, keep_turns=1, max_reply=16,
                              observation_max_tokens=32)
    assert len(traj.earlier) >= 2 and all(s.routing is not None for s in traj.segments())
    save_trajectories([traj, traj.earlier[0]], tmp_path)
    back = load_trajectories(tmp_path)
    assert len(back) == 2 and len(back[0].earlier) == len(traj.earlier) and back[1].earlier == []
    _same(back[0], traj)
    _same(back[1], traj.earlier[0])
    loaded = back[0].segments()
    assert [s.finish_reason for s in loaded[:-1]] == ["compacted; episode: max_turns"] * len(traj.earlier)


def test_observation_cap_keeps_head_and_tail_in_tokens() -> None:
    tok = ChatTokenizer.builtin()
    output = "\n".join(f"line {i}" for i in range(400))
    assert cap_observation("short", tok, max_tokens=64) is None and cap_observation(output, tok, max_tokens=None) is None
    body = cap_observation(output, tok, max_tokens=64)
    full = tok.encode_plain(f"\n{output}\n")
    marker = tok.encode_plain(f"\n[... {len(full) - 64} tokens of output cut ...]\n")
    assert body == full[:32] + marker + full[-32:]
    assert "tokens of output cut" in tok.decode(tok.encode_tool_response(output, body_ids=body))


def test_extractive_summary_is_deterministic_and_fits_its_budget() -> None:
    tok = ChatTokenizer.builtin()
    turns = [Turn(start=i, end=i + 1, finish_reason="stop", text="", command=f"echo {i}", output=f"{i}\nmore",
                  exit_code=0) for i in range(200)]
    lines = extractive_summary(turns)
    assert lines[3] == "4. $ echo 3 (exit 0): 3" and lines == extractive_summary(turns)
    text = fit_summary(lines, tok, budget=300)
    assert len(tok.encode_plain(text)) <= 300 and text.endswith(lines[-1]) and "earlier steps omitted" in text


def _ep(reason: str, reward: float, segments: int = 1) -> SimpleNamespace:
    def seg(r: str) -> SimpleNamespace:
        return SimpleNamespace(finish_reason=r, loss_mask=torch.tensor([False, True]))
    last = seg(reason)
    last.earlier = [seg(f"compacted; episode: {reason}") for _ in range(segments - 1)]
    last.segments = lambda: [*last.earlier, last]
    return last


def test_segments_share_the_reward_and_cut_episodes_follow_the_option() -> None:
    eps = [_ep("done", 3.0, segments=3), _ep("max_turns", 2.0, segments=2), _ep("wall_clock", 1.0)]
    segs, rewards, groups = training_segments(eps, [3.0, 2.0, 1.0], [0, 0, 1], cut_episodes="terminal")
    assert rewards == [3.0, 3.0, 3.0, 2.0, 2.0, 1.0] and groups == [0, 0, 0, 0, 0, 1] and len(segs) == 6
    _, rewards, _ = training_segments(eps, [3.0, 2.0, 1.0], [0, 0, 1], cut_episodes="bootstrap")
    assert rewards == [3.0, 3.0, 3.0, 0.0, 0.0, 0.0]
    segs, rewards, _ = training_segments(eps, [3.0, 2.0, 1.0], [0, 0, 1], cut_episodes="mask")
    assert rewards == [3.0, 3.0, 3.0] and len(segs) == 3
    m = cut_metrics(eps)
    assert m["rollout/cut_frac_max_turns"] == m["rollout/cut_frac_wall_clock"] == pytest.approx(1 / 3)
    assert m["rollout/cut_frac"] == pytest.approx(2 / 3) and m["rollout/segments_mean"] == 2.0


@pytest.mark.parametrize("args,needle", [
    (["-m", "t1core.train", "--rollout.max_tokens=5000", "--algo.minibatch_tokens=8192",
      "--warmstart.sft_minibatch_tokens=8192"], "rollout.max_tokens=5000: a context would run past the model's 4096"),
    (["-m", "t1cli.plan", "--config", "t1core/configs/qwen3_30b_a3b_harbor.toml", "--rollout.max_tokens=65536",
      "--context.compaction=off"], "past the model's 40960 positions"),
])
def test_position_check_refuses_overlong_contexts(args: list[str], needle: str) -> None:
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def _docker_answers() -> bool:
    try:
        import docker
        docker.from_env().ping()
        return True
    except Exception:  # no client library, no daemon, no permission: the test cannot run here
        return False


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.skipif(not _docker_answers(), reason="no Docker daemon answers")
def test_training_run_with_compaction_is_exact_in_every_segment(tmp_path: Path) -> None:
    """The trainer end to end (real sandboxes and verifiers) with contexts of 640 tokens: every episode is compacted,
    every segment trains, and drift and the log-prob gap stay exactly 0 (bitwise mode) over two steps, the second
    after an update and a weight sync."""
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks
    from t1core import train

    family_tasks(tmp_path / "tasks", split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:1])
    run = tmp_path / "run"
    assert train.main([
        "--out", str(run), f"--tasks.source={tmp_path / 'tasks'}", "--eval.source=[]", "--run.steps=2",
        "--rollout.episodes_per_step=2", "--rollout.group_size=2", "--rollout.concurrency=1",
        # Every episode of the untrained model is cut at max_turns: scored where it stopped ('terminal'), its
        # verifier count moves the actor; bootstrapped, its return is the critic's and may move it nowhere.
        "--algo.cut_episodes=terminal",
        "--rollout.max_turns=8", "--rollout.max_new_tokens_per_turn=16", "--rollout.max_tokens=640",
        "--context.compaction=extractive", "--context.keep_turns=1", "--context.observation_max_tokens=32",
        "--warmstart.pretrain_steps=0", "--warmstart.sft_epochs=0", "--warmstart.critic_steps=0",
        "--algo.minibatch_tokens=1400", "--run.checkpoint_every=0",
        "--algo.actor_push=raw"]) == 0  # raw: the actor moves even when both episodes score alike
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] in (0, 1)]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/compactions"] >= 2 and r["train/segments"] == 2 * r["rollout/segments_mean"] > 2
        assert r["tito/drift_tokens"] == 0.0 and r["mismatch/max_abs"] == 0.0 and r["mismatch/gap"] == 0.0
        assert r["train/actor_updated"] == 1.0 and r["policy/grad_norm"] > 0 and r["value/grad_norm"] > 0
    for step in ("step_0000", "step_0001"):  # the saved episodes reload whole: every segment, with its routing
        for traj in load_trajectories(run / "trajectories" / step):
            segs = traj.segments()
            assert len(segs) >= 2 and all(s.routing is not None and s.routing.shape[0] == s.num_tokens for s in segs)
            assert max(s.num_tokens for s in segs) <= 640
