"""The real vLLM 0.33.0 source for the `vllm_real` test lane, fetched once and cached outside the repository.

`pip download --no-deps vllm==0.33.0` (no GPU needed, nothing installed), then the wheel's Python files are
unpacked into `$T1_CACHE/vllm-0.33.0` (default `~/.cache/t1`; compiled extensions are left out: they need a CUDA
torch). Putting that directory on sys.path makes vLLM's CPU-importable modules importable next to our CPU torch.
When no package registry answers, `source_dir` raises `Unavailable` with pip's reason (the lane skips on it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.33.0"


class Unavailable(RuntimeError):
    """The wheel could not be fetched (no registry answered, or pip failed)."""


def cache_root() -> Path:
    return Path(os.environ.get("T1_CACHE", Path.home() / ".cache" / "t1"))


def source_dir(*, timeout_s: float = 900.0) -> Path:
    """The directory holding `vllm/` of the pinned wheel (downloaded and unpacked on first use)."""
    root = cache_root()
    out = root / f"vllm-{VERSION}"
    if (out / ".complete").is_file():
        return out
    wheel = _download(root / "vllm-wheel", timeout_s=timeout_s)
    partial = root / f"vllm-{VERSION}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if not m.endswith(".so")]
        zf.extractall(partial, members=members)
    (partial / ".complete").write_text(wheel.name + "\n")
    shutil.rmtree(out, ignore_errors=True)  # an unpacking that never completed
    partial.rename(out)
    return out


def _download(dest: Path, *, timeout_s: float) -> Path:
    found = sorted(dest.glob(f"vllm-{VERSION}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={VERSION}",
           "-d", str(dest), "--disable-pip-version-check", "-q"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"pip download vllm=={VERSION} took over {timeout_s:.0f} s") from None
    found = sorted(dest.glob(f"vllm-{VERSION}-*.whl"))
    if run.returncode != 0 or not found:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"pip download vllm=={VERSION} failed (no package registry answered?): {last}")
    return found[0]
