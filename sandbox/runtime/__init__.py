"""The Docker runtime: one container driven through a persistent shell (docker_sandbox, shell, settings), pools,
hosts and the provider boundary, services beside a sandbox, reaping, signals, and the verifier that scores a
finished sandbox.

The top wing of sandbox: it may import sandbox.images and sandbox.tasks, never the reverse
(tests/test_layers.py).
"""
