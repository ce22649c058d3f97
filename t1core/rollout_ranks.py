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

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from rollout.agent import AgentConfig, EpisodeSpec, run_episodes
from rollout.engine import Engine
from rollout.trajectory import Trajectory
from t1core.distributed import DataParallel, compute_dtype, iter_hf_tensors
from t1core.drift import CompletionLog
from t1model.tokenizer import ChatTokenizer

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

    def run(self, specs: list[EpisodeSpec], log: CompletionLog | None, tok: ChatTokenizer, *, config: AgentConfig,
            concurrency: int, pool_size: int | None, desc: str, keep_log: bool) -> tuple[list[Trajectory], list[int]]:
        """(trajectories, loss-region drift of each) of every episode of `specs`, in their order, on every rank
        (collective): this rank's share (`mine`) runs on its engine through `log`, and each episode's drift is
        counted against what that engine returned. keep_log: episodes of the asynchronous collector are still
        sampling on the engine (their records stay; these episodes' go once checked)."""
        mine = self.mine(specs)
        bar = tqdm(total=len(mine), desc=desc, leave=False, file=sys.stdout, disable=None if self.dp.is_main else True)
        trajs = []
        if log is not None and not keep_log:  # drift is checked against this engine's own completions
            log.clear()
        if mine:
            trajs = run_episodes(log, tok, mine, config=config, num_parallel=self.parallel(concurrency),
                                 pool_size=self.parallel(pool_size), on_done=lambda i, t: bar.update())
        bar.close()
        # Drift of every segment (a compacted episode's contexts), each against the completions of its own prompts.
        done = self.gather([(t, sum(log.drift(s) for s in t.segments())) for t in trajs], len(specs))
        if keep_log:
            for t in trajs:
                for s in t.segments():
                    log.forget(s)
        return [t for t, _ in done], [d for _, d in done]

    def sync_policy(self, engine: Engine | None, policy: torch.nn.Module) -> None:
        """Every rank's engine (rank 0's alone when it serves all ranks) gets `policy`'s current weights, streamed one
        decoder layer at a time (gathered from the shards when sharded; collective then), in the engine's dtype."""
        self.sync(engine, iter_hf_tensors(policy, dtype=compute_dtype(policy)))

    def sync(self, engine: Engine | None, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream `named_tensors` (collective: every rank runs it to its end) into this rank's engine, if it has one."""
        if engine is not None:
            engine.update_weights(named_tensors)
            return
        for _ in named_tensors:  # this rank's shards go into the gathers; the whole tensors are rank 0's to send
            pass
