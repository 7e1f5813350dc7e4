"""Rich tables of a profiling run: the fitted rates, and each measured layer time against the cost model."""

from __future__ import annotations

import pandas as pd
from rich.table import Table

from hfplan.profiles.profiler.run import Result

PASS_LABEL = {"forward": "fwd", "forward+backward": "fwd+bwd", "decode": "decode"}


def fits_table(result: Result) -> Table:
    hw, fits = result.profile, result.fits
    table = Table(title=f"fitted rates (profile {hw.name!r})", show_edge=False)
    for column in ("rate", "value", "fit"):
        table.add_column(column, justify="left" if column == "rate" else "right")
    roof = fits.roofline
    fit_note = f"roofline, {roof.points} kernels, rms {100 * roof.rms_rel_error:.0f}%"
    table.add_row("peak TFLOP/s", f"{hw.compute.peak_tflops:g}",
                  "datasheet" if result.device.nominal.peak_tflops else "best measured matmul")
    table.add_row("matmul efficiency", f"{hw.compute.matmul_efficiency:.3f}", fit_note)
    table.add_row("kernel overhead us", f"{hw.compute.kernel_overhead_us:.2f}", fit_note)
    table.add_row("memory GB/s x efficiency", f"{hw.memory.bandwidth_gbps:g} x {hw.memory.efficiency:.3f}", fit_note)
    table.add_row("memory capacity / reserved GiB", f"{hw.memory.capacity_gib:g} / {hw.memory.reserved_gib:g}",
                  "per device")
    for label, link, fit in (("intra-node", hw.links.intra_node, fits.intra), ("host", hw.links.host, fits.host)):
        note = (f"alpha-beta, {fit.points} points, rms {100 * fit.rms_rel_error:.0f}%" if fit is not None
                else "not measured: base profile")
        table.add_row(f"{label} GB/s x efficiency, latency us",
                      f"{link.bandwidth_gbps:g} x {link.efficiency:.3f}, {link.latency_us:.1f}", note)
    inter = hw.links.inter_node
    table.add_row("inter-node GB/s x efficiency, latency us",
                  f"{inter.bandwidth_gbps:g} x {inter.efficiency:.3f}, {inter.latency_us:.1f}",
                  "not measured: base profile")
    for op, fit in fits.per_collective.items():
        table.add_row(f"  {op} alone: GB/s, latency us", f"{fit.bytes_per_s / 1e9:.3g}, {fit.latency_s * 1e6:.1f}",
                      f"{fit.points} sizes, rms {100 * fit.rms_rel_error:.0f}%")
    return table


def layer_table(result: Result) -> Table:
    plan = result.layers
    frame = result.measurements[result.measurements["kind"] == "layer"]
    scale = "" if plan.scale == 1 else f", scaled down {plan.scale}x from the catalog"
    table = Table(title=f"one {plan.source.name} layer ({plan.shape}{scale}; "
                        f"{frame['dtype'].iloc[0]}): measured vs cost model", show_edge=False)
    for column in ("pass", "batch", "seq / ctx", "tp", "tokens", "measured ms", "predicted ms", "error %"):
        table.add_column(column, justify="left" if column == "pass" else "right")
    for row in frame.itertuples():
        length = row.context if row.op == "decode" else row.seq
        table.add_row(PASS_LABEL[row.op], str(int(row.batch)), str(int(length)), str(int(row.tp)), str(int(row.tokens)),
                      f"{1e3 * row.seconds:.3f}", f"{1e3 * row.predicted_s:.3f}", f"{row.error_pct:+.0f}")
    return table


def error_summary(frame: pd.DataFrame) -> str:
    """Median signed and absolute error per pass: the cost model's bias and its spread."""
    layer = frame[frame["kind"] == "layer"]
    parts = []
    for op, group in layer.groupby("op", sort=False):
        parts.append(f"{PASS_LABEL[op]} median {group['error_pct'].median():+.0f}% "
                     f"(|error| median {group['error_pct'].abs().median():.0f}%)")
    return "prediction error (predicted - measured) / measured: " + "; ".join(parts)
