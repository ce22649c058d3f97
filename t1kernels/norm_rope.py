"""RMSNorm and rotate-half RoPE for the CPU training path: analytic backwards, and the per-head q/k norm fused with
the rotation (`NormRoPEFunction`). Plain torch, so they run anywhere; each has its reference beside it or in the
tests (`F.rms_norm`, `apply_rope_reference`, float64 autograd).

Legend: T tokens, H heads, X heads of any kind (q or kv), D/Dh head dim.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.autograd.function import once_differentiable


class RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) over the last dim, for fp32/fp64 x.

    The forward is F.rms_norm's own op sequence (bitwise equal to it, and so to HF). The backward is analytic,
    dx = rstd * (g w - x_hat * mean(g w x_hat)) and dw = sum over rows of g x_hat (x_hat = x * rstd), a handful of
    fused ops instead of autograd's pow / mean / rsqrt / mul chain (~17 norms per step on the tiny model).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat * weight

    @staticmethod
    def infer(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The forward's ops without the autograd machinery (the same bits): for calls no gradient will follow,
        where `apply`'s bookkeeping costs more than the tiny engine's decode-step norms themselves."""
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))).mul_(weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:  # type: ignore[override]
        x_hat, rstd, weight = ctx.saved_tensors
        g_xhat = grad_y * x_hat
        d_weight = g_xhat.reshape(-1, weight.shape[0]).sum(0) if ctx.needs_input_grad[1] else None
        mean_gw_xhat = (g_xhat @ weight).unsqueeze(-1).div_(weight.shape[0])
        d_x = (grad_y * weight).mul_(rstd).addcmul_(x_hat, mean_gw_xhat.mul_(rstd), value=-1)
        return d_x, d_weight, None


def rope_inv_freq(head_dim: int, *, theta: float, yarn: tuple[float, int, float, float] | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [Dh / 2] (fp32) and the factor cos and sin are scaled by, as HF computes them.

    `yarn` = (factor, original_max_position_embeddings, beta_fast, beta_slow): YaRN (arXiv 2309.00071), HF's
    `rope_type='yarn'`. Dimensions that turn fewer than beta_slow times over the original length are interpolated
    (frequency / factor), those that turn more than beta_fast times are kept, a linear ramp between; cos and sin
    are scaled by 0.1 ln(factor) + 1 (the attention temperature). None: plain RoPE, factor 1.
    """
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor, original, beta_fast, beta_slow = yarn

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos_freqs.device)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


@functools.lru_cache(maxsize=16)
def _inv_freq_cached(head_dim: int, theta: float, yarn: tuple[float, int, float, float] | None,
                     device: torch.device) -> tuple[torch.Tensor, float]:
    """`rope_inv_freq`, once per shape (every forward and decode step needs it; a dozen small ops each time)."""
    return rope_inv_freq(head_dim, theta=theta, yarn=yarn, device=device)


def rope_cos_sin(positions_T: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype,
                 yarn: tuple[float, int, float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin tables [T, Dh] for rotate-half RoPE; angles in fp32 as HF computes them.

    The second table is [-sin, sin] over the two halves, so `apply_rope` needs no negation: (-x2) * s equals
    x2 * (-s) exactly in IEEE arithmetic. `yarn`: see `rope_inv_freq`.
    """
    inv_freq, attention_factor = _inv_freq_cached(head_dim, theta, yarn, positions_T.device)
    freqs_TF = positions_T.float()[:, None] * inv_freq[None, :]
    emb_TD = torch.cat((freqs_TF, freqs_TF), dim=-1)  # full width, as HF: vectorised cos/sin tails may differ
    cos_TD, sin_TD = emb_TD.cos(), emb_TD.sin()
    if yarn is not None:  # plain RoPE keeps its bits (HF multiplies by 1.0, which changes none)
        cos_TD, sin_TD = cos_TD * attention_factor, sin_TD * attention_factor
    half = head_dim // 2
    return cos_TD.to(dtype), torch.cat((-sin_TD[:, :half], sin_TD[:, half:]), dim=-1).to(dtype)


def _rotate_halves(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_signed_TD: torch.Tensor, *,
                   transpose: bool) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin by halves, with no concatenated copy of x; transpose=True applies R^T.

    With s = [-sin, sin]: y1 = x1 c + x2 s1, y2 = x2 c + x1 s2. The transpose (the backward) is the same with
    s1 and s2 swapped: dx1 = g1 c + g2 s2, dx2 = g2 c + g1 s1. addcmul_ rounds its product and sum once (FMA):
    within an ulp of HF's separate multiply and add.
    """
    half = x_THD.shape[-1] // 2
    s_T1D = sin_signed_TD[:, None, :]
    s_lo, s_hi = (s_T1D[..., half:], s_T1D[..., :half]) if transpose else (s_T1D[..., :half], s_T1D[..., half:])
    y_THD = x_THD * cos_TD[:, None, :]
    y_THD[..., :half].addcmul_(x_THD[..., half:], s_lo)
    y_THD[..., half:].addcmul_(x_THD[..., :half], s_hi)
    return y_THD


class RoPEFunction(torch.autograd.Function):
    """Rotate-half RoPE. Its backward is the transposed rotation of the gradient: nothing but the tables is saved,
    where autograd would save the rotated copy and zero-fill slice gradients."""

    @staticmethod
    def forward(ctx, x_THD: torch.Tensor, cos_TD: torch.Tensor,  # type: ignore[override]
                sin_signed_TD: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_TD, sin_signed_TD)
        return _rotate_halves(x_THD, cos_TD, sin_signed_TD, transpose=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_THD: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        assert not any(ctx.needs_input_grad[1:]), "RoPE tables are constants (built from positions)"
        cos_TD, sin_signed_TD = ctx.saved_tensors
        return _rotate_halves(grad_THD, cos_TD, sin_signed_TD, transpose=True), None, None


def apply_rope(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_signed_TD: torch.Tensor) -> torch.Tensor:
    """x [T, H, Dh] rotated by the tables of `rope_cos_sin` [T, Dh]."""
    return RoPEFunction.apply(x_THD, cos_TD, sin_signed_TD)


def apply_rope_reference(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_signed_TD: torch.Tensor) -> torch.Tensor:
    """HF's form, x * cos + rotate_half(x) * sin, differentiable by autograd (tests compare apply_rope to it)."""
    half = x_THD.shape[-1] // 2
    swapped = torch.cat((x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + swapped * sin_signed_TD[:, None, :]


class NormRoPEFunction(torch.autograd.Function):
    """rope(rms_norm(x) * w) for fp32/fp64 x [T, X, Dh]: the per-head q/k norm and the rotation in one function.

    With u = x * w, n = rstd * u and rope's halves, y1 = rstd (x1 w1 c + x2 w2 s1), y2 = rstd (x2 w2 c + x1 w1 s2):
    the weight folds into [T, Dh] tables (shared by all heads), so the forward is one product, two half-width
    FMAs and one scaling (four passes over x where the two functions take seven). Backward, with rg = R^T g:
    dw = sum over rows of rstd rg x, dx = rstd (rg w) - x rstd^3 <rg w, x> / Dh. Same math as `RMSNormFunction`
    then `RoPEFunction`, another rounding (tests compare the two in float64); a few percent off the CPU training
    step.
    """

    @staticmethod
    def forward(ctx, x_TXD: torch.Tensor, weight_D: torch.Tensor, cos_TD: torch.Tensor,  # type: ignore[override]
                sin_signed_TD: torch.Tensor, eps: float) -> torch.Tensor:
        y_TXD, rstd_TX1 = NormRoPEFunction.rotate_scaled(x_TXD, weight_D, cos_TD, sin_signed_TD, eps)
        ctx.save_for_backward(x_TXD, weight_D, cos_TD, sin_signed_TD, rstd_TX1)
        return y_TXD

    @staticmethod
    def rotate_scaled(x_TXD: torch.Tensor, weight_D: torch.Tensor, cos_TD: torch.Tensor, sin_signed_TD: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the forward's output, rstd [T, X, 1]) with no autograd bookkeeping; called directly where no gradient
        will follow (the engine's decode steps), the same ops and bits as `apply`."""
        half = x_TXD.shape[-1] // 2
        rstd_TX1 = torch.rsqrt(x_TXD.pow(2).mean(-1, keepdim=True).add_(eps))
        # The rotation of x with w folded in: cos * w, and each sin half times the w of the half it multiplies.
        # (roll by half swaps the halves: [w2, w1], one op instead of four slices and a cat; the same products.)
        sin_w_TD = sin_signed_TD * weight_D.roll(half)
        y_TXD = _rotate_halves(x_TXD, cos_TD * weight_D, sin_w_TD, transpose=False)
        return y_TXD.mul_(rstd_TX1), rstd_TX1

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_TXD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:  # type: ignore[override]
        assert not any(ctx.needs_input_grad[2:4]), "RoPE tables are constants (built from positions)"
        x_TXD, weight_D, cos_TD, sin_signed_TD, rstd_TX1 = ctx.saved_tensors
        head_dim = x_TXD.shape[-1]
        rg_TXD = _rotate_halves(grad_TXD.contiguous(), cos_TD, sin_signed_TD, transpose=True)
        t_RD = (rg_TXD * x_TXD).reshape(-1, head_dim)  # R = T * X rows
        d_weight = torch.mv(t_RD.T, rstd_TX1.view(-1)) if ctx.needs_input_grad[1] else None
        coef_TX1 = torch.mv(t_RD, weight_D).view(rstd_TX1.shape).mul_(rstd_TX1.pow(3)).div_(head_dim)
        d_x = rg_TXD.mul_(weight_D).mul_(rstd_TX1).addcmul_(x_TXD, coef_TX1, value=-1)
        return d_x, d_weight, None, None, None
