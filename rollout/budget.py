"""How many positions one episode's context may take in an engine (a slot's length, vLLM's max_model_len).

No torch here: the config computes it for every parse.
"""

from __future__ import annotations

TEMPLATE_GLUE = 8
"""Positions for the chat template's glue around the last reply (end of turn, the assistant header)."""


def slot_length(max_tokens: int, max_reply_tokens: int) -> int:
    """The longest sequence an engine must hold: the episode budget `max_tokens` plus one more reply (the last
    turn may start just under the budget), plus the template glue around it."""
    return max_tokens + max_reply_tokens + TEMPLATE_GLUE
