"""Run `python -m t1kernels.aot_report` (ptxas for sm_90a, on any machine) from a test and read its JSON rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def aot_rows(only: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    """(one row per compiled kernel variant, the process) for `--only ONLY`; skips when ptxas cannot run here."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "T1_KERNEL_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    probe = subprocess.run([sys.executable, "-c", "from t1kernels.aot_report import ptxas_can_run; "
                            "print(ptxas_can_run(90) or '')"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0 or probe.stdout.strip():
        pytest.skip(f"ptxas cannot run here: {probe.stdout.strip() or probe.stderr[-500:]}")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "t1kernels.aot_report", "--only", only, "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc
