"""Benchmarks (`python -m pytest bench/ -s`); what they share."""

import os


def box_cpu_s() -> float:
    """CPU seconds the whole box has spent busy (user + nice + system + irq + softirq), from /proc/stat: the daemon,
    runc, the kernel and the containers' processes included, not this process alone."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Verdicts:
    """The checks of a device-check script (bench/gpu_check_*.py): each verdict printed as it comes, then a summary
    whose last line is `ALL CHECKS PASSED` or `FAILED: [...]` (bench/gpu_run.sh greps for them)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, bool | None, str]] = []
        """(check, ok (None: reported, not judged), detail)."""

    def record(self, name: str, ok: bool | None, detail: str) -> None:
        self.rows.append((name, ok, detail))
        print(f"[{self._tag(ok)}] {name}: {detail}", flush=True)

    def summary(self) -> int:
        """Print the summary; the script's exit status (1 when a check failed)."""
        failed = [name for name, ok, _ in self.rows if ok is False]
        print("\nSUMMARY")
        for name, ok, detail in self.rows:
            print(f"  {self._tag(ok)} {name}: {detail}")
        print("ALL CHECKS PASSED" if not failed else f"FAILED: {failed}")
        return 1 if failed else 0

    @staticmethod
    def _tag(ok: bool | None) -> str:
        return "info" if ok is None else ("ok  " if ok else "FAIL")
