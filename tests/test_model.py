"""MoEModel / ValueModel / checkpoints: transformers parity both ways, R3 capture and replay, KV-cache decoding,
packing, determinism. References are independent: transformers' Qwen3MoeForCausalLM and full forwards."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from t1model.hf_io import hf_state_dict, load_pretrained, save_pretrained, yarn_from_hf
from t1kernels.norm_rope import NormRoPEFunction, RMSNormFunction, apply_rope, apply_rope_reference, rope_cos_sin
from t1model.model import ModelConfig, MoEModel, ValueModel, YarnScaling

transformers = pytest.importorskip("transformers")

# Small but with every Qwen3-MoE feature: head_dim != D / H, GQA, a dense layer, K > 1, odd vocab.
SMALL = ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8,
                    num_experts_per_tok=3, mlp_only_layers=(1,), rope_theta=1e4, max_position_embeddings=256)


def _hf_model(cfg: ModelConfig, seed: int = 0):
    hcfg = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob, mlp_only_layers=list(cfg.mlp_only_layers),
        decoder_sparse_step=cfg.decoder_sparse_step,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, attn_implementation="eager")
    torch.manual_seed(seed)  # transformers initialises from the global RNG; tests may touch it
    return transformers.Qwen3MoeForCausalLM(hcfg).eval()


def _ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", [
    {}, {"norm_topk_prob": False}, {"tie_word_embeddings": True, "mlp_only_layers": (), "decoder_sparse_step": 2}])
def test_hf_parity_both_ways(variant: dict, tmp_path) -> None:
    cfg = SMALL.replace(**variant)
    hf = _hf_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config == cfg.replace(initializer_range=ours.config.initializer_range)
    ids = _ids(57, cfg.vocab_size)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours.compute_logits(ids)
    assert (got - ref).abs().max().item() <= 1e-4
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=40_000)  # forces several shards
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids[None]).logits[0] - ref).abs().max().item() <= 1e-4


def test_gradients_match_transformers(tmp_path) -> None:
    # The trunk's hand-written backwards (RMSNorm, RoPE, fused MoE) against autograd through HF's model.
    hf = _hf_model(SMALL)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = _ids(57, SMALL.vocab_size)
    probe = torch.randn(57, SMALL.vocab_size, generator=torch.Generator().manual_seed(3))
    (hf(ids[None]).logits[0] * probe).sum().backward()
    (ours.compute_logits(ids) * probe).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        ref = hf_grads[name.replace("experts.w13", "experts.gate_up_proj").replace("experts.w2", "experts.down_proj")]
        # fp32 through 3 layers: measured ~1e-6 of each gradient's largest entry.
        assert (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def _check_fused_backward(fused, reference, inputs: list[torch.Tensor]) -> None:
    """Gradients of `fused` within fp32 rounding of autograd through `reference`, and exact in fp64 (gradcheck)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref_leaves = [t.clone().requires_grad_() for t in inputs]
    y, y_ref = fused(*leaves), reference(*ref_leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    for got, want in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, ref_leaves, dy)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.autograd.gradcheck(fused, [t.double().requires_grad_() for t in inputs])


def test_rms_norm_function_is_f_rms_norm_with_an_analytic_backward() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 3, 24, generator=g) * 3, torch.randn(24, generator=g)
    assert torch.equal(RMSNormFunction.apply(x, w, 1e-6), F.rms_norm(x, (24,), w, 1e-6))  # HF's bits
    _check_fused_backward(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), lambda a, b: F.rms_norm(a, (24,), b, 1e-6),
                          [x, w])


def test_rope_function_matches_rotate_half_reference() -> None:
    x = torch.randn(7, 3, 24, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.arange(7), head_dim=24, theta=1e4, dtype=torch.float64)
    y, y_ref = apply_rope(x, cos.float(), sin.float()), apply_rope_reference(x, cos.float(), sin.float())
    assert (y - y_ref).abs().max() <= 1e-6 * y_ref.abs().max()  # addcmul_ fuses the multiply and the add
    _check_fused_backward(lambda a: apply_rope(a, cos.to(a.dtype), sin.to(a.dtype)),
                          lambda a: apply_rope_reference(a, cos.to(a.dtype), sin.to(a.dtype)), [x])


def test_norm_rope_function_is_the_norm_then_the_rotation() -> None:
    # The fused q/k norm + RoPE against HF's composition (F.rms_norm, then x cos + rotate_half(x) sin) by autograd.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 3, 24, generator=g) * 3, torch.randn(24, generator=g)
    cos, sin = rope_cos_sin(torch.arange(7), head_dim=24, theta=1e4, dtype=torch.float64)

    def fused(a, b):
        return NormRoPEFunction.apply(a, b, cos.to(a.dtype), sin.to(a.dtype), 1e-6)

    def composed(a, b):
        return apply_rope_reference(F.rms_norm(a, (24,), b, 1e-6), cos.to(a.dtype), sin.to(a.dtype))

    assert (fused(x, w) - composed(x, w)).abs().max() <= 1e-5 * composed(x, w).abs().max()
    _check_fused_backward(fused, composed, [x, w])


def test_sharded_roundtrip_bitwise_and_fused_names(tmp_path) -> None:
    model = MoEModel(SMALL, seed=3)
    save_pretrained(model, tmp_path / "a", max_shard_bytes=30_000)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in index["weight_map"]
    loaded = load_pretrained(tmp_path / "a")
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    # A single-file save after a sharded one replaces it (no stale shards left behind).
    save_pretrained(model, tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]
    # Fused on-disk expert tensors (gate_up_proj [E, 2F, D], down_proj [E, D, F]) load to the same weights.
    from safetensors.torch import save_file
    tensors = {k: v for k, v in hf_state_dict(model).items() if ".experts." not in k}
    for name, p in model.state_dict().items():
        if name.endswith("experts.w13"):
            tensors[name.replace("w13", "gate_up_proj")] = p.clone()
        elif name.endswith("experts.w2"):
            tensors[name.replace("w2", "down_proj")] = p.clone()
    (tmp_path / "b").mkdir()
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    fused = load_pretrained(tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fused.state_dict().values()))


def test_checkpoint_is_strict(tmp_path) -> None:
    model = MoEModel(SMALL, seed=0)
    save_pretrained(model, tmp_path)
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="does not use"):
        load_pretrained(tmp_path)
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor"):
        load_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_pretrained(tmp_path)


def test_routing_capture_and_bitwise_replay() -> None:
    model = MoEModel(SMALL, seed=0)
    ids, cu = _ids(90, SMALL.vocab_size), [0, 30, 90]
    hidden, routing = model(ids, cu_seqlens=cu, return_routing=True)
    assert routing.shape == (90, len(SMALL.moe_layer_ids), SMALL.num_experts_per_tok) and routing.dtype == torch.uint8
    # Not degenerate: many experts used, and ids distinct within each (token, layer).
    assert routing.unique().numel() >= SMALL.num_experts - 1
    assert (routing.sort(-1).values.diff(dim=-1) > 0).all()
    replayed = model(ids, cu_seqlens=cu, replay_routing=routing)
    assert torch.equal(hidden, replayed)
    _, routing2 = model(ids, cu_seqlens=cu, replay_routing=routing.to(torch.int64), return_routing=True)
    assert torch.equal(routing2, routing)


def test_replay_other_experts_changes_output_and_grads_only_there() -> None:
    model = MoEModel(SMALL, seed=0)
    ids = _ids(40, SMALL.vocab_size)
    hidden, routing = model(ids, return_routing=True)
    forced = torch.zeros_like(routing)
    forced[..., 0], forced[..., 1], forced[..., 2] = 5, 2, 6  # every token on experts {2, 5, 6}
    out = model(ids, replay_routing=forced)
    assert (out - hidden).abs().max() > 1e-3
    out.pow(2).sum().backward()
    for layer_idx in SMALL.moe_layer_ids:
        mlp = model.model.layers[layer_idx].mlp
        used = torch.tensor([e in (2, 5, 6) for e in range(SMALL.num_experts)])
        for w in (mlp.experts.w13, mlp.experts.w2):
            per_expert = w.grad.flatten(1).abs().sum(1)
            assert (per_expert[used] > 0).all() and (per_expert[~used] == 0).all()
        # Renormalised replay = softmax over the replayed logits: other router rows get no gradient.
        router_rows = mlp.gate.weight.grad.abs().sum(1)
        assert (router_rows[used] > 0).all() and (router_rows[~used] == 0).all()


@pytest.mark.parametrize("bad, match", [
    (lambda r: r[:-1], "shape"), (lambda r: r[:, :1], "shape"), (lambda r: r.float(), "integer"),
    (lambda r: torch.full_like(r, 8), "outside"), (lambda r: torch.zeros_like(r), "distinct")])
def test_replay_validation(bad, match) -> None:
    model = MoEModel(SMALL, seed=0)
    ids = _ids(12, SMALL.vocab_size)
    _, routing = model(ids, return_routing=True)
    with pytest.raises(ValueError, match=match):
        model(ids, replay_routing=bad(routing))


def test_packed_equals_separate() -> None:
    # RoPE is relative, so hidden states cannot show an absolute offset: check the restart directly.
    from t1model.attention import PackedContext
    assert PackedContext.build([3, 2, 1], device=torch.device("cpu")).positions_T.tolist() == [0, 1, 2, 0, 1, 0]
    model = MoEModel(SMALL, seed=0)
    # Per-document SDPA calls, the right-padded batch, the equal-length batch.
    for lens, padded in (([17, 40, 5], False), ([30, 40, 25], True), ([16, 16, 16], False)):
        assert (PackedContext.build(lens, device=torch.device("cpu")).pad_index_T is not None) == padded
        docs = [_ids(n, SMALL.vocab_size, seed=i) for i, n in enumerate(lens)]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        packed, routing = model(torch.cat(docs), cu_seqlens=cu, return_routing=True)
        alone = [model(d, return_routing=True) for d in docs]
        torch.testing.assert_close(packed, torch.cat([h for h, _ in alone]), rtol=1e-5, atol=1e-5)
        assert torch.equal(routing, torch.cat([r for _, r in alone]))
        # Gradients too: the padded rows must send nothing back.
        probe = torch.randn(packed.shape, generator=torch.Generator().manual_seed(3))
        model.zero_grad()
        (model(torch.cat(docs), cu_seqlens=cu) * probe).sum().backward()
        packed_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        for d, pr in zip(docs, probe.split(lens)):
            (model(d) * pr).sum().backward()
        for a, p in zip(packed_grads, model.parameters()):
            assert (a is None) == (p.grad is None)  # the LM head: hidden states only
            if a is not None:
                torch.testing.assert_close(a, p.grad, rtol=1e-3, atol=2e-4)  # fp32, other summation order


def _last_logprobs(model: MoEModel, seq: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model.compute_logits(seq)[-1].double(), -1)


def test_incremental_decoding_matches_full_forward() -> None:
    model = MoEModel(SMALL, seed=0).eval()
    seqs = [_ids(n, SMALL.vocab_size, seed=10 + n) for n in (23, 9, 31)]
    slots = [4, 1, 2]  # non-contiguous, unordered slots
    cache = model.new_kv_cache(num_slots=6, max_seq_len=64)
    with torch.no_grad():
        # Prefill in two chunks of different sizes per slot, then batched single-token decodes.
        prefill = [(0, 11), (0, 4), (0, 20)], [(11, 20), (4, 6), (20, 28)]
        for chunks in prefill:
            part = [s[a:b] for s, (a, b) in zip(seqs, chunks)]
            cu = [0, *torch.tensor([len(p) for p in part]).cumsum(0).tolist()]
            model.extend(torch.cat(part), cache=cache, slot_ids=slots, cu_seqlens=cu)
        pos = [20, 6, 28]
        for _ in range(3):
            step = torch.stack([s[p] for s, p in zip(seqs, pos)])
            hidden, routing = model.extend(step, cache=cache, slot_ids=slots, cu_seqlens=[0, 1, 2, 3])
            assert routing.shape == (3, len(SMALL.moe_layer_ids), SMALL.num_experts_per_tok)
            pos = [p + 1 for p in pos]
            for b, s in enumerate(seqs):
                ref = _last_logprobs(model, s[:pos[b]])
                got = F.log_softmax(model.lm_head(hidden[b]).double(), -1)
                assert (got - ref).abs().max().item() < 1e-4
        assert cache.lengths[slots].tolist() == pos
        # Replay through extend: a reset slot re-prefilled with the full forward's routing gives the same hidden.
        full_hidden, full_routing = model(seqs[0][:12], return_routing=True)
        cache.reset(4)
        again, again_routing = model.extend(seqs[0][:12], cache=cache, slot_ids=[4], replay_routing=full_routing)
        assert torch.equal(again_routing, full_routing)
        torch.testing.assert_close(again, full_hidden, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.extend(_ids(60, SMALL.vocab_size), cache=cache, slot_ids=[1])


def test_seed_determinism_and_value_model() -> None:
    a, b, c = MoEModel(SMALL, seed=7), MoEModel(SMALL, seed=7), MoEModel(SMALL, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    ids = _ids(20, SMALL.vocab_size)
    assert torch.equal(a(ids), b(ids))
    critic = ValueModel.from_policy(a)
    values = critic(ids, cu_seqlens=[0, 8, 20])
    assert values.shape == (20,) and values.dtype == torch.float32 and (values == 0).all()
    with torch.no_grad():
        a.model.norm.weight.mul_(2)  # the critic holds a copy, not the policy's tensors
    assert torch.equal(critic.model.norm.weight, b.model.norm.weight)
    (critic(ids) - 3.0).pow(2).mean().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0


def test_config_validation_and_presets() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig(mlp_only_layers=(9,))
    big = ModelConfig.qwen3_30b_a3b()
    assert big.moe_layer_ids == tuple(range(48)) and big.routing_dtype == torch.uint8
    assert ModelConfig(num_experts=300, num_experts_per_tok=2).routing_dtype == torch.int16
    from t1model.tokenizer import ChatTokenizer
    assert ModelConfig.tiny().vocab_size == ChatTokenizer.builtin().vocab_size


def test_tiny_model_learns() -> None:
    """A few Adam steps on one repeated sequence must cut the loss (training works end to end on CPU)."""
    cfg = SMALL.replace(num_hidden_layers=2, mlp_only_layers=())
    model = MoEModel(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids = _ids(64, cfg.vocab_size)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model.compute_logits(ids[:-1]), ids[1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_real_qwen3_30b_config_maps_to_preset() -> None:
    """config.json as published for Qwen/Qwen3-30B-A3B (transformers 4.51 era keys) -> the preset."""
    from t1model.hf_io import config_from_hf, config_to_hf
    published = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936}
    cfg = config_from_hf(published)
    assert cfg == ModelConfig.qwen3_30b_a3b()
    hf_cfg = transformers.Qwen3MoeConfig(**config_to_hf(cfg, dtype=torch.bfloat16))
    assert (hf_cfg.num_experts, hf_cfg.rope_parameters["rope_theta"], hf_cfg.head_dim) == (128, 1e6, 128)
    # Qwen3's documented switch to 131,072 positions (YaRN, factor 4 over 32,768), as its model card writes it.
    yarn = config_from_hf({**published, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}})
    assert yarn.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=32768)
    assert yarn.max_positions == 131072 and cfg.max_positions == 40960


def test_yarn_parity_with_transformers_both_ways(tmp_path) -> None:
    """YaRN RoPE (HF rope_type 'yarn') over positions well past the original ones: logits as transformers'."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": SMALL.rope_theta}
    cfg = SMALL.replace(rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64))
    hf = _hf_model(SMALL)
    hf.config.rope_parameters = yarn
    hf = transformers.Qwen3MoeForCausalLM(hf.config).eval()  # rebuilt: the rotary tables come from the config
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.rope_scaling == cfg.rope_scaling and ours.config.max_positions == 256
    ids = _ids(200, cfg.vocab_size)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours.compute_logits(ids)
        plain = MoEModel(SMALL, seed=0)
        plain.load_state_dict(ours.state_dict())
        assert (plain.compute_logits(ids) - ref).abs().max().item() > 1e-2  # the test can tell YaRN from plain RoPE
    assert (got - ref).abs().max().item() <= 1e-4
    save_pretrained(ours, tmp_path / "ours")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert back.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    with torch.no_grad():
        assert (back(ids[None]).logits[0] - ref).abs().max().item() <= 1e-4


def test_hf_config_refuses_rope_types_it_does_not_implement() -> None:
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        yarn_from_hf({"rope_type": "dynamic", "factor": 2.0}, 4096)
    with pytest.raises(ValueError, match="mscale"):
        yarn_from_hf({"rope_type": "yarn", "factor": 2.0, "mscale": 0.7}, 4096)
    assert yarn_from_hf({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960) == \
        YarnScaling(factor=4.0, original_max_position_embeddings=32768)
    assert ModelConfig.qwen3_30b_a3b().replace(
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=32768)).max_positions == 131072
