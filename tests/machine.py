"""What a test needs from this machine: a Docker daemon that answers, a free TCP port for a gloo rendezvous, and
the life of one rank of a multi-rank test."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import socket
import sys
from collections.abc import Iterator

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


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, *, timeout_s: float = 120.0) -> Iterator[None]:
    """One rank of a test started by `mp.spawn`, in a gloo group on 127.0.0.1:`port`.

    An error leaves the group and propagates (spawn reports it). Success waits for every rank, leaves the group
    and ends the process at once with os._exit(0): a spawned child otherwise ends through interpreter finalization,
    which tears down the c10d and gloo objects the DeviceMeshes and DTensors still hold in no fixed order, and CI saw
    a rank that had finished its work die there with SIGABRT ('terminate called without an active exception', twice
    in 4-rank tests that checkpoint). Everything a rank writes is closed before it gets here."""
    import torch.distributed as dist

    faulthandler.enable()  # a native abort prints the rank's Python stack (pytest's covers only its own process)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()  # leave together: a rank leaving while its peer still talks to it can abort
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
