"""The no-TITO ablation: what a text-based pipeline trains on, aligned back to what was sampled.

A text pipeline stores the transcript as messages, re-renders it with the chat template and tokenizes it
again. `retokenize` builds that sequence and aligns it with the sampled one so that the train-vs-rollout
gap can still be measured: where a re-tokenized loss token equals its aligned sampled token it keeps that
token's rollout log-prob; a run of tokens that differs (the same text, another token path) gets the
rollout log-prob of the sampled run spread evenly over it, so that each run's total log-prob is compared
like for like. Routing cannot be replayed onto other tokens, so the result carries none.
"""

from __future__ import annotations

import difflib
from dataclasses import replace

import torch

from rollout.tito import transcript_messages
from rollout.trajectory import Trajectory
from t1model.tokenizer import ChatTokenizer

_ASSISTANT_HEADER = "<|im_start|>assistant\n"


def _assistant_spans(tok: ChatTokenizer, traj: Trajectory, ids: list[int]) -> list[tuple[int, int]]:
    """Token spans of the assistant replies inside the re-tokenized transcript `ids`: each reply runs
    from after an assistant header to its <|im_end|> (included, as the model samples it)."""
    header = tok.encode(_ASSISTANT_HEADER)
    spans, i = [], 0
    while len(spans) < len(traj.turns):
        while i + len(header) <= len(ids) and ids[i:i + len(header)] != header:
            i += 1
        if i + len(header) > len(ids):
            break
        start = i + len(header)
        end = start
        while end < len(ids) and ids[end] != tok.im_end_id:
            end += 1
        spans.append((start, min(end + 1, len(ids))))
        i = end
    return spans


def retokenize(traj: Trajectory, tok: ChatTokenizer) -> tuple[Trajectory, int]:
    """(re-tokenized trajectory, number of sampled loss tokens that drifted)."""
    ids = tok.encode(tok.render(transcript_messages(traj)))
    spans = _assistant_spans(tok, traj, ids)
    sampled = traj.token_ids.tolist()
    sampled_logp = traj.rollout_logprobs.tolist()
    mask = [False] * len(ids)
    logp = [0.0] * len(ids)
    turns, drifted = [], 0
    for (s0, s1), turn in zip(spans, traj.turns):
        a, b = sampled[turn.start:turn.end], ids[s0:s1]
        for tag, i0, i1, j0, j1 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if j1 > j0:
                total = sum(sampled_logp[turn.start + i0:turn.start + i1])
                for j in range(j0, j1):
                    mask[s0 + j] = True
                    logp[s0 + j] = sampled_logp[turn.start + i0 + j - j0] if tag == "equal" else total / (j1 - j0)
            if tag != "equal":
                drifted += i1 - i0
        turns.append(replace(turn, start=s0, end=s1))
    for turn in traj.turns[len(spans):]:
        drifted += turn.end - turn.start  # a reply the re-rendered transcript lost entirely
    out = replace(traj, token_ids=torch.tensor(ids, dtype=torch.long), loss_mask=torch.tensor(mask),
                  rollout_logprobs=torch.tensor(logp, dtype=torch.float32), routing=None, turns=turns)
    return out, drifted

