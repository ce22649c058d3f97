"""One episode as the trainer sees it: a single token-ID sequence with aligned per-token fields.

Legend: T tokens of the episode, L_moe MoE layers, K top-k experts.

Layout of `token_ids`: prompt, then per turn [sampled reply, glue, observation], ending with the last
sampled reply. `loss_mask` is 1 exactly on sampled tokens; glue (template tokens the model did not sample)
and observations are 0. Every per-token field has length T, checked on construction. Nothing here is ever
re-tokenized: the IDs are the ones the engine sampled and the tokenizer produced for the observations.

On disk (`save_trajectories`): per trajectory `NNNNNN.safetensors` (token_ids int32, loss_mask uint8,
rollout_logprobs fp32, routing when present) and `NNNNNN.json` (everything else). A compacted episode's earlier
segments go in the same two files: their tensors under `earlier.{i}.` (i from 0, oldest first), their other fields
in the JSON's "earlier" list, so that a saved episode reloads whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One assistant turn: where its sampled reply lies in the sequence and what it did."""

    start: int
    """Index of the first sampled token of this turn's reply."""
    end: int
    """One past the last sampled token of the reply (glue and observation follow)."""
    finish_reason: str
    """The engine's finish reason for this reply ("stop" / "length")."""
    text: str
    """The reply decoded for display and parsing only (never re-encoded)."""
    command: str | None = None
    """The shell command parsed from the reply, or None (no call, malformed call, or finish)."""
    output: str | None = None
    """What the sandbox returned for `command` (or the error message fed back), as the model saw it."""
    exit_code: int | None = None
    """The command's exit code (None when no command ran or it timed out)."""
    tool_error: str | None = None
    """Why the reply's tool call could not be run (malformed / missing), or None."""
    policy_version: int = 0
    """Weight version that sampled every token of this reply (an engine never swaps weights inside a completion)."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"turn span must satisfy 0 <= start < end, got [{self.start}, {self.end})")

INFRA = "infra"
"""finish_reason prefix of an episode that the infrastructure ended on every try (sandbox.runtime.failure): no verdict
on the policy, so the update leaves it out and every success rate leaves it unscored."""


def is_infra(finish_reason: str) -> bool:
    """Whether an episode that ended with `finish_reason` is masked: its sandbox died through no action of the agent."""
    return finish_reason.startswith(INFRA)


@dataclass(kw_only=True)
class Trajectory:
    """A token-native episode record (see the module docstring for the layout)."""

    token_ids: torch.Tensor
    """int64 [T]."""
    loss_mask: torch.Tensor
    """bool [T]: True exactly on sampled tokens."""
    rollout_logprobs: torch.Tensor
    """fp32 [T]: the engine's log-prob of each sampled token (rollout.sampling's definition), 0 elsewhere."""
    routing: torch.Tensor | None
    """[T, L_moe, K] uint8/int16 expert ids the engine used for every token (prompt, glue and observation
    tokens included: the trainer's forward runs over the whole sequence), or None if not captured."""
    prompt_len: int
    """Tokens of the initial prompt (system + instruction + assistant header)."""
    turns: list[Turn]
    """The assistant turns in order."""
    task_name: str
    finish_reason: str
    """Why the episode ended: done, max_turns, token_budget, wall_clock, sandbox_error: ..., ..."""
    policy_version: int
    """Weight version of the first sampled token; metrics["policy_versions"] counts the distinct versions
    (1 unless the weights were updated between two turns of this episode)."""
    reward: float = 0.0
    """Dense reward: number of verifiers passed (0 when they could not run)."""
    verifier: dict[str, Any] | None = None
    """VerifierResult fields (passed, failed, total, per_test, timed_out), or None when not verified."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-episode counters: turns, malformed tool calls, wall time, cached prompt tokens, ..."""
    system_prompt: str = ""
    """The system message of the prompt (for display and drift measurement; the IDs are authoritative)."""
    instruction: str = ""
    """The task instruction of the prompt (idem; with the summary of folded turns in a compacted context)."""
    earlier: list[Trajectory] = field(default_factory=list)
    """The episode's earlier segments, oldest first, when its history was compacted (`rollout.compaction`): each
    a trajectory of its own context, sharing this one's reward. Saved and loaded with it (`save_trajectory`)."""

    def __post_init__(self) -> None:
        T = self.token_ids.shape[0] if self.token_ids.dim() == 1 else -1
        if T < 0:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(self.token_ids.shape)}")
        for name, t, dtype in (("loss_mask", self.loss_mask, torch.bool),
                               ("rollout_logprobs", self.rollout_logprobs, torch.float32)):
            if t.shape != (T,) or t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} [{T}], got {t.dtype} {tuple(t.shape)}")
        if self.token_ids.dtype != torch.int64:
            raise ValueError(f"token_ids must be int64, got {self.token_ids.dtype}")
        if self.routing is not None:
            if self.routing.dim() != 3 or self.routing.shape[0] != T:
                raise ValueError(f"routing must be [{T}, L_moe, K], got {tuple(self.routing.shape)}")
            if self.routing.dtype not in (torch.uint8, torch.int16):
                raise ValueError(f"routing must be uint8 or int16, got {self.routing.dtype}")
        if not 0 <= self.prompt_len <= T:
            raise ValueError(f"prompt_len must be in [0, {T}], got {self.prompt_len}")
        if bool(self.rollout_logprobs[~self.loss_mask].ne(0).any()):
            raise ValueError("rollout_logprobs must be 0 outside the loss mask")
        in_turns = torch.zeros(T, dtype=torch.bool)
        for turn in self.turns:
            if turn.end > T:
                raise ValueError(f"turn span [{turn.start}, {turn.end}) exceeds T={T}")
            in_turns[turn.start:turn.end] = True
        if not torch.equal(in_turns, self.loss_mask):
            raise ValueError("loss_mask must be 1 exactly on the turns' sampled spans")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def segments(self) -> list[Trajectory]:
        """Every context of the episode in order: the earlier segments, then this one."""
        return [*self.earlier, self]

    def token_versions(self) -> torch.Tensor:
        """int64 [T]: the weight version that sampled each token (its turn's), -1 where nothing was sampled."""
        out_T = torch.full((self.num_tokens,), -1, dtype=torch.int64)
        for turn in self.turns:
            out_T[turn.start:turn.end] = turn.policy_version
        return out_T

    def sampled_ids(self) -> list[list[int]]:
        """Each turn's sampled IDs, in order."""
        ids = self.token_ids.tolist()
        return [ids[t.start:t.end] for t in self.turns]

    def _meta(self) -> dict[str, Any]:
        return {"prompt_len": self.prompt_len, "turns": [asdict(t) for t in self.turns],
                "task_name": self.task_name, "finish_reason": self.finish_reason,
                "policy_version": self.policy_version, "reward": self.reward, "verifier": self.verifier,
                "metrics": self.metrics, "system_prompt": self.system_prompt, "instruction": self.instruction,
                "num_tokens": self.num_tokens, "segments": len(self.earlier) + 1}


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)  # a reader never sees a half-written file


def _tensors(traj: Trajectory, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {f"{prefix}token_ids": traj.token_ids.to(torch.int32).contiguous(),
           f"{prefix}loss_mask": traj.loss_mask.to(torch.uint8).contiguous(),
           f"{prefix}rollout_logprobs": traj.rollout_logprobs.contiguous()}
    if traj.routing is not None:
        out[f"{prefix}routing"] = traj.routing.contiguous()
    return out


def save_trajectory(traj: Trajectory, directory: str | Path, index: int) -> Path:
    """Write one trajectory (with its earlier segments) as NNNNNN.safetensors + NNNNNN.json in `directory`; return
    the JSON path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(traj)
    for i, seg in enumerate(traj.earlier):
        if seg.earlier:
            raise ValueError(f"earlier segment {i} of {traj.task_name!r} has earlier segments of its own")
        tensors.update(_tensors(seg, f"earlier.{i}."))
    meta = traj._meta() | {"earlier": [seg._meta() for seg in traj.earlier]}
    stem = f"{index:06d}"
    _atomic_write(d / f"{stem}.safetensors", lambda p: save_file(tensors, str(p)))
    json_path = d / f"{stem}.json"
    _atomic_write(json_path, lambda p: p.write_text(json.dumps(meta, indent=1)))
    return json_path


def save_trajectories(trajs: list[Trajectory], directory: str | Path) -> None:
    """Write trajectories 0..N-1 into `directory` (see the module docstring for the format)."""
    for i, t in enumerate(trajs):
        save_trajectory(t, directory, i)


def _from_saved(meta: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str = "") -> Trajectory:
    return Trajectory(token_ids=tensors[f"{prefix}token_ids"].long(), loss_mask=tensors[f"{prefix}loss_mask"].bool(),
                      rollout_logprobs=tensors[f"{prefix}rollout_logprobs"], routing=tensors.get(f"{prefix}routing"),
                      prompt_len=meta["prompt_len"], turns=[Turn(**t) for t in meta["turns"]],
                      task_name=meta["task_name"], finish_reason=meta["finish_reason"],
                      policy_version=meta["policy_version"], reward=meta["reward"], verifier=meta["verifier"],
                      metrics=meta["metrics"], system_prompt=meta["system_prompt"],
                      instruction=meta["instruction"])


def load_trajectory(json_path: str | Path) -> Trajectory:
    """The trajectory `save_trajectory` wrote, its earlier segments included (files written before segments were
    saved have none)."""
    json_path = Path(json_path)
    meta = json.loads(json_path.read_text())
    tensors = load_file(str(json_path.with_suffix(".safetensors")))
    traj = _from_saved(meta, tensors)
    traj.earlier = [_from_saved(m, tensors, f"earlier.{i}.") for i, m in enumerate(meta.get("earlier", []))]
    return traj


def load_trajectories(directory: str | Path) -> list[Trajectory]:
    """All trajectories saved in `directory`, in index order."""
    paths = sorted(p for p in Path(directory).glob("[0-9]*.json"))
    if not paths:
        raise ValueError(f"no trajectories (NNNNNN.json) in {directory}")
    return [load_trajectory(p) for p in paths]
