"""The GPU check scripts must not rot between device sessions: their CPU mode runs here.

`bench/gpu_check_model.py --device cpu --small` runs every model-level check (fp64 parity with replayed
routing, bitwise R3 replay, decode vs full forward, the engine's train/rollout gap with and without R3,
a training step) on the CPU torch path. On a GPU the same code checks the Triton kernels (bench/gpu_run.sh).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
