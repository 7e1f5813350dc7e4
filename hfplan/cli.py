"""The `hfplan` command. Each command parses its options, calls one library function, renders with rich."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hfplan.errors import HfplanError

app = typer.Typer(help="Plan and run RLHF training the HybridFlow way.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
# Tables keep their full width when the output is a pipe or a file (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., object])


def user_errors(fn: F) -> F:
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HfplanError as error:
            err_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@user_errors
def catalog() -> None:
    """List the built-in names: workloads, models, hardware profiles, reward rules, algorithms."""
    from hfplan.dataflow.rewards import rule_names
    from hfplan.profiles.hardware import shipped_names
    from hfplan.profiles.models import CATALOG
    from hfplan.spec import ALGORITHM_ROLES, BUILTIN_WORKLOADS, DEFAULT_WORKLOAD

    models = Table(title="models", show_edge=False)
    models.add_column("name", no_wrap=True)
    for column in ("layers", "hidden", "heads", "kv heads", "ffn", "vocab", "params (B)"):
        models.add_column(column, justify="right")
    for name, arch in CATALOG.items():
        models.add_row(name, str(arch.layers), str(arch.hidden), str(arch.heads), str(arch.kv_heads),
                       str(arch.ffn), str(arch.vocab), f"{arch.params() / 1e9:.3f}")
    console.print(models)
    console.print("[bold]algorithms:[/] " + ", ".join(f"{a} ({', '.join(r)})" for a, r in ALGORITHM_ROLES.items()))
    console.print(f"[bold]hardware:[/] {', '.join(shipped_names())}")
    console.print(f"[bold]reward rules:[/] {', '.join('rule:' + r for r in rule_names())}")
    console.print(f"[bold]workloads[/] ({len(BUILTIN_WORKLOADS)}; default {DEFAULT_WORKLOAD}): "
                  + ", ".join(BUILTIN_WORKLOADS))


@app.command()
@user_errors
def simulate(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON (as written by `hfplan search`)")],
    timeline: Annotated[Path | None, typer.Option(help="write a Gantt chart: .png or .html")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON instead of tables")] = False,
    out: Annotated[Path | None, typer.Option(help="write the plan with this estimate filled in")] = None,
) -> None:
    """Simulate one iteration of a plan: timeline of calls, stage times, iteration time, memory."""
    from hfplan.files import write_atomically
    from hfplan.plan import load_plan
    from hfplan.simulator.engine import simulate_plan
    from hfplan.simulator.gantt import check_timeline_path, write_timeline

    if timeline is not None:
        check_timeline_path(timeline)
    plan = load_plan(plan_path)
    result = simulate_plan(plan)
    if timeline is not None:
        write_timeline(timeline, result.estimate.timeline, set_labels(plan), title=plan_title(plan))
    if out is not None:
        write_atomically(out, plan.model_copy(update={"estimate": result.estimate}).to_json())
    if as_json:
        sys.stdout.write(json.dumps(result.estimate.model_dump(mode="json"), indent=2) + "\n")
        return
    render_timeline(result.estimate, plan)
    render_totals(result.estimate, plan)
    if timeline is not None:
        console.print(f"timeline written to {timeline}")


@app.command()
@user_errors
def search(
    gpus: Annotated[int, typer.Option(help="GPUs to plan for")],
    workload: Annotated[str, typer.Option(help="built-in workload name or a workload .yaml/.json")] = "ppo-llama2-7b",
    hardware: Annotated[str, typer.Option(help="shipped hardware profile name or a profile .yaml")] = "a100-80g",
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs per node (default: the hardware profile's)")] = None,
    out: Annotated[Path, typer.Option(help="where to write the best plan")] = Path("best.json"),
    top: Annotated[int, typer.Option(min=1, help="plans to show")] = 5,
    csv: Annotated[Path | None, typer.Option(help="write every candidate (placement x allocation) to this CSV")] = None,
    jobs: Annotated[int | None, typer.Option(min=1, help="processes (default: all cores)")] = None,
    compare: Annotated[bool, typer.Option(help="also search other systems' fixed mappings and compare")] = True,
) -> None:
    """Search placements and parallelism for the fastest RLHF iteration; write the best plan."""
    import os

    from hfplan.files import write_atomically
    from hfplan.planner.report import candidates_frame, describe_parallelism
    from hfplan.planner.search import search as run_search
    from hfplan.spec import load_workload, make_cluster

    for path in (out, csv):
        if path is not None and not path.parent.exists():
            raise HfplanError(f"cannot write {path}: folder {path.parent} does not exist")
    spec = load_workload(workload)
    cluster = make_cluster(gpus, hardware, gpus_per_node)
    jobs = jobs or os.cpu_count() or 1
    with _progress() as progress:
        result = run_search(spec, cluster, top_k=top, progress=progress, jobs=jobs)
        comparison = []
        if compare:
            from hfplan.planner.baselines import compare as compare_systems

            comparison = compare_systems(spec, cluster, jobs=jobs)
    write_atomically(out, result.best.to_json())
    if csv is not None:
        write_atomically(csv, candidates_frame(result, spec).to_csv(index=False))
    table = Table(title=f"top {len(result.top)} plans: {workload} on {gpus} x {cluster.hardware}", show_edge=False)
    for column in ("#", "placement (GPUs)", "parallelism", "iteration s", "tokens/s", "peak GiB/GPU"):
        table.add_column(column, justify="right" if column in ("#", "iteration s", "tokens/s") else "left")
    for rank, plan in enumerate(result.top, 1):
        est = plan.estimate
        table.add_row(str(rank), " | ".join(f"{'+'.join(g.models)} ({g.gpus})" for g in plan.placement),
                      describe_parallelism(plan), seconds(est.iteration_s), f"{est.tokens_per_s:,.0f}",
                      " | ".join(f"{m:.1f}" for m in est.peak_memory_gib))
    console.print(table)
    if comparison:
        render_comparison(result.best, comparison)
    stats = result.stats
    console.print(f"searched {stats.placements} placements, {stats.allocations:,} allocations ({stats.evaluated} "
                  f"evaluated, {stats.pruned:,} pruned by bounds, {stats.infeasible} infeasible; "
                  f"{stats.simpy_runs} simpy runs) in {stats.seconds:.2f} s")
    console.print(f"[bold]best:[/] {seconds(result.best.estimate.iteration_s)} s per iteration, "
                  f"{result.best.estimate.tokens_per_s:,.0f} tokens/s; plan written to {out}"
                  + (f"; candidates to {csv}" if csv is not None else ""))


def seconds(value: float) -> str:
    """Seconds to the hundredth, or with 4 significant digits below one second: 42.28, 0.01234."""
    return f"{value:.2f}" if value >= 1 else f"{value:.4g}"


def render_comparison(best, comparison) -> None:
    table = Table(title="other systems' mappings, on the same simulator", show_edge=False)
    for column in ("system", "mapping", "iteration s", "tokens/s", "hfplan speedup"):
        table.add_column(column, justify="left" if column in ("system", "mapping") else "right")
    for item in comparison:
        if item.plan is None:
            table.add_row(item.baseline.name, item.baseline.description, "does not fit", "-", "-")
            continue
        est = item.plan.estimate
        table.add_row(item.baseline.name, item.baseline.description, seconds(est.iteration_s),
                      f"{est.tokens_per_s:,.0f}", f"{est.iteration_s / best.estimate.iteration_s:.2f}x")
    console.print(table)


class _progress:
    """A rich progress bar that appears only once a search has taken more than a moment."""

    DELAY_S = 0.5

    def __enter__(self):
        import time

        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._clock = time.perf_counter
        self._started = self._clock()
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                             TimeElapsedColumn(), console=err_console, transient=True)
        self._tasks: dict[str, int] = {}
        self._live = False
        return self._update

    def _update(self, stage: str, done: int, total: int) -> None:
        if not self._live:
            if self._clock() - self._started < self.DELAY_S:
                return
            self._bar.start()
            self._live = True
        if stage not in self._tasks:
            self._tasks[stage] = self._bar.add_task(stage, total=total)
        self._bar.update(self._tasks[stage], completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self._live:
            self._bar.stop()


def set_labels(plan) -> list[str]:
    return [f"set {i}: {'+'.join(g.models)} ({g.gpus} GPUs)" for i, g in enumerate(plan.placement)]


def plan_title(plan) -> str:
    w = plan.workload
    return (f"{w.algorithm} {'/'.join(sorted(set(w.models.values())))} on {plan.cluster.gpus} x "
            f"{plan.cluster.hardware}")


def render_timeline(estimate, plan) -> None:
    table = Table(title="timeline (one iteration)", show_edge=False)
    for column in ("set", "role", "call", "phase", "kind", "start s", "end s", "seconds"):
        table.add_column(column, justify="right" if column.endswith("s") and column != "kind" else "left")
    for span in estimate.timeline:
        table.add_row("controller" if span.set < 0 else str(span.set), span.role, span.op, span.phase, span.kind,
                      f"{span.start:.3f}", f"{span.end:.3f}", f"{span.end - span.start:.3f}")
    console.print(table)


def render_totals(estimate, plan) -> None:
    stages = Table(title="stages", show_edge=False)
    stages.add_column("phase")
    stages.add_column("seconds", justify="right")
    for phase, value in estimate.stages.items():
        stages.add_row(phase, seconds(value))
    console.print(stages)
    memory = Table(title="peak memory per GPU", show_edge=False)
    memory.add_column("set")
    memory.add_column("GiB", justify="right")
    for label, peak in zip(set_labels(plan), estimate.peak_memory_gib, strict=True):
        memory.add_row(label, f"{peak:.1f}")
    console.print(memory)
    console.print(f"[bold]iteration:[/] {seconds(estimate.iteration_s)} s   [bold]throughput:[/] "
                  f"{estimate.tokens_per_s:,.0f} tokens/s ({estimate.tokens_per_s / plan.cluster.gpus:,.0f} per GPU)")


@app.command()
@user_errors
def execute(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON (as written by `hfplan search`)")],
    iterations: Annotated[int, typer.Option(min=1, help="RLHF iterations to run")] = 40,
    data: Annotated[str | None, typer.Option(help="prompts: .parquet or .jsonl with a 'prompt' column "
                                                  "(default: the actor model's built-in set)")] = None,
    out: Annotated[Path, typer.Option(help="run folder: metrics.jsonl, timeline.json")] = Path("run"),
    address: Annotated[str | None, typer.Option(help="an existing Ray cluster (default: start a local one)")] = None,
    seed: Annotated[int, typer.Option(help="seed of weights, data order and sampling")] = 0,
    overrides: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                        help="override a hyperparameter (repeatable)")] = None,
    timeline: Annotated[Path | None, typer.Option(help="draw the last iteration's measured timeline: .png or "
                                                       ".html")] = None,
) -> None:
    """Run a plan for real on Ray: the single controller, torch.distributed workers, the hybrid engine."""
    from hfplan.executor.controller import ExecuteOptions
    from hfplan.executor.controller import execute as run_plan
    from hfplan.executor.errors import RunFailed
    from hfplan.plan import load_plan
    from hfplan.simulator.gantt import check_timeline_path, write_timeline

    if timeline is not None:
        check_timeline_path(timeline)
    plan = load_plan(plan_path)
    options = ExecuteOptions(iterations=iterations, data=data, out=out, address=address, seed=seed,
                             overrides=tuple(overrides or ()))
    last_spans: list = []
    with _IterationProgress(iterations) as progress:
        def on_iteration(report) -> None:
            last_spans[:] = report.spans
            progress.update(report.metrics)

        try:
            summary = run_plan(plan, options, on_iteration)
        except RunFailed as failure:
            err_console.print(f"[bold red]run failed:[/] {escape(str(failure))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
    if timeline is not None and last_spans:
        write_timeline(timeline, last_spans, set_labels(plan), title=f"measured: {plan_title(plan)}")
    render_run(summary, plan)
    if timeline is not None:
        console.print(f"timeline written to {timeline}")


class _IterationProgress:
    """A live line per iteration: reward, tokens/s, seconds."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("[bold]execute"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[status]}"), console=err_console, transient=False,
                             disable=not err_console.is_terminal)
        self._task = self._bar.add_task("iterations", total=total, status="starting workers")

    def __enter__(self):
        self._bar.start()
        return self

    def update(self, metrics: dict) -> None:
        status = f"{metrics['iteration_s']:.2f} s/it, {metrics['tokens_per_s']:,.0f} tokens/s"
        if "reward" in metrics:
            status = f"reward {metrics['reward']:.3f}, " + status
        self._bar.update(self._task, advance=1, status=status)

    def __exit__(self, *exc) -> None:
        self._bar.stop()


def render_run(summary, plan) -> None:
    rows = summary.iterations
    table = Table(title=f"run: {plan_title(plan)}", show_edge=False)
    keys = [k for k in ("reward", "cost", "kl", "response_len", "iteration_s", "tokens_per_s") if k in rows[0]]
    table.add_column("iterations")
    for key in keys:
        table.add_column(key, justify="right")
    count = min(10, len(rows))
    for label, first in ((f"first {count}", True), (f"last {count}", False)):
        table.add_row(label, *(f"{summary.mean_of(k, first):,.4g}" for k in keys))
    console.print(table)
    if "reward" in rows[0]:
        before, after = summary.mean_of("reward", True), summary.mean_of("reward", False)
        change = (after - before) / abs(before) * 100 if before else float("inf")
        console.print(f"[bold]mean reward[/] of the last {count} iterations: {after:.4f} vs {before:.4f} in the "
                      f"first {count} ({change:+.1f}%)")
    console.print(f"metrics and measured timeline written to {summary.out}/")


def _register_profile() -> None:
    from hfplan.profiles.profiler.command import profile_command

    app.command("profile")(user_errors(profile_command))


_register_profile()
