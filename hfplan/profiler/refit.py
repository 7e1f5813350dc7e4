"""A measured profile fitted again from its raw measurements (`hfplan profile --refit`), with this version's fits.

`hfplan profile` writes the profile and, beside it, every measurement it fitted the profile from (the CSV). A new
version of the cost model prices kernels, fixed costs or collectives differently, so the fixed costs fitted beyond
them change too; refitting the same measurements gives the profile this version would have written, without
measuring the machine again (a machine whose speed drifts between takes, a GPU cluster that is busy). The
measurements are the CSV's rows; what is not a row comes from the profile itself: the device (its name, kind,
world and threads, as its description states them), its memory capacity and reserve, the worker's resident memory
and the date it was measured; what the profile carried over unmeasured comes from its base profile as it is now
(the shipped one it names, or --base). Nothing here imports torch.
"""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path

import pandas as pd

from hfplan.errors import HfplanError
from hfplan.profiler import layers, runtime
from hfplan.profiler.device import Device, nominal_rates
from hfplan.profiler.run import (
    PACE_OPS,
    WORKER_MEMORY,
    Result,
    fit_measurements,
    frame_of,
    predicted_layers,
    with_runtime,
)
from hfplan.profiles.hardware import GIB, HardwareProfile, load_hardware
from hfplan.profiles.models import resolve_model

# What build_profile writes at the head of a measured profile's description: "<world> x <device name> (<kind>,
# <backend>; <versions>)".
MEASURED_ON = re.compile(r"^Measured by hfplan profile on (\d+) x (.+?) \((cpu|cuda), (?:gloo|nccl); ([^)]*)\)")
THREADS = re.compile(r", (\d+) CPU thread\(s\) per process")
BASE = re.compile(r"carried over from base profile '([^']+)'")
# Columns of whole numbers (shapes, counts, ranks), read back as such where a row has them.
WHOLE = ("m", "k", "n", "world", "batch", "seq", "context", "tp", "tokens", "heads", "kv_heads", "hidden", "ffn",
         "scale")


def read_rows(csv_path: Path) -> list[dict]:
    """The raw measurements of a profile's CSV, each row without its empty cells."""
    if not csv_path.is_file():
        raise HfplanError(f"{csv_path}: no raw measurements beside the profile (hfplan profile writes them there)")
    try:
        frame = pd.read_csv(csv_path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise HfplanError(f"{csv_path}: not a profile's raw measurements ({' '.join(str(error).split())})") from None
    missing = {"kind", "op", "seconds"} - set(frame.columns)
    if missing:
        raise HfplanError(f"{csv_path}: not a profile's raw measurements (no column {', '.join(sorted(missing))})")
    rows = [{k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
            for row in frame.to_dict("records")]
    return [{k: int(v) if k in WHOLE else v for k, v in row.items()} for row in rows]


def measured_device(profile: HardwareProfile) -> tuple[Device, str, str]:
    """The device `profile` was measured on, the versions it was measured with and its base profile's name, as its
    description says them."""
    head = MEASURED_ON.match(profile.description)
    if not profile.measured or head is None:
        raise HfplanError(f"profile {profile.name!r} was not written by hfplan profile (its description does not "
                          "say what it measured): nothing to refit")
    world, name, kind, versions = int(head.group(1)), head.group(2), head.group(3), head.group(4)
    threads = THREADS.search(profile.description)
    base = BASE.search(profile.description)
    device = Device(kind=kind, name=name, world_size=world, count=profile.gpus_per_node,
                    threads=int(threads.group(1)) if threads else 1, cache_bytes=0,
                    capacity_bytes=profile.memory.capacity_gib * GIB, used_bytes=0.0,
                    nominal=nominal_rates(name, kind),
                    sm_count=profile.compute.gemm.sm_count if profile.compute.gemm is not None else None,
                    cache_share_bytes=profile.compute.cache_bytes)
    return device, versions, base.group(1) if base else device.nominal.base


def refit_profile(profile: HardwareProfile, rows: list[dict], name: str, base: str | None = None) -> Result:
    """`profile` fitted again from its raw `rows` by this version of hfplan, named `name` (base: the profile whose
    unmeasured fields are carried over; by default the one `profile` names)."""
    device, versions, base_name = measured_device(profile)
    try:
        base_profile = load_hardware(base or base_name)
    except HfplanError as error:
        raise HfplanError(f"{error} (the base profile it was measured against; name one with --base)") from None
    for kind in ("matmul", "memory"):
        if not any(r.get("kind") == kind for r in rows):
            raise HfplanError(f"the raw measurements hold no {kind} rows: not a profile's measurements")
    measured = [r for r in rows if r["kind"] not in ("runtime", "layer", "pace")]
    fitted, fits = fit_measurements(measured, device, base_profile, name, versions)
    # The memory the profile measured (what a plan's fit and the probes' plans read), before anything is fitted on it.
    fitted = fitted.model_copy(update={"memory": fitted.memory.model_copy(update={
        "capacity_gib": profile.memory.capacity_gib, "reserved_gib": profile.memory.reserved_gib})})
    inputs = runtime.RuntimeMeasurements.from_rows(rows, fitted, device.kind == "cpu",
                                                   WORKER_MEMORY in profile.description,
                                                   profile.memory.worker_resident_gib)
    fitted, runtime_rows = with_runtime(fitted, runtime.fit_runtime(fitted, inputs), base_profile, device)
    today = datetime.date.today().isoformat()
    fitted = fitted.model_copy(update={
        "date": profile.date,
        "description": fitted.description + f" Refitted from its raw measurements (taken {profile.date}) on {today}."})
    layer_rows = [r for r in rows if r["kind"] == "layer"]
    plan = _layer_plan(layer_rows)
    pace_rows = {r["op"]: r["seconds"] for r in rows if r["kind"] == "pace"}
    pace_s = tuple(pace_rows[op] for op in PACE_OPS) if set(PACE_OPS) <= set(pace_rows) else None
    out = measured + runtime_rows + predicted_layers(fitted, plan.arch, layer_rows) \
        + [r for r in rows if r["kind"] == "pace"]
    return Result(profile=fitted, measurements=frame_of(out), fits=fits, layers=plan, device=device, pace_s=pace_s)


def _layer_plan(layer_rows: list[dict]) -> layers.LayerPlan:
    """The layer the rows measured (its catalog model scaled down as they say), for their predictions."""
    if not layer_rows:
        raise HfplanError("the raw measurements hold no layer rows: not a profile's measurements")
    first = layer_rows[0]
    source = resolve_model(str(first["model"]))
    scale = int(first.get("scale", 1))
    arch = layers.scaled(source, scale)
    if arch is None:
        raise HfplanError(f"the layer rows' model {source.name} does not scale down {scale}x")
    return layers.LayerPlan(arch=arch, source=source, scale=scale, cases=tuple(map(layers.Case.of_row, layer_rows)),
                            copies=0)
