"""Warm start, part (a): supervised transcripts of the demonstrations, built with the TITO construction.

A `ReferenceEngine` stands in for the policy and "samples" a fixed script per task: the demonstration's bash
tool calls (one for most tasks; a look at a file first where the instruction leaves the answer open), then
the done marker. The demonstration is the task's reference solution, except for the family instances whose
demonstration leaves out the finishing step (about half: `sandbox.tasks.families.finish`), which is the shortfall of
the warm start that RL then has to find. Everything else is the real agent loop: the real sandbox runs the solution, the real
observation is tokenized on its own and appended, glue tokens get loss mask 0, and the verifiers score the
episode. So SFT sees exactly the token layout RL will sample in, and a reference that does not pass its own
verifiers is caught (and left out) here.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future

import torch

from rollout.agent import DONE_MARKER, AgentConfig, EpisodeSpec, run_episodes
from rollout.engine import Completion, SamplingParams, generate_via_submit
from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory
from sandbox.tasks.suite import demonstration_turns
from sandbox.images.task_images import TaskImage
from sandbox.tasks.format import Task
from t1core.distributed import DataParallel
from t1model.tokenizer import ChatTokenizer, format_tool_call


class ReferenceEngine:
    """An `Engine` whose reply n to an episode of task X is script[X][n] (teacher forcing for SFT).

    The episode is recognised by its first prompt (system + instruction), the turn by the number of
    assistant headers in the prompt. Given each episode's seed (`seeds`), both are known instead by the request's
    sampling seed (`seeds`: episode seed -> first prompt; turn n of an episode of seed s samples with `derive_seed(s, n)`, `rollout.agent`), which also
    holds in a compacted context: its prompt starts with a summary, not the first prompt, and shows only the last
    turns. Replies are written text, tokenized once, closed by <|im_end|>.
    """

    def __init__(self, tok: ChatTokenizer, scripts: dict[tuple[int, ...], list[str]], *,
                 seeds: dict[int, tuple[int, ...]] | None = None) -> None:
        self.tok = tok
        self._header = tok.encode("<|im_start|>assistant\n")
        self._replies = {key: [tok.encode(text) + [tok.im_end_id] for text in texts]
                         for key, texts in scripts.items()}
        self._prefix_len = {len(k) for k in scripts}
        self._by_seed = {derive_seed(seed, n): (key, n) for seed, key in (seeds or {}).items()
                         for n in range(len(self._replies[key]))}

    @property
    def policy_version(self) -> int:
        return 0

    def _turn(self, prompt: list[int]) -> int:
        h, n = self._header, 0
        for i in range(len(prompt) - len(h) + 1):
            n += prompt[i:i + len(h)] == h
        return n - 1

    def longest_reply(self, key: tuple[int, ...]) -> int:
        """Tokens of the longest scripted reply of the episode whose first prompt is `key`, <|im_end|> included."""
        return max(len(ids) for ids in self._replies[key])

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Completion]:
        key, turn = self._by_seed.get(params.seed, (None, 0))
        if key is None:
            key = next((tuple(prompt[:n]) for n in self._prefix_len if tuple(prompt[:n]) in self._replies), None)
            turn = self._turn(prompt) if key is not None else 0
        if key is None:
            raise ValueError("ReferenceEngine: prompt of an episode it has no script for")
        replies = self._replies[key]
        ids = replies[min(turn, len(replies) - 1)]
        fut: Future[Completion] = Future()
        fut.set_result(Completion(token_ids=ids, logprobs=torch.zeros(len(ids)), routing=None,
                                  finish_reason="stop"))
        return fut

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_via_submit(self, prompts, params)


def reference_transcripts(tasks: list[Task], images: dict[str, TaskImage], *, tok: ChatTokenizer, config: AgentConfig,
                          num_parallel: int, pool_size: int | None = None,
                          dp: DataParallel = DataParallel.single(),
                          ) -> tuple[list[Trajectory], dict[str, float]]:
    """Run every task's demonstration through the agent loop. With `config.verify`, keep only the transcripts
    that pass all their verifiers but the ones an incomplete demonstration is meant to leave failing (and fail
    those); without, those that ran to the done marker.
    Returns (transcripts, metrics), in task order. Under torchrun rank r runs tasks r, r + W, ... in its own
    sandboxes and every rank gets all transcripts (the same as one process would make: the replies are scripted)."""
    keys = [tuple(tok.encode_prompt(config.system_prompt, task.instruction)) for task in tasks]
    demos = [demonstration_turns(task) for task in tasks]
    scripts = [[*map(format_tool_call, turns), DONE_MARKER] for turns, _ in demos]
    meant_to_fail = {task.name: fails for task, (_, fails) in zip(tasks, demos)}
    specs = [EpisodeSpec(task=task, image=images[task.name], seed=i) for i, task in enumerate(tasks)]
    longest: dict[str, int] = {}
    mine = list(range(dp.rank, len(tasks), dp.world_size))
    is_mine = set(mine)
    trajs: dict[int, Trajectory] = {}
    for batch in _distinct_prompt_batches(keys, scripts):
        engine = ReferenceEngine(tok, {keys[i]: scripts[i] for i in batch},
                                 seeds={specs[i].seed: keys[i] for i in batch})
        longest.update({tasks[i].name: engine.longest_reply(keys[i]) for i in batch})
        batch = [i for i in batch if i in is_mine]
        for i, traj in zip(batch, run_episodes(engine, tok, [specs[i] for i in batch], config=config,
                                               num_parallel=num_parallel, pool_size=pool_size)):
            trajs[i] = traj
    every = dp.gather_strided([trajs[i] for i in mine], len(tasks))
    over_cap = _warn_replies_over_cap(longest, config.rollout.max_new_tokens_per_turn, quiet=not dp.is_main)

    def usable(t: Trajectory) -> bool:
        if config.verify:
            if t.verifier is None or not t.verifier["total"]:
                return False
            fails = meant_to_fail[t.task_name]  # per_test keys end with the test function's name
            return all(ok != any(key.endswith(f"::{n}") or key == n for n in fails)
                       for key, ok in t.verifier["per_test"].items())
        return t.finish_reason == "done"

    good, bad = [], []
    for t in every:  # one pass: each transcript is judged once
        (good if usable(t) else bad).append(t)
    if bad and dp.is_main:  # dropped, not fatal: one flaky sandbox should not end a run, but nobody should miss it
        print(f"warm start: {len(bad)} of {len(every)} reference transcripts dropped: "
              + "; ".join(f"{t.task_name} ({t.finish_reason}, verifier {t.verifier})" for t in bad[:10]),
              file=sys.stderr, flush=True)
    metrics = {"sft/transcripts": float(len(good)), "sft/reference_failures": float(len(bad)),
               "sft/replies_over_cap": float(over_cap)}
    return good, metrics


def _distinct_prompt_batches(keys: list[tuple[int, ...]], scripts: list[list[str]]) -> list[list[int]]:
    """Task indices in batches within which no two tasks share a first prompt but differ in their script.

    `ReferenceEngine` tells episodes apart by their first prompt only, so two tasks with the same instruction and
    different reference solutions must not run against one engine (the later script would answer both). Tasks
    with equal prompts and equal scripts may share. Almost always a single batch.
    """
    batches: list[tuple[list[int], dict[tuple[int, ...], list[str]]]] = []
    for i, (key, script) in enumerate(zip(keys, scripts)):
        for members, seen in batches:
            if seen.get(key, script) == script:
                members.append(i)
                seen[key] = script
                break
        else:
            batches.append(([i], {key: script}))
    return [members for members, _ in batches]


def _warn_replies_over_cap(longest: dict[str, int], cap: int, *, quiet: bool = False) -> int:
    """SFT teaches replies the sampler then cuts at `cap` tokens: every such reply is malformed at rollout (an
    unclosed tool call), so its task cannot be solved: a family whose reference replies are longer than the cap
    scores 0 for that reason alone."""
    over = {name: n for name, n in longest.items() if n > cap}
    if over and not quiet:
        worst = sorted(over.items(), key=lambda kv: -kv[1])[:5]
        print(f"warm start: {len(over)} of {len(longest)} reference transcripts have a reply longer than "
              f"rollout.max_new_tokens_per_turn ({cap}); the policy cannot sample them whole: "
              + ", ".join(f"{name} ({n} tokens)" for name, n in worst), file=sys.stderr, flush=True)
    return len(over)
