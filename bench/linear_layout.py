"""A CPU BLAS's rate by the rows of a product and the layout of its weight, on one torch thread: why `hfplan profile`
times its matmuls as nn.Linear runs them and times their backward pairs apart (Compute.row_efficiency,
Compute.backward_row_efficiency).

For each weight (k in, n out) and row count m, four products, each over rotating copies of its operands (so the
weight streams from memory, as a layer's does in a many-layer model):
- `mm`: x @ W with W stored k x n, row-major (the profiler's sweep before 2026-12-07);
- `linear`: x @ W.t() with W stored n x k, as nn.Linear's forward runs it;
- `dX`: dY @ W, the input gradient of that product;
- `dW`: dY.t() @ X, its weight gradient (a reduction over the m rows).
Prints each one's GFLOP/s, fastest of --trials timed loops. Asserts nothing about time.

    python bench/linear_layout.py [--rows 16,64,128,512] [--trials 3]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import torch

WEIGHTS = ((512, 768), (512, 2752), (1376, 512), (1024, 1024), (1024, 4096), (2048, 2048))  # (k in, n out)
ROTATION_BYTES = 128 * 2**20  # of each weight's copies: well past the core's L2


def rate(flops: float, call: Callable[[], object], trials: int, calls: int = 20) -> float:
    """GFLOP/s of `call`, fastest of `trials` loops of `calls` after two warm-up calls."""
    call(), call()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return flops / best / 1e9


def products(k: int, n: int, m: int) -> tuple[Callable[[], object], ...]:
    """The four products of `m` rows by a k x n weight, each over its own rotating copies."""
    copies = max(2, ROTATION_BYTES // (4 * k * n))
    stored_kn = itertools.cycle([torch.randn(k, n) for _ in range(copies)])
    stored_nk = itertools.cycle([torch.randn(n, k) for _ in range(copies)])
    grads = itertools.cycle([torch.zeros(n, k) for _ in range(copies)])  # zeroed: no first write to fresh pages
    x, dy = torch.randn(m, k), torch.randn(m, n)
    return (lambda: x @ next(stored_kn), lambda: x @ next(stored_nk).t(), lambda: dy @ next(stored_nk),
            lambda: torch.mm(dy.t(), x, out=next(grads)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64,128,512")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'k in':>5} {'n out':>5} {'rows':>5}  {'mm':>6} {'linear':>6} {'dX':>6} {'dW':>6}   GFLOP/s, one thread")
    for k, n in WEIGHTS:
        for m in (int(r) for r in args.rows.split(",")):
            rates = [rate(2.0 * m * k * n, call, args.trials) for call in products(k, n, m)]
            print(f"{k:>5} {n:>5} {m:>5}  " + " ".join(f"{r:>6.0f}" for r in rates))


if __name__ == "__main__":
    main()
