"""Which device a run asks for, checked before any work: the model layer's, so that every entry point (the
trainer, `rollout.collect`) gives the same clear error."""

from __future__ import annotations

import torch


def check_device(dev: torch.device, name: str = "run.device") -> None:
    """A CUDA device that torch cannot use is an error naming why, raised before any task, image or model work
    (torch's own error comes later, from deep inside the first `.to(device)`)."""
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
        raise ValueError(f"{name}={str(dev)!r}: {why}; use {name}='cpu'")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name}={str(dev)!r}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}")
