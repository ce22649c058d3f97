"""Which RL instances a step draws (t1core.curriculum): uniform as before, or weighted by how often a family's
groups disagreed. References are plain loops over the definitions in the module's docstring."""

from __future__ import annotations

import pytest
import torch

from t1core import train
from t1core.curriculum import draw_instances, family_weight, observe_groups


def test_uniform_draws_what_the_trainer_drew_before() -> None:
    keys = [f"f{i % 5}" for i in range(40)]
    a = draw_instances(keys, {"f0": [9.0, 0.0]}, 12, mode="uniform", generator=torch.Generator().manual_seed(3))
    b = torch.randint(40, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    assert a == b  # statistics are ignored: earlier runs reproduce bit for bit


def test_observe_counts_each_group_once_with_decay() -> None:
    stats = {"a": [2.0, 1.0], "z": [4.0, 4.0]}
    rewards = [1, 1, 2, 3, 3, 3, 5]
    groups = [0, 0, 1, 1, 2, 2, 3]  # group 3 has one episode left (the others had no sampled tokens)
    keys_G = ["a", "b", "a", "c"]
    out = observe_groups(stats, keys_G, rewards, groups, decay=0.5)
    # a decays to [1, 0.5] and gains groups 0 and 2 (both flat); b gains group 1 (2 != 3); c's lone episode is no group
    ref: dict[str, list[float]] = {"a": [1.0, 0.5], "z": [2.0, 2.0]}
    for g, key in enumerate(keys_G):
        rs = [r for r, gg in zip(rewards, groups) if gg == g]
        if len(rs) >= 2:
            n, m = ref.get(key, [0.0, 0.0])
            ref[key] = [n + 1, m + (len(set(rs)) > 1)]
    assert out == ref == {"a": [3.0, 0.5], "b": [1.0, 1.0], "z": [2.0, 2.0]}
    assert stats == {"a": [2.0, 1.0], "z": [4.0, 4.0]}  # the input is not modified


def test_informative_draws_follow_the_posterior_weights() -> None:
    stats = {"solved": [8.0, 0.0], "learnable": [8.0, 8.0]}  # weights 1/10, 9/10; "new" was never seen: 1/2
    keys = ["solved"] * 3 + ["learnable"] + ["new"] * 2
    weight = {k: family_weight(stats, k) for k in set(keys)}
    assert weight == {"solved": pytest.approx(0.1), "learnable": pytest.approx(0.9), "new": 0.5}
    draws = draw_instances(keys, stats, 40_000, mode="informative", generator=torch.Generator().manual_seed(0))
    total = sum(weight[k] for k in keys)  # per instance, so a family's share grows with its instance count
    for i, key in enumerate(keys):
        assert draws.count(i) / len(draws) == pytest.approx(weight[key] / total, abs=0.01)
    again = draw_instances(keys, stats, 40_000, mode="informative", generator=torch.Generator().manual_seed(0))
    assert draws == again


def test_bad_sampling_settings_are_clear_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="expected one of"):
        draw_instances(["a"], {}, 1, mode="greedy", generator=gen)
    with pytest.raises(ValueError, match="no RL instances"):
        draw_instances([], {}, 1, mode="informative", generator=gen)
    with pytest.raises(ValueError, match="0 < decay <= 1"):
        observe_groups({}, ["a"], [1, 2], [0, 0], decay=0.0)
    with pytest.raises(ValueError, match="tasks.rl_sampling"):
        train.parse_args(["--tasks.rl_sampling=greedy"])
    with pytest.raises(ValueError, match="tasks.rl_sampling_decay"):
        train.parse_args(["--tasks.rl_sampling_decay=1.5"])
