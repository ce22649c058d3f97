"""T1's built-in task suite: fixed Harbor tasks in tasks/fixed/ and seeded task families.

Fixed tasks are split once, by name, in tasks/split.toml (`train = [...]`, `heldout = [...]`). Family
instances are written out as ordinary Harbor task directories under a caller-chosen `out_dir`; training and
held-out instances come from one distribution with disjoint seeds (the split is part of every instance's
random stream), and `heldout_tasks` drops a held-out instance whose instruction repeats a training one.

    tasks = suite.train_tasks(out, num_per_family=8, seed=0)               # families + fixed train tasks
    fam, fixed = suite.heldout_tasks(out, num_per_family=4, seed=0)        # held-out families, fixed tasks
    cmd = suite.reference_solution(task)                                   # solve.sh body, one tool call
    calls = suite.reference_turns(task)                                    # its turns (tool calls)
    calls, fails = suite.demonstration_turns(task)                         # what SFT is shown, tests it fails
"""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Sequence
from pathlib import Path

from sandbox.tasks.families import FAMILIES, SHORT_FAMILIES, Split, generate, known_families, write_harbor_task
import sandbox.tasks.format as task_formats
from sandbox.tasks.families.common import DEMO_FAILS_PREFIX, DEMONSTRATION_FILE, TURN_BREAK
from sandbox.tasks.format import Task, TaskFormatError, load_task

TASKS_DIR = Path(__file__).resolve().parents[2] / "tasks"
FIXED_DIR = TASKS_DIR / "fixed"
SPLIT_FILE = TASKS_DIR / "split.toml"
# Seeds of one call occupy [seed * SEED_STRIDE, seed * SEED_STRIDE + num_per_family).
SEED_STRIDE = 100_000


def fixed_task_names(split: Split) -> list[str]:
    """Names of the fixed tasks in `split`, as listed in tasks/split.toml (checked against tasks/fixed/)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"expected split 'train' or 'heldout', got {split!r}")
    try:
        cfg = tomllib.loads(SPLIT_FILE.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(SPLIT_FILE, "toml", f"invalid TOML: {e}") from e
    lists = {}
    for key in ("train", "heldout"):
        names = cfg.get(key)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TaskFormatError(SPLIT_FILE, key, f"expected a list of task names, got {names!r}")
        lists[key] = names
    on_disk = {p.name for p in FIXED_DIR.iterdir() if p.is_dir()}
    listed = lists["train"] + lists["heldout"]
    if sorted(listed) != sorted(on_disk):
        raise TaskFormatError(SPLIT_FILE, "train/heldout", "must list every directory of tasks/fixed/ exactly "
                              f"once; missing {sorted(on_disk - set(listed))}, unknown or repeated "
                              f"{sorted(n for n in set(listed) if listed.count(n) > 1 or n not in on_disk)}")
    return list(lists[split])


def fixed_tasks(split: Split) -> list[Task]:
    """The fixed tasks of `split`, loaded."""
    return [load_task(FIXED_DIR / name) for name in fixed_task_names(split)]


def family_tasks(out_dir: str | Path, *, split: Split, num_per_family: int, seed: int = 0,
                 families: Sequence[str] | None = None, avoid: Sequence[Task] = ()) -> list[Task]:
    """Write `num_per_family` instances of each family for `split` under `out_dir` and load them.

    A directory that already exists under the same name is replaced (generation is deterministic, so the
    content is the same unless the generator changed). `families=None` means all of FAMILIES (LONG_FAMILIES only by
    name). An instance whose
    instruction repeats one of `avoid` (e.g. the training tasks, when generating held-out ones) is skipped and
    the next seed drawn instead: both splits share one distribution, so a rare exact repeat is possible.
    """
    if num_per_family < 0 or seed < 0:
        raise ValueError(f"expected num_per_family >= 0 and seed >= 0, got {num_per_family}, {seed}")
    names = list(FAMILIES) if families is None else list(families)
    unknown = [f for f in names if f not in known_families()]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; expected names from {known_families()}")
    out = Path(out_dir)
    seen = {t.instruction for t in avoid}
    tasks = []
    for family in names:
        instance_seed, made = seed * SEED_STRIDE, 0
        while made < num_per_family:
            if instance_seed - seed * SEED_STRIDE >= SEED_STRIDE:  # bounded: a hopeless `avoid` must not hang
                raise ValueError(f"family {family!r}: no {num_per_family} instances outside `avoid` among "
                                 f"{SEED_STRIDE} seeds of split {split!r}")
            spec = generate(family, instance_seed, split)
            if spec.instruction.strip() not in seen:
                path = out / f"{family}-{split}-{instance_seed}"
                if path.exists():
                    _remove_generated(path)
                tasks.append(load_task(write_harbor_task(spec, path, family=family, seed=instance_seed, split=split)))
                made += 1
            instance_seed += 1
    return tasks


def train_tasks(out_dir: str | Path, *, num_per_family: int, seed: int = 0,
                families: Sequence[str] | None = None, include_fixed: bool = True) -> list[Task]:
    """Training tasks: family instances (train split) followed by the fixed train tasks."""
    tasks = family_tasks(out_dir, split="train", num_per_family=num_per_family, seed=seed, families=families)
    return tasks + (fixed_tasks("train") if include_fixed else [])


def heldout_tasks(out_dir: str | Path, *, num_per_family: int, seed: int = 0, families: Sequence[str] | None = None,
                  avoid: Sequence[Task] = ()) -> tuple[list[Task], list[Task]]:
    """Held-out evaluation tasks: (family instances of the held-out split, fixed held-out tasks).

    Pass the training tasks as `avoid` so that no held-out instance repeats a training instruction."""
    fam = family_tasks(out_dir, split="heldout", num_per_family=num_per_family, seed=seed, families=families,
                       avoid=avoid)
    return fam, fixed_tasks("heldout")


def reference_turns(task: Task) -> list[str]:
    """The task's reference solution as the tool calls of an SFT transcript, in order.

    solve.sh without shebang and leading comments, split at `TURN_BREAK` lines: one call for most tasks (a
    single short command for the family tasks), a look and then the command it calls for where the instruction
    alone leaves the solution open (see `TaskSpec.inspect`).
    """
    text = task_formats.reference_solution(task)
    if text is None:
        raise ValueError(f"task {task.name} has no reference solution")
    return _turns(text, task.name, source=str(task.solution_script))


def demonstration_turns(task: Task) -> tuple[list[str], tuple[str, ...]]:
    """(tool calls, tests it leaves failing) of the task's SFT demonstration: the incomplete demonstration a
    family instance ships next to solve.sh (it leaves out the finishing step, `sandbox.tasks.families.finish`), else
    the full reference with nothing left failing."""
    demo = task.solution_script.parent / DEMONSTRATION_FILE if task.solution_script is not None else None
    if demo is None or not demo.is_file():
        return reference_turns(task), ()
    second = (demo.read_text().splitlines()[1:2] or [""])[0]
    if not second.startswith(DEMO_FAILS_PREFIX) or not second.removeprefix(DEMO_FAILS_PREFIX).split():
        raise ValueError(f"task {task.name}: {demo} must name the tests it leaves failing on its second line "
                         f"({DEMO_FAILS_PREFIX!r} then names)")
    return _turns(demo.read_text(), task.name, source=str(demo)), tuple(second.removeprefix(DEMO_FAILS_PREFIX).split())


def _turns(text: str, name: str, *, source: str) -> list[str]:
    """A solution script without shebang and leading comments, split at `TURN_BREAK` lines."""
    lines = text.splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")) and lines[0].strip() != TURN_BREAK:
        lines.pop(0)
    turns: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == TURN_BREAK:
            turns.append([])
        else:
            turns[-1].append(line)
    calls = ["\n".join(t).strip() for t in turns]
    if not all(calls):
        raise ValueError(f"task {name}: {source} has an empty turn around {TURN_BREAK!r}")
    return calls


def reference_solution(task: Task) -> str:
    """The task's whole reference solution as one bash tool call (every turn of `reference_turns`, in order)."""
    return "\n".join(reference_turns(task))


def _remove_generated(path: Path) -> None:
    """Delete a previously generated instance; refuse anything this module did not write."""
    toml = path / "task.toml"
    if not toml.is_file() or "family" not in tomllib.loads(toml.read_text()).get("metadata", {}):
        raise ValueError(f"{path} exists and is not a generated family task; choose another out_dir")
    shutil.rmtree(path)


__all__ = ["FAMILIES", "SHORT_FAMILIES", "fixed_task_names", "fixed_tasks", "family_tasks", "train_tasks",
           "heldout_tasks", "reference_turns", "demonstration_turns", "reference_solution", "SEED_STRIDE"]
