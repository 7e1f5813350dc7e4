"""Modelled GEMM efficiency by shape, beside a measured matmul sweep where one is given.

For a grid of (m, k, n) shapes (square ones, and the skinny ones of transformer layers: decode and small
micro-batches against hidden and MLP widths), prints the fraction of peak the cost model charges (the
profile's matmul_efficiency times the tile, wave and short-K efficiency of the shape) and the roofline's
seconds. With --csv (the raw measurements `hfplan profile` writes beside a profile), the measured shapes
are printed instead, with their measured fraction of peak. Asserts nothing.

    python bench/gemm_efficiency.py --hardware a100-80g
    python bench/gemm_efficiency.py --hardware measured.yaml --csv measured.csv
"""

from __future__ import annotations

import argparse
import csv
import sys

from hfplan.profiles.hardware import load_hardware
from hfplan.simulator.kernels import gemm_shape_efficiency, gemm_time

SQUARE = tuple((s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192, 16384))
SKINNY = tuple((m, k, n) for m in (1, 16, 128, 1024, 4096) for k, n in ((4096, 4096), (4096, 11008), (11008, 4096)))


def measured_rows(path: str) -> list[tuple[int, int, int, float]]:
    with open(path, newline="") as handle:
        return [(int(float(r["m"])), int(float(r["k"])), int(float(r["n"])), float(r["seconds"]))
                for r in csv.DictReader(handle) if r["kind"] == "matmul"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="a100-80g", help="shipped profile name or profile .yaml")
    parser.add_argument("--csv", help="raw measurements of `hfplan profile` (its matmul rows are compared)")
    args = parser.parse_args()
    hw = load_hardware(args.hardware)
    tiling = hw.compute.gemm
    out = sys.stdout
    out.write(f"{hw.name}: peak {hw.compute.peak_tflops:g} TFLOP/s, matmul_efficiency "
              f"{hw.compute.matmul_efficiency:g}, tiling {tiling if tiling is not None else 'none (plain roofline)'}\n")
    shapes = [(m, k, n, None) for m, k, n in SQUARE + SKINNY] if args.csv is None else measured_rows(args.csv)
    out.write(f"{'m':>6} {'k':>6} {'n':>6} {'shape eff':>9} {'model % peak':>12} {'model us':>10}"
              + (f" {'measured % peak':>15} {'measured us':>11}" if args.csv else "") + "\n")
    for m, k, n, seconds in shapes:
        shape = gemm_shape_efficiency(tiling, m, k, n)
        model_s = gemm_time(hw, m, k, n)
        achieved = 2.0 * m * k * n / model_s / hw.peak_flops
        line = f"{m:>6} {k:>6} {n:>6} {shape:>9.3f} {100 * achieved:>12.1f} {1e6 * model_s:>10.1f}"
        if seconds is not None:
            line += f" {100 * 2.0 * m * k * n / seconds / hw.peak_flops:>15.1f} {1e6 * seconds:>11.1f}"
        out.write(line + "\n")


if __name__ == "__main__":
    main()
