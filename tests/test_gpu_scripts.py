"""The GPU check scripts must not rot between device sessions: their CPU mode runs here.

`bench/gpu_check_model.py --device cpu --small` runs every model-level check (fp64 parity with replayed
routing, bitwise R3 replay, decode vs full forward, the engine's train/rollout gap with and without R3,
a training step) on the CPU torch path. On a GPU the same code checks the Triton kernels (bench/gpu_run.sh).
The device check itself runs here in its dry-run mode (argument parsing, part limits, shape plans) and on its
failure path (no GPU: the part fails, the script exits 1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_model_runs_on_cpu() -> None:
    proc = subprocess.run([sys.executable, "bench/gpu_check_model.py", "--device", "cpu", "--small"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "ALL CHECKS PASSED" in out
    for check in ("parity fp32 vs fp64", "replay own routing bitwise", "replay other experts",
                  "decode vs full forward (fp32, replayed)", "train/rollout gap", "train fwd+bwd torch path"):
        assert check in out, f"{check!r} missing from:\n{out[-3000:]}"


# ---- the device check (bench/gpu_run.sh): its plan, limits and failure path, without a GPU ---------------------

def _gpu_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    return subprocess.run(["bash", "bench/gpu_run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_gpu_run_dry_run_plans_production_shapes_within_the_lease(tmp_path: Path) -> None:
    proc = _gpu_run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    limits = {m.group(1): int(m.group(2)) for m in (re.match(r"PART (\w+) limit_s=(\d+)", x) for x in lines) if m}
    assert set(limits) == {"env", "moe", "logprob", "model", "pytest", "vllm", "train"}
    # one device command (10 minutes at most): with the machine's start it fits the 15-minute lease
    assert sum(limits.values()) < 10 * 60, limits
    plans = {p["script"]: p for p in (json.loads(x) for x in lines if x.startswith("{"))}
    rows = {(r["shape"], r["routing"]): (r["T"], r["D"], r["F"], r["E"], r["K"]) for r in plans["moe"]["bench"]}
    assert rows == {("30b", "uniform"): (8192, 2048, 768, 128, 8), ("30b", "skewed"): (8192, 2048, 768, 128, 8),
                    ("122b", "uniform"): (16384, 4096, 1536, 256, 8), ("122b", "skewed"): (16384, 4096, 1536, 256, 8)}
    assert plans["logprob"]["throughput"] == {"N": 65536, "D": 2048, "V": 151936, "dtype": "torch.bfloat16",
                                              "entropy": True}
    assert plans["model"]["deterministic"] and plans["model"]["device"] == "cuda"
    assert {"parity", "replay", "speed", "repeat"} <= set(plans["model"]["checks"])
    assert plans["vllm"]["checks"] == ["tito", "logprobs", "routing", "prefix", "update", "trainer_world"]
    assert plans["train"]["steps"] == 2 and plans["train"]["device"] == "cuda" and plans["train"]["engine"] == "torch"
    assert "--run.device=cuda" in plans["train"]["argv"] and "--run.steps=2" in plans["train"]["argv"]
    assert plans["train"]["replay"] == "bench/fixtures/train_replay"  # the route on a device without Docker
    assert (tmp_path / "out" / "plan.log").read_text().count("PART ") == 7
    assert "set -u -o pipefail" in (ROOT / "bench" / "gpu_run.sh").read_text()


def test_gpu_run_rejects_bad_arguments(tmp_path: Path) -> None:
    for args in (("--only", "moe,nope"), ("--frobnicate",)):
        proc = _gpu_run(tmp_path, *args)
        assert proc.returncode == 2 and "gpu_run.sh:" in proc.stderr, (args, proc.stderr)
    proc = subprocess.run([sys.executable, "bench/gpu_check_moe.py", "--dry-run", "--shapes", "30b,7b"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--shapes" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path where no GPU is")
def test_gpu_run_fails_a_part_that_fails(tmp_path: Path) -> None:
    proc = _gpu_run(tmp_path, "--only", "moe")
    assert proc.returncode == 1, proc.stdout[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["moe"]["rc"] != 0 and "moe" in summary["failed"]
    assert "needs a CUDA GPU" in (tmp_path / "out" / "moe.log").read_text()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the path where vLLM is missing")
def test_gpu_run_skips_the_vllm_part_without_vllm(tmp_path: Path) -> None:
    """Without vLLM the vllm part says so and is reported as skipped: the device check still passes."""
    proc = _gpu_run(tmp_path, "--only", "vllm")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["vllm"]["rc"] == 77 and summary["skipped"] == "vllm" and summary["failed"] == ""
    assert "SKIPPED: vLLM is not installed here" in (tmp_path / "out" / "vllm.log").read_text()
    assert "SKIPPED PARTS: vllm" in proc.stdout


def _train_check() -> object:
    spec = importlib.util.spec_from_file_location("gpu_check_train", ROOT / "bench" / "gpu_check_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.docker  # only to record where the fixture's CPU kernels are not this box's
def test_train_check_replays_its_recording_exactly_without_docker(tmp_path: Path) -> None:
    """The train part's route on a device without Docker: the recorded episodes, replayed on the CPU with no daemon
    reachable, give the recorded run's final weights bit for bit (so the replay is the run, not an imitation of
    it) and pass the check's own criteria. A stale recording fails here: `python bench/gpu_check_train.py
    --record` refreshes it."""
    check = _train_check()
    recording, env = check.RECORDING, dict(os.environ, DOCKER_HOST="unix:///nonexistent/docker.sock")
    replay = [sys.executable, "bench/train_replay.py", "replay"]
    if json.loads((recording / "recording.json").read_text()).get("cpu_capability") != \
            torch.backends.cpu.get_cpu_capability():
        # Recorded on a CPU of another instruction set: its replay here is refused by name, and this box records
        # its own (the same run, with Docker) to replay.
        proc = subprocess.run([*replay, str(recording), "--", "--out", str(tmp_path / "refused"), "--run.device=cpu",
                               *check.RUN_ARGV], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0 and "a CPU replay would not be the recorded run" in proc.stderr, \
            proc.stderr[-2000:]
        recording = tmp_path / "recording"
        proc = subprocess.run([sys.executable, "bench/train_replay.py", "record", str(recording), "--", "--out",
                               str(tmp_path / "recorded"), "--run.device=cpu", *check.RUN_ARGV], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    index = json.loads((recording / "recording.json").read_text())
    run = tmp_path / "run"
    proc = subprocess.run([*replay, str(recording), "--", "--out", str(run), "--run.device=cpu", *check.RUN_ARGV],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"final sha256 {index['final_sha256']}" in proc.stdout, "stale recording: rerun gpu_check_train.py --record"
    problems, lines = check.check_run(run)
    assert problems == [] and len(lines) == check.STEPS, (problems, lines)
    # Another seed draws other task instances: refused, naming the recording, instead of training on them.
    proc = subprocess.run([*replay, str(recording), "--", "--out", str(tmp_path / "other"), "--run.device=cpu",
                           *check.RUN_ARGV, "--run.seed=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and "recorded for tasks" in proc.stderr, proc.stderr[-2000:]


# ---- precision of a CUDA run --------------------------------------------------------------------------------

def test_fp32_on_cuda_is_announced_and_gpu_presets_are_bf16() -> None:
    from t1core.config_toml import load_config
    from t1core.cli import precision_notice
    assert "float32 on CUDA" in precision_notice(load_config(None, ["--run.device=cuda", "--model.dtype=float32"]))
    assert precision_notice(load_config(None, ["--run.device=cuda:1", "--model.dtype=bfloat16"])) is None
    assert precision_notice(load_config(None, [])) is None  # the CPU default run prints nothing new
    presets = sorted((ROOT / "t1core" / "configs").glob("*.toml"))
    assert presets
    for path in presets:
        cfg = load_config(str(path), [])
        if cfg.run.device.startswith("cuda"):
            assert cfg.model.dtype == "bfloat16", path
