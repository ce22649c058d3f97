"""The trainer loop without sandboxes: a run's episodes recorded once where Docker runs, replayed where it cannot.

    python bench/train_replay.py record DIR -- [train args]   # a CPU box with Docker: run and record
    python bench/train_replay.py replay DIR -- [train args]   # anywhere: the same run, episodes from DIR

Why: the device check (bench/gpu_run.sh) must run the trainer's steps on a GPU, and the lent device has no Docker
daemon. T1 has no second sandbox runtime by design (sandboxes ride the Docker daemon), and an in-process stand-in
for the shell would train on a fake environment. So the episodes are real ones: `RecordingTrainer` is the trainer,
saving what each `collect` call returned (trajectories with their tokens, rollout log-probs and R3 routing, the
verifiers' rewards, the loss-region drift measured against the engine) in call order; `ReplayTrainer` is the
trainer whose `collect` returns those instead of running episodes. Everything else runs for real on the replay's
device: the SFT/pretraining (if any), score (the policy's log-probs over the recorded tokens with the recorded
routing replayed), the PPO update, the weight sync into the engine, checkpoints and the HF export.

A replay is exact only while the policy that sampled the recording is the policy being trained: the recorded run
and the replay share config and seed, and the actor does not move before the last recorded collection (critic-only
steps, or one actor step at the end). On the CPU the replayed run is bit-identical to the recorded one
(tests/test_gpu_scripts.py: same final weights); on CUDA the gap between the recorded CPU log-probs and the GPU
trainer's is what the device check reports. CPU bits also depend on the instruction set the CPU kernels take
(`torch.backends.cpu.get_cpu_capability()`: MKL and oneDNN pick other kernels, so other roundings, on AVX2 than on
AVX512): the recording names its capability, and a CPU replay on another one is refused rather than run inexactly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from rollout.trajectory import Trajectory, load_trajectories, save_trajectories
from sandbox.tasks.format import Task
from t1core import cli, train
from t1core.config import RunConfig
from t1core.config_checks import check_config
from t1core.distributed import DataParallel
from t1core.tasks import TaskSets, load_tasks

INDEX = "recording.json"


def weights_sha256(run_dir: Path) -> str:
    """sha256 of a finished run's final/model.safetensors."""
    return hashlib.sha256((run_dir / "final" / "model.safetensors").read_bytes()).hexdigest()


class RecordingTrainer(train.Trainer):
    """The trainer, also writing every collection (in call order) under `recording`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, recording: Path) -> None:
        self.recording, self.calls = recording, []
        super().__init__(cfg, run_dir)

    def collect(self, tasks: list[Task], **kw) -> tuple[list[Trajectory], list[int]]:
        trajs, drift = super().collect(tasks, **kw)
        call = f"call_{len(self.calls):03d}"
        save_trajectories(trajs, self.recording / call)
        self.calls.append({"dir": call, "desc": kw.get("desc", ""), "tasks": [t.name for t in tasks],
                           "drift": drift})
        return trajs, drift


class ReplayTrainer(train.Trainer):
    """The trainer whose episodes come from a recording: no task images are built, no sandbox is started."""

    def __init__(self, cfg: RunConfig, run_dir: Path, recording: Path) -> None:
        index = recording / INDEX
        if not index.is_file():
            raise FileNotFoundError(f"{recording}: no {INDEX} (record one with `python bench/train_replay.py "
                                    "record DIR -- ...` on a machine with Docker)")
        recorded = json.loads(index.read_text())
        here = torch.backends.cpu.get_cpu_capability()
        if cfg.run.device == "cpu" and recorded.get("cpu_capability") != here:
            raise RuntimeError(f"{recording}: recorded on a CPU running {recorded.get('cpu_capability', 'unnamed')} "
                               f"kernels, this one runs {here}: a CPU replay would not be the recorded run bit for "
                               "bit (record one here: python bench/train_replay.py record DIR -- ...)")
        self.recording, self.calls = recording, recorded["calls"]
        self.next_call = 0
        super().__init__(cfg, run_dir)

    def prepare_tasks(self) -> TaskSets:
        return load_tasks(self.cfg, self.run_dir)  # the same task sets, without images

    def collect(self, tasks: list[Task], **kw) -> tuple[list[Trajectory], list[int]]:
        if self.next_call >= len(self.calls):
            raise RuntimeError(f"{self.recording}: the recording holds {len(self.calls)} collections; the run asked "
                               "for one more (a longer run than the one recorded?)")
        call = self.calls[self.next_call]
        self.next_call += 1
        want = [t.name for t in tasks]
        if call["tasks"] != want:  # another config, seed or task suite than the recorded run's
            raise RuntimeError(f"{self.recording}/{call['dir']}: recorded for tasks {call['tasks'][:3]}..., the run "
                               f"asks for {want[:3]}... (replay with the recorded run's arguments)")
        return load_trajectories(self.recording / call["dir"]), list(call["drift"])


def run(trainer_cls: type[train.Trainer], argv: list[str], recording: Path) -> train.Trainer:
    """One run of `python -m t1core.train argv` with `trainer_cls`; returns the finished trainer."""
    cfg, run_dir = cli.parse_args(argv)
    check_config(cfg)
    cli.start(cfg, run_dir, DataParallel.single())  # one process: the device check runs one GPU
    trainer = trainer_cls(cfg, run_dir, recording)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def record(argv: list[str], recording: Path) -> Path:
    """Run and record into `recording` (replaced); the index holds the arguments and the final weights' hash."""
    if recording.exists():
        shutil.rmtree(recording)
    recording.mkdir(parents=True)
    trainer = run(RecordingTrainer, argv, recording)
    index = {"argv": argv, "calls": trainer.calls, "final_sha256": weights_sha256(trainer.run_dir),
             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    (recording / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return trainer.run_dir


def main(args: list[str]) -> int:
    if len(args) < 2 or args[0] not in ("record", "replay") or (len(args) > 2 and args[2] != "--"):
        print(__doc__.split("\n\n")[0] + "\nusage: python bench/train_replay.py record|replay DIR -- [train args]",
              file=sys.stderr)
        return 2
    mode, recording, argv = args[0], Path(args[1]), args[3:]
    run_dir = record(argv, recording) if mode == "record" else run(ReplayTrainer, argv, recording).run_dir
    print(f"{mode}: {run_dir.resolve()} final sha256 {weights_sha256(run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
