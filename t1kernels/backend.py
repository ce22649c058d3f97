"""Which implementation a kernel call runs: Triton or the plain-torch path.

Rule: CUDA tensors run Triton, CPU tensors run torch. `T1_KERNEL_BACKEND=triton|torch` forces one. Triton on CPU
tensors only works under the interpreter (`TRITON_INTERPRET=1`, set before `import triton`). Asking for Triton
where it cannot run raises; it never falls back silently.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
_ENV = "T1_KERNEL_BACKEND"


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    """None when `import triton` works, else the reason (cached: the import is slow)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install raising anything at import
        return f"{type(e).__name__}: {e}"
    return None


def select_backend(*tensors: torch.Tensor, op: str) -> Backend:
    """Pick the backend for `op` on these tensors, honouring T1_KERNEL_BACKEND.

    Raises RuntimeError when Triton is requested (explicitly, or implicitly by CUDA tensors) but cannot run.
    """
    forced = os.environ.get(_ENV, "").strip().lower()
    if forced not in ("", "triton", "torch"):
        raise ValueError(f"{_ENV} must be 'triton' or 'torch', got {forced!r}")
    on_cuda = any(t.is_cuda for t in tensors)
    want: Backend = forced or ("triton" if on_cuda else "torch")  # type: ignore[assignment]
    if want == "torch":
        return "torch"
    err = triton_import_error()
    if err is not None:
        raise RuntimeError(f"{op}: Triton backend requested ({_ENV}={forced or 'unset'}, cuda={on_cuda}) "
                           f"but triton cannot be imported: {err}")
    if not on_cuda and not interpreter_on():
        raise RuntimeError(f"{op}: Triton backend requested for CPU tensors; set TRITON_INTERPRET=1 before "
                           f"importing triton to run the kernels in the interpreter, or use {_ENV}=torch")
    return "triton"
