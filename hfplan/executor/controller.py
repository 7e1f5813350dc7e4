"""The single controller: runs the plan's registered algorithm over worker-group roles, iteration by
iteration, and records what happened (metrics through the run's loggers, samples of its responses, the measured
timeline in the simulator's format).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hfplan.dataflow.batch import Batch, resolved
from hfplan.dataflow.controller import ControllerState
from hfplan.dataflow.registry import get_algorithm
from hfplan.dataflow.roles import RoleFacts, update_field
from hfplan.errors import HfplanError
from hfplan.executor import compat, evaluation, preflight, resume, run_config
from hfplan.executor.data import PromptBatch, PromptStream
from hfplan.executor.errors import RunFailed
from hfplan.executor.generation_order import generation_rank
from hfplan.executor.interrupts import InterruptLatch
from hfplan.executor.loggers import DEFAULT_LOGGERS, open_loggers
from hfplan.executor.loggers import METRICS_FILE as METRICS_FILE  # its old home, where callers import it from
from hfplan.executor.placement import (
    DeathWatch,
    call_every_worker,
    check_capacity,
    clock_offsets,
    start_sets,
    stop_sets,
)
from hfplan.executor.roles import (
    ActorRole,
    CallTiming,
    Dispatch,
    ExecutionController,
    Recorder,
    RuleRole,
    WorkerGroupRole,
)
from hfplan.executor.samples import Sample, SamplesFile, take_samples
from hfplan.executor.startup import StartupLog
from hfplan.files import write_atomically
from hfplan.layout import ROLLOUT, facts_of, rank_coords
from hfplan.plan import Plan, Span, phase_seconds

TIMELINE_FILE = "timeline.json"
WORKERS_FILE = "workers.json"
RAY_LOG_FILE = "ray.log"  # what Ray prints while it starts or connects
EXPORT_FOLDER = "hf"  # the trained roles as Hugging Face model folders, one per role

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecuteOptions:
    iterations: int = 40
    data: str | None = None
    out: Path = Path("run")
    address: str | None = None
    seed: int = 0
    overrides: tuple[str, ...] = ()
    call_timeout_s: float = 600.0  # one role call, and every collective inside it
    start_timeout_s: float = 300.0  # placement groups and worker start-up
    checkpoint_every: int | None = None  # also a checkpoint every K iterations (one is always written at the end)
    keep: int = 2  # complete checkpoints kept
    resume: str | None = None  # continue from a checkpoint: "latest" (in `out`), an iteration of `out`, a folder
    long_prompts: str = "truncate"  # a prompt longer than prompt_len: "truncate" (with a warning) | "refuse"
    connect_timeout_s: float = 30.0  # how long an `address` cluster may take to answer
    loggers: tuple[str, ...] = DEFAULT_LOGGERS  # where the metrics go (hfplan.executor.loggers)
    samples: int = 0  # the first K sampled sequences of each iteration as text, in samples.jsonl
    log_every: int = 10  # the caller's progress lines (kept with the run's configuration)
    eval_data: str | None = None  # held-out prompts, evaluated greedily after some iterations (evaluation.py)
    eval_every: int | None = None  # evaluate every N iterations; always after the last one when eval_data is given

    @property
    def on_this_machine(self) -> bool:
        """Whether every worker runs on this machine: in a Ray hfplan starts, or in a cluster on loopback."""
        return self.address is None or compat.on_loopback(self.address)

    @classmethod
    def from_config(cls, config: run_config.RunConfig, **others) -> ExecuteOptions:
        """A run's options from its configuration, and those that are not part of it (address, resume, ...)."""
        return cls(iterations=config.iterations, data=config.data, out=Path(config.out), seed=config.seed,
                   overrides=config.overrides, checkpoint_every=config.checkpoint_every, keep=config.keep,
                   long_prompts=config.long_prompts, loggers=config.loggers, samples=config.samples,
                   log_every=config.log_every, eval_data=config.eval_data, eval_every=config.eval_every, **others)

    def config(self) -> run_config.RunConfig:
        """The run's configuration (what OUT/run_config.json holds)."""
        return run_config.RunConfig(iterations=self.iterations, data=None if self.data is None else str(self.data),
                                    seed=self.seed, out=str(self.out),
                                    checkpoint_every=self.checkpoint_every, keep=self.keep, log_every=self.log_every,
                                    loggers=self.loggers, samples=self.samples, long_prompts=self.long_prompts,
                                    eval_data=None if self.eval_data is None else str(self.eval_data),
                                    eval_every=self.eval_every, set=run_config.parse_assignments(self.overrides))


@dataclass
class IterationReport:
    iteration: int
    metrics: dict[str, float]
    spans: list[Span]  # the training iteration's only: what `hfplan validate` compares
    samples: list[Sample] = field(default_factory=list)  # the first `samples` sequences as text (eval's after)
    eval_spans: list[Span] = field(default_factory=list)  # the evaluation after it, if any (evaluation.py)
    sampled: dict = field(default_factory=dict)  # its sampled sequences' fields (sampled_outputs), for on_iteration
    rank_start_spreads: list[float] = field(default_factory=list)  # Recorder.rank_start_spreads
    calls: list[CallTiming] = field(default_factory=list)  # the training iteration's calls (Recorder.call_timings)


@dataclass
class RunSummary:
    out: Path
    iterations: list[dict] = field(default_factory=list)
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)  # "set S rank R" -> bytes
    nodes: dict[str, str] = field(default_factory=dict)  # "set S rank R" -> the Ray node it ran on
    resumed_from: Path | None = None  # the checkpoint the run continued from
    checkpoint: Path | None = None  # the last checkpoint written
    exported: dict[str, Path] = field(default_factory=dict)  # trained role -> its Hugging Face folder

    def mean_of(self, key: str, first: bool, count: int = 10) -> float:
        values = [m[key] for m in self.iterations if key in m]
        window = values[:count] if first else values[-count:]
        return float(np.mean(window)) if window else float("nan")


@dataclass
class Progress:
    """What the single controller carries from one iteration to the next, and a checkpoint keeps of it."""

    iteration: int  # iterations done
    stream: PromptStream
    state: ControllerState


def start_progress(plan: Plan, checked: preflight.Checked, options: ExecuteOptions,
                   snapshot: resume.ControllerSnapshot | None = None) -> Progress:
    """Iteration 0's controller state, or the state a checkpoint's controller left."""
    state = ControllerState(cfg=checked.hyper, samples_per_prompt=plan.workload.samples_per_prompt,
                            reuse_policy_log_probs=plan.workload.reuse_policy_log_probs,
                            staleness=plan.workload.staleness,
                            lagrange=snapshot.lagrange if snapshot else None)
    stream = PromptStream(checked.prompts, plan.workload.batch_prompts, options.seed,
                          position=snapshot.data_position if snapshot else 0, columns=checked.columns)
    return Progress(snapshot.iteration if snapshot else 0, stream, state)


def execute(plan: Plan, options: ExecuteOptions,
            on_iteration: Callable[[IterationReport], None] | None = None,
            on_start: Callable[[int, Path | None], None] | None = None,
            startup: StartupLog | None = None) -> RunSummary:
    """Run the plan up to `options.iterations` iterations (from the latest checkpoint with `resume`),
    checkpointing every `checkpoint_every` and at the end, then export the trained roles as Hugging Face
    folders. Every check of the input happens before any worker starts (HfplanError); a failure after that
    raises RunFailed naming the role, set and rank. `on_start(iterations done, resumed checkpoint)` is called
    once the workers are up. A run that stops before its first iteration is recorded leaves no run folder it
    made. `startup` times the stages up to the first iteration from its origin (default: this call)."""
    startup = startup or StartupLog(origin=time.time())
    startup.add("command", startup.origin, time.time())
    with startup.stage("checks"):
        inputs = preflight.check_inputs(plan, options)
        out = options.out
        run = resume.run_identity(plan, options.seed, inputs.prompts, inputs.columns)
        start = resume.starting_point(out, options.resume, run, options.iterations)
        if start is not None:
            resume.check_tensor_headers(start)
    made_out = not out.exists()
    _prepare_out(out)
    resume.clear_partial(out)
    run_config.write_config(options.config(), out)
    ray_session = _RaySession(options.address, plan, inputs.device)
    sets: list = []
    watch = DeathWatch(sets)
    summary = RunSummary(out, resumed_from=start.folder if start else None)
    recorded = len(start.controller.metrics) if start else 0
    exported: dict[str, Path] | None = None
    try:
        with InterruptLatch() as interrupt:
            checked = _codecs_while_ray_starts(plan, inputs, options, ray_session, startup)
            interrupt.check()
            check_capacity(plan, checked.device)
            if checked.truncated:
                logger.warning("%s", checked.truncated)
            marks = start_sets(plan, checked.hyper, options.seed, checked.device, checked.backend,
                               options.call_timeout_s, options.start_timeout_s, sets, watch, startup)
            interrupt.check()
            with watch:
                _run_on_sets(plan, checked, options, sets, run, start, summary, on_iteration, on_start, interrupt,
                             startup, marks)
                if summary.checkpoint is not None:
                    exported = _export_beside_the_controller(sets, summary, out / EXPORT_FOLDER,
                                                             options.call_timeout_s)
    except BaseException:
        if made_out and len(summary.iterations) <= recorded and summary.checkpoint is None:
            shutil.rmtree(out, ignore_errors=True)  # nothing of this run is worth keeping
        raise
    finally:
        if sets:
            stop_sets(sets)
        ray_session.stop()
    if exported is None:  # no worker shared this node: export here (imports torch and transformers)
        from hfplan.executor.export_model import export_checkpoint

        exported = export_checkpoint(summary.checkpoint, out / EXPORT_FOLDER)
    summary.exported = exported
    return summary


def _export_beside_the_controller(sets, summary: RunSummary, dest: Path,
                                  timeout_s: float) -> dict[str, Path] | None:
    """The run's last checkpoint exported as Hugging Face folders by a worker on the controller's node, which
    has torch and transformers imported already (the controller would spend seconds importing them after the
    run); None when no worker runs on this node."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for worker_set in sets:
        for rank, worker in enumerate(worker_set.workers):
            if summary.nodes.get(f"set {worker_set.index} rank {rank}") != here:
                continue
            try:
                made = ray.get(worker.export_model.remote(str(summary.checkpoint), str(dest)), timeout=timeout_s)
            except Exception as failed:  # the export failed, the worker died, or it did not finish in time
                if isinstance(getattr(failed, "cause", None), HfplanError):  # a RayTaskError's original error
                    raise HfplanError(str(failed.cause)) from None
                raise RunFailed(worker_set.describe_failure("+".join(worker_set.roles), "export", failed)) \
                    from failed
            return {role: Path(folder) for role, folder in made.items()}
    return None


def _codecs_while_ray_starts(plan: Plan, inputs: preflight.Inputs, options: ExecuteOptions,
                             ray_session: _RaySession, startup: StartupLog) -> preflight.Checked:
    """The tokenizer is built and the prompts checked against it while Ray starts (in processes of its own): a
    built-in one in milliseconds, a checkpoint folder's own through transformers' import, seconds of this
    process; no worker starts before both are done."""
    def codecs() -> preflight.Checked:
        with startup.stage("tokenizer"):
            return preflight.with_codecs(plan, inputs, options)

    with ThreadPoolExecutor(1, thread_name_prefix="hfplan-tokenizer") as pool:
        checked = pool.submit(codecs)
        with startup.stage("ray start"):
            ray_session.start(options.out / RAY_LOG_FILE)
        return checked.result()


def _run_on_sets(plan: Plan, checked: preflight.Checked, options: ExecuteOptions, sets, run: resume.RunIdentity,
                 start: resume.Checkpoint | None, summary: RunSummary,
                 on_iteration: Callable[[IterationReport], None] | None,
                 on_start: Callable[[int, Path | None], None] | None, interrupt: InterruptLatch,
                 startup: StartupLog, marks: dict[tuple[int, int], dict[str, float]]) -> None:
    """The run once its workers are up: load the checkpoint, iterate, checkpoint, write the run folder."""
    out = options.out
    with startup.stage("worker facts"):
        summary.nodes = ask_workers(sets, "node_id", options.call_timeout_s)
        pids = ask_workers(sets, "pid", options.call_timeout_s)
        write_atomically(out / WORKERS_FILE, json.dumps({"pids": pids, "nodes": summary.nodes}, indent=2) + "\n")
    if start is not None:
        with startup.stage("checkpoint load"):
            _load_checkpoint(sets, start, plan, options)
    with startup.stage("clock offsets"):
        offsets = clock_offsets(sets, options.start_timeout_s)
    recorder = Recorder(offsets)
    for (index, rank), worker_marks in marks.items():
        startup.add_worker(f"set {index} rank {rank}", worker_marks, offsets[(index, rank)])
    roles = build_roles(plan, checked, recorder, _worker_group_roles(plan, sets, recorder, options.call_timeout_s))
    progress = start_progress(plan, checked, options, start.controller if start else None)
    summary.iterations = list(start.controller.metrics) if start else []
    timeline: list[dict] = list(start.controller.timeline) if start else []
    samples = SamplesFile(out, progress.iteration) if options.samples else None
    with open_loggers(options.loggers, out, summary.iterations, progress.iteration,
                      options.config().model_dump(mode="json")) as loggers:
        interrupt.check()
        startup.write(out, time.time())
        if on_start is not None:
            on_start(progress.iteration, start.folder if start else None)
        for report in run_iterations(plan, roles, checked, options, recorder, progress):
            interrupt.check()
            check_finite(report)
            summary.iterations.append(report.metrics)
            loggers.log(report.metrics)
            if samples is not None:
                samples.write(report.samples)
            timeline.append(timeline_entry(report))
            if checkpoint_due(progress.iteration, options):
                summary.checkpoint = _write_checkpoint(sets, plan, run, progress, summary.iterations, timeline,
                                                       options)
            if on_iteration is not None:
                on_iteration(report)
    summary.peak_memory_bytes = ask_workers(sets, "peak_memory_bytes", options.call_timeout_s)
    write_atomically(out / WORKERS_FILE, json.dumps({"pids": pids, "nodes": summary.nodes,
                                                     "peak_memory_bytes": summary.peak_memory_bytes}, indent=2) + "\n")
    write_atomically(out / TIMELINE_FILE, json.dumps({"plan": plan.model_dump(mode="json"),
                                                      "iterations": timeline}) + "\n")


def timeline_entry(report: IterationReport) -> dict:
    """An iteration in timeline.json: its spans, and an evaluation's after it apart (`eval_spans`)."""
    entry: dict = {"iteration": report.iteration, "spans": [s.model_dump() for s in report.spans]}
    if report.eval_spans:
        entry["eval_spans"] = [s.model_dump() for s in report.eval_spans]
    return entry


def check_finite(report: IterationReport) -> None:
    """A loss, gradient norm, reward or any other metric that is NaN or infinite stops the run before the
    iteration is recorded or checkpointed: the checkpoints on disk are all of finite runs."""
    bad = {key: value for key, value in report.metrics.items() if not math.isfinite(value)}
    if bad:
        key, value = next(iter(bad.items()))
        role, _, metric = key.rpartition("/")
        what = f"role {role}'s {metric}" if role else metric
        others = f" (and {', '.join(list(bad)[1:])})" if len(bad) > 1 else ""
        raise RunFailed(f"iteration {report.iteration}: {what} is {value}{others}; the run stops before recording "
                        "it (a learning rate too high for the model, or a reward that returned NaN?)")


def _write_checkpoint(sets, plan: Plan, run: resume.RunIdentity, progress: Progress, metrics: list[dict],
                      timeline: list[dict], options: ExecuteOptions) -> Path:
    """Every worker writes its part into the checkpoint's temporary folder; then the controller's state and
    the manifest go in, and the folder takes its final name."""
    partial = resume.start_partial(options.out, progress.iteration)
    call_every_worker(sets, "save_checkpoint", options.call_timeout_s, str(partial))
    snapshot = resume.controller_snapshot(progress.iteration, progress.stream.position, progress.state.lagrange,
                                          metrics, timeline)
    return resume.commit(partial, resume.manifest_of(plan, run, progress.iteration), snapshot, options.keep)


def _load_checkpoint(sets, start: resume.Checkpoint, plan: Plan, options: ExecuteOptions) -> None:
    """Every worker loads its roles' states; its random streams are its own if the checkpoint ran on the same
    sets and layouts, else fresh ones drawn from (seed, iteration, set, rank)."""
    own = start.same_layout(plan)
    if not own:
        logger.warning("the plan's placement or layouts differ from checkpoint %s's: the weights and optimizer "
                       "states are resharded, and the sampling streams start afresh", start.folder)
    iteration = start.manifest.iteration

    def reseed(worker_set, rank: int) -> tuple[int]:
        # The ranks of one generation replica (its tp group) must sample the same tokens: one stream each.
        generator = plan.generation_role
        stream = rank
        if generator in plan.placement[worker_set.index].models:
            par = plan.parallelism[generator]
            stream = rank_coords(par.gen, generation_rank(par.train, par.gen, rank))[1]
        entropy = [options.seed, iteration, worker_set.index, stream]
        return (int(np.random.SeedSequence(entropy).generate_state(1)[0]),)

    call_every_worker(sets, "load_checkpoint", options.call_timeout_s, str(start.folder), own, per_worker=reseed)


def ask_workers(sets, method: str, timeout_s: float) -> dict:
    """One answer per worker, keyed "set S rank R"."""
    import ray

    refs = {f"set {s.index} rank {rank}": getattr(w, method).remote()
            for s in sets for rank, w in enumerate(s.workers)}
    return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s), strict=True))


def _prepare_out(out: Path) -> None:
    """The run folder, made if missing (its parent was checked by preflight.check_inputs)."""
    try:
        out.mkdir(exist_ok=True)
    except OSError as bad:
        raise HfplanError(f"--out {out}: cannot create the folder ({bad.strerror})") from None
    if not os.access(out, os.W_OK):
        raise HfplanError(f"--out {out}: folder is not writable")


def build_roles(plan: Plan, checked: preflight.Checked, recorder: Recorder,
                model_role: Callable[[str, RoleFacts], object]) -> dict:
    """The roles the algorithm's program gets: rewards computed on the controller (`rule:<name>`,
    `module:function`; imported by the checks), model roles from `model_role(name, facts)` (the backend's:
    worker groups, or single-process roles)."""
    roles: dict = {}
    for role in plan.workload.roles:
        facts = facts_of(plan.workload, role)
        if role in checked.rewards:
            roles[role] = RuleRole(role, facts, checked.rewards[role], checked.decode_responses,
                                   checked.decode_prompts, recorder)
        else:
            roles[role] = model_role(role, facts)
    return roles


def run_iterations(plan: Plan, roles: dict, checked: preflight.Checked, options: ExecuteOptions,
                   recorder: Recorder, progress: Progress | None = None) -> Iterator[IterationReport]:
    """The single controller's loop: each iteration's prompts through the registered program, then its
    metrics and spans, from `progress` (default: iteration 0) up to `options.iterations`; `progress` counts
    the iteration as done before its report is yielded. The iteration's time ends when the updates' results
    are in; an evaluation on held-out prompts, when one is due, runs after that and joins the report
    (hfplan.executor.evaluation)."""
    if plan.workload.staleness:  # asynchronous: generation runs ahead on the rollout set
        from hfplan.executor.pipelined import run_pipelined  # it builds on this module

        yield from run_pipelined(plan, roles, checked, options, recorder, progress)
        return
    progress = progress or start_progress(plan, checked, options)
    controller = ExecutionController(progress.state, recorder)
    algorithm = get_algorithm(plan.workload.algorithm)
    ahead: SentIteration | None = None
    while progress.iteration < options.iterations:
        iteration = progress.iteration
        if ahead is None:
            handed = progress.stream.next_batch()
            prompts = checked.encode(handed.prompts)
            recorder.start_iteration(handed.columns)
        else:  # its generation was sent during the last iteration: its time starts where that one's ended
            handed, prompts = ahead.handed, ahead.prompts
            recorder.hold_from = ahead.actor.ahead.call_id  # its outputs stay on the workers for its calls
            recorder.start_iteration(handed.columns, origin=ahead.after)
            recorder.hold_from = None
        updates = algorithm.program(roles, Batch(prompts=prompts), controller)
        opening = generation_to_send(roles, recorder, len(prompts))
        sent = None
        if opening is not None and sends_ahead_after(iteration + 1, options, checked.eval_set is not None):
            actor, n, greedy = opening
            next_handed = progress.stream.next_batch()
            next_prompts = checked.encode(next_handed.prompts)
            actor.send_ahead(next_prompts, n, greedy)
            sent = SentIteration(next_handed, next_prompts, actor)
        update_metrics = {name: resolved(value) for name, value in updates.items()}
        ended = time.time()
        elapsed = ended - recorder.origin
        ahead = None if sent is None else dataclasses.replace(sent, after=ended)
        recorder.finish_iteration()
        yield finish_iteration_report(plan, options, checked, roles, recorder, progress, iteration, elapsed,
                                      update_metrics)


@dataclass(frozen=True)
class SentIteration:
    """An iteration whose first generation was sent during the last one (ActorRole.send_ahead)."""

    handed: PromptBatch  # its prompts as the stream handed them
    prompts: np.ndarray  # encoded
    actor: ActorRole
    after: float = 0.0  # when the last iteration ended: this one's time starts there


def generation_to_send(roles: dict, recorder: Recorder, prompts: int) -> tuple[ActorRole, int, bool] | None:
    """The generation to send ahead for the next iteration: (actor, n, greedy) of the call this iteration opened
    with (read off its recording, its only input the prompts), when that is a hybrid actor's generation on its own
    set; None otherwise. The actor checks that the next iteration asks for the same (ActorRole.generate)."""
    if not recorder.calls:  # nothing dispatched to workers (the single-process backend)
        return None
    opening = recorder.calls[0]
    role, op, greedy = opening.label
    actor = roles.get(role)
    if op != "generate" or not isinstance(actor, ActorRole) or actor.rollout is not None:
        return None
    return actor, sum(opening.rows) // prompts, greedy


def checkpoint_due(done: int, options: ExecuteOptions) -> bool:
    """Whether a checkpoint is written once `done` iterations are done: every --checkpoint-every, and at the end."""
    every = options.checkpoint_every
    return done == options.iterations or bool(every and done % every == 0)


def sends_ahead_after(done: int, options: ExecuteOptions, evaluates: bool) -> bool:
    """Whether the next iteration's generation may be sent before `done` iterations are reported: not past the
    last, and neither a checkpoint (the workers' random streams and the prompt stream it saves would be those
    after the next generation) nor an evaluation (`evaluates`: the run has held-out prompts; it generates in
    between) due at that point."""
    evaluating = evaluates and evaluation.due(done, options.eval_every, options.iterations)
    return done < options.iterations and not checkpoint_due(done, options) and not evaluating


def finish_iteration_report(plan: Plan, options: ExecuteOptions, checked, roles, recorder: Recorder,
                            progress: Progress, iteration: int, elapsed: float, update_metrics: dict
                            ) -> IterationReport:
    """An iteration's report once its calls are recorded (metrics, samples, spans), the progress moved on past it,
    and the evaluation run when one is due after it (the synchronous and the asynchronous loop alike)."""
    metrics = iteration_metrics(plan, iteration, elapsed, recorder, update_metrics, progress.state)
    samples = take_samples(iteration, options.samples, sampled_outputs(recorder), recorder.texts.get(False),
                           checked.decode_prompts, checked.decode_responses) if options.samples else []
    report = IterationReport(iteration, metrics, list(recorder.spans), samples, sampled=sampled_outputs(recorder),
                             rank_start_spreads=list(recorder.rank_start_spreads), calls=recorder.call_timings())
    progress.iteration += 1
    if checked.eval_set is not None and evaluation.due(progress.iteration, options.eval_every, options.iterations):
        evaluated = evaluation.run_eval(plan, roles, checked, recorder, iteration, options.samples)
        report.metrics |= evaluated.metrics
        report.samples += evaluated.samples
        report.eval_spans = evaluated.spans
    return report


def _worker_group_roles(plan: Plan, sets, recorder: Recorder, timeout_s: float
                        ) -> Callable[[str, RoleFacts], WorkerGroupRole]:
    """Model roles over the sets' workers; the generating role also drives a separate rollout set."""
    by_role = {role: sets[plan.set_of(role)] for role in plan.placed_roles}
    dispatch = Dispatch()  # one for every role: a wait on any call sends all the calls held
    rollout = None
    if ROLLOUT in by_role:
        rollout = WorkerGroupRole(ROLLOUT, facts_of(plan.workload, ROLLOUT), by_role[ROLLOUT],
                                  _layouts(plan, ROLLOUT), recorder, timeout_s, dispatch)

    def model_role(role: str, facts: RoleFacts) -> WorkerGroupRole:
        if facts.generates:
            return ActorRole(role, facts, by_role[role], _layouts(plan, role), recorder, timeout_s, dispatch,
                             rollout=rollout)
        return WorkerGroupRole(role, facts, by_role[role], _layouts(plan, role), recorder, timeout_s, dispatch)

    return model_role


def _layouts(plan: Plan, role: str) -> dict:
    par = plan.parallelism[role]
    return {kind: layout for kind in ("train", "infer", "gen") if (layout := getattr(par, kind)) is not None}


def sampled_outputs(recorder: Recorder) -> dict:
    """The fields of this iteration's sampled (not greedy) responses, by name: the generation's outputs, the
    scores, log-probs and values of those responses."""
    seen: dict = {}
    for (_, _, greedy), outputs in recorder.observed.items():
        if not greedy:
            seen |= outputs
    return seen


def iteration_metrics(plan: Plan, iteration: int, elapsed: float, recorder: Recorder, updates: dict,
                      state: ControllerState) -> dict:
    """What one iteration did: speed, the sampled responses' scores and lengths, the KL to the
    reference, each trained role's update metrics (`<role>/<name>`), and seconds per stage."""
    seen = sampled_outputs(recorder)
    mask = seen["response_mask"]
    metrics: dict[str, float] = {"iteration": iteration, "iteration_s": elapsed,
                                 "tokens_per_s": plan.workload.tokens_per_iteration / elapsed,
                                 "response_tokens_per_s": float(mask.sum()) / elapsed,
                                 "response_len": float(mask.sum(axis=1).mean())}
    for field_name, key in (("rewards", "reward"), ("costs", "cost")):
        if field_name in seen:
            metrics[key] = float(np.mean(seen[field_name]))
    if "old_log_probs" in seen and "ref_log_probs" in seen:
        diff = (seen["old_log_probs"] - seen["ref_log_probs"]) * mask
        metrics["kl"] = float(diff.sum() / max(mask.sum(), 1.0))
    for role in plan.workload.roles:
        for key, value in updates.get(update_field(role), {}).items():
            metrics[f"{role}/{key}"] = float(value)
    if state.lagrange is not None:
        metrics["lagrange"] = float(state.lagrange)
    for phase, seconds in phase_seconds(recorder.spans).items():
        metrics[f"{phase}_s"] = seconds
    return metrics


@contextlib.contextmanager
def _stderr_into(log: Path) -> Iterator[None]:
    """File descriptor 2 (what native code writes to) appended to `log` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with log.open("a") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class _RaySession:
    """A local Ray that hfplan starts (loopback only, no dashboard), or an existing cluster (--address)."""

    def __init__(self, address: str | None, plan: Plan, device: str) -> None:
        self.address, self.plan, self.device = address, plan, device
        self.started = False
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._restore_raylet_reports: Callable[[], None] | None = None

    def start(self, log: Path) -> None:
        """ray.init, with what Ray's C++ core prints meanwhile (connection retries, warnings) in `log`, not on
        the terminal; so are the raylets' reports while the run lasts (a dead worker is named by hfplan)."""
        self._restore_raylet_reports = compat.raylet_reports_into(log)
        with _stderr_into(log):
            self._init()

    def _init(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller (a test, a notebook) owns the session
        self.started = True  # from here on, stop() shuts down whatever ray.init got to start
        if self.address is not None:
            if compat.on_loopback(self.address):
                compat.reach_clusters_through_loopback()
            try:
                ray.init(address=self.address, include_dashboard=False, logging_level=logging.WARNING,
                         log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as bad:
                raise HfplanError(f"--address {self.address}: cannot connect to Ray ({bad})") from None
        else:
            needed = sum(group.gpus for group in self.plan.placement)
            self._tmp = tempfile.TemporaryDirectory(prefix="hfplan-ray-")
            # One CPU slot per device: Ray starts one worker process per slot with the session, and the sets'
            # workers are all the run asks of it.
            ray.init(num_cpus=needed, include_dashboard=False,
                     logging_level=logging.WARNING, log_to_driver=False, **compat.local_ray_options(self._tmp.name))

    def stop(self) -> None:
        import ray

        if self.started:
            ray.shutdown()  # also after an interrupted ray.init: it stops the processes that init started
            self.started = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._restore_raylet_reports is not None:  # after shutdown, which ends the thread that prints them
            self._restore_raylet_reports()
            self._restore_raylet_reports = None
