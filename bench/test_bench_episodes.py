"""What an episode costs the box: container lives, daemon calls, wall and whole-box CPU, for the SFT reference
transcripts of built-in family instances (the real agent loop and sandboxes; the replies are scripted, so no
model runs and the figures are Docker's alone).

    python -m pytest bench/test_bench_episodes.py -s

Correctness gates the numbers: every transcript must run to the done marker, within the trainer's default
turn budget (some references look first, then act: more than one turn).
"""

from __future__ import annotations

import collections
import os
import re
import time
from pathlib import Path

import docker
import pytest

from bench import box_cpu_s
from rollout.agent import AgentConfig
from sandbox.daemon import docker_client
from sandbox.errors import DaemonUnreachable
from sandbox.images.task_images import build_task_images, default_base_image_overrides
from sandbox.images.base_image import ensure_base_image
from sandbox.tasks.suite import train_tasks
from t1core.config import RolloutSection
from t1model.tokenizer import ChatTokenizer
from t1core.warmstart import reference_transcripts

NUM_PER_FAMILY, PARALLEL = 4, 8


def test_reference_transcripts_cost_per_episode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        docker_client()
    except DaemonUnreachable as e:
        pytest.skip(f"no Docker daemon answers: {e}")
    ensure_base_image()
    tasks = train_tasks(tmp_path / "tasks", num_per_family=NUM_PER_FAMILY, seed=0)
    images = build_task_images(tasks, base_image_overrides=default_base_image_overrides())
    calls: collections.Counter[str] = collections.Counter()
    for method in ("_post", "_get", "_put", "_delete"):
        original = getattr(docker.APIClient, method)

        def counting(self, url, *args, _original=original, _verb=method[1:].upper(), **kwargs):
            path = re.sub(r"/[0-9a-f]{64}", "/<id>", url.split("/v1.", 1)[-1].split("/", 1)[-1])
            calls[f"{_verb} {path}"] += 1
            return _original(self, url, *args, **kwargs)

        monkeypatch.setattr(docker.APIClient, method, counting)
    config = AgentConfig(rollout=RolloutSection(max_tokens=4096, max_new_tokens_per_turn=512), verify=False)
    cpu0, t0 = box_cpu_s(), time.perf_counter()
    made, metrics = reference_transcripts(tasks, images, tok=ChatTokenizer.builtin(), config=config,
                                          num_parallel=PARALLEL)
    wall, cpu = time.perf_counter() - t0, box_cpu_s() - cpu0
    assert metrics["sft/reference_failures"] == 0 and len(made) == len(tasks)
    n = len(tasks)
    print(f"\n{n} reference transcripts, {PARALLEL} parallel: {wall:.1f} s wall, {cpu:.1f} s box CPU "
          f"({cpu / n * 1e3:.0f} ms per episode), load={os.getloadavg()[0]:.1f}")
    print(f"{'daemon call':40} {'per episode':>12}")
    for name, count in calls.most_common():
        print(f"{name:40} {count / n:>12.2f}")
