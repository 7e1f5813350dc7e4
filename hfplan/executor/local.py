"""A single-process backend: every role of a one-device plan in this process, each call run at once.

The floor the Ray executor is measured against (bench/execute_speed.py): the same engines
(runtime.RoleRuntime), the same controller steps and rule rewards, the same prompts and seeds as
`hfplan execute`, with no Ray, no dispatch and no serialisation. FSDP2 needs a process group even on
one device, so the caller joins a world of size 1 first (`single_process_world`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.roles import CallingRole
from hfplan.errors import HfplanError
from hfplan.executor import preflight
from hfplan.executor.controller import ExecuteOptions, IterationReport, RunSummary, build_roles, run_iterations
from hfplan.executor.loopback import gloo_on_loopback
from hfplan.executor.roles import Recorder, timed_phase
from hfplan.executor.runtime import RoleRuntime, build_runtimes, leave_generation_before
from hfplan.executor.worker import Timed
from hfplan.plan import Plan

LOCAL_SET = 0  # the plan's only set: its spans carry this index, as the executor's would


@contextlib.contextmanager
def single_process_world(timeout_s: float = 600.0) -> Iterator[None]:
    """This process as rank 0 of a gloo world of size 1, for the duration. It meets itself through a file
    store, and gloo listens on loopback only (the world's groups and every group made in it): a TCP store
    would listen on every interface."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    with tempfile.TemporaryDirectory(prefix="hfplan-world-") as folder, gloo_on_loopback():
        store = dist.FileStore(str(Path(folder) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
        try:
            yield
        finally:
            if dist.is_initialized():  # a vLLM engine's close ends the world it joined
                dist.destroy_process_group()


class LocalRole(CallingRole):
    """A model role whose calls run in this process, on the arrays of the batch, before returning."""

    def __init__(self, name: str, runtimes: dict[str, RoleRuntime], recorder: Recorder) -> None:
        self.name, self.runtimes, self.recorder = name, runtimes, recorder

    def call(self, op: str, batch: Batch, greedy: bool = False, n: int = 1) -> Batch:
        spans: list[Timed] = []
        leave_generation_before(self.runtimes, self.name, op, spans)
        out = self.runtimes[self.name].run(op, dict(batch.resolve()), {"greedy": greedy, "n": n}, spans)
        for timed in spans:
            self.recorder.span(self.name, timed.op, LOCAL_SET, timed.start, timed.end, kind=timed.kind,
                               phase=timed_phase(op, timed.op))
        self.recorder.observed[(self.name, op, greedy)] = out
        return Batch(out)


def run_local(plan: Plan, options: ExecuteOptions,
              on_iteration: Callable[[IterationReport], None] | None = None) -> RunSummary:
    """`options.iterations` iterations of a plan with one set of one device, in this process (which must
    have joined a world of size 1). Metrics as `execute` computes them; nothing is written to disk."""
    if len(plan.placement) != 1 or plan.placement[0].gpus != 1:
        shape = ", ".join(f"{'+'.join(g.models)} on {g.gpus}" for g in plan.placement)
        raise HfplanError(f"the single-process backend runs plans of one set of one device, not {shape}")
    checked = preflight.check(plan, options)
    runtimes = build_runtimes(plan, checked.hyper, LOCAL_SET, options.seed, checked.device)
    recorder = Recorder(clock_offsets={})
    roles = build_roles(plan, checked, recorder, lambda role, facts: LocalRole(role, runtimes, recorder))
    summary = RunSummary(options.out)
    try:
        for report in run_iterations(plan, roles, checked, options, recorder):
            summary.iterations.append(report.metrics)
            if on_iteration is not None:
                on_iteration(report)
    finally:
        for runtime in runtimes.values():
            if runtime.engine is not None:
                runtime.engine.close()
    return summary
