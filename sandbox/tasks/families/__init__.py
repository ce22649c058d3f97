"""Seeded task families: each synthesizes task instances (other names, contents, numbers, bugs) from a seed.

`FAMILIES` maps a family name to its generator `(random.Random) -> TaskSpec`; the split only seeds the
stream. `SHORT_FAMILIES` are the ones a tiny model can learn from scratch: a one- or two-sentence instruction
and a one-command solution whose arguments all appear verbatim in the instruction. The other two need what only
a file tells (which CSV field holds the column, which bug the script has): their references look first, and the
command after copies from the instruction and from that look's output (`TaskSpec.inspect`).

Every instance also asks for one finishing step, the same in every family (remove the scratch directory
/app/tmp), which the full reference does and about half of the SFT demonstrations leave out: see
`sandbox.tasks.families.finish`.

`LONG_FAMILIES` take 100 commands and more each (`sandbox.tasks.families.chain`): they are chosen by name
(tasks.families), never part of "every family", and have no finishing step (their demonstrations stop early instead).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from sandbox.tasks.families import basic, chain, data, text
from sandbox.tasks.families.finish import with_cleanup
from sandbox.tasks.families.common import Split, TaskSpec, write_harbor_task

Generator = Callable[[random.Random], TaskSpec]

FAMILIES: dict[str, Generator] = {
    "create_file": basic.create_file,
    "append_line": basic.append_line,
    "make_dir": basic.make_dir,
    "copy_file": basic.copy_file,
    "rename_file": basic.rename_file,
    "chmod_exec": basic.chmod_exec,
    "count_lines": text.count_lines,
    "sort_file": text.sort_file,
    "replace_word": text.replace_word,
    "head_lines": text.head_lines,
    "grep_lines": text.grep_lines,
    "json_field": data.json_field,
    "csv_column_sum": data.csv_column_sum,
    "fix_script": data.fix_script,
}
LONG_FAMILIES: dict[str, Generator] = {
    "follow_chain": chain.follow_chain,
}
SHORT_FAMILIES: tuple[str, ...] = (
    "create_file", "append_line", "make_dir", "copy_file", "rename_file", "chmod_exec", "count_lines",
    "sort_file", "replace_word", "head_lines", "grep_lines", "json_field",
)


def generate(family: str, seed: int, split: Split) -> TaskSpec:
    """The instance of `family` for `seed` (deterministic: same inputs, same task)."""
    if family not in FAMILIES and family not in LONG_FAMILIES:
        raise ValueError(f"unknown task family {family!r}; expected one of {known_families()}")
    if split not in ("train", "heldout"):
        raise ValueError(f"expected split 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{family}:{split}:{seed}")
    if family in LONG_FAMILIES:
        return LONG_FAMILIES[family](rng)
    return with_cleanup(FAMILIES[family](rng), rng)


def known_families() -> list[str]:
    """Every family name `generate` takes, sorted: FAMILIES and LONG_FAMILIES."""
    return sorted([*FAMILIES, *LONG_FAMILIES])


__all__ = ["FAMILIES", "LONG_FAMILIES", "SHORT_FAMILIES", "known_families", "Split", "TaskSpec", "generate", "write_harbor_task"]
