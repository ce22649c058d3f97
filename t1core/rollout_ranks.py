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

What the ranks roll out with is built here too: the engine over its own copy of the policy (`make_engine`: TorchEngine
or vLLM, None on a rank that owns none) and the agent's settings (`agent_config`, `routing_replay`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from rollout import vllm_api
from rollout.agent import AgentConfig, EpisodeSpec, run_episodes
from rollout.engine import Engine
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory
from rollout.vllm_engine import VLLMEngine, VLLMSettings
from t1core import distributed
from t1core.config import RunConfig
from t1core.distributed import DataParallel, compute_dtype, iter_hf_tensors
from t1core.drift import CompletionLog
from t1core.positions import engine_length
from t1model.dtypes import DTYPES
from t1model.hf_io import load_pretrained
from t1model.model import MoEModel
from t1model.tokenizer import ChatTokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutRanks:
    """The rollout layout of this run's ranks (module docstring)."""

    dp: DataParallel
    single_engine: bool
    """Rank 0's engine serves every rank's episodes (a disaggregated vLLM under torchrun)."""

    @classmethod
    def for_run(cls, cfg: RunConfig, dp: DataParallel) -> RolloutRanks:
        """Which ranks own an engine: all of them, except with a disaggregated vLLM on several ranks (rank 0's
        serves them all)."""
        single = cfg.rollout.engine == "vllm" and cfg.vllm.placement == "disaggregated" and dp.distributed
        return cls(dp=dp, single_engine=single)

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


def make_engine(policy: MoEModel, cfg: RunConfig,
                dp: DataParallel | None = None) -> TorchEngine | VLLMEngine | None:
    """The rollout engine over its own copy of the policy (synced after every update): rollout.engine picks
    TorchEngine or VLLMEngine (vLLM loads the policy from a HF checkpoint it is handed). None on a rank that owns
    no engine (`RolloutRanks.for_run`)."""
    r = cfg.rollout
    if r.engine == "vllm":
        return _make_vllm_engine(policy, cfg, dp or DataParallel.single())
    ecfg = EngineConfig.for_rollout(r, max_seq_len=engine_length(cfg, policy.config))
    dtype = DTYPES[cfg.model.dtype]
    if distributed.is_sharded(policy):  # loaded as shards: the engine's whole copy comes from the checkpoint
        engine_model = load_pretrained(cfg.model.name, dtype=dtype, device=cfg.run.device)
    else:
        engine_model = copy.deepcopy(policy).to(dtype)  # fp32 masters: the engine serves model.dtype
    return TorchEngine(engine_model.eval().requires_grad_(False), ecfg)


def _make_vllm_engine(policy: MoEModel, cfg: RunConfig, dp: DataParallel) -> VLLMEngine | None:
    """Colocated: this rank's own vLLM on its own GPU. Disaggregated: rank 0's vLLM on GPUs no trainer rank holds
    (tensor parallel; vllm.executor='ray': wherever vLLM's Ray executor places it); None elsewhere. A sharded policy
    (read from a checkpoint as shards) is never gathered here: vLLM reads the checkpoint itself."""
    if not RolloutRanks.for_run(cfg, dp).owns_engine:
        return None
    settings = VLLMSettings(vllm=cfg.vllm, max_model_len=engine_length(cfg, policy.config),
                            dtype=DTYPES[cfg.model.dtype], seed=cfg.run.seed, trainer_device=_trainer_device(cfg),
                            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if distributed.is_sharded(policy):
        return VLLMEngine.from_pretrained(cfg.model.name, policy.config, settings)
    return VLLMEngine.from_model(policy, settings)


def _trainer_device(cfg: RunConfig) -> torch.device:
    """This process's device: 'cuda' means the current CUDA device (cuda:LOCAL_RANK under torchrun)."""
    dev = torch.device(cfg.run.device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def routing_replay(cfg: RunConfig) -> tuple[bool, str | None]:
    """(whether the update replays the rollout's routing (R3), the one-line notice when it cannot). Every engine
    records routing except vLLM's CPU build (`rollout.vllm_api.Line.routed_experts`); rollout.r3='on' refused that
    one in `t1core.config_checks`. Decided from the installed vLLM's metadata, alike on every rank."""
    if cfg.rollout.engine != "vllm":
        return True, None
    line = vllm_api.require_vllm()
    if line.routed_experts:
        return True, None
    return False, ("R3: " + vllm_api.unavailable(line, "routed experts", "the update routes with the trainer's own "
                                                 "router (rollout.r3='auto'); no sleep mode either: the engine keeps "
                                                 "its memory through updates"))


def agent_config(cfg: RunConfig, *, temperature: float | None = None, task_timeouts: bool = False) -> AgentConfig:
    """The agent's sections of the run; `temperature` (0: greedy) overrides rollout.temperature, and
    `task_timeouts` cuts each episode at its own task's agent timeout (task.toml) instead of
    rollout.wall_clock_limit_s (benchmark tasks: their timeouts are part of the benchmark)."""
    rollout = cfg.rollout if temperature is None else dataclasses.replace(cfg.rollout, temperature=temperature)
    return AgentConfig(rollout=rollout, sandbox=cfg.sandbox, context=cfg.context, task_timeouts=task_timeouts,
                       return_routing=routing_replay(cfg)[0])
