"""The model's positions bound every context the run puts through it: checked before anything is built.

A context (one engine request: prompt plus reply) holds at most `rollout.max_tokens` tokens: the agent loop caps each
reply to the room left. With context compaction (`context.compaction`) an episode runs
through several contexts, each within that bound, so an episode of any number of turns fits the positions. The model
reaches `ModelConfig.max_positions`: its max_position_embeddings, or more under YaRN (`rope_scaling` in a checkpoint's
config.json, HF's way to switch it on).
"""

from __future__ import annotations

from rollout.compaction import COMPACT_AT
from t1core.config import RunConfig
from t1model.model import ModelConfig

def engine_length(cfg: RunConfig, mcfg: ModelConfig) -> int:
    """Tokens one engine slot holds: a context plus one reply and the slack (`RolloutSection.max_seq_len`), never
    beyond the model's positions (the agent keeps a context within rollout.max_tokens, which `check_positions` holds
    to the positions)."""
    return min(cfg.rollout.max_seq_len, mcfg.max_positions)


def check_positions(cfg: RunConfig, mcfg: ModelConfig, *, source: str) -> None:
    """ValueError naming the key when a context could run past the model's positions (`source`: where the model's
    shape came from, for the message)."""
    positions = mcfg.max_positions
    how = (f"max_position_embeddings={mcfg.max_position_embeddings}" if mcfg.rope_scaling is None else
           f"YaRN factor {mcfg.rope_scaling.factor:g} over {mcfg.rope_scaling.original_max_position_embeddings}")
    fix = ("lower it, compact the context (context.compaction), or give the checkpoint YaRN rope_scaling in its "
           "config.json")
    if cfg.rollout.max_tokens > positions:
        raise ValueError(f"rollout.max_tokens={cfg.rollout.max_tokens}: a context would run past the model's "
                         f"{positions} positions ({source}: {how}); {fix}")


def describe_context(cfg: RunConfig, mcfg: ModelConfig) -> str:
    """The planner's line on how long an episode may run within the model's positions."""
    r, c = cfg.rollout, cfg.context
    head = f"context: {r.max_tokens} of the model's {mcfg.max_positions} positions per context"
    if c.compaction == "off":
        return f"{head}; no compaction: an episode ends when its one context is full ({r.max_turns} turns at most)"
    return (f"{head}; history folded at {int(COMPACT_AT * r.max_tokens)} tokens (task + {c.compaction} summary + "
            f"last {c.keep_turns} turns), so episodes reach rollout.max_turns={r.max_turns} in several contexts, "
            "each trained as a segment")
