"""The machine's other work during a measurement: CPU time that processes outside the run spent meanwhile.

A run on a machine it shares (a CI runner, a laptop, a VM beside others) is slowed by whatever else runs there,
and no profile taken at another moment predicts that. `hfplan validate` says how busy the rest of the machine was
during its compared iterations, so a miss can be read as the model's or the machine's: the CPU seconds every
processor spent on anything but idling (the kernel's /proc/stat, hypervisor steal included), less those of this
process and its descendants (the run: its Ray, when hfplan or the caller started it in this process, and the
workers Ray starts), per second of wall time. Linux only (its /proc); elsewhere nothing is measured.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
IDLE_FIELDS = (3, 4)  # idle and iowait among /proc/stat's cpu fields: user nice system idle iowait irq softirq steal


@dataclass(frozen=True)
class CpuSample:
    wall_s: float  # time.monotonic()
    busy_s: float  # every processor's non-idle seconds since boot
    run_s: float  # CPU seconds of this process and its live descendants (with the children each has reaped)


def busy_seconds(stat_line: str, ticks_per_s: float) -> float:
    """Non-idle seconds of /proc/stat's aggregate `cpu` line (guest time is inside user time already)."""
    fields = [int(value) for value in stat_line.split()[1:9]]
    return sum(value for i, value in enumerate(fields) if i not in IDLE_FIELDS) / ticks_per_s


def parse_process(stat: str) -> tuple[int, int, int]:
    """(pid, parent pid, clock ticks of CPU: own user + system and reaped children's) of a /proc/PID/stat line.
    The command name is in parentheses and may hold spaces or parentheses itself: the fields follow the last ')'."""
    pid = int(stat.split(" ", 1)[0])
    rest = stat[stat.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(value) for value in rest[11:15])
    return pid, int(rest[1]), utime + stime + cutime + cstime


def tree_ticks(processes: list[tuple[int, int, int]], root: int) -> int:
    """CPU ticks of `root` and every descendant among (pid, parent, ticks) rows."""
    children: dict[int, list[int]] = {}
    ticks = {}
    for pid, parent, used in processes:
        children.setdefault(parent, []).append(pid)
        ticks[pid] = used
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total


def _processes() -> list[tuple[int, int, int]]:
    rows = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rows.append(parse_process((entry / "stat").read_text()))
        except (OSError, ValueError, IndexError):  # the process ended while it was read
            continue
    return rows


def sample() -> CpuSample | None:
    """This moment's reading, or None where /proc/stat is not there to read."""
    try:
        first = (PROC / "stat").read_text().splitlines()[0]
    except OSError:
        return None
    ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
    return CpuSample(time.monotonic(), busy_seconds(first, ticks_per_s),
                     tree_ticks(_processes(), os.getpid()) / ticks_per_s)


def other_cores(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Cores' worth of CPU that processes outside the run used between two readings (never below 0)."""
    if before is None or after is None or after.wall_s <= before.wall_s:
        return None
    other = (after.busy_s - before.busy_s) - (after.run_s - before.run_s)
    return max(0.0, other / (after.wall_s - before.wall_s))
