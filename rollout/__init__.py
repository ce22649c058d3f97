import t1core  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads OpenMP; see t1core/__init__.py)
