"""A separate rollout set's weight sync through Ray's object store: buckets as arrays of their bytes (how the
executor sends them, engines.reshard.bucket_array / bucket_values) against buckets as torch tensors (how it sent
them before 2026-12-07), between two Ray actors of one session: the profiler's own sender and receiver
(hfplan.profiler.object_store), which also hand the same buckets over as tensors.

The sender packs the first n bytes of a float32 buffer into a new flat bucket (the copy the sync makes) and
returns it; the receiver copies what it gets into a buffer of its own (the shards). Each round times both forms
at each size, alternating, after one warm-up each; prints per form and size the median seconds over the rounds,
the bandwidth, and the ratio of the tensor form's seconds to the array form's (above 1: arrays faster).

    RAY_AUTH_MODE=disabled python bench/weight_sync.py [--rounds N] [--sizes-mib 8 48]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from hfplan.profiler.object_store import FLOAT_BYTES, HandoverReceiver, HandoverSender


class Sender(HandoverSender):
    """The profiler's sender (array buckets, as the executor sends them), and the same bucket as a tensor."""

    def tensor_bucket(self, nbytes: int) -> list:
        return [(("weights",), self.held[: nbytes // FLOAT_BYTES].clone())]


class Receiver(HandoverReceiver):
    """The profiler's receiver (array buckets), and the same copy of tensor buckets."""

    def load_tensors(self, buckets: list) -> bool:
        for _, flat in buckets:
            self.into[: flat.numel()].copy_(flat)
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 48])
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    sizes = [m * 2**20 for m in args.sizes_mib]
    ray_tmp = tempfile.mkdtemp(prefix="hfr-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             _temp_dir=ray_tmp)
    try:
        sender = ray.remote(num_cpus=0)(Sender).remote(max(sizes))
        receiver = ray.remote(num_cpus=0)(Receiver).remote(max(sizes))

        def handover(nbytes: int, as_array: bool) -> float:
            start = time.perf_counter()
            sent = sender.bucket.remote(nbytes) if as_array else sender.tensor_bucket.remote(nbytes)
            ray.get((receiver.load if as_array else receiver.load_tensors).remote(sent), timeout=120)
            return time.perf_counter() - start

        for nbytes in sizes:  # warm-up
            handover(nbytes, True), handover(nbytes, False)
        seconds: dict[tuple[int, bool], list[float]] = {}
        for _ in range(args.rounds):
            for nbytes in sizes:
                for as_array in (False, True):
                    seconds.setdefault((nbytes, as_array), []).append(handover(nbytes, as_array))
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"weight-sync handover between two Ray actors, {args.rounds} alternating rounds, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'MiB':>5} {'tensor s':>9} {'array s':>9} {'tensor GB/s':>12} {'array GB/s':>11} {'tensor/array':>13}")
    for nbytes in sizes:
        tensor, array = (statistics.median(seconds[(nbytes, a)]) for a in (False, True))
        print(f"{nbytes // 2**20:>5} {tensor:>9.4f} {array:>9.4f} {nbytes / tensor / 1e9:>12.3f} "
              f"{nbytes / array / 1e9:>11.3f} {tensor / array:>12.2f}x")


if __name__ == "__main__":
    main()
