"""Does a checkpoint write the right command for an unseen instruction, in the pretraining format?

`python -m t1cli.experiments.copy_probe CHECKPOINT [--per-family N] [--families a,b] [--seed-block B]`

For N held-out instances of each built-in family, greedy decoding continues `instruction\\n` (the text
`t1core.pretrain` trains on, no chat template, no sandbox) until `</tool_call>`, and the result is compared with
the reference's first tool call, byte for byte. It measures the base model's copying (file names, words, field
names out of the instruction) apart from SFT and the agent loop: the held-out failures of the tiny default are
almost all one word or name copied wrong (EXPERIMENTS.md, "Where RL's gains go"). Prints per family `exact/N`, one wrong
command per family, and the total.
"""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
from collections import Counter

import torch

from sandbox.cli import Parser, bad_input
from sandbox.tasks.families import FAMILIES, generate
from sandbox.tasks.suite import SEED_STRIDE
from t1model.hf_io import load_pretrained
from t1model.model import MoEModel
from t1model.tokenizer import ChatTokenizer, format_tool_call

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
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; expected names from {sorted(FAMILIES)}")
    if args.per_family < 1:
        p.error(f"--per-family must be >= 1, got {args.per_family}")
    with bad_input(p):
        model = load_pretrained(args.checkpoint, dtype=torch.float32).eval()
        tok = ChatTokenizer.from_pretrained(args.checkpoint)
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
