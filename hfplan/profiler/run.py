"""One profiling run: measure, fit, build the profile, then measure the model's layer against it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import pandas as pd

from hfplan.profiler import comm, compute, host_share, idle_wake, layers, object_store, pace, runtime
from hfplan.profiler.build import Fits, build_profile, device_tiling
from hfplan.profiler.call_gaps import CALL_FIELDS
from hfplan.profiler.device import Device
from hfplan.profiler.fit import (
    COLLECTIVES,
    LinkFit,
    fit_alpha_beta,
    fit_attention,
    fit_roofline,
    fit_row_efficiency,
    measured_attention,
    row_limited,
)
from hfplan.profiler.sweeps import Sweeps
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import ModelArch
from hfplan.simulator.kernels import gemm_shape_efficiency, split_k_bytes

COLUMNS = ("kind", "op", "dtype", "m", "k", "n", "flops", "bytes", "world", "link", "steps", "moved_bytes", "model",
           "scale", "hidden", "heads", "kv_heads", "ffn", "batch", "seq", "context", "tp", "tokens", "seconds", "rate",
           "idle_ms", "predicted_s", "error_pct")


class Tracker(Protocol):
    def phase(self, name: str, total: int) -> Callable[[], None]:
        """Start a phase of `total` steps; returns the function to call after each step."""


class Silent:
    def phase(self, name: str, total: int) -> Callable[[], None]:
        return lambda: None


WAKE_TIMES = 25  # the idle-wake probe's timing, in the sweeps' min_time (a few seconds)


@dataclass(frozen=True)
class Request:
    device: Device
    model: ModelArch
    sweeps: Sweeps
    name: str
    base: HardwareProfile


@dataclass(frozen=True)
class Result:
    profile: HardwareProfile
    measurements: pd.DataFrame
    fits: Fits
    layers: layers.LayerPlan
    device: Device
    pace_s: tuple[float, float] | None = None  # CPU: the pace probe's seconds at the run's start and end


@contextmanager
def _cpu_threads(torch, device: Device):
    """A CPU "device" gets its share of the cores; the rest belong to the other processes of the world."""
    before = torch.get_num_threads()
    if device.kind == "cpu":
        torch.set_num_threads(device.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _link_fit(rows: list[dict]) -> LinkFit | None:
    if len(rows) < 2:
        return None
    return fit_alpha_beta([r["steps"] for r in rows], [r["moved_bytes"] for r in rows], [r["seconds"] for r in rows])


def run_profile(torch, request: Request, tracker: Tracker | None = None) -> Result:
    tracker = tracker or Silent()
    device, sweeps = request.device, request.sweeps
    rows: list[dict] = []
    # The machine's pace at the start and at the end (hfplan.profiler.pace): a shared or virtual machine that
    # changes speed while it is profiled shows it there.
    pace_start = pace.measure_step_seconds(torch) if device.kind == "cpu" else None
    if device.kind == "cpu":  # alone in its process, before the world's other processes start
        rows += idle_wake.measure_idle_wake(torch, WAKE_TIMES * sweeps.min_time)
    with _cpu_threads(torch, device):
        rows += compute.measure_matmuls(torch, device, sweeps.matmuls, sweeps.min_time,
                                        tracker.phase("matmul sweep", len(sweeps.matmuls)))
        if sweeps.cached_matmuls:
            rows += compute.measure_matmuls(torch, device, sweeps.cached_matmuls, sweeps.min_time,
                                            tracker.phase("cached matmuls", len(sweeps.cached_matmuls)), cached=True)
        if sweeps.attention:
            rows += compute.measure_attention(torch, device, sweeps.attention, sweeps.min_time,
                                              tracker.phase("attention", len(sweeps.attention)))
        if sweeps.linear_backwards:
            rows += compute.measure_linear_backwards(torch, device, sweeps.linear_backwards, sweeps.min_time,
                                                     tracker.phase("matmul backwards", len(sweeps.linear_backwards)))
        rows += compute.measure_copies(torch, device, sweeps.copy_bytes, sweeps.min_time,
                                       tracker.phase("memory copies", len(sweeps.copy_bytes)))
        if device.kind == "cuda" and sweeps.host_bytes:
            rows += compute.measure_host_copies(torch, device, sweeps.host_bytes, sweeps.min_time,
                                                tracker.phase("host copies", len(sweeps.host_bytes)))
    if device.world_size > 1:
        if device.kind == "cuda":
            torch.cuda.empty_cache()
        rows += comm.measure_collectives(torch, device, sweeps.message_bytes, sweeps.comm_min_time, sweeps.engine_reps,
                                         tracker.phase("collectives", comm.points(sweeps.message_bytes)))
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    profile, fits = fit_measurements(rows, device, request.base, request.name, versions)
    with _cpu_threads(torch, device):
        across = runtime.EngineSeconds.from_rows(rows)
        rows = [r for r in rows if r["kind"] != "engine"]  # become runtime rows, with their predictions
        measured = runtime.measure_runtime_inputs(torch, device, profile, sweeps.min_time, sweeps.through_ray,
                                                  across, sweeps.engine_reps)
    profile, runtime_rows = with_runtime(profile, runtime.fit_runtime(profile, measured), request.base, device)
    rows += runtime_rows

    plan = layers.plan_layers(profile, request.model, sweeps.layers, device, sweep_value_bytes(rows), sweeps.min_time)
    with _cpu_threads(torch, device):
        layer_rows = layers.measure_layers(torch, device, plan, sweeps.min_time,
                                           tracker.phase("model layer", len(plan.cases)))
    rows += predicted_layers(profile, plan.arch, layer_rows)
    pace_s = None
    if pace_start is not None:
        pace_s = (pace_start, pace.measure_step_seconds(torch))
        rows += [dict(kind="pace", op=op, model=runtime.MODEL, world=1, seconds=seconds)
                 for op, seconds in zip(PACE_OPS, pace_s, strict=True)]
    return Result(profile=profile, measurements=frame_of(rows), fits=fits, layers=plan, device=device, pace_s=pace_s)


# The clause of the description that says the engines were timed in a Ray worker, its memory measured there.
WORKER_MEMORY = ", that worker's resident memory"
PACE_OPS = ("pace_start", "pace_end")  # the pace probe's rows, at the run's start and end
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def sweep_dtype(rows: list[dict]) -> str:
    """The dtype the compute sweep ran in (its matmul rows')."""
    return next(r["dtype"] for r in rows if r["kind"] == "matmul")


def sweep_value_bytes(rows: list[dict]) -> int:
    return DTYPE_BYTES[sweep_dtype(rows)]


def frame_of(rows: list[dict]) -> pd.DataFrame:
    """The raw measurements as the profile's CSV holds them (COLUMNS, in that order)."""
    frame = pd.DataFrame(rows)
    return frame[[c for c in COLUMNS if c in frame.columns]]


def predicted_layers(profile: HardwareProfile, arch: ModelArch, layer_rows: list[dict]) -> list[dict]:
    """The layer rows with what `profile` predicts for each (predicted_s, error_pct), `arch` the layer that ran."""
    out = []
    for row in layer_rows:
        predicted = layers.predict(profile, arch, layers.Case.of_row(row))
        out.append(row | {"predicted_s": predicted, "error_pct": 100.0 * (predicted - row["seconds"]) / row["seconds"]})
    return out


def sweep_note(rows: list[dict], device: Device) -> str:
    """What the compute sweep measured, as the profile's description says it."""
    sizes = [r["bytes"] / 2 for r in rows if r["kind"] == "memory"]  # a copy's rows count its read and its write
    return (f"{sum(r['kind'] == 'matmul' for r in rows)} matmul shapes ({sweep_dtype(rows)}), "
            f"{len(sizes)} copy sizes of {size_text(min(sizes))} to {size_text(max(sizes))}"
            + (f", {device.threads} CPU thread(s) per process" if device.kind == "cpu" else ""))


def fit_measurements(rows: list[dict], device: Device, base: HardwareProfile, name: str, versions: str
                     ) -> tuple[HardwareProfile, Fits]:
    """The profile's rates fitted to the compute and collective rows (its runtime not yet: fit_runtime), and the
    fits behind them."""
    collectives = [r for r in rows if r["kind"] == "collective"]
    tiling = device_tiling(device, base)
    esize = sweep_value_bytes(rows)
    kernels = roofline_kernels(rows, tiling, esize)
    fits = Fits(
        roofline=fit_roofline([effective_flops(r, tiling) for r in kernels],
                              [effective_bytes(r, tiling) for r in kernels], [r["seconds"] for r in kernels]),
        best_matmul_flops=max(r["rate"] for r in rows if r["kind"] == "matmul"),
        best_copy_bytes=max(r["rate"] for r in rows if r["kind"] == "memory"),
        intra=_link_fit(collectives),
        host=_link_fit([r for r in rows if r["kind"] == "host"]),
        per_collective={op: fit for op in COLLECTIVES
                        if (fit := _link_fit([r for r in collectives if r["op"] == op])) is not None},
    )
    profile = build_profile(device, fits, base, name, versions, sweep_note(rows, device))
    # A CPU BLAS's rate by the rows of a product (GPUs: the tiling model of the base profile); the runtime's fixed
    # costs are fitted against the kernels it prices.
    rows_fit = None if tiling is not None else fit_row_efficiency(
        [r for r in rows if r["kind"] == "matmul"], profile.matmul_flops, fits.roofline.overhead_s, esize)
    if rows_fit is not None:
        fewest = min(rows_fit)  # the fewest rows by the smallest weight
        largest = max(weight for _, weight, _ in rows_fit)
        one_row_largest = min(point for point in rows_fit if point[1] == largest)
        profile = _with_compute(profile, f" Rows: a matmul of {fewest[0]:g} row(s) by a {size_text(fewest[1])} weight "
                                         f"reached {fewest[2]:.3g} of the matmul rate, by a {size_text(largest)} one "
                                         f"{one_row_largest[2]:.3g}; of enough rows all of it (row_efficiency).",
                                row_efficiency=rows_fit)
    # The same with their operands in the cache (a small model's generation step), every weight size measured.
    cached_fit = None if tiling is not None else fit_row_efficiency(
        [r for r in rows if r["kind"] == "matmul_cached"], profile.peak_flops, fits.roofline.overhead_s, esize,
        ends_at_rate=False, min_width=1)
    if cached_fit is not None and device.cache_share_bytes is not None:
        one_row = [point for point in cached_fit if point[0] == min(cached_fit)[0]]
        profile = _with_compute(profile, f" Cached: with its operands in the cache, a matmul of {one_row[0][0]:g} row "
                                         f"by a {size_text(one_row[0][1])} weight reached {one_row[0][2]:.3g} of peak, "
                                         f"by a {size_text(one_row[-1][1])} one {one_row[-1][2]:.3g} "
                                         f"(cached_row_efficiency), where a generation step's weights and KV cache fit "
                                         f"{size_text(device.cache_share_bytes)} (cache_bytes).",
                                cached_row_efficiency=cached_fit, cache_bytes=device.cache_share_bytes)
    # The attention kernel by kind of call (CPU): its call's, each pair's and its math's cost.
    attention = fit_attention([r for r in rows if r["kind"] == "attention"], esize, profile.compute.cache_bytes)
    if attention is not None:
        decode, forward = attention["decode"], attention["forward"]
        profile = _with_compute(
            profile, f" Attention: a decode step's kernel cost {decode[0]:.3g} us a call, {decode[1]:.3g} us a "
                     f"(sequence, query head) pair, {decode[2]:.3g} ns a score and its products ran at "
                     f"{decode[3] * 1e3:.3g} GFLOP/s; a causal pass's {forward[0]:.3g} us, {forward[1]:.3g} us, "
                     f"{forward[2]:.3g} ns and {forward[3] * 1e3:.3g} GFLOP/s (measured_attention).",
            measured_attention=measured_attention(attention))
    # Their backward pairs, two kernels each, by the same rows.
    backward_fit = None if tiling is not None else fit_row_efficiency(
        [r for r in rows if r["kind"] == "matmul_backward"], profile.matmul_flops, 2 * fits.roofline.overhead_s,
        esize, ends_at_rate=False)
    if backward_fit is not None:
        fewest, most = min(backward_fit), max(backward_fit)
        profile = _with_compute(profile, f" Their backward (input and weight gradients together): {fewest[0]:g} rows "
                                         f"by a {size_text(fewest[1])} weight reached {fewest[2]:.3g} of the rate, "
                                         f"{most[0]:g} rows by a {size_text(most[1])} one {most[2]:.3g} "
                                         "(backward_row_efficiency).", backward_row_efficiency=backward_fit)
    # How the world's processes share the host's cores (CPU); the runtime's fixed costs are fitted against it.
    parallelism = host_share.fit_parallelism(rows)
    if parallelism is not None:
        profile = _with_compute(profile, f" Host sharing: {device.world_size} processes computing at once did the "
                                         f"work of {parallelism:g} processes each on cores of its own (the rollout "
                                         "engine's decode, alone and together).", host_parallelism=parallelism)
    wake = idle_wake.fit_idle_wake(rows)
    if wake is not None:
        profile = _with_compute(profile, f" Idle wake: the rollout engine's generation of one prompt ran "
                                         f"{wake[-1][1]:g} us longer after {wake[-1][0]:g} ms asleep than back to "
                                         "back (and at each shorter wait measured).", idle_wake=wake)
    return profile, fits


def with_runtime(profile: HardwareProfile, fixed: runtime.RuntimeFit, base: HardwareProfile, device: Device
                 ) -> tuple[HardwareProfile, list[dict]]:
    """`profile` with its runtime fitted (`fixed`), the worker's memory and the object store's link, and the runtime
    rows; what was not measured carried over from `base`."""
    resident = fixed.worker_resident_gib if fixed.ray else base.memory.worker_resident_gib
    memory = profile.memory.model_copy(update={"worker_resident_gib": resident})
    measured_calls = fixed.ray and fixed.runtime.call_dispatch_us is not None
    calls = {} if measured_calls else {name: getattr(base.runtime, name) for name in CALL_FIELDS}
    calls["vllm_batched_tokens"] = base.runtime.vllm_batched_tokens  # vLLM's default for the device, not measured
    links = profile.links if fixed.object_store is None else profile.links.model_copy(
        update={"object_store": fixed.object_store})
    profile = profile.model_copy(update={
        "runtime": fixed.runtime.model_copy(update=calls), "memory": memory, "links": links,
        "description": profile.description + " Runtime: a sampled decode step of the executor's torch rollout "
                       "engine (of one and of several sequences), a micro-batch, an optimizer step and a log-prob "
                       "call of its training engine (as one rank trains, per token on that rank, and across the "
                       "profiled world wrapped in FSDP2, split by tensor parallelism and in pipeline stages) and "
                       "the hybrid engine's switch, less their modelled kernels and collectives (on one rank: timed "
                       "in a Ray worker, as the executor runs them, where Ray is measured too)"
                       + (" and each decoder layer's (a log-prob call, a micro-batch and a decode step of the demo "
                          "model at two depths)" if device.kind == "cpu" else "")
                       + (WORKER_MEMORY if fixed.ray else "")
                       + (", and the executor's gaps between calls and its controller's advantage step, read off "
                          "a short run of it" if measured_calls
                          else "; the executor's call gaps and controller step not measured (--quick, ray not "
                          f"importable, or the probe run failed; carried over from base profile '{base.name}')")
                       + ("" if fixed.ray else f"; worker memory carried over from base profile '{base.name}'")
                       + "." + (f" Object store: tensors of {object_store.size_range()} handed from one Ray worker "
                                "to another as the executor hands a separate rollout set its weights, alpha-beta fit."
                                if fixed.object_store is not None else "")})
    return profile, fixed.rows


def _with_compute(profile: HardwareProfile, sentence: str, **fields) -> HardwareProfile:
    """The profile with compute fields measured here, and the sentence of its description that says how."""
    return profile.model_copy(update={"compute": profile.compute.model_copy(update=fields),
                                      "description": profile.description + sentence})


def roofline_kernels(rows: list[dict], tiling, value_bytes: int) -> list[dict]:
    """The matmuls and copies the roofline is fitted to. Without a tiling model (CPU) the products of few rows are
    priced by their rows (row_efficiency, fitted against the rate), so the rate is fitted without them; a GPU's
    on the FLOPs its tiling model scales (effective_flops)."""
    limited = set() if tiling is not None else {
        id(row) for row in row_limited([r for r in rows if r["kind"] == "matmul"], value_bytes)}
    return [r for r in rows if r["kind"] in ("matmul", "memory") and id(r) not in limited]


def effective_flops(row: dict, tiling) -> float:
    """A kernel's FLOPs as the cost model charges them: a matmul's divided by its shape efficiency, so that the
    fitted rate is the one of a GEMM without tile, wave or short-K loss (the profile's matmul_efficiency)."""
    if row["kind"] != "matmul":
        return row["flops"]
    return row["flops"] / gemm_shape_efficiency(tiling, row["m"], row["k"], row["n"])


def effective_bytes(row: dict, tiling) -> float:
    """A kernel's memory traffic as the cost model charges it: a split-K matmul's partial sums on top of its
    operands (small-M shapes, where the library splits K), so that their weight-read bound fits the bandwidth."""
    if row["kind"] != "matmul":
        return row["bytes"]
    return row["bytes"] + split_k_bytes(tiling, row["m"], row["k"], row["n"])


def size_text(nbytes: float) -> str:
    """Bytes as the profile's notes and report write them (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"
