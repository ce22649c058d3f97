"""Plain-torch log-probs of exact token IDs: a single-tile path, a chunked path that never holds [N, V], and the
materialising reference.

Legend: N rows (tokens), D model dim, V vocab. z = hidden @ weight.T / temperature are the scaled logits.

When the whole [N, V] fits one tile (N * V <= TILE_ELEMS), the single-tile path computes log_softmax(z) in place
and keeps it for the backward, which then needs no second logits GEMM and writes dz over it. Its memory is that
one tile, alive from forward to backward, plus one temporary tile for the entropy terms. On CPU a fresh 32 MiB
tile is itself costly: glibc maps blocks of 32 MiB and more fresh from the kernel on every allocation, and their
first touch page-faults (2048 x 4096 logits GEMM on 2 cores: 22.8 ms into a fresh tile, 13.5 ms into a reused
one). Hence the in-place ops, and `TileBuffers`, which hands the same CPU buffer to the next forward once a
backward is done with it.

Above that, the chunked path walks the vocabulary in blocks of columns (outer loop, so each weight block is read
and upcast once) and the rows in blocks of at most N_CHUNK (inner loop), keeping an online max / sum-exp per row
in fp32. Per-row state is O(N); the [rows, cols] temporaries are at most two tiles of TILE_ELEMS fp32 each. The
backward recomputes each tile of logits from the saved log-sum-exp instead of storing probabilities. The column
block is TILE_ELEMS // rows (small batches take the vocabulary in few, wide steps: fewer op launches); the
reduction order is fixed for a given N, so results are deterministic.
"""

from __future__ import annotations

import threading

import torch

# One tile of logits is at most TILE_ELEMS fp32 = 32 MiB; chunked forward and backward keep <= 2 alive. Large tiles
# mean few ops: on a shared 2-core CPU each op's thread rendezvous costs more than its arithmetic (N=2048, V=4096,
# 2 threads: 512 rows x 4096 cols per tile took ~1.4-1.7x the CPU time of one 2048 x 4096 tile). At the issue-8
# shape (N=4096, D=1024, V=151936) the extra memory stays ~0.1 GiB, under 10% of one fp32 [N, V] (2.5 GB).
N_CHUNK = 2048
TILE_ELEMS = 2**23
# Finite stand-in for -inf as the initial running max: 0 * (m_old - m_new) must stay 0, not NaN.
_NEG_BIG = -1.0e30


def fits_one_tile(num_rows: int, vocab: int) -> bool:
    """Whether [num_rows, vocab] logits fit one tile, so the single-tile path (`tile_logprob_*`) runs."""
    return num_rows * vocab <= TILE_ELEMS


class TileBuffers:
    """Reusable CPU buffers for single-tile logits: one is kept per device while no forward holds it.

    `take` hands out the kept buffer (or a fresh one) viewed as [N, V]; `give` returns it after its last use (the
    backward, or the forward itself when no backward can follow). A tile whose backward never runs is simply freed
    with its autograd graph. Only tiles of at least REUSE_MIN_ELEMS go through here: small ones fault in little.
    Memory: at most one idle TILE_ELEMS fp32 buffer (32 MiB) per CPU device. Thread-safe.
    """

    REUSE_MIN_ELEMS = 2**20

    def __init__(self) -> None:
        self._idle: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        numel = num_rows * vocab
        if device.type != "cpu" or numel < self.REUSE_MIN_ELEMS:
            return torch.empty(num_rows, vocab, dtype=torch.float32, device=device)
        with self._lock:
            flat = self._idle.pop(device, None)
        if flat is None or flat.numel() < numel:
            flat = torch.empty(max(numel, TILE_ELEMS), dtype=torch.float32, device=device)
        return flat[:numel].view(num_rows, vocab)

    def give(self, tile_NV: torch.Tensor) -> None:
        """Return a tile from `take`; the caller must not touch it afterwards."""
        if tile_NV.device.type != "cpu" or tile_NV.numel() < self.REUSE_MIN_ELEMS:
            return
        flat = torch.empty(0, dtype=torch.float32, device=tile_NV.device).set_(tile_NV.untyped_storage())
        with self._lock:
            self._idle.setdefault(tile_NV.device, flat)


TILE_BUFFERS = TileBuffers()


def vocab_chunk(num_rows: int, vocab: int) -> int:
    """Columns per vocabulary block for a batch of `num_rows` rows."""
    return max(1, min(vocab, TILE_ELEMS // max(1, min(num_rows, N_CHUNK))))


def _scaled_fp32(hidden_ND: torch.Tensor, inv_t: float) -> torch.Tensor:
    """hidden / temperature in fp32 (O(N * D)), so no tile needs its own scaling pass."""
    h_ND = hidden_ND if hidden_ND.dtype == torch.float32 else hidden_ND.float()
    return h_ND if inv_t == 1.0 else h_ND * inv_t


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def chunked_logprob_fwd(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                        temperature: float, ignore_index: int, with_entropy: bool,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward without autograd. Returns (logp_N, entropy_N, lse_N, mean_z_N), all fp32.

    lse_N is log-sum-exp of the scaled logits z and mean_z_N = E_p[z]; the backward needs only these two.
    entropy_N is zeros when `with_entropy` is False. Ignored rows give logp = entropy = 0.
    """
    N, V = hidden_ND.shape[0], weight_VD.shape[0]
    dev = hidden_ND.device
    h_ND = _scaled_fp32(hidden_ND, 1.0 / temperature)
    valid_N = targets_N != ignore_index
    tgt_N = torch.where(valid_N, targets_N, 0).long()
    m_N = torch.full((N,), _NEG_BIG, dtype=torch.float32, device=dev)   # running max of z
    s_N = torch.zeros(N, dtype=torch.float32, device=dev)               # sum exp(z - m)
    t_N = torch.zeros(N, dtype=torch.float32, device=dev)               # sum exp(z - m) * (z - m)
    zt_N = torch.zeros(N, dtype=torch.float32, device=dev)              # z at the target column
    vc = vocab_chunk(N, V)
    for v0 in range(0, V, vc):
        v1 = min(v0 + vc, V)
        w_vD = _fp32(weight_VD[v0:v1])
        for n0 in range(0, N, N_CHUNK):
            n1 = min(n0 + N_CHUNK, N)
            z_nv = torch.mm(h_ND[n0:n1], w_vD.T)
            tgt_n = tgt_N[n0:n1]
            hit_n = (tgt_n >= v0) & (tgt_n < v1)
            picked_n = z_nv.gather(1, (tgt_n - v0).clamp_(0, v1 - v0 - 1)[:, None])[:, 0]
            zt_N[n0:n1] = torch.where(hit_n, picked_n, zt_N[n0:n1])
            m_old = m_N[n0:n1].clone()
            m_new = torch.maximum(m_old, z_nv.amax(dim=1))
            alpha = torch.exp(m_old - m_new)
            z_nv.sub_(m_new[:, None])                                     # z - m_new, in place
            e_nv = torch.exp(z_nv) if with_entropy else z_nv.exp_()  # z - m is only needed for the entropy
            s_old = s_N[n0:n1].clone()
            s_N[n0:n1] = alpha * s_old + e_nv.sum(dim=1)
            if with_entropy:
                # Shifted accumulator: re-basing from m_old to m_new adds s_old * (m_old - m_new).
                t_N[n0:n1] = alpha * (t_N[n0:n1] + s_old * (m_old - m_new)) + e_nv.mul_(z_nv).sum(dim=1)
            m_N[n0:n1] = m_new
    log_s_N = torch.log(s_N)
    lse_N = m_N + log_s_N
    mean_z_N = m_N + t_N / s_N
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    logp_N = torch.where(valid_N, zt_N - lse_N, zero)
    ent_N = torch.where(valid_N, log_s_N - t_N / s_N, zero) if with_entropy else torch.zeros_like(logp_N)
    return logp_N, ent_N, lse_N, mean_z_N


def _dz_tile(logp_nv: torch.Tensor, mean_logp_n: torch.Tensor, g_lp_n: torch.Tensor | None,
             g_en_n: torch.Tensor | None) -> torch.Tensor:
    """dL/dz for one tile from its log-softmax values, without the onehot term. Consumes logp_nv.

    dz = p * (g_ent * (E_p[z] - z) - g_logp), and E_p[z] - z = E_p[log p] - log p (the shift by lse cancels).
    Without the entropy term the result is written over logp_nv: no second tile.
    """
    if g_en_n is None:
        return logp_nv.exp_().mul_(-g_lp_n[:, None])
    p_nv = torch.exp(logp_nv)
    coef_nv = logp_nv.neg_().add_(mean_logp_n[:, None]).mul_(g_en_n[:, None])
    if g_lp_n is not None:
        coef_nv.sub_(g_lp_n[:, None])
    return coef_nv.mul_(p_nv)


def _grads_fp32(grad_logp_N: torch.Tensor | None, grad_ent_N: torch.Tensor | None, valid_N: torch.Tensor,
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Output gradients in fp32, zero on ignored rows (None stays None: that output's terms are skipped)."""
    if grad_logp_N is None and grad_ent_N is None:
        raise ValueError("token_logprobs backward: expected grad_logp_N or grad_ent_N, got neither")
    zero = torch.zeros((), dtype=torch.float32, device=valid_N.device)
    g_lp_N = torch.where(valid_N, grad_logp_N.float(), zero) if grad_logp_N is not None else None
    g_en_N = torch.where(valid_N, grad_ent_N.float(), zero) if grad_ent_N is not None else None
    return g_lp_N, g_en_N


def tile_logprob_fwd(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                     temperature: float, ignore_index: int, with_entropy: bool,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward for logits that fit one tile (`fits_one_tile`). Returns (logp_N, entropy_N, logp_NV, mean_logp_N).

    logp_NV = log_softmax(z) [N, V] and mean_logp_N = E_p[log p] = -entropy (zeros without entropy) are what the
    backward needs. Outputs as `chunked_logprob_fwd`: fp32, ignored rows give logp = entropy = 0.
    """
    h_ND = _scaled_fp32(hidden_ND, 1.0 / temperature)
    valid_N = targets_N != ignore_index
    tgt_N = torch.where(valid_N, targets_N, 0).long()
    logp_NV = torch.mm(h_ND, _fp32(weight_VD).T, out=TILE_BUFFERS.take(hidden_ND.shape[0], weight_VD.shape[0],
                                                                        hidden_ND.device))
    torch.log_softmax(logp_NV, dim=1, out=logp_NV)  # in place: no second tile
    zero = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
    logp_N = torch.where(valid_N, logp_NV.gather(1, tgt_N[:, None])[:, 0], zero)
    if with_entropy:
        mean_logp_N = torch.exp(logp_NV).mul_(logp_NV).sum(dim=1)
        ent_N = torch.where(valid_N, -mean_logp_N, zero)
    else:
        mean_logp_N, ent_N = torch.zeros_like(logp_N), torch.zeros_like(logp_N)
    return logp_N, ent_N, logp_NV, mean_logp_N


def tile_logprob_bwd(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                     logp_NV: torch.Tensor, mean_logp_N: torch.Tensor, grad_logp_N: torch.Tensor | None,
                     grad_ent_N: torch.Tensor | None, *, temperature: float, ignore_index: int,
                     need_hidden: bool = True, need_weight: bool = True,
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of `tile_logprob_fwd`: as `chunked_logprob_bwd`, with no recompute. Consumes logp_NV (dz)."""
    inv_t = 1.0 / temperature
    valid_N = targets_N != ignore_index
    g_lp_N, g_en_N = _grads_fp32(grad_logp_N, grad_ent_N, valid_N)
    dz_NV = _dz_tile(logp_NV, mean_logp_N, g_lp_N, g_en_N)
    if g_lp_N is not None:
        tgt_N = torch.where(valid_N, targets_N, 0).long()
        dz_NV.scatter_add_(1, tgt_N[:, None], g_lp_N[:, None])
    d_hidden = d_weight = None
    if need_hidden:
        dh_ND = torch.mm(dz_NV, _fp32(weight_VD))
        d_hidden = (dh_ND if inv_t == 1.0 else dh_ND.mul_(inv_t)).to(hidden_ND.dtype)
    if need_weight:
        d_weight = torch.mm(dz_NV.T, _scaled_fp32(hidden_ND, inv_t)).to(weight_VD.dtype)
    TILE_BUFFERS.give(logp_NV)  # dz_NV was written over it: its last use
    return d_hidden, d_weight


def tile_logprob_drop(logp_NV: torch.Tensor, mean_logp_N: torch.Tensor) -> None:
    """Release the state of `tile_logprob_fwd` when no backward will follow."""
    TILE_BUFFERS.give(logp_NV)


def chunked_logprob_bwd(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                        lse_N: torch.Tensor, mean_z_N: torch.Tensor, grad_logp_N: torch.Tensor | None,
                        grad_ent_N: torch.Tensor | None, *, temperature: float, ignore_index: int,
                        need_hidden: bool = True, need_weight: bool = True,
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward without autograd: (d_hidden_ND, d_weight_VD) in the inputs' dtypes (None where not needed).

    dz = g_logp * (onehot - p) + g_ent * p * (E_p[z] - z). With z = (hidden / T) @ weight.T:
    d_weight = dz.T @ (hidden / T) and d_hidden = (dz @ weight) / T. Each weight block's gradient is complete
    after the inner row loop, so one fp32 block of d_weight is alive at a time; d_hidden accumulates in fp32.
    """
    N, V = hidden_ND.shape[0], weight_VD.shape[0]
    dev = hidden_ND.device
    inv_t = 1.0 / temperature
    h_ND = _scaled_fp32(hidden_ND, inv_t)
    valid_N = targets_N != ignore_index
    tgt_N = torch.where(valid_N, targets_N, 0).long()
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    g_lp_N, g_en_N = _grads_fp32(grad_logp_N, grad_ent_N, valid_N)
    mean_logp_N = mean_z_N - lse_N
    dh_ND = torch.zeros(N, hidden_ND.shape[1], dtype=torch.float32, device=dev) if need_hidden else None
    dw_VD = torch.zeros_like(weight_VD) if need_weight else None
    vc = vocab_chunk(N, V)
    for v0 in range(0, V, vc):
        v1 = min(v0 + vc, V)
        w_vD = _fp32(weight_VD[v0:v1])
        dw_vD = None
        for n0 in range(0, N, N_CHUNK):
            n1 = min(n0 + N_CHUNK, N)
            g_lp_n = None if g_lp_N is None else g_lp_N[n0:n1]
            g_en_n = None if g_en_N is None else g_en_N[n0:n1]
            logp_nv = torch.mm(h_ND[n0:n1], w_vD.T).sub_(lse_N[n0:n1, None])
            dz_nv = _dz_tile(logp_nv, mean_logp_N[n0:n1], g_lp_n, g_en_n)
            if g_lp_N is not None:
                tgt_n = tgt_N[n0:n1]
                hit_n = (tgt_n >= v0) & (tgt_n < v1)
                col_n1 = (tgt_n - v0).clamp_(0, v1 - v0 - 1)[:, None]
                dz_nv.scatter_add_(1, col_n1, torch.where(hit_n, g_lp_n, zero)[:, None])
            if dh_ND is not None:
                dh_ND[n0:n1].addmm_(dz_nv, w_vD)
            if dw_VD is not None:
                h_nD = h_ND[n0:n1]
                dw_vD = torch.mm(dz_nv.T, h_nD) if dw_vD is None else dw_vD.addmm_(dz_nv.T, h_nD)
        if dw_vD is not None:
            dw_VD[v0:v1] = dw_vD
    d_hidden = dh_ND.mul_(inv_t).to(hidden_ND.dtype) if dh_ND is not None else None
    return d_hidden, dw_VD


def reference_token_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                             temperature: float = 1.0, ignore_index: int = -100, dtype: torch.dtype = torch.float64,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialising reference: log_softmax over the full [N, V] logits in `dtype`, then gather.

    Returns (logp_N, entropy_N) in `dtype`, differentiable by plain autograd; ignored rows are 0. For tests and
    benchmarks only: it holds several [N, V] tensors.
    """
    logits_NV = hidden_ND.to(dtype) @ weight_VD.to(dtype).T / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    valid_N = targets_N != ignore_index
    tgt_N = torch.where(valid_N, targets_N, 0).long()
    logp_N = logp_NV.gather(1, tgt_N[:, None])[:, 0]
    ent_N = -(logp_NV.exp() * logp_NV).sum(dim=-1)
    zero = torch.zeros((), dtype=dtype, device=hidden_ND.device)
    return torch.where(valid_N, logp_N, zero), torch.where(valid_N, ent_N, zero)
