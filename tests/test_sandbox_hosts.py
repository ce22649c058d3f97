"""Sandboxes over several Docker hosts, for real: three extra dockerd processes on this box (tests.docker_hosts),
one reached over TCP with TLS. Placement under per-host limits, an image built once and loaded everywhere, the rule
that tells an infrastructure death from the agent's own (sandbox.runtime.failure), a daemon SIGKILLed in the middle of a
collection, and a tiny training run spread over the three hosts."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import docker
import pytest

from rollout.agent import AgentConfig, EpisodeSpec, is_masked, run_episodes
from rollout.config import RolloutSection
from sandbox.runtime import hosts as hosts_mod
from sandbox.tasks import suite
from sandbox.images.base_image import ensure_base_image
from sandbox.errors import SandboxError
from sandbox.runtime.host_spec import HostSpec, ssh_url_with_port
from sandbox.runtime.hosts import DockerHosts
from sandbox.runtime.settings import SandboxSettings
from sandbox.images.image_cache import TaskImage
from sandbox.images.task_images import build_task_image, default_base_image_overrides
from sandbox.tasks.format import load_task
from t1model.tokenizer import ChatTokenizer, format_tool_call
from tests.docker_hosts import SSHD, ExtraDaemons
from tests.machine import docker_answers
from tests.test_rollout_agent import ScriptedEngine, solve_then_done

RUN_ID = "t1-test-hosts"


@pytest.fixture(scope="module")
def daemons():
    if not docker_answers():
        pytest.skip("no Docker daemon answers")
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        pytest.skip("extra Docker daemons need root and dockerd")
    base = ensure_base_image()
    # Daemon 0 is also reached over SSH where an sshd is installed (.ci/run installs openssh-server).
    with ExtraDaemons(3, tls=2, ssh=0 if Path(SSHD).is_file() else None) as fleet:
        fleet.load_image(base)
        yield fleet
        for i in range(3):
            assert _leftovers(fleet, i) == ([], []), f"daemon {i} kept containers or networks of the tests"


def _leftovers(fleet: ExtraDaemons, i: int) -> tuple[list[str], list[str]]:
    ps = fleet.docker(i, "ps", "-aq", "--filter", "label=t1.run_id").split()
    nets = fleet.docker(i, "network", "ls", "-q", "--filter", "label=t1.run_id").split()
    return ps, nets


def _specs(fleet: ExtraDaemons, *options: str) -> list[HostSpec]:
    return [HostSpec.parse(fleet.spec(i, opt)) for i, opt in enumerate(options)]


def test_host_entries_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs tls=DIR"):
        HostSpec.parse("tcp://10.0.0.1:2376")
    with pytest.raises(ValueError, match="lacks ca.pem, cert.pem, key.pem"):
        HostSpec.parse(f"tcp://10.0.0.1:2376 tls={tmp_path}")
    with pytest.raises(ValueError, match="unknown option 'maxx=3'"):
        HostSpec.parse("unix:///var/run/docker.sock maxx=3")
    with pytest.raises(ValueError, match="max must be a whole number >= 1"):
        HostSpec.parse("unix:///var/run/docker.sock max=0")
    with pytest.raises(ValueError, match="unix://, tcp:// or ssh://"):
        HostSpec.parse("http://box:2375")
    spec = HostSpec.parse("ssh://me@box max=4 memory_mb=2048 name=box")
    assert (spec.max_sandboxes, spec.memory_mb, spec.name) == (4, 2048, "box")
    # The SDK would put port 22 in and override the user's ssh_config: the port ssh resolves is made explicit.
    config = tmp_path / "ssh_config"
    config.write_text("Host box\n  HostName 10.9.8.7\n  Port 2222\n")
    ssh = tmp_path / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {config} "$@"\n')
    ssh.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{ssh.parent}:{os.environ['PATH']}")
        assert ssh_url_with_port("ssh://me@box") == "ssh://me@box:2222"
        assert ssh_url_with_port("ssh://me@other") == "ssh://me@other:22"
        assert ssh_url_with_port("ssh://me@box:2200") == "ssh://me@box:2200"  # the user's own port wins


@pytest.mark.docker
def test_placement_respects_per_host_limits_over_unix_and_tls(daemons: ExtraDaemons, monkeypatch) -> None:
    """Limits 2 sandboxes, 3 sandboxes, 1024 MiB (two of 512 MiB): seven sandboxes fill them exactly, each answers
    a command (the third host over TCP+TLS), and an eighth finds no room."""
    monkeypatch.setattr(hosts_mod, "FULL_WAIT_S", 1.0)
    provider = DockerHosts(_specs(daemons, "max=2", "max=3", "memory_mb=1024"))
    settings = SandboxSettings(memory="512m")
    boxes = []
    try:
        for _ in range(7):
            boxes.append(provider.start(ensure_base_image(), settings, run_id=RUN_ID))
        assert provider.load() == {"host0": 2, "host1": 3, "host2": 2}
        for sb in boxes:
            assert sb.run(f"echo {sb.host_name}").output == f"{sb.host_name}\n"
            assert sb.shell_stream_open()  # the TLS host's socket cannot peek: read and kept instead
        assert [len(daemons.docker(i, "ps", "-q", "--filter", f"label=t1.run_id={RUN_ID}").split())
                for i in range(3)] == [2, 3, 2]
        with pytest.raises(SandboxError, match="no host had room"):
            provider.start(ensure_base_image(), settings, run_id=RUN_ID)
    finally:
        for sb in boxes:
            sb.close()
        provider.close()
    assert provider.load() == {"host0": 0, "host1": 0, "host2": 0}


def _fresh_image(task_dir: Path, marker: str) -> TaskImage:
    """A task image built on the main daemon now, that no host has yet: /built holds `marker`-<time>."""
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "instruction.md").write_text("Nothing to do.\n")
    (task_dir / "task.toml").write_text('version = "1.0"\n')
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (task_dir / "environment" / "Dockerfile").write_text(
        f"FROM debian:bookworm\nRUN echo {marker}-{time.time_ns()} > /built\n")
    return build_task_image(load_task(task_dir), base_image_overrides=default_base_image_overrides())


@pytest.mark.docker
def test_image_built_once_and_loaded_on_every_host(daemons: ExtraDaemons, tmp_path: Path) -> None:
    image = _fresh_image(tmp_path / "built", "built")
    main_id = docker.APIClient().inspect_image(image.ref)["Id"]
    provider = DockerHosts(_specs(daemons, "", "", ""))
    try:
        t0 = time.monotonic()
        provider.distribute([image.ref])
        first = time.monotonic() - t0
        t0 = time.monotonic()
        provider.distribute([image.ref])  # known on every host by its id: nothing moves
        again = time.monotonic() - t0
        ids = [daemons.docker(i, "image", "inspect", "-f", "{{.Id}}", image.ref).strip() for i in range(3)]
        assert ids == [main_id] * 3, "the image was rebuilt somewhere instead of loaded (its id differs)"
        with provider.start(image, run_id=RUN_ID) as sb:
            assert sb.run("cat /built").output.startswith("built-")
        print(f"\nload into 3 hosts: {first:.1f} s; again: {again * 1e3:.0f} ms")
        assert again < first
    finally:
        provider.close()
        for i in range(3):
            daemons.docker(i, "rmi", image.ref)


@pytest.mark.docker
def test_a_host_over_ssh_gets_the_image_and_runs_sandboxes(daemons: ExtraDaemons, tmp_path: Path, monkeypatch) -> None:
    """ssh://: the Docker SDK's SSH client (the `ssh` binary running `docker system dial-stdio` on the far end) into a
    real sshd whose sessions reach daemon 0. A task image built on the main daemon is streamed there over SSH, a
    sandbox from it answers commands, placement counts it, and closing it leaves nothing on that daemon."""
    if daemons.ssh_index is None:
        pytest.skip("no sshd here (apt-get install openssh-server)")
    monkeypatch.setenv("PATH", f"{daemons.ssh_bin}:{os.environ['PATH']}")
    image = _fresh_image(tmp_path / "over-ssh", "ssh")
    provider = DockerHosts([HostSpec.parse(daemons.ssh_spec("max=2 name=viassh"))])
    try:
        provider.distribute([image.ref])
        main_id = docker.APIClient().inspect_image(image.ref)["Id"]
        assert daemons.docker(0, "image", "inspect", "-f", "{{.Id}}", image.ref).strip() == main_id
        with provider.start(image, run_id=RUN_ID) as sb:
            assert sb.host_name == "viassh" and provider.load() == {"viassh": 1}
            assert sb.run("cat /built").output.startswith("ssh-")
            assert sb.run("echo $((1+2+3))").output == "6\n"
            assert daemons.docker(0, "ps", "-q", "--filter", f"label=t1.run_id={RUN_ID}").split() == [sb.id[:12]]
        assert provider.load() == {"viassh": 0}
        assert _leftovers(daemons, 0) == ([], [])
    finally:
        provider.close()
        daemons.docker(0, "rmi", image.ref)


@pytest.mark.docker
def test_agent_kill_is_the_agents_doing_an_outside_kill_or_removal_is_infra(daemons: ExtraDaemons) -> None:
    provider = DockerHosts(_specs(daemons, "", "", ""))
    try:
        own = provider.start(ensure_base_image(), run_id=RUN_ID)
        with pytest.raises(SandboxError) as e:
            own.run("kill -9 -1; sleep 5", timeout=30)
            own.run("true")  # the container may still be stopping when the first command comes back
        assert own.failure_origin(e.value) == "agent", e.value
        own.close()
        for how in ("kill", "rm"):
            sb = provider.start(ensure_base_image(), run_id=RUN_ID)
            index = int(sb.host_name.removeprefix("host"))
            daemons.docker(index, *(["kill", sb.id] if how == "kill" else ["rm", "-f", sb.id]))
            with pytest.raises(SandboxError) as e:
                sb.run("true")
                sb.run("true")
            assert sb.failure_origin(e.value) == "infra", (how, e.value)
            sb.close()
    finally:
        provider.close()


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.builtin()


@pytest.mark.docker
@pytest.mark.slow
def test_daemon_sigkilled_mid_collection(daemons: ExtraDaemons, tok: ChatTokenizer, tmp_path: Path,
                                         monkeypatch) -> None:
    """12 episodes over three hosts; host0's dockerd is SIGKILLed while episodes sleep in their sandboxes. Every
    episode either finishes elsewhere (retried, same task and seed) or is masked; none is an infra 0 trained; the
    host rejoins once restarted and nothing of the run is left on any daemon."""
    tasks = suite.family_tasks(tmp_path, split="train", num_per_family=3, families=["create_file"])
    images = {t.name: build_task_image(t, base_image_overrides=default_base_image_overrides()) for t in tasks}
    provider = DockerHosts(_specs(daemons, "max=4", "max=4", "max=4"))
    started, lock, first_turns = threading.Event(), threading.Lock(), []

    def script(task, turn: int) -> str:
        if turn == 0:
            with lock:
                first_turns.append(task)
                if len(first_turns) == 12:  # every episode is about to sleep in its sandbox
                    started.set()
            return format_tool_call("sleep 4; echo slept")
        return solve_then_done(task, turn - 1)

    def killer() -> None:
        started.wait(300)
        time.sleep(1.0)
        assert provider.load()["host0"] >= 1
        daemons.kill(0)

    thread = threading.Thread(target=killer)
    thread.start()
    specs = [EpisodeSpec(task=tasks[i % 3], image=images[tasks[i % 3].name], seed=i) for i in range(12)]
    try:
        trajs = run_episodes(ScriptedEngine(tok, tasks, script), tok, specs, provider=provider, num_parallel=12,
                             config=AgentConfig(rollout=RolloutSection(max_turns=4, infra_retries=2)))
        thread.join()
        failures = sum(t.metrics.get("infra/failures/host0", 0) for t in trajs)
        assert failures >= 1, [t.finish_reason for t in trajs]
        for t in trajs:
            assert is_masked(t) or t.finish_reason == "done", t.finish_reason
            assert is_masked(t) or t.reward == t.verifier["total"] > 0
        assert any(t.metrics["infra/retries"] > 0 and not is_masked(t) for t in trajs)
        assert not provider.health()["host0"]
        daemons.restart(0)
        deadline = time.monotonic() + 60
        while not provider.health()["host0"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert provider.health()["host0"], "host0 did not rejoin after its restart"
        assert all(not h.lost for h in provider.hosts), "containers lost on host0 were not removed at rejoin"
        with provider.start(ensure_base_image(), run_id=RUN_ID, avoid=["host1", "host2"]) as sb:
            assert sb.host_name == "host0" and sb.run("echo back").output == "back\n"
    finally:
        if thread.is_alive():
            thread.join()
        provider.close()
    for i in range(3):
        assert _leftovers(daemons, i) == ([], []), f"daemon {i} kept something of the run"
    subprocess.run(["ip", "link", "show", "docker0"], check=True, capture_output=True)


@pytest.mark.docker
@pytest.mark.slow
def test_tiny_training_run_over_three_hosts(daemons: ExtraDaemons, tmp_path: Path) -> None:
    """One RL step of the tiny model with sandbox.hosts set to the three daemons: its episodes run on all of them,
    nothing is masked, and nothing of the run stays on any daemon."""
    import json

    from t1core import train
    from tests.test_train import TINY

    family_dir = tmp_path / "tasks"
    suite.family_tasks(family_dir, split="train", num_per_family=1, seed=0, families=["create_file", "append_line"])
    hosts = json.dumps([daemons.spec(i) for i in range(3)])
    out = tmp_path / "run"
    args = ["--out", str(out), f"--tasks.source={family_dir}", *TINY, "--rollout.episodes_per_step=6",
            "--rollout.group_size=2", "--rollout.concurrency=6", "--run.steps=1", "--run.checkpoint_every=0",
            f"--sandbox.hosts={hosts}"]
    try:
        assert train.main(args) == 0
    finally:
        hosts_mod.use_hosts(())  # the process's provider again the local daemon (the run made it these three)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 0)
    assert step["rollout/infra_masked"] == 0 and step["rollout/infra_failures"] == 0
    assert sorted(k for k in step if k.startswith("rollout/episodes/")) == \
        ["rollout/episodes/host0", "rollout/episodes/host1", "rollout/episodes/host2"], step
    assert sum(step[f"rollout/episodes/host{i}"] for i in range(3)) == 6
    for i in range(3):
        assert _leftovers(daemons, i) == ([], []), f"daemon {i} kept something of the run"


def _episode(reason: str, reward: float, **metrics: float):
    import torch

    from rollout.trajectory import Trajectory, Turn

    ids = torch.arange(8)
    mask = torch.tensor([False] * 4 + [True] * 4)
    return Trajectory(token_ids=ids, loss_mask=mask, rollout_logprobs=torch.zeros(8), routing=None, prompt_len=4,
                      turns=[Turn(start=4, end=8, finish_reason="stop", text="x")], task_name="t", finish_reason=reason, policy_version=0, reward=reward,
                      metrics=dict(metrics))


def test_masked_episodes_reach_neither_the_update_nor_the_reward_means(tmp_path: Path) -> None:
    """Two groups of two: one episode of group 0 is masked (infra on every try). The update gets the other three,
    the masked one's 0 is in no mean, and the infra counters are per host."""
    from types import SimpleNamespace

    from t1core.config import RunConfig
    from t1core.distributed import DataParallel
    from t1core.advantages import shaped_reward
    from t1core.train import Trainer

    cfg = RunConfig()
    trajs = [_episode("done", 2.0, **{"host/host1": 1.0}),
             _episode("infra: DaemonUnreachable: gone", 0.0, **{"infra/retries": 2.0, "infra/failures/host0": 2.0,
                                                                 "infra/failures/host2": 1.0, "host/host2": 1.0}),
             _episode("done", 1.0, **{"infra/retries": 1.0, "infra/failures/host0": 1.0, "host/host1": 1.0}),
             _episode("sandbox_error: ContainerDied: exit 137", 0.0, **{"host/host2": 1.0})]
    trainer = SimpleNamespace(dp=DataParallel.single(), run_dir=tmp_path, cfg=cfg,
                              rewards=lambda ts: [shaped_reward(t, cfg.algo) for t in ts])
    batch = Trainer.step_batch(trainer, 0, trajs, [0] * 4, [0, 0, 1, 1])
    assert [t.finish_reason for t in batch.trajs] == ["done", "done", "sandbox_error: ContainerDied: exit 137"]
    assert batch.group_ids == [0, 1, 1] and batch.rewards == [2.0 + 0, 1.0, 0.0]
    m = batch.metrics
    assert m["reward/dense_mean"] == 0.0 and m["reward/shaped_mean"] == 1.0  # over the three unmasked: (2+1+0)/3
    assert m["rollout/infra_masked"] == 1 and m["rollout/infra_retries"] == 3 and m["rollout/sandbox_errors"] == 1
    assert (m["rollout/infra_failures/host0"], m["rollout/infra_failures/host2"], m["rollout/infra_failures"]) == \
        (3.0, 1.0, 4.0)
    assert (m["rollout/episodes/host1"], m["rollout/episodes/host2"]) == (2.0, 2.0)


@pytest.mark.docker
@pytest.mark.slow
def test_sigterm_of_a_training_run_leaves_nothing_on_any_host(daemons: ExtraDaemons, tmp_path: Path) -> None:
    """A training run over the three daemons, SIGTERMed while its sandboxes are open: it exits 143 and no container
    or network of it stays on any daemon."""
    import json
    import os
    import signal
    import sys

    from tests.test_train import TINY

    family_dir = tmp_path / "tasks"
    suite.family_tasks(family_dir, split="train", num_per_family=1, seed=0, families=["create_file", "append_line"])
    args = [sys.executable, "-m", "t1core.train", "--out", str(tmp_path / "run"), f"--tasks.source={family_dir}",
            *TINY, "--rollout.episodes_per_step=6", "--rollout.concurrency=6", "--run.steps=20",
            "--run.checkpoint_every=0", f"--sandbox.hosts={json.dumps([daemons.spec(i) for i in range(3)])}"]
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen(args, cwd=repo, env={**os.environ, "PYTHONPATH": repo}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(_leftovers(daemons, i)[0] for i in range(3)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for i in range(3):
        assert _leftovers(daemons, i) == ([], []), f"daemon {i} kept something of the SIGTERMed run"
