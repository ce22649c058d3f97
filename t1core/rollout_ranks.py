"""Which trainer ranks own a rollout engine, which episodes each rank runs, and how a weight sync reaches the engines.

Every rank its own engine (TorchEngine, or a colocated vLLM on the rank's own GPU): rank r runs episodes r, r + W,
... against its engine, the results are gathered on every rank (`DataParallel.gather_strided`), and a sync streams
the gathered layers into every rank's engine.

One engine for all ranks (a disaggregated vLLM, tensor parallel over GPUs of its own, under torchrun): rank 0 owns
it and runs every episode of the step against it, `W` times the per-rank `rollout.concurrency` at once (the same
number in flight as W ranks would run); the trajectories reach the other ranks by one `broadcast_object_list`.
Scale-out is the engine's own business (its batch, its tensor parallelism): the trainer adds no RPC layer. The cost:
the sandboxes of the whole step run from rank 0's host, and the other ranks wait through the collection. A sync is
collective as before: every rank runs the per-layer gather of the sharded policy (`iter_hf_tensors`); rank 0 streams
each layer into vLLM (NCCL) as it arrives, the others drop theirs once gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from rollout.engine import Engine
from t1core.distributed import DataParallel

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutRanks:
    """The rollout layout of this run's ranks (module docstring)."""

    dp: DataParallel
    single_engine: bool
    """Rank 0's engine serves every rank's episodes (a disaggregated vLLM under torchrun)."""

    @property
    def owns_engine(self) -> bool:
        return self.dp.is_main or not self.single_engine

    def mine(self, items: list[T]) -> list[T]:
        """The items (episodes) this rank runs."""
        if self.single_engine:
            return list(items) if self.dp.is_main else []
        return items[self.dp.rank::self.dp.world_size]

    def gather(self, mine: list[T], total: int) -> list[T]:
        """Every rank's results of `mine(items)`, in the order of the items, on every rank (collective)."""
        if self.single_engine:
            out = self.dp.broadcast(mine)
            assert len(out) == total, (len(out), total)
            return out
        return self.dp.gather_strided(mine, total)

    def parallel(self, per_rank: int | None) -> int | None:
        """Episodes (or warm sandboxes) at once on this rank, from the per-rank setting."""
        if per_rank is None or not self.single_engine:
            return per_rank
        return per_rank * self.dp.world_size

    def sync(self, engine: Engine | None, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream `named_tensors` (collective: every rank runs it to its end) into this rank's engine, if it has one."""
        if engine is not None:
            engine.update_weights(named_tensors)
            return
        for _ in named_tensors:  # this rank's shards go into the gathers; the whole tensors are rank 0's to send
            pass
