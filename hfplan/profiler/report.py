"""Rich tables of a profiling run: the fitted rates, and each measured layer time against the cost model.
An error above FLAG_PCT is marked, and a note under the tables says what the mark means."""

from __future__ import annotations

import pandas as pd
from rich.table import Table

from hfplan.profiler import object_store
from hfplan.profiler.fit import ROW_FIT_MIN_WIDTH
from hfplan.profiler.run import Result, size_text
from hfplan.profiles.hardware import rows_by_weight

PASS_LABEL = {"forward": "fwd", "forward+backward": "fwd+bwd", "decode": "decode"}
# Above this relative error a fit or a layer prediction is flagged: plans made with the profile may be off.
FLAG_PCT = 25.0
FLAG = "!"


def _rms_note(what: str, rms_rel_error: float) -> str:
    pct = 100 * rms_rel_error
    return f"{what}, rms {pct:.0f}%" + (f" {FLAG}" if pct > FLAG_PCT else "")


def fits_table(result: Result) -> Table:
    hw, fits = result.profile, result.fits
    table = Table(title=f"fitted rates (profile {hw.name!r})", show_edge=False)
    for column in ("rate", "value", "fit"):
        table.add_column(column, justify="left" if column == "rate" else "right")
    roof = fits.roofline
    fit_note = _rms_note(f"roofline, {roof.points} kernels", roof.rms_rel_error)
    table.add_row("peak TFLOP/s", f"{hw.compute.peak_tflops:g}",
                  "datasheet" if result.device.nominal.peak_tflops else "best measured matmul")
    table.add_row("matmul efficiency", f"{hw.compute.matmul_efficiency:.3f}", fit_note)
    table.add_row("kernel overhead us", f"{hw.compute.kernel_overhead_us:.2f}", fit_note)
    table.add_row("memory GB/s x efficiency",
                  f"{hw.memory.bandwidth_gbytes_per_s:g} x {hw.memory.efficiency:.3f}", fit_note)
    rt = hw.runtime
    continuous_us = rt.engine_step_s("continuous") * 1e6
    table.add_row("forward pass / engine step static, continuous us",
                  f"{rt.forward_pass_us:.1f} / {rt.engine_step_us:.1f}, {continuous_us:.1f}",
                  "measured beyond the modelled kernels and each layer's")
    table.add_row("each decoder layer: forward / training micro-batch / engine step us",
                  f"{rt.layer_forward_us:.1f} / {rt.layer_train_us:.1f} / {rt.layer_step_us:.1f}",
                  "measured beyond the modelled kernels: the demo model at two depths, the difference per layer")
    table.add_row("each decoder layer on top, wrapped in FSDP2 / split by tensor parallelism: forward, training "
                  "micro-batch us",
                  f"{rt.fsdp_layer_forward_us:.1f}, {rt.fsdp_layer_train_us:.1f} / {rt.tp_layer_forward_us:.1f}, "
                  f"{rt.tp_layer_train_us:.1f}",
                  "measured across the profiled world at two depths, the difference per layer (0: not measured)")
    table.add_row("controller: round trip (its sending side) / a call within a task / a call opening a task on "
                  "its worker (+ each rank past the first) / its own step us",
                  f"{rt.controller_call_us:.1f} ({rt.controller_send_s() * 1e6:.1f}) / {rt.call_dispatch_s() * 1e6:.1f}"
                  f" / {rt.task_dispatch_s() * 1e6:.1f} (+{rt.rank_dispatch_us:.1f}) / {rt.controller_step_us:.1f}",
                  "measured through a Ray actor" if rt.controller_call_us else "no ray: no call measured")
    table.add_row("the controller's CPU per Ray task it sends us", f"{rt.controller_task_cpu_us:.1f}",
                  "measured on the probe's run (its CPU beyond its steps and rules), shared with the head host's "
                  "workers" if rt.controller_task_cpu_us else "not measured")
    store = hw.links.object_store
    table.add_row("tensors between two workers through Ray's object store: GB/s, latency us",
                  "none" if store is None else f"{store.bandwidth_gbytes_per_s:g}, {store.latency_us:g}",
                  f"measured through Ray, {object_store.size_range()}" if store is not None
                  else "not measured (--quick, no Ray of the profiler's own, or it failed): a point-to-point send "
                       "over the node's link")
    table.add_row("weight sync to a separate rollout set, fixed us", f"{rt.weight_sync_s() * 1e6:.1f}",
                  "measured with a rollout probe, beyond the engines' per-tensor cost and the bytes"
                  if rt.weight_sync_us is not None else "not measured: the controller's round trip")
    table.add_row("training micro-batch / optimizer step per tensor us",
                  f"{rt.train_pass_s() * 1e6:.1f} / {rt.optimizer_tensor_s() * 1e6:.2f}",
                  "measured beyond the modelled kernels, on the executor's training engine")
    table.add_row("with FSDP2: forward / training micro-batch / optimizer step per tensor us",
                  f"{rt.forward_pass_s(True) * 1e6:.1f} / {rt.train_pass_s(True) * 1e6:.1f} / "
                  f"{rt.optimizer_tensor_s(True) * 1e6:.2f}",
                  "measured beyond the modelled kernels, on the engine wrapped in FSDP2")
    table.add_row("split by tensor parallelism, on top: forward / training micro-batch / optimizer step per tensor us",
                  f"{rt.tp_forward_pass_us:.1f} / {rt.tp_train_pass_us:.1f} / {rt.tp_optimizer_tensor_us:.2f}",
                  "measured across the profiled world (0: not measured)")
    table.add_row("in pipeline stages, on top: forward / training micro-batch per stage us; a switch resharded by "
                  "plan, per tensor us", f"{rt.pp_forward_pass_us:.1f} / {rt.pp_train_pass_us:.1f}; "
                  f"{rt.reshard_tensor_us:.1f}", "measured across the profiled world (0: not measured)")
    table.add_row("split by tensor parallelism: switch per tensor / each collective of a generation step us",
                  f"{rt.tp_switch_tensor_us:.1f} / "
                  + ("link" if rt.step_collective_us is None else f"{rt.step_collective_us:.1f}"),
                  "measured across the profiled world: the switch beyond the modelled collectives, each collective "
                  "whole, in place of the link's latency (0, link: not measured)")
    for label, rows, measured, unset in (
            ("a matmul's rate by its rows and weight", hw.compute.row_efficiency, "median rate",
             "every row count at the matmul rate (or a tiling model prices the shape)"),
            ("its backward's (input and weight gradients)", hw.compute.backward_row_efficiency,
             "median backward pair's rate", "each gradient's GEMM priced by its own shape")):
        table.add_row(f"{label}: rows -> fraction of the matmul rate, per weight size",
                      _row_table_text(rows) if rows else "none",
                      f"measured: each row count's {measured} over the matmul rate, of the matmuls at least "
                      f"{ROW_FIT_MIN_WIDTH} wide in K and N, per weight size measured at two row counts or more"
                      if rows else unset)
    wake = hw.compute.idle_wake
    table.add_row("a call after its process idled: idle ms -> extra us",
                  ", ".join(f"{idle:g} -> {extra:,.0f}" for idle, extra in wake) if wake else "none",
                  "measured: the rollout engine's generation of one prompt after each wait against back to back"
                  if wake else "not measured (GPUs)")
    table.add_row("memory capacity / reserved GiB", f"{hw.memory.capacity_gib:g} / {hw.memory.reserved_gib:g}",
                  "per device")
    for label, link, fit in (("intra-node", hw.links.intra_node, fits.intra), ("host", hw.links.host, fits.host)):
        note = (_rms_note(f"alpha-beta, {fit.points} points", fit.rms_rel_error) if fit is not None
                else "not measured: base profile")
        table.add_row(f"{label} GB/s x efficiency, latency us",
                      f"{link.bandwidth_gbytes_per_s:g} x {link.efficiency:.3f}, {link.latency_us:.1f}", note)
    inter = hw.links.inter_node
    table.add_row("inter-node GB/s x efficiency, latency us",
                  f"{inter.bandwidth_gbytes_per_s:g} x {inter.efficiency:.3f}, {inter.latency_us:.1f}",
                  "not measured: base profile")
    for op, fit in fits.per_collective.items():
        table.add_row(f"  {op} alone: GB/s, latency us", f"{fit.bytes_per_s / 1e9:.3g}, {fit.latency_s * 1e6:.1f}",
                      _rms_note(f"{fit.points} sizes", fit.rms_rel_error))
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
        error = f"{row.error_pct:+.0f}" + (f" {FLAG}" if abs(row.error_pct) > FLAG_PCT else "")
        table.add_row(PASS_LABEL[row.op], str(int(row.batch)), str(int(length)), str(int(row.tp)), str(int(row.tokens)),
                      f"{1e3 * row.seconds:.3f}", f"{1e3 * row.predicted_s:.3f}", error)
    return table


def flagged(result: Result) -> list[str]:
    """What is off by more than FLAG_PCT: fits by their rms error, layer passes by any prediction."""
    fits = result.fits
    out = []
    named = [("roofline", fits.roofline), ("intra-node link", fits.intra), ("host link", fits.host),
             *((f"{op} alone", fit) for op, fit in fits.per_collective.items())]
    for name, fit in named:
        if fit is not None and 100 * fit.rms_rel_error > FLAG_PCT:
            out.append(f"{name} fit (rms {100 * fit.rms_rel_error:.0f}%)")
    layer = result.measurements[result.measurements["kind"] == "layer"]
    for op, group in layer.groupby("op", sort=False):
        worst = group["error_pct"].abs().max()
        if worst > FLAG_PCT:
            off = int((group["error_pct"].abs() > FLAG_PCT).sum())
            out.append(f"{PASS_LABEL[op]} predictions ({off} of {len(group)}, worst {worst:.0f}%)")
    return out


def flag_note(result: Result) -> str | None:
    """One line under the tables when something is flagged, else None."""
    items = flagged(result)
    if not items:
        return None
    return (f"{FLAG} error above {FLAG_PCT:.0f}%: {'; '.join(items)}. Plans made with this profile may be off by as "
            "much for the calls these rates cost; see docs/profile.md")


def error_summary(frame: pd.DataFrame) -> str:
    """Median signed and absolute error per pass: the cost model's bias and its spread."""
    layer = frame[frame["kind"] == "layer"]
    parts = []
    for op, group in layer.groupby("op", sort=False):
        parts.append(f"{PASS_LABEL[op]} median {group['error_pct'].median():+.0f}% "
                     f"(|error| median {group['error_pct'].abs().median():.0f}%)")
    return "prediction error (predicted - measured) / measured: " + "; ".join(parts)


def pace_note(result: Result) -> tuple[str, bool] | None:
    """The pace probe's line under the tables (CPU profiles), and whether it is a warning; None without one."""
    if result.pace_s is None:
        return None
    from hfplan.profiler.pace import PACE_DRIFT, drift, profiled_step_seconds

    start, end = result.pace_s
    implied = profiled_step_seconds(result.profile)
    line = (f"machine pace while profiling: the probe (a decode step of the tiny model) took {start * 1e6:,.0f} us at "
            f"the start and {end * 1e6:,.0f} us at the end"
            + (f"; the fitted runtime implies {implied * 1e6:,.0f} us" if implied is not None else ""))
    moved = drift(start, end)
    if moved <= PACE_DRIFT:
        return line, False
    return (line + f": the machine's speed moved by {moved * 100:.0f}% while it was profiled, so the fixed costs "
            "(runtime) hold one moment of it; profile again when the machine is quiet, or compare `hfplan "
            "validate`'s pace"), True


def _row_table_text(rows: tuple[tuple[int, int, float], ...]) -> str:
    """A row table as its weight sizes, each with its rows -> fraction points."""
    return "; ".join(f"{size_text(weight)}: " + ", ".join(f"{m:g} -> {fraction:.3g}" for m, fraction in points)
                     for weight, points in rows_by_weight(rows))
