"""The policy in Hugging Face format (HF Qwen3-MoE files, `--model.name=PATH` loads them): the exports of a run
(final/, warmstart/: `export_policy`, with the tokenizer) and the policy_hf/ beside every checkpoint.
A sharded policy is streamed one decoder layer at a time to the main rank (`save_hf`); a single process writes its
model directly (`save_hf_unsharded`)."""

from __future__ import annotations

from pathlib import Path

import torch

from t1core import distributed
from t1core.distributed import DataParallel
from t1model.hf_io import save_pretrained, save_pretrained_streamed
from t1model.model import MoEModel
from t1model.tokenizer import ChatTokenizer


def export_policy(policy: torch.nn.Module, tok: ChatTokenizer, path: Path, dp: DataParallel) -> None:
    """HF Qwen3-MoE files in the policy's compute dtype, and the tokenizer. Sharded: streamed one layer at a time to
    the main rank, which writes it (collective)."""
    save_hf(policy, path, dp)
    if dp.is_main:
        tok.save_pretrained(path)


def save_hf(model: torch.nn.Module, path: Path, dp: DataParallel, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """`t1model.hf_io.save_pretrained(model, path)` (HF Qwen3-MoE, in its compute dtype) written by the main rank
    from a stream: one decoder layer gathered at a time and written as it arrives, never the whole model in one
    place. The files are byte for byte what a single process's save_pretrained writes. Collective when sharded:
    every rank calls it (the others gather and drop)."""
    dtype = distributed.compute_dtype(model)
    stream = distributed.iter_hf_tensors(model, dtype=dtype, sorted_names=True)
    if dp.is_main:
        save_pretrained_streamed(model.config, stream, path, dtype=dtype, max_shard_bytes=max_shard_bytes)
    else:
        for _ in stream:
            pass


def save_hf_unsharded(policy: torch.nn.Module, path: Path) -> None:
    """The policy in HF format beside the checkpoint: T1's MoEModel through t1model.hf_io, any other model that
    can save itself (a transformers model) through its own save_pretrained; a model that cannot is not exported."""
    if isinstance(policy, MoEModel):
        save_pretrained(policy, str(path))
    elif hasattr(policy, "save_pretrained"):
        policy.save_pretrained(str(path))
