"""How many positions one episode's context may take in an engine (a slot's length, vLLM's max_model_len).

No torch here: the config computes it for every parse.
"""

from __future__ import annotations

MAX_TURNS = 6
"""Assistant turns per episode by default: the trainer's rollout.max_turns, and rollout.evaluate's / collect's."""
MAX_REPLY_TOKENS = 384
"""Tokens per reply by default (rollout.max_new_tokens_per_turn): above the longest built-in reference reply (323)."""
MAX_TOKENS = 2048
"""Token budget of one context by default (rollout.max_tokens): within the default model's 4,096 positions."""

TEMPLATE_GLUE = 8
"""Positions for the chat template's glue around the last reply (end of turn, the assistant header)."""


def slot_length(max_tokens: int, max_reply_tokens: int) -> int:
    """The longest sequence an engine must hold: the episode budget `max_tokens` plus one more reply (the last
    turn may start just under the budget), plus the template glue around it."""
    return max_tokens + max_reply_tokens + TEMPLATE_GLUE


def engine_slot(max_tokens: int, max_reply_tokens: int, positions: int, *, flag: str = "--rollout.max_tokens") -> int:
    """An engine slot's length for a model of `positions` positions: `slot_length`, cut to the positions (the agent
    caps each reply to the room left in a context). ValueError naming `flag` when a context itself could run past the
    positions, since no cut keeps that episode within the model."""
    if max_tokens > positions:
        raise ValueError(f"{flag}={max_tokens}: a context would run past the model's {positions} positions; "
                         f"lower it (at most {positions})")
    return min(slot_length(max_tokens, max_reply_tokens), positions)
