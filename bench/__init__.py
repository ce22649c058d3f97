"""Benchmarks (`python -m pytest bench/ -s`); what they share."""

import os


def box_cpu_s() -> float:
    """CPU seconds the whole box has spent busy (user + nice + system + irq + softirq), from /proc/stat: the daemon,
    runc, the kernel and the containers' processes included, not this process alone."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
