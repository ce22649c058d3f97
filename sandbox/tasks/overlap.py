"""The guard against training on the test: do the evaluation tasks overlap the training tasks?

Three checks, each a function (train, evaluation) -> the overlapping pairs it finds (`CHECKS`):
- the same task name (a benchmark copied into the training directory, or the same directory twice);
- the same instruction once normalized (case and runs of whitespace ignored): a task renamed or re-packaged;
- the n-gram decontaminator (`sandbox.tasks.decontaminate`): a shared normalized 13-token instruction span, 5-gram
  Jaccard above its threshold, or a byte-identical file that carries task-specific content (set-up scripts, base
  Dockerfiles, tiny files and boilerplate many tasks share are not counted).

`check_disjoint` applies a policy (tasks.decontaminate): 'refuse' (ValueError naming the pairs, the files and the
rule that fired, and the two other policies), 'warn' (print the same, train on everything) or 'drop' (print it and
leave the overlapping training tasks out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox.tasks import decontaminate
from sandbox.tasks.format import Task


@dataclass(frozen=True)
class Overlap:
    train: str
    """Name of the training task."""
    held_out: str
    """Name of the evaluation task it overlaps."""
    why: str
    """What the check found ("same name", "same instruction", ...)."""


def normalize_instruction(text: str) -> str:
    """Lower case, every run of whitespace one space, no leading or trailing space."""
    return " ".join(text.lower().split())


def same_name(train: Sequence[Task], held_out: Sequence[Task]) -> list[Overlap]:
    names = {t.name for t in train}
    return [Overlap(t.name, t.name, "same name") for t in held_out if t.name in names]


def same_instruction(train: Sequence[Task], held_out: Sequence[Task]) -> list[Overlap]:
    by_text: dict[str, str] = {}
    for t in train:
        by_text.setdefault(normalize_instruction(t.instruction), t.name)
    return [Overlap(by_text[key], t.name, "same instruction") for t in held_out
            if (key := normalize_instruction(t.instruction)) in by_text]


def shared_ngrams_or_files(train: Sequence[Task], held_out: Sequence[Task]) -> list[Overlap]:
    """`sandbox.tasks.decontaminate.find_overlaps` over the tasks' directories (tasks without one are not compared)."""
    def texts(tasks: Sequence[Task]) -> tuple[list[decontaminate.TaskText], dict[str, str]]:
        dirs = [(Path(t.path), t.name) for t in tasks if t.path is not None and Path(t.path).is_dir()]
        return [decontaminate.read_task(d) for d, _ in dirs], {str(d): name for d, name in dirs}

    (train_texts, train_names), (eval_texts, eval_names) = texts(train), texts(held_out)
    return [Overlap(train_names.get(str(o.train), Path(o.train).name), eval_names.get(str(o.eval), Path(o.eval).name),
                    f"{o.kind}: {o.evidence}" if o.kind != "file" else f"identical task-specific file {o.evidence}")
            for o in decontaminate.find_overlaps(train_texts, eval_texts)]


Check = Callable[[Sequence[Task], Sequence[Task]], list[Overlap]]
CHECKS: tuple[Check, ...] = (same_name, same_instruction, shared_ngrams_or_files)
"""Every check the guard runs."""


def find_overlaps(train: Sequence[Task], held_out: Sequence[Task]) -> list[Overlap]:
    """What every check in `CHECKS` finds, one entry per (train, evaluation) pair (its first reason)."""
    seen: dict[tuple[str, str], Overlap] = {}
    for check in CHECKS:
        for o in check(train, held_out):
            seen.setdefault((o.train, o.held_out), o)
    return list(seen.values())


POLICIES = ("refuse", "warn", "drop")
"""What a run does about training tasks that overlap its evaluation tasks (tasks.decontaminate)."""


def describe(found: Sequence[Overlap], *, num_held_out: int, train_what: str, held_out_what: str) -> str:
    """One line: how many evaluation tasks overlap, up to three pairs with the rule and the evidence of each."""
    shown = "; ".join(f"{o.held_out} ~ {o.train} ({o.why[:120]})" for o in found[:3])
    more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
    return (f"{held_out_what} overlaps {train_what}: {len({o.held_out for o in found})} of its {num_held_out} tasks "
            f"match training tasks ({shown}{more})")


def check_disjoint(train: Sequence[Task], held_out: Sequence[Task], *, train_what: str, held_out_what: str,
                   policy: str = "refuse") -> list[Task]:
    """The training tasks to keep: all of them when the two sets are disjoint. When they overlap, by `policy`:
    'refuse' raises ValueError in one line (the pairs, the rule that fired, how to proceed); 'warn' prints that
    line and keeps every task; 'drop' prints it and keeps the training tasks that overlap nothing."""
    if policy not in POLICIES:
        raise ValueError(f"tasks.decontaminate: expected one of {POLICIES}, got {policy!r}")
    found = find_overlaps(train, held_out)
    if not found:
        return list(train)
    line = describe(found, num_held_out=len(held_out), train_what=train_what, held_out_what=held_out_what)
    dropped = {o.train for o in found}
    if policy == "refuse":
        raise ValueError(f"{line}; evaluate on tasks the run does not train on, or set tasks.decontaminate='drop' "
                         f"(train without the {len(dropped)} overlapping training tasks) or 'warn' (train on them)")
    keep = [t for t in train if policy == "warn" or t.name not in dropped]
    what = ("training on them anyway" if policy == "warn" else
            f"dropped {len(dropped)} training tasks: {sorted(dropped)[:5]}")
    print(f"decontaminate ({policy}): {line}; {what}", flush=True)
    return keep
