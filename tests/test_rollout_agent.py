"""Agent episodes against real Docker sandboxes, real tasks, the real tokenizer and real verifiers.

The policy is either the real TorchEngine (tiny untrained model) or `ScriptedEngine`, a test double of the
*policy only*: it implements the Engine protocol and replies with scripted text (e.g. the task's reference
solution) tokenized by the real tokenizer. Everything around it is real.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import docker
import pytest
import torch

from t1kernels.logprob import token_logprobs
from rollout.agent import DONE_MARKER, AgentConfig, EpisodeSpec, is_masked, parse_action, run_episode, run_episodes
from rollout.config import RolloutSection
from rollout.engine import Completion, SamplingParams, generate_via_submit
from rollout.tito import retokenization_drift, sampled_drift
from rollout.torch_engine import EngineConfig, TorchEngine
from sandbox.tasks import suite
from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.images.task_images import TaskImage, build_task_image, default_base_image_overrides
from sandbox.tasks.format import Task, load_task
from sandbox.runtime.settings import SandboxSection, SandboxSettings
from t1core.drift import CompletionLog
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer, format_tool_call

Script = Callable[[Task, int], str]  # (task, turn) -> reply text


class ScriptedEngine:
    """Engine-protocol test double of the policy: reply text from a script, tokenized with the real tokenizer,
    ending with <|im_end|> (finish "stop"); log-prob 0 (a deterministic policy), no routing."""

    def __init__(self, tok: ChatTokenizer, tasks: list[Task], script: Script) -> None:
        self.tok, self.tasks, self.script = tok, tasks, script
        self.policy_version = 0
        self.calls: list[tuple[list[int], Completion]] = []
        self._lock = threading.Lock()

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Completion]:
        text = self.tok.decode(prompt)
        task = next(t for t in self.tasks if t.instruction in text)
        reply = self.script(task, text.count("<|im_start|>assistant") - 1)  # turn index
        ids = self.tok.encode(reply)[:params.max_new_tokens - 1] + [self.tok.im_end_id]
        comp = Completion(token_ids=ids, logprobs=torch.zeros(len(ids)), routing=None, finish_reason="stop")
        with self._lock:
            self.calls.append((list(prompt), comp))
        fut: Future[Completion] = Future()
        fut.set_result(comp)
        return fut

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_via_submit(self, prompts, params)


def solve_then_done(task: Task, turn: int) -> str:
    if turn == 0:
        return f"I will write the answer.\n{format_tool_call(suite.reference_solution(task))}"
    return f"The file is in place. {DONE_MARKER}"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.builtin()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    out = Path(tmp_path_factory.mktemp("tasks"))
    return suite.family_tasks(out, split="train", num_per_family=4, families=["create_file", "append_line"])


@pytest.fixture(scope="module")
def images(tasks: list[Task]) -> dict[str, str]:
    overrides = default_base_image_overrides()
    return {t.name: build_task_image(t, base_image_overrides=overrides) for t in tasks}


def test_parse_action() -> None:
    assert parse_action(format_tool_call("ls -la")).command == "ls -la"
    assert parse_action(f"all good {DONE_MARKER}").finish
    assert parse_action("nothing to see").error.startswith("no_tool_call")
    assert parse_action("<tool_call>\n{oops\n</tool_call>").error.startswith("bad_json")
    # A tool call wins over the marker.
    assert parse_action(f"{format_tool_call('pwd')} {DONE_MARKER}").command == "pwd"


@pytest.mark.docker
def test_reference_solution_reaches_full_reward(tok: ChatTokenizer, tasks: list[Task],
                                                images: dict[str, TaskImage]) -> None:
    task = tasks[0]
    engine = ScriptedEngine(tok, tasks, solve_then_done)
    with DockerSandbox(images[task.name], SandboxSettings.for_run(task)) as sb:
        traj = run_episode(engine, tok, sb, task, config=AgentConfig(rollout=RolloutSection(max_turns=5)), seed=0)
    assert traj.finish_reason == "done" and len(traj.turns) == 2
    assert traj.verifier["total"] >= 3 and traj.reward == traj.verifier["total"] == traj.verifier["passed"]
    first = traj.turns[0]
    assert first.command == suite.reference_solution(task) and first.exit_code == 0
    # TITO: loss region == what the policy produced; glue "\n" after <|im_end|> has mask 0.
    assert sampled_drift(traj, [c.token_ids for _, c in engine.calls]).num_drifted == 0
    nl = tok.assistant_turn_end_ids()[1:]
    assert traj.token_ids[first.end:first.end + len(nl)].tolist() == nl and not traj.loss_mask[first.end]
    assert engine.calls[1][0] == traj.token_ids[:traj.turns[1].start].tolist()
    assert traj.metrics["malformed_tool_calls"] == 0 and traj.metrics["tito_prefix_checks"] == 2
    # Control: finishing without doing anything does not get full reward (the verifiers can fail).
    lazy = ScriptedEngine(tok, tasks, lambda t, n: DONE_MARKER)
    with DockerSandbox(images[task.name], SandboxSettings.for_run(task)) as sb:
        nothing = run_episode(lazy, tok, sb, task, config=AgentConfig(rollout=RolloutSection(max_turns=5)), seed=0)
    assert nothing.finish_reason == "done" and nothing.reward < nothing.verifier["total"]


@pytest.mark.docker
def test_malformed_tool_calls_get_error_observations(tok: ChatTokenizer, tasks: list[Task],
                                                     images: dict[str, TaskImage]) -> None:
    task = tasks[1]
    replies = ["Let me look around first.", "<tool_call>\n{\"name\": \"bash\", \"arguments\": {oops\n</tool_call>",
               format_tool_call(suite.reference_solution(task)), DONE_MARKER]
    engine = ScriptedEngine(tok, tasks, lambda t, n: replies[n])
    with DockerSandbox(images[task.name], SandboxSettings.for_run(task)) as sb:
        traj = run_episode(engine, tok, sb, task, config=AgentConfig(rollout=RolloutSection(max_turns=6)), seed=0)
    assert traj.metrics["malformed_tool_calls"] == 2 and traj.finish_reason == "done"
    assert [t.tool_error is not None for t in traj.turns] == [True, True, False, False]
    assert traj.turns[0].output.startswith("ERROR: no_tool_call") and traj.turns[1].tool_error.startswith("bad_json")
    assert "ERROR: no_tool_call" in tok.decode(engine.calls[1][0])  # the model saw the error
    assert traj.reward == traj.verifier["total"]


@pytest.mark.docker
def test_turn_limit_and_token_budget(tok: ChatTokenizer, tasks: list[Task], images: dict[str, TaskImage]) -> None:
    task = tasks[2]
    engine = ScriptedEngine(tok, tasks, lambda t, n: format_tool_call("echo hello"))
    with DockerSandbox(images[task.name], SandboxSettings.for_run(task)) as sb:
        config = AgentConfig(rollout=RolloutSection(max_turns=3), verify=False)
        traj = run_episode(engine, tok, sb, task, config=config, seed=0)
        assert traj.finish_reason == "max_turns" and len(traj.turns) == 3 and traj.verifier is None
        assert traj.turns[0].output.strip() == "hello"
        budget = traj.turns[1].end + 5  # room for turn 2 only after its observation: no
        config = AgentConfig(rollout=RolloutSection(max_turns=9, max_tokens=budget, max_new_tokens_per_turn=64),
                             verify=False)
        cut = run_episode(engine, tok, sb, task, config=config)
        assert cut.finish_reason == "token_budget" and len(cut.turns) == 2 and cut.num_tokens <= budget


@pytest.mark.docker
def test_eight_concurrent_scripted_episodes(tok: ChatTokenizer, tasks: list[Task], images: dict[str, TaskImage],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ScriptedEngine(tok, tasks, solve_then_done)
    specs = [EpisodeSpec(task=t, image=images[t.name], seed=i) for i, t in enumerate(tasks)]
    assert len(specs) == 8
    created: list[str] = []
    create = docker.APIClient.create_container

    def counting(self, *args, **kwargs):
        out = create(self, *args, **kwargs)
        created.append(out["Id"])
        return out

    monkeypatch.setattr(docker.APIClient, "create_container", counting)
    t0 = time.monotonic()
    trajs = run_episodes(engine, tok, specs, config=AgentConfig(rollout=RolloutSection(max_turns=4)), num_parallel=8)
    wall = time.monotonic() - t0
    # One container life per episode: the pools start no spare (each acquire used to start one, removed unused).
    assert len(created) == len(specs), f"{len(created)} containers for {len(specs)} episodes"
    assert [t.task_name for t in trajs] == [t.name for t in tasks]
    for traj in trajs:
        assert traj.finish_reason == "done" and traj.reward == traj.verifier["total"] >= 3, traj.finish_reason
    # Concurrency: 8 episodes took less than 8 sequential ones would.
    assert wall < sum(t.metrics["wall_s"] for t in trajs)


@pytest.mark.docker
def test_sandbox_limits_reach_the_container(tok: ChatTokenizer, tasks: list[Task], images: dict[str, TaskImage],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`AgentConfig.sandbox` (the trainer's sandbox.* section) sets every episode's container: CPU and memory over
    the task's own, the process limit, and the output cap of what the agent is shown."""
    task = tasks[0]
    flood = "head -c 3000 /dev/zero | tr '\\0' x"
    engine = ScriptedEngine(tok, tasks, lambda t, turn: format_tool_call(flood) if turn == 0 else DONE_MARKER)
    hosts: list[dict] = []
    create = docker.APIClient.create_container

    def capture(self, *args, **kwargs):
        hosts.append(kwargs["host_config"])
        return create(self, *args, **kwargs)

    monkeypatch.setattr(docker.APIClient, "create_container", capture)
    spec = [EpisodeSpec(task=task, image=images[task.name], seed=0)]
    limits = SandboxSection(cpus=0.5, memory_mb=300, pids=64, output_cap_bytes=1024)
    two = RolloutSection(max_turns=2)
    (capped,) = run_episodes(engine, tok, spec, config=AgentConfig(rollout=two, verify=False, sandbox=limits))
    (own,) = run_episodes(engine, tok, spec, config=AgentConfig(rollout=two, verify=False))
    got = [(h["NanoCpus"], h["Memory"], h["PidsLimit"]) for h in hosts]
    assert got == [(500_000_000, 300 << 20, 64), (int(task.cpus * 1e9), task.memory_mb << 20, 256)], got
    assert own.turns[0].output.count("x") == 3000
    assert 0 < capped.turns[0].output.count("x") <= 1024
    with pytest.raises(ValueError, match="sandbox.pids: expected >= 16"):
        SandboxSection(pids=8)


def _find_container_running(needle: str, api: docker.APIClient, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in api.containers(filters={"label": "t1.run_id"}):
            try:
                procs = api.top(c["Id"]).get("Processes") or []
            except docker.errors.APIError:  # removed or stopping meanwhile: not the one
                continue
            if any(needle in " ".join(p) for p in procs):
                return c["Id"]
        time.sleep(0.2)
    raise AssertionError(f"no container runs {needle!r}")


@pytest.mark.docker
def test_sandbox_killed_mid_episode_ends_only_that_episode(tok: ChatTokenizer, tasks: list[Task],
                                                           images: dict[str, TaskImage]) -> None:
    victim, other = tasks[0], tasks[5]
    marker = "sleep 4321"

    def script(task: Task, turn: int) -> str:
        if task is victim:
            return format_tool_call(marker) if turn == 0 else DONE_MARKER
        return solve_then_done(task, turn)

    api = docker.APIClient()
    errors: list[BaseException] = []

    def kill_when_found() -> None:
        try:
            api.kill(_find_container_running(marker, api))
        except BaseException as e:  # surfaced by the assert below, not lost in the thread
            errors.append(e)

    killer = threading.Thread(target=kill_when_found)
    killer.start()
    specs = [EpisodeSpec(task=victim, image=images[victim.name], seed=0),
             EpisodeSpec(task=other, image=images[other.name], seed=1)]
    # Killed through the API from outside: the infrastructure's doing (sandbox.runtime.failure), not the agent's; with
    # no retry the episode stays masked (tests/test_sandbox_hosts.py covers the retries and the agent's own kill).
    trajs = run_episodes(ScriptedEngine(tok, tasks, script), tok, specs,
                         config=AgentConfig(rollout=RolloutSection(max_turns=4, infra_retries=0)), num_parallel=2)
    killer.join()
    assert not errors, errors
    dead, alive = trajs
    assert dead.finish_reason.startswith("infra: ContainerDied"), dead.finish_reason
    assert is_masked(dead) and dead.metrics["infra/failures/local"] == 1 and dead.metrics["infra/retries"] == 0
    assert dead.reward == 0 and dead.verifier is None and len(dead.turns) == 1
    assert alive.finish_reason == "done" and alive.reward == alive.verifier["total"]


@pytest.mark.docker
def test_real_engine_episodes_tito_routing_and_drift(tok: ChatTokenizer, tasks: list[Task],
                                                     images: dict[str, TaskImage]) -> None:
    """4 concurrent episodes of the tiny untrained policy: every token has routing that replays to the engine's
    log-probs, the loss region is exactly what was sampled, and naive re-tokenization would have drifted."""
    model = MoEModel(ModelConfig.tiny(), seed=0)
    cfg = AgentConfig(rollout=RolloutSection(max_turns=3, max_new_tokens_per_turn=24, max_tokens=1024, temperature=1.0),
                      verify=False)
    with TorchEngine(model, EngineConfig(max_batch=8, num_slots=8, max_seq_len=1024)) as real:
        engine = CompletionLog(real)
        specs = [EpisodeSpec(task=t, image=images[t.name], seed=i) for i, t in enumerate(tasks[:4])]
        trajs = run_episodes(engine, tok, specs, config=cfg, num_parallel=4)
    drifted = 0
    for traj in trajs:
        assert traj.finish_reason == "max_turns" and len(traj.turns) == 3
        assert traj.routing is not None and traj.routing.shape == (traj.num_tokens, 4, 2)
        assert traj.metrics["cached_prompt_tokens"] > 0  # turns 2 and 3 reused the KV of turn 1
        with torch.no_grad():
            hidden_TD = model(traj.token_ids, replay_routing=traj.routing)
        logp = token_logprobs(hidden_TD[:-1], model.lm_head.weight, traj.token_ids[1:])
        mask = traj.loss_mask[1:]
        torch.testing.assert_close(logp[mask], traj.rollout_logprobs[1:][mask], rtol=0, atol=5e-5)
        assert engine.drift(traj) == 0
        ids = traj.token_ids.tolist()
        assert sampled_drift(traj, [engine.sampled[tuple(ids[:t.start])][0] for t in traj.turns]).num_drifted == 0
        drifted += retokenization_drift(traj, tok).num_drifted
    assert drifted > 0


@pytest.mark.docker
def test_collect_cli(tasks: list[Task], images: dict[str, TaskImage], tmp_path: Path,
                     capsys: pytest.CaptureFixture) -> None:
    from rollout.collect import main
    from rollout.trajectory import load_trajectories

    out = tmp_path / "run"
    rc = main(["--tasks", str(tasks[0].path.parent), "--episodes", "2", "--rollout.concurrency=2", "--rollout.max_turns=2",
               "--rollout.max_new_tokens_per_turn=16", "--rollout.max_tokens=1024", "--out", str(out)])
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out.resolve())
    trajs = load_trajectories(out)
    assert len(trajs) == 2 and [t.task_name for t in trajs] == [t.name for t in sorted(tasks, key=lambda t: t.name)[:2]]
    for t in trajs:
        assert t.routing is not None and t.verifier is not None and len(t.turns) == 2
    summary = (out / "summary.json").read_text()
    assert "\"episodes\": 2" in summary


@pytest.mark.docker
def test_reference_transcripts_keep_apart_tasks_with_one_instruction(tok: ChatTokenizer, tasks: list[Task],
                                                                      images: dict[str, TaskImage]) -> None:
    # The reference engine recognises an episode by its first prompt. Two tasks told the same words but solved by
    # different scripts must each get their own script, not the one registered last.
    import dataclasses

    from t1core.warmstart import reference_transcripts

    first, second = tasks[0], tasks[1]
    twin = dataclasses.replace(second, instruction=first.instruction)
    assert suite.reference_solution(twin) != suite.reference_solution(first)
    two = AgentConfig(rollout=RolloutSection(max_turns=2))
    transcripts, metrics = reference_transcripts([first, twin], images, tok=tok, config=two,
                                                 num_parallel=2)
    assert metrics["sft/reference_failures"] == 0
    assert [t.task_name for t in transcripts] == [first.name, twin.name]
    for task, traj in zip((first, twin), transcripts):
        assert traj.turns[0].command == suite.demonstration_turns(task)[0][0]


@pytest.mark.docker
def test_incomplete_demonstrations_leave_only_their_step_undone(tok: ChatTokenizer, tasks: list[Task],
                                                                images: dict[str, TaskImage], tmp_path: Path) -> None:
    # About half the SFT demonstrations stop before the finishing step (sandbox.tasks.families.finish). Checked against
    # the real verifiers: such a transcript fails exactly the tests its demonstration names, the full reference
    # (solve.sh) passes them all, and a demonstration that fails anything else is dropped.
    import shutil

    from t1core.warmstart import reference_transcripts

    kinds = {bool(suite.demonstration_turns(t)[1]) for t in tasks}
    assert kinds == {True, False}, "the fixture's instances should hold both kinds of demonstration"
    broken = load_task(shutil.copytree(tasks[0].dockerfile_dir.parent, tmp_path / "broken"))
    demo = broken.solution_script.parent / "demonstration.sh"
    demo.write_text("#!/usr/bin/env bash\n# t1: leaves failing: test_scratch_dir_removed\ntrue\n")
    images = {**images, broken.name: build_task_image(broken, base_image_overrides=default_base_image_overrides())}
    transcripts, metrics = reference_transcripts([*tasks, broken], images, tok=tok, num_parallel=4,
                                                 config=AgentConfig(rollout=RolloutSection(max_turns=2), verify=True))
    assert metrics["sft/reference_failures"] == 1 and [t.task_name for t in transcripts] == [t.name for t in tasks]
    for task, traj in zip(tasks, transcripts):
        turns, fails = suite.demonstration_turns(task)
        assert [t.command for t in traj.turns[:1]] == turns and traj.finish_reason == "done"
        failed = sorted(k.split("::")[-1] for k, ok in traj.verifier["per_test"].items() if not ok)
        assert failed == sorted(fails) and traj.verifier["total"] >= 4
        if fails:
            assert suite.reference_solution(task) == f"{turns[0]}; rm -r /app/tmp"
    full = run_episodes(ScriptedEngine(tok, tasks, solve_then_done), tok,
                        [EpisodeSpec(task=t, image=images[t.name], seed=0) for t in tasks],
                        config=AgentConfig(rollout=RolloutSection(max_turns=2)), num_parallel=4)
    assert all(t.verifier["passed"] == t.verifier["total"] for t in full)


@pytest.mark.docker
def test_two_turn_references_look_first_and_pass_their_verifiers(tok: ChatTokenizer, tmp_path: Path) -> None:
    # csv_column_sum and fix_script leave the answer to a file (which column is which, which bug it is): their
    # SFT transcripts look first, and the second call is what the real output of the look calls for.
    from t1core.warmstart import reference_transcripts

    tasks = suite.family_tasks(tmp_path, split="train", num_per_family=2, families=["csv_column_sum", "fix_script"])
    overrides = default_base_image_overrides()
    images = {t.name: build_task_image(t, base_image_overrides=overrides) for t in tasks}
    transcripts, metrics = reference_transcripts(tasks, images, tok=tok, num_parallel=2,
                                                 config=AgentConfig(rollout=RolloutSection(max_turns=4), verify=True))
    assert metrics["sft/reference_failures"] == 0 and len(transcripts) == 4
    for task, traj in zip(tasks, transcripts):
        (look, act), fails = suite.demonstration_turns(task)
        assert [t.command for t in traj.turns[:2]] == [look, act] and traj.finish_reason == "done"
        assert traj.verifier["passed"] == traj.verifier["total"] - len(fails) >= 3
        out = traj.turns[0].output.strip()
        if task.name.startswith("csv_column_sum"):  # "3:price" -> awk's field $3
            field, column = out.split(":")
            assert f"${field}}}" in act and f"-nx {column}" in look
        else:  # the script as it is, with the line the sed rewrites
            pattern = act.split("'")[1].split("/")[1]  # sed's pattern (no backslashes: Python's re reads it alike)
            assert out.startswith("#!/bin/bash") and re.search(pattern, out) and not re.search(pattern, act.split("/")[2])
