"""How fast hfplan's executor hands tensors from one worker process to another through Ray's object store.

That is the path a separate rollout set's weights take (executor.worker: weight_buckets, then load_shards on
the rollout rank): the actor's rank packs its slices into flat buckets (a copy) and returns them as arrays of
their bytes (engines.reshard.bucket_array), Ray stores them and resolves them into the rollout rank's call, which
copies each into its generation shards. On the project's 2-core VM (2026-12-07) 48 MiB took 0.16-0.18 s that
way while the buckets travelled as tensors, which Ray pickles (the handover fitted at 0.26 GB/s), and 0.06 s as
arrays (bench/weight_sync.py; the profile then shipped fitted 0.92 GB/s); the gloo point-to-point fit the simulator
priced the bytes at before gave 0.03 s, and a separate rollout set's generation on the 12M-parameter `small` model
was under-priced by 35-48%.

`hfplan profile` times that path between two Ray actors of its session (a sender holding a float32 buffer that
returns a packed copy of its first n bytes, a receiver that copies what it gets into a buffer of its own) at
SIZES, each the median of its timed transfers after a warm-up, and fits latency + bytes / bandwidth
(Links.object_store).
"""

from __future__ import annotations

import logging
import time

from hfplan.measure import typical
from hfplan.profiler.fit import fit_alpha_beta
from hfplan.profiles.hardware import Link

SIZES = tuple(m * 2**20 for m in (1, 4, 16, 64))  # bytes handed over
REPS = 5  # timed transfers a size
TIMEOUT_S = 120.0
FLOAT_BYTES = 4

logger = logging.getLogger(__name__)


class HandoverSender:
    """An actor rank's side: a buffer, and its first bytes packed as a weight sync's bucket."""

    def __init__(self, most_bytes: int) -> None:
        import torch

        self.held = torch.ones(most_bytes // FLOAT_BYTES)

    def bucket(self, nbytes: int) -> list:
        from hfplan.executor.engines.reshard import bucket_array

        return [(("weights",), bucket_array(self.held[: nbytes // FLOAT_BYTES].clone()))]

    def ready(self) -> bool:
        return True


class HandoverReceiver:
    """A rollout rank's side: each bucket it is handed copied into a buffer of its own."""

    def __init__(self, most_bytes: int) -> None:
        import torch

        self.into = torch.empty(most_bytes // FLOAT_BYTES)

    def load(self, buckets: list) -> bool:
        import torch

        from hfplan.executor.engines.reshard import bucket_values

        for _, raw in buckets:
            flat = bucket_values(raw, torch.float32)
            self.into[: flat.numel()].copy_(flat)
        return True


def measure_object_store(ray, sizes: tuple[int, ...] = SIZES, reps: int = REPS) -> list[dict]:
    """Time the handover at each of `sizes` bytes in the Ray session this process holds (two actors that need no
    CPU slot, killed after); raw rows of kind `object_store`, none where Ray failed it (logged: the rest of the
    profile stands, and a weight sync's bytes are priced as a point-to-point send)."""
    try:
        return _timed(ray, sizes, reps)
    except (ray.exceptions.RayError, ValueError) as failure:
        logger.warning("the object store's handover was not measured (%s)", failure)
        return []


def _timed(ray, sizes: tuple[int, ...], reps: int) -> list[dict]:
    most = max(sizes)
    sender = ray.remote(num_cpus=0)(HandoverSender).remote(most)
    receiver = ray.remote(num_cpus=0)(HandoverReceiver).remote(most)
    try:
        ray.get([sender.ready.remote(), receiver.load.remote([])], timeout=TIMEOUT_S)
        rows = []
        for nbytes in sizes:
            seconds = []
            for rep in range(reps + 1):  # the first a warm-up
                start = time.perf_counter()
                ray.get(receiver.load.remote(sender.bucket.remote(nbytes)), timeout=TIMEOUT_S)
                if rep:
                    seconds.append(time.perf_counter() - start)
            rows.append(dict(kind="object_store", steps=1, moved_bytes=nbytes, seconds=typical(seconds)))
        return rows
    finally:
        ray.kill(sender)
        ray.kill(receiver)


def object_store_link(rows: list[dict]) -> Link | None:
    """Links.object_store fitted to measure_object_store's `rows` (latency + bytes / bandwidth, at the bandwidth it
    reached: efficiency 1); None with fewer than two sizes."""
    if len(rows) < 2:
        return None
    fit = fit_alpha_beta([r["steps"] for r in rows], [r["moved_bytes"] for r in rows], [r["seconds"] for r in rows])
    return Link(bandwidth_gbytes_per_s=round(fit.bytes_per_s / 1e9, 4), efficiency=1.0,
                latency_us=round(fit.latency_s * 1e6, 1))


def handover_seconds(link: Link, nbytes: float) -> float:
    """One handover of `nbytes` as the profiler's probe times it (its two Ray calls' latency, then the bytes)."""
    return link.latency_us * 1e-6 + nbytes / link.effective_bytes_per_s


def size_range() -> str:
    """SIZES as the profile's notes name them."""
    return f"{min(SIZES) // 2**20} to {max(SIZES) // 2**20} MiB"
