"""A Ray actor call's round trip and the caller's CPU per call with a role call's packed arguments and result (one
pickle, no arrays or references beside it) passed as executor.wire passes them now, the pickle alone, against the
three arguments it passed before (the pickle and two empty lists), in alternating rounds. Then what a worker spends
packing a call's result (a generation's: four small arrays and six spans) with the pickler that looks for Ray
references in every object against the one a result now takes (`wire.pack(result, refs=False)`), in alternating
rounds, Ray imported as in a worker. Asserts nothing.

    RAY_AUTH_MODE=disabled python bench/wire_args.py [--rounds N] [--calls N] [--bytes N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
from rounds import alternate  # bench/ is the script's folder, hence on sys.path


@ray.remote(num_cpus=1)
class Echo:
    def alone(self, blob: bytes) -> bytes:
        return blob

    def beside(self, blob: bytes, buffers: list, refs: list) -> tuple:
        return blob, buffers, refs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=2000, help="the pickle's size (a log-prob call's is about 2 KB)")
    args = parser.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        echo = Echo.remote()
        blob = b"x" * args.bytes
        forms = {"the pickle alone": lambda: echo.alone.remote(blob),
                 "pickle + 2 empty lists": lambda: echo.beside.remote(blob, [], [])}
        for call in forms.values():
            ray.get(call(), timeout=60)
        wall: dict[str, list[float]] = {name: [] for name in forms}
        cpu: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, call in forms.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(args.calls):
                    ray.get(call(), timeout=60)
                wall[name].append((time.perf_counter() - start) / args.calls * 1e3)
                cpu[name].append((time.process_time() - start_cpu) / args.calls * 1e3)
        print(f"a no-op actor call, {args.bytes}-byte pickle, {args.calls} calls x {args.rounds} alternating rounds; "
              f"load average {os.getloadavg()[0]:.2f}; medians over the rounds, ms per call")
        for name in forms:
            print(f"  {name:<24} round trip {statistics.median(wall[name]):.3f}  "
                  f"caller CPU {statistics.median(cpu[name]):.3f}")
    finally:
        ray.shutdown()
    pack_times(args.rounds)


def pack_times(rounds: int, packs: int = 2000) -> None:
    import numpy as np

    from hfplan.executor import wire
    from hfplan.executor.worker import Timed

    rows = 32
    result = {"fields": {"prompts": np.zeros((rows, 5), np.int64), "responses": np.zeros((rows, 4), np.int64),
                         "response_mask": np.ones((rows, 4), np.int64),
                         "log_probs": np.zeros((rows, 4), np.float32)},
              "spans": [Timed("generate", "compute", 1.0, 2.0) for _ in range(6)]}
    forms = {"looking for references": lambda: wire.pack(result), "refs=False": lambda: wire.pack(result, refs=False)}
    ms = alternate(forms, rounds, packs)
    print(f"packing a generation's result, {packs} packs x {rounds} alternating rounds; medians over the rounds")
    for name in forms:
        print(f"  {name:<24} {ms[name] * 1e3:.1f} us CPU")
    before, after = (ms[name] for name in forms)
    print(f"  refs=False / looking for references: {after / before:.2f}x")


if __name__ == "__main__":
    main()
