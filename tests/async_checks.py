"""What every asynchronous training test checks in its run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def async_steps(out: Path, steps: int, *, max_staleness: int = 1) -> list[dict]:
    """The RL steps' metric rows of the run in `out`, after checking each: within the staleness bound, drift 0,
    and the policy version being updated equal to the step (one sync per step)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if 0 <= r["step"] < steps]
    assert len(rl) == steps, [r["step"] for r in rows]
    for r in rl:
        assert r["async/staleness_max"] <= max_staleness and r["tito/drift_tokens"] == 0, r
    assert [r["async/policy_version"] for r in rl] == list(range(steps))
    return rl
