"""Trajectory validation and save/load; TITO assembly (glue, routing stitching) on engine completions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.engine import Completion, SamplingParams
from rollout.tito import TitoBuilder, glue_ids, sampled_drift
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory, Turn, load_trajectories, save_trajectories
from t1model.model import ModelConfig, MoEModel

IM_END, NL = 7, 8
TURN_END = [IM_END, NL]


def _traj(n: int = 10, *, with_routing: bool = True) -> Trajectory:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[4:7] = True
    logp = torch.where(mask, -torch.rand(n), torch.zeros(n))
    routing = torch.randint(0, 16, (n, 3, 2), dtype=torch.uint8) if with_routing else None
    return Trajectory(token_ids=torch.arange(n) * 3, loss_mask=mask, rollout_logprobs=logp, routing=routing,
                      prompt_len=4, turns=[Turn(start=4, end=7, finish_reason="stop", text="ls", command="ls",
                                                output="a\nb", exit_code=0)],
                      task_name="t", finish_reason="done", policy_version=3, reward=2.0,
                      verifier={"passed": 2, "total": 3}, metrics={"turns": 1.0}, system_prompt="sys",
                      instruction="do it")


def test_trajectory_validation() -> None:
    t = _traj()
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(**{**t.__dict__, "loss_mask": t.loss_mask[:-1]})
    with pytest.raises(ValueError, match="routing"):
        Trajectory(**{**t.__dict__, "routing": t.routing[:-1]})
    with pytest.raises(ValueError, match="outside the loss mask"):
        Trajectory(**{**t.__dict__, "rollout_logprobs": t.rollout_logprobs - 1})
    with pytest.raises(ValueError, match="turns' sampled spans"):
        Trajectory(**{**t.__dict__, "turns": []})
    with pytest.raises(ValueError, match="int64"):
        Trajectory(**{**t.__dict__, "token_ids": t.token_ids.int()})


def test_save_load_roundtrip(tmp_path: Path) -> None:
    trajs = [_traj(10), _traj(13, with_routing=False)]
    save_trajectories(trajs, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000000.json", "000000.safetensors",
                                                         "000001.json", "000001.safetensors"]
    back = load_trajectories(tmp_path)
    for a, b in zip(trajs, back):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert (a.routing is None and b.routing is None) or torch.equal(a.routing, b.routing)
        assert a.turns == b.turns and a.verifier == b.verifier and a.metrics == b.metrics
        assert (a.task_name, a.reward, a.policy_version, a.prompt_len) == (b.task_name, b.reward, b.policy_version,
                                                                           b.prompt_len)
    with pytest.raises(ValueError, match="no trajectories"):
        load_trajectories(tmp_path / "empty")


def test_glue_ids() -> None:
    assert glue_ids([5, 6, IM_END], "stop", TURN_END) == [NL]
    assert glue_ids([5, 6, 9], "length", TURN_END) == TURN_END
    assert glue_ids([5, 6, 2], "stop", TURN_END) == TURN_END  # stopped on another eos id: close the turn fully


def test_tito_builder_with_engine_prefix_reuse() -> None:
    """Three turns through a real engine with prefix reuse: the trajectory's routing equals the routing the
    model gives the whole sequence, its loss region is exactly what was sampled, and each prompt extends the
    previous turn's IDs."""
    cfg = ModelConfig.tiny().replace(num_hidden_layers=2)
    model = MoEModel(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    builder = TitoBuilder(torch.randint(10, 4000, (20,), generator=g).tolist())
    sampled: list[list[int]] = []
    with TorchEngine(model, EngineConfig(max_batch=2, num_slots=2, max_seq_len=256)) as eng:
        for turn in range(3):
            prompt = builder.next_prompt()
            comp = eng.submit(prompt, SamplingParams(max_new_tokens=6 + turn, seed=turn)).result()
            assert turn == 0 or comp.num_cached_tokens == len(builder.ids)
            builder.add_reply(prompt, comp, text="")
            sampled.append(comp.token_ids)
            builder.add_observation(glue_ids(comp.token_ids, comp.finish_reason, TURN_END),
                                    torch.randint(10, 4000, (5,), generator=g).tolist())
        with pytest.raises(AssertionError, match="TITO prefix broken"):
            builder.add_reply(prompt, comp, text="")
    traj = builder.build(task_name="x", finish_reason="max_turns", policy_version=0)
    assert traj.num_tokens == 20 + (6 + 7 + 8) + 2 * (2 + 5)
    assert sampled_drift(traj, sampled).num_drifted == 0
    assert traj.rollout_logprobs[traj.loss_mask].lt(0).all()
    with torch.no_grad():
        _, own = model(traj.token_ids, return_routing=True)
    assert (own == traj.routing).float().mean() > 0.99


def test_completion_validation() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        Completion(token_ids=[1, 2], logprobs=torch.zeros(3), routing=None, finish_reason="stop")
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(token_ids=[1], logprobs=torch.zeros(1), routing=None, finish_reason="eos")  # type: ignore[arg-type]


def _transcript(tok, replies: list[list[int]], outputs: list[str]) -> Trajectory:
    """A TITO trajectory of given reply token paths (each ending with <|im_end|>) and command outputs."""
    builder = TitoBuilder(tok.encode_prompt("You are an agent in a shell.", "Create /app/x.txt containing hello."))
    for i, ids in enumerate(replies):
        prompt = builder.next_prompt()
        comp = Completion(token_ids=ids, logprobs=-torch.ones(len(ids)), routing=None, finish_reason="stop")
        builder.add_reply(prompt, comp, text=tok.decode(ids[:-1]))
        if i < len(outputs):
            builder.set_turn_result(command="cmd", output=outputs[i], exit_code=0, tool_error=None)
            builder.add_observation(glue_ids(ids, "stop", tok.assistant_turn_end_ids()),
                                    tok.encode_tool_response(outputs[i]))
    return builder.build(task_name="x", finish_reason="done", policy_version=0,
                         system_prompt="You are an agent in a shell.", instruction="Create /app/x.txt containing hello.")


def test_retokenization_drift_vs_tito() -> None:
    """Naive re-tokenization reproduces canonical token paths but not the other paths a sampling model takes
    (here: words split into smaller pieces, as sampling at temperature 1 does); TITO keeps them exactly."""
    from rollout.tito import retokenization_drift
    from t1model.tokenizer import ChatTokenizer, format_tool_call

    tok = ChatTokenizer.builtin()
    texts = ["I'll look first.\n" + format_tool_call("ls -la /app"), format_tool_call("echo hello > /app/x.txt"),
             "The file is there. TASK_DONE"]
    outputs = ["total 0\ndrwxr-xr-x 2 root root 40 .\n", ""]
    canonical = [tok.encode(t) + [tok.im_end_id] for t in texts]
    traj = _transcript(tok, canonical, outputs)
    assert retokenization_drift(traj, tok).num_drifted == 0
    assert sampled_drift(traj, canonical).num_drifted == 0

    def pieces(text: str) -> list[int]:  # a valid but non-canonical path: each character encoded alone
        return [i for ch in text for i in tok.encode(ch)]
    sampled = [pieces("I'll look first.\n") + tok.encode(format_tool_call("ls -la /app")) + [tok.im_end_id],
               canonical[1], pieces("The file is there. ") + tok.encode("TASK_DONE") + [tok.im_end_id]]
    assert tok.decode(sampled[0]) == tok.decode(canonical[0])  # same text, other ids
    traj = _transcript(tok, sampled, outputs)
    report = retokenization_drift(traj, tok)
    assert report.num_drifted > 0 and report.num_turns_drifted == 2
    assert sampled_drift(traj, sampled).num_drifted == 0
