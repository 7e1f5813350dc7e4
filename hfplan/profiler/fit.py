"""Fitting measured times to the simulator's cost models: alpha-beta for collectives, roofline for kernels.

Pure numpy/scipy, no torch: the fits are tested on synthetic measurements with known parameters.
Both fits weigh every point by its own time (relative residuals), so that the microsecond points
(which carry the latency and the fixed kernel cost) count as much as the second-long ones (which
carry the bandwidth and the FLOP rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from hfplan.profiles.hardware import MeasuredAttention
from hfplan.simulator.kernels import decode_streams

# The collectives the profiler times (their steps and bytes on a ring: hfplan.simulator.collectives.collective_terms).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class LinkFit:
    """alpha (seconds per step) and bandwidth (bytes/s) of one link class, and how well they fit."""

    latency_s: float
    bytes_per_s: float
    rms_rel_error: float
    points: int

    def predict(self, steps: np.ndarray | float, moved_bytes: np.ndarray | float) -> np.ndarray | float:
        return steps * self.latency_s + moved_bytes / self.bytes_per_s


def fit_alpha_beta(steps: Sequence[float], moved_bytes: Sequence[float], seconds: Sequence[float],
                   robust: bool = True) -> LinkFit:
    """Fit time = steps*alpha + moved_bytes/bandwidth, alpha >= 0, bandwidth > 0, on relative residuals.

    moved_bytes is what one rank sends (the bytes factor of `collectives.collective_terms` times the message size).
    Linear in (alpha, 1/bandwidth), so the bounded least squares has one minimum. `robust` uses a
    soft-L1 loss, so that a point disturbed by other work on the machine counts less.
    """
    s, b, t = (np.asarray(v, dtype=float) for v in (steps, moved_bytes, seconds))
    if not (len(s) == len(b) == len(t)) or len(t) < 2:
        raise ValueError("need at least two measurements of equal-length steps, bytes and seconds")
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    design = np.column_stack([s / t, b / t])  # each row divided by its own time: relative residuals
    # Scale the columns to order one so that the solver treats both parameters alike.
    scale = np.array([np.median(t / np.maximum(s, 1e-30)), np.median(t / np.maximum(b, 1e-30))])
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    result = least_squares(lambda p: design @ (p * scale) - 1.0, x0=np.array([0.5, 0.5]),
                           bounds=(np.zeros(2), np.full(2, np.inf)), method="trf", x_scale="jac",
                           loss="soft_l1" if robust else "linear", f_scale=0.15)
    alpha, inv_bw = result.x * scale
    inv_bw = max(inv_bw, 1e-30)
    fit = LinkFit(latency_s=float(alpha), bytes_per_s=float(1.0 / inv_bw), rms_rel_error=0.0, points=len(t))
    rel = fit.predict(s, b) / t - 1.0
    return LinkFit(fit.latency_s, fit.bytes_per_s, float(np.sqrt(np.mean(rel**2))), len(t))


@dataclass(frozen=True)
class RooflineFit:
    """The simulator's kernel model: time = overhead + max(flops / flops_per_s, bytes / bytes_per_s)."""

    overhead_s: float
    flops_per_s: float
    bytes_per_s: float
    rms_rel_error: float
    points: int

    def predict(self, flops: np.ndarray | float, nbytes: np.ndarray | float) -> np.ndarray:
        return self.overhead_s + np.maximum(np.asarray(flops, dtype=float) / self.flops_per_s,
                                            np.asarray(nbytes, dtype=float) / self.bytes_per_s)


def fit_roofline(flops: Sequence[float], nbytes: Sequence[float], seconds: Sequence[float],
                 bytes_per_s: float | None = None, robust: bool = True) -> RooflineFit:
    """Fit the roofline kernel model to measured kernels (matmuls and elementwise ops together).

    Parameters are fitted in log space (all positive) on log residuals, i.e. relative error. Give
    `bytes_per_s` to hold the bandwidth at a separately measured value and fit only the overhead and
    the FLOP rate. `robust` uses a soft-L1 loss (residuals beyond about 15% count linearly, not
    quadratically), so that kernels the roofline cannot describe (skinny matmuls that reach neither
    roof, a point disturbed by other work on the machine) do not drag the roofs of the rest.
    """
    f, b, t = (np.asarray(v, dtype=float) for v in (flops, nbytes, seconds))
    if not (len(f) == len(b) == len(t)) or len(t) < 3:
        raise ValueError("need at least three measurements of equal-length flops, bytes and seconds")
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    if not np.any(f > 0):
        raise ValueError("need at least one measurement with FLOPs (a matmul)")
    log_t = np.log(t)
    rate_guess = np.max(f / t)
    bw_guess = np.max(b / t) if bytes_per_s is None else bytes_per_s
    x0 = [np.log(max(np.min(t) * 0.5, 1e-9)), np.log(rate_guess), np.log(max(bw_guess, 1.0))]

    def unpack(p: np.ndarray) -> tuple[float, float, float]:
        return np.exp(p[0]), np.exp(p[1]), (bytes_per_s if bytes_per_s is not None else np.exp(p[2]))

    def residuals(p: np.ndarray) -> np.ndarray:
        overhead, rate, bw = unpack(p)
        return np.log(overhead + np.maximum(f / rate, b / bw)) - log_t

    free = x0 if bytes_per_s is None else x0[:2]
    best = None
    # The max() makes the surface piecewise smooth: start from a few overheads and keep the best.
    for shift in (0.0, -3.0, 3.0):
        start = np.array(free, dtype=float)
        start[0] += shift
        result = least_squares(residuals, start, method="trf", loss="soft_l1" if robust else "linear",
                               f_scale=0.15)
        if best is None or result.cost < best.cost:
            best = result
    overhead, rate, bw = unpack(best.x)
    rms = float(np.sqrt(np.mean(np.expm1(best.fun) ** 2)))
    return RooflineFit(float(overhead), float(rate), float(bw), rms, len(t))


ROW_FIT_MIN_WIDTH = 256  # a matmul's K and N at least this wide to stand for its rows (narrower: overhead-bound)


def _row_tables(rows: Sequence[dict], value_bytes: int, min_width: int = ROW_FIT_MIN_WIDTH
                ) -> dict[int, dict[int, list[dict]]]:
    """The matmuls Compute.row_efficiency is fitted to, by their weight's bytes (k x n values) and then their rows:
    those at least `min_width` wide in K and N, of the weight sizes measured at two row counts or more (one
    says nothing of how the rate grows with rows)."""
    groups: dict[int, dict[int, list[dict]]] = {}
    for row in rows:
        if min(row["k"], row["n"]) >= min_width:
            weight = int(row["k"] * row["n"] * value_bytes)
            groups.setdefault(weight, {}).setdefault(int(row["m"]), []).append(row)
    return {weight: by_rows for weight, by_rows in groups.items() if len(by_rows) >= 2}


def row_limited(rows: Sequence[dict], value_bytes: int) -> list[dict]:
    """The matmuls whose rate Compute.row_efficiency describes: of each weight size it tables, every row count below
    its largest (the largest is the table's end, at the rate). The roofline's matmul rate is fitted without them
    (CPU), as a GPU's is fitted on FLOPs its tiling model scales: a product of few rows is slow by its rows, not by
    the rate."""
    limited = []
    for by_rows in _row_tables(rows, value_bytes).values():
        largest = max(by_rows)
        limited += [row for m, group in by_rows.items() if m < largest for row in group]
    return limited


def fit_row_efficiency(rows: Sequence[dict], rate: float, overhead_s: float, value_bytes: int,
                       ends_at_rate: bool = True, min_width: int = ROW_FIT_MIN_WIDTH
                       ) -> tuple[tuple[int, int, float], ...] | None:
    """Compute.row_efficiency from matmul rows (dicts with m, k, n, flops, seconds) and the profile's matmul rate
    (FLOP/s) and kernel overhead: for each weight size `_row_tables` keeps, each row count's median rate beyond the
    overhead over `rate`, capped at 1, made non-decreasing in m (a point below one of fewer rows is that one's:
    timing noise, not a kernel that slows as it grows), and, `ends_at_rate`, 1 at the largest row count measured
    (the rate is the large matmuls': the sweep measures each weight at enough rows to reach it). Without it (the
    backward pairs of Compute.backward_row_efficiency, whose rate is not the one fitted) the largest row count keeps
    its measured fraction (and the cached products of Compute.cached_row_efficiency, whose narrow weights, below
    `min_width`, are what a small model runs). None where every row count of every weight size reaches the rate
    (nothing to scale)."""
    table: list[tuple[int, int, float]] = []
    for weight, by_rows in sorted(_row_tables(rows, value_bytes, min_width).items()):
        fraction, largest = 0.0, max(by_rows)
        for m in sorted(by_rows):
            reached = [row["flops"] / max(row["seconds"] - overhead_s, 1e-12) / rate for row in by_rows[m]]
            measured = max(fraction, min(1.0, float(np.median(reached))))
            fraction = 1.0 if m == largest and ends_at_rate else measured
            table.append((m, weight, round(fraction, 4)))
    if all(fraction >= 1.0 for _, _, fraction in table):
        return None
    return tuple(table)


def fit_attention(rows: Sequence[dict], value_bytes: int, cache_bytes: int | None
                  ) -> dict[str, tuple[float, float, float, float]] | None:
    """Compute.measured_attention from attention rows (dicts with op, batch, heads, kv_heads, hidden, context,
    flops, seconds): for each op, seconds = call + pairs x pair + scores x score + flops / rate (pairs: batch x
    heads; scores: flops over 4 x the head's width), all four at least zero, by least squares on relative error;
    (call us, pair us, score ns, TFLOP/s) by op. Decode rows whose keys and values stream from memory
    (kernels.decode_streams: more than `cache_bytes`) are left out: the simulator prices those by their read. None
    unless both ops (decode and forward) have more rows than that."""
    by_op: dict[str, list[dict]] = {}
    for row in rows:
        width = row["hidden"] / row["heads"]
        if row["op"] == "decode" and decode_streams(
                cache_bytes, value_bytes * row["batch"] * row["context"] * 2 * row["kv_heads"] * width):
            continue
        by_op.setdefault(row["op"], []).append(row)
    if set(by_op) != {"decode", "forward"} or any(len(points) <= 4 for points in by_op.values()):
        return None
    fitted = {}
    for op, points in sorted(by_op.items()):
        t = np.array([p["seconds"] for p in points], dtype=float)
        flops = np.array([p["flops"] for p in points], dtype=float)
        columns = np.column_stack([np.ones_like(t), [p["batch"] * p["heads"] for p in points],
                                   flops / (4.0 * np.array([p["hidden"] / p["heads"] for p in points])), flops])
        design = columns / t[:, None]  # relative residuals
        scale = np.median(t[:, None] / columns, axis=0)  # each to order one, so the solver treats them alike
        result = least_squares(lambda x, design=design, scale=scale: design @ (x * scale) - 1.0,
                               x0=np.full(4, 0.25), bounds=(0.0, np.inf), method="trf", x_scale="jac")
        call, pair, score, per_flop = result.x * scale
        fitted[op] = (float(call * 1e6), float(pair * 1e6), float(score * 1e9), float(1e-12 / max(per_flop, 1e-30)))
    return fitted


def measured_attention(fitted: dict[str, tuple[float, float, float, float]]) -> dict[str, MeasuredAttention]:
    """fit_attention's figures as the profile writes them (Compute.measured_attention), rounded."""
    return {op: MeasuredAttention(call_us=round(call, 3), pair_us=round(pair, 4), score_ns=round(score, 4),
                                  tflops=float(f"{tflops:.4g}"))
            for op, (call, pair, score, tflops) in fitted.items()}
