"""The `hfplan` command. Each command parses its options, calls one library function, renders with rich."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from hfplan import __version__
from hfplan.errors import HfplanError

F = TypeVar("F", bound=Callable[..., object])
# The click exceptions typer raises: click's own, or those of the copy of click newer typer releases carry.
_click = importlib.import_module(typer.BadParameter.__module__)
INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)
# The notation of the parallelism cells, explained under every table that uses it.
PARALLELISM_LEGEND = ("parallelism: tN pN dN = tensor-, pipeline- and data-parallel sizes (their product is the set's "
                      "GPUs); mbN = sequences per micro-batch per data-parallel rank; fsdp = parameters, gradients and "
                      "optimizer states sharded over the data-parallel ranks (ZeRO-3); hsdpG = the same within groups "
                      "of G ranks, replicated across groups; zero1 / zero2 = optimizer states (and gradients) sharded; "
                      "none of these = replicated; selective-recompute / full-recompute = attention's core / every "
                      "layer recomputed in the backward pass; vN = N virtual stages per pipeline rank (interleaved "
                      "1F1B); cb = continuous batching; paged = a paged KV cache (blocks as tokens are generated, as "
                      "vLLM does); maxN = at most N sequences per engine replica at once; "
                      "train / infer / gen = the layouts for updates, "
                      "forward passes and the actor's generation (infer in the training layout when only mb is shown)")


class _OneLineErrors(TyperGroup):
    """Usage errors (a missing option, `--gpus abc`, `--top 0`) end like every other bad input: one line on
    stderr and exit code 2, not click's usage block. Ctrl-C ends with one line and exit code 130."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = _with_optional_values(list(sys.argv[1:] if args is None else args))
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except getattr(_click, "NoArgsIsHelpError", ()) as help_shown:
            if help_shown.format_message():  # with rich, typer has printed the help already
                typer.echo(help_shown.format_message())
            code = 2
        except _click.UsageError as error:
            where = error.ctx.command_path if error.ctx is not None else "hfplan"
            _error_line(f"{where}: {error.format_message()} (see {where} --help)")
            code = 2
        except _click.ClickException as error:
            _error_line(error.format_message())
            code = 2
        except (typer.Abort, getattr(_click, "Abort", typer.Abort)):
            code = INTERRUPTED
        if code == INTERRUPTED:
            _error_line("interrupted")
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


# Options whose value may be left out, with the value they then take (`--resume` alone = `--resume latest`).
OPTIONAL_VALUES = {"--resume": "latest"}


def _with_optional_values(args: list[str]) -> list[str]:
    """The command line with each value-less option of OPTIONAL_VALUES given its implied value (typer has no
    option whose value is optional): the option is last, or the next word is another option."""
    filled: list[str] = []
    for index, word in enumerate(args):
        filled.append(word)
        if word in OPTIONAL_VALUES and (index + 1 == len(args) or args[index + 1].startswith("-")):
            filled.append(OPTIONAL_VALUES[word])
    return filled


app = typer.Typer(cls=_OneLineErrors, help="Plan and run RLHF training the HybridFlow way.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
# Tables keep their full width when the output is a pipe or a file (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True)


def _error_line(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", highlight=False, soft_wrap=True)


def user_errors(fn: F) -> F:
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HfplanError as error:
            _error_line(str(error))
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def parse_rollout_engines(names: str) -> tuple[str, ...]:
    """--rollout-engines torch,vllm: the engine names, each known."""
    from hfplan.plan import ENGINE_KV_CACHE

    engines = tuple(dict.fromkeys(name.strip() for name in names.split(",")))
    unknown = [name for name in engines if name not in ENGINE_KV_CACHE]
    if unknown or not engines:
        raise HfplanError(f"--rollout-engines {names}: name engines among {', '.join(ENGINE_KV_CACHE)}, "
                          "comma-separated")
    return engines


def require_execute_extra(command: str) -> None:
    """The executor's packages are an extra: without them, one line saying how to install them."""
    missing = [name for name in ("torch", "ray", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise HfplanError(f"hfplan {command} needs the execute extra ({', '.join(missing)} not installed): "
                          "pip install '.[execute]' in the hfplan checkout (torch==2.13.0 first for the CPU build)")


def _show_version(value: bool) -> None:
    if value:
        console.print(f"hfplan {__version__}", highlight=False)
        raise typer.Exit()


class _WarningLines(logging.Handler):
    """hfplan's warnings as `warning: ...` lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        err_console.print(f"[bold yellow]warning:[/] {escape(record.getMessage())}", highlight=False,
                          soft_wrap=True)


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                               help="print the version and exit")] = False) -> None:
    """Plan and run RLHF training the HybridFlow way."""
    package_logger = logging.getLogger("hfplan")
    if not any(isinstance(h, _WarningLines) for h in package_logger.handlers):
        package_logger.addHandler(_WarningLines(logging.WARNING))
        package_logger.propagate = False


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
    for column in ("layers", "hidden", "heads", "kv heads", "ffn", "vocab", "context", "params (B)"):
        models.add_column(column, justify="right")
    for name, arch in CATALOG.items():
        models.add_row(name, str(arch.layers), f"{arch.hidden:,}", str(arch.heads), str(arch.kv_heads),
                       f"{arch.ffn:,}", f"{arch.vocab:,}", f"{arch.context_len:,}", f"{arch.params() / 1e9:.3f}")
    console.print(models)
    console.print("[bold]algorithms:[/] " + ", ".join(f"{a} ({', '.join(r)})" for a, r in ALGORITHM_ROLES.items()))
    console.print(f"[bold]hardware:[/] {', '.join(shipped_names())}")
    console.print(f"[bold]reward rules:[/] {', '.join('rule:' + r for r in rule_names())} (built in, and the "
                  "hfplan.rewards entry points of installed packages; or reward: module:function)")
    console.print(f"[bold]workloads[/] ({len(BUILTIN_WORKLOADS)}; default {DEFAULT_WORKLOAD}): "
                  + ", ".join(BUILTIN_WORKLOADS))


@app.command()
@user_errors
def simulate(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON (as written by `hfplan search`)")],
    timeline: Annotated[Path | None, typer.Option(help="write a Gantt chart: .png or .html")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON instead of tables")] = False,
    out: Annotated[Path | None, typer.Option(help="write the plan with this estimate filled in")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="also list the transfers that take no time (under "
                                                         "half a millisecond)")] = False,
) -> None:
    """Simulate one iteration of a plan: timeline of calls, stage times, iteration time, memory."""
    from hfplan.files import check_outputs, write_outputs
    from hfplan.plan import load_plan
    from hfplan.simulator.engine import simulate_plan
    from hfplan.simulator.gantt import check_timeline_path, timeline_chart

    if timeline is not None:
        check_timeline_path(timeline)
    check_outputs([(timeline, "--timeline"), (out, "--out")])
    plan = load_plan(plan_path)
    result = simulate_plan(plan)
    outputs = []
    if timeline is not None:
        outputs.append((timeline, timeline_chart(timeline, result.estimate.timeline, set_labels(plan),
                                                 title=plan_title(plan))))
    if out is not None:
        outputs.append((out, plan.model_copy(update={"estimate": result.estimate}).to_json()))
    write_outputs(outputs)
    if as_json:
        sys.stdout.write(json.dumps(result.estimate.model_dump(mode="json"), indent=2) + "\n")
        return
    render_timeline(result.estimate, show_all)
    render_totals(result.estimate, plan)
    if timeline is not None:
        console.print(f"timeline written to {timeline}", highlight=False)


@app.command()
@user_errors
def search(
    gpus: Annotated[int, typer.Option(help="GPUs to plan for")],
    workload: Annotated[str, typer.Option(help="built-in workload name or a workload .yaml/.json")] = "ppo-llama2-7b",
    hardware: Annotated[str, typer.Option(help="shipped hardware profile name or a profile .yaml")] = "a100-80g",
    gpus_per_node: Annotated[int | None, typer.Option(
        help="GPUs per node, a power of two, at most --gpus (default: the hardware profile's)")] = None,
    out: Annotated[Path, typer.Option(help="where to write the best plan")] = Path("best.json"),
    top: Annotated[int, typer.Option(min=1, help="plans to show")] = 5,
    csv: Annotated[Path | None, typer.Option(help="write every candidate (placement x allocation) to this CSV")] = None,
    jobs: Annotated[int | None, typer.Option(min=1, help="processes (default: all cores)")] = None,
    time_limit: Annotated[float | None, typer.Option(
        min=0, help="seconds from the start after which the walk of the allocations stops and the best so far "
                    "is reported with its proven gap to the optimum; inf: walk to the end (default: to the end up "
                    "to 2,048 GPUs, 60 s past that)")] = None,
    compare: Annotated[bool, typer.Option(help="also search other systems' fixed mappings and compare")] = True,
    target: Annotated[str, typer.Option(help="search only what this framework runs: hfplan (all), verl or "
                                             "openrlhf; then `hfplan export` writes its command")] = "hfplan",
    rollout_engines: Annotated[str, typer.Option(metavar="torch[,vllm]", help="the rollout engines hfplan's plans "
                                                                             "may generate with (vllm: where the "
                                                                             "run has it installed)")] = "torch",
) -> None:
    """Search placements and parallelism for the fastest RLHF iteration; write the best plan."""
    import os

    from hfplan.files import check_outputs, write_outputs
    from hfplan.planner.report import candidates_frame, status_counts
    from hfplan.planner.search import MAX_OPEN_PREFIXES, default_time_limit
    from hfplan.planner.search import search as run_search
    from hfplan.planner.targets import get_target, search_target
    from hfplan.spec import load_workload, make_cluster

    check_outputs([(out, "--out"), (csv, "--csv")])
    engines = parse_rollout_engines(rollout_engines)
    spec = load_workload(workload)
    cluster = make_cluster(gpus, hardware, gpus_per_node)
    chosen = get_target(target, spec)
    jobs = jobs or os.cpu_count() or 1
    if time_limit is None:
        time_limit = default_time_limit(cluster)
    with _progress() as progress:
        result = search_target(chosen, spec, cluster, top_k=top, progress=progress, jobs=jobs, time_limit=time_limit,
                               engines=engines)
        own = (run_search(spec, cluster, top_k=1, jobs=jobs, time_limit=time_limit).best if target != "hfplan"
               else None)
        comparison = []
        if compare:
            from hfplan.planner.baselines import compare as compare_systems

            comparison = compare_systems(spec, cluster, jobs=jobs)
    outputs: list[tuple[Path, str]] = [(out, result.best.to_json())]
    sides = staleness_outputs(out, result) if spec.staleness and target == "hfplan" else {}
    outputs += [(path, plan.to_json()) for path, plan in sides.values()]
    if csv is not None:
        outputs.append((csv, candidates_frame(result, spec).to_csv(index=False)))
    write_outputs(outputs)
    where = f"{display_name(workload)} on {gpus:,} x {cluster.profile.name}"
    table = Table(title=f"top {len(result.top)} plans: {where}", show_edge=False)
    _plan_columns(table, "#", len(str(len(result.top))))
    for rank, plan in enumerate(result.top, 1):
        table.add_row(str(rank), *_plan_cells(plan))
    console.print(table)
    if comparison:
        render_comparison(result.best, comparison)
    console.print(PARALLELISM_LEGEND, style="dim", highlight=False)
    stats, counts = result.stats, status_counts(result)
    console.print(f"searched {stats.placements:,} placements and {stats.allocations:,} allocations in "
                  f"{stats.seconds:.2f} s ({stats.simpy_runs:,} simpy runs): {sum(counts.values()):,} candidates, "
                  f"{counts['evaluated']:,} evaluated, {counts['pruned']:,} pruned by bounds, "
                  f"{counts['infeasible']:,} infeasible"
                  + (f", {counts['open']:,} left open by " + (f"--time-limit {time_limit:g}"
                                                                   if stats.stopped_by == "time limit" else
                                                                   f"the walk's cap of {MAX_OPEN_PREFIXES:,} open "
                                                                   f"prefixes and rows") if counts["open"] else "")
                  + f" (a pruned, infeasible or open candidate may stand for many allocations); {stats.twins:,} twins "
                    f"of a shown plan left out", highlight=False)
    console.print(f"[bold]best ({optimality_text(result.gap)}):[/] {seconds(result.best.estimate.iteration_s)} s "
                  f"per iteration, "
                  f"{result.best.estimate.tokens_per_s:,.0f} tokens/s; plan written to {escape(str(out))}"
                  + (f"; candidates to {escape(str(csv))}" if csv is not None else ""), highlight=False)
    if own is not None:
        render_target_gap(chosen, result.best, own, out)
    if sides:
        render_staleness(result, sides)


def staleness_outputs(out: Path, result) -> dict[str, tuple[Path, object]]:
    """A workload that allows staleness: its synchronous and asynchronous best, each beside --out (OUT.sync.json,
    OUT.async.json), by side."""
    found = {"sync": result.synchronous, "async": result.asynchronous}
    return {side: (out.with_name(f"{out.stem}.{side}{out.suffix}"), plan) for side, plan in found.items()
            if plan is not None}


def render_staleness(result, sides: dict[str, tuple[Path, object]]) -> None:
    """The synchronous and the asynchronous best, what the staleness buys, and where each plan went."""
    sync, pipelined = result.synchronous, result.asynchronous
    line = (f"[bold]synchronous best:[/] {seconds(sync.estimate.iteration_s)} s per iteration "
            f"({escape(str(sides['sync'][0]))}); ")
    if pipelined is None:
        console.print(line + "no plan with a rollout set apart from training fits, so none runs asynchronously",
                      highlight=False)
        return
    speedup = sync.estimate.iteration_s / pipelined.estimate.iteration_s
    console.print(line + f"[bold]asynchronous best[/] (staleness {pipelined.workload.staleness}: generation "
                  f"overlapping training on a rollout set): {seconds(pipelined.estimate.iteration_s)} s per "
                  f"iteration in the steady state ({escape(str(sides['async'][0]))}); [bold]speedup "
                  f"{speedup:.2f}x[/] over the synchronous best", highlight=False)


def optimality_text(gap: float) -> str:
    """'optimal' when the walk proved it, else how far from the optimum the best may be (its proven gap)."""
    if gap <= 0:
        return "optimal"
    return f"within {gap:.2%} of optimal" if math.isfinite(gap) else "no bound on the gap to the optimum"


def render_target_gap(target, best, own, out: Path) -> None:
    """How far the target's best is from hfplan's own best on the same simulator, and what to run next."""
    gap = best.estimate.iteration_s / own.estimate.iteration_s
    console.print(f"[bold]{escape(target.source.label)}[/]: {target.summary}. Its best takes "
                  f"{seconds(best.estimate.iteration_s)} s per iteration; hfplan's own best on the same simulator "
                  f"{seconds(own.estimate.iteration_s)} s (the target's takes {gap:.2f}x as long). Run it there: "
                  f"hfplan export {escape(str(out))} --to {target.name}", highlight=False)


@app.command("export")
@user_errors
def export_command(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON (as written by `hfplan search`)")],
    to: Annotated[str, typer.Option("--to", help="framework: verl or openrlhf")],
    out: Annotated[Path | None, typer.Option(
        help="also write verl's YAML config (run with --config-path/--config-name) or OpenRLHF's shell script")]
        = None,
) -> None:
    """Print the command that runs a plan on verl or OpenRLHF; refuse, with the reason, a plan it cannot run."""
    from hfplan.export import export_plan
    from hfplan.files import check_outputs, write_outputs
    from hfplan.plan import load_plan

    check_outputs([(out, "--out")])
    result = export_plan(load_plan(plan_path), to, str(plan_path))
    if out is not None:
        write_outputs([(out, result.file_text)])
    typer.echo(result.command, nl=False)
    if out is not None:
        err_console.print(f"{result.framework} {'config' if to == 'verl' else 'script'} written to {escape(str(out))}",
                          highlight=False)


@app.command()
@user_errors
def profile(
    device: Annotated[str | None, typer.Option(
        help="device to profile: cuda or cpu (default: cuda when available, else cpu)")] = None,
    world_size: Annotated[int | None, typer.Option(
        "--world-size", "-w", help="processes (devices) the collectives run across (default: every visible GPU; "
                                   "on CPU 2-4, one per core)")] = None,
    model: Annotated[str | None, typer.Option(
        help="catalog model (or config.json) whose transformer layer is measured against the cost model "
             "(default: llama3.1-8b)")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="short sweeps: under 2 minutes on a 2-core CPU, a few minutes on a GPU node")] = False,
    out: Annotated[Path | None, typer.Option(
        help="profile YAML to write; the raw measurements go beside it as .csv (default: ./<device>.yaml)")] = None,
    base: Annotated[str | None, typer.Option(
        help="profile whose unmeasured links (inter-node; host on CPU) are carried over (default: cpu on CPU; "
             "a100-80g, h100-80g or h200-141g by GPU name; with --refit, the refitted profile's)")] = None,
    refit: Annotated[Path | None, typer.Option(
        help="measure nothing: fit this profile .yaml again from its raw measurements (the .csv beside it) with "
             "this version of hfplan (default --out: ./<its name>-refit.yaml)")] = None,
) -> None:
    """Measure compute, memory and communication on this machine; write a hardware profile for `--hardware`."""
    from hfplan.profiler import report
    from hfplan.profiler.command import profile_machine, refit_profile_file

    if refit is not None:
        given = [name for name, value in (("--device", device), ("--world-size", world_size), ("--model", model),
                                          ("--quick", quick or None)) if value is not None]
        if given:
            raise HfplanError(f"--refit measures nothing: {', '.join(given)} cannot be given with it (the profile's "
                              "measurements say them)")
        outcome = refit_profile_file(refit, out, base)
    else:
        with _ProfileProgress() as progress:
            outcome = profile_machine(device, world_size, model or "llama3.1-8b", quick, out, base, progress)
    result = outcome.result
    console.print(report.fits_table(result))
    console.print(report.layer_table(result))
    console.print(report.error_summary(result.measurements), highlight=False)
    note = report.flag_note(result)
    if note is not None:
        console.print(note, style="bold yellow", highlight=False)
    pace = report.pace_note(result)
    if pace is not None:
        console.print(pace[0], style="bold yellow" if pace[1] else None, highlight=False)
    console.print(f"profile written to {escape(str(outcome.out))} (raw measurements: {escape(str(outcome.csv_path))});"
                  f" use it with `hfplan search --hardware {escape(str(outcome.out))}`", highlight=False)


@app.command()
@user_errors
def cost(
    kind: Annotated[str, typer.Argument(metavar="CALL", help="train, forward, generate or collective")],
    model: Annotated[str, typer.Option(help="catalog model or config.json")] = "llama2-7b",
    hardware: Annotated[str, typer.Option(help="shipped profile name or profile .yaml")] = "a100-80g",
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline-parallel size")] = 1,
    dp: Annotated[int, typer.Option(help="data-parallel size (generate: engine replicas)")] = 1,
    micro_batch: Annotated[int, typer.Option(help="sequences per micro-batch per data-parallel rank")] = 1,
    batch: Annotated[int, typer.Option(help="sequences (train, forward) or prompts (generate) of the call")] = 8,
    seq_len: Annotated[int, typer.Option(help="tokens per sequence (train, forward)")] = 2048,
    prompt_len: Annotated[int, typer.Option(help="prompt tokens (generate)")] = 1024,
    response_len: Annotated[int, typer.Option(help="longest response (generate)")] = 1024,
    response_len_mean: Annotated[float | None, typer.Option(help="mean response length (generate)")] = None,
    batching: Annotated[str, typer.Option(help="generate: static or continuous")] = "static",
    kv_cache: Annotated[str, typer.Option(help="generate: reserved, or paged (with continuous batching)")]
        = "reserved",
    recompute: Annotated[str, typer.Option(help="train: none, selective or full")] = "none",
    virtual_stages: Annotated[int, typer.Option(help="train: model chunks per pipeline stage")] = 1,
    shard: Annotated[bool, typer.Option("--shard/--no-shard", help="train: FSDP / ZeRO-3 or replicated")] = True,
    head: Annotated[str, typer.Option(help="lm, or scalar (critic, reward)")] = "lm",
    op: Annotated[str, typer.Option(help="collective: all_reduce, all_gather, reduce_scatter or p2p")]
        = "all_reduce",
    nbytes: Annotated[float, typer.Option("--bytes", help="collective: message bytes")] = 2.0**30,
    gpus: Annotated[int | None, typer.Option(help="collective: group size (default tp * pp * dp)")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs per node (default: the profile's)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the cost as JSON instead of tables")] = False,
) -> None:
    """The cost of one call as the search computes it: seconds, FLOP/s per GPU, tokens/s, memory, parts."""
    from hfplan.simulator.call_cost import CallRequest, call_cost

    result = call_cost(CallRequest(
        kind=kind, hardware=hardware, model=model, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, batch=batch,
        seq_len=seq_len, prompt_len=prompt_len, response_len=response_len, response_len_mean=response_len_mean,
        recompute=recompute, virtual_stages=virtual_stages, shard=shard, head=head, batching=batching,
        kv_cache=kv_cache, gpus_per_node=gpus_per_node, op=op, nbytes=nbytes, gpus=gpus))
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return
    render_cost(result)


def render_cost(result) -> None:
    totals = Table(title=f"{result.kind} on {result.gpus} GPU(s)", show_edge=False)
    totals.add_column("measure")
    totals.add_column("value", justify="right")
    totals.add_row("seconds", seconds(result.seconds))
    if result.flops_per_gpu_per_s is not None:
        totals.add_row("TFLOP/s per GPU", f"{result.flops_per_gpu_per_s / 1e12:,.1f}")
    if result.tokens_per_s is not None:
        totals.add_row("tokens/s" + (" (response)" if result.kind == "generate" else ""), f"{result.tokens_per_s:,.0f}")
    if result.memory_gib_per_gpu is not None:
        totals.add_row("memory GiB per GPU", f"{result.memory_gib_per_gpu:,.2f}")
    for name, value in result.detail.items():
        if name not in ("fits", "usable_gib_per_gpu"):
            totals.add_row(name.replace("_", " "), f"{value:,.1f}" if isinstance(value, float) else str(value))
    console.print(totals)
    if result.detail.get("fits") is False:
        console.print(f"[bold red]does not fit:[/] {result.memory_gib_per_gpu:,.1f} GiB per GPU, "
                      f"{result.detail['usable_gib_per_gpu']:,.1f} GiB usable", highlight=False)
    from hfplan.simulator.call_cost import part_meaning

    parts = Table(title="seconds by part", show_edge=False)
    phases = list(result.phases)
    for column in ("part", "seconds", "share %", *phases, "what it is"):
        parts.add_column(column, justify="left" if column in ("part", "what it is") else "right")
    for name, value in sorted(result.parts.items(), key=lambda item: -item[1]):
        if value > 0:
            by_phase = [seconds(result.phases[phase].get(name, 0.0)) for phase in phases]
            parts.add_row(name, seconds(value), f"{100 * value / result.seconds:.1f}", *by_phase, part_meaning(name))
    console.print(parts)


def seconds(value: float) -> str:
    """Seconds to the hundredth, or with 4 significant digits below one second: 42.28, 0.01234."""
    return f"{value:,.2f}" if value >= 1 else f"{value:.4g}"


def display_name(ref: str) -> str:
    """A built-in name as it is; a file (workload, config.json, profile) by its name without folders."""
    if "/" not in ref and not ref.endswith((".yaml", ".yml", ".json")):
        return ref  # built-in names may hold dots: qwen2.5-7b
    path = Path(ref)
    return path.parent.name if path.name == "config.json" else path.stem


def _plan_columns(table: Table, first: str, width: int = 0) -> None:
    if first == "#":
        table.add_column(first, justify="right", no_wrap=True, min_width=width)
        table.add_column("placement (GPUs, peak memory per GPU)", overflow="fold")
    else:
        table.add_column(f"{first}: placement (GPUs, peak memory per GPU)", overflow="fold", min_width=width)
    table.add_column("parallelism", overflow="fold")
    for column in ("iteration s", "tokens/s"):
        table.add_column(column, justify="right", no_wrap=True)


def _placement_lines(plan) -> str:
    """One line per colocated set, with its peak memory: roles spaced so that a narrow table wraps between them."""
    peaks = plan.estimate.peak_memory_gib
    lines = [f"{' + '.join(g.models)} ({gpus_text(g.gpus)}, {memory_text(peak)})"
             for g, peak in zip(plan.placement, peaks, strict=True)]
    idle = plan.estimate.idle_gpus
    stale = plan.workload.staleness
    return "\n".join(lines + ([f"idle ({gpus_text(idle)})"] if idle else [])
                     + ([f"asynchronous: staleness {stale}"] if stale else []))


def gpus_text(count: int) -> str:
    return f"{count:,} GPU{'s' if count != 1 else ''}"


def memory_text(gib: float) -> str:
    """GiB with one decimal; MiB below a tenth of a GiB (the demo models' few MiB are not "0.0 GiB")."""
    return f"{gib:.1f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"


def _plan_cells(plan) -> tuple[str, str, str, str]:
    from hfplan.planner.report import describe_role

    est = plan.estimate
    layouts = "\n".join(f"{role}: {describe_role(par)}" for role, par in plan.parallelism.items())
    return _placement_lines(plan), layouts, seconds(est.iteration_s), f"{est.tokens_per_s:,.0f}"


def render_comparison(best, comparison) -> None:
    """Each system's best mapping within its rules, in the columns of the top plans (the system's name heads
    its placement), with hfplan's speedup over it; or why nothing fits within its rules."""
    table = Table(title="other systems' mappings, on the same simulator, and hfplan's speedup over each",
                  show_edge=False)
    _plan_columns(table, "system", max(len(item.baseline.name) for item in comparison))
    table.add_column("speedup", justify="right", no_wrap=True)
    for item in comparison:
        name = f"[bold]{escape(item.baseline.name)}[/]"
        if item.plan is None:
            table.add_row(f"{name}\ndoes not fit", escape(item.reason), "-", "-", "-")
            continue
        placement, layouts, iteration, tokens = _plan_cells(item.plan)
        speedup = item.plan.estimate.iteration_s / best.estimate.iteration_s
        table.add_row(f"{name}\n{placement}", layouts, iteration, tokens, f"{speedup:.2f}x")
    console.print(table)
    for item in comparison:
        console.print(f"{item.baseline.name}: {item.baseline.description}", style="dim", highlight=False)


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


class _ProfileProgress:
    """The profiler's phases as progress bars, after one line saying what is measured."""

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console)
        self._live = False
        return self

    def started(self, description: str) -> None:
        console.print(description, highlight=False)
        self._bar.start()
        self._live = True

    def phase(self, name: str, total: int) -> Callable[[], None]:
        task = self._bar.add_task(name, total=total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self._live:
            self._bar.stop()


def set_labels(plan) -> list[str]:
    return [f"set {i}: {'+'.join(g.models)} ({gpus_text(g.gpus)})" for i, g in enumerate(plan.placement)]


def plan_title(plan) -> str:
    """The workload and the hardware, by name: algorithm, models (files by their names), GPUs and profile."""
    w = plan.workload
    models = sorted({display_name(ref) for ref in w.models.values()})
    return (f"{w.algorithm} {'/'.join(models)}, {w.batch_prompts:,} prompts x {w.samples_per_prompt}, "
            f"{w.prompt_len:,}+{w.response_len:,} tokens, on {plan.cluster.gpus:,} x {plan.cluster.profile.name}")


# A transfer or dispatch this short shows as 0.000 s: `simulate` lists it only with --all.
ZERO_S = 0.0005
HIDDEN_WHEN_SHORT = ("transfer", "dispatch")


def render_timeline(estimate, show_all: bool = False) -> None:
    table = Table(title="timeline (one iteration)", show_edge=False)
    for column in ("set", "role", "call", "phase", "kind", "start s", "end s", "seconds"):
        table.add_column(column, justify="right" if column.endswith("s") and column != "kind" else "left")
    hidden = 0
    for span in estimate.timeline:
        if not show_all and span.kind in HIDDEN_WHEN_SHORT and span.end - span.start < ZERO_S:
            hidden += 1
            continue
        table.add_row("controller" if span.set < 0 else str(span.set), span.role, span.op, span.phase, span.kind,
                      f"{span.start:,.3f}", f"{span.end:,.3f}", f"{span.end - span.start:,.3f}")
    console.print(table)
    if hidden:
        console.print(f"{hidden:,} transfers and dispatches of under half a millisecond not shown (--all shows them)",
                      style="dim",
                      highlight=False)


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
        memory.add_row(label, f"{peak:,.1f}")
    console.print(memory)
    console.print(f"[bold]iteration:[/] {seconds(estimate.iteration_s)} s   [bold]throughput:[/] "
                  f"{estimate.tokens_per_s:,.0f} tokens/s ({estimate.tokens_per_s / plan.cluster.gpus:,.0f} per GPU)")


# execute's options that a --config file (and a resumed run's run_config.json) may give: parameter -> its key
RUN_CONFIG_OPTIONS = {"iterations": "iterations", "data": "data", "out": "out", "seed": "seed", "overrides": "set",
                      "checkpoint_every": "checkpoint_every", "keep": "keep", "long_prompts": "long_prompts",
                      "log_every": "log_every", "logger": "loggers", "samples": "samples", "eval_data": "eval_data",
                      "eval_every": "eval_every"}


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` on the command line (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


@app.command()
@user_errors
def execute(
    ctx: typer.Context,
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON (as written by `hfplan search`)")],
    iterations: Annotated[int, typer.Option(min=1, help="RLHF iterations to run")] = 40,
    data: Annotated[str | None, typer.Option(help="prompts: .parquet or .jsonl with a 'prompt' column "
                                                  "(default: the actor model's built-in set)")] = None,
    out: Annotated[Path, typer.Option(help="run folder: metrics, timeline.json, checkpoints, run_config.json")]
    = Path("run"),
    address: Annotated[str | None, typer.Option(help="an existing Ray cluster (default: start a local one)")] = None,
    seed: Annotated[int, typer.Option(help="seed of weights, data order and sampling")] = 0,
    overrides: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                        help="override a hyperparameter (repeatable)")] = None,
    timeline: Annotated[Path | None, typer.Option(help="draw the last iteration's measured timeline: .png or "
                                                       ".html")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(min=1, metavar="K", help="also checkpoint every K "
                                                         "iterations (one is always written at the end)")] = None,
    keep: Annotated[int, typer.Option(min=1, metavar="N", help="complete checkpoints kept")] = 2,
    resume_run: Annotated[str | None, typer.Option("--resume", metavar="[latest|ITERATION|PATH]",
                                                    help="continue from a checkpoint: the latest complete one in "
                                                         "--out (the default), the one of that iteration, or a "
                                                         "checkpoint folder")] = None,
    long_prompts: Annotated[str, typer.Option(metavar="truncate|refuse",
                                              help="a prompt longer than the workload's prompt_len: keep its last "
                                                   "prompt_len tokens (with a warning that counts them) or refuse "
                                                   "the data")] = "truncate",
    connect_timeout: Annotated[float, typer.Option(min=0.1, metavar="S", help="seconds to wait for the --address "
                                                                               "cluster to answer")] = 30.0,
    log_every: Annotated[int, typer.Option(min=1, metavar="N", help="when stderr is not a terminal, a progress "
                                                                    "line every N iterations")] = 10,
    logger: Annotated[str, typer.Option(metavar="NAMES", help="where the metrics go, comma-separated: jsonl "
                                                              "(metrics.jsonl), csv (metrics.csv), tensorboard "
                                                              "(tensorboard/), wandb (wandb/)")] = "jsonl",
    samples: Annotated[int, typer.Option(min=0, metavar="K", help="write each iteration's first K sampled responses "
                                                                  "(prompt, response, reward) to samples.jsonl; one "
                                                                  "is shown every --log-every iterations")] = 0,
    eval_data: Annotated[str | None, typer.Option(metavar="PATH", help="held-out prompts (.parquet or .jsonl "
                                                                       "with a 'prompt' column) the actor answers "
                                                                       "greedily: eval/reward in the metrics")] = None,
    eval_every: Annotated[int | None, typer.Option(min=1, metavar="N", help="evaluate on --eval-data every N "
                                                                            "iterations (and after the last; the "
                                                                            "default: after the last only)")] = None,
    config_file: Annotated[Path | None, typer.Option("--config", metavar="PATH",
                                                     help="a YAML or JSON file of these options (the command line "
                                                          "overrides it)")] = None,
    rollout: Annotated[str | None, typer.Option(metavar="torch|vllm", help="generate with this rollout engine "
                                                                           "instead of the plan's gen.engine")]
    = None,
) -> None:
    """Run a plan for real on Ray: the single controller, torch.distributed workers, the hybrid engine."""
    require_execute_extra("execute")
    from hfplan.executor.controller import ExecuteOptions
    from hfplan.executor.controller import execute as run_plan
    from hfplan.executor.errors import RunFailed
    from hfplan.executor.loggers import parse_names
    from hfplan.executor.run_config import parse_assignments, resolve
    from hfplan.executor.startup import StartupLog
    from hfplan.files import check_outputs, write_outputs
    from hfplan.plan import load_plan
    from hfplan.simulator.gantt import check_timeline_path, timeline_chart

    startup = StartupLog()  # from the launch of this process
    if timeline is not None:
        check_timeline_path(timeline)
    check_outputs([(timeline, "--timeline")])
    values = {"iterations": iterations, "data": data, "out": str(out), "seed": seed, "checkpoint_every":
              checkpoint_every, "keep": keep, "long_prompts": long_prompts, "log_every": log_every,
              "overrides": parse_assignments(overrides or []), "logger": parse_names(logger), "samples": samples,
              "eval_data": eval_data, "eval_every": eval_every}
    given = {key: values[name] for name, key in RUN_CONFIG_OPTIONS.items() if given_on_command_line(ctx, name)}
    config = resolve(given, config_file, resume_run)
    plan = load_plan(plan_path)
    if rollout is not None:
        plan = plan.with_rollout_engine(rollout)
    options = ExecuteOptions.from_config(config, address=address, resume=resume_run, connect_timeout_s=connect_timeout)
    last_spans: list = []
    with _IterationProgress(options.iterations, options.log_every) as progress:
        def on_iteration(report) -> None:
            last_spans[:] = report.spans
            progress.update(report.iteration, report.metrics, report.samples)

        try:
            summary = run_plan(plan, options, on_iteration, on_start=progress.started, startup=startup)
        except RunFailed as failure:
            progress.stop()
            err_console.print(f"[bold red]run failed:[/] {escape(str(failure))}", highlight=False, soft_wrap=True)
            err_console.print(_resume_hint(plan_path, options), highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            progress.stop()
            err_console.print(f"interrupted: the workers are stopped. {_resume_hint(plan_path, options)}",
                              highlight=False, soft_wrap=True)
            raise typer.Exit(INTERRUPTED) from None
    if timeline is not None and last_spans:
        write_outputs([(timeline, timeline_chart(timeline, last_spans, set_labels(plan),
                                                 title=f"measured: {plan_title(plan)}"))])
    render_run(summary, plan)
    if timeline is not None:
        console.print(f"timeline written to {timeline}")


@app.command()
@user_errors
def validate(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON (as written by `hfplan search`)")],
    iterations: Annotated[int, typer.Option(min=2, help="iterations to run; the first is a warm-up, not compared")]
    = 3,
    profile_path: Annotated[Path | None, typer.Option("--profile", help="hardware profile YAML to simulate on "
                                                                        "(default: the plan's hardware)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the comparison as one JSON object")] = False,
    timeline: Annotated[Path | None, typer.Option(help="draw the simulated timeline above the measured one: .png "
                                                       "or .html")] = None,
    data: Annotated[str | None, typer.Option(help="prompts: .parquet or .jsonl with a 'prompt' column")] = None,
    out: Annotated[Path | None, typer.Option(help="keep the executed iterations' run folder here (default: a "
                                                  "temporary folder, removed at the end)")] = None,
    seed: Annotated[int, typer.Option(help="seed of weights, data order and sampling")] = 0,
    overrides: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                        help="override a hyperparameter (repeatable)")] = None,
    address: Annotated[str | None, typer.Option(help="an existing Ray cluster (default: start a local one); one "
                                                     "beyond loopback is simulated as the plan's cluster")] = None,
    connect_timeout: Annotated[float, typer.Option(min=0.1, metavar="S", help="seconds to wait for the --address "
                                                                               "cluster to answer")] = 30.0,
) -> None:
    """Execute a plan and compare each call, stage, the iteration and peak memory with its simulation."""
    require_execute_extra("validate")
    from hfplan.executor.controller import ExecuteOptions
    from hfplan.executor.errors import RunFailed
    from hfplan.files import check_outputs, write_outputs
    from hfplan.plan import load_plan
    from hfplan.simulator.gantt import check_timeline_path, timeline_chart
    from hfplan.validation.run import side_by_side, with_profile
    from hfplan.validation.run import validate as run_validation

    if timeline is not None:
        check_timeline_path(timeline)
    check_outputs([(timeline, "--timeline")])
    plan = with_profile(load_plan(plan_path), profile_path)
    labels = set_labels(plan)
    with (tempfile.TemporaryDirectory(prefix="hfplan-validate-") as scratch,
          _IterationProgress(iterations, log_every=1) as progress):
        options = ExecuteOptions(iterations=iterations, data=data, out=out or Path(scratch) / "run", seed=seed,
                                 overrides=tuple(overrides or ()), address=address,
                                 connect_timeout_s=connect_timeout)
        try:
            result = run_validation(plan, options, labels, lambda report: progress.update(report.iteration,
                                                                                       report.metrics))
        except RunFailed as failure:
            err_console.print(f"[bold red]run failed:[/] {escape(str(failure))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
    if timeline is not None:
        spans, rows = side_by_side(result.simulated, result.measured, labels)
        write_outputs([(timeline, timeline_chart(timeline, spans, rows, title=f"simulated vs measured: "
                                                                            f"{plan_title(plan)}"))])
    if as_json:
        body = {"plan": str(plan_path), "iterations": iterations, "prompt_len": result.plan.workload.prompt_len,
                "response_len_mean": result.response_len_mean,
                "response_len_counts": [list(pair) for pair in result.response_len_counts],
                "simulated_cluster": {"gpus": result.plan.cluster.gpus,
                                      "gpus_per_node": result.plan.cluster.gpus_per_node},
                "other_cpu_cores": result.other_cpu_cores, "rank_start_spread_s": result.rank_start_spread_s,
                "pace": result.pace.to_json() if result.pace is not None else None, **result.comparison.to_json()}
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    render_validation(result)
    if timeline is not None:
        console.print(f"timeline written to {timeline}", highlight=False)


def _error_cell(error: float | None) -> str:
    return "-" if error is None else f"{error * 100:+.1f}%"


def render_validation(result) -> None:
    comparison = result.comparison
    calls = Table(title="calls (median of the measured iterations)", show_edge=False)
    for column in ("set", "role", "call", "phase", "kind", "simulated s", "measured s", "error"):
        calls.add_column(column, justify="right" if column.endswith(("s", "error")) and column != "kind" else "left")
    for c in comparison.calls:
        calls.add_row("controller" if c.set < 0 else str(c.set), c.role, c.op, c.phase, c.kind,
                      f"{c.simulated:,.4f}", f"{c.measured:,.4f}", _error_cell(c.error))
    console.print(calls)
    figures = Table(title="stages, iteration, peak memory per GPU", show_edge=False)
    for column in ("", "simulated", "measured", "error"):
        figures.add_column(column, justify="left" if not column else "right")
    for phase, f in comparison.stages.items():
        figures.add_row(f"{phase} s", f"{f.simulated:,.4f}", f"{f.measured:,.4f}", _error_cell(f.error))
    it = comparison.iteration
    figures.add_row("[bold]iteration s[/]", f"{it.simulated:,.4f}", f"{it.measured:,.4f}", _error_cell(it.error))
    for label, f in comparison.memory_gib.items():
        figures.add_row(f"{label} GiB", f"{f.simulated:,.3f}", f"{f.measured:,.3f}", _error_cell(f.error))
    console.print(figures)
    counts = result.response_len_counts
    cluster = result.plan.cluster
    console.print(f"simulated with the measured response lengths ({sum(n for _, n in counts)} responses, mean "
                  f"{result.response_len_mean:.1f} tokens, longest {max(length for length, _ in counts)}) and prompt "
                  f"width ({result.plan.workload.prompt_len} tokens), on "
                  f"{cluster.nodes} node(s) of {cluster.gpus_per_node} as the run placed its {cluster.gpus} "
                  "process(es); error = (simulated - measured) / measured", highlight=False)
    if result.other_cpu_cores is not None:
        console.print(f"other processes used {result.other_cpu_cores:.2f} of the machine's {os.cpu_count()} cores "
                      "during the compared iterations (their work slows the run and no profile predicts it)",
                      highlight=False)
    if result.rank_start_spread_s is not None:
        charged = result.plan.cluster.profile.runtime.rank_dispatch_us
        console.print(f"ranks' start spread: a task sent to every rank of a set started on its last rank a median "
                      f"{result.rank_start_spread_s * 1e3:.2f} ms after its first (the profile charges "
                      f"{charged / 1e3:.2f} ms per rank past the first, runtime.rank_dispatch_us)", highlight=False)
    if result.pace is not None:
        pace = result.pace
        console.print(f"machine pace: the probe (a decode step of the tiny model) took {pace.before_s * 1e6:,.0f} us "
                      f"before the run and {pace.after_s * 1e6:,.0f} us after it, {pace.ratio:.2f}x the "
                      f"{pace.profiled_s * 1e6:,.0f} us the profile implies (above 1: the machine ran slower than "
                      "when profiled, which stretches every measured call alike)", highlight=False)
        if pace.sharing is not None:
            shared = pace.sharing
            profiled = "not measured" if shared.profiled is None else f"{shared.profiled:.2f}"
            console.print(f"host sharing: {shared.world} probes at once took {shared.before_s * 1e6:,.0f} and "
                          f"{shared.after_s * 1e6:,.0f} us each (before, after): parallelism {pace.parallelism:.2f} "
                          f"around the run against the profile's {profiled} (below it: the processes of a set slow "
                          "each other more than the simulator charges)", highlight=False)
        if pace.split is not None:
            probe = pace.split
            console.print(f"split engine's pace: the profile's log-prob calls of the tiny model over {probe.world} "
                          f"processes (wrapped in FSDP2, split by tensor parallelism) took {probe.before_s * 1e3:,.1f} "
                          f"ms before the run and {probe.after_s * 1e3:,.1f} ms after it, {probe.ratio:.2f}x the "
                          f"{probe.profiled_s * 1e3:,.1f} ms the profile prices them at (above 1: the calls of a set "
                          "of several processes ran slower than when profiled)", highlight=False)
        moved = pace.drifted()
        if moved is not None:
            console.print(moved, style="bold yellow", highlight=False)
    for side, names in comparison.unmatched.items():
        if names:
            console.print(f"only {side}: {', '.join(names)}", style="dim", highlight=False)


def _resume_hint(plan_path: Path, options) -> str:
    """Where the run can continue from, and the command that continues it with the same data, seed and length."""
    from hfplan.executor.resume import latest

    found = latest(options.out)
    if found is None:
        return "No checkpoint was written yet (--checkpoint-every K writes them): rerun from the start."
    again = [f"hfplan execute {plan_path} --out {options.out} --resume --iterations {options.iterations}"]
    again += [f"--data {options.data}"] if options.data else []
    again += [f"--seed {options.seed}"] if options.seed else []
    again += [f"--checkpoint-every {options.checkpoint_every}"] if options.checkpoint_every else []
    return f"The last complete checkpoint is {found}; continue with: {' '.join(again)}"


@app.command("export-model")
@user_errors
def export_model(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="a run folder (its latest complete checkpoint) or "
                                                                "one checkpoint folder")],
    out: Annotated[Path | None, typer.Option(help="where the model folders go (default: the run folder's hf/)")]
    = None,
) -> None:
    """Write a checkpoint's trained roles (actor, critics) as Hugging Face folders: safetensors, config, tokenizer."""
    require_execute_extra("export-model")
    from hfplan.executor.controller import EXPORT_FOLDER
    from hfplan.executor.export_model import checkpoint_of, export_checkpoint
    from hfplan.executor.resume import CHECKPOINTS_FOLDER

    folder = checkpoint_of(run_dir)
    if out is None:
        run_folder = folder.parent.parent if folder.parent.name == CHECKPOINTS_FOLDER else folder
        out = run_folder / EXPORT_FOLDER
    for role, path in export_checkpoint(folder, out).items():
        console.print(f"{role}: {path}", highlight=False)


class _IterationProgress:
    """A run's progress: a live bar on a terminal; otherwise a plain line every `log_every` iterations (and at
    the last), each with the iteration, reward, losses, tokens/s and the time left."""

    def __init__(self, total: int, log_every: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total, self.log_every = total, log_every
        self.live = err_console.is_terminal
        self._bar = Progress(TextColumn("[bold]execute"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[status]}"), console=err_console, transient=False,
                             disable=not self.live)
        self._task = self._bar.add_task("iterations", total=total, status="starting workers")
        self._first = 0  # the iteration the run started from (a resumed run's checkpoint)
        self._clock = time.monotonic()

    def __enter__(self):
        self._bar.start()
        return self

    def started(self, first_iteration: int, checkpoint: Path | None) -> None:
        """The workers are up: from iteration 0, or from the resumed checkpoint's."""
        self._first, self._clock = first_iteration, time.monotonic()
        if checkpoint is not None:
            err_console.print(f"resumed from {checkpoint} ({first_iteration} iterations done)", highlight=False,
                              soft_wrap=True)
        self._bar.update(self._task, completed=first_iteration, status="running")

    def update(self, iteration: int, metrics: dict, samples: list | None = None) -> None:
        done = iteration + 1
        parts = [f"reward {metrics['reward']:.3f}"] if "reward" in metrics else []
        parts += [f"{key} {value:.4g}" for key, value in metrics.items() if key.endswith("loss")]
        parts += [f"eval/reward {metrics['eval/reward']:.3f}"] if "eval/reward" in metrics else []
        parts.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
        per_iteration = (time.monotonic() - self._clock) / max(done - self._first, 1)
        left = per_iteration * (self.total - done)
        if self.live:
            status = ", ".join([*parts[:1], f"{metrics['iteration_s']:.2f} s/it", parts[-1]])
            self._bar.update(self._task, completed=done, status=status)
        elif done % self.log_every == 0 or done == self.total:
            err_console.print(f"iteration {done}/{self.total}  " + "  ".join(parts) + f"  ETA {_clock_time(left)}",
                              highlight=False, soft_wrap=True)
        if samples and (done % self.log_every == 0 or done == self.total):
            err_console.print(escape(sample_line(samples[0])), highlight=False, soft_wrap=True)

    def stop(self) -> None:
        self._bar.stop()

    def __exit__(self, *exc) -> None:
        self._bar.stop()


def sample_line(sample) -> str:
    """One sample as a progress line: `  sample: "prompt" -> "response"  reward 0.25` (texts cut at 80 characters)."""
    def quoted(text: str) -> str:
        shown = json.dumps(text, ensure_ascii=False)
        return shown if len(shown) <= 80 else shown[:79] + '…"'

    scores = "".join(f"  {key} {value:.3f}" for key, value in (("reward", sample.reward), ("cost", sample.cost))
                     if value is not None)
    return f"  sample: {quoted(sample.prompt)} -> {quoted(sample.response)}{scores}"


def _clock_time(seconds_left: float) -> str:
    minutes, secs = divmod(int(round(seconds_left)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def render_run(summary, plan) -> None:
    rows = summary.iterations
    table = Table(title=f"run: {plan_title(plan)}", show_edge=False)
    keys = [k for k in ("reward", "cost", "kl", "response_len", "iteration_s", "tokens_per_s") if k in rows[0]]
    table.add_column("iterations")
    for key in keys:
        table.add_column(key, justify="right")
    count = min(10, len(rows) // 2)  # two windows that never share an iteration
    if count == 0:
        table.add_row(f"all {len(rows)}", *(f"{summary.mean_of(k, True, len(rows)):,.4g}" for k in keys))
    for label, first in ((f"first {count}", True), (f"last {count}", False)) if count else ():
        table.add_row(label, *(f"{summary.mean_of(k, first, count):,.4g}" for k in keys))
    console.print(table)
    if "reward" in rows[0] and count:
        before, after = summary.mean_of("reward", True, count), summary.mean_of("reward", False, count)
        change = f" ({(after - before) / abs(before) * 100:+.1f}%)" if before else ""
        console.print(f"[bold]mean reward[/] of the last {count} iterations: {after:.4f} vs {before:.4f} in the "
                      f"first {count}{change}")
    elif "reward" in rows[0]:
        console.print(f"{len(rows)} iteration{'s' if len(rows) > 1 else ''}: too few to compare the first "
                      "iterations' reward with the last ones'")
    if "eval/reward" in rows[-1]:
        console.print(f"[bold]eval/reward[/] after the last iteration: {rows[-1]['eval/reward']:.4f}")
    console.print(f"metrics and measured timeline written to {summary.out}/")
    if summary.checkpoint is not None:
        console.print(f"checkpoint: {summary.checkpoint}", highlight=False)
    for role, path in summary.exported.items():
        console.print(f"{role} exported as a Hugging Face model: {path}", highlight=False)


if __name__ == "__main__":  # `python -m hfplan.cli`, as the `hfplan` script
    app(prog_name="hfplan")
