"""sandbox.tasks.decontaminate: planted contamination is found, boilerplate is not, bad input is one line (exit 2).

Fixtures are written here; the run against the public Terminal-Bench collections skips when they are absent
($T1_TB1_TASKS, $T1_TB2_TASKS: TB1 = camel-ai/camel at 7955886, examples/workforce/terminal_bench/tasks; TB2 =
yujianll/skill-usage at f9f89fa, terminal-bench-2; checked out outside the repo)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.tasks.decontaminate import check_dirs, find_task_dirs, main, ngrams, normalize, read_task, task_specific

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "FROM python:3.13-slim-bookworm\nWORKDIR /app\n"
TEST_SH = "#!/bin/bash\napt-get update && apt-get install -y curl\ncurl -LsSf https://astral.sh/uv/install.sh | sh\n"
TOML = 'version = "1.0"\n[agent]\ntimeout_sec = 600.0\n'
EVAL_INSTRUCTIONS = {
    "ledger": "Reconcile the quarterly ledger stored in /app/ledger.csv against the bank export in /app/bank.csv "
              "and write every unmatched transaction id, one per line, to /app/unmatched.txt.",
    "maze": "Write a program /app/solve_maze.py that reads the ASCII maze in /app/maze.txt, finds the shortest "
            "path from S to E using only horizontal and vertical moves, and prints its length.",
    "cert": "Create a self-signed TLS certificate for the host internal.example with a 4096-bit RSA key, store "
            "the key in /app/ssl/server.key and the certificate in /app/ssl/server.crt.",
}


DATA_TSV = "".join(f"row{i}\t{i * 7 % 13}\n" for i in range(12))
"""A data file above the information threshold (a 2-line one is not evidence: tests of task_specific)."""


def _task(root: Path, name: str, instruction: str, tests: str, extra: dict[str, str] | None = None) -> Path:
    d = root / name
    files = {"instruction.md": instruction, "task.toml": TOML, "environment/Dockerfile": DOCKERFILE,
             "tests/test.sh": TEST_SH, "tests/test_outputs.py": tests, **(extra or {})}
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def _eval_set(root: Path) -> Path:
    for i, (name, text) in enumerate(EVAL_INSTRUCTIONS.items()):
        _task(root, name, text, f"def test_{name}():\n    assert open('/app/out{i}').read() == '{name} {i}'\n")
    return root


def _disjoint_train(root: Path) -> Path:
    """Tasks that share the base Dockerfile, test.sh and task.toml with every evaluation task, and nothing else."""
    _task(root, "rename", "Rename every file ending in .jpeg under /app/photos so that it ends in .jpg instead.",
          "def test_rename():\n    assert True\n")
    _task(root, "primes", "Print the first twenty prime numbers, separated by spaces, into the file /app/primes.txt.",
          "def test_primes():\n    assert 1\n")
    return root


def test_normalize_ignores_case_punctuation_and_layout() -> None:
    assert normalize("Write  the\nFILE: /app/out.txt!") == ("write", "the", "file", "app", "out", "txt")
    assert normalize("ﬁle Ｆｉｌｅ") == ("file", "file")  # NFKC folds ligatures and full-width letters


def test_disjoint_set_sharing_only_boilerplate_passes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    evals, train = _eval_set(tmp_path / "eval"), _disjoint_train(tmp_path / "train")
    assert check_dirs(find_task_dirs(train), [evals]) == []
    assert main([str(train), "--against", str(evals)]) == 0
    assert "0 contaminated pairs (0 of 2 training tasks) against 3 evaluation tasks" in capsys.readouterr().out


HELPER = ("import json\n\ndef load_ledger(path):\n    rows = json.load(open(path))\n"
          "    return {r['id']: r['amount'] for r in rows}\n")


def test_boilerplate_is_evidence_below_the_common_count(tmp_path: Path) -> None:
    """A task-specific helper all three evaluation tasks hold is boilerplate by frequency, and counts once it is no
    longer common (`--common 4`); the set-up Dockerfile and test.sh never count, by content, at any count."""
    evals, train = _eval_set(tmp_path / "eval"), _disjoint_train(tmp_path / "train")
    for d in [*evals.iterdir(), train / "rename"]:
        (d / "tests" / "helpers.py").write_text(HELPER)
    assert check_dirs(find_task_dirs(train), [evals]) == []
    found = check_dirs(find_task_dirs(train), [evals], common=4)
    assert {(Path(o.train).name, o.kind, o.evidence) for o in found} == {("rename", "file", "tests/helpers.py")}
    assert len({(o.train, o.eval) for o in found}) == 3  # one training task against every evaluation task


GENERIC_FILES = {
    "tests/test.sh": TEST_SH,
    "run-tests.sh": "#!/bin/bash\n\nsource $TEST_DIR/setup-uv-pytest.sh\nbash $TEST_DIR/run-uv-pytest.sh",
    "tests/test.sh ": "#!/usr/bin/env bash\n# Harbor entry point\ncd \"$(dirname \"$0\")\"\nmkdir -p /logs/verifier\n"
                      "if python3 -m pytest -q -p no:cacheprovider test_*.py; then r=1; else r=0; fi\n"
                      "echo \"$r\" > /logs/verifier/reward.txt\n",
    "tests/test.sh  ": "#!/bin/bash\napt-get update\napt-get install -y curl\ncurl -LsSf https://astral.sh/uv/0.9.5/"
                       "install.sh | sh\nsource $HOME/.local/bin/env\nif [ \"$PWD\" = \"/\" ]; then\n    echo \"Error: "
                       "No working directory set.\"\n    exit 1\nfi\nuvx \\\n  -p 3.13 \\\n  -w pytest==8.4.1 \\\n"
                       "  pytest "
                       "--ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\nif [ $? -eq 0 ]; then\n  echo 1 > "
                       "/logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n",
    "environment/Dockerfile": "FROM debian:bookworm\nRUN apt-get update && apt-get install -y --no-install-recommends "
                              "python3 git \\\n    && rm -rf /var/lib/apt/lists/*\nCOPY data.csv /app/data.csv\n"
                              "WORKDIR /app\n",
    "solution/solve.sh": "#!/bin/bash\nset -euo pipefail\necho done\n",
    "tests/requirements.txt": "pytest==8.4.1\n",
    "tests/expected.txt": "1\n",
}
SPECIFIC_FILES = {
    "solution/solve.sh": "#!/bin/bash\nset -e\ntr -cs 'A-Za-z' '\\n' < /app/text.txt | sort | uniq -c "
                         "> /app/top3.txt\n",
    "solution/solve.sh ": "#!/bin/bash\necho 'hello world' > /app/out.txt\n",
    "environment/Dockerfile": "FROM debian:bookworm\nRUN useradd -m alice && chmod 0700 /home/alice\nWORKDIR /app\n",
    "tests/test.sh": "#!/bin/bash\npytest /tests\ngrep -q 'quarterly ledger' /app/unmatched.txt\n",
    "data/ACCOUNTS.DAT": "U001John Doe            0000001180U002Jane Smith          0000001800U003Bob Wilson   00",
    "tests/test_outputs.py": "def test_out():\n    assert open('/app/out.txt').read() == 'hello world'\n",
}


@pytest.mark.parametrize("rel,text", list(GENERIC_FILES.items()))
def test_set_up_files_carry_no_task_content(rel: str, text: str) -> None:
    assert not task_specific(rel.strip(), text.encode()), rel


@pytest.mark.parametrize("rel,text", list(SPECIFIC_FILES.items()))
def test_task_files_carry_task_content(rel: str, text: str) -> None:
    assert task_specific(rel.strip(), text.encode()), rel


def test_two_task_eval_set_sharing_a_runner_and_a_base_dockerfile_passes(tmp_path: Path) -> None:
    """Two evaluation tasks (below any frequency rule) sharing only the runner and the base Dockerfile with the
    training tasks: no pair. A renamed copy of one of them, or its test file, still is one."""
    evals = tmp_path / "eval"
    for name in ("ledger", "maze"):
        test = f"def test_{name}():\n    assert open('/app/{name}.out').read().split() == ['{name}', 'ok']\n"
        _task(evals, name, EVAL_INSTRUCTIONS[name], test)
    train = _disjoint_train(tmp_path / "train")
    assert check_dirs(find_task_dirs(train), [evals]) == []
    shutil.copytree(evals / "maze", train / "maze-renamed")
    copied = (evals / "ledger" / "tests" / "test_outputs.py").read_text()
    _task(train, "copycat", "Count the vowels of /app/words.txt and write the number to /app/count.txt.", copied)
    found = check_dirs(find_task_dirs(train), [evals])
    assert {(Path(o.train).name, Path(o.eval).name, o.kind) for o in found} == {
        ("maze-renamed", "maze", "span"), ("maze-renamed", "maze", "jaccard"), ("maze-renamed", "maze", "file"),
        ("copycat", "ledger", "file")}


def _fixed(root: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        shutil.copytree(ROOT / "tasks" / "fixed" / name, root / name)
    return root


BUILTIN_TRAIN, BUILTIN_EVAL = ("text-word-frequency", "text-dedupe-emails"), ("python-primes", "data-csv-to-json")
"""The split of issue 58: they share only the generic tests/test.sh runner."""


def test_builtin_split_sharing_only_the_runner_passes(tmp_path: Path) -> None:
    from sandbox.tasks.overlap import find_overlaps
    from sandbox.tasks.format import load_task_dirs

    train, evals = _fixed(tmp_path / "A", BUILTIN_TRAIN), _fixed(tmp_path / "B", BUILTIN_EVAL)
    shared = set(read_task(train / BUILTIN_TRAIN[0]).files) & set(read_task(evals / BUILTIN_EVAL[0]).files)
    assert shared == set()  # test.sh is identical (below) but carries no task content
    assert (train / BUILTIN_TRAIN[0] / "tests" / "test.sh").read_bytes() == (
        evals / BUILTIN_EVAL[0] / "tests" / "test.sh").read_bytes()
    assert check_dirs(find_task_dirs(train), [evals]) == []
    assert find_overlaps(load_task_dirs(train), load_task_dirs(evals)) == []


def test_policies_refuse_warn_drop(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """refuse: one line naming the pair, the file and the rule, and the other policies; warn keeps every task;
    drop keeps those that overlap nothing."""
    from sandbox.tasks.overlap import check_disjoint
    from sandbox.tasks.format import load_task_dirs

    evals = _eval_set(tmp_path / "eval")
    train = _disjoint_train(tmp_path / "train")
    _task(train, "copycat", "Count the vowels of /app/words.txt and write the number to /app/count.txt.",
          (evals / "maze" / "tests" / "test_outputs.py").read_text())
    tasks, held = load_task_dirs(train), load_task_dirs(evals)
    with pytest.raises(ValueError) as e:
        check_disjoint(tasks, held, train_what="A", held_out_what="B")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("B overlaps A: 1 of its 3 tasks match training tasks (maze ~ copycat "
                                               "(identical task-specific file tests/test_outputs.py))"), msg
    assert "tasks.decontaminate='drop'" in msg and "'warn'" in msg
    assert [t.name for t in check_disjoint(tasks, held, train_what="A", held_out_what="B", policy="warn")] == [
        t.name for t in tasks]
    kept = check_disjoint(tasks, held, train_what="A", held_out_what="B", policy="drop")
    assert sorted(t.name for t in kept) == ["primes", "rename"]
    out = capsys.readouterr().out
    assert "decontaminate (warn): B overlaps A" in out and "decontaminate (drop): " in out and "['copycat']" in out


def test_planted_paraphrase_with_a_13_token_span_is_found(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    evals, train = _eval_set(tmp_path / "eval"), _disjoint_train(tmp_path / "train")
    # A reworded "maze" that keeps one 13-token stretch, with other case, punctuation and line breaks.
    _task(train, "labyrinth", "Your job: read the labyrinth from /app/grid.txt. FINDS the shortest path\nfrom S to "
          "E, using only horizontal and vertical moves -- then report it.", "def test_l():\n    assert 2\n")
    # The same with a token changed at each end of the stretch: 12 tokens in common, below the span.
    _task(train, "labyrinth12", "Your job: read the labyrinth from /app/grid.txt. Find the shortest path\nfrom S "
          "to E, using only horizontal and vertical steps -- then report it.", "def test_l():\n    assert 3\n")
    found = check_dirs(find_task_dirs(train), [evals])
    assert [(Path(o.train).name, Path(o.eval).name, o.kind, o.evidence) for o in found] == [
        ("labyrinth", "maze", "span", "txt finds the shortest path from s to e using only horizontal and")]
    # Independent reference: the longest common run of normalized tokens, by brute force.
    mine = normalize((train / "labyrinth12" / "instruction.md").read_text())
    theirs = normalize(EVAL_INSTRUCTIONS["maze"])
    assert read_task(train / "labyrinth12").tokens == mine
    longest = max(k for k in range(1, 20) if ngrams(mine, k) & ngrams(theirs, k))
    assert longest == 12
    assert main([str(train), "--against", str(evals)]) == 1
    assert "1 contaminated pairs (1 of 4 training tasks)" in capsys.readouterr().out


def test_jaccard_threshold(tmp_path: Path) -> None:
    """A reordering shares no 13-token span but most 5-token shingles; the reported similarity is |A & B| / |A | B|."""
    evals, train = _eval_set(tmp_path / "eval"), tmp_path / "train"
    a = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    b = "lambda mu nu xi omicron pi rho sigma tau upsilon"
    _task(evals, "greek", f"{a} {b}", "def test_g():\n    pass\n")
    _task(train, "greek2", f"{b} {a}", "def test_h():\n    pass\n")
    shingles = [ngrams(normalize(t), 5) for t in (f"{a} {b}", f"{b} {a}")]
    expected = len(shingles[0] & shingles[1]) / len(shingles[0] | shingles[1])
    assert expected == 12 / 20  # 16 shingles each, the 6 inside each half shared
    found = check_dirs(find_task_dirs(train), [evals], jaccard=0.6)
    assert [(o.kind, o.evidence) for o in found] == [("jaccard", f"{expected:.2f}")]
    assert check_dirs(find_task_dirs(train), [evals], jaccard=0.61) == []


def test_copied_tests_are_found_in_either_layout(tmp_path: Path) -> None:
    """A Harbor training task with an evaluation task's test file, and a TB1 one with its data file."""
    evals = _eval_set(tmp_path / "eval")
    _task(evals, "data", "Sum the second column of /app/data.tsv and print the total.", "def test_d():\n    pass\n",
          {"environment/data.tsv": DATA_TSV})
    train = _disjoint_train(tmp_path / "train")
    copied = (evals / "maze" / "tests" / "test_outputs.py").read_text()
    _task(train, "copycat", "Count the vowels of /app/words.txt and write the number to /app/count.txt.", copied)
    tb1 = train / "tb1-copy"
    tb1.mkdir()
    (tb1 / "task.yaml").write_text("instruction: |\n  Average the numbers in /app/numbers.tsv.\n")
    (tb1 / "data.tsv").write_text(DATA_TSV)
    found = check_dirs(find_task_dirs(train), [evals])
    assert sorted((Path(o.train).name, Path(o.eval).name, o.kind, o.evidence) for o in found) == [
        ("copycat", "maze", "file", "tests/test_outputs.py"),
        ("tb1-copy", "data", "file", "data.tsv = environment/data.tsv")]


def test_instances_of_one_family_count_once(tmp_path: Path) -> None:
    """Three generated instances of one family that copied one evaluation test file: still contamination."""
    evals, train = _eval_set(tmp_path / "eval"), tmp_path / "train"
    copied = (evals / "cert" / "tests" / "test_outputs.py").read_text()
    for i in range(3):
        d = _task(train, f"fam-{i}", f"Instance {i}: list the files of /app/dir{i}.", copied)
        (d / "task.toml").write_text(TOML + '[metadata]\nfamily = "listing"\n')
    assert len(check_dirs(find_task_dirs(train), [evals])) == 3


def test_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    evals = _eval_set(tmp_path / "eval")
    (tmp_path / "empty").mkdir()
    for args, message in (([str(tmp_path / "nope"), "--against", str(evals)], "nope: not a directory"),
                          ([str(evals), "--against", str(tmp_path / "empty")], "empty: no task directories"),
                          ([str(evals), "--against", str(evals), "--jaccard", "0"], "jaccard: expected")):
        r = subprocess.run([sys.executable, "-m", "sandbox.decontaminate", *args], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 2 and r.stdout == "", (args, r)
        assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def _collection(var: str) -> Path:
    path = os.environ.get(var, "")
    if not path or not Path(path).is_dir():
        pytest.skip(f"${var} does not name a checkout of the collection (see docs/lab-notes-terminal-bench.md)")
    return Path(path)


TB_SAME_NAME = frozenset(
    "chess-best-move cobol-modernization configure-git-webserver count-dataset-tokens crack-7z-hash extract-elf "
    "extract-moves-from-video feal-differential-cryptanalysis feal-linear-cryptanalysis fix-git git-multibranch "
    "gpt2-codegolf hf-model-inference kv-store-grpc make-doom-for-mips make-mips-interpreter nginx-request-logging "
    "openssl-selfsigned-cert password-recovery path-tracing path-tracing-reverse polyglot-c-py polyglot-rust-c "
    "prove-plus-comm pytorch-model-cli pytorch-model-recovery qemu-alpine-ssh qemu-startup raman-fitting "
    "reshard-c4-data sanitize-git-repo sqlite-db-truncate sqlite-with-gcov train-fasttext write-compressor".split())
TB_CROSS = frozenset({("feal-differential-cryptanalysis", "feal-linear-cryptanalysis"),
                      ("feal-linear-cryptanalysis", "feal-differential-cryptanalysis"),
                      ("make-doom-for-mips", "make-mips-interpreter"), ("make-mips-interpreter", "make-doom-for-mips"),
                      ("polyglot-c-py", "polyglot-rust-c"), ("polyglot-rust-c", "polyglot-c-py")})
"""TB1 against TB2, measured 2026-12-06 on the sources in the module docstring (issue 58): 41 pairs, 35 TB1 tasks
TB2 took over under the same name and 6 pairs across names; the same before and after the content rule."""


def test_terminal_bench_2_reuses_terminal_bench_1() -> None:
    """TB2 took several tasks over from TB1: the check sees exactly those pairs (and no task twice)."""
    tb1, tb2 = _collection("T1_TB1_TASKS"), _collection("T1_TB2_TASKS")
    found = check_dirs(find_task_dirs(tb1), [tb2])
    pairs = {(Path(o.train).name, Path(o.eval).name) for o in found}
    assert pairs == {(n, n) for n in TB_SAME_NAME} | TB_CROSS


def test_trainer_refuses_training_tasks_that_overlap(tmp_path: Path) -> None:
    """tasks.decontaminate_against: a fixed training task copied into the evaluation set stops the run in one line
    (exit 2) at the config check; the built-in suite against the fixtures above passes it."""
    import shutil

    evals = _eval_set(tmp_path / "eval")
    shutil.copytree(ROOT / "tasks" / "fixed" / "git-merge-branch", evals / "copied")
    (evals / "copied" / "instruction.md").write_text("A different instruction altogether, about nothing else.\n")
    small = ["--tasks.num_per_family=1", "--tasks.num_rl_per_family=0", "--tasks.num_heldout_per_family=0"]
    from t1core.config_checks import check_config
    from t1core.config_toml import load_config

    check_config(load_config(None, [*small, f"--tasks.decontaminate_against=[\"{tmp_path / 'eval' / 'maze'}\"]"]))
    r = subprocess.run([sys.executable, "-m", "t1core.train", "--out", str(tmp_path / "run"), *small,
                        f"--tasks.decontaminate_against=[\"{evals}\"]"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert f"tasks.decontaminate_against '{evals}' overlaps the training tasks: 1 of its 4 tasks" in r.stderr, r.stderr
    assert "copied ~ git-merge-branch (identical task-specific file" in r.stderr, r.stderr
    assert "tasks.decontaminate='drop'" in r.stderr, r.stderr


@pytest.mark.docker
@pytest.mark.slow
def test_trainer_trains_and_evaluates_on_the_builtin_split(tmp_path: Path) -> None:
    """Issue 58: `t1core.train --tasks.source=A --eval.source=B` on the split above starts, trains and evaluates B
    before and after RL (it was refused for the shared runner)."""
    from tests.test_train import TINY

    train, evals = _fixed(tmp_path / "A", BUILTIN_TRAIN), _fixed(tmp_path / "B", BUILTIN_EVAL)
    r = subprocess.run([sys.executable, "-m", "t1core.train", "--out", str(tmp_path / "run"), *TINY,
                        f"--tasks.source={train}", f"--eval.source={evals}", "--run.steps=1", "--eval.attempts=0"],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for tag in ("before", "after"):
        lines = (tmp_path / "run" / "eval" / tag / "B_greedy.jsonl").read_text().splitlines()
        assert len(lines) == len(BUILTIN_EVAL), lines


def test_load_tasks_applies_the_policy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """t1core.tasks.load_tasks: a training directory holding a renamed copy of an evaluation task refuses the run
    (one line naming the pair and the rule), trains on everything with 'warn', and without the copy with 'drop'."""
    from t1core.tasks import load_tasks
    from t1core.config_toml import load_config

    train, evals = _fixed(tmp_path / "A", BUILTIN_TRAIN), _fixed(tmp_path / "B", BUILTIN_EVAL)
    shutil.copytree(evals / BUILTIN_EVAL[0], train / "primes-renamed")
    base = [f"--tasks.source={train}", f"--eval.source={evals}"]
    with pytest.raises(ValueError, match=r"primes-renamed \(same instruction\).*tasks.decontaminate='drop'"):
        load_tasks(load_config(None, base), tmp_path / "run0")
    warned = load_tasks(load_config(None, [*base, "--tasks.decontaminate=warn"]), tmp_path / "run1")
    dropped = load_tasks(load_config(None, [*base, "--tasks.decontaminate=drop"]), tmp_path / "run2")
    assert sorted(t.name for t in warned.train) == sorted([*BUILTIN_TRAIN, "primes-renamed"])
    assert sorted(t.name for t in dropped.train) == sorted(BUILTIN_TRAIN) == sorted(t.name for t in dropped.rl)
    assert "decontaminate (drop): " in capsys.readouterr().out
