"""Data and repair families: jq on JSON, awk on CSV, a one-token bug fix in a bash script.

The CSV and bug-fix references take two turns: a look at the file, then the command its output calls for."""

from __future__ import annotations

import json
import random

from sandbox.tasks.families.common import WORDS, TaskSpec, ident, sha_of

_KEYS = ("name", "owner", "city", "color", "status", "port", "count", "level", "region", "version")
_INT_KEYS = ("port", "count", "level", "version")


def json_field(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    src = f"/app/{rng.choice(('config', 'settings', 'record', 'profile'))}_{tag}.json"
    out = f"/app/value_{tag}.txt"
    keys = rng.sample(_KEYS, rng.randint(3, 6))
    obj = {k: rng.randint(1, 9999) if k in _INT_KEYS else rng.choice(WORDS) for k in keys}
    key = rng.choice(keys)
    content = json.dumps(obj, indent=2) + "\n"
    return TaskSpec(
        instruction=f"Write the value of the field {key} in {src} to {out}.",
        files={src: content}, solution=f"jq -r .{key} {src} > {out}", category="data",
        constants={"SRC": src, "OUT": out, "VALUE": str(obj[key]), "SRC_SHA": sha_of(content)},
        tests="""
        def test_output_exists():
            assert pathlib.Path(OUT).is_file()

        def test_value_correct():
            assert read(OUT).strip() == VALUE

        def test_value_is_raw_not_quoted():
            assert pathlib.Path(OUT).is_file() and '"' not in read(OUT)

        def test_input_unchanged():
            assert sha(SRC) == SRC_SHA
        """)


def csv_column_sum(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    src, out = f"/app/{rng.choice(('sales', 'stock', 'visits', 'scores'))}_{tag}.csv", f"/app/total_{tag}.txt"
    cols = rng.sample(("qty", "price", "units", "points", "hits", "days"), 3)
    k = rng.randint(1, 3)
    rows = [[rng.randint(0, 500) for _ in cols] for _ in range(rng.randint(3, 12))]
    content = ",".join(["item", *cols]) + "\n" + "".join(
        ",".join([rng.choice(WORDS), *map(str, r)]) + "\n" for r in rows)
    total = sum(r[k - 1] for r in rows)
    col = cols[k - 1]
    # The instruction names the column, not its position: the reference first asks the header, whose answer
    # ("3:price") holds the awk field number to copy.
    return TaskSpec(
        instruction=f"Write the sum of the {col} column of {src} (it has a header line) to {out}.",
        files={src: content}, category="data",
        inspect=(f"head -1 {src} | tr , '\\n' | grep -nx {col}",),
        solution=f"awk -F, 'NR>1 {{s+=${k + 1}}} END {{print s}}' {src} > {out}",
        constants={"SRC": src, "OUT": out, "TOTAL": total, "SRC_SHA": sha_of(content)},
        tests="""
        def test_output_exists():
            assert pathlib.Path(OUT).is_file()

        def test_output_is_a_number():
            assert read(OUT).strip().isdigit()

        def test_sum_correct():
            assert int(read(OUT).strip()) == TOTAL

        def test_input_unchanged():
            assert sha(SRC) == SRC_SHA
        """)


# (buggy line, fixed line, the sed expression that fixes it): one token differs. The expression is the shortest
# piece of the buggy line that names the bug, copied from what `cat` shows, with no backslash to escape twice
# (once for sed, once for the tool call's JSON).
_BUGS = (
    ("total=1", "total=0", "s/total=1/total=0/"),
    ("  total=$((total - n))", "  total=$((total + n))", "s/total - n/total + n/"),
    ("echo $totl", "echo $total", "s/totl/total/"),
    ("  total=$((total * n))", "  total=$((total + n))", "s/total [*] n/total + n/"),
)


def fix_script(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    name = f"/app/{rng.choice(('sum', 'add', 'total', 'tally'))}_{tag}.sh"
    data = f"/app/{rng.choice(('numbers', 'values', 'amounts'))}_{tag}.txt"
    good = ["#!/bin/bash", "total=0", f"for n in $(cat {data}); do", "  total=$((total + n))", "done",
            "echo $total"]
    buggy_line, fixed_line, fix = rng.choice(_BUGS)
    i = next(j for j, line in enumerate(good) if line == fixed_line)
    bad = good[:i] + [buggy_line] + good[i + 1:]
    nums = [rng.randint(2, 60) for _ in range(rng.randint(3, 8))]
    numbers = "".join(f"{x}\n" for x in nums)
    return TaskSpec(
        instruction=f"The script {name} should print the sum of the numbers in {data}, but it has a bug. "
                    "Fix the script.",
        files={name: "\n".join(bad) + "\n", data: numbers}, modes={name: 0o755}, category="fix",
        inspect=(f"cat {name}",),  # which of the bugs it is shows only in the script
        solution=f"sed -i '{fix}' {name}",
        constants={"SCRIPT": name, "DATA": data, "TOTAL": sum(nums), "DATA_SHA": sha_of(numbers)},
        tests="""
        def test_prints_sum():
            assert run(["bash", SCRIPT]).stdout.strip() == str(TOTAL)

        def test_sums_other_numbers():
            original = read(DATA)
            try:
                pathlib.Path(DATA).write_text("7\\n11\\n100\\n")
                out = run(["bash", SCRIPT]).stdout.strip()
            finally:
                pathlib.Path(DATA).write_text(original)
            assert out == "118"

        def test_data_unchanged():
            assert sha(DATA) == DATA_SHA
        """)
