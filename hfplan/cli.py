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
    from hfplan.plan import load_plan, write_atomically
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
    for phase, seconds in estimate.stages.items():
        stages.add_row(phase, f"{seconds:.2f}")
    console.print(stages)
    memory = Table(title="peak memory per GPU", show_edge=False)
    memory.add_column("set")
    memory.add_column("GiB", justify="right")
    for label, peak in zip(set_labels(plan), estimate.peak_memory_gib, strict=True):
        memory.add_row(label, f"{peak:.1f}")
    console.print(memory)
    console.print(f"[bold]iteration:[/] {estimate.iteration_s:.2f} s   [bold]throughput:[/] "
                  f"{estimate.tokens_per_s:,.0f} tokens/s ({estimate.tokens_per_s / plan.cluster.gpus:,.0f} per GPU)")


def _register_profile() -> None:
    from hfplan.profiles.profiler.command import profile_command

    app.command("profile")(user_errors(profile_command))


_register_profile()
