"""The TITO / R3 ablation: how far the trainer's log-probs are from the rollout engine's, and why.

`t1 mismatch [--episodes N] [--seeds 0,1,2] [--out result.json] [--rollout.key=value ...]` (or
`python -m t1cli.experiments.mismatch`); the episodes' limits are a [rollout] section (`ROLLOUT`, changed by
`--config FILE` and `--rollout.key=value` as the trainer's are)

Legend: T packed tokens, L_moe MoE layers, K top-k experts.

The rollout side and the training side compute with different numerics, as in a real deployment: episodes are
sampled by a `TorchEngine` over a bf16 copy of the policy (prefill + one-token decode steps against a KV cache,
continuous batching), while the trainer runs one fp32 full forward over the packed trajectories. Routing therefore
flips on some (token, layer) pairs, and every condition below is measured on the same episodes:

    (a) re-tokenized   the transcript re-rendered and re-tokenized (`t1core.retokenize`), trainer's own routing
    (b) TITO           the exact sampled token ids, trainer's own routing
    (c) TITO + R3      the exact ids, the experts the engine chose replayed in every MoE layer
    control            the bf16 rollout model itself, as a full forward with exact ids + R3: what incremental
                       decoding and batch shapes alone leave (no dtype difference)
    (d) bitwise        episodes of their own (same seeds), sampled by an fp32 batch-invariant engine and scored
                       with algo.bitwise's forward (`t1core.update.policy_logprobs(bitwise=True)`): exact ids +
                       R3 + the engine's reduction order, so gap and max |d| are exactly 0

Per condition, with d = logp_train - logp_rollout over the loss tokens (`t1core.losses.mismatch_metrics`): gap =
mean |d| per trajectory then over trajectories, k3 KL, the share of |d| > ln 2, max |d|. Drift = loss-region
tokens the trainer scores that differ from what the engine returned (checked against a record the engine wrapper
kept, not against the trajectory). Routing agreement = share of (token, layer) pairs where the trainer's router,
in that condition's forward, picks the expert set the engine recorded; "tokens flipped" = share of tokens with at
least one disagreeing layer. All tokens of a trajectory count (the engine records routing for prompt,
observation and glue tokens too).

Episodes are real multi-turn episodes of the built-in task families in Docker sandboxes. The policy is the tiny
model warm-started the way `t1core.train` does it (reference-solution transcripts through the agent loop, then
SFT), so replies look like tool calls; `--sft-epochs 0` samples from the raw initialisation instead, and
`--checkpoint DIR` uses a trained HF checkpoint.
"""

from __future__ import annotations

import t1model.cpu_threads  # noqa: F401  (first: OpenMP reads its settings when torch loads it)
import argparse
import contextlib
import copy
import difflib
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from t1kernels.moe import route
from rollout.agent import AgentConfig, EpisodeSpec, run_episodes
from rollout.config import RolloutSection
from rollout.sampling import derive_seed
from rollout.torch_engine import EngineConfig, TorchEngine
from rollout.trajectory import Trajectory, save_trajectories
from sandbox.tasks import suite
from sandbox.cli import Parser, bad_input
from sandbox.images.task_images import TaskImage, build_task_image, default_base_image_overrides
from sandbox.tasks.format import Task
from t1config.cli import add_config_argument, parse_known
from t1config.toml import load
from t1core.batch import PackedBatch, pack
from t1core.drift import CompletionLog
from t1core.losses import mismatch_metrics
from t1model.dtypes import DTYPES
from t1model.hf_io import load_pretrained
from t1model.model import ModelConfig, MoEModel
from t1core.retokenize import retokenize
from t1model.tokenizer import ChatTokenizer
from t1core.update import policy_logprobs, sft_update
from t1core.warmstart import reference_transcripts


CONDITIONS: dict[str, str] = {
    "retokenized": "(a) re-tokenized, no replay",
    "tito": "(b) TITO (exact ids), no replay",
    "tito_r3": "(c) TITO + R3 (exact ids + replay)",
    "control": "control: rollout model, full fwd, (c)",
    "bitwise": "(d) bitwise: fp32 engine order, (c)",
}


ROLLOUT = RolloutSection(max_turns=3, max_new_tokens_per_turn=48, max_tokens=1024, concurrency=4,
                         batch_invariant=False)
"""The experiment's episodes: three short turns of the tiny model, four at once. batch_invariant is the bitwise
condition's alone ((d) builds its own engine); (a)-(c) sample as a plain engine does."""


@dataclass(frozen=True, kw_only=True)
class MismatchConfig:
    """What the experiment runs; the defaults take a few minutes on a 2-core CPU."""

    num_episodes: int = 8
    """Episodes collected per seed (round-robin over the tasks)."""
    seeds: tuple[int, ...] = (0, 1)
    """Sampling seeds; each collects its own episodes. The table pools all of them, the JSON keeps each one."""
    families: tuple[str, ...] = suite.SHORT_FAMILIES
    """Task families; one training instance of each is written and built, used for SFT and for the episodes."""
    task_seed: int = 0
    """Seed of the task instances."""
    sft_epochs: int = 16
    """Warm-start passes over the reference transcripts (16 at 3e-3: replies are mostly well-formed tool calls
    whose commands run); 0 samples from the raw initialisation (gibberish replies, much faster)."""
    sft_lr: float = 3e-3
    """Warm-start learning rate (AdamW)."""
    sft_minibatch_tokens: int = 512
    """Tokens per warm-start optimizer step (whole transcripts are packed)."""
    checkpoint: str | None = None
    """A HF Qwen3-MoE checkpoint directory to use as the policy instead of the warm start."""
    model_seed: int = 0
    """Initialisation (and SFT order) seed of the tiny policy."""
    rollout_dtype: str = "bfloat16"
    """dtype of the engine's copy of the policy; the trainer side is always fp32."""
    rollout: RolloutSection = ROLLOUT
    """The episodes' turns, token budgets, temperature (the trainer's log-probs use the same one) and concurrency."""
    work_dir: str | None = None
    """Where task instances are written; None: a temporary directory removed at the end."""
    trajectories_dir: str | None = None
    """Save the collected episodes here (`rollout.trajectory.save_trajectories`); None: not saved."""

    def __post_init__(self) -> None:
        for name in ("num_episodes", "sft_minibatch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"MismatchConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if not self.seeds or any(s < 0 for s in self.seeds):
            raise ValueError(f"MismatchConfig.seeds: expected a non-empty tuple of seeds >= 0, got {self.seeds}")
        unknown = [f for f in self.families if f not in suite.FAMILIES]
        if not self.families or unknown:
            raise ValueError(f"MismatchConfig.families: expected names from {sorted(suite.FAMILIES)}, got "
                             f"{list(self.families)}")
        if self.sft_epochs < 0 or not self.sft_lr > 0:
            raise ValueError(f"MismatchConfig: expected sft_epochs >= 0 and sft_lr > 0, got {self.sft_epochs}, "
                             f"{self.sft_lr}")
        if self.rollout_dtype not in DTYPES:
            raise ValueError(f"MismatchConfig.rollout_dtype: expected one of {list(DTYPES)}, got "
                             f"{self.rollout_dtype!r}")
        if not self.rollout.temperature > 0:
            raise ValueError(f"rollout.temperature: expected > 0 (the experiment scores sampled tokens), got "
                             f"{self.rollout.temperature}")

    def agent_config(self) -> AgentConfig:
        return AgentConfig(rollout=self.rollout)


def _span_drift(sampled: list[int], trained: list[int]) -> int:
    """Tokens in which two token sequences differ: each non-matching run of a difflib alignment counts the
    longer of its two sides (a substitution of 2 tokens by 3 counts 3)."""
    ops = difflib.SequenceMatcher(a=sampled, b=trained, autojunk=False).get_opcodes()
    return sum(max(i1 - i0, j1 - j0) for tag, i0, i1, j0, j1 in ops if tag != "equal")


def loss_region_drift(trained: Trajectory, tito: Trajectory, sampled: dict[tuple[int, ...], list[list[int]]]) -> int:
    """Drift of the loss region the trainer scores (`trained`'s turns) against the engine's record.

    `tito` is the episode as collected: its turn n's prompt (the ids before the turn) keys the record. A prompt
    sampled more than once (the first turn of one task in several episodes) takes its closest record. A turn the
    record does not know, or one `trained` lost, counts in full.
    """
    ids = tito.token_ids.tolist()
    trained_ids = trained.token_ids.tolist()
    total = 0
    for n, turn in enumerate(tito.turns):
        span = trained_ids[trained.turns[n].start:trained.turns[n].end] if n < len(trained.turns) else []
        candidates = sampled.get(tuple(ids[:turn.start]), [])
        total += min((_span_drift(c, span) for c in candidates), default=max(len(span), turn.end - turn.start))
    return total


@contextlib.contextmanager
def router_choices(model: MoEModel) -> Iterator[list[torch.Tensor]]:
    """Inside the block, each MoE layer appends the top-k ids [T, K] its own router would pick in that forward
    (in layer order), whatever routing the forward actually replays."""
    picks: list[torch.Tensor] = []
    handles = []
    for layer in model.model.layers:
        if layer.is_moe:
            k = layer.mlp.top_k
            handles.append(layer.mlp.gate.register_forward_hook(
                lambda _m, _inp, logits_TE, k=k: picks.append(route(logits_TE.detach(), k)[1])))
    try:
        yield picks
    finally:
        for h in handles:
            h.remove()


@dataclass
class ConditionScores:
    """Per-token results of one condition on one set of trajectories; `pool` merges seeds."""

    logp_train_T: torch.Tensor
    logp_rollout_T: torch.Tensor
    mask_T: torch.Tensor
    traj_index_T: torch.Tensor
    num_trajectories: int
    drift_tokens: int
    routing_counts: tuple[int, int, int, int] | None
    """(agreeing (token, layer) pairs, pairs, tokens with a disagreeing layer, tokens), None without a record."""
    flipped_T: torch.Tensor | None
    """Positions whose routing disagrees with the record in at least one layer (None without a record); for
    (c), the flips of (b), so that both split the same tokens."""

    @staticmethod
    def pool(parts: list[ConditionScores]) -> ConditionScores:
        offsets, n = [], 0
        for p in parts:
            offsets.append(n)
            n += p.num_trajectories
        counts, flipped_T = None, None
        if all(p.routing_counts is not None for p in parts):
            counts = tuple(sum(c) for c in zip(*(p.routing_counts for p in parts)))
            flipped_T = torch.cat([p.flipped_T for p in parts])
        return ConditionScores(torch.cat([p.logp_train_T for p in parts]),
                               torch.cat([p.logp_rollout_T for p in parts]), torch.cat([p.mask_T for p in parts]),
                               torch.cat([p.traj_index_T + o for p, o in zip(parts, offsets)]), n,
                               sum(p.drift_tokens for p in parts), counts, flipped_T)

    def summary(self) -> dict[str, float | None]:
        m = mismatch_metrics(self.logp_train_T, self.logp_rollout_T, self.mask_T, self.traj_index_T,
                             num_trajectories=self.num_trajectories)
        agree, pairs, flipped, tokens = self.routing_counts or (0, 0, 0, 0)
        return {"drift_tokens": float(self.drift_tokens), "gap": float(m["mismatch/gap"]),
                "k3": float(m["mismatch/k3"]), "extreme_frac": float(m["mismatch/extreme_frac"]),
                "max_abs": float(m["mismatch/max_abs"]),
                "routing_agreement": agree / pairs if self.routing_counts else None,
                "tokens_flipped_frac": flipped / tokens if self.routing_counts else None,
                "routing_flips": float(pairs - agree) if self.routing_counts else None,
                "loss_tokens": float(self.mask_T.sum()), "trajectories": float(self.num_trajectories),
                **self._split_by_flips()}

    def _split_by_flips(self) -> dict[str, float | None]:
        """Token mean |d| over loss positions whose own routing flipped somewhere vs the rest: where R3 acts."""
        if self.flipped_T is None:
            return {}
        abs_d_T = (self.logp_train_T.double() - self.logp_rollout_T.double()).abs()
        out: dict[str, float | None] = {}
        for name, sel_T in (("flipped", self.flipped_T), ("unflipped", ~self.flipped_T)):
            keep_T = self.mask_T & sel_T
            out[f"loss_tokens_{name}"] = float(keep_T.sum())
            out[f"mean_abs_d_{name}"] = float(abs_d_T[keep_T].mean()) if bool(keep_T.any()) else None
        return out


def _same_experts(own_TLK: torch.Tensor, recorded_TLK: torch.Tensor) -> torch.Tensor:
    """[T, L_moe] bool: the two routings chose the same expert SET (order within the top-k is irrelevant, as in
    t1core.losses.routing_agreement)."""
    return (own_TLK.long().sort(-1).values == recorded_TLK.long().sort(-1).values).all(-1)


def _routing_counts(own_TLK: torch.Tensor, recorded_TLK: torch.Tensor) -> tuple[int, int, int, int]:
    same_TL = _same_experts(own_TLK, recorded_TLK)
    return int(same_TL.sum()), same_TL.numel(), int((~same_TL).any(-1).sum()), same_TL.shape[0]


def _score(model: MoEModel, batch: PackedBatch, trained: list[Trajectory], tito: list[Trajectory],
           sampled: dict[tuple[int, ...], list[list[int]]], *, replay: bool, temperature: float,
           bitwise: bool = False) -> ConditionScores:
    with torch.no_grad(), router_choices(model) as picks:
        logp_T, _ = policy_logprobs(model, batch, temperature=temperature, replay=replay, bitwise=bitwise)
    counts, flipped_T = None, None
    if batch.routing_TLK is not None:
        own_TLK = torch.stack(picks, dim=1)
        counts = _routing_counts(own_TLK, batch.routing_TLK)
        flipped_T = ~_same_experts(own_TLK, batch.routing_TLK).all(-1)
    drift = sum(loss_region_drift(tr, t, sampled) for tr, t in zip(trained, tito))
    return ConditionScores(logp_T.float(), batch.rollout_logp_T, batch.loss_mask_T, batch.traj_index_T,
                           len(trained), drift, counts, flipped_T)


def _kept(trajs: list[Trajectory]) -> list[Trajectory]:
    """The episodes with sampled tokens (each with its routing)."""
    kept = [t for t in trajs if bool(t.loss_mask.any())]
    if not kept:
        raise RuntimeError(f"none of {len(trajs)} episodes has sampled tokens (finish reasons: "
                           f"{sorted({t.finish_reason for t in trajs})})")
    if any(t.routing is None for t in kept):
        raise RuntimeError("an episode came back without routing: the engine must capture it for R3")
    return kept


def measure(policy: MoEModel, rollout_model: MoEModel, trajs: list[Trajectory], record: CompletionLog,
            tok: ChatTokenizer, *, temperature: float) -> dict[str, ConditionScores]:
    """Score the collected episodes under conditions (a), (b), (c) and the control of the module docstring."""
    kept = _kept(trajs)
    retok = [retokenize(t, tok)[0] for t in kept]
    exact = pack(kept, with_routing=True)
    plan = {"retokenized": (policy, pack(retok, with_routing=False), retok, False),
            "tito": (policy, exact, kept, False), "tito_r3": (policy, exact, kept, True),
            "control": (rollout_model, exact, kept, True)}
    scores = {name: _score(model, batch, trained, kept, record.sampled, replay=replay, temperature=temperature)
              for name, (model, batch, trained, replay) in plan.items()}
    # (b) and (c) split their tokens by the same flips: where the fp32 router, left alone, leaves the record.
    scores["tito_r3"].flipped_T = scores["tito"].flipped_T
    return scores


def prepare_tasks(cfg: MismatchConfig, out_dir: Path) -> tuple[list[Task], dict[str, str]]:
    """One training instance per family, written under out_dir, and their images (built or cached)."""
    tasks = suite.family_tasks(out_dir, split="train", num_per_family=1, seed=cfg.task_seed,
                               families=list(cfg.families))
    overrides = default_base_image_overrides()
    return tasks, {t.name: build_task_image(t, base_image_overrides=overrides) for t in tasks}


def warm_start(cfg: MismatchConfig, tasks: list[Task], images: dict[str, TaskImage], tok: ChatTokenizer,
               log: Callable[[str], None]) -> tuple[MoEModel, dict[str, float]]:
    """The fp32 policy: a checkpoint, or the tiny model after `sft_epochs` of SFT on reference transcripts."""
    if cfg.checkpoint is not None:
        return load_pretrained(cfg.checkpoint, dtype=torch.float32).eval(), {}
    policy = MoEModel(ModelConfig.tiny(), seed=cfg.model_seed)
    if cfg.sft_epochs == 0:
        return policy.eval(), {}
    transcripts, metrics = reference_transcripts(tasks, images, tok=tok, config=cfg.agent_config(),
                                                 num_parallel=cfg.num_parallel)
    if not transcripts:
        raise RuntimeError("no reference transcript passed its verifiers: nothing to warm-start on")
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.sft_lr, foreach=False)
    gen = torch.Generator().manual_seed(cfg.model_seed)
    for epoch in range(cfg.sft_epochs):
        m = sft_update(transcripts, policy=policy, opt=opt, sched=None, grad_clip=1.0,
                       minibatch_tokens=cfg.sft_minibatch_tokens, generator=gen)
        log(f"  sft epoch {epoch + 1}/{cfg.sft_epochs}: nll {m['sft/nll']:.3f}")
    return policy.eval().requires_grad_(False), {**metrics, "sft/nll_last_epoch": m["sft/nll"]}


def measure_bitwise(policy: MoEModel, trajs: list[Trajectory], record: CompletionLog, *,
                    temperature: float) -> ConditionScores:
    """Condition (d): episodes from the fp32 batch-invariant engine, scored with the bitwise forward + R3."""
    kept = _kept(trajs)
    return _score(policy, pack(kept, with_routing=True), kept, kept, record.sampled, replay=True,
                  temperature=temperature, bitwise=True)


def collect(rollout_model: MoEModel, tasks: list[Task], images: dict[str, TaskImage], tok: ChatTokenizer,
            cfg: MismatchConfig, *, seed: int, batch_invariant: bool = False) -> tuple[list[Trajectory], CompletionLog]:
    """`num_episodes` real episodes sampled by a fresh engine over `rollout_model`, and the engine's record."""
    r = cfg.rollout
    ecfg = EngineConfig.for_parallel(r.concurrency, max_seq_len=r.max_seq_len, batch_invariant=batch_invariant)
    specs = [EpisodeSpec(task=tasks[i % len(tasks)], image=images[tasks[i % len(tasks)].name],
                         seed=derive_seed(seed, i)) for i in range(cfg.num_episodes)]
    with TorchEngine(rollout_model, ecfg) as engine:
        record = CompletionLog(engine)
        trajs = run_episodes(record, tok, specs, config=cfg.agent_config(), num_parallel=r.concurrency)
    return trajs, record


def _episode_stats(trajs: list[Trajectory]) -> dict[str, float]:
    return {"episodes": float(len(trajs)), "turns": float(sum(len(t.turns) for t in trajs)),
            "tokens": float(sum(t.num_tokens for t in trajs)),
            "sampled_tokens": float(sum(int(t.loss_mask.sum()) for t in trajs)),
            "tool_calls": float(sum(t.metrics.get("commands", 0) for t in trajs)),
            "malformed_tool_calls": float(sum(t.metrics.get("malformed_tool_calls", 0) for t in trajs)),
            "done": float(sum(t.finish_reason == "done" for t in trajs)),
            "sandbox_errors": float(sum(t.finish_reason.startswith("sandbox_error") for t in trajs))}


@dataclass(frozen=True)
class MismatchResult:
    """Pooled rows (condition -> metrics), the same per seed, episode statistics and timings."""

    config: MismatchConfig
    rows: dict[str, dict[str, float | None]]
    per_seed: dict[int, dict[str, dict[str, float | None]]]
    episodes: dict[str, float]
    warm_start: dict[str, float]
    wall_s: float

    @property
    def ordering_holds(self) -> bool:
        """gap (c) < (b) < (a): what the paper's ablation shows."""
        gap = {k: r["gap"] for k, r in self.rows.items()}
        return gap["tito_r3"] < gap["tito"] < gap["retokenized"]

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "rows": self.rows, "labels": CONDITIONS,
                "per_seed": {str(k): v for k, v in self.per_seed.items()}, "episodes": self.episodes,
                "warm_start": self.warm_start, "ordering_holds": self.ordering_holds, "wall_s": self.wall_s}


@contextlib.contextmanager
def _work_dir(path: str | None) -> Iterator[Path]:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="t1-mismatch-") as tmp:
        yield Path(tmp)


def run_experiment(config: MismatchConfig | None = None, *,
                   log: Callable[[str], None] = lambda s: None) -> MismatchResult:
    """Tasks -> policy -> per seed: episodes from the rollout-dtype engine, scored under every condition."""
    cfg = config or MismatchConfig()
    t0 = time.perf_counter()
    tok = ChatTokenizer.builtin()
    if cfg.checkpoint is not None and (Path(cfg.checkpoint) / "tokenizer.json").is_file():
        tok = ChatTokenizer.from_pretrained(cfg.checkpoint)
    with _work_dir(cfg.work_dir) as work:
        tasks, images = prepare_tasks(cfg, work)
        log(f"{len(tasks)} tasks ready ({time.perf_counter() - t0:.0f}s); warm start ...")
        policy, warm = warm_start(cfg, tasks, images, tok, log)
        rollout_model = copy.deepcopy(policy).to(DTYPES[cfg.rollout_dtype]).eval().requires_grad_(False)
        parts: dict[str, list[ConditionScores]] = defaultdict(list)
        per_seed, all_trajs = {}, []
        for seed in cfg.seeds:
            log(f"seed {seed}: {cfg.num_episodes} episodes ({time.perf_counter() - t0:.0f}s)")
            trajs, record = collect(rollout_model, tasks, images, tok, cfg, seed=seed)
            scores = measure(policy, rollout_model, trajs, record, tok, temperature=cfg.rollout.temperature)
            bw_trajs, bw_record = collect(policy, tasks, images, tok, cfg, seed=seed, batch_invariant=True)
            scores["bitwise"] = measure_bitwise(policy, bw_trajs, bw_record, temperature=cfg.rollout.temperature)
            per_seed[seed] = {name: s.summary() for name, s in scores.items()}
            for name, s in scores.items():
                parts[name].append(s)
            all_trajs += trajs
    if cfg.trajectories_dir is not None:
        save_trajectories(all_trajs, cfg.trajectories_dir)
    rows = {name: ConditionScores.pool(p).summary() for name, p in parts.items()}
    return MismatchResult(cfg, rows, per_seed, _episode_stats(all_trajs), warm, time.perf_counter() - t0)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(result: MismatchResult) -> str:
    """The rows as aligned text, with a line on the episodes and on the expected ordering."""
    head = (f"{'condition':<40} {'drift':>6} {'gap':>8} {'k3':>9} {'|d|>ln2':>8} {'max|d|':>7} "
            f"{'route agree':>11} {'tok flipped':>11}")
    lines = [head, "-" * len(head)]
    for name, label in CONDITIONS.items():
        r = result.rows[name]
        lines.append(f"{label:<40} {r['drift_tokens']:>6.0f} {r['gap']:>8.5f} {r['k3']:>9.2e} "
                     f"{r['extreme_frac']:>8.4f} {r['max_abs']:>7.3f} {_fmt(r['routing_agreement'], '.4f'):>11} "
                     f"{_fmt(r['tokens_flipped_frac'], '.4f'):>11}")
    e, c = result.episodes, result.config
    lines.append(f"{e['episodes']:.0f} episodes ({e['turns']:.0f} turns, {e['sampled_tokens']:.0f} sampled tokens, "
                 f"{e['tool_calls']:.0f} tool calls run, {e['malformed_tool_calls']:.0f} malformed), seeds "
                 f"{list(c.seeds)}, rollout {c.rollout_dtype} KV-cache decoding vs fp32 full forward; "
                 f"{result.wall_s:.0f}s")
    b, c = result.rows["tito"], result.rows["tito_r3"]
    lines.append(f"mean |d| on loss tokens whose routing flipped ({b['loss_tokens_flipped']:.0f} in (b)): "
                 f"(b) {_fmt(b['mean_abs_d_flipped'], '.5f')}, (c) {_fmt(c['mean_abs_d_flipped'], '.5f')}; "
                 f"on the others: (b) {_fmt(b['mean_abs_d_unflipped'], '.5f')}, "
                 f"(c) {_fmt(c['mean_abs_d_unflipped'], '.5f')}")
    flips = b["routing_flips"]
    lines.append(f"routing flips (token, layer) bf16 engine vs fp32 trainer: {flips:.0f}; "
                 f"gap (c) < (b) < (a): {'yes' if result.ordering_holds else 'NO'}")
    d = result.rows["bitwise"]
    exact = d["gap"] == 0.0 and d["max_abs"] == 0.0 and d["drift_tokens"] == 0
    lines.append(f"(d) on {d['trajectories']:.0f} episodes of its own ({d['loss_tokens']:.0f} sampled tokens) from the "
                 f"fp32 batch-invariant engine: gap and max |d| exactly 0, drift 0: {'yes' if exact else 'NO'}")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> tuple[MismatchConfig, str | None]:
    d = MismatchConfig()
    p = Parser(prog="python -m t1cli.experiments.mismatch", description=__doc__.splitlines()[0],
               epilog="example: python -m t1cli.experiments.mismatch --episodes 8 --out runs/mismatch.json")
    p.add_argument("--episodes", type=int, default=d.num_episodes, help="episodes per seed")
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="comma-separated sampling seeds")
    p.add_argument("--families", default=",".join(d.families), help="comma-separated task families")
    p.add_argument("--sft-epochs", type=int, default=d.sft_epochs, help="warm-start epochs (0: raw init)")
    p.add_argument("--sft-lr", type=float, default=d.sft_lr)
    p.add_argument("--checkpoint", default=None, help="HF checkpoint dir to use as the policy (skips warm start)")
    p.add_argument("--rollout-dtype", default=d.rollout_dtype, choices=sorted(DTYPES))
    p.add_argument("--work-dir", default=None, help="where task instances are written (default: a temp dir)")
    p.add_argument("--trajectories", default=None, help="save the collected episodes in this directory")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    add_config_argument(p, "a trainer's; its [rollout] is read over the experiment's ROLLOUT")
    with bad_input(p):
        a, overrides = parse_known(p, argv)
        (rollout,) = load(a.config, overrides, {"rollout": RolloutSection}, others=None,
                          base={"rollout": ROLLOUT}).values()
        return _config(a, rollout), a.out


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _config(a: argparse.Namespace, rollout: RolloutSection) -> MismatchConfig:
    return MismatchConfig(num_episodes=a.episodes, seeds=_int_list(a.seeds, "--seeds"),
                         families=tuple(f for f in a.families.split(",") if f), sft_epochs=a.sft_epochs,
                         sft_lr=a.sft_lr, checkpoint=a.checkpoint, rollout_dtype=a.rollout_dtype,
                         rollout=rollout, work_dir=a.work_dir,
                         trajectories_dir=a.trajectories)


def main(argv: list[str] | None = None) -> int:
    cfg, out = _parse_args(argv)
    result = run_experiment(cfg, log=lambda s: print(s, flush=True))
    print(format_table(result))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
