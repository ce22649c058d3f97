"""Episodes built token by token against a real engine, the way the agent loop builds them, without sandboxes:
shared by tests/test_bitwise.py and bench/test_bench_bitwise.py."""

from __future__ import annotations

import torch

from rollout.engine import SamplingParams
from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory, Turn


class Episode:
    """An agent-loop episode built by hand: replies from the engine, observations appended as plain ids. Each
    reply asks for routing from the first token the episode has none for, as `rollout.agent` does."""

    def __init__(self, prompt: list[int], seed: int, *, stop_token_ids: tuple[int, ...] = ()) -> None:
        self.ids, self.seed, self.stop_token_ids = list(prompt), seed, stop_token_ids
        self.prompt_len = len(prompt)
        self.mask: list[bool] = [False] * len(prompt)
        self.logp: list[float] = [0.0] * len(prompt)
        self.routing: list[torch.Tensor] = []
        self.turns: list[Turn] = []
        self.cached: list[int] = []

    def params(self, max_new: int, temperature: float) -> SamplingParams:
        routed = sum(r.shape[0] for r in self.routing)  # tokens whose routing the episode holds already
        return SamplingParams(max_new_tokens=max_new, temperature=temperature, stop_token_ids=self.stop_token_ids,
                              seed=derive_seed(self.seed, len(self.turns)), return_routing=True,
                              prompt_routing_from=routed)

    def add_reply(self, comp) -> None:
        self.routing += [comp.prompt_routing, comp.routing]
        start = len(self.ids)
        self.ids += comp.token_ids
        self.mask += [True] * len(comp.token_ids)
        self.logp += comp.logprobs.tolist()
        self.turns.append(Turn(start=start, end=len(self.ids), finish_reason=comp.finish_reason, text=""))
        self.cached.append(comp.num_cached_tokens)

    def add_observation(self, obs: list[int]) -> None:
        self.ids += obs
        self.mask += [False] * len(obs)
        self.logp += [0.0] * len(obs)

    def trajectory(self) -> Trajectory:
        ids = self.ids[:sum(r.shape[0] for r in self.routing)]  # a trailing observation was never run
        n = len(ids)
        return Trajectory(token_ids=torch.tensor(ids), loss_mask=torch.tensor(self.mask[:n]),
                          rollout_logprobs=torch.tensor(self.logp[:n], dtype=torch.float32),
                          routing=torch.cat(self.routing), prompt_len=self.prompt_len, turns=self.turns,
                          task_name=f"episode{self.seed}", finish_reason="done", policy_version=0)
