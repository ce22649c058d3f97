"""Matrix products whose every row is independent of how many rows there are (batch invariance on the CPU).

The rollout engine batches whichever requests are ready, so a token's forward shares its GEMMs with a set of other
rows that depends on sandbox timing. For the same seed to give the same tokens, each row's result must not depend
on that set. Measured with the CPU wheel's BLAS (MKL, `tests/test_rows.py`): a row of `x @ w` is bitwise the same
for every thread count and number of columns, and for every number of rows M from 16 up, but products with fewer
rows take other kernels that sum in another order (one row: the matrix-vector path; with `w` transposed, as
nn.Linear passes it, up to 15 rows). So products of fewer than MIN_ROWS rows run on rows padded to MIN_ROWS.
`tests/test_rollout_engine.py` checks the end result: batched and one-at-a-time generation agree bit for bit.

The padding costs decode speed (the tiny model's engine at batch 8: ~1,200 -> ~670 tok/s), so it is a mode the
caller turns on for its own thread (`batch_invariant_mode`, used by `rollout.TorchEngine` with
`EngineConfig.batch_invariant`); otherwise these are plain products.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

MIN_ROWS = 16
"""Rows a product is padded to (the largest small-M kernel measured covers 15 rows)."""


_mode = threading.local()


def batch_invariant() -> bool:
    """Whether this thread runs in `batch_invariant_mode`."""
    return getattr(_mode, "on", False)


@contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    """Within the block, on this thread: products pad few rows, and the CPU engine's cached attention sums over
    fixed key blocks (`t1core.decode_attention`)."""
    before, _mode.on = batch_invariant(), on
    try:
        yield
    finally:
        _mode.on = before


def pad_rows(a_MX: torch.Tensor, rows: int = MIN_ROWS) -> torch.Tensor:
    """a with zero rows appended up to `rows` along dim -2 (a itself when it has that many)."""
    m = a_MX.shape[-2]
    return a_MX if m >= rows else F.pad(a_MX, (0, 0, 0, rows - m))


def mm_rows(a_MK: torch.Tensor, b_KN: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b` for 2-D a, b; in batch-invariant mode each row independent of the number of rows."""
    m = a_MK.shape[0]
    if m >= MIN_ROWS or not batch_invariant():
        return torch.mm(a_MK, b_KN, out=out)
    res_MN = torch.mm(pad_rows(a_MK), b_KN)[:m]
    return res_MN if out is None else out.copy_(res_MN)


def linear_rows(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; for 2-D x in batch-invariant mode each row independent of the number of rows."""
    m = x_MK.shape[0]
    if x_MK.dim() != 2 or m >= MIN_ROWS or not batch_invariant():
        return F.linear(x_MK, weight_NK, bias_N)
    return F.linear(pad_rows(x_MK), weight_NK, bias_N)[:m]
