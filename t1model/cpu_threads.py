"""OpenMP settings for CPU runs, applied when an entry point imports this module first (before torch).

Entry points (`python -m t1core.train`, `rollout.collect`, the experiments) import it as their first import;
library code never does, so importing `t1model.model` in a notebook changes nothing in the environment. The
tests and benchmarks get the same settings from the root conftest.py. An explicit setting by the user wins.
"""

import os

# Before torch loads OpenMP (libgomp reads these once). Idle OpenMP threads must not spin for long: with the
# active wait policy they spin between parallel regions and starve everything else on a small box (the engine
# thread, the trainer, dockerd), a many-fold slowdown of CPU training steps under load. They must
# not go to sleep at once either: with OMP_WAIT_POLICY=PASSIVE alone (a spin count of 0) every one of a training
# step's many small parallel regions pays a futex wake-up (a third more time per step). A spin of 10,000 iterations (well under a millisecond) bridges the gaps between
# back-to-back ops and then sleeps.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
