"""Images: the base images T1 builds itself, task images (docker build, preload, the cache) and what an image's
layers hold (ELF libraries, ld.so.cache, the verifier's protected paths).

Above sandbox.tasks (a task image is built from a Task), below sandbox.runtime (a sandbox starts from a
TaskImage): tests/test_layers.py.
"""
