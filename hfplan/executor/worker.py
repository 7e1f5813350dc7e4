"""The per-device process: one Ray actor per GPU (or per CPU "GPU"), holding every role of its set.

The worker joins its set's torch.distributed world, builds the roles placed on the set and runs the
calls the controller dispatches to it. Each call returns its outputs (numpy) and the spans it spent, timed on
this process's clock, packed as executor.wire packs the call's arguments.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from hfplan.executor import wire
from hfplan.executor.loopback import loopback_interface
from hfplan.executor.startup import WORKER_STAGES
from hfplan.hyperparams import Hyperparameters
from hfplan.plan import Plan


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: the plan (as JSON), where it sits, and how to run."""

    plan_json: str
    hyper_json: str
    set_index: int
    rank: int
    world_size: int
    seed: int
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    collective_timeout_s: float


@dataclass(frozen=True)
class Timed:
    """One stretch of work inside a call, on the worker's clock."""

    op: str
    kind: str  # compute | transfer | transition
    start: float
    end: float


def listening_socket(host: str) -> socket.socket:
    """A socket bound to a port the system chose on `host`, listening. Rank 0 hands it to its TCPStore, so
    the port stays taken from the moment its number is given out (a port found free and closed again can be
    taken by any other connection before the store binds it)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen()
    except OSError:
        listener.close()
        raise
    return listener


def _remote_fields(fields: dict) -> tuple[dict, list]:
    """The RowsFrom fields, and the distinct Ray references their pieces come from (KeptOutputs are none)."""
    from hfplan.executor.roles import KeptOutputs, RowsFrom

    remote = {name: value for name, value in fields.items() if isinstance(value, RowsFrom)}
    refs = {id(source): source for value in remote.values() for source, _, _ in value.pieces
            if not isinstance(source, KeptOutputs)}
    return remote, list(refs.values())


def wait_for_producers(fields: dict) -> None:
    """Block until every call on another worker whose outputs these fields read has finished (its outputs
    exist somewhere, not yet fetched here): a call is dispatched before its producers end, and that wait is
    not transfer. This worker's own earlier calls have run: Ray runs them in the order they were sent."""
    import ray

    _, refs = _remote_fields(fields)
    if refs:
        ray.wait(refs, num_returns=len(refs), fetch_local=False)


def fetch_fields(fields: dict, kept: dict[int, dict]) -> dict[str, np.ndarray]:
    """Arrays for every field: those sent inline as they are, RowsFrom pieces fetched (or read from `kept`,
    this worker's own outputs by call id) and joined."""
    import ray

    from hfplan.executor.roles import KeptOutputs

    remote, refs = _remote_fields(fields)
    results = [wire.unpack_packed(packed) for packed in ray.get(refs)] if refs else []
    fetched = dict(zip((id(ref) for ref in refs), results, strict=True))

    def outputs_of(source) -> dict:
        if not isinstance(source, KeptOutputs):
            return fetched[id(source)]["fields"]
        if source.call_id not in kept:
            raise RuntimeError(f"the outputs of call {source.call_id}, made on this worker, are gone: that call "
                               "failed, or belongs to an earlier iteration")
        return kept[source.call_id]

    arrays = {name: value for name, value in fields.items() if name not in remote}
    for name, value in remote.items():
        parts = [outputs_of(source)[value.name][lo:hi] for source, lo, hi in value.pieces]
        arrays[name] = np.concatenate(parts, axis=0)  # a new, writable array
    return arrays


RUNTIME_MODULE = "hfplan.executor.runtime"  # the roles' engines: imports torch and transformers


def _imported(name: str) -> tuple[object, float]:
    """The module, and when its import ended (this process's clock)."""
    return importlib.import_module(name), time.time()


class SetWorker:
    """Instantiated by the controller as a Ray actor (see placement.py)."""

    def __init__(self, spec: WorkerSpec) -> None:
        # torch, transformers and the engines take seconds to import: begun at once, while the controller
        # starts the other workers and the set's rendezvous, and waited for in setup.
        self.marks = {"start": time.time()}
        pool = ThreadPoolExecutor(1, thread_name_prefix="hfplan-imports")
        self._imports: Future = pool.submit(_imported, RUNTIME_MODULE)
        pool.shutdown(wait=False)
        self.spec = spec
        self.plan = Plan.model_validate_json(spec.plan_json)
        self.hyper = Hyperparameters.model_validate_json(spec.hyper_json)
        self.runtimes: dict = {}
        self.kept: dict[int, dict] = {}  # this iteration's call outputs by call id (roles.KeptOutputs)
        self._listener: socket.socket | None = None  # rank 0's, until its store takes it in setup

    def rendezvous_address(self) -> tuple[str, int]:
        """Where rank 0 of the set listens for its peers: this node's address and a port it holds from now on."""
        import ray

        host = ray.util.get_node_ip_address()
        self._listener = listening_socket(host)
        return host, self._listener.getsockname()[1]

    def clock(self) -> float:
        return time.time()

    def setup(self, host: str, port: int) -> dict[str, float]:
        """Join the set's world and build its roles; returns this worker's start-up marks (its clock): `start`,
        `setup` (when this call began) and the end of each of startup.WORKER_STAGES."""
        self.marks["setup"] = time.time()
        runtime, self.marks[WORKER_STAGES[0]] = self._imports.result()
        import torch
        import torch.distributed as dist

        spec = self.spec
        if spec.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly the bundle's GPU to this process
        else:
            torch.set_num_threads(1)  # one core per "GPU": processes must not fight over the cores
        loopback = loopback_interface()
        if host.startswith("127.") and loopback:  # a set on one machine talks over loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        timeout = timedelta(seconds=spec.collective_timeout_s)
        listener, self._listener = self._listener, None
        store = dist.TCPStore(host, port, spec.world_size, is_master=listener is not None, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach() if listener else None)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                timeout=timeout)
        self.marks[WORKER_STAGES[1]] = time.time()
        self.runtimes = runtime.build_runtimes(self.plan, self.hyper, spec.set_index, spec.seed, spec.device)
        self.marks[WORKER_STAGES[2]] = time.time()
        return self.marks

    def calls(self, blob: bytes, buffers: list | tuple = (), refs: list | tuple = ()) -> wire.Packed | list:
        """Role calls run back to back (roles.Dispatch): a list of `run_call`'s arguments, as wire.pack sends it;
        returns each call's result packed the same way (one value per call: Ray's num_returns), with no Ray
        reference looked for in it (a result is arrays and spans; a reference in it would travel unseen by Ray's
        reference counting). A call that fails returns CallFailed, and so do the calls after it, which do not run."""
        results, failed = [], None
        for args in wire.unpack(blob, buffers, refs):
            if failed is None:
                try:
                    result = self.run_call(*args)
                except Exception as error:  # the controller names the call (roles.PendingCall.outputs)
                    failed = f"{args[0]}.{args[1]}"
                    result = wire.CallFailed(traceback.format_exception_only(error)[-1].strip())
            else:
                result = wire.CallFailed(f"not run: {failed}, sent with it, failed first")
            results.append(wire.pack(result, refs=False))  # outputs and spans: no Ray reference among them
        return results if len(results) > 1 else results[0]

    def run_call(self, role: str, op: str, fields: dict, options: dict, call_id: int, keep_from: int) -> dict:
        """Run role call `call_id` on this rank's share of the batch; returns {"fields", "spans"}. Fields made by
        other calls arrive as RowsFrom references and are fetched here, straight from their producers (or read
        from this worker's kept outputs); the transfer span starts when the last producer has finished. The
        outputs are kept for later calls; those of calls before `keep_from` (an earlier iteration) are dropped."""
        self.kept = {key: value for key, value in self.kept.items() if key >= keep_from}
        spans: list[Timed] = []
        self._leave_generation(role, op, spans)
        wait_for_producers(fields)
        start = time.time()
        arrays = fetch_fields(fields, self.kept)
        spans.append(Timed(op, "transfer", start, time.time()))
        outputs = self.runtimes[role].run(op, arrays, options, spans)
        self.kept[call_id] = outputs
        return {"fields": outputs, "spans": spans}

    def _leave_generation(self, role: str | None = None, op: str | None = None, spans: list | None = None) -> None:
        from hfplan.executor.runtime import leave_generation_before

        leave_generation_before(self.runtimes, role, op, [] if spans is None else spans)

    def leave_generation(self) -> list[Timed]:
        """Every role back in its training layout now; the way back's spans (none if no role was generating)."""
        spans: list[Timed] = []
        self._leave_generation(spans=spans)
        return spans

    def weight_buckets(self, role: str, rollout_role: str, ranks: int) -> tuple:
        """When this rank started on its part of a weight sync (this worker's clock: the call queues behind the
        update, which the sync does not include), then its buckets of `role`'s weights for each of the rollout
        set's `ranks` ranks in turn (empty where it holds none of that rank's shard): called with num_returns =
        ranks + 1, so each rollout rank takes its own straight from this worker's object store."""
        self._leave_generation()
        started = time.time()
        runtime = self.runtimes[role]
        buckets = runtime.sync_buckets(runtime.plan.parallelism[rollout_role].gen)
        return (started, *(buckets.get(dst, []) for dst in range(ranks)))

    def load_shards(self, role: str, *parts: list) -> float:
        """Take a weight sync's buckets, one list from each rank of the actor (Ray resolves them before the call
        runs); returns when it was done (this worker's clock)."""
        self.runtimes[role].load_shards([bucket for part in parts for bucket in part])
        return time.time()

    def pid(self) -> int:
        return os.getpid()

    def export_model(self, checkpoint_folder: str, dest: str) -> dict[str, str]:
        """Write a checkpoint's trained roles as Hugging Face folders under `dest` (export_model.export_checkpoint)
        in this process, which has torch and transformers imported already; returns each role's folder."""
        from hfplan.executor.export_model import export_checkpoint

        return {role: str(path) for role, path in export_checkpoint(Path(checkpoint_folder), Path(dest)).items()}

    def _generators(self) -> dict:
        return {role: rt.generator for role, rt in self.runtimes.items() if rt.generator is not None}

    def save_checkpoint(self, folder: str) -> float:
        """Write this rank's part of a checkpoint: every trained role of the set (a collective over the set)
        and this worker's random streams. Returns seconds spent."""
        from hfplan.executor import checkpoint

        self._leave_generation()
        start, root = time.time(), Path(folder)
        for role, runtime in self.runtimes.items():
            if runtime.trained is not None:
                checkpoint.save_trained(runtime.trained, checkpoint.role_folder(root, role))
        checkpoint.save_rng(checkpoint.rng_file(root, self.spec.set_index, self.spec.rank), self._generators())
        return time.time() - start

    def load_checkpoint(self, folder: str, own_streams: bool, reseed: int) -> float:
        """Load every trained role of the set from a checkpoint (resharded to this layout; a collective), and
        this worker's random streams: its own when the checkpoint has the same ranks (`own_streams`), else
        fresh ones from `reseed`. Returns seconds spent."""
        from hfplan.executor import checkpoint

        self._leave_generation()
        start, root = time.time(), Path(folder)
        for role, runtime in self.runtimes.items():
            if runtime.trained is not None:
                checkpoint.load_trained(runtime.trained, checkpoint.role_folder(root, role))
        if own_streams:
            checkpoint.restore_rng(checkpoint.rng_file(root, self.spec.set_index, self.spec.rank),
                                   self._generators())
        else:
            checkpoint.reseed(self._generators(), reseed)
        return time.time() - start

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this process less Ray's shared object store (CPU: host_memory), or peak
        allocated device memory (CUDA)."""
        if self.spec.device == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated())
        from hfplan.executor.host_memory import peak_resident_bytes

        return peak_resident_bytes()

    def close(self) -> None:
        import torch.distributed as dist

        for role_runtime in self.runtimes.values():
            if role_runtime.engine is not None:
                role_runtime.engine.close()  # before the world ends: vLLM tears down its groups in it
        if dist.is_initialized():
            dist.destroy_process_group()
