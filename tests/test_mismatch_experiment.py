"""The TITO / R3 mismatch experiment: its parts against independent references, and a small real run (real
Docker sandboxes, the real bf16 TorchEngine, the real tokenizer, an untrained tiny policy)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rollout.engine import SamplingParams
from rollout.tito import retokenization_drift
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory, Turn, load_trajectories
from t1core.drift import CompletionLog
from t1cli.experiments.mismatch import (CONDITIONS, ROLLOUT, MismatchConfig, MismatchResult, _parse_args,
                                         _routing_counts,
                                         format_table, loss_region_drift, router_choices, run_experiment)
from t1core.losses import routing_agreement
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer


def _traj(prompt: list[int], turns: list[list[int]], between: list[int]) -> Trajectory:
    """prompt, reply 1, `between`, reply 2, `between`, ..., last reply (no routing: not needed here)."""
    ids, spans = list(prompt), []
    for n, reply in enumerate(turns):
        if n:
            ids += between
        spans.append(Turn(start=len(ids), end=len(ids) + len(reply), finish_reason="stop", text=""))
        ids += reply
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for t in spans:
        mask[t.start:t.end] = True
    return Trajectory(token_ids=torch.tensor(ids), loss_mask=mask, rollout_logprobs=torch.zeros(len(ids)),
                      routing=None, prompt_len=len(prompt), turns=spans, task_name="t", finish_reason="done",
                      policy_version=0)


def test_loss_region_drift_counts_differences_against_the_record() -> None:
    prompt, r1, r2, obs = [1, 2, 3], [10, 11, 12], [13, 14], [4, 5]
    tito = _traj(prompt, [r1, r2], obs)
    record = {tuple(prompt): [r1], tuple(prompt + r1 + obs): [r2]}
    assert loss_region_drift(tito, tito, record) == 0
    assert loss_region_drift(_traj(prompt, [r1, [13, 15]], obs), tito, record) == 1       # one substitution
    assert loss_region_drift(_traj(prompt, [[10, 99, 98, 12], r2], obs), tito, record) == 2  # 1 token -> 2
    assert loss_region_drift(_traj(prompt, [r1], obs), tito, record) == len(r2)            # a lost turn
    assert loss_region_drift(tito, tito, {tuple(prompt): [r1]}) == len(r2)                  # never sampled
    # A prompt sampled twice (same task, two episodes): the closest record is the reference.
    twice = {**record, tuple(prompt): [[7, 7, 7], r1]}
    assert loss_region_drift(tito, tito, twice) == 0


def test_router_choices_and_routing_counts() -> None:
    model = MoEModel(ModelConfig.tiny(), seed=3).eval()
    ids_T = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), router_choices(model) as picks:
        _, routing_TLK = model(ids_T, return_routing=True)
    own_TLK = torch.stack(picks, dim=1)
    num_pairs = own_TLK.shape[0] * own_TLK.shape[1]
    assert _routing_counts(own_TLK, routing_TLK) == (num_pairs, num_pairs, 0, 37)
    # Replay experts the router did not pick on the last layer only: the layers before run unchanged, so that
    # layer's own pick is still the original one and disagrees with the replayed ids on every token.
    orig_TK = routing_TLK[:, -1].long()
    alt_TK = torch.tensor([[e for e in range(4) if e not in row][:2] for row in orig_TK.tolist()])
    forced_TLK = routing_TLK.clone()
    forced_TLK[:, -1] = alt_TK.to(forced_TLK.dtype)
    with torch.no_grad(), router_choices(model) as picks:
        model(ids_T, replay_routing=forced_TLK)
    under_replay_TLK = torch.stack(picks, dim=1)
    assert torch.equal(under_replay_TLK, own_TLK)
    agree, pairs, flipped, tokens = _routing_counts(under_replay_TLK, forced_TLK)
    assert agree / pairs == pytest.approx(float(routing_agreement(under_replay_TLK, forced_TLK)))
    assert agree == num_pairs - 37
    assert flipped == tokens == 37


def test_recording_engine_keeps_what_the_engine_returned() -> None:
    model = MoEModel(ModelConfig.tiny(), seed=0)
    prompts = [[5, 6, 7], [8, 9]]
    with TorchEngine(model, EngineConfig(max_batch=2, num_slots=2, max_seq_len=32)) as engine:
        rec = CompletionLog(engine)
        comps = rec.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))
    assert rec.policy_version == 0
    assert dict(rec.sampled) == {tuple(p): [c.token_ids] for p, c in zip(prompts, comps)}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[MismatchResult, list[Trajectory]]:
    tmp = Path(tmp_path_factory.mktemp("mismatch"))
    cfg = MismatchConfig(num_episodes=2, seeds=(0,), families=("create_file", "append_line"), sft_epochs=0,
                         rollout=dataclasses.replace(ROLLOUT, max_turns=2, max_new_tokens_per_turn=24, max_tokens=512,
                                                     concurrency=2),
                         work_dir=str(tmp / "tasks"), trajectories_dir=str(tmp / "trajectories"))
    result = run_experiment(cfg)
    return result, load_trajectories(tmp / "trajectories")


@pytest.mark.docker
def test_small_run_drift_and_gap_ordering(small_run: tuple[MismatchResult, list[Trajectory]]) -> None:
    result, trajs = small_run
    rows = result.rows
    assert set(rows) == set(CONDITIONS) and result.episodes["episodes"] == 2
    assert result.episodes["sandbox_errors"] == 0 and result.episodes["turns"] >= 3
    # TITO: the trainer scores exactly the tokens the engine returned.
    assert rows["tito"]["drift_tokens"] == 0 and rows["tito_r3"]["drift_tokens"] == 0
    # Re-tokenization changes these replies (an independent measure, rollout.tito's, agrees) -> (a) drifts.
    tok = ChatTokenizer.builtin()
    assert sum(retokenization_drift(t, tok).num_drifted for t in trajs) > 0
    assert rows["retokenized"]["drift_tokens"] > 0
    # The bf16 engine's routing really differs from the fp32 trainer's somewhere ...
    assert rows["tito"]["routing_flips"] > 0 and rows["tito"]["routing_agreement"] < 1
    # ... and replaying it brings the trainer closer to what was sampled.
    assert rows["tito_r3"]["gap"] <= rows["tito"]["gap"] < rows["retokenized"]["gap"]
    b, c = rows["tito"], rows["tito_r3"]
    if b["loss_tokens_flipped"] > 0:  # where the routing flipped, replay is what closes the gap
        assert c["mean_abs_d_flipped"] < b["mean_abs_d_flipped"]
    assert 0 < rows["tito_r3"]["gap"] < 0.1 and rows["tito"]["loss_tokens"] == result.episodes["sampled_tokens"]
    # (d): the fp32 batch-invariant engine's own episodes under the bitwise forward: not small, zero.
    d = rows["bitwise"]
    assert d["loss_tokens"] > 0 and d["gap"] == 0.0 and d["max_abs"] == 0.0 and d["drift_tokens"] == 0
    assert d["routing_agreement"] == 1.0
    table = format_table(result)
    assert all(label in table for label in CONDITIONS.values())


def test_the_episodes_are_set_as_the_trainer_sets_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The experiment's [rollout] preset, then a trainer's --config file, then --rollout.key=value flags; anything
    else is one line, exit 2."""
    cfg, _ = _parse_args([])
    assert cfg.rollout == ROLLOUT and cfg.rollout.max_turns == 3 and not cfg.rollout.batch_invariant
    trainer = tmp_path / "run.toml"
    trainer.write_text("[rollout]\nmax_turns = 5\ntemperature = 0.7\n[algo]\ngamma = 0.9\n")
    cfg, _ = _parse_args(["--config", str(trainer), "--rollout.max_turns=2"])
    assert cfg.rollout == dataclasses.replace(ROLLOUT, max_turns=2, temperature=0.7)
    for argv, said in ((["--max-turns", "2"], "unrecognised arguments ['--max-turns', '2']"),
                       (["--rollout.temperature=0"], "rollout.temperature: expected > 0"),
                       (["--algo.gamma=0.5"], "unknown section 'algo'")):
        with pytest.raises(SystemExit) as e:
            _parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and said in err[0], err
