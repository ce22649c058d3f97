"""Terminal-Bench results as data (issue 58): docs/terminal-bench/ gives the README's figures, every file holds its
collection's whole task list, and a file that disagrees is one line, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from sandbox import tb_report

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "terminal-bench"


def test_the_readme_row_is_what_the_files_give() -> None:
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| reference solutions passing: built-in / TB1, TB2 |"))
    cell = row.split("|")[2].strip()
    assert cell == f"all / {tb_report.readme_cell(tb_report.results(DATA), tb_report.shorts(DATA))}", cell


def test_every_file_covers_its_collection_and_counts_by_hand() -> None:
    found = {(r.collection, r.setting): r for r in tb_report.results(DATA)}
    for key, name in (("tb1", "TB1"), ("tb2", "TB2")):
        names = (DATA / f"{key}-tasks.txt").read_text().split()
        rows = [json.loads(line) for line in (DATA / f"{key}-trusted-agent.jsonl").read_text().splitlines()]
        assert sorted(r["task"] for r in rows) == sorted(names) and len(names) == len(set(names))
        by_hand = sum(1 for r in rows if r["total"] is not None and r["passed"] == r["total"])
        assert found[(name, "trusted-agent flags")].resolved == by_hand
        assert found[(name, "trainer defaults")].resolved is None  # not run: never invented
        assert all(r["flags"] and r["date"] and r["base_image"] and r["reason"] for r in rows)
    assert (found[("TB1", "trusted-agent flags")].resolved, found[("TB2", "trusted-agent flags")].resolved) == (41, 52)


def test_a_file_missing_a_task_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "tb"
    shutil.copytree(DATA, bad)
    lines = (bad / "tb1-trusted-agent.jsonl").read_text().splitlines()
    (bad / "tb1-trusted-agent.jsonl").write_text("\n".join(lines[1:]) + "\n")
    r = subprocess.run([sys.executable, "-m", "sandbox.tb_report", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert ("tb1-trusted-agent.jsonl: tasks differ from the collection's list (extra [], missing ['aimo-airline"
            in r.stderr)
