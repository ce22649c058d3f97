"""The long-horizon family (sandbox.tasks.families.chain), teacher forcing in the engine, and SFT transcripts of
compacted episodes: instances checked against an independent walk of their own files, the verifiers and the
demonstrations in a real container, forced replies against the engine's own draws."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from rollout.agent import AgentConfig
from rollout.config import ContextSection, RolloutSection
from rollout.engine import SamplingParams
from rollout.torch_engine import EngineConfig, TorchEngine
from sandbox.runtime.settings import SandboxSettings
from sandbox.tasks.families import FAMILIES, LONG_FAMILIES, generate
from sandbox.tasks.families.chain import END, LINKS, MILESTONES
from sandbox.tasks.suite import demonstration_turns, family_tasks, reference_turns
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer

STEP = re.compile(r"^tee -a done < (q/\w+)$")


def _walk(files: dict[str, str], first: str) -> list[str]:
    """The chain read off the files themselves: paths in order, from `first` to the one that holds `end`."""
    names = [first]
    while (nxt := files[f"/app/{names[-1]}"].strip()) != END:
        names.append(nxt)
    return names


def test_chain_paths_are_the_same_six_tokens_in_the_output_and_in_the_command() -> None:
    """What makes the copy learnable for the tiny model (the module's docstring): every path is six tokens, and the
    output's tokens of it are the command's, so each stands at one fixed distance before its copy."""
    tok = ChatTokenizer.builtin()
    spec = generate("follow_chain", 3, "train")
    paths = [p.removeprefix("/app/") for p in spec.files]
    assert len(paths) >= LINKS[0]
    for path in paths:
        ids = tok.encode(path)
        assert len(ids) == 6, (path, [tok.decode([i]) for i in ids])
        assert tok.encode(f"{path}\n")[:6] == ids  # as the tool response holds it
        assert tok.encode(f"tee -a done < {path}")[-6:] == ids  # as the command holds it


def test_follow_chain_instances_are_seeded_and_each_command_follows_the_last_output() -> None:
    assert "follow_chain" in LONG_FAMILIES and "follow_chain" not in FAMILIES  # never part of "every family"
    stops = 0
    for seed in range(40):
        spec = generate("follow_chain", seed, "train")
        assert spec == generate("follow_chain", seed, "train")
        first = re.search(r"starting at (q/\w+)", spec.instruction).group(1)
        names = _walk(spec.files, first)
        assert LINKS[0] <= len(names) <= LINKS[1] and len(names) == len(spec.files)
        assert [STEP.match(t).group(1) for t in spec.turns] == names
        if spec.demonstration is not None:  # stops early: a prefix, past the first quarter, naming what it fails
            stops += 1
            k = len(spec.demonstration)
            assert len(names) // 4 <= k < len(names) and spec.demonstration == spec.turns[:k]
            need = [-(-len(names) * m // MILESTONES) for m in range(1, MILESTONES + 1)]
            assert spec.demonstration_fails == tuple(f"test_progress_{m}" for m, n in enumerate(need, 1) if k < n)
    assert 10 <= stops <= 30
    assert generate("follow_chain", 0, "heldout").instruction != generate("follow_chain", 0, "train").instruction


def test_forced_reply_has_the_log_probs_and_routing_of_the_same_reply_drawn() -> None:
    """Teacher forcing in the engine: forcing the tokens a draw produced gives that draw's tokens, log-probs and
    routing bit for bit (under another sampling seed, whose own draw differs)."""
    policy = MoEModel(ModelConfig.tiny(), seed=0).eval().requires_grad_(False)
    prompt = list(range(10, 60))
    with TorchEngine(copy.deepcopy(policy), EngineConfig(max_batch=2, num_slots=2, max_seq_len=128,
                                                          batch_invariant=True)) as eng:
        drawn = eng.submit(prompt, SamplingParams(max_new_tokens=12, seed=1)).result()
        other = eng.submit(prompt, SamplingParams(max_new_tokens=12, seed=2)).result()
        forced = eng.submit(prompt, SamplingParams(max_new_tokens=12, seed=2,
                                                   forced_token_ids=tuple(drawn.token_ids))).result()
    assert other.token_ids != drawn.token_ids  # the seed alone would not give the drawn reply
    assert forced.token_ids == drawn.token_ids
    assert torch.equal(forced.logprobs, drawn.logprobs) and torch.equal(forced.routing, drawn.routing)
    with pytest.raises(ValueError, match="forced_token_ids"):
        TorchEngine(policy, EngineConfig(max_seq_len=128)).submit(prompt, SamplingParams(forced_token_ids=(10**6,)))


def _run_turns(task, image, turns: list[str]) -> dict[str, bool]:
    from sandbox.runtime.docker_sandbox import DockerSandbox
    from sandbox.runtime.verify import run_verifiers

    with DockerSandbox(image, SandboxSettings.for_run(task)) as sb:
        for cmd in turns:
            assert sb.run(cmd, timeout=10).exit_code == 0, cmd
        return {k.split("::")[-1]: ok for k, ok in run_verifiers(sb, task).per_test.items()}


@pytest.mark.docker
def test_follow_chain_verifiers_score_reference_demonstration_and_untouched_state(tmp_path: Path) -> None:
    from sandbox.images.task_images import build_task_image, default_base_image_overrides

    tasks = family_tasks(tmp_path, split="train", num_per_family=6, seed=0, families=["follow_chain"])
    task = next(t for t in tasks if demonstration_turns(t)[1])  # one whose demonstration stops early
    image = build_task_image(task, base_image_overrides=default_base_image_overrides())
    full = _run_turns(task, image, reference_turns(task))
    assert len(full) == MILESTONES + 1 and all(full.values())
    demo, fails = demonstration_turns(task)
    assert {n for n, ok in _run_turns(task, image, demo).items() if not ok} == set(fails)
    assert {n for n, ok in _run_turns(task, image, []).items() if ok} == {"test_chain_unchanged"}
    # a repeated line is forgiven, a skipped link ends the count
    names = [STEP.match(t).group(1) for t in reference_turns(task)]
    repeat = reference_turns(task)[:20] + reference_turns(task)[19:30]  # 30 links, twice the 20th
    got = _run_turns(task, image, repeat)
    assert got["test_progress_2"] and not got["test_progress_3"]
    skip = [t for i, t in enumerate(reference_turns(task)) if i != 5]
    assert not any(ok for n, ok in _run_turns(task, image, skip).items() if n.startswith("test_progress")), names[5]


@pytest.mark.docker
def test_sft_transcript_of_a_compacted_demonstration_follows_its_script(tmp_path: Path) -> None:
    """The warm start's scripted engine finds each turn of a compacted episode (its prompt no longer starts with the
    first one): every command of the transcript, over all its segments, is the demonstration's."""
    from sandbox.images.task_images import build_task_images, default_base_image_overrides
    from t1core.warmstart import reference_transcripts

    tok = ChatTokenizer.builtin()
    tasks = family_tasks(tmp_path, split="train", num_per_family=2, seed=0, families=["follow_chain"])
    images = build_task_images(tasks, base_image_overrides=default_base_image_overrides())
    config = AgentConfig(rollout=RolloutSection(max_turns=300, max_tokens=1024, max_new_tokens_per_turn=48,
                                                wall_clock_limit_s=600.0),
                         context=ContextSection(compaction="extractive", keep_turns=2, observation_max_tokens=32))
    good, metrics = reference_transcripts(tasks, images, tok=tok, config=config, num_parallel=2)
    assert metrics["sft/transcripts"] == 2 and metrics["sft/reference_failures"] == 0
    for task, traj in zip(tasks, good):
        segs = traj.segments()
        assert len(segs) >= 3 and traj.finish_reason == "done"
        assert [t.command for s in segs for t in s.turns if t.command] == demonstration_turns(task)[0]
        passed = {k.split("::")[-1] for k, ok in traj.verifier["per_test"].items() if ok}
        assert passed == {k.split("::")[-1] for k in traj.verifier["per_test"]} - set(demonstration_turns(task)[1])


def test_episode_shape_and_its_closing_lines() -> None:
    """The held-out evaluation's figures on long episodes: commands per episode (median, max), contexts (fewest,
    mean), the median time of turns 10/100/300 where reached; and the closing lines before and after RL."""
    from types import SimpleNamespace

    from t1core.evaluation import episode_shape, shape_lines

    def ep(commands: int, contexts: int, **turn_s: float):
        return SimpleNamespace(metrics={"commands": commands, **turn_s}, segments=lambda: [None] * contexts)

    eps = [ep(120, 5, turn10_s=0.3, turn100_s=0.5), ep(30, 2, turn10_s=0.1), ep(101, 4, turn10_s=0.2, turn100_s=0.4)]
    got = episode_shape("eval/builtin/family", eps)
    assert got == {"eval/builtin/family_commands_median": 101.0, "eval/builtin/family_commands_max": 120.0,
                   "eval/builtin/family_segments_min": 2.0, "eval/builtin/family_segments_mean": 11 / 3,
                   "eval/builtin/family_turn10_s": 0.2, "eval/builtin/family_turn100_s": 0.45}
    lines = shape_lines(got, {**got, "eval/builtin/family_commands_median": 110.0})
    assert len(lines) == 2 and "before RL" in lines[0] and "median 110" in lines[1] and "turn 100 0.45 s" in lines[0]
    assert episode_shape("eval/builtin/family", []) == {} and shape_lines({}, {}) == []
