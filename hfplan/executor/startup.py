"""Where a run's start-up went: each stage from the command's launch to the first iteration's start, in the run
folder's `startup.json`. Stages may overlap (the tokenizer is built while Ray starts); a worker's own stages are
on its clock, moved to the controller's by its clock offset."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hfplan.files import write_atomically

STARTUP_FILE = "startup.json"
# The stages a worker times in its own process (worker.SetWorker), in order.
WORKER_STAGES = ("imports", "process group", "models")

logger = logging.getLogger(__name__)


def process_start_time() -> float | None:
    """When this process was launched (wall clock), where the system says (Linux); else None."""
    try:  # field 22 of /proc/self/stat: clock ticks from boot to this process's start
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)  # to the nanosecond (/proc/uptime: 10 ms)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class StartupLog:
    """Stages as (name, start, end) on the controller's wall clock; `origin` is the launch (or, where the system
    does not say, when the log was made)."""

    origin: float = field(default_factory=lambda: process_start_time() or time.time())
    stages: list[tuple[str, float, float]] = field(default_factory=list)

    def add(self, name: str, start: float, end: float) -> None:
        self.stages.append((name, start, end))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time())

    def add_worker(self, where: str, marks: dict[str, float], offset: float) -> None:
        """A worker's stages from its marks (`start`, `setup` and the end of each of WORKER_STAGES, its clock):
        the imports from its start, the rest from the later of the imports' end and the set-up call's start
        (an import that ended before the call does not count the wait for it)."""
        previous = marks["start"]
        for name in WORKER_STAGES:
            self.add(f"{where} {name}", previous - offset, marks[name] - offset)
            previous = max(marks[name], marks.get("setup", marks[name]))

    def write(self, folder: Path, first_iteration: float) -> None:
        """`startup.json`: each stage's start and end (seconds after launch) and length, and the first iteration's
        start; also logged, one line a stage."""
        rows = [{"stage": name, "start_s": round(start - self.origin, 3), "end_s": round(end - self.origin, 3),
                 "seconds": round(end - start, 3)} for name, start, end in self.stages]
        total = round(first_iteration - self.origin, 3)
        write_atomically(folder / STARTUP_FILE,
                         json.dumps({"first_iteration_s": total, "stages": rows}, indent=2) + "\n")
        for row in rows:
            logger.info("start-up: %-24s %7.3f s (%.3f to %.3f)", row["stage"], row["seconds"], row["start_s"],
                        row["end_s"])
        logger.info("start-up: first iteration starts %.3f s after launch", total)
