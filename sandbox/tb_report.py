"""Terminal-Bench results as data: `python -m sandbox.tb_report docs/terminal-bench/` prints the README's figures.

The directory holds sources.toml (each collection's repository, commit, path and task list file; the settings) and one
JSONL file per collection and setting, `{collection}-{setting}.jsonl`, a line per task: task, builds, passed and
total (the reference solution's verifiers), resolved (all passed), nothing (the do-nothing agent), reason, why, run,
flags, base_image (the task's own FROM), base_mapped_onto, time_limits, date. A file must hold every task of its
collection's list exactly once. Prints a table (collection, source, setting, reference solutions resolved) and the
README's cell (`readme_cell`; tests/test_tb_report.py checks the README holds it); a setting with no file is "not
run". Exit 0, or 2 with one line on bad input (a file that disagrees with its collection's task list, a malformed
line).
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from sandbox.cli import Parser, bad_input

FIELDS = ("task", "builds", "passed", "total", "resolved", "nothing", "reason", "why", "run", "flags", "base_image",
          "base_mapped_onto", "time_limits", "date")
"""Every line's keys."""


@dataclass(frozen=True)
class Result:
    collection: str
    """The collection's display name (sources.toml `name`)."""
    source: str
    """repository@commit (short)."""
    setting: str
    """The setting's label (sources.toml [settings.*] label)."""
    resolved: int | None
    """Tasks whose reference solution passed every verifier; None: this setting was not run."""
    tasks: int


def _rows(path: Path, expected: list[str]) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from e
        if not isinstance(row, dict) or set(row) != set(FIELDS):
            raise ValueError(f"{path}:{i}: expected the keys {list(FIELDS)}")
        if row["resolved"] != (row["total"] is not None and row["passed"] == row["total"]):
            raise ValueError(f"{path}:{i}: {row['task']}: resolved={row['resolved']} but "
                             f"{row['passed']}/{row['total']}")
        rows.append(row)
    names = [r["task"] for r in rows]
    if sorted(names) != sorted(expected):
        extra, missing = sorted(set(names) - set(expected)), sorted(set(expected) - set(names))
        raise ValueError(f"{path}: tasks differ from the collection's list (extra {extra[:3]}, missing {missing[:3]}, "
                         f"{len(names) - len(set(names))} repeated)")
    return rows


def shorts(root: Path) -> dict[str, str]:
    """Setting label -> the short name the README uses (sources.toml [settings.*] short)."""
    settings = tomllib.loads((root / "sources.toml").read_text()).get("settings", {})
    return {s["label"]: s.get("short", s["label"]) for s in settings.values()}


def results(root: Path) -> list[Result]:
    """Every (collection, setting) of sources.toml, in its order; ValueError naming a file that disagrees."""
    src = root / "sources.toml"
    if not src.is_file():
        raise ValueError(f"{root}: no sources.toml (not a Terminal-Bench results directory)")
    cfg = tomllib.loads(src.read_text())
    settings = cfg.pop("settings")
    out = []
    for key, col in cfg.items():
        expected = (root / col["tasks"]).read_text().split()
        source = f"{col['repository'].removeprefix('https://github.com/')}@{col['commit'][:7]}"
        for skey, setting in settings.items():
            path = root / f"{key}-{skey}.jsonl"
            rows = _rows(path, expected) if path.is_file() else None
            out.append(Result(col["name"], source, setting["label"],
                              None if rows is None else sum(r["resolved"] for r in rows), len(expected)))
    return out


def readme_cell(found: list[Result], shorts: dict[str, str]) -> str:
    """The README's figures: each collection's count under the settings that ran, then what did not run, e.g.
    '41/94, 52/89 (trusted-agent flags; defaults not run)' (`shorts`: setting label -> its short name)."""
    ran = list(dict.fromkeys(r.setting for r in found if r.resolved is not None))
    not_run = list(dict.fromkeys(r.setting for r in found if r.resolved is None and r.setting not in ran))
    figures = "; ".join(", ".join(f"{r.resolved}/{r.tasks}" for r in found if r.setting == s) for s in ran)
    notes = ran + [f"{shorts.get(s, s)} not run" for s in not_run]
    return f"{figures or 'nothing run'} ({'; '.join(notes)})"


def table(found: list[Result]) -> str:
    lines = ["| collection | source | setting | reference solutions resolved |", "|---|---|---|---|"]
    lines += [f"| {r.collection} | {r.source} | {r.setting} | "
              f"{'not run' if r.resolved is None else f'{r.resolved}/{r.tasks}'} |" for r in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m sandbox.tb_report", description=__doc__.split("\n\n")[0],
               epilog="example: python -m sandbox.tb_report docs/terminal-bench/")
    p.add_argument("dir", type=Path, help="the results directory (sources.toml and the JSONL files)")
    args = p.parse_args(argv)
    with bad_input(p):
        found = results(args.dir)
    print(table(found))
    print(f"\nREADME (reference solutions passing, TB1, TB2): {readme_cell(found, shorts(args.dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
