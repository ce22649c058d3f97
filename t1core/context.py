"""RunContext: what every phase of a run reads besides the models, as one value (the config, the run directory, the
ranks, the tokenizer, the task sets, the phase stopwatch). The trainer builds it once its tasks are ready and hands
it to each phase: `warm_start(run, policy)`, `evaluate(run, collect, tag)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from t1core.clock import Stopwatch
from t1core.config import RunConfig
from t1core.distributed import DataParallel
from t1core.tasks import TaskSets
from t1model.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class RunContext:
    cfg: RunConfig
    dir: Path
    """The run directory: metrics, checkpoints, trajectories/, eval/."""
    dp: DataParallel
    tok: ChatTokenizer
    tasks: TaskSets
    clock: Stopwatch
