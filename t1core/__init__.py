import os

# Before torch loads OpenMP: with the default (active) wait policy, OpenMP threads spin between parallel
# regions and starve everything else on a small box (the engine thread, the trainer, dockerd); measured
# here as a 13-40x slowdown of CPU training steps under load. An explicit setting by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
