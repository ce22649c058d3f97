"""Does a checkpoint write the right command for an unseen instruction, in the pretraining format?

`python -m t1cli.experiments.copy_probe CHECKPOINT [--per-family N] [--families a,b] [--seed-block B]`

For N held-out instances of each built-in family, greedy decoding continues `instruction\\n` (the text
`t1core.pretrain` trains on, no chat template, no sandbox) until `</tool_call>`, and the result is compared with
the reference's first tool call, byte for byte. It measures the base model's copying (file names, words, field
names out of the instruction) apart from SFT and the agent loop: the held-out failures of the tiny default are
almost all one word or name copied wrong (EXPERIMENTS.md, "Where RL's gains go"). Prints per family `exact/N`, one wrong
command per family, and the total.

A long family (`follow_chain`) is probed in its own corpus format (`t1core.pretrain.walk_text`, the agent's chat
template): N fresh walks of the corpus's lengths, and a call counts when the model's greedy choice is right at
every one of its tokens given the walk so far (teacher forcing: the greedy reply of each turn after a right history).
A chain of 100 links needs nearly every call right, so this rate is what a long-horizon warm start stands on.
"""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import random
from collections import Counter

import torch

from rollout.agent import DONE_MARKER
from sandbox.cli import Parser, bad_input
from sandbox.tasks.families import FAMILIES, generate
from sandbox.tasks.suite import SEED_STRIDE
from t1core.pretrain import WALKS, walk_text
from t1model.hf_io import load_pretrained
from t1model.model import MoEModel
from t1model.tokenizer import IM_START, ChatTokenizer, format_tool_call

END = "</tool_call>"


@torch.no_grad()
def greedy_command(model: MoEModel, tok: ChatTokenizer, instruction: str, *, max_new_tokens: int) -> str:
    """The text greedy decoding writes after `instruction\\n`, up to and including the first `</tool_call>`."""
    ids = torch.tensor(tok.encode(instruction + "\n"))
    cache = model.new_kv_cache(num_slots=1, max_seq_len=ids.numel() + max_new_tokens)
    hidden, _ = model.extend(ids, cache=cache, slot_ids=[0], cu_seqlens=torch.tensor([0, ids.numel()]))
    end_id = tok.token_id(END)  # one special token: the markup in the text encodes to it too
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(model.lm_head(hidden[-1:]).argmax(-1)))
        if out[-1] == end_id:
            break
        hidden, _ = model.extend(torch.tensor(out[-1:]), cache=cache, slot_ids=[0], cu_seqlens=torch.tensor([0, 1]))
    return tok.decode(out)


@torch.no_grad()
def walk_probe(model: MoEModel, tok: ChatTokenizer, family: str, *, walks: int) -> tuple[int, int, str]:
    """(calls right, calls, one wrong call as `want -> got`) over `walks` fresh walks of `family` (seeds of their own:
    never a corpus walk), teacher-forced."""
    a_head, end_id = tok.encode(f"{IM_START}assistant\n"), tok.im_end_id
    right = total = 0
    miss = ""
    for w in range(walks):
        instruction, steps = WALKS[family](random.Random(f"{family}:probe:{w}"))
        ids = tok.encode(walk_text(instruction, steps))
        hidden, _ = model.extend(torch.tensor(ids), cache=model.new_kv_cache(num_slots=1, max_seq_len=len(ids)),
                                 slot_ids=[0], cu_seqlens=torch.tensor([0, len(ids)]))
        pred = model.lm_head(hidden).argmax(-1).tolist()  # pred[i]: the greedy token after ids[:i + 1]
        i = 0
        while (i := _find(ids, a_head, i)) >= 0:
            start = i + len(a_head)
            stop = ids.index(end_id, start)  # the reply and its <|im_end|>
            i = stop
            if tok.decode(ids[start:stop]).strip() == DONE_MARKER:
                continue
            total += 1
            if all(pred[k - 1] == ids[k] for k in range(start, stop + 1)):
                right += 1
            elif not miss:
                miss = f"{tok.decode(ids[start:stop])!r} -> {tok.decode(pred[start - 1:stop])!r}"
    return right, total, miss


def _find(ids: list[int], pattern: list[int], start: int) -> int:
    for i in range(start, len(ids) - len(pattern) + 1):
        if ids[i:i + len(pattern)] == pattern:
            return i
    return -1


def probe(model: MoEModel, tok: ChatTokenizer, *, families: list[str], per_family: int, seed_block: int = 0,
          ) -> dict[str, tuple[int, list[tuple[str, str, str]]]]:
    """family -> (exact matches, [(instruction, wanted, got) for each miss])."""
    results = {}
    for fam in families:
        exact, misses = 0, []
        for i in range(per_family):
            spec = generate(fam, seed_block * SEED_STRIDE + i, "heldout")
            want = format_tool_call(spec.turns[0].strip())  # what the pretraining text holds
            got = greedy_command(model, tok, spec.instruction.strip(), max_new_tokens=len(tok.encode(want)) + 8)
            if got.strip() == want:
                exact += 1
            else:
                misses.append((spec.instruction.strip(), want, got))
        results[fam] = (exact, misses)
    return results


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m t1cli.experiments.copy_probe", description=__doc__.splitlines()[0],
               epilog="example: python -m t1cli.experiments.copy_probe runs/exp1/warmstart --per-family 12")
    p.add_argument("checkpoint", help="HF checkpoint directory (a run's warmstart/ or final/)")
    p.add_argument("--per-family", type=int, default=6, help="held-out instances per family")
    p.add_argument("--families", default="", help="comma-separated family names (default: all built-in)")
    p.add_argument("--seed-block", type=int, default=0,
                   help="held-out seed block (seeds B * sandbox.tasks.suite.SEED_STRIDE + i)")
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f] or sorted(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES and f not in WALKS]
    if unknown:
        p.error(f"--families: unknown {unknown}; expected names from {sorted(FAMILIES) + sorted(WALKS)}")
    if args.per_family < 1:
        p.error(f"--per-family must be >= 1, got {args.per_family}")
    with bad_input(p):
        model = load_pretrained(args.checkpoint, dtype=torch.float32).eval()
        tok = ChatTokenizer.from_pretrained(args.checkpoint)
    for fam in [f for f in families if f in WALKS]:
        right, calls, miss = walk_probe(model, tok, fam, walks=args.per_family)
        print(f"{fam:<16} {right}/{calls} calls of {args.per_family} walks" + (f"   e.g. {miss[:120]}" if miss else ""))
    families = [f for f in families if f in FAMILIES]
    if not families:
        return 0
    results = probe(model, tok, families=families, per_family=args.per_family, seed_block=args.seed_block)
    total = Counter()
    for fam, (exact, misses) in results.items():
        total["exact"] += exact
        line = f"{fam:<16} {exact}/{args.per_family}"
        if misses:
            instruction, _, got = misses[0]
            line += f"   e.g. {instruction[:60]!r} -> {got.removeprefix('<tool_call>').strip()[:90]!r}"
        print(line)
    print(f"total {total['exact']} of {args.per_family * len(families)} exact")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
