"""What a test needs from this machine: a Docker daemon that answers, a free TCP port for a gloo rendezvous."""

from __future__ import annotations

import socket

import pytest


def docker_answers() -> bool:
    """Whether a Docker daemon answers (the SDK installed and the daemon up)."""
    try:
        import docker
    except ImportError:
        return False
    try:
        docker.from_env().ping()
        return True
    except docker.errors.DockerException:
        return False


needs_docker = pytest.mark.skipif(not docker_answers(), reason="no Docker daemon answers")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (the rendezvous of a multi-rank test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
