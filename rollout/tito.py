"""Token-in/token-out turn assembly, template glue, and measuring what re-tokenization would have changed.

Legend: T tokens of an episode, L_moe MoE layers, K top-k experts.

`TitoBuilder` grows one episode's token sequence turn by turn. The prompt of turn n+1 is always the full
ID sequence of turn n (its prompt plus the sampled reply, verbatim) followed by glue and the observation:
IDs are only ever appended, never re-derived from text. Glue is the part of the chat template the model
did not sample: after a reply that stopped on `<|im_end|>` the template continues with "\n"; after a reply
cut by max tokens (or ended by another stop id) the whole end-of-turn `<|im_end|>\n` is inserted. Glue and
observations carry loss mask 0 and log-prob 0.

Glue and observation tokens are held as *pending* until the next reply comes back: their routing is only
known once the engine has prefilled them as part of the next prompt. An episode therefore ends with its last
sampled reply, and every token in the trajectory has routing.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rollout.engine import Completion
from rollout.trajectory import Trajectory, Turn


class _ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def render(self, messages: list[dict[str, str]]) -> str: ...
    def assistant_turn_end_ids(self) -> list[int]: ...


def glue_ids(sampled: list[int], finish_reason: str, turn_end_ids: list[int]) -> list[int]:
    """Template tokens that must follow a sampled reply so the next prompt continues the chat format.

    `turn_end_ids` is the template's end of an assistant turn (`[<|im_end|>] + "\n"` ids). If the reply
    already ends with its first token (stopped on <|im_end|>), only the rest is glue.
    """
    if not turn_end_ids:
        raise ValueError("turn_end_ids must not be empty")
    if finish_reason == "stop" and sampled and sampled[-1] == turn_end_ids[0]:
        return list(turn_end_ids[1:])
    return list(turn_end_ids)


class TitoBuilder:
    """Accumulates one episode: prompt, then per turn sampled reply (mask 1) and glue + observation (mask 0)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        self.ids: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self._routing: list[torch.Tensor] | None = []
        self.turns: list[Turn] = []
        self.pending: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.prefix_checks = 0
        self._last_turn_ids: list[int] = []

    def next_prompt(self) -> list[int]:
        """The prompt of the next turn: everything so far plus the pending glue/observation."""
        return self.ids + self.pending

    def pending_len(self) -> int:
        return len(self.pending)

    def add_reply(self, prompt: list[int], comp: Completion, *, text: str) -> None:
        """Commit the pending tokens (with their prefill routing) and the sampled reply of `comp`.

        `prompt` is what was submitted (must equal `next_prompt()`); `text` the decoded reply for display.
        """
        # TITO invariant: this prompt starts with the full IDs of the previous turn (prompt + reply).
        if prompt[:len(self._last_turn_ids)] != self._last_turn_ids or prompt != self.ids + self.pending:
            raise AssertionError("TITO prefix broken: the new prompt does not extend the previous turn's IDs")
        self.prefix_checks += 1
        self._commit_routing(comp, len(prompt))
        self.ids += self.pending
        self.mask += [False] * len(self.pending)
        self.logprobs += [0.0] * len(self.pending)
        self.pending = []
        start = len(self.ids)
        self.ids += comp.token_ids
        self.mask += [True] * len(comp.token_ids)
        self.logprobs += comp.logprobs.tolist()
        self.turns.append(Turn(start=start, end=len(self.ids), finish_reason=comp.finish_reason, text=text,
                               policy_version=comp.policy_version))
        self._last_turn_ids = list(self.ids)

    def _commit_routing(self, comp: Completion, prompt_len: int) -> None:
        if self._routing is None or comp.routing is None or comp.prompt_routing is None:
            self._routing = None  # one missing piece makes the episode's routing unusable for replay
            return
        known = len(self.ids)  # tokens whose routing we already hold
        if comp.prompt_routing_start > known:
            raise ValueError(f"engine returned prompt routing from {comp.prompt_routing_start}, but routing is "
                             f"only known up to {known}")
        new = comp.prompt_routing[known - comp.prompt_routing_start:]
        if new.shape[0] != prompt_len - known:
            raise ValueError(f"prompt routing covers {new.shape[0]} new tokens, expected {prompt_len - known}")
        self._routing += [new, comp.routing]

    def set_turn_result(self, *, command: str | None, output: str | None, exit_code: int | None,
                        tool_error: str | None) -> None:
        """Record what the last turn's tool call did (display and analysis only)."""
        self.turns[-1] = dataclasses.replace(self.turns[-1], command=command, output=output, exit_code=exit_code,
                                             tool_error=tool_error)

    def add_observation(self, glue: list[int], observation_ids: list[int]) -> None:
        """Queue glue + observation; they join the sequence with the next reply (module docstring)."""
        self.pending = list(glue) + list(observation_ids)

    def build(self, **meta: Any) -> Trajectory:
        """The trajectory up to the last reply (pending tokens are dropped: the model never answered them)."""
        routing = torch.cat(self._routing) if self._routing else None
        mask_T = torch.tensor(self.mask, dtype=torch.bool)
        logp_T = torch.tensor(self.logprobs, dtype=torch.float32)
        return Trajectory(token_ids=torch.tensor(self.ids, dtype=torch.long), loss_mask=mask_T,
                          rollout_logprobs=logp_T, routing=routing, prompt_len=self.prompt_len if self.ids else 0,
                          turns=list(self.turns), **meta)


@dataclass(frozen=True)
class DriftReport:
    """Loss-region tokens a pipeline would train on that differ from what the model sampled."""

    num_loss_tokens: int
    """Sampled tokens in the trajectory."""
    num_drifted: int
    """Sampled tokens with no identical counterpart at the aligned position of the other sequence."""
    num_turns: int
    num_turns_drifted: int
    """Turns with at least one drifted token."""


def transcript_messages(traj: Trajectory) -> list[dict[str, str]]:
    """The episode as chat messages (what a text-based pipeline would store): replies decoded, outputs as seen."""
    msgs = [{"role": "system", "content": traj.system_prompt}, {"role": "user", "content": traj.instruction}]
    for i, turn in enumerate(traj.turns):
        msgs.append({"role": "assistant", "content": turn.text})
        if i + 1 < len(traj.turns):
            msgs.append({"role": "tool", "content": turn.output or ""})
    return msgs


def _drift_per_turn(reference: list[int], ref_turns: list[tuple[int, int]], other: list[int]) -> list[int]:
    """For each reference turn span, how many of its tokens are not matched in an alignment with `other`."""
    matcher = difflib.SequenceMatcher(a=reference, b=other, autojunk=False)
    matched = [False] * len(reference)
    for block in matcher.get_matching_blocks():
        for i in range(block.a, block.a + block.size):
            matched[i] = True
    return [sum(not matched[i] for i in range(s, e)) for s, e in ref_turns]


def retokenization_drift(traj: Trajectory, tok: _ChatTokenizer) -> DriftReport:
    """What naive re-tokenization would have trained on: render the transcript text with the chat template,
    tokenize it, align it with the trajectory (difflib over token ids) and count sampled tokens that have no
    identical aligned counterpart."""
    naive = tok.encode(tok.render(transcript_messages(traj)))
    spans = [(t.start, t.end) for t in traj.turns]
    per_turn = _drift_per_turn(traj.token_ids.tolist(), spans, naive)
    return DriftReport(num_loss_tokens=int(traj.loss_mask.sum()), num_drifted=sum(per_turn),
                       num_turns=len(spans), num_turns_drifted=sum(d > 0 for d in per_turn))


def sampled_drift(traj: Trajectory, sampled: list[list[int]]) -> DriftReport:
    """Compare the trajectory's loss region with what the engine actually returned, turn by turn.

    `sampled` is each turn's completion token ids as the engine produced them (recorded independently of the
    trajectory). TITO trajectories must give exactly zero.
    """
    ids = traj.token_ids.tolist()
    if len(sampled) != len(traj.turns):
        raise ValueError(f"got {len(sampled)} sampled replies for {len(traj.turns)} turns")
    per_turn = []
    for turn, s in zip(traj.turns, sampled):
        got = ids[turn.start:turn.end]
        per_turn.append(sum(a != b for a, b in zip(got, s)) + abs(len(got) - len(s)))
    return DriftReport(num_loss_tokens=int(traj.loss_mask.sum()), num_drifted=sum(per_turn),
                       num_turns=len(per_turn), num_turns_drifted=sum(d > 0 for d in per_turn))
