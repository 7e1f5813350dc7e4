"""Plan.placement -> Ray: one placement group per colocated set, one worker per device of the set.

A set that fits in a node is packed onto one node (STRICT_PACK), as the plan's cost model assumes;
a larger set spans whole nodes (PACK). Every worker takes one CPU, and one GPU when the plan is for GPUs.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

from hfplan.errors import HfplanError
from hfplan.executor import compat
from hfplan.executor.errors import RunFailed
from hfplan.executor.roles import WorkerSet
from hfplan.executor.startup import StartupLog
from hfplan.executor.worker import SetWorker, WorkerSpec
from hfplan.hyperparams import Hyperparameters
from hfplan.plan import Plan


def bundle(device: str) -> dict[str, float]:
    return {"CPU": 1, "GPU": 1} if device == "cuda" else {"CPU": 1}


def check_capacity(plan: Plan, device: str) -> None:
    """Refuse a plan that needs more devices than the Ray cluster has, before any worker starts."""
    import ray

    resources = ray.cluster_resources()
    needed = sum(group.gpus for group in plan.placement)
    kind = "GPU" if device == "cuda" else "CPU"
    have = int(resources.get(kind, 0))
    if have < needed:
        raise HfplanError(f"the plan needs {needed} {'GPUs' if device == 'cuda' else 'CPU worker slots'} but the "
                          f"Ray cluster has {have}")


def start_sets(plan: Plan, hyper: Hyperparameters, seed: int, device: str, backend: str, timeout_s: float,
               ready_timeout_s: float, sets: list[WorkerSet], watch: DeathWatch | None = None,
               startup: StartupLog | None = None) -> dict[tuple[int, int], dict[str, float]]:
    """Create every set's placement group and workers (appended to `sets` as they start, so that the
    caller can stop what started when a later set fails) and join each set's torch.distributed world.
    Failures are described with `watch`'s record of the first worker that died, if it has one. Returns each
    worker's start-up marks by (set, rank) (worker.SetWorker.setup); `startup` gets the stages timed here."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_worker = ray.remote(SetWorker)
    run_id = uuid.uuid4().hex[:8]  # worker names stay unique when runs share a Ray cluster
    plan_json, hyper_json = plan.model_dump_json(), hyper.model_dump_json()
    startup = startup or StartupLog()
    requested: dict[int, float] = {}  # when each set's workers were asked for
    for index, group in enumerate(plan.placement):
        strategy = "STRICT_PACK" if group.gpus <= plan.cluster.gpus_per_node else "PACK"
        pg = placement_group([bundle(device)] * group.gpus, strategy=strategy, name=f"hfplan-set{index}-{run_id}")
        try:
            with startup.stage(f"set {index} placement group"):
                ray.get(pg.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise HfplanError(f"Ray could not place set {index} ({'+'.join(group.models)}, {group.gpus} devices, "
                              f"{strategy}) within {ready_timeout_s:.0f} s: not enough free resources") from None
        workers = []
        for rank in range(group.gpus):
            spec = WorkerSpec(plan_json, hyper_json, index, rank, group.gpus, seed, device, backend, timeout_s)
            options = dict(num_cpus=1, num_gpus=1 if device == "cuda" else 0, name=f"set-{index}-rank-{rank}-{run_id}",
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
            workers.append(remote_worker.options(**options).remote(spec))
        sets.append(WorkerSet(index, tuple(group.models), workers,
                              failure_namer(index, group.models, workers, sets, watch), pg))
        requested[index] = time.time()
    setups = []
    for worker_set in sets:
        host, port = _get(worker_set, worker_set.workers[0].rendezvous_address.remote(), ready_timeout_s, "start")
        startup.add(f"set {worker_set.index} worker start", requested[worker_set.index], time.time())
        setups += [((worker_set.index, rank), worker_set, w.setup.remote(host, port))
                   for rank, w in enumerate(worker_set.workers)]
    return {key: _get(worker_set, ref, ready_timeout_s, "setup") for key, worker_set, ref in setups}


CLOCK_ROUND_TRIPS = 5


def clock_offsets(sets: list[WorkerSet], timeout_s: float) -> dict[tuple[int, int], float]:
    """Worker clock minus controller clock, per (set, rank), from the quickest of a few round trips each: the
    worker read its clock somewhere inside the trip, so the shortest trip bounds the error most tightly."""
    offsets = {}
    for worker_set in sets:
        for rank, worker in enumerate(worker_set.workers):
            trips = []
            for _ in range(CLOCK_ROUND_TRIPS):
                before = time.time()
                theirs = _get(worker_set, worker.clock.remote(), timeout_s, "clock")
                after = time.time()
                trips.append((after - before, theirs - (before + after) / 2))
            offsets[(worker_set.index, rank)] = min(trips)[1]
    return offsets


def _get(worker_set: WorkerSet, ref, timeout_s: float, what: str):
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception as failure:
        raise RunFailed(worker_set.describe_failure("+".join(worker_set.roles), what, failure)) from failure


def call_every_worker(sets: list[WorkerSet], method: str, timeout_s: float, *args, per_worker=None) -> list:
    """Call `method` on every worker of every set at once (with `args`, then `per_worker(set, rank)`'s
    arguments if given) and wait for all; a failure raises RunFailed naming the set and rank."""
    calls = [(s, getattr(w, method).remote(*args, *(per_worker(s, rank) if per_worker else ())))
             for s in sets for rank, w in enumerate(s.workers)]
    return [_get(worker_set, ref, timeout_s, method) for worker_set, ref in calls]


PROBE_S = 3.0  # how long a failure's description waits to learn which worker, if any, has died


class DeathWatch:
    """Stops the run within seconds when a worker dies while the controller waits on another set: one trivial
    call per worker is outstanding at a time (queued behind its work); one that fails means the worker died.
    The watch records the first death and kills every other worker, so that whatever the controller waits on
    fails at once, and each failure is described as that death (see `failure_namer`)."""

    def __init__(self, sets: list[WorkerSet], period_s: float = 1.0) -> None:
        self.sets, self.period_s = sets, period_s
        self.dead: tuple[WorkerSet, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hfplan-death-watch", daemon=True)

    def __enter__(self) -> DeathWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.period_s)

    def _watch(self) -> None:
        import ray

        probes: dict[tuple[int, int], object] = {}
        while not self._stop.wait(self.period_s):
            for worker_set in self.sets:
                for rank, worker in enumerate(worker_set.workers):
                    probe = probes.get((worker_set.index, rank))
                    if probe is not None:
                        if not ray.wait([probe], timeout=0)[0]:
                            continue  # the worker is busy
                        try:
                            ray.get(probe)
                        except ray.exceptions.RayActorError:
                            if not self._stop.is_set():
                                self._died(worker_set, rank)
                            return
                    probes[(worker_set.index, rank)] = worker.clock.remote()

    def _died(self, worker_set: WorkerSet, rank: int) -> None:
        import ray

        self.dead = (worker_set, rank)
        for other in self.sets:
            for worker in other.workers:
                with contextlib.suppress(Exception):
                    ray.kill(worker)


def dead_worker(sets: list[WorkerSet]) -> tuple[WorkerSet, int] | None:
    """A worker of the run that has died, if any: a trivial call to each worker fails at once on a dead one
    (a busy one answers later, harmlessly)."""
    import ray

    probes = [(s, rank, w.clock.remote()) for s in sets for rank, w in enumerate(s.workers)]
    ray.wait([ref for *_, ref in probes], num_returns=len(probes), timeout=PROBE_S)
    for worker_set, rank, ref in probes:
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return worker_set, rank
    return None


def failure_namer(index: int, roles, workers, sets: list[WorkerSet], watch: DeathWatch | None = None):
    """How a failed call on set `index` is described: the first worker that died if the watch saw one, else the
    worker the failure names (a peer's collective may fail first: then any dead worker of the run), else the
    call's own error."""

    def describe(role: str, op: str, failure: Exception) -> str:
        import ray

        rank = _failed_rank(workers, failure)
        dead = watch.dead if watch is not None else None
        if dead is None and rank is None:
            dead = dead_worker(sets)
        if dead is not None:
            dead_set, dead_rank = dead
            when = f"during {role}.{op}" if dead_set.index == index else f"while {role}.{op} ran on set {index}"
            return f"the worker of set {dead_set.index} ({'+'.join(dead_set.roles)}), rank {dead_rank} died {when}"
        where = f"set {index} ({'+'.join(roles)})" + (f", rank {rank}" if rank is not None else "")
        if isinstance(failure, ray.exceptions.GetTimeoutError):
            return f"{role}.{op} on {where} did not finish in time (a stuck collective or an overloaded machine)"
        if isinstance(failure, ray.exceptions.RayActorError):
            return f"the worker of {where} died during {role}.{op}"
        cause = str(failure).strip().splitlines()
        return f"{role}.{op} failed on {where}: {cause[-1] if cause else type(failure).__name__}"

    return describe


def _failed_rank(workers, failure: Exception) -> int | None:
    actor_id = getattr(failure, "actor_id", None)
    if actor_id is None:
        return None
    for rank, worker in enumerate(workers):
        if compat.actor_id(worker) == actor_id:
            return rank
    return None


def stop_sets(sets: list[WorkerSet], timeout_s: float = 10.0) -> None:
    import ray

    closing = [w.close.remote() for s in sets for w in s.workers]
    with contextlib.suppress(Exception):  # workers already gone are fine at shutdown
        ray.get(closing, timeout=timeout_s)
    from ray.util.placement_group import remove_placement_group

    for worker_set in sets:
        for worker in worker_set.workers:
            ray.kill(worker)
        remove_placement_group(worker_set.placement_group)
