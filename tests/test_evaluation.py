"""Evaluation on benchmark directories: the overlap guard, the scorecard's numbers, the trainer's before/after
report (eval.source) and `python -m rollout.evaluate` with resume. Real sandboxes, real verifiers, the real tiny
model; the benchmark (tests/benchmark_tasks.py) resolves the same tasks whatever the policy does, so the rates
and intervals are known: 1 of 3 tasks, interval [0, 1], verifier fraction 1/2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rollout import evaluate, scorecard
from rollout.report import bootstrap_interval
from sandbox.tasks.overlap import check_disjoint, find_overlaps
from sandbox.tasks.format import load_task_dirs
from t1core import train
from t1core.config_toml import load_config
from t1core.metrics import progress_line
from tests.benchmark_tasks import BENCHMARK, write_benchmark, write_task
from tests.test_train import TINY, needs_docker


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks

    out = tmp_path_factory.mktemp("train_tasks")
    family_tasks(out, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    return out


def test_overlap_by_name_and_by_normalized_instruction(tmp_path: Path, train_dir: Path) -> None:
    train = load_task_dirs(train_dir)
    bench = load_task_dirs(write_benchmark(tmp_path / "bench"))
    assert find_overlaps(train, bench) == []
    check_disjoint(train, bench, train_what="A", held_out_what="B")  # disjoint: no error
    # A renamed copy whose instruction differs only in case and spacing, and a same-named task.
    t = train[0]
    respaced = "  " + t.instruction.upper().replace(" ", "\n  ")
    write_task(tmp_path / "b2", "renamed", respaced, "def test_x():\n    pass\n")
    write_task(tmp_path / "b2", train[1].name, "Something else entirely.", "def test_x():\n    pass\n")
    found = find_overlaps(train, load_task_dirs(tmp_path / "b2"))
    assert {(o.train, o.held_out, o.why) for o in found} == {(t.name, "renamed", "same instruction"),
                                                             (train[1].name, train[1].name, "same name")}
    with pytest.raises(ValueError, match=r"^B overlaps A: 2 of its 2 tasks match training tasks") as e:
        check_disjoint(train, load_task_dirs(tmp_path / "b2"), train_what="A", held_out_what="B")
    assert "\n" not in str(e.value)


def test_trainer_refuses_an_eval_source_that_overlaps_tasks_source(tmp_path: Path, train_dir: Path, capsys) -> None:
    copy = tmp_path / "bench"
    write_benchmark(copy, ("probe-os",))
    shutil.copytree(next(p for p in sorted(train_dir.iterdir()) if p.is_dir()), copy / "renamed-copy")
    with pytest.raises(SystemExit) as e:
        train.main(["--out", str(tmp_path / "run"), f"--tasks.source={train_dir}", f"--eval.source={copy}", *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"eval.source '{copy}' overlaps tasks.source=" in err[0], err
    assert "renamed-copy ~ " in err[0] and "(same instruction)" in err[0]


def test_scorecard_rates_interval_and_table() -> None:
    recs = [{"task": t, "attempt": a, "resolved": ok, "passed": p, "total": 2, "turns": 1, "tokens": 10, "time_s": 1.0,
             "finish": "done", "why": "" if ok else "x"}
            for t, a, ok, p in [("a", 0, True, 2), ("a", 1, False, 1), ("b", 0, False, 0), ("b", 1, False, 0),
                                ("c", 0, True, 2), ("c", 1, True, 2)]]
    s = scorecard.summarize(recs)
    assert s["tasks"] == 3 and s["attempts"] == 2
    assert s["resolved_rate"] == pytest.approx((0.5 + 0 + 1) / 3)  # mean of task rates, not of attempts
    assert s["verifier_frac"] == pytest.approx((0.75 + 0 + 1) / 3)
    # The interval by hand: a resample of three tasks is all b (mean 0) or all c (mean 1) with probability 1/27 each,
    # more than 2.5%, so the 95% percentile interval is exactly [0, 1]; with 30 tasks it is far narrower.
    assert (s["ci_low"], s["ci_high"]) == (0.0, 1.0)
    lo, hi = bootstrap_interval([0.5, 0.0, 1.0] * 10)
    assert 0.2 < lo < 0.5 < hi < 0.8
    rows = scorecard.task_table(recs)
    assert [(r["task"], r["resolved"], r["rate"], r["tests_passed"]) for r in rows] == [
        ("a", 1, 0.5, 1.5), ("b", 0, 0.0, 0.0), ("c", 2, 1.0, 2.0)]
    tsv = scorecard.format_table(rows, sep="\t").splitlines()
    assert tsv[0].split("\t") == list(scorecard.COLUMNS) and tsv[2].split("\t")[-1] == "x"


def test_a_row_that_evaluated_nothing_says_so() -> None:
    assert progress_line({"step": -1, "eval/tasks": 0.0}, total_steps=2) == "warm start: nothing evaluated"
    cfg = load_config(None, ["--tasks.source=/tmp", "--eval.source=builtin"])
    from t1core.tasks import nothing_reason
    assert "pass --eval.source=DIR" in nothing_reason(cfg)
    assert nothing_reason(load_config(None, ["--eval.source=[]"])) == "eval.source is empty"


@pytest.mark.docker
@needs_docker
def test_tiny_run_reports_the_benchmark_before_and_after_rl(tmp_path: Path, train_dir: Path, capsys) -> None:
    bench = write_benchmark(tmp_path / "B")
    # probe-os's own agent timeout (task.toml) is near zero: its episodes end at once (the run's own
    # rollout.wall_clock_limit_s is 120 s); the verifier still runs and resolves it.
    toml = bench / "probe-os" / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 110.0", "timeout_sec = 0.001"))
    run = tmp_path / "run"
    args = ["--out", str(run), f"--tasks.source={train_dir}", f"--eval.source={bench}", "--run.steps=1",
            "--eval.attempts=2", "--rollout.concurrency=3", "--run.checkpoint_every=0",
            *[a for a in TINY if not a.startswith(("--rollout.concurrency", "--run.checkpoint_every"))]]
    assert train.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    before, after = rows[-1], rows[1]
    for kind, attempts in (("greedy", 1), ("sampled", 2)):
        p = f"eval/B/{kind}"
        for row in (before, after):
            assert row[f"{p}_resolved"] == pytest.approx(1 / 3) and row[f"{p}_tasks"] == 3
            assert (row[f"{p}_resolved_lo"], row[f"{p}_resolved_hi"]) == (0.0, 1.0)
            assert row[f"{p}_verifier_frac"] == pytest.approx(0.5) and row[f"{p}_attempts"] == attempts
        assert f"{p}_change" not in before
        assert after[f"{p}_change"] == after[f"{p}_change_lo"] == after[f"{p}_change_hi"] == 0.0
        records = scorecard.read_records(run / "eval" / "after" / f"B_{kind}.jsonl")
        assert len(records) == 3 * attempts
        assert {r["finish"] for r in records if r["task"] == "probe-os"} == {"wall_clock"}
        assert all(r["turns"] >= 1 for r in records if r["task"] != "probe-os")
        table = (run / "eval" / "after" / f"B_{kind}.tsv").read_text().splitlines()
        assert [line.split("\t")[0] for line in table] == ["task", *sorted(BENCHMARK)]
    assert "B greedy resolved 33.3% [0.0%, 100.0%]" in next(x for x in lines if x.startswith("warm start:"))
    assert lines[-2].startswith("time per phase (wall/CPU s): ")  # the time budget, last before the run directory
    lines = lines[:-2] + lines[-1:]
    assert lines[-3].startswith("B resolved, greedy, over 3 tasks: 0.333 [0.000, 1.000] -> 0.333 [0.000, 1.000], "
                                "change +0.000 [+0.000, +0.000]")
    assert lines[-2].startswith("B resolved, sampled (2 attempts at T=1), over 3 tasks: ")
    assert lines[-1] == str(run.resolve()) and (run / "metrics.png").is_file()


@pytest.mark.docker
@needs_docker
def test_a_run_with_nothing_to_evaluate_says_so(tmp_path: Path, train_dir: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train.main(["--out", str(run), f"--tasks.source={train_dir}", "--run.steps=0", *TINY]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(x.startswith("evaluation: none (eval.source='builtin' is the built-in suite's held-out split")
               for x in lines)
    assert "warm start: nothing evaluated" in lines and "after RL: nothing evaluated" in lines
    assert lines[-2].startswith("evaluation: none (")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from t1model.hf_io import save_pretrained
    from t1model.model import ModelConfig, MoEModel
    from t1model.tokenizer import ChatTokenizer

    out = tmp_path_factory.mktemp("ckpt")
    save_pretrained(MoEModel(ModelConfig.tiny(), seed=0), out)
    ChatTokenizer.builtin().save_pretrained(out)
    return out


@pytest.mark.docker
@needs_docker
def test_evaluate_writes_its_report_and_resumes(tmp_path: Path, checkpoint: Path, capsys) -> None:
    bench, out = write_benchmark(tmp_path / "B"), tmp_path / "out"
    args = ["--checkpoint", str(checkpoint), "--tasks", str(bench), "--out", str(out), "--rollout.max_turns=2",
            "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=300", "--rollout.concurrency=3"]
    assert evaluate.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith(" attempts at T=0: 3 to run, 0 already done; " + f"{checkpoint} on torch (cpu), 3 at once")
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["resolved_rate"] == pytest.approx(1 / 3) and report["summary"]["tasks"] == 3
    assert [r["task"] for r in report["tasks"]] == sorted(BENCHMARK)
    assert (out / "tasks.tsv").read_text().splitlines()[0].split("\t") == list(scorecard.COLUMNS)
    assert printed[-1] == str((out / "report.json").resolve())
    # An interruption: the last attempt's record never made it, and a half-written line did.
    first = (out / "attempts.jsonl").read_text().splitlines()
    lost = json.loads(first[-1])
    (out / "attempts.jsonl").write_text("\n".join(first[:-1]) + "\n" + first[-1][:20])
    assert evaluate.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert ": 1 to run, 2 already done; " in printed[0]
    again = [json.loads(x) for x in (out / "attempts.jsonl").read_text().splitlines()]
    assert [json.loads(x) for x in first[:-1]] == again[:2]
    redone = again[2]  # greedy on the same seed: the same episode again
    assert {k: v for k, v in redone.items() if k != "time_s"} == {k: v for k, v in lost.items() if k != "time_s"}
    assert json.loads((out / "report.json").read_text())["summary"] == report["summary"]
    # Nothing left to do: no episode runs; other settings than the first run's are refused in one line.
    assert evaluate.main(args) == 0
    assert ": 0 to run, 3 already done; " in capsys.readouterr().out.splitlines()[0]
    with pytest.raises(SystemExit) as e:
        evaluate.main([*args, "--temperature", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an evaluation with temperature=0.0, not 1.0" in err[0]


@pytest.mark.docker
@needs_docker
def test_evaluate_leaves_infrastructure_failures_unscored_and_retries_them(tmp_path: Path, checkpoint: Path, capsys,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attempt placed on a Docker host that does not answer is unscored: nothing recorded, exit 1 with one
    line; the same command on a daemon that answers then runs them all, and nothing of the first try counts."""
    import sandbox.runtime.hosts
    monkeypatch.setattr(sandbox.runtime.hosts, "NO_HOST_WAIT_S", 0.5)  # a start gives up on the dead host at once
    bench, out = write_benchmark(tmp_path / "B", ("probe-os", "probe-flag")), tmp_path / "out"
    args = ["--checkpoint", str(checkpoint), "--tasks", str(bench), "--out", str(out), "--rollout.max_turns=2",
            "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=300", "--rollout.concurrency=2"]
    assert evaluate.main([*args, f"--sandbox.hosts=[unix://{tmp_path}/no-daemon.sock]"]) == 1
    io = capsys.readouterr()
    unscored = [line for line in io.out.splitlines() if "unscored (the infrastructure failed on every try" in line]
    assert len(unscored) == 2 and all("no Docker host answers" in line for line in unscored), io.out
    assert io.err.strip().splitlines() == ["evaluate: no attempt was scored: the infrastructure ended all 2 on every "
                                           "try; run the same command again to retry them"]
    assert (out / "attempts.jsonl").read_text() == "" and not (out / "report.json").exists()
    sandbox.runtime.hosts.use_hosts(())  # back to the local daemon for this process
    assert evaluate.main(args) == 0
    assert ": 2 to run, 0 already done; " in capsys.readouterr().out.splitlines()[0]
    records = scorecard.read_records(out / "attempts.jsonl")
    assert sorted(r["task"] for r in records) == ["probe-flag", "probe-os"] and not any(r["infra"] for r in records)
    report = json.loads((out / "report.json").read_text())
    assert report["unscored"] == [] and report["summary"]["unscored"] == 0.0


def test_infrastructure_failures_are_left_out_of_every_rate(tmp_path: Path) -> None:
    """rollout.report, rollout.scorecard and the trainer's held-out change leave an episode the infrastructure ended
    out of the rates and count it; against the same outcomes with those episodes removed by hand."""
    from rollout.report import family_table, load_samples, paired_change
    from rollout.trajectory import Trajectory, Turn, save_trajectory
    from t1core import evaluation

    def episode(task: str, passed: int, reason: str = "done") -> Trajectory:
        mask = torch.tensor([False, True])
        verified = not reason.startswith("infra")
        return Trajectory(token_ids=torch.arange(2), loss_mask=mask, rollout_logprobs=torch.zeros(2), routing=None,
                          prompt_len=1, turns=[Turn(start=1, end=2, finish_reason="stop", text="ls")], task_name=task,
                          finish_reason=reason, policy_version=0, reward=float(passed),
                          verifier={"passed": passed, "total": 2, "outcome": passed == 2} if verified else None,
                          metrics={}, system_prompt="s", instruction="i")

    dead = "infra: DaemonUnreachable: no Docker host answers (host0)"
    before = [episode("a-heldout-0", 0), episode("b-heldout-0", 2), episode("c-heldout-0", 0, dead)]
    after = [episode("a-heldout-0", 0, dead), episode("b-heldout-0", 2), episode("c-heldout-0", 2)]
    for tag, trajs in (("before", before), ("after", after)):
        for i, t in enumerate(trajs):
            save_trajectory(t, evaluation.eval_dir(tmp_path, tag, "greedy"), i)
    b, a = (load_samples(evaluation.eval_dir(tmp_path, tag, "greedy")) for tag in ("before", "after"))
    assert [s.infra for s in b] == [False, False, True]
    table = family_table(b)
    assert table["total"]["instances"] == 2 and table["total"]["unscored"] == 1
    assert "c" not in table  # a family with no scored episode drops out; the total counts its episode
    c = paired_change(a, b)
    assert (c["tasks"], c["change"], c["unscored"]) == (1, 0.0, 2)  # only b is scored on both sides
    m = evaluation.change_metrics(tmp_path, "after")
    assert m["eval/builtin/greedy_change_unscored"] == 2 and m["eval/builtin/greedy_change_instances"] == 1
    assert m["eval/builtin/greedy_change_verifier_before"] == 0.5 and m["eval/builtin/greedy_change_verifier_after"] == 1.0
    line = evaluation.builtin_lines(m, temperature=1.0)[0]
    assert line.endswith("; 2 episodes unscored (the infrastructure failed on every try)"), line
    recs = [scorecard.attempt_record(t, attempt=0) for t in after]
    assert [r["infra"] for r in recs] == [True, False, False] and recs[0]["why"] == dead
    s = scorecard.summarize(recs)
    assert (s["tasks"], s["resolved_rate"], s["unscored"]) == (2, 1.0, 1)
    assert [r["task"] for r in scorecard.task_table(recs)] == ["b-heldout-0", "c-heldout-0"]
    with pytest.raises(ValueError, match="no scored attempt"):
        scorecard.summarize(recs[:1])


def test_evaluate_serves_the_checkpoint_with_torch_or_vllm(checkpoint: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """rollout.engine picks the engine; both serve the checkpoint's weights (vLLM: the CPU fake of 0.33's AsyncLLM,
    tests/fake_vllm.py, which loads the directory it is given as vLLM would): the same greedy tokens."""
    from rollout import vllm_api
    from rollout.engine import SamplingParams
    from tests import fake_vllm

    monkeypatch.setattr(vllm_api, "load_vllm", fake_vllm.fake_api)
    base = ["--checkpoint", str(checkpoint), "--tasks", "unused", "--out", "unused", "--device", "cpu",
            "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=300"]
    tokens = {}
    for name, cls in (("torch", "TorchEngine"), ("vllm", "VLLMEngine")):
        engine, tok = evaluate.open_engine(*evaluate._parse_args([*base, f"--rollout.engine={name}"]))
        with engine:
            assert type(engine).__name__ == cls
            prompt = tok.encode_prompt("You are in a shell.", "List the files.")
            tokens[name] = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))[0].token_ids
    assert len(tokens["torch"]) == 6 and tokens["torch"] == tokens["vllm"]


def test_benchmarks_are_named_after_their_directories(tmp_path: Path, train_dir: Path) -> None:
    from t1core.config_checks import check_config
    from t1core.tasks import load_benchmarks

    a = write_benchmark(tmp_path / "x" / "B", ("probe-os",))
    b = write_benchmark(tmp_path / "y" / "B", ("probe-flag",))
    cfg = load_config(None, [f"--tasks.source={train_dir}", f"--eval.source=[{a}, {b}, builtin]"])
    got, kept = load_benchmarks(cfg, load_task_dirs(train_dir))
    assert [t.name for t in kept] == [t.name for t in load_task_dirs(train_dir)]
    assert {k: [t.name for t in v] for k, v in got.items()} == {"B": ["probe-os"], "B-2": ["probe-flag"]}
    write_benchmark(b, ("probe-os",))  # now in both directories
    with pytest.raises(ValueError, match=r"eval.source: task names \['probe-os'\] appear in more than one"):
        load_benchmarks(cfg, load_task_dirs(train_dir))
    with pytest.raises(ValueError, match="eval.source: expected 'builtin' or directories of tasks, got '/nope'"):
        check_config(load_config(None, ["--eval.source=/nope"]))
