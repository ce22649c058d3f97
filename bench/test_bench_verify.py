"""Verifier throughput: wall time of one verification, and tasks verified per minute with several in parallel.

Sandboxes are prepared first (image built, container started, reference solution run), so the figures are
for `run_verifiers` alone. Correctness gates the numbers: every verification must pass all its verifiers.

    python -m pytest bench/test_bench_verify.py -s
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox.tasks import suite
from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.runtime.settings import SandboxSettings
from sandbox.images.task_images import build_task_image, default_base_image_overrides
from sandbox.run_task import run_script
from sandbox.tasks.format import Task
from sandbox.runtime.verify import VerifierResult, run_verifiers

RUN_ID = "t1-bench-verify"
PARALLEL = (1, 4)


def _prepare(task: Task, overrides: dict[str, str]) -> DockerSandbox:
    sb = DockerSandbox(build_task_image(task, base_image_overrides=overrides),
                       SandboxSettings.for_task(task, network=False), run_id=RUN_ID)
    assert task.solution_script is not None
    run_script(sb, task.solution_script.read_text(), timeout_s=task.agent_timeout_s)
    return sb


def _verify_all(tasks: list[Task], overrides: dict[str, str], workers: int) -> tuple[float, list[VerifierResult]]:
    with ThreadPoolExecutor(4) as pool:
        sandboxes = list(pool.map(lambda t: _prepare(t, overrides), tasks))
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(run_verifiers, sandboxes, tasks))
        elapsed = time.perf_counter() - t0
    finally:
        for sb in sandboxes:
            sb.close()
    return elapsed, results


def test_bench_verify_throughput(benchmark, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = default_base_image_overrides()
    tasks = suite.family_tasks(tmp_path, split="train", num_per_family=1, seed=0)
    tasks += suite.fixed_tasks("heldout")
    rows = []

    def measure() -> None:
        for workers in PARALLEL:
            elapsed, results = _verify_all(tasks, overrides, workers)
            bad = {t.name: (r.passed, r.total, r.error) for t, r in zip(tasks, results) if not r.outcome}
            assert not bad, bad  # correctness first: the figures mean nothing otherwise
            per_task = [r.duration_s for r in results]
            rows.append((workers, len(tasks), elapsed, statistics.median(per_task), max(per_task)))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    with capsys.disabled():
        print(f"\nverifier throughput ({len(tasks)} tasks: one instance per family + the fixed held-out tasks)")
        print(f"{'parallel':>8} {'tasks':>6} {'wall s':>8} {'tasks/min':>10} {'p50 s/task':>11} {'max s/task':>11}")
        for workers, n, elapsed, p50, worst in rows:
            print(f"{workers:>8} {n:>6} {elapsed:>8.1f} {60 * n / elapsed:>10.1f} {p50:>11.2f} {worst:>11.2f}")
