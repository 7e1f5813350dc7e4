"""The simulator against the executor: `hfplan validate`'s comparison over a grid of plans on this machine.

Workloads: the built-in `demo` (PPO), `arith-grpo` (GRPO) and the demo run as ReMax (`demo-remax`: its actor,
reference and rule reward); with --model, every model role runs that catalog model instead; with --small, each demo
model its larger counterpart of the same vocabulary (`small`, `small-arith`: 12M parameters, where the tiny ones'
calls are mostly fixed costs, theirs are mostly GEMMs). Placements: every role
on one set, in the layouts tp x pp x dp of bench/execute_layouts.py that fit --max-processes (--quick: 1x1x1, 1x1x2,
2x1x1); the actor apart from the other roles on 2 processes (split, the search's best layouts for it); and a
separate rollout engine beside the colocated roles on 2 processes (--quick: neither). Each plan is validated
--repeats times (hfplan.validation.run.validate: executed, the first iteration a warm-up, then simulated with the
measured response lengths) on one Ray session. Prints each plan's simulated and (median) measured iteration and
its spread over the repeats ((highest - lowest) / median), the most CPU other processes used during a run's
compared iterations (`others`, cores: hfplan.validation.machine), the machine's pace around its runs (`pace`: the
probe's time over the profile's, hfplan.profiler.pace; nan where the profile was not measured on CPU) and each
stage's error in its first run, then the median and worst absolute per-stage error, the iteration and memory
errors, the median spread, and Kendall's tau between simulated and measured iteration times, over all plans and
over the pairs whose measured ranges do not overlap (the ranking the search relies on, where the measurements
settle it), the other processes' CPU and the pace over all runs, and, where validate measured the host's
parallelism around a run (several probes at once against one alone), its range and the errors once each run is
costed again with that parallelism and stretched by its pace (a reading of what the machine's state around the run
explains, not the model), and the split engine's pace validate measured around the runs beside the median signed
iteration error of the plans with a set of several processes and of the others (the same kind of reading). Asserts
nothing about time.

With --save PATH it also writes every run's costed plan (the measured response lengths, the cluster it ran on) and
measured figures as JSON; --recost PATH runs nothing and costs those runs again with the code at hand (and
--hardware, if given), printing the same figures: a change to the model read against the same measurements, where
two grids on a VM whose pace drifts differ by more than the change.

    RAY_AUTH_MODE=disabled python bench/validate.py [--quick] [--iterations N] [--repeats N] [--hardware NAME|PATH]
                                                    [--max-processes N] [--model NAME | --small] [--save PATH]
    python bench/validate.py --recost PATH [--hardware NAME|PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from execute_layouts import LAYOUTS  # bench/ is the script's folder, hence on sys.path

from hfplan.dataflow.ops import PHASES
from hfplan.executor.controller import ExecuteOptions
from hfplan.layout import ROLLOUT
from hfplan.plan import Plan, colocated_plan
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.profiles.models import LARGER_DEMO_MODELS
from hfplan.spec import BUILTIN_WORKLOADS, RULE_PREFIX, Workload, make_cluster, workload_from_dict
from hfplan.validation.compare import Comparison, kendall_tau
from hfplan.validation.run import validate

QUICK_LAYOUTS = ((1, 1, 1), (1, 1, 2), (2, 1, 1))


def workloads(model: str | None = None, small: bool = False) -> dict[str, Workload]:
    """demo, arith-grpo and demo-remax (the demo's models, batch and lengths, trained by ReMax); `model`: every
    model role of each runs that catalog model instead (rule rewards stay); `small`: each demo model is its larger
    counterpart (LARGER_DEMO_MODELS)."""
    remax = dict(BUILTIN_WORKLOADS["demo"], algorithm="remax")
    remax["models"] = {role: remax["models"][role] for role in ("actor", "reference", "reward")}
    specs = {"demo": BUILTIN_WORKLOADS["demo"], "arith-grpo": BUILTIN_WORKLOADS["arith-grpo"], "demo-remax": remax}
    out = {}
    for name, spec in specs.items():
        if model is not None:
            spec = dict(spec, models={role: ref if ref.startswith(RULE_PREFIX) else model
                                      for role, ref in spec["models"].items()})
        if small:
            spec = dict(spec, models={role: LARGER_DEMO_MODELS.get(ref, ref) for role, ref in spec["models"].items()})
        out[name] = workload_from_dict(spec, name)
    return out


def placed_plans(workload: Workload, hardware: str) -> list[tuple[str, Plan]]:
    """The actor apart from the other model roles, and a separate rollout engine beside them, on 2 processes:
    the search's best layouts for each placement."""
    roles = tuple(workload.model_roles)
    rest = tuple(r for r in roles if r != "actor")
    cluster = make_cluster(2, hardware)
    split = Rules(name="split", placements=((("actor",), rest),))
    rollout = Rules(name="rollout", rollout=True, placements=((roles, (ROLLOUT,)),))
    return [("split 1|1", search(workload, cluster, rules=split).best),
            ("rollout 1+1", search(workload, cluster, rules=rollout).best)]


@dataclass
class Point:
    """One plan validated `repeats` times."""

    label: str
    runs: list[Comparison]
    other_cores: list[float]  # each run's CPU of other processes during its compared iterations (cores)
    paces: list[float]  # each run's machine pace against the profile's (hfplan.profiler.pace; nan: not measured)
    parallelisms: list[float] = field(default_factory=list)  # each run's host parallelism around it (nan: none)
    # each run costed again on its profile with the parallelism measured around it (runs without one left out)
    at_machine: list[Comparison] = field(default_factory=list)
    # each run's split engine's pace against the profile's price of it (validate's split probe; nan: none)
    splits: list[float] = field(default_factory=list)
    spans_processes: bool = False  # a set of the plan has several processes (its calls make collectives)

    @property
    def simulated(self) -> float:
        return self.runs[0].iteration.simulated

    @property
    def measured(self) -> list[float]:
        return [r.iteration.measured for r in self.runs]

    @property
    def median(self) -> float:
        return statistics.median(self.measured)

    @property
    def spread(self) -> float:
        return (max(self.measured) - min(self.measured)) / self.median

    @property
    def error(self) -> float:
        return (self.simulated - self.median) / self.median

    @property
    def pace(self) -> float:
        return statistics.median(self.paces)

    @property
    def paced_error(self) -> float:
        """The error with the simulated time stretched by the machine's measured pace (nan: not measured)."""
        return (self.simulated * self.pace - self.median) / self.median

    def paced_stage_errors(self) -> list[float]:
        """Each run's stage errors with the simulated seconds stretched by that run's pace."""
        return [(f.simulated * pace - f.measured) / f.measured for r, pace in zip(self.runs, self.paces, strict=True)
                for f in r.stages.values() if f.measured > 0 and not math.isnan(pace)]


def stage_errors_line(comparison: Comparison) -> str:
    """Each stage's signed error, in the order of the phases (`-` where nothing was measured)."""
    return " ".join(f"{phase[:3]} " + ("-" if figure.error is None else f"{figure.error * 100:+.0f}%")
                    for phase, figure in sorted(comparison.stages.items(), key=lambda item: PHASES.index(item[0])))


def median_abs(values) -> float:
    values = [abs(v) for v in values if v is not None]
    return statistics.median(values) * 100 if values else float("nan")


def print_point(point: Point) -> None:
    print(f"{point.label:<26}{point.simulated:>12.3f}{point.median:>12.3f}{point.error * 100:>+8.1f}%"
          f"{point.spread * 100:>7.1f}%{max(point.other_cores):>8.2f}{statistics.median(point.paces):>7.2f}  "
          f"{stage_errors_line(point.runs[0])}", flush=True)


def run_record(costed: Plan, comparison: Comparison, others: float, pace: float, parallelism: float,
               split: float) -> dict:
    """What --save keeps of one run: the plan as it was costed (its measured response lengths, the cluster it ran
    on) and the measured figures, so that --recost can cost it again on another model or profile."""
    return {"costed": json.loads(costed.model_dump_json()), "other_cores": others, "pace": pace,
            "parallelism": parallelism, "split_pace": split,
            "iteration": comparison.iteration.measured,
            "stages": {phase: figure.measured for phase, figure in comparison.stages.items()},
            "memory_gib": {label: figure.measured for label, figure in comparison.memory_gib.items()}}


def recosted(record: dict, hardware: str | None, parallelism: float | None = None) -> Comparison:
    """A saved run's measured figures beside this code's simulation of its costed plan (on `hardware` if given;
    with `parallelism`, on a copy of its profile whose host parallelism is that: the machine around the run)."""
    from hfplan.plan import phase_seconds
    from hfplan.simulator.engine import simulate_plan
    from hfplan.validation.compare import Figure
    from hfplan.validation.run import predicted_gib

    costed = Plan.model_validate(record["costed"])
    if hardware is not None:
        costed = costed.model_copy(update={"cluster": costed.cluster.model_copy(update={"hardware": hardware})})
    hw = None
    if parallelism is not None:
        profile = costed.cluster.profile
        hw = profile.model_copy(update={"compute": profile.compute.model_copy(
            update={"host_parallelism": parallelism})})
    estimate = simulate_plan(costed, hw).estimate
    stages = phase_seconds(estimate.timeline)
    memory = zip(record["memory_gib"].items(), predicted_gib(costed, estimate.peak_memory_gib), strict=True)
    return Comparison(calls=[], stages={phase: Figure.of(stages.get(phase, 0.0), measured)
                                        for phase, measured in record["stages"].items()},
                      iteration=Figure.of(estimate.iteration_s, record["iteration"]),
                      memory_gib={label: Figure.of(predicted, measured) for (label, measured), predicted in memory})


def models_label(args) -> str:
    """The models the grid runs, as its header names them."""
    if args.small:
        return "small, small-arith"
    return args.model or "of each workload"


def measure(args, iterations: int, repeats: int, records: dict) -> list[Point]:
    """Validate every plan of the grid `repeats` times on one Ray session, printing each as it ends."""
    layouts = [lay for lay in (QUICK_LAYOUTS if args.quick else LAYOUTS) if lay[0] * lay[1] * lay[2]
               <= args.max_processes]
    plans: list[tuple[str, Plan]] = []
    for name, workload in workloads(args.model, args.small).items():
        plans += [(f"{name} t{tp}p{pp}d{dp}", colocated_plan(workload, tp, pp, dp, args.hardware))
                  for tp, pp, dp in layouts]
        if not args.quick and args.max_processes >= 2:
            plans += [(f"{name} {label}", plan) for label, plan in placed_plans(workload, args.hardware)]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray_tmp = tempfile.mkdtemp(prefix="hfr-", dir="/tmp")
    out = Path(tempfile.mkdtemp(prefix="hfplan-validate-"))
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=ray_tmp,
             log_to_driver=False)
    points = []
    try:
        print(f"hfplan validate over {len(plans)} plans x {repeats} runs, {iterations} iterations each (first a "
              f"warm-up), profile {args.hardware}, models {models_label(args)}, {os.cpu_count()} "
              f"cores, load {os.getloadavg()[0]:.1f}")
        print(HEADER)
        for label, plan in plans:
            runs, others, paces, parallelisms, at_machine, splits = [], [], [], [], [], []
            for repeat in range(repeats):
                options = ExecuteOptions(iterations=iterations, out=out / f"{label.replace(' ', '-')}-{repeat}",
                                         call_timeout_s=300, start_timeout_s=120)
                checked = validate(plan, options, [f"set {i}" for i in range(len(plan.placement))])
                runs.append(checked.comparison)
                others.append(checked.other_cpu_cores if checked.other_cpu_cores is not None else math.nan)
                paces.append(checked.pace.ratio if checked.pace is not None else math.nan)
                parallelism = checked.pace.parallelism if checked.pace is not None else None
                parallelisms.append(math.nan if parallelism is None else parallelism)
                probe = checked.pace.split if checked.pace is not None else None
                splits.append(math.nan if probe is None else probe.ratio)
                record = run_record(checked.plan, checked.comparison, others[-1], paces[-1], parallelisms[-1],
                                    splits[-1])
                records.setdefault(label, []).append(record)
                if parallelism is not None:
                    at_machine.append(recosted(record, None, parallelism))
            points.append(Point(label, runs, others, paces, parallelisms, at_machine, splits,
                                spans_processes(plan)))
            print_point(points[-1])
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return points


def recost(path: Path, hardware: str | None) -> list[Point]:
    """The saved grid's measurements against this code's simulation, printing each plan."""
    saved = json.loads(path.read_text())
    print(f"the measurements of {path} ({saved['runs']} of {len(saved['points'])} plans, {saved['iterations']} "
          f"iterations each, measured {saved['date']}) costed again on profile {hardware or 'as saved'}")
    print(HEADER)
    points = []
    for label, records in saved["points"].items():
        parallelisms = [r.get("parallelism", math.nan) for r in records]
        points.append(Point(label, [recosted(r, hardware) for r in records], [r["other_cores"] for r in records],
                            [r["pace"] for r in records], parallelisms,
                            [recosted(r, hardware, p) for r, p in zip(records, parallelisms, strict=True)
                             if not math.isnan(p)], [r.get("split_pace", math.nan) for r in records],
                            spans_processes(Plan.model_validate(records[0]["costed"]))))
        print_point(points[-1])
    return points


HEADER = (f"{'plan':<26}{'simulated s':>12}{'measured s':>12}{'error':>9}{'spread':>8}{'others':>8}{'pace':>7}"
          "  stages (first run: generation, preparation, training)")


def summary(points: list[Point]) -> None:
    stage_errors = [f.error for p in points for r in p.runs for f in r.stages.values()]
    print(f"median |error|: per stage {median_abs(stage_errors):.1f}% (worst "
          f"{max(abs(e) for e in stage_errors if e is not None) * 100:.1f}%), iteration "
          f"{median_abs([p.error for p in points]):.1f}% (worst {max(abs(p.error) for p in points) * 100:.1f}%), "
          f"memory {median_abs([f.error for p in points for r in p.runs for f in r.memory_gib.values()]):.1f}%; "
          f"median spread {statistics.median(p.spread for p in points) * 100:.1f}%")
    simulated, measured = [p.simulated for p in points], [p.median for p in points]
    ranges = [(min(p.measured), max(p.measured)) for p in points]
    settled = sum(1 for i in range(len(ranges)) for j in range(i + 1, len(ranges))
                  if ranges[i][1] < ranges[j][0] or ranges[j][1] < ranges[i][0])
    print(f"Kendall tau (simulated vs measured iteration): {kendall_tau(simulated, measured):.2f} over all "
          f"{len(points) * (len(points) - 1) // 2} pairs of plans; {kendall_tau(simulated, measured, ranges):.2f} "
          f"over the {settled} whose measured ranges do not overlap")
    others = [o for p in points for o in p.other_cores if not math.isnan(o)]
    if others:
        print(f"other processes' CPU during the compared iterations (cores of {os.cpu_count()}): median "
              f"{statistics.median(others):.2f}, most {max(others):.2f}")
    paces = [r for p in points for r in p.paces if not math.isnan(r)]
    if paces:
        print(f"machine pace against the profile's (the probe's time around each run over the profile's; above 1: "
              f"slower): median {statistics.median(paces):.2f}, range {min(paces):.2f}-{max(paces):.2f}")
        paced = [p for p in points if not math.isnan(p.pace)]
        print(f"at the machine's pace (each simulated time x its runs' pace, a reading, not the model): median "
              f"|error| per stage {median_abs([e for p in paced for e in p.paced_stage_errors()]):.1f}%, iteration "
              f"{median_abs([p.paced_error for p in paced]):.1f}% (worst "
              f"{max(abs(p.paced_error) for p in paced) * 100:.1f}%), Kendall tau "
              f"{kendall_tau([p.simulated * p.pace for p in paced], [p.median for p in paced]):.2f}")
    machine_reading(points)
    split_reading(points)


def machine_reading(points: list[Point]) -> None:
    """The host's parallelism around the runs, and the errors of each run costed with it and stretched by its pace:
    what is left once the machine's state around the run is counted (a reading, not the model)."""
    measured = []  # (the run costed at the machine's parallelism, its pace)
    for point in points:
        paces = [pace for pace, parallelism in zip(point.paces, point.parallelisms, strict=True)
                 if not math.isnan(parallelism)]
        measured += [(run, pace) for run, pace in zip(point.at_machine, paces, strict=True) if not math.isnan(pace)]
    parallelisms = [x for p in points for x in p.parallelisms if not math.isnan(x)]
    if not parallelisms or not measured:
        return
    print(f"host parallelism around the runs (probes at once against one alone): median "
          f"{statistics.median(parallelisms):.2f}, range {min(parallelisms):.2f}-{max(parallelisms):.2f}")
    stage = [(f.simulated * pace - f.measured) / f.measured for r, pace in measured for f in r.stages.values()
             if f.measured > 0]
    iteration = [(r.iteration.simulated * pace - r.iteration.measured) / r.iteration.measured for r, pace in measured]
    print(f"at the machine's pace and parallelism (each run costed with the parallelism measured around it, x its "
          f"pace; a reading, not the model): median |error| per stage {median_abs(stage):.1f}%, iteration "
          f"{median_abs(iteration):.1f}% (worst {max(abs(e) for e in iteration) * 100:.1f}%), over {len(measured)} "
          "runs")


def spans_processes(plan: Plan) -> bool:
    return any(group.gpus > 1 for group in plan.placement)


def split_reading(points: list[Point]) -> None:
    """The split engine's pace around the runs (validate's split probe against the profile's price of it), and the
    iteration errors of the plans whose sets span processes beside those of one-process plans: whether the misses of
    the first follow the machine's split engine (a reading, not the model)."""
    ratios = [x for p in points for x in p.splits if not math.isnan(x)]
    if not ratios:
        return
    spanning = [p for p in points if p.spans_processes]
    alone = [p for p in points if not p.spans_processes]
    print(f"split engine's pace against the profile's (the probe around each run; above 1: slower): median "
          f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; median iteration error "
          f"{statistics.median(p.error for p in spanning) * 100 if spanning else math.nan:+.1f}% over the "
          f"{len(spanning)} plans with a set of several processes, "
          f"{statistics.median(p.error for p in alone) * 100 if alone else math.nan:+.1f}% over the {len(alone)} "
          "others")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three colocated layouts, 3 iterations, one run each")
    parser.add_argument("--iterations", type=int, default=None, help="iterations per run (default 5; quick 3)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per plan (default 3; quick 1)")
    parser.add_argument("--hardware", default=None, help="hardware profile the plans are simulated on (default "
                                                         "cpu; with --recost, the profile each run was costed on)")
    parser.add_argument("--max-processes", type=int, default=4)
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model", default=None, help="a catalog model every model role runs instead of the "
                                                       "workloads' own (e.g. qwen2.5-0.5b on a GPU)")
    models.add_argument("--small", action="store_true", help="the demo models' larger counterparts (small, "
                                                             "small-arith: 12M parameters) in their places")
    parser.add_argument("--save", type=Path, default=None, help="also write every run's costed plan and measured "
                                                                "figures here (JSON), for --recost")
    parser.add_argument("--recost", type=Path, default=None, help="run nothing: cost the runs saved by --save "
                                                                  "again with this code and report the same figures")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.recost is not None:
        if not args.recost.is_file():
            parser.exit(2, f"--recost {args.recost}: file not found\n")
        summary(recost(args.recost, args.hardware))
        return
    if args.save is not None and not args.save.parent.is_dir():
        parser.exit(2, f"--save {args.save}: its folder does not exist\n")
    args.hardware = args.hardware or "cpu"
    iterations = args.iterations or (3 if args.quick else 5)
    repeats = args.repeats or (1 if args.quick else 3)
    records: dict[str, list[dict]] = {}
    points = measure(args, iterations, repeats, records)
    summary(points)
    print(f"whole benchmark: {time.perf_counter() - started:.0f} s")
    if args.save is not None:
        body = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "iterations": iterations, "runs": repeats,
                "points": records}
        temporary = args.save.with_name(args.save.name + ".part")
        temporary.write_text(json.dumps(body))
        temporary.replace(args.save)


if __name__ == "__main__":
    main()
