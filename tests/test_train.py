"""The trainer end to end on tiny settings: real sandboxes, real model, real verifiers.

Resume: 4 RL steps straight and 2 steps + `--resume` + 2 more give bitwise-identical policy and critic (with the
KL penalty on, so the resumed run must also reload its anchor policy).
Episodes run one at a time (concurrency 1) so that the engine's batch composition, and with it every
floating-point sum, is the same in both runs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from t1core import cli, train
from t1core.checkpoint.save import load_checkpoint
from t1core.config_toml import config_to_toml, load_config
from t1core.update import _step
from tests.machine import needs_docker

docker = pytest.importorskip("docker")


TINY = ["--rollout.episodes_per_step=2", "--rollout.group_size=2", "--rollout.concurrency=1",
        "--rollout.max_turns=2",
        "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=640", "--algo.minibatch_tokens=1400",
        "--warmstart.pretrain_steps=0", "--warmstart.sft_epochs=0", "--warmstart.critic_steps=1",
        "--run.checkpoint_every=2",
        "--optim.lr_actor=1e-3",
        "--algo.kl_coef=0.1",  # KL on: resume must reload the anchor policy too
        "--algo.actor_push=center",  # two episodes often score alike; the test needs actor updates
        # The untrained model uses every turn, so every episode is cut at max_turns=2: scored where it stopped, its
        # (forced or real) reward reaches the update; bootstrapped (the default), the critic's value would replace it.
        "--algo.cut_episodes=terminal"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sandbox.tasks.suite import family_tasks
    from sandbox.tasks.families import SHORT_FAMILIES

    out = tmp_path_factory.mktemp("tasks")
    family_tasks(out, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    return out


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(run_dir / "checkpoints", restore_rng=False)
    return {**{f"policy.{k}": v for k, v in ckpt["policy"].items()},
            **{f"critic.{k}": v for k, v in ckpt["critic"].items()}}


@pytest.mark.docker
@needs_docker
def test_resume_continues_bit_for_bit(tmp_path: Path, task_dir: Path, capsys) -> None:
    # Extending run.steps on resume would move the end of the decayed RL rate (optim.lr_decay): constant here;
    # the crash test below resumes with the decay on.
    common = [f"--tasks.source={task_dir}", *TINY, "--optim.lr_decay=false"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(["--out", str(straight), "--run.steps=4", *common]) == 0
    printed = capsys.readouterr().out  # a line per metrics row, also when stdout is no terminal (no bars then)
    assert "warm start:" in printed and "rl step 1/4: reward" in printed and "critic only" in printed
    assert "rl step 4/4: reward" in printed and "actor+critic, KL to warm start" in printed
    assert train.main(["--out", str(split), "--run.steps=2", *common]) == 0
    assert train.main(["--resume", str(split), "--run.steps=4"]) == 0

    a, b = _state(straight), _state(split)
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"resumed run differs in {differing[:5]}"
    # The run really trained: the actor moved away from its initialisation after the critic-only step.
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows}
    assert steps[0]["train/actor_updated"] == 0.0 and steps[3]["train/actor_updated"] == 1.0
    assert steps[3]["tito/drift_tokens"] == 0.0 and steps[3]["tito/prefix_checks"] > 0
    # Every run directory has what the issue lists.
    for name in ("config.toml", "metrics.jsonl", "metrics.png", "final/config.json", "final/tokenizer.json",
                 "warmstart/tokenizer.json", "trajectories/step_0003"):
        assert (straight / name).exists(), name

    # A saved checkpoint starts a new run as it is: its warm start (SFT off) is the loaded policy, bit for bit.
    again = tmp_path / "again"
    assert train.main(["--out", str(again), "--run.steps=1", f"--model.name={straight / 'final'}", *common]) == 0
    assert (again / "warmstart" / "model.safetensors").read_bytes() == \
        (straight / "final" / "model.safetensors").read_bytes()


@pytest.mark.docker
@needs_docker
def test_concurrent_episodes_are_bit_for_bit_with_the_batch_invariant_engine(tmp_path: Path, task_dir: Path) -> None:
    """Two runs with 4 episodes in flight at once: which rows the engine batches together depends on sandbox
    timing, and with `rollout.batch_invariant` nothing downstream may depend on it (`t1kernels.rows`)."""
    common = [f"--tasks.source={task_dir}", *TINY, "--rollout.episodes_per_step=4", "--rollout.concurrency=4",
              "--rollout.batch_invariant=true", "--run.steps=2", "--run.checkpoint_every=0"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert train.main(["--out", str(first), *common]) == 0
    assert train.main(["--out", str(second), *common]) == 0
    a, b = _state(first), _state(second)
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"the second run differs in {differing[:5]}"
    from t1core.checkpoint.save import load_checkpoint
    rng = [load_checkpoint(d / "checkpoints", restore_rng=False)["rng_states"] for d in (first, second)]
    assert repr(rng[0]) == repr(rng[1])  # the global generators too (seeded by the trainer)
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (first, second)]
    gaps = [[r.get("mismatch/gap") for r in run] for run in rows]
    assert gaps[0] == gaps[1] and any(g is not None for g in gaps[0])


class _Crash(RuntimeError):
    pass


@pytest.mark.docker
@needs_docker
def test_resume_after_a_crash_continues_bit_for_bit(tmp_path: Path, task_dir: Path, monkeypatch) -> None:
    """A run killed after its step-2 checkpoint and resumed as it was (defaults: decayed RL rate) ends where a
    straight run ends."""
    common = [f"--tasks.source={task_dir}", *TINY, "--run.steps=4"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert train.main(["--out", str(straight), *common]) == 0
    step_fn = train.Trainer.train_step

    def crash_at_2(self, step: int):
        if step == 2:
            raise _Crash("simulated crash")
        return step_fn(self, step)

    monkeypatch.setattr(train.Trainer, "train_step", crash_at_2)
    with pytest.raises(_Crash):
        train.main(["--out", str(crashed), *common])
    monkeypatch.setattr(train.Trainer, "train_step", step_fn)
    assert train.main(["--resume", str(crashed)]) == 0
    a, b = _state(straight), _state(crashed)
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"resumed run differs in {differing[:5]}"
    drawn = [[json.loads(p.read_text())["task_name"] for p in sorted((d / "trajectories").glob("step_*/*.json"))]
             for d in (straight, crashed)]
    assert drawn[0] == drawn[1] and len(drawn[0]) == 8


@pytest.mark.docker
@needs_docker
def test_a_step_of_flat_groups_leaves_the_actor_alone(tmp_path: Path, task_dir: Path, monkeypatch) -> None:
    """Rewards forced to [1, 1, 2, 2]: two instances, each sampled twice, each group scoring alike. The step is not
    flat (1 != 2), but no group says which of its actions were better: under algo.actor_push='group_positive' the
    actor takes no step (the critic still does); under 'center' it moves on the critic's error."""
    monkeypatch.setattr(train.Trainer, "rewards", lambda self, trajs: [1.0, 1.0, 2.0, 2.0][:len(trajs)])
    common = [f"--tasks.source={task_dir}", *TINY, "--rollout.episodes_per_step=4", "--run.steps=2",
              "--run.checkpoint_every=0"]
    moved = {}
    for skip in (True, False):
        out = tmp_path / f"skip_{skip}"
        rule = "group_positive" if skip else "center"
        assert train.main(["--out", str(out), *common, f"--algo.actor_push={rule}"]) == 0
        rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
        assert rows[1]["train/flat_step"] == 0.0
        assert rows[1]["train/actor_updated"] == (0.0 if skip else 1.0)
        assert rows[1].get("train/flat_group_episode_frac") == (1.0 if skip else None)
        moved[skip] = ((out / "final" / "model.safetensors").read_bytes()
                       != (out / "warmstart" / "model.safetensors").read_bytes())
    assert moved == {True: False, False: True}


FROZEN = '--optim.actor_frozen=["lm_head.*", "*.mlp.gate.*"]'


def _warm_final_frozen(run_dir: Path) -> tuple[dict, dict, list[str]]:
    """The run's warm-start and final HF weights, and the names FROZEN matches among them."""
    from safetensors.torch import load_file

    warm = load_file(run_dir / "warmstart" / "model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    return warm, final, [k for k in final if k == "lm_head.weight" or ".mlp.gate." in k]


@pytest.mark.docker
@needs_docker
def test_actor_frozen_parameters_stay_as_warm_started(tmp_path: Path, task_dir: Path) -> None:
    """optim.actor_frozen: SFT still trains the LM head and the routers, RL leaves them bit for bit as the warm
    start had them, and moves the rest of the policy."""
    from t1model.model import ModelConfig, MoEModel

    out = tmp_path / "frozen"
    args = ["--out", str(out), f"--tasks.source={task_dir}", *TINY, "--run.steps=3", "--run.checkpoint_every=0",
            "--warmstart.sft_epochs=1", FROZEN]
    assert train.main(args) == 0
    init = MoEModel(ModelConfig.tiny(), seed=0).state_dict()
    warm, final, frozen = _warm_final_frozen(out)
    assert len(frozen) == 1 + ModelConfig.tiny().num_hidden_layers
    assert all(not torch.equal(warm[k], init[k]) for k in frozen)  # SFT trained them
    assert all(torch.equal(final[k], warm[k]) for k in frozen)  # RL did not
    moved = [k for k in final if k not in frozen and not torch.equal(final[k], warm[k])]
    assert "model.embed_tokens.weight" in moved and any(".self_attn." in k for k in moved)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("train/actor_updated") == 1.0 for r in rows)


def test_actor_frozen_pattern_that_matches_nothing_is_an_error() -> None:
    from t1core.optimizer import frozen_parameters
    from t1model.model import ModelConfig, MoEModel

    model = MoEModel(ModelConfig.tiny().replace(num_hidden_layers=1), seed=0)
    assert frozen_parameters(model, ["lm_head.*"]) == ["lm_head.weight"]
    with pytest.raises(ValueError, match=r"optim.actor_frozen: \['lm_hed.\*'\] match no parameter"):
        frozen_parameters(model, ["lm_head.*", "lm_hed.*"])
    with pytest.raises(ValueError, match="optim.actor_frozen: expected non-empty patterns"):
        load_config(None, ['--optim.actor_frozen=[""]'])


def test_actor_lr_decay_follows_the_rl_step() -> None:
    from t1core.optimizer import make_optimizer, refresh_lr

    cfg = load_config(None, ["--optim.warmup_steps=4", "--optim.lr_decay=true"])
    done = {"frac": 0.0}
    opt, sched = make_optimizer(torch.nn.Linear(2, 2), lr=1e-3, cfg=cfg, progress=lambda: done["frac"])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # warmup step 1 of 4
    opt.step()
    sched.step()
    done["frac"] = 0.75
    refresh_lr(sched)  # the trainer calls this at each RL step
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 / 4 * 0.25)


def test_nonfinite_loss_skips_the_step() -> None:
    lin = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in lin.parameters()]
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    metrics: dict[str, list[float]] = defaultdict(list)
    loss = lin(torch.ones(1, 3)).sum() * float("nan")
    _step(loss, list(lin.parameters()), opt, None, 1.0, "policy", metrics)
    assert metrics["skipped/policy_nonfinite_loss"] == [1.0]
    assert all(torch.equal(p, q) for p, q in zip(before, lin.parameters()))
    # A finite loss does step.
    _step(lin(torch.ones(1, 3)).sum(), list(lin.parameters()), opt, None, 1.0, "policy", metrics)
    assert not all(torch.equal(p, q) for p, q in zip(before, lin.parameters()))


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown key algo.nope"):
        cli.parse_args(["--algo.nope=1"])
    with pytest.raises(ValueError, match="config overrides look like --section.key=value"):
        cli.parse_args(["stray"])
    with pytest.raises(ValueError, match="--config /nonexistent/run.toml: no such file"):
        cli.parse_args(["--config", "/nonexistent/run.toml"])


def test_resume_keeps_the_saved_config(tmp_path: Path) -> None:
    """--resume continues under the run's config.toml, changed only by command-line overrides; an --out elsewhere
    or a --config file (whose settings the resume would drop) are errors, and so is a directory that is no run."""
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match="no config.toml there"):
        cli.parse_args(["--resume", str(run)])
    (run / "config.toml").write_text(config_to_toml(load_config(None, ["--run.steps=3", "--run.seed=7"])))
    cfg, run_dir = cli.parse_args(["--resume", str(run), "--run.steps=5"])
    assert run_dir == run and cfg.run.steps == 5 and cfg.run.seed == 7
    assert cli.parse_args(["--resume", str(run)])[0] == dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, steps=3))
    other = tmp_path / "other.toml"
    other.write_text("[run]\nseed = 3\n")
    cases = {"stays in its own directory": ["--resume", str(run), "--out", str(tmp_path / "elsewhere")],
             "keeps its saved config.toml": ["--resume", str(run), "--config", str(other)]}
    for message, argv in cases.items():
        with pytest.raises(ValueError, match=message):
            cli.parse_args(argv)


def test_an_unusable_cuda_device_fails_before_any_work(tmp_path: Path, capsys) -> None:
    from t1model.device import check_device

    check_device(torch.device("cpu"))
    out = tmp_path / "run"
    if torch.cuda.is_available():
        bad = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(SystemExit):
            train.main(["--out", str(out), f"--run.device={bad}"])
        assert re.search(rf"run.device='{bad}': torch sees \d+ CUDA device", capsys.readouterr().err)
    else:
        with pytest.raises(SystemExit):
            train.main(["--out", str(out), "--run.device=cuda"])
        assert re.search(r"run.device='cuda': .*; use run.device='cpu'", capsys.readouterr().err)
    assert not out.exists()  # no run directory, no tasks written, no images built


def test_vllm_engine_without_vllm_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Checked from the installed distributions, before anything is built (no traceback, no run directory)."""
    from importlib import metadata

    from t1core.config_checks import check_config

    try:
        pytest.skip(f"vLLM {metadata.version('vllm')} is installed here")
    except metadata.PackageNotFoundError:
        pass
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "t1core.train", "--out", str(out), "--rollout.engine=vllm"],
                          capture_output=True, text=True, timeout=300, cwd=Path(train.__file__).parents[1])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "rollout.engine='vllm' but vLLM is not installed here: pip install -e '.[gpu]' (CUDA), bash "
        "scripts/setup_vllm_cpu.sh (CPU), or rollout.engine='torch'")
    assert not out.exists()
    cfg = load_config(None, ["--rollout.engine=vllm", "--rollout.temperature=0.005"])
    with pytest.raises(ValueError, match=r"rollout.temperature=0.005: vLLM raises"):  # checked before vLLM's presence
        check_config(cfg)


def test_the_trainer_file_stays_the_loop() -> None:
    """Issue 59: t1core/train.py is at most 250 lines and re-exports nothing (tests import from the owners)."""
    text = Path(train.__file__).read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert text.count("noqa: F401") == 1  # the cpu_threads import, which must come first


@pytest.mark.parametrize("preset", sorted((Path(train.__file__).parent / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_presets_load(preset: Path) -> None:
    cfg = load_config(str(preset), [])
    if preset.stem.endswith("_cpu"):  # a preset anyone runs on a CPU box: exact on-policy log-probs
        assert cfg.run.device == "cpu" and cfg.model.dtype == "float32" and cfg.algo.bitwise == "on"
    else:
        assert cfg.run.device == "cuda" and cfg.model.dtype == "bfloat16"


def test_drift_check_sees_an_altered_sampled_token() -> None:
    from rollout.engine import SamplingParams
    from rollout.trajectory import Trajectory, Turn
    from t1core.drift import CompletionLog
    from t1model.tokenizer import ChatTokenizer, format_tool_call
    from t1core.warmstart import ReferenceEngine

    tok = ChatTokenizer.builtin()
    prompt = tok.encode_prompt("sys", "Create /app/a.txt")
    log = CompletionLog(ReferenceEngine(tok, {tuple(prompt): [format_tool_call("touch /app/a.txt")]}))
    reply = log.submit(prompt, SamplingParams()).result().token_ids

    def traj(ids: list[int]) -> Trajectory:
        mask = torch.tensor([False] * len(prompt) + [True] * len(reply))
        return Trajectory(token_ids=torch.tensor(ids), loss_mask=mask, rollout_logprobs=torch.zeros(len(ids)),
                          routing=None, prompt_len=len(prompt), task_name="t", finish_reason="done",
                          policy_version=0, turns=[Turn(start=len(prompt), end=len(ids), finish_reason="stop",
                                                        text="")])

    assert log.drift(traj(prompt + reply)) == 0
    altered = list(reply)
    altered[2] = (altered[2] + 1) % tok.vocab_size
    assert log.drift(traj(prompt + altered)) == 1
    log.clear()
    assert log.drift(traj(prompt + reply)) == len(reply)  # nothing recorded: every token unverified


@pytest.mark.docker
@needs_docker
def test_heldout_evaluation_is_greedy_and_sampled_with_the_same_seeds_before_and_after(tmp_path: Path,
                                                                                       capsys) -> None:
    # No RL step between the two evaluations: the same policy, instances and sampling seeds must give the same
    # episodes, so the paired change is exactly 0 (an evaluation that drew other seeds or instances after RL would
    # show a change here).
    run = tmp_path / "run"
    args = ["--out", str(run), "--run.steps=0", "--eval.attempts=2", "--tasks.families=[\"create_file\"]",
            "--tasks.num_per_family=1", "--tasks.num_rl_per_family=1", "--tasks.num_heldout_per_family=3",
            *[a for a in TINY if not a.startswith("--run.checkpoint_every")]]
    assert train.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    before, after = rows[-1], rows[0]
    assert before["eval/builtin/family_episodes"] == 3 and before["eval/builtin/family_sampled_episodes"] == 6
    assert not any(k.endswith(("greedy_change", "sampled_change")) for k in before)
    for kind in ("greedy", "sampled"):
        p = f"eval/builtin/{kind}_change"
        assert after[p] == after[f"{p}_lo"] == after[f"{p}_hi"] == 0.0 and after[f"{p}_instances"] == 3
        assert after[f"{p}_verifier_before"] == after[f"{p}_verifier_after"]
    assert after["eval/builtin/sampled_change_samples"] == 2
    for name in ("family", "family_sampled"):
        a, b = (sorted((run / "trajectories" / f"eval_{tag}_{name}").glob("*.json")) for tag in ("before", "after"))
        assert len(a) == len(b) == 3 * (1 + (name == "family_sampled"))
        for x, y in zip(a, b):
            assert x.with_suffix(".safetensors").read_bytes() == y.with_suffix(".safetensors").read_bytes()
    # The run ends with the comparison, the time budget, then the run directory.
    assert lines[-2].startswith("time per phase (wall/CPU s): ")
    lines = lines[:-2] + lines[-1:]
    assert lines[-3].startswith("held-out success, greedy: ") and "over 3 instances" in lines[-3]
    assert lines[-2].startswith("held-out success, sampled (mean of 2 at T=1)") and lines[-1] == str(run.resolve())


def test_builtin_rl_instances_are_unseen_by_sft_and_heldout(tmp_path: Path) -> None:
    from t1core.tasks import load_tasks

    fams = "--tasks.families=[\"create_file\", \"count_lines\"]"
    cfg, _ = cli.parse_args([fams, "--tasks.num_per_family=3", "--tasks.num_rl_per_family=5",
                               "--tasks.num_heldout_per_family=4"])
    sets = load_tasks(cfg, tmp_path)
    family = sets.rl  # by default RL practises unseen family instances only
    assert len(family) == 10 and all("-train-" in t.name for t in family)
    instructions = [{t.instruction for t in ts if t.name.split("-")[0] in ("create_file", "count_lines")}
                    for ts in (sets.train, family, sets.heldout_family)]
    assert [len(s) for s in instructions] == [6, 10, 8]  # no repeat within a set either
    assert not (instructions[0] & instructions[1]) and not (instructions[2] & (instructions[0] | instructions[1]))
    # On request the fixed train tasks are practised in RL too; 0 RL instances means RL on the SFT instances.
    with_fixed = load_tasks(cli.parse_args([fams, "--tasks.num_per_family=3", "--tasks.num_rl_per_family=5",
                                            "--tasks.fixed_tasks=rl"])[0], tmp_path / "c")
    assert [t.name for t in with_fixed.rl] == [t.name for t in family] + [t.name for t in sets.train[6:]]
    cfg0, _ = cli.parse_args([fams, "--tasks.num_per_family=3", "--tasks.num_rl_per_family=0"])
    same = load_tasks(cfg0, tmp_path / "b")
    assert [t.name for t in same.rl] == [t.name for t in same.train]


def _torchrun(args: list[str]) -> None:
    """`torchrun --nproc_per_node=2 -m t1core.train ARGS` (2 gloo ranks, FSDP2); fails with the ranks' output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "t1core.train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data-parallel: 2 ranks" in proc.stdout


@pytest.mark.torchrun
@pytest.mark.docker
@needs_docker
def test_data_parallel_run_resumes_bit_for_bit(tmp_path: Path, task_dir: Path) -> None:
    """Under torchrun: 4 steps straight and 2 + `--resume` + 2 end with the same sharded-then-gathered policy,
    critic and optimizer state (a checkpoint gathers the shards; resume scatters them back)."""
    common = [f"--tasks.source={task_dir}", *TINY, "--optim.lr_decay=false", "--algo.minibatch_tokens=700"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _torchrun(["--out", str(straight), "--run.steps=4", *common])
    _torchrun(["--out", str(split), "--run.steps=2", *common])
    _torchrun(["--resume", str(split), "--run.steps=4"])
    a, b = _state(straight), _state(split)
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"resumed data-parallel run differs in {differing[:5]}"
    from t1core.checkpoint.save import load_checkpoint
    opt = [load_checkpoint(d / "checkpoints", restore_rng=False)["optimizers"]["actor"]["state"]
           for d in (straight, split)]
    assert opt[0].keys() == opt[1].keys() and opt[0]
    for name in opt[0]:
        assert all(torch.equal(opt[0][name][k], opt[1][name][k]) for k in ("exp_avg", "exp_avg_sq")), name
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows}
    assert steps[3]["train/actor_updated"] == 1.0 and steps[3]["tito/drift_tokens"] == 0.0
    for name in ("metrics.png", "final/model.safetensors", "warmstart/model.safetensors", "trajectories/step_0003"):
        assert (straight / name).exists(), name


@pytest.mark.torchrun
@pytest.mark.docker
@needs_docker
def test_data_parallel_run_keeps_frozen_parameters(tmp_path: Path, task_dir: Path) -> None:
    """optim.actor_frozen under two FSDP2 ranks: the frozen tensors (sharded DTensors with requires_grad off) stay
    bit for bit as warm-started while the rest of the policy moves."""
    out = tmp_path / "frozen_dp"
    _torchrun(["--out", str(out), f"--tasks.source={task_dir}", *TINY, "--run.steps=3", "--run.checkpoint_every=0",
               FROZEN])
    warm, final, frozen = _warm_final_frozen(out)
    assert frozen and all(torch.equal(final[k], warm[k]) for k in frozen)
    assert not torch.equal(final["model.embed_tokens.weight"], warm["model.embed_tokens.weight"])


@pytest.mark.torchrun
@pytest.mark.docker
@needs_docker
def test_data_parallel_rollouts_equal_a_single_process(tmp_path: Path, task_dir: Path) -> None:
    """Two ranks each run half of a step's episodes on their own engine: with the batch-invariant engine the
    gathered trajectories equal a single process's, token for token, log-prob and routing bits included (steps 0
    and 1: step 0 only trains the critic, so both sample from the same policy)."""
    from rollout.trajectory import load_trajectories

    common = [f"--tasks.source={task_dir}", *TINY, "--rollout.episodes_per_step=4", "--rollout.batch_invariant=true",
              "--run.steps=2", "--run.checkpoint_every=0"]
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    assert train.main(["--out", str(single), *common]) == 0
    _torchrun(["--out", str(ranks), *common])
    for step in ("step_0000", "step_0001"):
        a, b = (load_trajectories(d / "trajectories" / step) for d in (single, ranks))
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            assert x.task_name == y.task_name
            assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.loss_mask, y.loss_mask)
            assert torch.equal(x.rollout_logprobs, y.rollout_logprobs) and torch.equal(x.routing, y.routing)
            assert x.reward == y.reward


@pytest.mark.torchrun
@pytest.mark.docker
@needs_docker
def test_data_parallel_sft_transcripts_equal_a_single_process(tmp_path: Path) -> None:
    """Each rank runs every other task's reference solution (3 tasks: 2 on rank 0, 1 on rank 1); the gathered
    transcripts equal one process's, in task order, token for token."""
    from rollout.trajectory import load_trajectories
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks

    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=3, seed=0, families=list(SHORT_FAMILIES)[:1])
    common = [f"--tasks.source={tasks}", *TINY, "--warmstart.sft_epochs=1",
              "--rollout.max_new_tokens_per_turn=384", "--rollout.max_tokens=2048", "--algo.minibatch_tokens=2048",
              "--run.steps=1",
              "--run.checkpoint_every=0"]
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    assert train.main(["--out", str(single), *common]) == 0
    _torchrun(["--out", str(ranks), *common])
    a, b = (load_trajectories(d / "trajectories" / "sft") for d in (single, ranks))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x.task_name == y.task_name and x.finish_reason == y.finish_reason == "done"
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.loss_mask, y.loss_mask)
    rows = [json.loads((d / "metrics.jsonl").read_text().splitlines()[0]) for d in (single, ranks)]
    assert rows[0]["sft/transcripts"] == rows[1]["sft/transcripts"] == 3.0

