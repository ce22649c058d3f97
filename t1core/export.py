"""The policy as a Hugging Face checkpoint directory with its tokenizer: `--model.name=PATH` loads it."""

from __future__ import annotations

from pathlib import Path

import torch

from t1core import distributed
from t1core.distributed import DataParallel
from t1model.tokenizer import ChatTokenizer


def save_hf(policy: torch.nn.Module, tok: ChatTokenizer, path: Path, dp: DataParallel) -> None:
    """HF Qwen3-MoE files in the policy's compute dtype, and the tokenizer. Sharded: streamed one layer at a time to
    the main rank, which writes it (collective)."""
    distributed.save_hf(policy, path, dp)
    if dp.is_main:
        tok.save_pretrained(path)
