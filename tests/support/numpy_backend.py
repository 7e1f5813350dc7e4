"""A second, non-tracing backend of the dataflow contract: numpy in one process.

Fake model roles (random log-probs, values and scores of the right shapes; rule rewards run for real
on decoded text) and the real controller steps. With a thread pool, every call returns futures
(concurrent.futures.Future, which offers the batch's Future protocol) as soon as it is dispatched,
like the executor's worker groups; without one it runs each call at once. Every call checks the
fields and shapes it receives and is logged, so tests can compare it call by call with the tracer.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.controller import STEPS, ControllerState
from hfplan.dataflow.ops import GENERATED
from hfplan.dataflow.registry import get_algorithm
from hfplan.dataflow.rewards import get_rule
from hfplan.dataflow.roles import RoleFacts, call_writes
from hfplan.spec import RULE_PREFIX, Workload

VOCAB = 26  # token ids decode to the letters a..z


@dataclass(frozen=True)
class Call:
    label: str
    reads: tuple[str, ...]
    sequences: int


@dataclass
class Backend:
    workload: Workload
    pool: Executor | None = None
    seed: int = 0
    calls: list[Call] = field(default_factory=list)
    hooks: dict[str, Callable[[], None]] = field(default_factory=dict)  # label -> run inside the call

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def dispatch(self, label: str, batch: Batch, run: Callable[[Batch], Batch], writes: tuple[str, ...]) -> Batch:
        """Log the call now (program order), run it on the resolved batch, return its fields (futures
        with a pool). A call's logged sequences are those it works on (a generation's: its output)."""
        self.calls.append(Call(label, tuple(batch), 0))
        index = len(self.calls) - 1

        def work() -> Batch:
            concrete = batch.resolve(timeout=30)
            if label in self.hooks:
                self.hooks[label]()
            out = run(concrete)
            assert tuple(out) == writes, (label, tuple(out), writes)
            sequences = len(out) if ".generate" in label else len(concrete)
            self.calls[index] = Call(label, tuple(batch), sequences)
            return out

        if self.pool is None:
            return work()
        future = self.pool.submit(work)
        return Batch({name: _FieldFuture(future, name) for name in writes})

    def run(self) -> Batch:
        """One iteration of the workload's algorithm; returns its metrics (resolved)."""
        w = self.workload
        algorithm = get_algorithm(w.algorithm)
        roles = {name: NumpyRole(name, facts, self) for name, facts in algorithm.roles.items()}
        prompts = Batch(prompts=self.rng.integers(0, VOCAB, size=(w.batch_prompts, w.prompt_len)))
        controller = NumpyController(self, ControllerState(cfg=w.hyperparameters,
                                                           samples_per_prompt=w.samples_per_prompt,
                                                           reuse_policy_log_probs=w.reuse_policy_log_probs,
                                                           staleness=w.staleness))
        return Batch(algorithm.program(roles, prompts, controller)).resolve(timeout=30)


class _FieldFuture:
    """One field of a call's future batch (the call's future yields all of its fields at once)."""

    def __init__(self, future, name: str) -> None:
        self._future, self._name = future, name

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None):
        return self._future.result(timeout)[self._name]


def decode(tokens: np.ndarray, mask: np.ndarray | None = None) -> str:
    ids = tokens if mask is None else tokens[mask > 0]
    return "".join(chr(ord("a") + int(t) % VOCAB) for t in ids)


class NumpyRole:
    def __init__(self, name: str, facts: RoleFacts, backend: Backend) -> None:
        self.name, self.facts, self.backend = name, facts, backend
        self.w = backend.workload
        self.rule = self.w.models[name][len(RULE_PREFIX):] if self.w.models[name].startswith(RULE_PREFIX) else None

    # -- shape checks -----------------------------------------------------------------------------
    def _check_sequences(self, batch: Batch, op: str) -> int:
        assert set(GENERATED) <= set(batch), (self.name, op, sorted(batch))
        s, r, p = len(batch), self.w.response_len, self.w.prompt_len
        assert batch["prompts"].shape == (s, p) and batch["prompts"].dtype.kind == "i", (self.name, op)
        assert batch["responses"].shape == (s, r) and batch["responses"].dtype.kind == "i", (self.name, op)
        mask = batch["response_mask"]
        assert mask.shape == (s, r) and set(np.unique(mask)) <= {0.0, 1.0}, (self.name, op)
        for name, value in batch.items():
            if name not in GENERATED:
                assert value.shape in ((s, r), (s,)) and np.all(np.isfinite(value)), (self.name, op, name)
        return s

    # -- the Role protocol --------------------------------------------------------------------------
    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        writes = call_writes(self.name, self.facts, "generate")
        rng = np.random.default_rng(self.backend.rng.integers(1 << 31))

        def run(b: Batch) -> Batch:
            assert set(b) == {"prompts"} and b["prompts"].shape[1] == self.w.prompt_len, sorted(b)
            prompts = np.repeat(b["prompts"], n, axis=0)
            s, r = len(prompts), self.w.response_len
            if greedy:
                responses = np.tile(np.arange(r) % VOCAB, (s, 1))
                lengths = np.full(s, r)
            else:
                responses = rng.integers(0, VOCAB, size=(s, r))
                lengths = rng.integers(1, r + 1, size=s)
            mask = (np.arange(r)[None, :] < lengths[:, None]).astype(float)
            behaviour = -rng.exponential(size=mask.shape) * mask
            return Batch(prompts=prompts, responses=responses, response_mask=mask, behaviour_log_probs=behaviour)

        return self.backend.dispatch(f"{self.name}.generate" + ("(greedy)" if greedy else ""),
                                     batch.select("prompts"), run, writes)

    def _forward(self, op: str, batch: Batch) -> Batch:
        writes = call_writes(self.name, self.facts, op)
        rng = np.random.default_rng(self.backend.rng.integers(1 << 31))

        def run(b: Batch) -> Batch:
            s = self._check_sequences(b, op)
            mask = b["response_mask"]
            if op == "score" and self.rule is not None:
                rule = get_rule(self.rule)
                value = np.array([rule(decode(p), decode(t, m)) for p, t, m in zip(b["prompts"], b["responses"], mask,
                                                                                   strict=True)])
            elif op == "score":
                value = rng.normal(size=s)
            elif op == "log_prob":
                value = -rng.exponential(size=mask.shape) * mask
            else:
                value = rng.normal(size=mask.shape) * mask
            return Batch({writes[0]: value})

        return self.backend.dispatch(f"{self.name}.{op}", batch, run, writes)

    def log_prob(self, batch: Batch) -> Batch:
        return self._forward("log_prob", batch)

    def values(self, batch: Batch) -> Batch:
        return self._forward("values", batch)

    def score(self, batch: Batch) -> Batch:
        return self._forward("score", batch)

    def update(self, batch: Batch) -> Batch:
        writes = call_writes(self.name, self.facts, "update")

        def run(b: Batch) -> Batch:
            s = self._check_sequences(b, "update")
            assert s % self.w.mini_batches == 0
            steps = [Batch.concat(part.chunk(2)) for part in b.chunk(self.w.mini_batches)]  # the real split
            assert sum(len(step) for step in steps) == s
            return Batch({writes[0]: {"steps": len(steps) * self.w.epochs, "sequences": s}})

        return self.backend.dispatch(f"{self.name}.update", batch, run, writes)


class NumpyController:
    def __init__(self, backend: Backend, state: ControllerState) -> None:
        self.backend, self.state = backend, state
        self.samples_per_prompt = state.samples_per_prompt
        self.reuse_policy_log_probs = state.reuse_policy_log_probs
        self.staleness = state.staleness

    def step(self, name: str, batch: Batch) -> Batch:
        step = STEPS[name]
        inputs = batch.select(*step.reads)
        concrete = inputs.resolve(timeout=30)
        self.backend.calls.append(Call(f"controller.{name}", tuple(inputs), len(concrete)))
        return Batch(step(concrete, self.state))
