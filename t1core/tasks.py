"""The run's tasks: the SFT, RL and held-out sets (the built-in suite or a directory of tasks), eval.source's
benchmarks kept apart from them, and their images built before the first episode."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.images.task_images import TaskImage, build_task_images, default_base_image_overrides
from sandbox.images.base_image import ensure_base_image
from sandbox.tasks.overlap import check_disjoint
from sandbox.tasks.suite import family_tasks, fixed_tasks, heldout_tasks, train_tasks
from sandbox.tasks.format import Task, load_task, load_task_dirs
from sandbox.cli import bad_input
from sandbox.runtime.hosts import use_hosts
from t1core import cli, distributed
from t1core.config import RunConfig
from t1core.step import SeedBlock


BUILTIN = "builtin"
"""The eval.source item naming the built-in suite's held-out split."""
@dataclass
class TaskSets:
    train: list[Task]           # SFT: reference transcripts of these
    rl: list[Task]              # RL episodes (the SFT instances themselves when no separate RL set is drawn)
    heldout_family: list[Task]
    heldout_fixed: list[Task]
    images: dict[str, TaskImage] = field(default_factory=dict)   # task name -> image (and preloaded files)
    benchmarks: dict[str, list[Task]] = field(default_factory=dict)  # eval.source's directories by name

    @property
    def num_eval_tasks(self) -> int:
        """Tasks an evaluation runs: the built-in held-out split's and the benchmarks'."""
        return len(self.heldout_family) + len(self.heldout_fixed) + sum(map(len, self.benchmarks.values()))

    def all(self) -> list[Task]:
        bench = [t for ts in self.benchmarks.values() for t in ts]
        unique = {t.name: t for t in self.train + self.rl + self.heldout_family + self.heldout_fixed + bench}
        return list(unique.values())


def load_tasks(cfg: RunConfig, run_dir: Path) -> TaskSets:
    """The built-in suite (families written under run_dir/tasks) or a directory of task dirs (all train).

    Built-in: SFT instances, RL instances (fresh seeds: RL then practises on instances the warm start has not
    memorised, which is what held-out success measures; the fixed train tasks too if tasks.fixed_tasks='rl') and
    held-out instances, no instruction repeated across the three. Then eval.source's directories, refused when
    they overlap the training tasks (`load_benchmarks`)."""
    sets = _training_tasks(cfg, run_dir)
    everything = list({t.name: t for t in sets.train + sets.rl}.values())
    sets.benchmarks, keep = load_benchmarks(cfg, everything)
    for d in cfg.tasks.decontaminate_against:
        keep = check_disjoint(keep, load_task_dirs(d), train_what="the training tasks",
                              held_out_what=f"tasks.decontaminate_against {d!r}", policy=cfg.tasks.decontaminate)
    kept = {t.name for t in keep}
    sets.train, sets.rl = [t for t in sets.train if t.name in kept], [t for t in sets.rl if t.name in kept]
    if len(keep) < len(everything) and not (sets.train and sets.rl):
        raise ValueError("tasks.decontaminate='drop': no training tasks left once those overlapping the evaluation "
                         "tasks are dropped")
    return sets


def load_benchmarks(cfg: RunConfig, train: list[Task]) -> tuple[dict[str, list[Task]], list[Task]]:
    """eval.source's directories by name (a repeated directory name gets '-2', '-3'), and the training tasks `train`
    to keep: ValueError when a task name repeats across the directories; training tasks that overlap one of them
    (sandbox.tasks.overlap) refuse the run, warn or are dropped, by tasks.decontaminate."""
    out: dict[str, list[Task]] = {}
    for source in cfg.eval.source:
        if source == BUILTIN:
            continue
        base = name = Path(source).resolve().name
        copies = 1
        while name in out or name == BUILTIN:  # 'builtin' names the built-in split's metrics
            copies += 1
            name = f"{base}-{copies}"
        out[name] = load_task_dirs(source)
        train = check_disjoint(train, out[name], train_what=f"tasks.source={cfg.tasks.source!r}",
                               held_out_what=f"eval.source {source!r}", policy=cfg.tasks.decontaminate)
    names = [t.name for ts in out.values() for t in ts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"eval.source: task names {repeated[:3]} appear in more than one directory")
    return out, train


def nothing_reason(cfg: RunConfig) -> str:
    """Why a run evaluates nothing (printed instead of empty lines)."""
    if not cfg.eval.source:
        return "eval.source is empty"
    if cfg.tasks.source != BUILTIN and cfg.eval.source == (BUILTIN,):
        return (f"eval.source='builtin' is the built-in suite's held-out split, and tasks.source={cfg.tasks.source!r} "
                "is a directory: pass --eval.source=DIR (a benchmark the run does not train on)")
    return "the held-out split is empty (tasks.num_heldout_per_family=0 and no held-out fixed task)"


def _training_tasks(cfg: RunConfig, run_dir: Path) -> TaskSets:
    t = cfg.tasks
    families = list(t.families) or None
    if t.source == "builtin":
        out = run_dir / "tasks"
        train = train_tasks(out, num_per_family=t.num_per_family, seed=int(SeedBlock.TRAIN), families=families,
                            include_fixed=t.fixed_tasks != "off")
        rl = train
        if t.num_rl_per_family:
            rl = family_tasks(out, split="train", num_per_family=t.num_rl_per_family, seed=int(SeedBlock.RL),
                              families=families, avoid=train) + (fixed_tasks("train") if t.fixed_tasks == "rl" else [])
        if BUILTIN not in cfg.eval.source:
            return TaskSets(train, rl, [], [])
        fam, fixed = heldout_tasks(out, num_per_family=t.num_heldout_per_family, seed=int(SeedBlock.HELDOUT),
                                   families=families, avoid=train + rl)
        return TaskSets(train, rl, fam, fixed if t.fixed_tasks != "off" else [])
    root = Path(t.source)
    if not root.is_dir():
        raise ValueError(f"tasks.source: expected 'builtin' or a directory of tasks, got {t.source!r}")
    tasks = [load_task(p) for p in sorted(root.iterdir()) if p.is_dir()]
    return TaskSets(tasks, tasks, [], [])


def prepare_tasks(cfg: RunConfig, run_dir: Path, dp: distributed.DataParallel) -> TaskSets:
    """The run's task sets on every rank: the main rank writes the task directories (a malformed task, or eval.source
    overlapping tasks.source, is the user's input: one line, exit 2), removes containers left by crashed runs and
    builds the images (and loads them into every host of sandbox.hosts); all ranks then run sandboxes on those hosts.
    Says so when the run will evaluate nothing."""
    tasks = None
    hosts = use_hosts(cfg.sandbox.hosts)  # every rank: the provider its sandbox pools start from
    if dp.is_main:
        with bad_input(cli.parser()):
            tasks = load_tasks(cfg, run_dir)
        hosts.reap()
        build_images(tasks, cfg)
        if cfg.sandbox.hosts:
            hosts.distribute({image.ref for image in tasks.images.values()})
        if not tasks.num_eval_tasks:
            print(f"evaluation: none ({nothing_reason(cfg)})", flush=True)
    return dp.broadcast(tasks)


def build_images(tasks: TaskSets, cfg: RunConfig) -> None:
    """Build (or find cached) every task image; user overrides take precedence over the defaults."""
    ensure_base_image()
    overrides = cfg.tasks.base_image_map()  # user patterns first: the first matching pattern wins
    for pattern, image in default_base_image_overrides().items():
        overrides.setdefault(pattern, image)
    tasks.images.update(build_task_images(tasks.all(), base_image_overrides=overrides))


def check_decontaminated(cfg: RunConfig) -> None:
    """With tasks.decontaminate='refuse': the training tasks (the built-in suite's written to a scratch directory
    first) overlap none of tasks.decontaminate_against's (`load_tasks`); ValueError otherwise, before any build."""
    if cfg.tasks.decontaminate == "refuse":
        with tempfile.TemporaryDirectory(prefix="t1-decontaminate-") as tmp:
            load_tasks(cfg, Path(tmp))
