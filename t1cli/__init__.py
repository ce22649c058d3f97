"""T1's tools, on top of the house: the `t1` command (t1cli.main) and what is not on the training path, the memory
planner (plan, plan_comm), the async simulator (async_sim) and the experiments (experiments/). It may import every
floor below it; nothing but bench/ imports it."""
