"""The machine during a measurement: CPU time that processes outside the run spent meanwhile, and its pace.

A run on a machine it shares (a CI runner, a laptop, a VM beside others) is slowed by whatever else runs there,
and no profile taken at another moment predicts that. `hfplan validate` says how busy the rest of the machine was
during its compared iterations, so a miss can be read as the model's or the machine's: the CPU seconds every
processor spent on anything but idling (the kernel's /proc/stat, hypervisor steal included), less those of this
process and its descendants (the run: its Ray, when hfplan or the caller started it in this process, and the
workers Ray starts), per second of wall time. Linux only (its /proc); elsewhere nothing is measured.

The pace (hfplan.profiler.pace) catches what that cannot: the machine itself running slower or faster than when
the profile was taken (a VM's host busy with other tenants), as the probe's time just before and after the run
over the time the profile implies for it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hfplan.profiler.host_share import parallelism
from hfplan.profiler.pace import PACE_DRIFT, SPLIT, drift

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Sharing:
    """How the host's cores held up around a run: `world` probes timed at once (each process's step, their mean),
    before and after it, beside the one timed alone (Pace), and what the profile measured (Compute.host_parallelism)."""

    world: int
    before_s: float
    after_s: float
    profiled: float | None

    def parallelism(self, alone_s: float) -> float:
        return parallelism(self.world, alone_s, (self.before_s + self.after_s) / 2)


@dataclass(frozen=True)
class Probe:
    """A probe's seconds by the profile, and timed just before and just after the run."""

    profiled_s: float
    before_s: float
    after_s: float

    @property
    def ratio(self) -> float:
        """How much slower than by the profile the probe ran around the run (above 1: slower)."""
        return (self.before_s + self.after_s) / 2 / self.profiled_s

    def moved(self) -> bool:
        """Whether the probe around the run was further than PACE_DRIFT from the profile's figure, either way."""
        return drift(1.0, self.ratio) > PACE_DRIFT


@dataclass(frozen=True)
class SplitPace(Probe):
    """The split engine probe (hfplan.profiler.pace: the profile's log-prob calls of the demo model across `world`
    processes of the host, wrapped in FSDP2 and split by tensor parallelism), its profiled_s the profile's price of
    them."""

    world: int

    def to_json(self) -> dict:
        return {"processes": self.world, "profiled_s": self.profiled_s, "before_s": self.before_s,
                "after_s": self.after_s, "ratio": self.ratio}


@dataclass(frozen=True)
class Pace(Probe):
    """The machine's pace around a run (hfplan.profiler.pace): the probe's seconds when the profile was
    measured (what its fit implies), and timed just before and just after the run; `sharing`: the same probe on
    every process of the profile's host at once (None where the profile measured no sharing); `split`: the split
    engine probe over those processes (None where not measured)."""

    sharing: Sharing | None = None
    split: SplitPace | None = None

    @property
    def parallelism(self) -> float | None:
        """The host's parallelism around the run (Compute.host_parallelism's measure), None if not measured."""
        return None if self.sharing is None else self.sharing.parallelism((self.before_s + self.after_s) / 2)

    def drifted(self) -> str | None:
        """A sentence when the machine around the run was further than PACE_DRIFT from the profile's moment, on
        the step or on the split engine: the run's misses are then the machine's as much as the model's."""
        moved = []
        if self.moved():
            moved.append(f"the step's pace {self.ratio:.2f}x")
        if self.split is not None and self.split.moved():
            moved.append(f"the split engine's {self.split.ratio:.2f}x")
        if not moved:
            return None
        return (f"the machine has moved since it was profiled ({' and '.join(moved)} the profile's): profile it "
                "again (hfplan profile) before reading these errors as the model's")

    def to_json(self) -> dict:
        body = {"profiled_step_s": self.profiled_s, "before_step_s": self.before_s, "after_step_s": self.after_s,
                "ratio": self.ratio, "parallelism": self.parallelism, "profiled_parallelism": None,
                "together": None}
        if self.sharing is not None:
            body["profiled_parallelism"] = self.sharing.profiled
            body["together"] = {"processes": self.sharing.world, "before_step_s": self.sharing.before_s,
                                "after_step_s": self.sharing.after_s}
        body["split"] = None if self.split is None else self.split.to_json()
        return body


class PaceProbe:
    """The probe as processes of their own (`python -m hfplan.profiler.pace`), started on entry (each imports torch
    once, meanwhile the run checks its inputs and starts its workers), read once the run's workers are up
    (`before`: before its first iteration) and again after the run (`finish`); they sleep in between. One times the
    probe alone; with `world` > 1 (the processes the profile measured its host's sharing with), `world` of them then
    time it at once. Any failure of the probe leaves the pace unknown (None), never the run failed; a run refused
    before its workers start waits for no probe."""

    TIMEOUT_S = 120.0

    def __init__(self, profiled_s: float | None, world: int = 1, profiled_parallelism: float | None = None,
                 profiled_split_s: float | None = None) -> None:
        """`profiled_split_s`: the split engine probe's time by the profile (pace.profiled_split_seconds over
        `world` processes); with it, the processes form a gloo group and also time the split probe, all at once,
        after the step."""
        self.profiled_s, self.world, self.profiled_parallelism = profiled_s, world, profiled_parallelism
        self.profiled_split_s = profiled_split_s if world > 1 else None
        self.processes: list[subprocess.Popen] = []
        self.before: Probed | None = None
        self._rendezvous: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> PaceProbe:
        if self.profiled_s is None:
            return self
        world = max(1, self.world)
        command = [sys.executable, "-m", "hfplan.profiler.pace"]
        group: list[list[str]] = [[] for _ in range(world)]
        try:
            if self.profiled_split_s is not None:
                self._rendezvous = tempfile.TemporaryDirectory(prefix="hfplan-pace-")
                init = Path(self._rendezvous.name, "rendezvous").as_uri()
                group = [["--rank", str(rank), "--world", str(world), "--init", init] for rank in range(world)]
            for args in group:  # each kept as it starts, so that a failed start stops those already running
                self.processes.append(subprocess.Popen(command + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                       stderr=subprocess.DEVNULL, text=True))
        except OSError as error:
            logger.warning("the machine's pace is not measured: %s", error)
            self._stop()
        return self

    def measure_before(self) -> None:
        """The probes before the run's iterations (once; a later call does nothing)."""
        if not self.processes or self.before is not None:
            return
        try:
            self.before = self._measure()
        except (OSError, ValueError) as error:
            logger.warning("the machine's pace is not measured: %s", error)
            self._stop()

    def finish(self) -> Pace | None:
        """The probes after the run; the pace (None where a probe failed)."""
        if not self.processes or self.before is None or self.profiled_s is None:
            return None
        world = len(self.processes)
        try:
            after = self._measure()
        except (OSError, ValueError) as error:
            logger.warning("the machine's pace is not measured: %s", error)
            return None
        finally:
            self._stop()
        before = self.before
        sharing = split = None
        if before.together_s is not None and after.together_s is not None:
            sharing = Sharing(world, before.together_s, after.together_s, self.profiled_parallelism)
        if before.split_s is not None and after.split_s is not None:
            split = SplitPace(self.profiled_split_s, before.split_s, after.split_s, world)
        return Pace(self.profiled_s, before.alone_s, after.alone_s, sharing, split)

    def __exit__(self, *exc) -> None:
        self._stop()

    def _measure(self) -> Probed:
        """The probe alone, then (with several processes) every process's at once, their mean, then the split
        engine probe (where asked for: every process at once, each with the same figure; a failure of it leaves
        it unknown from then on and the step's probes as they are)."""
        alone = self._ask(self.processes[:1])[0]
        if len(self.processes) < 2:
            return Probed(alone)
        together = self._ask(self.processes)
        split = None
        if self.profiled_split_s is not None:
            try:
                split = self._ask(self.processes, SPLIT, "split_s")[0]
            except ValueError as error:
                logger.warning("the split engine's pace is not measured: %s", error)
                self.profiled_split_s = None
        return Probed(alone, sum(together) / len(together), split)

    def _ask(self, processes: list[subprocess.Popen], line: str = "", answer: str = "step_s") -> list[float]:
        for process in processes:
            process.stdin.write(line + "\n")
            process.stdin.flush()
        return [self._read(process, answer) for process in processes]

    def _read(self, process: subprocess.Popen, answer: str) -> float:
        ready, _, _ = select.select([process.stdout], [], [], self.TIMEOUT_S)
        line = process.stdout.readline() if ready else ""
        if not line:
            raise ValueError("the probe process gave no measurement")
        value = json.loads(line).get(answer)
        if not isinstance(value, int | float):
            raise ValueError(f"the probe process did not measure {answer}")
        return float(value)

    def _stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdin.close()
            process.stdout.close()
        self.processes = []
        if self._rendezvous is not None:
            self._rendezvous.cleanup()
            self._rendezvous = None


@dataclass(frozen=True)
class Probed:
    """One reading of the probes: the step alone, every process's at once (their mean) and the split engine probe
    (None where not measured)."""

    alone_s: float
    together_s: float | None = None
    split_s: float | None = None
