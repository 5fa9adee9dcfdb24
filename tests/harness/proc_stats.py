"""CPU time and memory of a running process, read from /proc: what a benchmark reports of the
processes it measures (a fraction of one core over a phase, the resident set size)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds_from_stat(stat: str) -> float:
    """utime + stime (all threads) of a /proc/PID/stat line, in seconds. The fields are counted
    after the command name's closing parenthesis: the name itself may hold spaces."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of proc(5)


def memory_kib_from_status(status: str) -> dict[str, int]:
    """VmRSS and VmHWM (the peak resident set) of a /proc/PID/status text, in KiB."""
    found = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


@dataclass(frozen=True)
class Sample:
    """One look at a process: its CPU seconds so far and its memory, at a monotonic time."""

    pid: int
    at: float
    cpu: float
    rss_kib: int
    hwm_kib: int


def sample(pid: int, at: float) -> Sample | None:
    """The process now, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        memory = memory_kib_from_status(Path(f"/proc/{pid}/status").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None
    cpu = cpu_seconds_from_stat(stat)
    return Sample(pid, at, cpu, memory.get("VmRSS", 0), memory.get("VmHWM", 0))


def cores_used(before: Sample, after: Sample) -> float:
    """The CPU used between two samples of one process, as a fraction of one core."""
    return (after.cpu - before.cpu) / max(after.at - before.at, 1e-9)
