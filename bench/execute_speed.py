"""How fast `hfplan execute` runs, against the same model calls made one after another in one plain process.

Workloads: the built-in `demo` (PPO, tiny model, rule reward) and `arith-grpo` (GRPO on tiny-arith, 8 prompts x
4 samples, 4 response tokens), each on 1 process (every role colocated on one CPU "GPU") and on 2 processes
(every role colocated on a set of 2, and the placement `hfplan search --gpus 2` picks where that differs; where that
pick keeps to 1 process, leaving the second idle, it says so and runs the others).
Plans come from the search (hfplan.planner.search), every layout tp = pp = 1. The executor runs through its
library API on one Ray session started here; the first iterations of each run are warm-up and not counted.

The floor is hfplan.executor.local: the registered algorithm over the same engines (RoleRuntime), controller
steps and rule rewards, in this process, on the 1-process plan, with one torch thread like a worker, in a gloo
world of size 1 (FSDP2 needs a process group). The overhead ratio is the executor's median iteration time over
the floor's; runs alternate with the floor's over --rounds, and each figure is its fastest round's. Where the
ratio exceeds 1.2 on 1 process, the measured timeline says where the time goes. Last, the
rollout engine's generated tokens/s against transformers' `generate` (bench/rollout_speed.py's `measure`).
Prints figures; asserts nothing about time.

    RAY_AUTH_MODE=disabled python bench/execute_speed.py [--iterations N] [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rollout_speed import measure  # bench/ is the script's folder, hence on sys.path

from hfplan.executor.controller import ExecuteOptions, IterationReport, RunSummary, execute
from hfplan.executor.local import run_local, single_process_world
from hfplan.plan import Plan, Span
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.spec import load_workload, make_cluster

WORKLOADS = ("demo", "arith-grpo")
STAGES = ("generation", "preparation", "training")
OVERHEAD_GOAL = 1.2
ROLLOUT_GOAL = 2.0
NICENESS_ENV = "RAY_worker_niceness"  # Ray's own name (its config keys are lower case)
GAPS = "gaps (no span: dispatch, serialisation, Ray scheduling, waiting)"


@dataclass
class Measured:
    """One configuration's run: the metrics and spans of its measured (not warm-up) iterations."""

    label: str
    processes: int
    plan: Plan
    metrics: list[dict] = field(default_factory=list)
    spans: list[list[Span]] = field(default_factory=list)
    peak_memory: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # the whole run, start-up included

    def median(self, key: str) -> float:
        return statistics.median(m[key] for m in self.metrics)


def plans_for(name: str) -> tuple[list[tuple[str, int, Plan]], str | None]:
    """(label, processes, plan): all colocated on 1 and on 2, and the search's pick on 2 where it differs; and a
    note where the search, given 2, keeps to 1 process (the simulator prices the second slower, as issue 25 asks
    where a second process does not pay)."""
    workload = load_workload(name)
    colocated = Rules(name="colocated", placements=((tuple(workload.model_roles),),))
    out = []
    for gpus in (1, 2):
        plan = search(workload, make_cluster(gpus, "cpu"), rules=colocated).best
        out.append((f"colocated on {gpus}", gpus, plan))
    for label, gpus, plan in out:
        used = sum(group.gpus for group in plan.placement)
        if used != gpus:
            raise SystemExit(f"{name} {label}: the search placed {used} processes, not {gpus}")
    picked = search(workload, make_cluster(2, "cpu")).best
    used = sum(group.gpus for group in picked.placement)
    if used < 2:
        return out, (f"search's pick on 2: {placement_text(picked)}, {used} process (the second idle), "
                     f"{picked.estimate.iteration_s:.3f} s simulated")
    if picked.placement != out[-1][2].placement:
        out.append(("search's pick on 2", 2, picked))
    return out, None


def placement_text(plan: Plan) -> str:
    return " | ".join(f"{'+'.join(group.models)} x{group.gpus}" for group in plan.placement)


def collect(label: str, processes: int, plan: Plan, warmup: int, run) -> Measured:
    measured = Measured(label, processes, plan)

    def keep(report: IterationReport) -> None:
        if report.iteration >= warmup:
            measured.metrics.append(report.metrics)
            measured.spans.append(report.spans)

    start = time.perf_counter()
    summary: RunSummary = run(keep)
    measured.seconds = time.perf_counter() - start
    measured.peak_memory = summary.peak_memory_bytes
    return measured


def run_floor(label: str, plan: Plan, iterations: int, warmup: int, seed: int) -> Measured:
    torch.set_num_threads(1)  # as each worker process does: one core per "GPU"
    with single_process_world():
        return collect(label, 1, plan, warmup,
                       lambda keep: run_local(plan, ExecuteOptions(iterations=iterations, seed=seed), keep))


def run_executor(label: str, processes: int, plan: Plan, iterations: int, warmup: int, seed: int,
                 out: Path) -> Measured:
    options = ExecuteOptions(iterations=iterations, out=out, seed=seed, call_timeout_s=300, start_timeout_s=120)
    return collect(label, processes, plan, warmup, lambda keep: execute(plan, options, keep))


def busy_union(spans: list[Span]) -> float:
    """Seconds covered by at least one span."""
    total, reach = 0.0, 0.0
    for span in sorted(spans, key=lambda s: s.start):
        if span.end > reach:
            total += span.end - max(span.start, reach)
            reach = span.end
    return total


def span_sums(spans: list[Span]) -> dict[str, float]:
    """Seconds of the spans by where they ran and their kind ("set 0 compute", "controller compute", ...)."""
    sums: dict[str, float] = defaultdict(float)
    for span in spans:
        sums[f"{'controller' if span.set < 0 else f'set {span.set}'} {span.kind}"] += span.end - span.start
    return sums


def gaps_before(spans: list[Span], iteration_s: float) -> dict[str, float]:
    """Seconds no span covers, each charged to the span that ends it (or to the end of the iteration)."""
    reach, gaps = 0.0, defaultdict(float)
    for span in sorted(spans, key=lambda s: s.start):
        if span.start > reach:
            gaps[f"before {span.role}.{span.op} ({span.kind})"] += span.start - reach
        reach = max(reach, span.end)
    gaps["after the last span (results to the controller)"] += max(0.0, iteration_s - reach)
    return gaps


def medians(per_iteration: list[dict[str, float]]) -> dict[str, float]:
    """Median of each key over the iterations (0 where an iteration lacks it)."""
    keys = {key for values in per_iteration for key in values}
    return {key: statistics.median(values.get(key, 0.0) for values in per_iteration) for key in keys}


def compute_per_call(run: Measured) -> dict[str, float]:
    """Median compute seconds of each role call per iteration, by "role.op"."""
    per_iteration = []
    for spans in run.spans:
        sums: dict[str, float] = defaultdict(float)
        for span in spans:
            if span.kind == "compute":
                sums[f"{span.role}.{span.op}"] += span.end - span.start
        per_iteration.append(sums)
    return medians(per_iteration)


def kind_medians(run: Measured) -> dict[str, float]:
    """Median seconds per iteration of the spans by kind, and of the time no span covers."""
    return medians([span_sums(spans) | {GAPS: m["iteration_s"] - busy_union(spans)}
                    for m, spans in zip(run.metrics, run.spans, strict=True)])


def where_time_goes(run: Measured, floor: Measured) -> list[str]:
    """A 1-process run against the floor: span seconds by kind, the gaps no span covers (by the call after
    them), and each call's compute seconds against the same call's in the floor."""
    iteration, floor_s = run.median("iteration_s"), floor.median("iteration_s")
    kinds, floor_kinds = kind_medians(run), kind_medians(floor)
    lines = [f"  where the time goes, {run.label}: median ms per iteration, executor {iteration * 1e3:.1f} against "
             f"floor {floor_s * 1e3:.1f} ({(iteration - floor_s) * 1e3:+.1f})",
             f"    {'':<68}{'executor':>9}{'floor':>8}{'excess':>8}"]
    for key in sorted(kinds.keys() | floor_kinds.keys()):
        ours, theirs = kinds.get(key, 0.0), floor_kinds.get(key, 0.0)
        lines.append(f"    {key:<68}{ours * 1e3:>9.1f}{theirs * 1e3:>8.1f}{(ours - theirs) * 1e3:>+8.1f}")
    gaps = medians([gaps_before(spans, m["iteration_s"]) for m, spans in zip(run.metrics, run.spans, strict=True)])
    lines.append("    largest gaps in the executor (ms):")
    for key, value in sorted(gaps.items(), key=lambda kv: -kv[1])[:6]:
        lines.append(f"      {key:<66}{value * 1e3:>9.1f}")
    ours, theirs = compute_per_call(run), compute_per_call(floor)
    lines.append("    compute per call (ms; a uniform excess means the same work ran slower: a busy machine):")
    for key in sorted(ours, key=lambda k: -(ours[k] - theirs.get(k, 0.0))):
        base = theirs.get(key, float("nan"))
        lines.append(f"      {key:<66}{ours[key] * 1e3:>9.1f}{base * 1e3:>8.1f}{ours[key] / base:>7.2f}x")
    return lines


def row(run: Measured, floor_s: float) -> str:
    stages = "".join(f"{run.median(f'{stage}_s'):>8.3f}" for stage in STAGES)
    memory = ", ".join(f"{b / 2**20:.0f}" for b in run.peak_memory.values()) or "-"
    simulated = run.plan.estimate.iteration_s if run.plan.estimate is not None else float("nan")
    return (f"  {run.label:<24}{run.processes:>3}{run.median('iteration_s'):>8.3f}{simulated:>7.3f}"
            f"{run.median('tokens_per_s'):>8.0f}{run.median('response_tokens_per_s'):>8.0f}{stages}"
            f"{run.median('iteration_s') / floor_s:>8.2f}  {memory:<12} {run.seconds:>5.0f}  "
            f"{placement_text(run.plan)}")


def same_rewards(a: Measured, b: Measured) -> str:
    pairs = [(x.get("reward"), y.get("reward")) for x, y in zip(a.metrics, b.metrics, strict=True)]
    return "yes" if all(x == y for x, y in pairs) else f"no ({pairs})"


def fastest(runs: list[Measured]) -> Measured:
    return min(runs, key=lambda run: run.median("iteration_s"))


def bench_workload(name: str, iterations: int, warmup: int, rounds: int, seed: int, out: Path) -> None:
    plans, note = plans_for(name)
    workload = plans[0][2].workload
    print(f"\n{name}: {workload.algorithm}, models {workload.models}; {workload.batch_prompts} prompts x "
          f"{workload.samples_per_prompt}, {workload.prompt_len} prompt + {workload.response_len} response tokens; "
          f"{iterations} iterations per run, first {warmup} not counted; {rounds} round(s)")
    if note:
        print(f"  {note}")
    # Rounds alternate the floor and the executor's runs, and each figure is its fastest round's: the
    # load of a shared machine drifts, and hits both alike only when they take turns.
    floors: list[Measured] = []
    by_label: dict[str, list[Measured]] = defaultdict(list)
    for round_index in range(rounds):
        floors.append(run_floor("floor: 1 plain process", plans[0][2], iterations, warmup, seed))
        for index, (label, procs, plan) in enumerate(plans):
            by_label[label].append(run_executor(label, procs, plan, iterations, warmup, seed,
                                                out / f"{name}-{round_index}-{index}"))
    floors.append(run_floor("floor: 1 plain process", plans[0][2], iterations, warmup, seed))
    floor, runs = fastest(floors), [fastest(by_label[label]) for label, _, _ in plans]
    floor_s = floor.median("iteration_s")
    print(f"  {'configuration':<24}{'P':>3}{'iter s':>8}{'sim s':>7}{'tok/s':>8}{'resp/s':>8}{'gen s':>8}"
          f"{'prep s':>8}{'train s':>8}{'ratio':>8}  {'peak MiB':<12} {'run s':>5}  placement")
    for run in [floor, *runs]:
        print(row(run, floor_s))
    print(f"  ratio: median iteration time over the floor's (goal <= {OVERHEAD_GOAL} on 1 process; the 2-process rows "
          "against the same 1-process floor); sim s: the plan's simulated iteration; peak MiB: resident, per worker; "
          "run s: the whole run, start-up included")
    print("  median iteration s of each run: floor " + " ".join(f"{f.median('iteration_s'):.3f}" for f in floors)
          + "; " + "; ".join(f"{label} " + " ".join(f"{r.median('iteration_s'):.3f}" for r in by_label[label])
                             for label, _, _ in plans))
    print(f"  the 1-process executor sampled the floor's rewards: {same_rewards(floors[0], by_label[plans[0][0]][0])}")
    for run in runs:
        if run.processes == 1 and run.median("iteration_s") / floor_s > OVERHEAD_GOAL:
            print("\n".join(where_time_goes(run, floor)))


def bench_rollout(repeats: int) -> None:
    print(f"\nrollout engine against transformers' generate (generated tokens per CPU second, best of {repeats}, "
          f"{torch.get_num_threads()} torch thread; goal >= {ROLLOUT_GOAL}x)")
    print(f"  {'model':<11}{'batch':>6}{'P':>4}{'R':>4}  {'mode':<8}{'engine':>9}{'HF':>9}{'ratio':>8}")
    for name in WORKLOADS:
        workload = load_workload(name)
        model = workload.models["actor"]
        result = measure(model, workload.sequences, workload.prompt_len, workload.response_len, repeats=repeats)
        for mode in ("greedy", "sampled"):
            m = result[mode]
            print(f"  {model:<11}{workload.sequences:>6}{workload.prompt_len:>4}{workload.response_len:>4}  "
                  f"{mode:<8}{m['engine_tokens_per_s']:>9.0f}{m['transformers_tokens_per_s']:>9.0f}"
                  f"{m['ratio']:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=None, help="iterations per run (default 20; 6 --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each configuration (default 2; 1 --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, rounds and rollout repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-niceness", type=int, default=None,
                        help="niceness of Ray's worker processes (Ray's default: 15, below every ordinary process)")
    args = parser.parse_args()
    iterations = args.iterations or (6 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 2)
    warmup = 2 if iterations >= 4 else iterations - 1
    if iterations < 2 or rounds < 1:
        raise SystemExit("--iterations must be at least 2 (the first is warm-up), --rounds at least 1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.worker_niceness is not None:
        os.environ[NICENESS_ENV] = str(args.worker_niceness)  # read by the raylet that ray.init starts
    niceness = os.environ.get(NICENESS_ENV) or "15 (Ray's default)"
    import ray

    ray_tmp = tempfile.mkdtemp(prefix="hfr-", dir="/tmp")  # short: Ray's socket paths have a length limit
    out = Path(tempfile.mkdtemp(prefix="hfplan-bench-"))
    started = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=ray_tmp,
             log_to_driver=False)
    try:
        print(f"hfplan execute speed: one Ray session (4 CPUs, loopback), {os.cpu_count()} cores here; the floor "
              "runs in this process, one torch thread, as rank 0 of a gloo world of size 1 (file store, gloo on "
              "127.0.0.1); "
              f"Ray worker niceness {niceness}; load average {os.getloadavg()[0]:.1f}")
        for name in WORKLOADS:
            bench_workload(name, iterations, warmup, rounds, args.seed, out)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    bench_rollout(repeats=2 if args.quick else 5)
    print(f"\nwhole benchmark: {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
