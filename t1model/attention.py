"""Causal attention over packed documents and over a slotted KV cache.

Legend: T packed tokens, B documents/slots, H query heads, Hkv KV heads, Dh head dim, S cache length, N chunk length.

Two entry points, both GQA-aware (H is a multiple of Hkv):
- `packed_causal_attention`: training / full forward. Each document of a packed row attends causally to itself only.
  On CUDA with fp16/bf16 and `flash_attn` installed it runs `flash_attn_varlen_func`. Otherwise: one call when all
  documents have the same length; one call over documents right-padded to the longest when that adds little work
  (padding sits after every real token, so causal attention never reads it); else one call per document (a
  block-diagonal mask would cost T^2). Each call is `block_attention.block_causal_attention` when it trains on the
  CPU in fp32/fp64 and its kept probabilities fit `BLOCK_ATTN_MAX_BYTES` (faster there), else torch SDPA.
- `cached_attention`: incremental decoding. New chunks of several slots attend to their slot's cached keys plus
  causally within the chunk, in one batched SDPA call with a boolean mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from t1kernels.rows import batch_invariant
from t1model import block_attention
from t1model.decode_attention import KEY_BLOCK, decode_attention, key_bias, scores_bias

# Documents of unequal length run as one right-padded SDPA batch while B * max_len <= PAD_LIMIT * T: up to that much
# padded work costs less than one small SDPA call (forward and backward) per document. On the tiny model's
# pretraining rows (2,048 tokens of 39-105-token documents, 2 cores) a training step took 0.242 s instead of 0.263 s.
PAD_LIMIT = 1.6
# Probabilities `block_causal_attention` may keep per layer for its backward; above it, SDPA (which keeps O(T)).
BLOCK_ATTN_MAX_BYTES = 64 * 2**20


@functools.lru_cache(maxsize=None)
def _flash_attn_varlen() -> Callable | None:
    """`flash_attn_varlen_func` when flash-attn is importable, else None (looked up once, lazily)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def uses_flash_attn(q_THD: torch.Tensor) -> bool:
    """Whether `packed_causal_attention` runs flash-attn for this query (CUDA, half precision, package present)."""
    return q_THD.is_cuda and q_THD.dtype in (torch.float16, torch.bfloat16) and _flash_attn_varlen() is not None


def padded_index(doc_lens: list[int], positions_T: torch.Tensor) -> torch.Tensor | None:
    """Row of each token in the [B * max_len] right-padded layout, or None when padding would cost too much
    (or is not needed: one document, or all of one length)."""
    num_docs, max_len, total = len(doc_lens), max(doc_lens, default=0), sum(doc_lens)
    if num_docs < 2 or len(set(doc_lens)) == 1 or num_docs * max_len > PAD_LIMIT * total:
        return None
    doc_T = torch.repeat_interleave(torch.arange(num_docs, device=positions_T.device),
                                    torch.tensor(doc_lens, device=positions_T.device), output_size=total)
    return doc_T * max_len + positions_T


def packed_causal_attention(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, *,
                            doc_lens: list[int], cu_seqlens_B1: torch.Tensor, scale: float,
                            pad_index_T: torch.Tensor | None = None) -> torch.Tensor:
    """Block-diagonal causal attention over packed documents; returns [T, H, Dh].

    `doc_lens` are the document lengths on the host (they decide how to batch the SDPA calls), `cu_seqlens_B1` the
    same as int32/int64 offsets on the tensors' device (for flash-attn), `pad_index_T` the padded layout from
    `padded_index` (None: no padding).
    """
    if q_THD.device.type == "cpu" and batch_invariant():
        # The engine's fixed-order sums (decode_attention): a token's output is the bits it had at rollout.
        return torch.cat([InvariantCausalAttention.apply(q_NHD, k_NKD, v_NKD, scale) for q_NHD, k_NKD, v_NKD
                          in zip(q_THD.split(doc_lens), k_TKD.split(doc_lens), v_TKD.split(doc_lens))], dim=0)
    if uses_flash_attn(q_THD):
        flash = _flash_attn_varlen()
        cu_B1 = cu_seqlens_B1.to(device=q_THD.device, dtype=torch.int32)
        max_len = max(doc_lens)
        # flash-attn's backward sums dk/dv over query blocks with atomics unless told otherwise: a deterministic run
        # (torch.use_deterministic_algorithms, as the trainer sets) asks for its fixed-order backward.
        return flash(q_THD, k_TKD, v_TKD, cu_B1, cu_B1, max_len, max_len, softmax_scale=scale, causal=True,
                     deterministic=torch.are_deterministic_algorithms_enabled())
    if len(set(doc_lens)) == 1:
        # Equal lengths (typical for benchmarks and fixed-length packing): one batched call.
        num_docs, n = len(doc_lens), doc_lens[0]
        return _causal_docs(*(x.view(num_docs, n, *x.shape[1:]) for x in (q_THD, k_TKD, v_TKD)),
                            scale=scale).reshape(q_THD.shape)
    if pad_index_T is not None:
        num_docs, n = len(doc_lens), max(doc_lens)

        def padded(x_TXD: torch.Tensor) -> torch.Tensor:  # [T, X, Dh] -> [B, n, X, Dh], zeros after each document
            out = x_TXD.new_zeros(num_docs * n, *x_TXD.shape[1:]).index_copy(0, pad_index_T, x_TXD)
            return out.view(num_docs, n, *x_TXD.shape[1:])

        o_BNHD = _causal_docs(padded(q_THD), padded(k_TKD), padded(v_TKD), scale=scale)
        return o_BNHD.reshape(num_docs * n, *q_THD.shape[1:]).index_select(0, pad_index_T)
    outs = [_causal_docs(q_NHD[None], k_NKD[None], v_NKD[None], scale=scale)[0]
            for q_NHD, k_NKD, v_NKD in zip(q_THD.split(doc_lens), k_TKD.split(doc_lens), v_TKD.split(doc_lens))]
    return torch.cat(outs, dim=0)


QUERY_BLOCK = 1024
"""Queries per block of the bitwise training forward (`InvariantCausalAttention`)."""


class InvariantCausalAttention(torch.autograd.Function):
    """Causal attention of one document, q [N, H, Dh], k/v [N, Hkv, Dh] -> [N, H, Dh], whose forward is the
    engine's batch-invariant `decode_attention` (each query's sums in the order it had when the engine ran it,
    in prefill, decode or after a prefix-cache hit) and whose backward is the default training path's
    (`_causal_docs`: block attention, or SDPA past its memory budget), recomputed: the bits that must match are
    the forward's; the gradient is the same function's, rounded otherwise."""

    @staticmethod
    def forward(ctx, q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,  # type: ignore[override]
                scale: float) -> torch.Tensor:
        # Query blocks against their key prefix: O(N x QUERY_BLOCK) mask and bias instead of N x N (4 GB at 32k
        # tokens). The bits are the whole square's: a query's sums never see keys past its own end (masked keys
        # add exactly 0, `decode_attention`), so dropping them changes nothing.
        num_n, outs = q_NHD.shape[0], []
        for s in range(0, num_n, QUERY_BLOCK):
            e = min(num_n, s + QUERY_BLOCK)
            causal_11nE = torch.ones(e - s, e, dtype=torch.bool, device=q_NHD.device).tril_(diagonal=s)[None, None]
            o_1HnD = decode_attention(q_NHD[s:e].transpose(0, 1)[None], k_NKD[:e].transpose(0, 1)[None],
                                      v_NKD[:e].transpose(0, 1)[None], mask_B1NS=causal_11nE, scale=scale)
            outs.append(o_1HnD[0].transpose(0, 1))
        ctx.save_for_backward(q_NHD, k_NKD, v_NKD)
        ctx.scale = scale
        return torch.cat(outs).contiguous()

    @staticmethod
    def backward(ctx, do_NHD: torch.Tensor):  # type: ignore[override]
        q_NHD, k_NKD, v_NKD = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            o_1NHD = _causal_docs(q_NHD[None], k_NKD[None], v_NKD[None], scale=ctx.scale)
        dq, dk, dv = torch.autograd.grad(o_1NHD, (q_NHD, k_NKD, v_NKD), do_NHD[None])
        return dq, dk, dv, None


def _causal_docs(q_BNHD: torch.Tensor, k_BNKD: torch.Tensor, v_BNKD: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal attention of B documents of one length (no flash-attn): o [B, N, H, Dh]."""
    num_b, num_n, num_heads, _ = q_BNHD.shape
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (q_BNHD, k_BNKD, v_BNKD))
    if (training and q_BNHD.device.type == "cpu" and q_BNHD.dtype in (torch.float32, torch.float64)
            and block_attention.saved_bytes(num_b, num_n, num_heads, q_BNHD.dtype) <= BLOCK_ATTN_MAX_BYTES):
        return block_attention.block_causal_attention(q_BNHD, k_BNKD, v_BNKD, scale=scale)
    o_BHND = F.scaled_dot_product_attention(q_BNHD.transpose(1, 2), k_BNKD.transpose(1, 2), v_BNKD.transpose(1, 2),
                                            is_causal=True, scale=scale, enable_gqa=num_heads != k_BNKD.shape[2])
    return o_BHND.transpose(1, 2)


def cached_attention(q_BHND: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *,
                     mask_B1NS: torch.Tensor | None, scale: float,
                     bias_BnKN: torch.Tensor | None = None,
                     scores_bias_PnKR: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of padded new chunks [B, H, N, Dh] to gathered cache entries [B, Hkv, S, Dh] (new keys included).

    `mask_B1NS` (bool, True = attend) encodes each slot's cached length and the causal order inside the chunk;
    None means every query sees every key (one-token decode where S is exactly each slot's length).
    In batch-invariant mode on the CPU (`t1kernels.rows.batch_invariant_mode`) each row's result does not depend on
    the rest of the batch (`decode_attention`); otherwise torch SDPA.
    """
    if q_BHND.device.type == "cpu" and batch_invariant():
        return decode_attention(q_BHND, k_BKSD, v_BKSD, mask_B1NS=mask_B1NS, scale=scale, bias_BnKN=bias_BnKN,
                                scores_bias_PnKR=scores_bias_PnKR)
    gqa = q_BHND.shape[1] != k_BKSD.shape[1]
    return F.scaled_dot_product_attention(q_BHND, k_BKSD, v_BKSD, attn_mask=mask_B1NS, scale=scale, enable_gqa=gqa)


class KVCache:
    """Preallocated keys/values of `num_slots` sequences: k, v [L, num_slots, Hkv, S, Dh]; lengths on the host.

    Layer-major so that one layer's cache is a contiguous [num_slots, Hkv, S, Dh] block (gathered per step).
    Allocated with zeros: positions past a slot's length are masked out of attention, but masked values still
    enter the weighted sum as 0 * v, so they must be finite.
    """

    def __init__(self, *, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        for name, value in (("num_slots", num_slots), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache.{name}: expected a positive int, got {value!r}")
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.int64)
        """Tokens cached per slot (host tensor: bookkeeping never waits on the device)."""

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def reset(self, slot: int | None = None) -> None:
        """Forget a slot's tokens (all slots when None); the memory is reused, not cleared."""
        if slot is None:
            self.lengths.zero_()
            return
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot: expected an index in [0, {self.num_slots}), got {slot}")
        self.lengths[slot] = 0

    def advance(self, slots: list[int], num_new: list[int]) -> None:
        """Record that `num_new[b]` tokens were written after slot `slots[b]`'s cached ones."""
        self.lengths[slots] += torch.tensor(num_new, dtype=torch.int64)


class AttnContext:
    """Where a layer's keys/values come from: `attend` returns o [T, H, Dh] for this layer's q/k/v."""

    positions_T: torch.Tensor

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, *,
               scale: float) -> torch.Tensor:
        raise NotImplementedError


class PackedContext(AttnContext):
    """Full forward of packed documents (no cache): block-diagonal causal attention."""

    def __init__(self, doc_lens: list[int], cu_seqlens_B1: torch.Tensor, positions_T: torch.Tensor) -> None:
        self.doc_lens, self.cu_seqlens_B1, self.positions_T = doc_lens, cu_seqlens_B1, positions_T
        self.pad_index_T = padded_index(doc_lens, positions_T)  # once per forward, shared by every layer

    @classmethod
    def build(cls, doc_lens: list[int], *, device: torch.device) -> PackedContext:
        lens_B = torch.tensor(doc_lens, dtype=torch.int64)
        cu_B1 = torch.nn.functional.pad(torch.cumsum(lens_B, 0), (1, 0))
        total = int(cu_B1[-1])
        positions_T = torch.arange(total) - torch.repeat_interleave(cu_B1[:-1], lens_B, output_size=total)
        return cls(doc_lens, cu_B1.to(device), positions_T.to(device))

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, *,
               scale: float) -> torch.Tensor:
        return packed_causal_attention(q_THD, k_TKD, v_TKD, doc_lens=self.doc_lens, cu_seqlens_B1=self.cu_seqlens_B1,
                                       scale=scale, pad_index_T=self.pad_index_T)


class CachedContext(AttnContext):
    """One `extend` step: chunk b continues slot slots[b] at positions lengths[slot] .. lengths[slot] + n_b - 1.

    Index tensors and the attention mask are built once here and shared by all layers.
    """

    def __init__(self, cache: KVCache, **fields: object) -> None:
        self.cache = cache
        self.__dict__.update(fields)

    @classmethod
    def build(cls, cache: KVCache, slots: list[int], chunk_lens: list[int], *, device: torch.device) -> CachedContext:
        if len(slots) != len(chunk_lens):
            raise ValueError(f"slot_ids: expected one slot per chunk ({len(chunk_lens)}), got {len(slots)}")
        if len(set(slots)) != len(slots) or any(not 0 <= s < cache.num_slots for s in slots):
            raise ValueError(f"slot_ids: expected distinct slots in [0, {cache.num_slots}), got {slots}")
        starts = cache.lengths[slots].tolist()
        ends = [s + n for s, n in zip(starts, chunk_lens)]
        if max(ends) > cache.max_seq_len:
            raise ValueError(f"extend: slot lengths after this chunk {ends} exceed the cache's max_seq_len "
                             f"{cache.max_seq_len}")
        num_b, n_max, s_max = len(slots), max(chunk_lens), max(ends)
        invariant = cache.k.device.type == "cpu" and batch_invariant()
        if invariant:  # whole key blocks straight from the cache: no padded copy in decode_attention
            s_max = min(-(-s_max // KEY_BLOCK) * KEY_BLOCK, cache.max_seq_len)
        lens_B, starts_B = torch.tensor(chunk_lens), torch.tensor(starts)
        offset_T = torch.cat([torch.arange(n) for n in chunk_lens]) if num_b > 1 else torch.arange(n_max)
        chunk_T = torch.repeat_interleave(torch.arange(num_b), lens_B, output_size=sum(chunk_lens))
        positions_T = starts_B[chunk_T] + offset_T
        contiguous = slots == list(range(slots[0], slots[0] + num_b))
        # A contiguous slot range gathers by slicing (a view, no copy): the common decode case.
        slot_sel = slice(slots[0], slots[0] + num_b) if contiguous else torch.tensor(slots, device=device)
        pad_T = None if len(set(chunk_lens)) == 1 else (chunk_T * n_max + offset_T).to(device)
        mask = None
        if n_max > 1 or len(set(starts)) > 1 or invariant:
            i_N, j_S = torch.arange(n_max), torch.arange(s_max)
            mask = (j_S[None, None, :] <= (starts_B[:, None, None] + i_N[None, :, None])) \
                & (j_S[None, None, :] < torch.tensor(ends)[:, None, None])
            mask = mask[:, None].to(device)
        bias = key_bias(mask, s_max, cache.k.dtype) if invariant else None  # built once, shared by the layers
        return cls(cache, positions_T=positions_T.to(device), tok_slot_T=torch.tensor(slots)[chunk_T].to(device),
                   tok_pos_T=positions_T.to(device), slot_sel=slot_sel, pad_T=pad_T, num_b=num_b, n_max=n_max,
                   s_max=s_max, mask_B1NS=mask, bias_BnKN=bias, scores_bias_PnKR=None)

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, *,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_cache[self.tok_slot_T, :, self.tok_pos_T] = k_TKD.to(k_cache.dtype)
        v_cache[self.tok_slot_T, :, self.tok_pos_T] = v_TKD.to(v_cache.dtype)
        k_BKSD = k_cache[self.slot_sel, :, :self.s_max].to(q_THD.dtype)
        v_BKSD = v_cache[self.slot_sel, :, :self.s_max].to(q_THD.dtype)
        num_heads, head_dim = q_THD.shape[1:]
        if self.pad_T is None:
            q_BNHD = q_THD.view(self.num_b, self.n_max, num_heads, head_dim)
        else:
            q_BNHD = q_THD.new_zeros(self.num_b * self.n_max, num_heads, head_dim)
            q_BNHD[self.pad_T] = q_THD
            q_BNHD = q_BNHD.view(self.num_b, self.n_max, num_heads, head_dim)
        if self.bias_BnKN is not None and self.scores_bias_PnKR is None:  # once per step, shared by the layers
            self.scores_bias_PnKR = scores_bias(self.bias_BnKN, num_kv=k_BKSD.shape[1],
                                                group=num_heads // k_BKSD.shape[1])
        o_BHND = cached_attention(q_BNHD.transpose(1, 2), k_BKSD, v_BKSD, mask_B1NS=self.mask_B1NS, scale=scale,
                                  bias_BnKN=self.bias_BnKN, scores_bias_PnKR=self.scores_bias_PnKR)
        o_PHD = o_BHND.transpose(1, 2).reshape(self.num_b * self.n_max, num_heads, head_dim)
        return o_PHD if self.pad_T is None else o_PHD[self.pad_T]
