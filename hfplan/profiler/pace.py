"""The machine's pace: how fast it runs the executor's work now, against the moment a CPU profile was taken.

A shared or virtual machine does not keep one speed: on the project's 2-core VM the same 1-second loop of small
torch ops took 58 us per call at one moment and 105 us minutes later, with no other process running (the host's
other tenants). A profile is a snapshot of one such moment, so a run measured at another is off by the
machine's drift before the model errs at all. The probe is one of the profile's own measurements, a sampled
decode step of the executor's torch rollout engine on the tiny model with one sequence (hfplan.profiler.runtime,
one CPU thread as an executor worker has); the profile implies what it took then (the step's fitted fixed cost
plus its modelled kernels), and `hfplan validate` times it again around its run.

`hfplan profile` on CPU times the probe at its start and at its end (a moving machine shows there), and
`python -m hfplan.profiler.pace` is the probe as a process of its own: for each line it reads on stdin it times the
step and prints its seconds as a JSON line, until stdin ends, so a caller brackets a run with processes that import
torch once and sleep in between (one alone for the pace; several at once for how the host's cores hold up).
"""

from __future__ import annotations

import json
import sys

from hfplan.plan import Layout
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs

PROBE_SECONDS = 0.6  # timing budget of one probe (its warm-up and rounds on top)


def profiled_step_seconds(profile: HardwareProfile) -> float | None:
    """What the probe took when `profile` was measured, from its fitted runtime fields and modelled kernels;
    None for a profile that was not measured on CPU processes (a GPU's, or a shipped figure)."""
    from hfplan.profiler import runtime

    if not (profile.measured and profile.on_host):
        return None
    # The simulator's own decode step of one sequence on one process: its kernels, the step's fixed costs and each
    # layer's.
    return costs.decode_step_time(profile, CATALOG[runtime.MODEL], Layout(), costs.SetShape(1, 1), 1,
                                  runtime.PROBE_CONTEXT)


def measure_step_seconds(torch, min_time: float = PROBE_SECONDS) -> float:
    """The probe, timed here with one CPU thread (as an executor worker on CPU runs; the thread count is put
    back after)."""
    from hfplan.profiler import runtime
    from hfplan.profiler.timing import Clock

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine, prompts = runtime.cpu_probe(torch)
        return runtime.step_seconds(Clock(torch, "cpu"), engine, prompts, min_time)
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    import torch

    for _ in sys.stdin:
        sys.stdout.write(json.dumps({"step_s": measure_step_seconds(torch)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()


def drift(start_s: float, end_s: float) -> float:
    """How far apart two timings of the probe are, as the slower over the faster less 1 (0: the same pace)."""
    return max(start_s, end_s) / min(start_s, end_s) - 1.0
