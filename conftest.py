"""pytest configuration shared by tests/ and bench/."""

import os

# Set before any test module imports torch (see t1model/cpu_threads.py for why).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
