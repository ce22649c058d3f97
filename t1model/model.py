"""Qwen3-MoE decoder (policy) and its value model (critic): math only.

Legend: T packed tokens, B documents/slots, D model dim, F expert hidden dim, E experts, K top-k, L_moe MoE layers,
V vocab, H query heads, Hkv KV heads, Dh head dim, S cache length.

Semantics follow Hugging Face's Qwen3-MoE so real checkpoints load unchanged (t1model.hf_io): pre-norm blocks
with RMSNorm, rotate-half RoPE, grouped-query attention with per-head q/k RMSNorm, a softmax(fp32) top-k router
with optional renormalisation (`norm_topk_prob`), SwiGLU experts, and dense SwiGLU layers where `mlp_only_layers`
/ `decoder_sparse_step` say so. Expert weights are stacked: w13 [E, 2F, D] (gate rows, then up rows), w2 [E, D, F].
Inputs are packed 1-D token rows with `cu_seqlens`; the forward returns hidden states (log-probs go through
`t1kernels.logprob.token_logprobs` with `lm_head.weight`) and, on request, the routing [T, L_moe, K] for R3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from t1kernels.moe import check_routing, fused_moe, route
from t1kernels.norm_rope import NormRoPEFunction, RMSNormFunction, apply_rope, rope_cos_sin
from t1kernels.rows import linear_rows
from t1model.attention import AttnContext, CachedContext, KVCache, PackedContext

__all__ = ["ModelConfig", "YarnScaling", "MoEModel", "ValueModel", "KVCache", "set_moe_recompute"]

_ROUTING_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN RoPE scaling: HF's `rope_scaling = {"rope_type": "yarn", ...}`, Qwen3's documented way past its native
    positions (factor 4 over 32,768: 131,072)."""

    factor: float
    """How many times the original positions the model reaches (> 1)."""
    original_max_position_embeddings: int
    """The positions the model was pretrained on."""
    beta_fast: float = 32.0
    """Dimensions turning more often than this over the original length keep their frequency."""
    beta_slow: float = 1.0
    """Dimensions turning less often than this are interpolated (frequency / factor)."""

    def __post_init__(self) -> None:
        if not self.factor > 1 or self.original_max_position_embeddings < 1 or not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"YarnScaling: expected factor > 1, original_max_position_embeddings >= 1 and "
                             f"beta_fast > beta_slow > 0, got {self}")

    def as_tuple(self) -> tuple[float, int, float, float]:
        """The form `t1kernels.norm_rope.rope_cos_sin` takes."""
        return (self.factor, self.original_max_position_embeddings, self.beta_fast, self.beta_slow)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Qwen3-MoE shape and numerics (HF `config.json` field names). The defaults are the tiny CPU model."""

    vocab_size: int = 4096
    """V: rows of the embedding and the LM head (the built-in tokenizer has exactly 4096 ids)."""
    hidden_size: int = 256
    """D: residual stream width."""
    intermediate_size: int = 512
    """Hidden width of the dense SwiGLU layers (only used by layers that are not MoE)."""
    moe_intermediate_size: int = 128
    """F: hidden width of each expert's SwiGLU."""
    num_hidden_layers: int = 4
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """H: query heads."""
    num_key_value_heads: int = 2
    """Hkv: key/value heads (grouped-query attention); must divide H."""
    head_dim: int = 64
    """Dh: per-head width; may differ from D / H (it does in Qwen3)."""
    num_experts: int = 16
    """E: routed experts per MoE layer (0 makes every layer dense)."""
    num_experts_per_tok: int = 2
    """K: experts each token uses per MoE layer."""
    norm_topk_prob: bool = True
    """Renormalise the K selected router probabilities to sum to one (Qwen3-MoE checkpoints: true)."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layer indices forced to a dense SwiGLU MLP."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm (block norms, q/k norms, final norm)."""
    rope_theta: float = 10000.0
    """RoPE base (Qwen3-MoE checkpoints: 1e6)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is meant for; bounds KV caches by default (see `max_positions`)."""
    rope_scaling: YarnScaling | None = None
    """YaRN scaling of RoPE (HF `rope_scaling`), or None for plain RoPE."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    initializer_range: float = 0.02
    """Std of the normal init of every matrix (norm weights start at one)."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "decoder_sparse_step",
                    "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig.num_key_value_heads: expected a divisor of num_attention_heads="
                             f"{self.num_attention_heads}, got {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim: expected an even number (RoPE rotates halves), "
                             f"got {self.head_dim}")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"ModelConfig: expected num_experts >= 0 and 1 <= num_experts_per_tok <= num_experts, "
                             f"got num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}")
        if not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"ModelConfig.mlp_only_layers: expected indices in [0, {self.num_hidden_layers}), "
                             f"got {bad}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name}: expected > 0, got {getattr(self, name)!r}")

    @property
    def max_positions(self) -> int:
        """Positions a sequence may use: max_position_embeddings, or factor x the original positions under YaRN
        (vLLM's rule; Qwen3's checkpoints keep max_position_embeddings at 40,960 when YaRN is switched on)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        scaled = int(self.rope_scaling.factor * self.rope_scaling.original_max_position_embeddings)
        return max(self.max_position_embeddings, scaled)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule for which decoder layers are sparse."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order (the L_moe axis of routing tensors)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def routing_dtype(self) -> torch.dtype:
        """uint8 while expert ids fit (E <= 256), else int16."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The CPU default: ~9M parameters, D=256, 4 MoE layers of 16 experts (top-2, F=128), V=4096."""
        return cls()

    @classmethod
    def qwen3_30b_a3b(cls) -> ModelConfig:
        """Shape of Qwen/Qwen3-30B-A3B (48 layers, 128 experts, top-8)."""
        return cls(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                   num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                   num_experts=128, num_experts_per_tok=8, rope_theta=1e6, max_position_embeddings=40960)

    @classmethod
    def qwen3_235b_a22b(cls) -> ModelConfig:
        """Shape of Qwen/Qwen3-235B-A22B (94 layers, 128 experts, top-8)."""
        return cls(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                   num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                   num_experts=128, num_experts_per_tok=8, rope_theta=1e6, max_position_embeddings=40960)

    @classmethod
    def moe_120b_a8b(cls) -> ModelConfig:
        """A 122B-class Qwen3-MoE shape (120.7B total, 8.3B active): D=4096, 48 layers, 256 experts of F=768, top-8."""
        return cls(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=768,
                   num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                   num_experts=256, num_experts_per_tok=8, rope_theta=1e6, max_position_embeddings=40960)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": ModelConfig.tiny,
    "qwen3_30b_a3b": ModelConfig.qwen3_30b_a3b,
    "qwen3_235b_a22b": ModelConfig.qwen3_235b_a22b,
    "moe_120b_a8b": ModelConfig.moe_120b_a8b,
}
"""Model shapes a run's `model.name` may name: a model built from scratch (random init). Any other name is
the directory of a HF Qwen3-MoE checkpoint."""


class Linear(nn.Linear):
    """nn.Linear whose rows do not depend on how many rows there are (`t1kernels.rows`): a token decoded alone
    gives the same bits as the same token decoded beside others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias)


def _linear(in_features: int, out_features: int, *, bias: bool = False, **factory: object) -> nn.Linear:
    # skip_init: nn.Linear's own init would consume the global RNG (library code must not) and be overwritten.
    return skip_init(Linear, in_features, out_features, bias=bias, **factory)


def _no_grad(*tensors: torch.Tensor) -> bool:
    """Whether no gradient can flow from this call (autograd off, or no input that wants one)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the weight (as HF Qwen3 does)."""

    def __init__(self, dim: int, eps: float, **factory: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            if _no_grad(x, self.weight):  # the same ops without autograd's per-call bookkeeping (decode steps)
                return RMSNormFunction.infer(x, self.weight, self.eps)
            return RMSNormFunction.apply(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


def norm_rope(norm: RMSNorm, x_TXD: torch.Tensor, cos_TD: torch.Tensor, sin_signed_TD: torch.Tensor) -> torch.Tensor:
    """`apply_rope(norm(x), cos, sin)`, fused for fp32/fp64 (`NormRoPEFunction`)."""
    if x_TXD.dtype in (torch.float32, torch.float64) and norm.weight.dtype == x_TXD.dtype:
        if _no_grad(x_TXD, norm.weight):
            return NormRoPEFunction.rotate_scaled(x_TXD, norm.weight, cos_TD, sin_signed_TD, norm.eps)[0]
        return NormRoPEFunction.apply(x_TXD, norm.weight, cos_TD, sin_signed_TD, norm.eps)
    return apply_rope(norm(x_TXD), cos_TD, sin_signed_TD)


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm before RoPE; where keys come from is the context's job."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory: object) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.scale = cfg.head_dim ** -0.5
        d, h_dh, kv_dh = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = _linear(d, h_dh, **factory)
        self.k_proj = _linear(d, kv_dh, **factory)
        self.v_proj = _linear(d, kv_dh, **factory)
        self.o_proj = _linear(h_dh, d, **factory)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory)

    def forward(self, x_TD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor,
                ctx: AttnContext) -> torch.Tensor:
        T = x_TD.shape[0]
        q_THD = norm_rope(self.q_norm, self.q_proj(x_TD).view(T, self.num_heads, self.head_dim), cos_TD, sin_TD)
        k_TKD = norm_rope(self.k_norm, self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim), cos_TD, sin_TD)
        v_TKD = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        o_THD = ctx.attend(self.layer_idx, q_THD, k_TKD, v_TKD, scale=self.scale)
        return self.o_proj(o_THD.reshape(T, -1))


class DenseMLP(nn.Module):
    """SwiGLU feed-forward of the non-MoE layers: down(silu(gate x) * up x)."""

    def __init__(self, dim: int, hidden: int, **factory: object) -> None:
        super().__init__()
        self.gate_proj = _linear(dim, hidden, **factory)
        self.up_proj = _linear(dim, hidden, **factory)
        self.down_proj = _linear(hidden, dim, **factory)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class Experts(nn.Module):
    """Stacked expert weights: w13 [E, 2F, D] = gate_proj rows then up_proj rows; w2 [E, D, F] = down_proj."""

    def __init__(self, cfg: ModelConfig, **factory: object) -> None:
        super().__init__()
        e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d, **factory))
        self.w2 = nn.Parameter(torch.empty(e, d, f, **factory))


class SparseMoE(nn.Module):
    """Router (linear D -> E, no bias) + top-k SwiGLU experts, with routing capture and replay."""

    def __init__(self, cfg: ModelConfig, **factory: object) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = _linear(cfg.hidden_size, cfg.num_experts, **factory)
        self.experts = Experts(cfg, **factory)
        self.recompute = False  # keep only the inputs for the backward (`set_moe_recompute`)
        # The expert call, `fused_moe`'s signature. Expert parallelism puts its all-to-all dispatch here
        # (t1core.expert_parallel), and then `experts` holds only this rank's share of the E experts.
        self.dispatch: Callable[..., torch.Tensor] = fused_moe

    def forward(self, x_TD: torch.Tensor, replay_ids_TK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # validate=False: MoETrunk checked the whole replayed routing once per batch (check_routing), so no layer
        # pays a host sync of its own; route's own top-k ids are valid by construction.
        weights_TK, ids_TK = route(self.gate(x_TD), self.top_k, replay_ids=replay_ids_TK,
                                   renormalize=self.renormalize, validate=False)
        y_TD = self.dispatch(x_TD, self.experts.w13, self.experts.w2, ids_TK, weights_TK, validate=False,
                         recompute=self.recompute)
        return y_TD, ids_TK


def set_moe_recompute(model: nn.Module, on: bool) -> int:
    """Make every MoE layer of `model` keep only its inputs for the backward and recompute the expert
    pre-activations there (`fused_moe(recompute=True)`; the run's `model.moe_recompute`). Returns the number of
    MoE layers set. Numerics are unchanged: the recomputed values are the same bits."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in layers:
        m.recompute = bool(on)
    return len(layers)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory: object) -> None:
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.self_attn = Attention(cfg, layer_idx, **factory)
        self.mlp: nn.Module = (SparseMoE(cfg, **factory) if self.is_moe
                               else DenseMLP(cfg.hidden_size, cfg.intermediate_size, **factory))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)

    def forward(self, x_TD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor, ctx: AttnContext,
                replay_ids_TK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), cos_TD, sin_TD, ctx)
        h_TD = self.post_attention_layernorm(x_TD)
        if not self.is_moe:
            return x_TD + self.mlp(h_TD), None
        y_TD, ids_TK = self.mlp(h_TD, replay_ids_TK)
        return x_TD + y_TD, ids_TK


def _cu_to_lengths(cu_seqlens: torch.Tensor | list[int] | None, num_tokens: int) -> list[int]:
    """Validated document lengths from cu_seqlens (None: one document)."""
    if cu_seqlens is None:
        return [num_tokens]
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)  # sync: host offsets
    if (len(cu) < 2 or cu[0] != 0 or cu[-1] != num_tokens or any(not isinstance(c, int) for c in cu)
            or any(b <= a for a, b in zip(cu, cu[1:]))):
        raise ValueError(f"cu_seqlens: expected strictly increasing ints from 0 to T={num_tokens}, got {cu}")
    return [b - a for a, b in zip(cu, cu[1:])]


class MoETrunk(nn.Module):
    """Embedding, decoder layers and final norm (HF `Qwen3MoeModel`); shared by the policy and the critic."""

    def __init__(self, cfg: ModelConfig, **factory: object) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, **factory) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)

    def _check_input(self, input_ids_T: torch.Tensor) -> None:
        if input_ids_T.dim() != 1 or input_ids_T.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids_T: expected a 1-D int32/int64 tensor, got {input_ids_T.dtype} "
                             f"{list(input_ids_T.shape)}")

    def _replay_per_layer(self, replay_routing: torch.Tensor | None, num_tokens: int) -> list[torch.Tensor | None]:
        cfg = self.config
        num_moe = len(cfg.moe_layer_ids)
        if replay_routing is None:
            return [None] * num_moe
        want = (num_tokens, num_moe, cfg.num_experts_per_tok)
        if tuple(replay_routing.shape) != want or replay_routing.dtype not in _ROUTING_DTYPES:
            raise ValueError(f"replay_routing: expected an integer tensor of shape [T, L_moe, K] = {list(want)}, got "
                             f"{replay_routing.dtype} {list(replay_routing.shape)}")
        # Range and duplicate checks for the whole batch, with one host read, where the routing lives (a CPU
        # routing costs no device sync at all); the layers then take the ids unchecked.
        check_routing(replay_routing, num_experts=cfg.num_experts)
        return list(replay_routing.to(self.embed_tokens.weight.device).unbind(1))

    def run(self, input_ids_T: torch.Tensor, ctx: AttnContext, positions_T: torch.Tensor,
            replay_routing: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, D] after the final norm, and the routing [T, L_moe, K] actually used."""
        cfg = self.config
        replay = self._replay_per_layer(replay_routing, input_ids_T.shape[0])
        x_TD = self.embed_tokens(input_ids_T)
        yarn = cfg.rope_scaling.as_tuple() if cfg.rope_scaling is not None else None
        cos_TD, sin_TD = rope_cos_sin(positions_T, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=x_TD.dtype,
                                      yarn=yarn)
        ids_per_layer = []
        for layer in self.layers:
            x_TD, ids_TK = layer(x_TD, cos_TD, sin_TD, ctx, replay[len(ids_per_layer)] if layer.is_moe else None)
            if ids_TK is not None:
                ids_per_layer.append(ids_TK)
        if ids_per_layer:
            routing_TLK = torch.stack(ids_per_layer, dim=1).to(cfg.routing_dtype)
        else:
            routing_TLK = torch.empty(input_ids_T.shape[0], 0, cfg.num_experts_per_tok, dtype=cfg.routing_dtype,
                                      device=x_TD.device)
        return self.norm(x_TD), routing_TLK

    def forward(self, input_ids_T: torch.Tensor, *, cu_seqlens: torch.Tensor | list[int] | None = None,
                replay_routing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_input(input_ids_T)
        doc_lens = _cu_to_lengths(cu_seqlens, input_ids_T.shape[0])
        ctx = PackedContext.build(doc_lens, device=input_ids_T.device)
        return self.run(input_ids_T, ctx, ctx.positions_T, replay_routing)

    @torch.no_grad()
    def extend(self, input_ids_T: torch.Tensor, *, cache: KVCache, slot_ids: torch.Tensor | list[int],
               cu_seqlens: torch.Tensor | list[int] | None = None,
               replay_routing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_input(input_ids_T)
        chunk_lens = _cu_to_lengths(cu_seqlens, input_ids_T.shape[0])
        slots = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
        ctx = CachedContext.build(cache, slots, chunk_lens, device=input_ids_T.device)
        out = self.run(input_ids_T, ctx, ctx.positions_T, replay_routing)
        cache.advance(slots, chunk_lens)
        return out


def init_weights_(module: nn.Module, *, seed: int, std: float) -> None:
    """Deterministic init from one CPU generator in parameter order: N(0, std) matrices, norm weights one.

    Drawn on the CPU in fp32 and then copied, so the same seed gives the same bits on every device and dtype path.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


class MoEModel(nn.Module):
    """The policy: `MoETrunk` + LM head. `forward` returns hidden states; see the module docstring."""

    def __init__(self, cfg: ModelConfig | None = None, *, seed: int | None = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        """seed=None leaves the weights uninitialised (for loading a checkpoint right after)."""
        super().__init__()
        self.config = cfg = cfg if cfg is not None else ModelConfig.tiny()
        factory = {"dtype": dtype, "device": torch.device(device) if device is not None else torch.get_default_device()}
        self.model = MoETrunk(cfg, **factory)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, **factory)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if seed is not None:
            init_weights_(self, seed=seed, std=cfg.initializer_range)

    def forward(self, input_ids_T: torch.Tensor, *, cu_seqlens: torch.Tensor | list[int] | None = None,
                replay_routing: torch.Tensor | None = None,
                return_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, D] of a packed row (positions restart at each cu_seqlens offset).

        replay_routing [T, L_moe, K] forces those experts in every MoE layer (R3; ValueError on a wrong shape, ids
        outside [0, E) or repeated ids). return_routing=True also returns the routing used, [T, L_moe, K] uint8
        (int16 when E > 256).
        """
        hidden_TD, routing_TLK = self.model(input_ids_T, cu_seqlens=cu_seqlens, replay_routing=replay_routing)
        return (hidden_TD, routing_TLK) if return_routing else hidden_TD

    def compute_logits(self, input_ids_T: torch.Tensor, *, cu_seqlens: torch.Tensor | list[int] | None = None,
                       replay_routing: torch.Tensor | None = None) -> torch.Tensor:
        """Materialised logits [T, V] (tests and debugging only: training uses t1kernels.logprob)."""
        return self.lm_head(self(input_ids_T, cu_seqlens=cu_seqlens, replay_routing=replay_routing))

    def new_kv_cache(self, num_slots: int, max_seq_len: int | None = None, *, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> KVCache:
        """An empty KV cache of `num_slots` sequences of up to `max_seq_len` tokens (default: max positions)."""
        cfg, ref = self.config, self.lm_head.weight
        return KVCache(num_layers=cfg.num_hidden_layers, num_slots=num_slots,
                       max_seq_len=max_seq_len or cfg.max_positions, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, dtype=dtype or ref.dtype, device=device or ref.device)

    def extend(self, input_ids_T: torch.Tensor, *, cache: KVCache, slot_ids: torch.Tensor | list[int],
               cu_seqlens: torch.Tensor | list[int] | None = None,
               replay_routing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one chunk of tokens per listed slot to the cache; returns (hidden [T, D], routing [T, L_moe, K]).

        Chunk b (tokens cu_seqlens[b]:cu_seqlens[b+1]) continues slot slot_ids[b]: it attends to that slot's cached
        keys and causally within itself, at positions cache.lengths[slot] onwards. Prefill is a long chunk, decode
        a chunk of one token per slot. Runs without autograd.
        """
        return self.model.extend(input_ids_T, cache=cache, slot_ids=slot_ids, cu_seqlens=cu_seqlens,
                                 replay_routing=replay_routing)


class ValueModel(nn.Module):
    """The critic: the policy's trunk with a scalar head per token; values come out in fp32."""

    def __init__(self, cfg: ModelConfig | None = None, *, seed: int | None = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg if cfg is not None else ModelConfig.tiny()
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.model = MoETrunk(cfg, dtype=dtype, device=device)
        # fp32 head: value targets (verifier counts) are not bf16-friendly.
        self.value_head = _linear(cfg.hidden_size, 1, bias=True, dtype=torch.float32, device=device)
        if seed is not None:
            init_weights_(self.model, seed=seed, std=cfg.initializer_range)
        with torch.no_grad():
            # Zero head: the warm-started critic predicts 0 before its first update (no RNG involved).
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    @classmethod
    def from_policy(cls, policy: MoEModel) -> ValueModel:
        """A critic whose trunk is a copy (not a share) of the policy's trunk; head zero."""
        ref = policy.lm_head.weight
        critic = cls(policy.config, seed=None, dtype=ref.dtype, device=ref.device)
        critic.copy_trunk_from(policy)
        return critic

    def copy_trunk_from(self, policy: MoEModel) -> None:
        """Overwrite this critic's trunk with a copy of the policy's (the value head is left as it is)."""
        self.model.load_state_dict(policy.model.state_dict())

    def forward(self, input_ids_T: torch.Tensor, *, cu_seqlens: torch.Tensor | list[int] | None = None,
                replay_routing: torch.Tensor | None = None) -> torch.Tensor:
        """values_T [T] fp32 for a packed row (same packing and replay rules as MoEModel.forward)."""
        hidden_TD, _ = self.model(input_ids_T, cu_seqlens=cu_seqlens, replay_routing=replay_routing)
        # A fresh [T] tensor, not a view of [T, 1]: FSDP2 attaches its backward hook to the output, and an in-place
        # op on a view would silently drop it.
        # .float(): under a mixed-precision policy the head arrives in the compute dtype (a no-op in fp32).
        head = self.value_head
        return F.linear(hidden_TD.float(), head.weight.float(), head.bias.float()).squeeze(-1).clone()
