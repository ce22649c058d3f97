"""What the actor and critic train and how fast: the frozen parameters (optim.actor_frozen) and AdamW with its
learning-rate schedule (warmup, optional decay or run-progress factor)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import torch

from t1core.config import RunConfig


def frozen_parameters(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of `model`'s parameters that match any fnmatch pattern (`optim.actor_frozen`); a pattern that matches
    nothing is a ValueError naming it (a typo would otherwise train everything without a word)."""
    names = [n for n, _ in model.named_parameters()]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"optim.actor_frozen: {unmatched} match no parameter of the policy "
                         f"(names look like {names[:3]})")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def freeze(model: torch.nn.Module, names: Sequence[str]) -> None:
    """No gradient (so no optimizer step) for the parameters `names` (`frozen_parameters`); all others train."""
    frozen = set(names)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def make_optimizer(model: torch.nn.Module, *, lr: float, cfg: RunConfig, decay_steps: int | None = None,
                   progress: Callable[[], float] | None = None,
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a linear warmup over `optim.warmup_steps`; with `decay_steps`, times a linear decay that reaches
    0 at optimizer step `decay_steps` (the LambdaLR must be stepped once per optimizer step); with `progress`,
    times 1 - progress() (a fraction of the run done, read whenever the rate is set: `refresh_lr`)."""
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=o.betas, weight_decay=o.weight_decay,
                            foreach=False)  # foreach=False: one fixed reduction order per parameter
    warmup = o.warmup_steps

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        if progress is not None:
            ramp *= max(0.0, 1.0 - progress())
        return ramp * max(0.0, 1.0 - step / decay_steps) if decay_steps else ramp

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def refresh_lr(sched: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the rates from the schedule's factor now (a `progress` factor moves between optimizer steps)."""
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
