"""Task formats: Harbor and Terminal-Bench 1 directories loaded into one Task (format, compose, test_deps), T1's
built-in suite and seeded families, and the overlap checks between training and evaluation tasks.

The lowest wing of sandbox: it imports no image or runtime module (tests/test_layers.py), so a task parser
loads no Docker SDK.
"""
