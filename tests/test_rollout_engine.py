"""Sampling and TorchEngine: seeded reproducibility, log-probs vs the full forward with replayed routing,
continuous batching vs requests run alone, prefix reuse, weight updates."""

from __future__ import annotations

import math
import time
import threading
from pathlib import Path

import pytest
import torch

from t1kernels.logprob import token_logprobs
from rollout.engine import Completion, Engine, SamplingParams, request_seed
from rollout.sampling import derive_seed, sample_tokens, uniform
from rollout.torch_engine import EngineConfig, TorchEngine
from t1model.hf_io import hf_state_dict
from t1model.model import ModelConfig, MoEModel

CFG = ModelConfig.tiny().replace(num_hidden_layers=2)


@pytest.fixture(scope="module")
def model() -> MoEModel:
    return MoEModel(CFG, seed=0)


def _prompts(n: int, *, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, CFG.vocab_size, (k,), generator=g).tolist() for k in lens]


# ---- sampling ----

def _reference_probs(logits_V: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """float64 nucleus distribution, written independently of rollout.sampling (loop over sorted tokens)."""
    p = torch.softmax(logits_V.double() / temperature, -1)
    out = torch.zeros_like(p)
    mass = 0.0
    for idx in torch.argsort(p, descending=True, stable=True).tolist():
        if mass >= top_p:
            break
        out[idx] = p[idx]
        mass += float(p[idx])
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_sampling_matches_reference_distribution(temperature: float, top_p: float) -> None:
    g = torch.Generator().manual_seed(1)
    logits_V = torch.randn(12, generator=g) * 2
    ref = _reference_probs(logits_V, temperature, top_p)
    n = 20000
    logits_BV = logits_V.expand(n, -1)
    u_B = torch.tensor([uniform(derive_seed(7, i), 0) for i in range(n)], dtype=torch.float64)
    tokens_B, logp_B = sample_tokens(logits_BV, temperature_B=torch.full((n,), temperature),
                                     top_p_B=torch.full((n,), top_p), uniform_B=u_B)
    freq = torch.bincount(tokens_B, minlength=12).double() / n
    assert torch.all(freq[ref == 0] == 0), "sampled a token outside the nucleus"
    # 5 sigma of a binomial proportion per token.
    sigma = torch.sqrt(ref * (1 - ref) / n)
    assert torch.all((freq - ref).abs() <= 5 * sigma + 1e-9), (freq, ref)
    # Reported log-probs: the full tempered distribution, no top-p renormalisation.
    full = torch.log_softmax(logits_V.double() / temperature, -1)
    torch.testing.assert_close(logp_B.double(), full[tokens_B], rtol=0, atol=1e-6)


def test_sampling_seeded_and_batch_independent() -> None:
    g = torch.Generator().manual_seed(2)
    logits_BV = torch.randn(6, 50, generator=g)
    seeds = [derive_seed(3, i) for i in range(6)]
    args = dict(temperature_B=torch.ones(6), top_p_B=torch.full((6,), 0.95))
    u = torch.tensor([uniform(s, 4) for s in seeds], dtype=torch.float64)
    a, la = sample_tokens(logits_BV, uniform_B=u, **args)
    b, lb = sample_tokens(logits_BV, uniform_B=u.clone(), **args)
    assert torch.equal(a, b) and torch.equal(la, lb)
    # Row 2 alone draws the same token as inside the batch.
    one, _ = sample_tokens(logits_BV[2:3], temperature_B=torch.ones(1), top_p_B=torch.full((1,), 0.95),
                           uniform_B=u[2:3])
    assert one.item() == a[2].item()
    # Greedy: argmax, log-prob at temperature 1.
    greedy, lg = sample_tokens(logits_BV, temperature_B=torch.zeros(6), top_p_B=torch.ones(6), uniform_B=u)
    assert torch.equal(greedy, logits_BV.argmax(-1))
    torch.testing.assert_close(lg, torch.log_softmax(logits_BV, -1).gather(1, greedy[:, None]).squeeze(1))
    assert len({uniform(s, 0) for s in seeds}) == 6 and 0 <= min(uniform(s, 9) for s in seeds) < 1


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1, 2])  # type: ignore[arg-type]


# ---- engine ----

def _full_forward_logprobs(model: MoEModel, prompt: list[int], comp: Completion, temperature: float) -> torch.Tensor:
    ids_T = torch.tensor(prompt + comp.token_ids)
    routing_TLK = torch.cat([comp.prompt_routing, comp.routing])
    assert comp.prompt_routing_start == 0 and routing_TLK.shape[0] == ids_T.shape[0]
    with torch.no_grad():
        hidden_TD = model(ids_T, replay_routing=routing_TLK)
    p = len(prompt)
    return token_logprobs(hidden_TD[p - 1:-1], model.lm_head.weight, ids_T[p:], temperature=temperature)


def test_the_engine_of_n_parallel_episodes_is_built_in_one_place() -> None:
    """`EngineConfig.for_parallel`: n decode at once over 2n slots (at least one); the trainer, rollout.collect,
    rollout.evaluate and the mismatch experiment all build their engine through it."""
    cfg = EngineConfig.for_parallel(3, max_seq_len=64, batch_invariant=True)
    assert (cfg.max_batch, cfg.num_slots, cfg.max_seq_len, cfg.batch_invariant) == (3, 6, 64, True)
    one = EngineConfig.for_parallel(0, max_seq_len=64)
    assert (one.max_batch, one.num_slots) == (1, 2)
    root = Path(__file__).resolve().parents[1]
    built = [str(p.relative_to(root)) for package in ("t1core", "rollout")
             for p in sorted((root / package).rglob("*.py")) if "EngineConfig(" in p.read_text()
             and p.name != "torch_engine.py"]
    assert built == [], built


def test_engine_logprobs_match_full_forward_with_replay(model: MoEModel) -> None:
    prompts = _prompts(5, seed=1)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=11)
    with TorchEngine(model, EngineConfig(max_batch=8, num_slots=8, max_seq_len=128, prefix_reuse=False)) as eng:
        assert isinstance(eng, Engine)
        comps = eng.generate(prompts, params)
    for prompt, comp in zip(prompts, comps):
        assert comp.routing.dtype == torch.uint8 and comp.routing.shape == (len(comp.token_ids), 2, 2)
        assert len(comp.token_ids) == 24 and comp.finish_reason == "length"
        ref = _full_forward_logprobs(model, prompt, comp, params.temperature)
        torch.testing.assert_close(comp.logprobs, ref, rtol=0, atol=2e-5)
        # The recorded routing is what the model picks by itself on the same ids (not a degenerate buffer).
        with torch.no_grad():
            _, own = model(torch.tensor(prompt + comp.token_ids), return_routing=True)
        recorded = torch.cat([comp.prompt_routing, comp.routing])
        assert (own == recorded).float().mean() > 0.99 and recorded.unique().numel() > 4


def test_continuous_batching_equals_alone(model: MoEModel) -> None:
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(max_new_tokens=8 + 5 * i, seed=100 + i, top_p=0.9) for i in range(6)]
    with TorchEngine(model, EngineConfig(max_batch=4, num_slots=6, max_seq_len=128, prefix_reuse=False)) as eng:
        alone = [eng.submit(p, sp).result() for p, sp in zip(prompts, params)]
    with TorchEngine(model, EngineConfig(max_batch=4, num_slots=6, max_seq_len=128, prefix_reuse=False)) as eng:
        # Staggered: more requests than max_batch, submitted from threads while others decode.
        futures: list = [None] * 6
        def go(i: int) -> None:
            futures[i] = eng.submit(prompts[i], params[i])
        threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batched = [f.result() for f in futures]
        assert eng.stats["steps"] < sum(len(c.token_ids) + 1 for c in alone)  # really ran together
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=2e-5)
        assert torch.equal(a.routing, b.routing)


def test_stop_tokens_and_generate_seeds(model: MoEModel) -> None:
    prompt = _prompts(1, seed=3)[0]
    with TorchEngine(model, EngineConfig(max_batch=2, num_slots=2, max_seq_len=64)) as eng:
        free = eng.submit(prompt, SamplingParams(max_new_tokens=12, seed=5)).result()
        stop = free.token_ids[4]
        cut = eng.submit(prompt, SamplingParams(max_new_tokens=12, seed=5, stop_token_ids=(stop,))).result()
        assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
        gen = eng.generate([prompt, prompt], SamplingParams(max_new_tokens=6, seed=5))
        one = eng.submit(prompt, SamplingParams(max_new_tokens=6, seed=request_seed(5, 1))).result()
        assert gen[1].token_ids == one.token_ids
        # Context limit: a reply stops with "length" when the slot is full.
        long_prompt = _prompts(1, seed=4, lo=60, hi=61)[0]
        full = eng.submit(long_prompt, SamplingParams(max_new_tokens=50, seed=5)).result()
        assert full.finish_reason == "length" and len(long_prompt) + len(full.token_ids) == 64
        with pytest.raises(ValueError, match="max_seq_len"):
            eng.submit(list(range(64)), SamplingParams())


def test_prefix_reuse_multi_turn_and_weight_update() -> None:
    model = MoEModel(CFG, seed=0)  # its own copy: update_weights loads into the engine's model
    params = SamplingParams(max_new_tokens=10, seed=9)
    turn1 = _prompts(1, seed=5)[0]
    extra = _prompts(1, seed=6)[0]
    cfg = EngineConfig(max_batch=2, num_slots=4, max_seq_len=256)
    with TorchEngine(model, cfg) as eng:
        c1 = eng.submit(turn1, params).result()
        turn2 = turn1 + c1.token_ids + extra
        c2 = eng.submit(turn2, params).result()
        assert c2.num_cached_tokens == len(turn1) + len(c1.token_ids)
        with TorchEngine(model, EngineConfig(max_batch=2, num_slots=4, max_seq_len=256, prefix_reuse=False)) as ref:
            r2 = ref.submit(turn2, params).result()
        assert r2.token_ids == c2.token_ids and r2.num_cached_tokens == 0
        torch.testing.assert_close(c2.logprobs, r2.logprobs, rtol=0, atol=2e-5)
        # Prompt routing of the cached part comes from the slot's history: it equals what turn 1 returned, and
        # (up to rare near-ties) a fresh run's.
        assert torch.equal(c2.prompt_routing[:c2.num_cached_tokens], torch.cat([c1.prompt_routing, c1.routing]))
        assert (c2.prompt_routing == r2.prompt_routing).float().mean() > 0.99
        # Incremental: only the tail asked for comes back.
        c2b = eng.submit(turn2, params.replace(prompt_routing_from=len(turn2) - 3)).result()
        assert c2b.prompt_routing_start == len(turn2) - 3 and torch.equal(c2b.prompt_routing, c2.prompt_routing[-3:])
        # A prompt sharing only a short part of a recent slot takes a free slot instead of truncating it ...
        other = turn1[:5] + extra
        assert eng.submit(other, params).result().num_cached_tokens == 0
        assert eng.submit(turn2, params).result().num_cached_tokens == len(turn2) - 1  # same prompt again

        new_model = MoEModel(CFG, seed=1)
        assert eng.update_weights(hf_state_dict(new_model).items()) == 1
        c3 = eng.submit(turn2, params).result()
        assert c3.num_cached_tokens == 0 and c3.policy_version == 1
        with TorchEngine(new_model, cfg) as ref:
            r3 = ref.submit(turn2, params).result()
        assert c3.token_ids == r3.token_ids
        assert not math.isclose(float(c3.logprobs[0]), float(c2.logprobs[0]))
    with TorchEngine(model, EngineConfig(max_batch=1, num_slots=1, max_seq_len=256)) as one_slot:
        c1 = one_slot.submit(turn1, params).result()
        # ... but when that slot is the one to evict anyway, its shared prefix is reused.
        c4 = one_slot.submit(other, params).result()
        assert c4.num_cached_tokens == 5 and torch.equal(c4.prompt_routing[:5], c1.prompt_routing[:5])


def test_update_weights_waits_for_running_requests() -> None:
    model = MoEModel(CFG, seed=0)
    prompt = _prompts(1, seed=7)[0]
    with TorchEngine(model, EngineConfig(max_batch=2, num_slots=2, max_seq_len=256)) as eng:
        running = eng.submit(prompt, SamplingParams(max_new_tokens=150, seed=1))
        while eng.stats["decode_tokens"] == 0:  # wait until it is decoding
            time.sleep(0.001)
        assert eng.update_weights(hf_state_dict(MoEModel(CFG, seed=3)).items()) == 1
        # The request running during the update finished with the old weights, all of it.
        assert running.done() and running.result().policy_version == 0 and len(running.result().token_ids) == 150
        after = eng.submit(prompt, SamplingParams(max_new_tokens=4, seed=1)).result()
        assert after.policy_version == 1 and after.num_cached_tokens == 0
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(prompt, SamplingParams())


def test_update_weights_checks_every_name_and_serves_nothing_half_updated() -> None:
    """A streamed update: lazily consumed, each HF name exactly once. A bad stream (missing, unknown, repeated
    name, wrong shape) is a ValueError, after which requests fail instead of running on a half-written model; a
    complete update serves again, with exactly the streamed weights."""
    target = MoEModel(CFG, seed=4)
    named = hf_state_dict(target)
    names = list(named)
    prompt = _prompts(1, seed=8)[0]
    params = SamplingParams(max_new_tokens=4, seed=2)
    bad_streams = {
        "missing": [(n, named[n]) for n in names[:-1]],
        "unknown tensor 'model.layers.0.mlp.experts.99.up_proj.weight'":
            [*named.items(), ("model.layers.0.mlp.experts.99.up_proj.weight", named[names[0]])],
        "arrived twice": [*named.items(), (names[3], named[names[3]])],
        "expected shape": [(n, t.T if n == "lm_head.weight" else t) for n, t in named.items()],
    }
    with TorchEngine(MoEModel(CFG, seed=0), EngineConfig(max_batch=1, num_slots=2, max_seq_len=128)) as eng:
        with pytest.raises(TypeError, match="iterable of"):
            eng.update_weights(target.state_dict())
        for message, stream in bad_streams.items():
            with pytest.raises(ValueError, match=message):
                eng.update_weights(iter(stream))
            with pytest.raises(RuntimeError, match="no complete weights"):
                eng.submit(prompt, params)
        consumed = []

        def lazily():
            for name in names:
                consumed.append(name)
                yield name, named[name].clone()

        assert eng.update_weights(lazily()) == 1 and consumed == names
        got = hf_state_dict(eng.model)
        assert got.keys() == named.keys() and all(torch.equal(got[n], named[n]) for n in names)
        with TorchEngine(target, EngineConfig(max_batch=1, num_slots=2, max_seq_len=128)) as ref:
            assert eng.submit(prompt, params).result().token_ids == ref.submit(prompt, params).result().token_ids


def test_batch_invariant_engine_gives_the_same_bits_whatever_ran_beside() -> None:
    """With EngineConfig.batch_invariant, a request's tokens, log-probs and routing are bitwise the same whether it
    decodes with 5 others, alone, or in another submission order (different chunk paddings, key lengths and row
    counts in every product). Without the mode, one-at-a-time log-probs differ by ~1e-6 on this model."""
    model = MoEModel(ModelConfig.tiny(), seed=3).eval()
    prompts = _prompts(6, seed=5, lo=5, hi=150)

    def run(max_batch: int, order: list[int]) -> dict[int, Completion]:
        cfg = EngineConfig(max_batch=max_batch, num_slots=6, max_seq_len=256, batch_invariant=True)
        with TorchEngine(model, cfg) as eng:
            futs = {i: eng.submit(prompts[i], SamplingParams(temperature=1.0, max_new_tokens=24, seed=50 + i))
                    for i in order}
            return {i: f.result() for i, f in futs.items()}

    together = run(6, list(range(6)))
    for other in (run(1, list(range(6))), run(3, [5, 2, 0, 4, 1, 3])):
        for i in range(6):
            assert other[i].token_ids == together[i].token_ids
            assert torch.equal(other[i].logprobs, together[i].logprobs)
            assert torch.equal(other[i].routing, together[i].routing)


def test_engine_leaves_its_creators_thread_count_alone(model: MoEModel) -> None:
    """The engine runs small steps on one intra-op thread (`EngineConfig.cpu_parallel_min_tokens`) by setting its
    own thread's count each step. The thread that built it must come out of a rollout with the count it had: a
    trainer whose updates ran on one thread after every collection would be half as fast on two cores."""
    threads = 2
    seen: dict[str, int] = {}

    def creator() -> None:  # a fresh thread: torch has not fixed its count yet
        torch.set_num_threads(threads)
        with TorchEngine(model, EngineConfig(max_batch=2, num_slots=2, max_seq_len=64)) as eng:
            # Every step is a few tokens, far below cpu_parallel_min_tokens: the engine sets 1 thread for each.
            eng.generate(_prompts(2, seed=3, lo=3, hi=6), SamplingParams(max_new_tokens=4, seed=0))
        seen["creator"] = torch.get_num_threads()

    t = threading.Thread(target=creator)
    t.start()
    t.join()
    assert seen["creator"] == threads


def test_every_engine_the_trainer_holds_has_every_method_of_the_protocol() -> None:
    """The trainer calls submit/generate/update_weights/sleep/close and reads policy_version on whatever engine
    it holds: TorchEngine, VLLMEngine, and the CompletionLog that wraps either."""
    from rollout.vllm_engine import VLLMEngine
    from t1core.drift import CompletionLog

    members = {"policy_version", "submit", "generate", "update_weights", "sleep", "close"}
    assert members == {n for n in vars(Engine) if not n.startswith("_")}
    for cls in (TorchEngine, VLLMEngine, CompletionLog):
        missing = [m for m in members if getattr(cls, m, None) is None]
        assert not missing, (cls.__name__, missing)
    with TorchEngine(MoEModel(CFG, seed=0), EngineConfig(max_batch=1, num_slots=2, max_seq_len=64)) as eng:
        log = CompletionLog(eng)
        assert isinstance(log, Engine)
        log.sleep()  # TorchEngine: nothing to give back; it still serves
        assert log.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids
        assert log.update_weights(hf_state_dict(MoEModel(CFG, seed=1)).items()) == 1 == log.policy_version
