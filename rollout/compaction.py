"""Long episodes in a bounded context: history folded into a summary, observations capped in tokens.

When a context reaches `Compaction.at_tokens`, the episode goes on in a new context: the system prompt and the task,
then a summary of every turn folded so far, then the last `keep_turns` turns verbatim (their token ids copied, never
re-tokenized: the replies are the sampled ids, now prompt tokens of the new context). The context that was left ends
as a segment of its own (`finish_reason='compacted'`); each segment is trained on exactly the tokens it was sampled
with, with the routing its own prefill and decode recorded, and all segments of an episode share its reward
(`Trajectory.segments`). This is what slime does with a harness that compacts its history.

The summary is made by a function of the folded turns: `extractive_summary` (the default: each folded command, its
exit code and its output's first line, deterministic) or a summary the policy writes (`rollout.agent` asks the
engine; its text enters the new prompt as task data and is not trained on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from rollout.trajectory import Turn

COMPACT_AT = 0.8
"""The trainer folds a context when it reaches this share of its bound, rollout.max_tokens (SkyRL's choice): room
for one more reply and observation before the bound."""
SUMMARY_HEADER = "Summary of your earlier steps in this task (the most recent steps follow verbatim):"
"""Opens the summary block appended to the task instruction in a compacted context."""
SUMMARY_REQUEST = ("Summarize the shell session below for yourself: what was tried, what worked, what is left. "
                   "Be brief; reply with the summary only.")
"""The system prompt of the request that asks the policy for a summary (`summary='policy'`)."""


@dataclass(frozen=True, kw_only=True)
class Compaction:
    """When and how an episode's context is folded (`rollout.agent.AgentConfig.compaction`)."""

    at_tokens: int
    """Fold when the next prompt holds this many tokens (below the context bound, AgentConfig.max_tokens)."""
    keep_turns: int = 4
    """The last turns kept verbatim in the new context (>= 1: the new context continues from a sampled reply)."""
    summary: Literal["extractive", "policy"] = "extractive"
    """Who writes the summary of the folded turns: `extractive_summary`, or the policy itself."""
    summary_tokens: int | None = None
    """Tokens the summary may hold at most (older lines dropped first); None: at_tokens // 4."""

    def __post_init__(self) -> None:
        if self.at_tokens < 2 or self.keep_turns < 1:
            raise ValueError(f"Compaction: expected at_tokens >= 2 and keep_turns >= 1, got {self}")
        if self.summary not in ("extractive", "policy"):
            raise ValueError(f"Compaction.summary: expected 'extractive' or 'policy', got {self.summary!r}")

    @property
    def summary_budget(self) -> int:
        return self.summary_tokens if self.summary_tokens is not None else self.at_tokens // 4


class _Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def encode_plain(self, text: str) -> list[int]: ...


def _first_line(text: str | None, width: int = 120) -> str:
    line = next((s.strip() for s in (text or "").splitlines() if s.strip()), "")
    return line if len(line) <= width else line[:width] + "..."


def extractive_summary(turns: list[Turn], *, first_turn: int = 0) -> list[str]:
    """One line per folded turn, oldest first: the command, its exit code and its output's first line (or why the
    reply ran nothing). Deterministic: the same turns give the same text."""
    lines = []
    for n, turn in enumerate(turns, start=first_turn + 1):
        if turn.command is not None:
            status = "timed out" if turn.exit_code is None else f"exit {turn.exit_code}"
            lines.append(f"{n}. $ {_first_line(turn.command)} ({status}): {_first_line(turn.output, 80)}")
        else:
            lines.append(f"{n}. no command ({_first_line(turn.tool_error, 60) or 'finished'})")
    return lines


def fit_summary(lines: list[str], tok: _Tokenizer, *, budget: int) -> str:
    """The summary block of `lines` within `budget` tokens: the newest lines kept, the number of older ones said."""
    kept: list[str] = []
    used = len(tok.encode_plain(SUMMARY_HEADER)) + 16  # header and the omission line
    for line in reversed(lines):
        cost = len(tok.encode_plain(line + "\n"))
        if used + cost > budget:
            break
        kept.append(line)
        used += cost
    dropped = len(lines) - len(kept)
    head = [SUMMARY_HEADER] + ([f"({dropped} earlier steps omitted)"] if dropped else [])
    return "\n".join(head + kept[::-1])


def cap_observation(output: str, tok: _Tokenizer, *, max_tokens: int | None) -> list[int] | None:
    """Ids of `output` as a tool response's body ("\\n{output}\\n") cut to its first and last tokens with a marker
    between them, when it holds more than `max_tokens`; None when it fits (the caller tokenizes it as usual)."""
    if max_tokens is None:
        return None
    body = tok.encode_plain(f"\n{output}\n")
    if len(body) <= max_tokens:
        return None
    marker = tok.encode_plain(f"\n[... {len(body) - max_tokens} tokens of output cut ...]\n")
    head = max_tokens // 2
    return body[:head] + marker + body[len(body) - (max_tokens - head):]
