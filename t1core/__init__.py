"""T1's trainer floor: config, losses, warm start, the PPO loop and its distributed plumbing (`python -m
t1core.train`). It orchestrates the floors below it (t1model, rollout, sandbox), which never import it."""
