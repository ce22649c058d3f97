"""Generation engines, the multi-turn agent loop and token-native trajectories."""
