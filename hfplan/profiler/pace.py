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

The step computes alone, and the engine split across processes drifts on its own: on the project's 2-core VM the
tensor-parallel training engine's calls ran 20-45% longer than in a profile two hours older while this step's pace
stayed within 3%, and a 16 KiB all-reduce after a burst of compute did not show it (2026-12-07: the profile's
all-reduce fit moved by 3.5% between the two). So `python -m hfplan.profiler.pace --rank R --world W --init URI`
is one of W such processes in a gloo group (on loopback, meeting at the file URI), and a line `split` makes every
one of them time the profile's own log-prob calls of the demo model across the group, wrapped in FSDP2 and split by
tensor parallelism (hfplan.profiler.runtime: log_prob_call, timed as the profile's WorldClock times it), whose
time the profile's fit implies too (profiled_split_seconds).
"""

from __future__ import annotations

import contextlib
import json
import sys

from hfplan.plan import Layout
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs

PROBE_SECONDS = 0.6  # timing budget of one probe (its warm-up and rounds on top)
SPLIT = "split"  # the line that asks the probes of a group for the split engine probe
SPLIT_REPS = 9  # timed calls of each of its log-prob calls (the median kept)
# Two timings of a probe further apart than this (drift): the machine changed speed between them (while it was
# profiled, or since, around a validated run)
PACE_DRIFT = 0.25


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


def split_modes(world: int) -> tuple[str, ...]:
    """The engine modes of the split probe over `world` processes: wrapped in FSDP2, and split by tensor
    parallelism where the demo model splits over them (as the profile timed them across its world)."""
    from hfplan.profiler import runtime

    return tuple(mode for mode in runtime.world_modes(world) if mode in (runtime.FSDP, runtime.TP))


def profiled_split_seconds(profile: HardwareProfile, world: int) -> float | None:
    """What the split probe over `world` processes of one host takes by `profile` (its log-prob calls' modelled
    kernels and collectives and the fitted fixed costs); None where the profile was not measured on CPU processes
    or has fewer processes a node."""
    from hfplan.profiler import runtime

    if not (profile.measured and profile.on_host) or world < 2 or profile.gpus_per_node < world:
        return None
    return sum(runtime.log_prob_price(profile, mode, world) for mode in split_modes(world))


class SplitProbe:
    """The split probe in this process's group (every rank builds and calls it): the engine's roles are built on
    first use and kept."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.calls: list | None = None

    def seconds(self) -> float:
        import torch.distributed as dist

        from hfplan.profiler import runtime

        if self.calls is None:
            modes = split_modes(dist.get_world_size())
            self.calls = [runtime.log_prob_call(self.torch, runtime.profiled_role(self.torch, "cpu", mode), 1)
                          for mode in modes]
        return sum(runtime.WorldClock(self.torch, "cpu", SPLIT_REPS).per_calls(self.calls))


def main(argv: list[str] | None = None) -> None:
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m hfplan.profiler.pace")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--init", help="file:// URI where the group's processes meet")
    args = parser.parse_args(argv)
    split = None
    if args.world is not None:
        from datetime import timedelta

        import torch.distributed as dist

        from hfplan.executor.loopback import gloo_on_loopback

        # No group (a failed rendezvous): the step is still timed, and the split probe answers that it was not.
        with contextlib.suppress(RuntimeError, ValueError, OSError), gloo_on_loopback():
            dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                                    timeout=timedelta(seconds=60))
            split = SplitProbe(torch)
    torch.set_num_threads(1)
    try:
        for line in sys.stdin:
            if line.strip() == SPLIT:
                body = {"split_s": None if split is None else split.seconds()}
            else:
                body = {"step_s": measure_step_seconds(torch)}
            sys.stdout.write(json.dumps(body) + "\n")
            sys.stdout.flush()
    finally:
        if split is not None:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()


def drift(start_s: float, end_s: float) -> float:
    """How far apart two timings of the probe are, as the slower over the faster less 1 (0: the same pace)."""
    return max(start_s, end_s) / min(start_s, end_s) - 1.0
