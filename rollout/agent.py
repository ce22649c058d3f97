"""Multi-turn agent episodes in Docker sandboxes, many at once, sharing one engine.

One episode: the system prompt and the task instruction are tokenized once; then, each turn, the engine
samples a reply to the full token sequence so far, the tool call is parsed from the decoded reply (decoding
is for parsing and display only; the IDs are kept verbatim), the sandbox runs the command, and the output
is tokenized on its own as the next user message and appended (see `rollout.tito`). The episode ends when
the agent writes the done marker without a tool call, or at the turn limit, the token budget or the wall-clock limit; then
the task's verifiers run and the dense reward (verifiers passed) is attached. With compaction on, a full context is
folded into a new one and the episode goes on (`rollout.compaction`).

A reply without a parseable tool call is answered with an error observation (counted in metrics). A
sandbox failure (`SandboxError`: container died, shell gone) ends that episode with the reason recorded and no
verification; the other episodes go on. Who caused it decides what happens next (`sandbox.runtime.failure`): the agent
("sandbox_error: ...", reward 0, trained like any failed attempt), or the infrastructure ("infra: ...": the
episode is run again from scratch, same task and seed, on another host, up to rollout.infra_retries times;
one that still fails keeps its "infra" reason and the trainer leaves it out of the update: `is_masked`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from rollout.compaction import COMPACT_AT, SUMMARY_REQUEST, Compaction, cap_observation, extractive_summary, fit_summary
from rollout.config import ContextSection, RolloutSection
from rollout.engine import Engine, SamplingParams
from rollout.sampling import derive_seed
from rollout.tito import TitoBuilder, glue_ids
from rollout.trajectory import INFRA, Trajectory, Turn, is_infra
from sandbox.runtime.environment import Environment, EnvironmentProvider
from sandbox.errors import SandboxError
from sandbox.runtime.settings import SandboxSection, SandboxSettings
from sandbox.images.task_images import TaskImage
from sandbox.tasks.format import Task
from sandbox.runtime.verify import run_verifiers
from t1model.tokenizer import ChatTokenizer, ToolCall, format_tool_call, parse_tool_call

DONE_MARKER = "TASK_DONE"
PROBE_TURNS = (10, 100, 300)
"""Turns whose wall time (sampling the reply, running its command) an episode records as metrics `turn{n}_s`: a long
episode's turn should cost what its tenth did (compaction keeps the context bounded)."""

DEFAULT_SYSTEM_PROMPT = (
    "You are an autonomous agent working in a Linux shell inside a container. Solve the user's task by "
    "running shell commands. To run a command, reply with exactly one tool call:\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "<shell command>"}}\n</tool_call>\n'
    "Its output comes back inside <tool_response>. When the task is complete, reply without a tool call "
    f"and write {DONE_MARKER}."
)


def is_masked(traj: Trajectory) -> bool:
    """Whether the update must leave `traj` out: its sandbox died through no action of the agent, on every try."""
    return is_infra(traj.finish_reason)


def failure_reason(sandbox: Any, error: SandboxError) -> str:
    """An episode's finish_reason for `error`: "infra: ..." when the infrastructure caused it, else
    "sandbox_error: ..." (the agent's doing; `Environment.failure_origin` decides)."""
    origin = sandbox.failure_origin(error) if hasattr(sandbox, "failure_origin") else "agent"
    return f"{INFRA if origin == 'infra' else 'sandbox_error'}: {type(error).__name__}: {error}"


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How episodes run: the run config's [rollout], [sandbox] and [context] sections as they are (`rollout.config`,
    `sandbox.runtime.settings`: one name and one default per knob, checked there), and what no config file sets."""

    rollout: RolloutSection = RolloutSection()
    """Turns, token budgets, wall clock, sampling and infrastructure retries of every episode."""
    sandbox: SandboxSection = SandboxSection()
    """Limits of each episode's container (`SandboxSettings.for_run`) and the timeout of each command."""
    context: ContextSection = ContextSection()
    """Compaction and the observation cap."""
    task_timeouts: bool = False
    """Cut each episode at its own task's agent timeout (task.toml [agent] timeout_sec) instead of
    rollout.wall_clock_limit_s: benchmark tasks, whose timeouts are part of the benchmark."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """The system message; it must explain the tool-call format and the done marker."""
    verify: bool = True
    """Run the task's verifiers at the end (reward = verifiers passed)."""
    return_routing: bool = True
    """Ask the engine for the routing of every token (R3); False on an engine that cannot record it (the trajectory
    then carries none and the update routes with the trainer's own router: `t1core.rollout_ranks.routing_replay`)."""

    @property
    def compaction(self) -> Compaction | None:
        """context.compaction at COMPACT_AT of rollout.max_tokens (which then bounds each context, not the episode;
        the episode returns its earlier contexts as `Trajectory.earlier`); None: the episode ends at max_tokens."""
        c = self.context
        if c.compaction == "off":
            return None
        return Compaction(at_tokens=int(COMPACT_AT * self.rollout.max_tokens), keep_turns=c.keep_turns,
                          summary=c.compaction)


@dataclass(frozen=True)
class Action:
    """What a reply asks for: run `command`, or finish, or neither (`error` says why)."""

    command: str | None
    finish: bool
    error: str | None


def parse_action(text: str) -> Action:
    """The reply's action. A tool call wins over the done marker; a reply with neither is an error."""
    call = parse_tool_call(text)
    if isinstance(call, ToolCall):
        return Action(call.command, False, None)
    if call.kind == "no_tool_call" and DONE_MARKER in text:
        return Action(None, True, None)
    return Action(None, False, f"{call.kind}: {call.message}")


def _error_observation(message: str) -> str:
    return (f"ERROR: {message}. Reply with exactly one tool call, e.g.\n{format_tool_call('ls')}\n"
            f"or, when the task is complete, with {DONE_MARKER} and no tool call.")


class _Episode:
    """State of one running episode (kept out of `run_episode` to keep each step short)."""

    def __init__(self, engine: Engine, tok: ChatTokenizer, sandbox: Any, task: Task, config: AgentConfig,
                 seed: int) -> None:
        self.engine, self.tok, self.sandbox, self.task, self.cfg, self.seed = engine, tok, sandbox, task, config, seed
        self.builder = TitoBuilder(tok.encode_prompt(config.system_prompt, task.instruction))
        self.turn_end = tok.assistant_turn_end_ids()
        self.metrics: dict[str, float] = {"malformed_tool_calls": 0, "commands": 0, "command_timeouts": 0,
                                          "cached_prompt_tokens": 0, "prefilled_prompt_tokens": 0,
                                          "generate_s": 0.0, "command_s": 0.0}
        self.versions: set[int] = set()
        self.segments: list[Trajectory] = []  # contexts left by compaction, oldest first
        self.folded: list[Turn] = []  # turns replaced by the summary so far
        self.carried: list[Turn] = []  # turns the current context holds verbatim in its prompt
        self.summary_lines: list[str] = []
        self.start = time.monotonic()
        limit = task.agent_timeout_s if config.task_timeouts else config.rollout.wall_clock_limit_s
        self.deadline = self.start + limit
        self._instruction = task.instruction  # the current context's (with the summary once compacted)

    def _stop_reason(self) -> str | None:
        if time.monotonic() >= self.deadline:
            return "wall_clock"
        # Room for the pending tokens plus at least one sampled token.
        if len(self.builder.ids) + self.builder.pending_len() + 1 > self.cfg.rollout.max_tokens:
            return "token_budget"
        return None

    def _sample(self, turn: int) -> tuple[list[int], Any]:
        prompt = self.builder.next_prompt()
        room = self.cfg.rollout.max_tokens - len(prompt)
        params = SamplingParams(temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p,
                                max_new_tokens=min(self.cfg.rollout.max_new_tokens_per_turn, room),
                                stop_token_ids=tuple(self.tok.eos_ids), seed=derive_seed(self.seed, turn),
                                prompt_routing_from=len(self.builder.ids), return_routing=self.cfg.return_routing)
        t0 = time.monotonic()
        # Bounded by the episode's wall clock: a stalled engine ends the episode instead of hanging it.
        comp = self.engine.submit(prompt, params).result(timeout=max(1.0, self.deadline - t0))
        self.metrics["generate_s"] += time.monotonic() - t0
        self.metrics["cached_prompt_tokens"] += comp.num_cached_tokens
        self.metrics["prefilled_prompt_tokens"] += len(prompt) - comp.num_cached_tokens
        self.versions.add(comp.policy_version)
        return prompt, comp

    def step(self, turn: int) -> str | None:
        """One turn; returns the episode's finish reason when it ends here, else None."""
        prompt, comp = self._sample(turn)
        sampled = comp.token_ids
        body = sampled[:-1] if comp.finish_reason == "stop" else sampled
        text = self.tok.decode(body)
        self.builder.add_reply(prompt, comp, text=text)
        action = parse_action(text)
        if action.finish:
            return "done"
        if action.error is not None:
            self.metrics["malformed_tool_calls"] += 1
            output, exit_code = _error_observation(action.error), None
        else:
            t0 = time.monotonic()
            timeout = min(self.cfg.sandbox.command_timeout_s, max(1.0, self.deadline - time.monotonic()))
            res = self.sandbox.run(action.command, timeout=timeout)  # SandboxError propagates: episode over
            self.metrics["command_s"] += time.monotonic() - t0
            self.metrics["commands"] += 1
            self.metrics["command_timeouts"] += int(res.timed_out)
            output = res.output + (f"\n[command timed out after {timeout:.0f}s]" if res.timed_out else "")
            exit_code = None if res.timed_out else res.exit_code
        self.builder.set_turn_result(command=action.command, output=output, exit_code=exit_code,
                                     tool_error=action.error)
        body = cap_observation(output, self.tok, max_tokens=self.cfg.context.observation_max_tokens)
        self.builder.add_observation(glue_ids(sampled, comp.finish_reason, self.turn_end),
                                     self.tok.encode_tool_response(output, body_ids=body))
        return None

    def compact(self, turn: int) -> bool:
        """Go on in a new context when this one is full (module `rollout.compaction`); False when it cannot (one
        turn fills it: nothing to fold). The last keep_turns turns stay, fewer when only they are left."""
        c, old = self.cfg.compaction, self.builder
        keep = min(c.keep_turns, len(old.turns) - 1)  # a context of long turns keeps fewer, never none
        if keep < 1:
            return False
        folded = self.carried + old.turns[:len(old.turns) - keep]  # the turns carried in last time fold now
        self.carried = old.turns[len(old.turns) - keep:]
        self.summary_lines += self._summarize(folded, turn)
        self.folded += folded
        summary = fit_summary(self.summary_lines, self.tok, budget=c.summary_budget)
        kept_ids = old.ids[old.turns[-keep].start:] + old.pending
        self.segments.append(self._build(old, "compacted", instruction=self._instruction))
        self._instruction = f"{self.task.instruction}\n\n{summary}"
        self.builder = TitoBuilder(self.tok.encode_prompt(self.cfg.system_prompt, self._instruction) + kept_ids)
        self.metrics["compactions"] = self.metrics.get("compactions", 0) + 1
        return True

    def _summarize(self, folded: list[Turn], turn: int) -> list[str]:
        c = self.cfg.compaction
        if c.summary == "extractive":
            return extractive_summary(folded, first_turn=len(self.folded))
        transcript = "\n".join(extractive_summary(folded, first_turn=len(self.folded)))
        params = SamplingParams(temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p,
                                max_new_tokens=min(self.cfg.rollout.max_new_tokens_per_turn, c.summary_budget),
                                stop_token_ids=tuple(self.tok.eos_ids), seed=derive_seed(self.seed, turn, 2),
                                return_routing=self.cfg.return_routing)
        prompt = self.tok.encode_prompt(SUMMARY_REQUEST, transcript)
        comp = self.engine.submit(prompt, params).result(timeout=max(1.0, self.deadline - time.monotonic()))
        body = comp.token_ids[:-1] if comp.finish_reason == "stop" else comp.token_ids
        return [self.tok.decode(body).strip()]

    def run(self) -> Trajectory:
        reason = "max_turns"
        try:
            for turn in range(self.cfg.rollout.max_turns):
                c = self.cfg.compaction
                if c is not None and len(self.builder.ids) + self.builder.pending_len() >= c.at_tokens:
                    if not self.compact(turn):
                        reason = "token_budget"
                        break
                stop = self._stop_reason()
                if stop is not None:
                    reason = stop
                    break
                t0 = time.monotonic()
                done = self.step(turn)
                if turn + 1 in PROBE_TURNS:
                    self.metrics[f"turn{turn + 1}_s"] = time.monotonic() - t0
                if done is not None:
                    reason = done
                    break
        except SandboxError as e:
            reason = failure_reason(self.sandbox, e)
        except FutureTimeout:
            reason = "wall_clock"  # while waiting for the engine; that reply is dropped
        return self._finish(reason)

    def _finish(self, reason: str) -> Trajectory:
        verifier, reward = None, 0.0
        if self.cfg.verify and not reason.startswith(("sandbox_error", INFRA)):
            t0 = time.monotonic()
            try:
                result = run_verifiers(self.sandbox, self.task)
                self.metrics["verify_s"] = time.monotonic() - t0
                verifier, reward = result.to_json(), float(result.reward)
            except SandboxError as e:
                why = failure_reason(self.sandbox, e)
                # an infrastructure failure during verification masks the episode: its reason leads with it
                reason = f"{why}; during verification of: {reason}" if why.startswith(INFRA) else \
                    f"{reason}; verifier {why}"
        # A weight update between turns makes the episode off-policy for its early turns: recorded, not hidden.
        num_turns = sum(len(s.turns) for s in self.segments) + len(self.builder.turns)
        self.metrics.update(turns=num_turns, wall_s=time.monotonic() - self.start,
                            tito_prefix_checks=self.builder.prefix_checks
                            + sum(s.metrics["tito_prefix_checks"] for s in self.segments),
                            policy_versions=len(self.versions), segments=len(self.segments) + 1)
        for seg in self.segments:  # every segment carries the episode's outcome (its reward is theirs)
            seg.reward, seg.verifier, seg.finish_reason = reward, verifier, f"compacted; episode: {reason}"
        last = self._build(self.builder, reason, instruction=self._instruction, reward=reward, verifier=verifier,
                           metrics=self.metrics)
        last.earlier = self.segments
        return last

    def _build(self, builder: TitoBuilder, reason: str, *, instruction: str, **meta: Any) -> Trajectory:
        meta.setdefault("metrics", {"tito_prefix_checks": builder.prefix_checks, "turns": len(builder.turns)})
        return builder.build(task_name=self.task.name, finish_reason=reason,
                             policy_version=min(self.versions, default=self.engine.policy_version),
                             system_prompt=self.cfg.system_prompt, instruction=instruction, **meta)


def run_episode(engine: Engine, tok: ChatTokenizer, sandbox: Any, task: Task, *, config: AgentConfig | None = None,
                seed: int = 0) -> Trajectory:
    """Run one episode of `task` in `sandbox` (a started sandbox.DockerSandbox of the task's image)."""
    return _Episode(engine, tok, sandbox, task, config or AgentConfig(), seed).run()


@dataclass(frozen=True, kw_only=True)
class EpisodeSpec:
    """One episode to run: a task (with its built image) and the episode's seed."""

    task: Task
    image: str | TaskImage  # TaskImage: from sandbox.images.task_images.build_task_image (may carry preloaded files)
    seed: int


def _failed_episode(spec: EpisodeSpec, tok: ChatTokenizer, config: AgentConfig, reason: str,
                    version: int) -> Trajectory:
    """The record of an episode that never got a sandbox: no tokens, the reason, reward 0."""
    empty = TitoBuilder(tok.encode_prompt(config.system_prompt, spec.task.instruction))
    return empty.build(task_name=spec.task.name, finish_reason=reason, policy_version=version,
                       system_prompt=config.system_prompt, instruction=spec.task.instruction)


class _Pools:
    """One SandboxPool per environment (image + limits), created on first use, told how many episodes it will
    serve (so it starts no spare), and closed as soon as the last of them is over."""

    def __init__(self, specs: list[EpisodeSpec], *, num_parallel: int, pool_size: int | None,
                 limits: SandboxSection, provider: EnvironmentProvider | None) -> None:
        self.settings = [SandboxSettings.for_run(s.task, limits) for s in specs]
        self.keys = [(s.image, settings) for s, settings in zip(specs, self.settings)]
        self.specs, self.num_parallel, self.pool_size = specs, num_parallel, pool_size
        self.remaining = Counter(self.keys)
        self.pools: dict[tuple, Any] = {}
        self.lock = threading.Lock()
        self.provider = provider

    def get(self, index: int) -> Any:
        from sandbox import SandboxPool  # the runtime's warm-container pool

        key, spec = self.keys[index], self.specs[index]
        with self.lock:
            if key not in self.pools:
                need = self.remaining[key]  # episodes of this environment, none started yet
                size = min(self.pool_size or self.num_parallel, need)
                self.pools[key] = SandboxPool(spec.image, size=size, demand=need, settings=self.settings[index],
                                              provider=self.provider)
            return self.pools[key]

    def done(self, index: int) -> None:
        key = self.keys[index]
        with self.lock:
            self.remaining[key] -= 1
            pool = self.pools.pop(key) if self.remaining[key] == 0 and key in self.pools else None
        if pool is not None:
            pool.close()

    def close(self) -> None:
        with self.lock:
            pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            pool.close()


def run_episodes(engine: Engine, tok: ChatTokenizer, specs: list[EpisodeSpec], *, config: AgentConfig | None = None,
                 num_parallel: int = 8, pool_size: int | None = None,
                 on_done: Callable[[int, Trajectory], None] | None = None,
                 provider: EnvironmentProvider | None = None) -> list[Trajectory]:
    """Run episodes concurrently (threads), each in its own sandbox from a per-environment `SandboxPool` (limits:
    `config.sandbox` over the task's own), all sharing `engine`; returns trajectories in the order of `specs`.

    `pool_size`: sandboxes kept warm per environment (None: `num_parallel`), never more than the episodes of that
    environment not yet started. A sandbox that cannot be acquired or dies mid-episode ends only that episode, with
    the reason in `finish_reason`; one the infrastructure ended is run again (module docstring), and its metrics
    count the tries ("infra/retries") and the failures per host ("infra/failures/<host>"). `provider`: where
    sandboxes start (None: `sandbox.runtime.hosts.default_provider()`, the run's hosts). `on_done(index, trajectory)` is
    called as each episode finishes (from its thread).
    """
    if num_parallel < 1:
        raise ValueError(f"num_parallel must be >= 1, got {num_parallel}")
    config = config or AgentConfig()
    pools = _Pools(specs, num_parallel=num_parallel, pool_size=pool_size, limits=config.sandbox, provider=provider)

    def attempt(index: int, avoid: list[str]) -> tuple[Trajectory, str]:
        """One try of episode `index`: (its trajectory, the host it ran on). The first try takes a warm sandbox;
        a retry starts one on a host not in `avoid` (cold: the pool's warm ones may sit on the host that failed)."""
        spec = specs[index]
        try:
            pool = pools.get(index)
            sb: Environment = pool.acquire() if not avoid else \
                pool.provider.start(spec.image, pools.settings[index], avoid=avoid)
        except SandboxError as e:  # no command ran: never the agent's doing
            reason = f"{INFRA}: {type(e).__name__}: {e}"
            return _failed_episode(spec, tok, config, reason, engine.policy_version), "unplaced"
        try:
            return run_episode(engine, tok, sb, spec.task, config=config, seed=spec.seed), sb.host_name
        finally:
            if avoid:
                sb.close()
            else:
                pool.release(sb)

    def one(index: int) -> Trajectory:
        failures: Counter[str] = Counter()
        try:
            while True:
                traj, host = attempt(index, list(failures))
                if not is_masked(traj) or sum(failures.values()) >= config.rollout.infra_retries:
                    break
                failures[host] += 1
        finally:
            pools.done(index)
        if is_masked(traj):
            failures[host] += 1
        traj.metrics["infra/retries"] = float(sum(failures.values()) - is_masked(traj))
        traj.metrics.update({f"infra/failures/{h}": float(n) for h, n in failures.items()})
        traj.metrics[f"host/{host}"] = 1.0  # where its last try ran
        if on_done is not None:
            on_done(index, traj)
        return traj

    try:
        with ThreadPoolExecutor(max_workers=num_parallel, thread_name_prefix="t1-episode") as ex:
            return list(ex.map(one, range(len(specs))))
    finally:
        pools.close()
