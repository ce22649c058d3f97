"""sandbox.decontaminate: planted contamination is found, boilerplate is not, bad input is one line (exit 2).

Fixtures are written here; the run against the public Terminal-Bench collections skips when they are absent
($T1_TB1_TASKS, $T1_TB2_TASKS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.decontaminate import check_dirs, find_task_dirs, main, ngrams, normalize, read_task

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


def test_boilerplate_is_evidence_below_the_common_count(tmp_path: Path) -> None:
    """The same shared Dockerfile counts once it is no longer common: `--common 4` with 3 evaluation tasks."""
    evals, train = _eval_set(tmp_path / "eval"), _disjoint_train(tmp_path / "train")
    found = check_dirs(find_task_dirs(train), [evals], common=4)
    assert {(Path(o.train).name, o.kind, o.evidence) for o in found} >= {
        ("rename", "file", "environment/Dockerfile, tests/test.sh")}
    assert len({(o.train, o.eval) for o in found}) == 6  # every training task against every evaluation task


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
          {"environment/data.tsv": "a\t1\nb\t2\n"})
    train = _disjoint_train(tmp_path / "train")
    copied = (evals / "maze" / "tests" / "test_outputs.py").read_text()
    _task(train, "copycat", "Count the vowels of /app/words.txt and write the number to /app/count.txt.", copied)
    tb1 = train / "tb1-copy"
    tb1.mkdir()
    (tb1 / "task.yaml").write_text("instruction: |\n  Average the numbers in /app/numbers.tsv.\n")
    (tb1 / "data.tsv").write_text("a\t1\nb\t2\n")
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
        pytest.skip(f"${var} does not name a checkout of the collection (see EXPERIMENTS.md, issue 45)")
    return Path(path)


def test_terminal_bench_2_reuses_terminal_bench_1() -> None:
    """TB2 took several tasks over from TB1: the check must see them (and see no task twice)."""
    tb1, tb2 = _collection("T1_TB1_TASKS"), _collection("T1_TB2_TASKS")
    found = check_dirs(find_task_dirs(tb1), [tb2])
    same_name = {Path(o.train).name for o in found if Path(o.train).name == Path(o.eval).name}
    assert {"chess-best-move", "fix-git", "openssl-selfsigned-cert"} <= same_name


def test_trainer_refuses_training_tasks_that_overlap(tmp_path: Path) -> None:
    """tasks.decontaminate_against: a fixed training task copied into the evaluation set stops the run in one line
    (exit 2) at the config check; the built-in suite against the fixtures above passes it."""
    import shutil

    evals = _eval_set(tmp_path / "eval")
    shutil.copytree(ROOT / "tasks" / "fixed" / "git-merge-branch", evals / "copied")
    (evals / "copied" / "instruction.md").write_text("A different instruction altogether, about nothing else.\n")
    small = ["--tasks.num_per_family=1", "--tasks.num_rl_per_family=0", "--tasks.num_heldout_per_family=0"]
    from t1core.builders import check_config
    from t1core.config_toml import load_config

    check_config(load_config(None, [*small, f"--tasks.decontaminate_against=[\"{tmp_path / 'eval' / 'maze'}\"]"]))
    r = subprocess.run([sys.executable, "-m", "t1core.train", "--out", str(tmp_path / "run"), *small,
                        f"--tasks.decontaminate_against=[\"{evals}\"]"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "tasks.decontaminate_against: 1 pairs" in r.stderr and "git-merge-branch and" in r.stderr, r.stderr
