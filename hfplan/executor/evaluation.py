"""Evaluation on held-out prompts (`hfplan execute --eval-data PATH --eval-every N`).

After every N-th iteration (and after the last), the dataflow's evaluation program (hfplan.dataflow.evaluation)
runs over the run's roles: the actor answers the held-out prompts greedily, through the same generate path as
ReMax's baseline (the hybrid engine's switch in and out included), and the reward (and Safe-RLHF's cost) scores the
answers: a controller rule with the file's other columns, or a reward model's forward pass. Nothing is updated and
no random stream moves (greedy decoding draws nothing), so the training iterations are those of the same run
without evaluation.

The prompts go in chunks of the workload's sequences per iteration (what a training generation and score run), the
last one filled up with repeats of its own prompts whose answers are dropped, so every call has a training call's
shape. Its results are fields of the iteration's metrics row: `eval/reward`, `eval/cost`, `eval/response_len`,
and `eval_s`, its wall time, which no training metric (iteration_s, tokens_per_s, the phases) counts. Its spans,
on their own clock from the evaluation's start, are kept apart from the iteration's (timeline.json's
`eval_spans`), which is all `hfplan validate` compares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from hfplan.dataflow.batch import Batch, resolved
from hfplan.dataflow.evaluation import evaluate
from hfplan.dataflow.ops import GENERATED
from hfplan.dataflow.registry import get_algorithm
from hfplan.executor import preflight
from hfplan.executor.data import PromptSet
from hfplan.executor.roles import ActorRole, Recorder
from hfplan.executor.samples import SCORES, Sample, take_samples
from hfplan.plan import Plan, Span

PREFIX = "eval/"  # the evaluation's metrics: eval/reward, eval/cost, eval/response_len
SECONDS = "eval_s"  # its wall time, beside the iteration's own


def due(done: int, every: int | None, last: int) -> bool:
    """Whether an evaluation follows the iteration that makes `done` iterations done, of `last`."""
    return done == last or (every is not None and done % every == 0)


@dataclass(frozen=True)
class EvalReport:
    metrics: dict[str, float]  # eval/... and eval_s, merged into the iteration's row
    spans: list[Span]  # from the evaluation's start
    samples: list[Sample]  # its first K answers, marked eval


def run_eval(plan: Plan, roles: dict, checked: preflight.Checked, recorder: Recorder, iteration: int,
             samples: int) -> EvalReport:
    """Evaluate the actor as it is after iteration `iteration` on checked.eval_set; `samples` answers kept."""
    algorithm = get_algorithm(plan.workload.algorithm)
    held_out = checked.eval_set
    if held_out is None:
        raise ValueError("an evaluation needs the held-out prompts of --eval-data")
    size = plan.workload.sequences
    actor = roles[algorithm.generator]
    recorder.start_iteration()
    start = recorder.origin
    pending: list[tuple[Batch, int]] = []
    kept = actor.outside_training() if isinstance(actor, ActorRole) else contextlib.nullcontext()
    with kept:
        for first in range(0, len(held_out.prompts), size):
            chunk, rows = _filled(held_out, first, size)
            recorder.start_batch(chunk.columns)
            pending.append((evaluate(roles, Batch(prompts=checked.encode(chunk.prompts)), algorithm), rows))
        fields = _joined(pending)
    recorder.finish_iteration()
    metrics = eval_metrics(fields, time.time() - start)
    answers = take_samples(iteration, samples, fields, None, checked.decode_prompts, checked.decode_responses)
    return EvalReport(metrics, list(recorder.spans), [dataclasses.replace(s, eval=True) for s in answers])


def eval_metrics(fields: dict[str, np.ndarray], seconds: float) -> dict[str, float]:
    """eval/response_len, each score's mean under the training metrics' name (rewards -> eval/reward, costs ->
    eval/cost; another scoring role's field under its own), and eval_s."""
    known = dict(SCORES)
    metrics = {f"{PREFIX}response_len": float(fields["response_mask"].sum(axis=1).mean())}
    for name in fields:
        if name not in GENERATED:
            metrics[f"{PREFIX}{known.get(name, name)}"] = float(np.mean(fields[name]))
    metrics[SECONDS] = seconds
    return metrics


def _filled(held_out: PromptSet, first: int, size: int) -> tuple[PromptSet, int]:
    """Prompts [first, first + size) with their columns, filled up to `size` by repeating them; and how many
    are real."""
    end = min(first + size, len(held_out.prompts))
    rows = [first + i % (end - first) for i in range(size)]
    return (PromptSet([held_out.prompts[r] for r in rows], {name: [values[r] for r in rows]
                                                             for name, values in held_out.columns.items()}),
            end - first)


def _joined(pending: list[tuple[Batch, int]]) -> dict[str, np.ndarray]:
    """Every chunk's fields (waited for), their real rows only, concatenated in prompt order."""
    chunks = [{name: np.asarray(resolved(value))[:rows] for name, value in batch.items()} for batch, rows in pending]
    return {name: np.concatenate([chunk[name] for chunk in chunks]) for name in chunks[0]}

