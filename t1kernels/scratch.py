"""Scratch buffers the kernels write in full before anything reads them: allocated without the deterministic fill.

`torch.use_deterministic_algorithms(True)` (the trainer turns it on) makes every `torch.empty` write NaN into the
new memory (`torch.utils.deterministic.fill_uninitialized_memory`), so that a read of an unwritten element gives
the same NaN on every run. On CUDA that fill is a full memory pass over every MoE and log-prob scratch buffer
(gigabytes per layer at T = 8k) right before a kernel overwrites it. The buffers made here are never read before
a kernel has written every element they are read at, so the fill buys nothing: they come from a bare storage,
which torch does not fill. Nothing global is switched: other threads' `torch.empty` keep the fill, and tests can
still pre-fill scratch with NaN (`scratch_fill`) to catch a read of an unwritten element.
"""

from __future__ import annotations

import math

import torch


def empty_unfilled(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous uninitialised tensor, never filled, whatever `fill_uninitialized_memory` says."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype, device="meta").element_size()
    storage = torch.UntypedStorage(nbytes, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)


def scratch(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device,
            fill: float | None = None) -> torch.Tensor:
    """Kernel scratch: unfilled (`empty_unfilled`), or filled with `fill` (tests pass NaN to catch stray reads)."""
    if fill is None:
        return empty_unfilled(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)
