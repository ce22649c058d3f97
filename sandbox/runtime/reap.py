"""Remove sandbox containers (and task services' networks) that a crashed or killed run left behind, and prune
cached task images.

    python -m sandbox.reap [--run-id ID] [--everything]            containers
    python -m sandbox.reap --config run.toml                      the same on each host of its sandbox.hosts
    python -m sandbox.reap --sandbox.hosts='[tcp://box:2376 tls=DIR, ...]'   (as the trainer's flag)
    python -m sandbox.reap --images [--keep N] [--idle-hours H]    task images (sandbox.images.image_cache)

Every sandbox container carries labels naming its run (`t1.run_id`) and its owner process (`t1.owner_pid`,
`t1.owner_start`: the process start time, so a recycled pid is not mistaken for the owner, `t1.owner_host`).
`--images` removes the task images (labelled `t1.kind`) beyond the N most recently used that have been idle
for H hours and that no container uses; they are rebuilt when a task needs them again.
"""

from __future__ import annotations

import socket

import docker

from sandbox.daemon import (LABEL_HOST, LABEL_PID, LABEL_RUN, LABEL_START, docker_client,
                                    docker_errors)
from sandbox.errors import SandboxError
from sandbox.runtime.host_spec import HostSpec  # parsing only: the clients it makes are for the hosts given


def owner_alive(labels: dict[str, str]) -> bool:
    """Whether the process that created a container still runs. Containers made on another host (a shared
    daemon) count as alive: their owner cannot be checked from here."""
    if labels.get(LABEL_HOST) != socket.gethostname():
        return True
    try:
        pid = int(labels.get(LABEL_PID, ""))
    except ValueError:
        return False  # a T1 container without an owner is nobody's
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return False
    return start == labels.get(LABEL_START, start)


def reap(run_id: str | None = None, *, everything: bool = False) -> int:
    """Force-remove T1 sandbox containers; return how many were removed.

    Always removes those whose owner process is gone (on this host). With `run_id`, also every container of
    that run, live owner or not (a restarted trainer reusing its run id). With `everything=True`, every T1
    container on the daemon (other live runs included: use with care).
    """
    return reap_api(docker_client(), run_id, everything=everything)


def reap_api(api: docker.APIClient, run_id: str | None = None, *, everything: bool = False) -> int:
    """`reap` on the daemon behind `api` (one of several hosts: sandbox.runtime.hosts)."""
    with docker_errors("listing T1 containers"):
        containers = api.containers(all=True, filters={"label": LABEL_RUN})
    removed = 0
    for c in containers:
        if not _doomed(c.get("Labels") or {}, run_id, everything=everything):
            continue
        try:
            with docker_errors(f"removing container {c['Id'][:12]}"):
                api.remove_container(c["Id"], force=True)
            removed += 1
        except SandboxError as e:
            if "No such container" not in str(e) and "already in progress" not in str(e):
                raise  # removed concurrently (its owner closing it) is fine; anything else is not
    _reap_networks(api, run_id, everything=everything)
    return removed


def _doomed(labels: dict[str, str], run_id: str | None, *, everything: bool) -> bool:
    """Whether `reap` removes what carries `labels`: everything, the given run's, or a dead owner's."""
    return everything or (run_id is not None and labels.get(LABEL_RUN) == run_id) or not owner_alive(labels)


def _reap_networks(api: docker.APIClient, run_id: str | None, *, everything: bool) -> None:
    """Remove the private networks of task services (sandbox.runtime.services) by the same rule, once their containers
    are gone (one still in use by a live container stays)."""
    with docker_errors("listing T1 networks"):
        networks = api.networks(filters={"label": LABEL_RUN})
    for n in networks:
        if _doomed(n.get("Labels") or {}, run_id, everything=everything):
            try:
                with docker_errors(f"removing network {n['Name']}"):
                    api.remove_network(n["Id"])
            except SandboxError as e:
                if "not found" not in str(e) and "active endpoints" not in str(e):
                    raise


def run_hosts(config: str | None, overrides: list[str]) -> list[HostSpec]:
    """The hosts of a run's [sandbox] section (its TOML file, `--sandbox.key=value` flags); [] = DOCKER_HOST's daemon.
    ValueError naming a bad entry or an unknown flag."""
    from sandbox.runtime.settings import SandboxSection
    from t1config.toml import load

    (section,) = load(config, overrides, {"sandbox": SandboxSection}, others=None).values()
    return [HostSpec.parse(entry) for entry in section.hosts]


def main(argv: list[str] | None = None) -> int:
    from sandbox.cli import Parser, bad_input
    from sandbox.images.image_cache import prune_task_images
    from t1config.cli import add_config_argument, parse_known

    parser = Parser(prog="python -m sandbox.reap", description=__doc__.split("\n\n")[0],
                    epilog="examples: python -m sandbox.reap   (containers of dead runs);  "
                           "python -m sandbox.reap --images --keep 50   (task images beyond the 50 last used)")
    parser.add_argument("--run-id", default=None, help="also remove every container of this run")
    parser.add_argument("--everything", action="store_true", help="every T1 container, live owners too")
    parser.add_argument("--images", action="store_true", help="prune cached task images instead")
    parser.add_argument("--keep", type=int, default=0, help="--images: keep this many most recently used")
    parser.add_argument("--idle-hours", type=float, default=1.0, help="--images: only images idle this long")
    add_config_argument(parser, "a run's; its [sandbox] hosts are reaped, as --sandbox.hosts=[...] names them; "
                                "default: DOCKER_HOST")
    with bad_input(parser):
        args, overrides = parse_known(parser, argv)
        hosts = run_hosts(args.config, overrides)
    if args.images:
        if args.keep < 0 or args.idle_hours < 0:
            parser.error(f"--keep and --idle-hours must be >= 0, got {args.keep}, {args.idle_hours}")
        removed = prune_task_images(keep=args.keep, min_idle_s=args.idle_hours * 3600)
        print(f"removed {len(removed)} task image(s)" + "".join(f"\n  {r}" for r in removed))
        return 0
    if hosts:
        for spec in hosts:
            print(f"{spec.url}: removed {reap_api(spec.client(), args.run_id, everything=args.everything)} "
                  "container(s)")
        return 0
    print(f"removed {reap(args.run_id, everything=args.everything)} container(s)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
