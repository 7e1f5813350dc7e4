"""`hfplan execute` against TRL's GRPOTrainer on a matched configuration: the built-in `arith-grpo` workload.

Both sides run the same GRPO iteration on one process with one torch thread: the tiny-arith actor and its
reference (the same architecture and initial weights, hfplan.executor.models.build_model under the run's seed,
fp32), hfplan's tokenizer, its built-in arithmetic prompts in the order its run hands them out, 8 prompts x 4
samples, at most 4 response tokens at temperature 1, the `arith-close` rule as the reward, AdamW at the workload's
actor_lr with one optimizer step per iteration, the workload's clip ratio, KL coefficient (so TRL runs its
reference forward too) and gradient clipping. hfplan runs the plan its search makes for 1 process on the `cpu`
profile (`hfplan execute PLAN` as a subprocess), twice: as the workload is, and with `reuse_policy_log_probs: true`
(no old-log-prob forward of the actor; TRL skips it too with one step per generation) where this hfplan has that
workload option. TRL runs in its own environment, made once in bench/.venv-trl (torch pinned, then hfplan and
trl==1.16.0 under constraints.txt; never a dependency of hfplan) or the interpreter given with --trl-python, as a
subprocess of bench/trl_runner.py, which times each step.

Runs alternate over --rounds (hfplan, hfplan reuse, TRL, hfplan, ...); the first iterations of every run are
warm-up. Per system: the median over the measured iterations of all rounds of response tokens/s, seconds per
iteration, its generation and what follows it; and the median over rounds of the start-up (process launch to
the first iteration's start; for hfplan also its start-up ratio to TRL's, and the seconds of each start-up stage
its run folder's startup.json names) and of the whole process. Prints figures; asserts nothing about time; exits
non-zero only when a run fails.

    RAY_AUTH_MODE=disabled python bench/vs_trl.py [--rounds N] [--iterations N] [--quick] [--trl-python PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / "bench" / ".venv-trl"
RUNNER = ROOT / "bench" / "trl_runner.py"
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"  # a CPU build lies on disk; an unpinned torch would pull a CUDA build
WORKLOAD = "arith-grpo"
REUSE = "reuse_policy_log_probs"  # the workload option that skips the actor's old-log-prob forward
HFPLAN, HFPLAN_REUSE, TRL = "hfplan", "hfplan reuse", "TRL"


def folder_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20


def ensure_trl_python() -> Path:
    """The TRL environment's python: made once (torch pinned first, then hfplan with its execute extra and TRL
    under the repository's constraints), reused afterwards. pip's output goes to the environment's install.log."""
    python = TRL_VENV / "bin" / "python"
    done = TRL_VENV / ".installed"
    if python.is_file() and done.is_file() and done.read_text().strip() == f"trl=={TRL_VERSION}":
        print(f"TRL environment: {TRL_VENV.relative_to(ROOT)} (made before; delete it to make it again)")
        return python
    print(f"making the TRL environment {TRL_VENV.relative_to(ROOT)} (once; pip's output in its install.log) ...",
          flush=True)
    started = time.perf_counter()
    if TRL_VENV.exists():
        shutil.rmtree(TRL_VENV)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    log = TRL_VENV / "install.log"
    steps = [["pip", "install", f"torch=={TORCH_VERSION}"],
             ["pip", "install", "-c", "constraints.txt", "-e", ".[execute]", f"trl=={TRL_VERSION}"]]
    with log.open("w") as sink:
        for step in steps:
            sink.write(f"$ {' '.join(step)}\n")
            sink.flush()
            result = subprocess.run([str(python), "-m", *step], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
            if result.returncode:
                raise SystemExit(f"TRL environment: `{' '.join(step)}` failed (exit {result.returncode}); see {log}")
    done.write_text(f"trl=={TRL_VERSION}\n")
    print(f"  made in {time.perf_counter() - started:.0f} s, {folder_mib(TRL_VENV):.0f} MiB on disk", flush=True)
    return python


@dataclass
class Run:
    """One process's measured iterations (after warm-up) and its start-up and whole-process seconds."""

    system: str
    iterations: list[dict] = field(default_factory=list)  # iteration_s, generation_s, preparation_s, training_s,
    # response_tokens_per_s, reward; and period_s where known
    startup_s: float = float("nan")  # process launch to the first iteration's start
    process_s: float = float("nan")  # process launch to exit
    after_s: float = float("nan")  # the last iteration's end to exit (hfplan: checkpoint, export, Ray shutdown)
    notes: dict = field(default_factory=dict)

    def median(self, key: str) -> float:
        values = [m[key] for m in self.iterations if key in m]
        return statistics.median(values) if values else float("nan")


def fail(what: str, log: Path, returncode: int) -> None:
    tail = log.read_text(errors="replace").splitlines()[-30:] if log.is_file() else []
    print(f"\n{what} failed (exit {returncode}); the last lines of {log}:\n" + "\n".join(tail), file=sys.stderr)
    raise SystemExit(1)


def make_plans(folder: Path) -> dict[str, Path]:
    """The plan hfplan's search makes for 1 process on the cpu profile, per hfplan variant (written as JSON)."""
    from hfplan.planner.search import search
    from hfplan.spec import Workload, load_workload, make_cluster, workload_from_dict

    base = load_workload(WORKLOAD)
    workloads = {HFPLAN: base}
    if REUSE in Workload.model_fields:
        workloads[HFPLAN_REUSE] = workload_from_dict(base.to_dict() | {REUSE: True}, f"{WORKLOAD} + {REUSE}")
    plans = {}
    for system, workload in workloads.items():
        plan = search(workload, make_cluster(1, "cpu"), jobs=1).best
        path = folder / f"plan-{system.replace(' ', '-')}.json"
        path.write_text(plan.to_json())
        plans[system] = path
    return plans


def run_hfplan(system: str, plan: Path, iterations: int, warmup: int, seed: int, out: Path) -> Run:
    """`hfplan execute` in a subprocess. Its progress line per iteration (stderr, `--log-every 1`) is stamped
    here as it arrives: the first one, less the first iteration's seconds, is the first iteration's start."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    command = [sys.executable, "-c", "import sys; from hfplan.cli import app; sys.argv[0] = 'hfplan'; app()",
               "execute", str(plan), "--iterations", str(iterations), "--out", str(out / "run"), "--seed", str(seed),
               "--log-every", "1"]
    log = out / "hfplan.log"
    ends: list[float] = []  # when each iteration's progress line arrived
    launched = time.time()
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            if line.startswith("iteration "):
                ends.append(time.time())
            sink.write(line)
        returncode = proc.wait()
    exited = time.time()
    if returncode:
        fail(f"{system}: hfplan execute", log, returncode)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line]
    if len(metrics) != iterations or len(ends) != iterations:
        raise SystemExit(f"{system}: expected {iterations} iterations, found {len(metrics)} metrics and "
                         f"{len(ends)} progress lines (see {log})")
    # The last iteration's line follows the final checkpoint; that iteration ends its seconds after the line
    # before (the next prompts' encoding, a few ms, aside).
    last_end = ends[-2] + metrics[-1]["iteration_s"]
    run = Run(system, startup_s=ends[0] - metrics[0]["iteration_s"] - launched, process_s=exited - launched,
              after_s=exited - last_end)
    for index in range(warmup, iterations):
        m = metrics[index]
        row = {key: m[key] for key in ("iteration_s", "generation_s", "preparation_s", "training_s",
                                       "response_tokens_per_s", "reward") if key in m}
        # The last line comes after the final checkpoint: no period for it.
        if index + 1 < iterations:
            row["period_s"] = ends[index] - ends[index - 1]
        run.iterations.append(row)
    timeline = json.loads((out / "run" / "timeline.json").read_text())
    calls = sorted({f"{s['role']}.{s['op']}" for s in timeline["iterations"][-1]["spans"] if s["kind"] == "compute"})
    run.notes["calls"] = ", ".join(calls)
    startup = out / "run" / "startup.json"  # the run's own start-up stages (an hfplan that writes them)
    if startup.is_file():
        run.notes["startup"] = {row["stage"]: row["seconds"] for row in json.loads(startup.read_text())["stages"]}
    return run


def startup_stages(runs: list[Run]) -> str:
    """The median over rounds of each start-up stage an hfplan run wrote, in the order of the first run's."""
    stages = [run.notes["startup"] for run in runs if "startup" in run.notes]
    if not stages:
        return "not written by this hfplan"
    return ", ".join(f"{name} {statistics.median(s[name] for s in stages if name in s):.2f}" for name in stages[0])


def run_trl(python: Path, iterations: int, warmup: int, seed: int, out: Path) -> Run:
    """bench/trl_runner.py under the TRL environment's python; its stamps are wall-clock, like the launch's."""
    result = out / "trl.json"
    command = [str(python), str(RUNNER), "--workload", WORKLOAD, "--iterations", str(iterations),
               "--seed", str(seed), "--out", str(result)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # nothing is fetched: models are built
    log = out / "trl.log"
    launched = time.time()
    with log.open("w") as sink:
        returncode = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    exited = time.time()
    if returncode:
        fail("TRL: bench/trl_runner.py", log, returncode)
    data = json.loads(result.read_text())
    steps = data["steps"]
    if len(steps) != iterations:
        raise SystemExit(f"TRL: expected {iterations} steps, found {len(steps)} (see {log})")
    rewards = {entry["step"]: entry["reward"] for entry in data["logs"] if "reward" in entry}
    own_step_s = {entry["step"]: entry["step_time"] for entry in data["logs"] if "step_time" in entry}
    run = Run(TRL, startup_s=steps[0]["begin"] - launched, process_s=exited - launched,
              after_s=exited - steps[-1]["end"])
    for index in range(warmup, iterations):
        s = steps[index]
        seconds = s["end"] - s["begin"]
        row = {"iteration_s": seconds, "generation_s": s["generate_end"] - s["generate_begin"],
               "model_generate_s": s["model_generate_end"] - s["model_generate_begin"],
               "preparation_s": s["scored"] - s["generate_end"], "training_s": s["end"] - s["scored"],
               "response_tokens_per_s": s["response_tokens"] / seconds,
               "period_s": s["end"] - steps[index - 1]["end"]}
        if index + 1 in rewards:
            row["reward"] = rewards[index + 1]
        if index + 1 in own_step_s:
            row["own_step_s"] = own_step_s[index + 1]  # TRL's logged step_time (its training_step)
        run.iterations.append(row)
    run.notes = {"versions": data["versions"], "threads": data["threads"], "ref_model": data["ref_model"],
                 "old_log_probs": any(s["has_old_log_probs"] for s in steps),
                 "imports_s": data["imported"] - data["started"], "python_start_s": data["started"] - launched,
                 "trainer_s": data["trainer_ready"] - data["imported"],
                 "to_first_step_s": steps[0]["begin"] - data["trainer_ready"]}
    return run


def pooled(runs: list[Run]) -> Run:
    """One system's rounds as one: every measured iteration, and the median over rounds of the start-up, whole
    process and tail seconds."""
    out = Run(runs[0].system, [m for run in runs for m in run.iterations], notes=runs[0].notes)
    out.startup_s = statistics.median(run.startup_s for run in runs)
    out.process_s = statistics.median(run.process_s for run in runs)
    out.after_s = statistics.median(run.after_s for run in runs)
    return out


def row(run: Run) -> str:
    it, gen = run.median("iteration_s"), run.median("generation_s")
    after = statistics.median(m["iteration_s"] - m["generation_s"] for m in run.iterations)
    return (f"  {run.system:<14}{run.median('response_tokens_per_s'):>9.0f}{it:>8.3f}{gen:>8.3f}{after:>9.3f}"
            f"{run.median('preparation_s'):>8.3f}{run.median('training_s'):>8.3f}{run.median('period_s'):>9.3f}"
            f"{run.startup_s:>9.1f}{run.process_s:>9.1f}{run.after_s:>8.1f}{run.median('reward'):>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="runs of each system, alternating (default 3; "
                                                                "1 --quick)")
    parser.add_argument("--iterations", type=int, default=None, help="iterations per run, the same for every "
                                                                    "system (default 20; 6 --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="first iterations of each run not counted "
                                                                "(default 3; 2 under 10 iterations)")
    parser.add_argument("--quick", action="store_true", help="1 round of 6 iterations")
    parser.add_argument("--trl-python", type=Path, default=None,
                        help=f"an interpreter with trl, transformers and hfplan's dependencies (default: "
                             f"{TRL_VENV.relative_to(ROOT)}, made on first use)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    iterations = args.iterations or (6 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (3 if iterations >= 10 else 2)
    if rounds < 1 or warmup < 1 or iterations <= warmup + 1:
        raise SystemExit("--rounds must be at least 1, --warmup at least 1 and --iterations above --warmup + 1")
    import torch
    import transformers

    from hfplan.spec import load_workload

    trl_python = args.trl_python or ensure_trl_python()
    workload = load_workload(WORKLOAD)
    hp = workload.hyperparameters
    started = time.perf_counter()
    print(f"hfplan execute against TRL's GRPOTrainer on {WORKLOAD}; {datetime.datetime.now().isoformat(' ', 'seconds')}"
          f"; os.cpu_count() {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  workload: {workload.algorithm}, actor and reference {workload.models['actor']}, reward "
          f"{workload.models['reward']}; {workload.batch_prompts} prompts x {workload.samples_per_prompt}, prompt_len "
          f"{workload.prompt_len}, response_len {workload.response_len}; mini_batches {workload.mini_batches}, "
          f"epochs {workload.epochs}; actor_lr {hp.actor_lr:g}, clip {hp.clip_ratio:g}, KL loss {hp.kl_loss_coef:g} "
          f"({hp.kl_estimator}), max_grad_norm {hp.max_grad_norm:g}, temperature {hp.temperature:g}, top_p "
          f"{hp.top_p:g}")
    print(f"  {rounds} round(s) of {iterations} iterations per system, the first {warmup} of each run not counted; "
          f"seed {args.seed}")
    folder = Path(tempfile.mkdtemp(prefix="hfplan-vs-trl-"))
    by_system: dict[str, list[Run]] = {}
    try:
        plans = make_plans(folder)
        from hfplan.plan import load_plan

        for system, path in plans.items():
            plan = load_plan(path)
            gen = plan.parallelism["actor"].gen
            print(f"  {system} plan: {' | '.join('+'.join(g.models) + f' x{g.gpus}' for g in plan.placement)}; "
                  f"generation {gen.batching} batching, max_batch {gen.max_batch}; simulated "
                  f"{plan.estimate.iteration_s:.3f} s per iteration")
        if HFPLAN_REUSE not in plans:
            print(f"  {HFPLAN_REUSE}: skipped, this hfplan's Workload has no {REUSE} option")
        for round_index in range(rounds):
            for system, path in plans.items():
                out = folder / f"{round_index}-{system.replace(' ', '-')}"
                out.mkdir()
                by_system.setdefault(system, []).append(run_hfplan(system, path, iterations, warmup, args.seed, out))
            out = folder / f"{round_index}-trl"
            out.mkdir()
            by_system.setdefault(TRL, []).append(run_trl(trl_python, iterations, warmup, args.seed, out))
            print(f"  round {round_index + 1}/{rounds} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    except BaseException:
        print(f"run folders and logs kept in {folder}", file=sys.stderr)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    trl_notes = by_system[TRL][0].notes
    versions = trl_notes["versions"]
    print(f"  versions: hfplan side torch {torch.__version__}, transformers {transformers.__version__}; TRL side "
          f"torch {versions['torch']}, transformers {versions['transformers']}, trl {versions['trl']} "
          f"(python {versions['python']})")
    print(f"\n  {'system':<14}{'resp/s':>9}{'iter s':>8}{'gen s':>8}{'after g':>9}{'prep s':>8}{'train s':>8}"
          f"{'period s':>9}{'start s':>9}{'proc s':>9}{'tail s':>8}{'reward':>8}")
    merged = {system: pooled(runs) for system, runs in by_system.items()}
    for run in merged.values():
        print(row(run))
    trl_rate = merged[TRL].median("response_tokens_per_s")
    for system in (HFPLAN, HFPLAN_REUSE):
        if system in merged:
            ratio = merged[system].median("response_tokens_per_s") / trl_rate
            print(f"  {system} / TRL response tokens/s: {ratio:.2f}x")
    print("  resp/s: response tokens per second of an iteration; iter s: seconds per iteration (hfplan: its "
          "iteration_s; TRL: on_step_begin to on_step_end); gen s: generation (hfplan: generation_s; TRL: "
          "_generate); after g: iter s less gen s; prep s: the scoring before training (hfplan: preparation_s; TRL: "
          "the rest of _generate_and_score_completions); train s: hfplan training_s, TRL the rest of the step; "
          "period s: between consecutive iterations' ends (hfplan: its progress lines); medians over the measured "
          "iterations of all rounds. start s: process launch to the first iteration's start; proc s: the whole "
          "process; tail s: the last iteration's end to exit (hfplan writes its final checkpoint, exports the actor "
          "and stops Ray there; TRL saves nothing); medians over rounds. reward: mean reward of an iteration's samples")
    print("  per-round median iteration s: " + "; ".join(
        f"{system} " + " ".join(f"{run.median('iteration_s'):.3f}" for run in runs)
        for system, runs in by_system.items()))
    print(f"  TRL: its own logged step_time {merged[TRL].median('own_step_s'):.3f} s (training_step, within iter s); "
          f"generate() alone {merged[TRL].median('model_generate_s'):.3f} s of its gen s; start-up "
          f"{trl_notes['python_start_s']:.1f} s to the runner's first line, {trl_notes['imports_s']:.1f} s imports, "
          f"{trl_notes['trainer_s']:.1f} s building hfplan's model and the trainer, {trl_notes['to_first_step_s']:.1f}"
          f" s in train() before the first step; reference model {'yes' if trl_notes['ref_model'] else 'no'}, old "
          f"log-prob forward {'yes' if trl_notes['old_log_probs'] else 'no'}; torch threads {trl_notes['threads']}")
    for system in (HFPLAN, HFPLAN_REUSE):
        if system in by_system:
            print(f"  {system}: calls {by_system[system][0].notes['calls']}")
            print(f"  {system}: start-up / TRL's {merged[system].startup_s / merged[TRL].startup_s:.2f}x; its stages "
                  f"(s, medians over rounds; some overlap): {startup_stages(by_system[system])}")
    print(f"\nwhole benchmark: {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
