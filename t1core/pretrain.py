"""Base pretraining of a from-scratch policy on synthetic task text: what a real run gets from its checkpoint.

A real RL run starts from a pretrained LM that can already copy a file name out of a sentence into a command.
The tiny preset starts from random weights, and SFT on a few hundred reference transcripts then memorises them
instead: the SFT'd tiny policy solved 36% of its own SFT instances greedily but 4-14% of unseen ones, and RL had
almost no success on unseen instances to learn from. Diversity is what teaches copying: the same model trained
on a stream of fresh (instruction, command) pairs for ~300 steps writes the exact reference command for ~85% of
unseen instructions.

So a from-scratch preset first pretrains on such a stream: pairs from the built-in families' generators (train
split, a seed block of its own; instructions of the RL and held-out instances are skipped), written as plain
text `instruction \\n <tool_call>{...}</tool_call> \\n` (the first call of the instance's SFT demonstration:
the corpus does the finishing step as often as the demonstrations do, see `sandbox.tasks.families.finish`; a two-turn
reference gives its look, the second call depends on output the corpus does not hold), packed into rows of
whole pairs, next-token loss on every token. A long family (`WALKS`) gives whole walks of fresh short instances in
the chat template instead, each command copied from the output before it (`walk_text`); such a corpus teaches the
tiny model no copying alone, mixed with the short families' first commands it does (`corpus_families`).
No sandbox is involved (the text is what a corpus would hold), and nothing here is random beyond the seed: the same
config gives the same weights.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from t1kernels.logprob import token_logprobs
from rollout.agent import DEFAULT_SYSTEM_PROMPT, DONE_MARKER
from sandbox.tasks.families import FAMILIES, chain, generate, known_families
from sandbox.tasks.suite import SEED_STRIDE  # seed block b holds instance seeds b * SEED_STRIDE + i
from t1core.context import RunContext
from t1core.config import RunConfig
from t1core.models import is_preset
from t1core.optimizer import make_optimizer
from t1core.distributed import DataParallel
from t1core.step import SeedBlock
from t1model.tokenizer import ChatTokenizer, format_tool_call, render_chat
from t1core.update import _step, _summarise

WALKS: dict[str, Callable[[random.Random], tuple[str, list[tuple[str, str]]]]] = {
    "follow_chain": lambda rng: chain.walk(rng, rng.randint(*WALK_LINKS)),
}
"""Long families whose corpus documents are whole walks of a fresh, short instance."""
WALK_LINKS = (2, 20)
"""Links of a corpus chain (inclusive): a document fits a row, and the end (and the done marker after it) is seen."""


def walk_text(instruction: str, steps: list[tuple[str, str]]) -> str:
    """A walk as the agent's contexts hold it, in the chat template (`render_chat`): system, instruction, then per
    step the tool call and its <tool_response>, and the done marker after the last output. What a long family needs
    from a base model is to copy a name out of the last output into the next command (the first from the
    instruction), at every link: a corpus of first commands alone, and SFT on a few chains, left a policy that wrote
    names it had memorised."""
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
    for command, output in steps:
        messages += [{"role": "assistant", "content": format_tool_call(command)}, {"role": "tool", "content": output}]
    return render_chat([*messages, {"role": "assistant", "content": DONE_MARKER}])


def corpus_families(families: Sequence[str]) -> list[str]:
    """The families a run's corpus draws from: its own (every short family when none is named), and with a long
    family the short ones as well. Walks alone teach the tiny model no copying (0 of 105 calls after 600 steps); the
    short families' first commands teach it to copy out of an instruction, and the walks then use that (102 of 105
    after 750 steps of the mix; docs/long-horizon.md)."""
    families = list(families) or list(FAMILIES)
    if any(f in WALKS for f in families):
        families += [f for f in FAMILIES if f not in families]
    return families


def corpus_texts(families: Sequence[str], *, seed_block: int, avoid: Collection[str] = ()) -> Iterator[str]:
    """Endless, deterministic stream of `instruction\\n<tool_call>...</tool_call>\\n`, families in turn; a long
    family's document is a whole walk instead (`walk_text`).

    An instance whose instruction is in `avoid` (the RL and held-out instructions) is skipped."""
    unknown = [f for f in families if f not in known_families()]
    if not families or unknown:
        raise ValueError(f"pretraining corpus: expected family names from {known_families()}, got {list(families)}")
    i = 0
    while True:
        family = families[i % len(families)]
        seed = seed_block * SEED_STRIDE + i // len(families)
        i += 1
        if family in WALKS:
            instruction, steps = WALKS[family](random.Random(f"{family}:corpus:{seed}"))
            if instruction not in avoid:
                yield walk_text(instruction, steps)
            continue
        spec = generate(family, seed, "train")
        if spec.instruction.strip() not in avoid:
            demo = spec.demonstration if spec.demonstration is not None else spec.turns
            yield f"{spec.instruction.strip()}\n{format_tool_call(demo[0].strip())}\n"


def packed_rows(texts: Iterator[str], tok: ChatTokenizer, *, row_tokens: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids_T, targets_T, cu_seqlens) rows of whole documents, at most `row_tokens` tokens each.

    Targets are the next token within a document and -100 on each document's last token (no cross-document
    prediction). Tool-call markup in the text becomes its special tokens, as in a real assistant reply."""
    pending: list[int] | None = None
    while True:
        ids: list[int] = []
        targets: list[int] = []
        cu = [0]
        while True:
            doc = pending if pending is not None else tok.encode(next(texts))
            pending = None
            if len(doc) > row_tokens:
                raise ValueError(f"pretraining: a {len(doc)}-token document exceeds row_tokens={row_tokens}")
            if len(ids) + len(doc) > row_tokens:
                pending = doc
                break
            ids += doc
            targets += doc[1:] + [-100]
            cu.append(len(ids))
        yield torch.tensor(ids), torch.tensor(targets), torch.tensor(cu)


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """What `pretrain` trains on and for how long."""

    families: Sequence[str]
    """Built-in families whose generators write the corpus."""
    steps: int
    """Optimizer steps."""
    row_tokens: int
    """Tokens per step (whole instruction/command pairs)."""
    seed_block: int
    """Seed block of the corpus's instances (`t1core.step.SeedBlock.PRETRAIN` in a run)."""
    grad_clip: float | None = None
    """Global grad-norm clip; None = off."""
    avoid: Collection[str] = ()
    """Instructions left out of the corpus (the RL and held-out instances')."""


def pretrain(policy: torch.nn.Module, tok: ChatTokenizer, config: PretrainConfig, *, opt: torch.optim.Optimizer,
             sched: torch.optim.lr_scheduler.LRScheduler | None,
             dp: DataParallel = DataParallel.single()) -> dict[str, float]:
    """`config.steps` optimizer steps of next-token loss on the synthetic corpus; returns first/last-50-step losses.

    With W ranks a step takes W consecutive rows of the stream, rank r the r-th (every rank walks the same stream);
    the logged loss is the main rank's row."""
    device = next(policy.parameters()).device
    params = [p for p in policy.parameters() if p.requires_grad]
    c = config
    rows = packed_rows(corpus_texts(c.families, seed_block=c.seed_block, avoid=c.avoid), tok, row_tokens=c.row_tokens)
    metrics: dict[str, list[float]] = defaultdict(list)
    losses: list[float] = []
    tokens = 0
    for _ in tqdm(range(c.steps), desc="pretrain", leave=False, file=sys.stdout, disable=None):
        mine = [next(rows) for _ in range(dp.world_size)][dp.rank]
        ids_T, targets_T, cu = (x.to(device) for x in mine)
        logp_T = token_logprobs(policy(ids_T, cu_seqlens=cu), policy.lm_head.weight, targets_T)
        loss = -logp_T[targets_T != -100].mean()
        _step(loss, params, opt, sched, c.grad_clip, "pretrain", metrics, dp=dp)  # non-finite: skipped and counted
        losses.append(loss.item())
        tokens += ids_T.numel()
    window = max(1, min(50, len(losses) // 2))
    out = {"pretrain/steps": float(c.steps), "pretrain/tokens": float(tokens)}
    if losses:
        out["pretrain/loss_first"] = sum(losses[:window]) / window
        out["pretrain/loss_last"] = sum(losses[-window:]) / window
    out.update(_summarise(metrics))
    return out


def pretrains(cfg: RunConfig) -> bool:
    """Whether the run pretrains its base (`pretrain_base`): a from-scratch preset and pretrain_steps > 0.

    The corpus comes from the built-in families, so a from-scratch model on a task directory must say
    `warmstart.pretrain_steps=0` explicitly rather than silently start RL from random weights."""
    if cfg.warmstart.pretrain_steps == 0 or not is_preset(cfg.model.name):
        return False
    if cfg.tasks.source != "builtin":
        raise ValueError(f"warmstart.pretrain_steps={cfg.warmstart.pretrain_steps} pretrains a from-scratch "
                         f"model on the built-in families' text, but tasks.source={cfg.tasks.source!r}: use "
                         "tasks.source='builtin', start from a checkpoint (model.name=DIR), or set "
                         "warmstart.pretrain_steps=0")
    return True


def pretrain_base(run: RunContext, policy: torch.nn.Module) -> dict[str, float]:
    """The run's base pretraining (from-scratch presets only, `pretrains`): warmstart.pretrain_steps on the
    corpus of the run's families (`corpus_families`), RL, held-out and benchmark (eval.source) instructions kept out
    of it."""
    cfg, tasks = run.cfg, run.tasks
    w = cfg.warmstart
    opt, sched = make_optimizer(policy, lr=w.pretrain_lr, cfg=cfg)
    config = PretrainConfig(families=corpus_families(cfg.tasks.families), steps=w.pretrain_steps,
                            row_tokens=w.pretrain_row_tokens, seed_block=int(SeedBlock.PRETRAIN),
                            grad_clip=cfg.optim.grad_clip,
                            avoid={task.instruction.strip() for task in
                                   tasks.rl + tasks.heldout_family + sum(tasks.benchmarks.values(), [])})
    return pretrain(policy, run.tok, config, opt=opt, sched=sched, dp=run.dp)
