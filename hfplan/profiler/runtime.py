"""Fixed costs the kernels do not show (HardwareProfile.runtime), measured on the executor's own engines.

Each is what one unit of work takes beyond what the cost model charges for its kernels on the profile just
fitted: a sampled decode step of the executor's torch rollout engine with static batching (of one sequence and of
BATCH: the fixed cost per step and per sequence in it) and with continuous batching (the slope of generation time
over decode steps, so the prefills drop out), a training micro-batch and an optimizer step of the executor's
training engine (the slope of a step's time over its micro-batches, and what is left at none) and a log-prob call
through it, as it trains on one rank and, across the profiled world (every rank computing at once), wrapped in
FSDP2, split by tensor parallelism (there, also the rollout engine's decode step over the tensor-parallel
group, as the executor generates in that layout: what each of its collectives costs whole) and in pipeline stages
(with its switch resharded by plan); per token of a
micro-batch (one sequence against BATCH, on one rank); the hybrid engine's switch on one rank, a Ray worker's own
resident memory, and what the executor's calls cost between their spans and its controller's advantage step
(call_gaps: read off a short run of the executor). On CPU, first each decoder layer's fixed cost: a log-prob call, a
training micro-batch and a decode step of the demo model at its depth and at DEEP times it, beyond their kernels,
per layer added, and the same of the log-prob call and training micro-batch wrapped in FSDP2 and split by tensor
parallelism, on top; every other fixed cost is then fitted beyond the kernels and those.
torch and ray are passed in or imported here, only when `hfplan profile` runs.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.layout import shape_problem, stage_parameter_tensors, trains_through_fsdp
from hfplan.measure import typical
from hfplan.plan import GenConfig, InferConfig, Layout, TrainConfig
from hfplan.profiler import object_store
from hfplan.profiler.call_gaps import CallGaps, measure_call_gaps
from hfplan.profiler.compute import compute_dtype
from hfplan.profiler.device import Device
from hfplan.profiler.sweeps import ENGINE_REPS
from hfplan.profiler.timing import Clock
from hfplan.profiles.hardware import HardwareProfile, Link, Runtime
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs

MODEL = "tiny"  # the demo model: its kernels are tiny, so what it takes is mostly the fixed cost
PROMPT = 8
SHORT, LONG = 2, 34  # response lengths whose time difference is LONG - SHORT decode steps
PROBE_CONTEXT = PROMPT + (SHORT + LONG) / 2  # the mean context of those decode steps, as the model prices them
BATCH = 8  # sequences of the larger static batch whose steps are timed (the demo's batch)
WIDE = 4 * BATCH  # and of a wide one (the per-sequence cost beyond BATCH: Runtime.engine_wide_sequence_step_us)
FEW, MANY = 1, 3  # micro-batches (of one sequence) per optimizer step: the difference is MANY - FEW passes
DEEP = 4  # the demo model timed again with its decoder layers this many times over: the difference is per layer
# (in every engine mode timed at two depths: from 2 and 4 layers, the split engine's per-layer figures moved by 2x
# between two profiles minutes apart on the project's VM)
DEEP_LAYERS = DEEP * CATALOG[MODEL].layers
ROUNDS = 3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeFit:
    runtime: Runtime
    rows: list[dict]
    ray: bool  # whether the executor's calls were measured (through Ray; else the engines timed here)
    worker_resident_gib: float = 0.0  # a Ray worker's own resident memory, measured with them
    object_store: Link | None = None  # Links.object_store, measured through Ray


def cpu_probe(torch):
    """The engine and prompt the CPU probes time (the machine's pace, the host's sharing, the wake after a wait):
    the rollout engine on MODEL in fp32 and one PROMPT-token prompt. No token is -1, so a generation runs every
    token it is asked for."""
    from hfplan.executor.models import build_model
    from hfplan.executor.rollout.torch_engine import TorchRolloutEngine

    model = build_model(MODEL, "lm", seed=0, dtype=torch.float32).eval()
    return TorchRolloutEngine(model, pad_id=0, eos_id=-1), torch.randint(1, CATALOG[MODEL].vocab, (1, PROMPT))


def slope_s(few_s: float, many_s: float) -> float:
    """Seconds per micro-batch between updates of FEW and of MANY micro-batches."""
    return (many_s - few_s) / (MANY - FEW)


def fixed_us(measured_s: float, predicted_s: float) -> float:
    """Microseconds of a unit of work beyond its modelled kernels (never negative)."""
    return max(0.0, measured_s - predicted_s) * 1e6


def _row(op: str, seconds: float, predicted: float, world: int = 1) -> dict:
    """A raw runtime row; its error none where `seconds`, a difference of two timings (a slope), came out at or
    below zero on a noisy machine."""
    error = 100.0 * (predicted - seconds) / seconds if seconds > 0 else None
    return dict(kind="runtime", op=op, model=MODEL, world=world, seconds=seconds, predicted_s=predicted,
                error_pct=error)


@dataclass(frozen=True)
class EngineTimes:
    """Seconds of the executor's engines on one rank (time_engines), before the modelled kernels are taken off."""

    step: float  # a static decode step of one sequence
    batch_step: float  # of BATCH sequences
    wide_step: float  # of WIDE sequences
    continuous_step: float  # a continuous engine's, one slot refilled
    beyond_steps: float  # a static generation of one sequence beyond its decode steps (prefill, the call's own)
    plain: EngineSeconds  # the training engine as one rank trains (with its wide micro-batch and the switch)
    depths: DepthSeconds | None  # the same calls at two depths of the demo model (CPU: its host's per-layer cost)


@dataclass(frozen=True)
class DepthSeconds:
    """Seconds of the same calls on the demo model with its own decoder layers and with DEEP times as many (each
    pair: (its own depth, the deeper)): a log-prob call of one sequence and a training micro-batch of one sequence
    (the slope of an actor update's time from FEW to MANY micro-batches, so the optimizer step drops out) through
    the training engine as one rank trains, and a static decode step of one sequence."""

    layers: tuple[int, int]
    log_prob: tuple[float, float]
    train_pass: tuple[float, float]
    step: tuple[float, float]


def depth_seconds(torch, device: Device, min_time: float, plain: EngineSeconds) -> DepthSeconds:
    """Time DepthSeconds' decode steps, the two depths alternating within each round; the training engine's calls
    are `plain`'s (engine_seconds times them at both depths in the same rounds, so the shallower are the very
    timings the engine's other fixed costs are fitted from)."""
    from hfplan.executor.models import build_model
    from hfplan.executor.rollout.torch_engine import TorchRolloutEngine

    arch = CATALOG[MODEL]
    layers = (arch.layers, DEEP_LAYERS)
    engines = [TorchRolloutEngine(build_model(MODEL, "lm", seed=0, dtype=compute_dtype(device), layers=n)
                                  .to(device.kind).eval(), pad_id=0, eos_id=-1) for n in layers]
    prompts = torch.randint(1, arch.vocab, (1, PROMPT), device=device.kind)
    steps = steps_seconds(Clock(torch, device.kind), [(engine, prompts) for engine in engines], min_time)
    return DepthSeconds(layers, (plain.log_prob, plain.deep[0]), (plain.pass_s, plain.deep_pass_s),
                        (steps[0], steps[1]))


def _layer_fixed(bare: HardwareProfile, depths: DepthSeconds) -> tuple[Runtime, list[dict]]:
    """The fixed costs per decoder layer (Runtime.layer_forward_us, layer_train_us, layer_step_us): what each of
    DepthSeconds' calls took beyond its modelled kernels at the deeper depth less at its own, over the layers
    between them."""
    one, tokens = costs.SetShape(1, 1), PROMPT + LONG
    archs = [_demo_arch(n) for n in depths.layers]

    def train_pass(arch) -> float:  # a step of MANY micro-batches less one of FEW, per micro-batch between them
        step = {n: costs.train_step_time(bare, arch, TrainConfig(micro_batch=1), one, n, tokens, "lm")
                for n in (FEW, MANY)}
        return slope_s(step[FEW], step[MANY])

    models = {"log_prob": [costs.inference_time(bare, a, InferConfig(micro_batch=1), one, 1, tokens, "lm")
                           for a in archs],
              "train_pass": [train_pass(a) for a in archs],
              "step": [costs.decode_step_time(bare, a, Layout(), one, 1, PROBE_CONTEXT) for a in archs]}
    added = depths.layers[1] - depths.layers[0]
    per_layer, rows = {}, []
    for name, (shallow_model, deep_model) in models.items():
        shallow, deep = getattr(depths, name)
        per_layer[name] = max(0.0, (deep - shallow) - (deep_model - shallow_model)) * 1e6 / added
        rows += [_row(depth_op(name, n), seconds, model)
                 for n, seconds, model in zip(depths.layers, (shallow, deep), (shallow_model, deep_model),
                                              strict=True)]
    return Runtime(layer_forward_us=round(per_layer["log_prob"], 2), layer_train_us=round(per_layer["train_pass"], 2),
                   layer_step_us=round(per_layer["step"], 2)), rows


def time_engines(torch, device: Device, min_time: float, engine_reps: int) -> EngineTimes:
    """Time the rollout engine, the training engine on a world of this process alone and the hybrid engine's
    switch, here (in the process that calls this)."""
    from hfplan.executor.models import build_model
    from hfplan.executor.rollout.torch_engine import TorchRolloutEngine

    clock = Clock(torch, device.kind)
    model = build_model(MODEL, "lm", seed=0, dtype=compute_dtype(device)).to(device.kind).eval()
    prompts = torch.randint(1, CATALOG[MODEL].vocab, (1, PROMPT), device=device.kind)
    # No token is -1: every response runs its length. The continuous engine has one slot for two prompts, so
    # it refills the slot (a batch of one every step, as the static engine's).
    static = TorchRolloutEngine(model, pad_id=0, eos_id=-1)
    continuous = TorchRolloutEngine(model, pad_id=0, eos_id=-1, batching="continuous", max_batch=1)
    single, batch, wide, continuous_case = generations_seconds(
        clock, [(static, prompts), (static, prompts.repeat(BATCH, 1)), (static, prompts.repeat(WIDE, 1)),
                (continuous, prompts.repeat(2, 1))], min_time)
    plain = _engine_on_one_rank(torch, device, PLAIN, engine_reps)
    return EngineTimes(step=single.step, batch_step=batch.step, wide_step=wide.step,
                       continuous_step=continuous_case.step,
                       beyond_steps=single.beyond_steps, plain=plain,
                       depths=depth_seconds(torch, device, min_time, plain) if device.kind == "cpu" else None)


@dataclass(frozen=True)
class RuntimeMeasurements:
    """What the Runtime fields are fitted from (fit_runtime): measured here (measure_runtime_inputs) or read back
    from a profile's raw rows (from_rows, for `hfplan profile --refit`)."""

    engines: EngineTimes  # the engines on one rank
    across: dict[str, EngineSeconds]  # by mode: FSDP always (over one rank where no world was profiled), TP, PP
    gaps: CallGaps | None  # the executor's call gaps (None: not measured)
    object_store: list[dict]  # tensors handed between two Ray workers (steps, moved_bytes, seconds); [] if not
    ray: bool  # whether the engines on one rank were timed in a Ray worker
    worker_resident_gib: float = 0.0  # that worker's own resident memory (0: not measured)

    @classmethod
    def from_rows(cls, rows: list[dict], profile: HardwareProfile, on_cpu: bool, ray: bool,
                  worker_resident_gib: float) -> RuntimeMeasurements:
        """The measurements behind a profile's runtime rows (the rows fit_runtime writes, as the profile's CSV
        holds them), `profile` its fitted rates (to make the weight-sync probe's plan again, as the profile did);
        `on_cpu`, `ray` and `worker_resident_gib` as the profile measured them (not rows). Raises HfplanError
        naming a row the measurement always writes that is missing (the call gaps' probe and the object store's
        may have failed and left theirs out)."""
        runtime_rows = [r for r in rows if r.get("kind") == "runtime"]
        by_op = {r["op"]: r for r in runtime_rows}

        def seconds(op: str) -> float:
            if op not in by_op:
                raise HfplanError(f"no runtime row {op!r} (measured by another version of hfplan profile?)")
            return float(by_op[op]["seconds"])

        def optional(op: str) -> float | None:
            return seconds(op) if op in by_op else None

        plain = EngineSeconds(1, PLAIN, {n: seconds(train_step_op(PLAIN, n)) for n in (FEW, MANY)},
                              seconds(log_prob_op(PLAIN)), seconds(switch_op(PLAIN)),
                              wide=(seconds(WIDE_OPS[0]), seconds(WIDE_OPS[1])), kept_switch=seconds(KEPT_SWITCH_OP))
        depths = None
        if on_cpu:  # time_engines times the demo model at two depths on CPU only
            layers = (CATALOG[MODEL].layers, DEEP_LAYERS)
            depths = DepthSeconds(layers, *(tuple(seconds(depth_op(name, n)) for n in layers)
                                            for name in ("log_prob", "train_pass", "step")))
        step, batch_step, wide_step, continuous_step = (seconds(op) for op in STEP_OPS)
        engines = EngineTimes(step, batch_step, wide_step, continuous_step, seconds(GENERATE_CALL_OP), plain, depths)
        across = {}
        for mode in (FSDP, TP, PP):
            if log_prob_op(mode) not in by_op:
                continue
            world = int(by_op[log_prob_op(mode)]["world"])
            # engine_seconds times the deeper model on CPU across a world, and the split decode steps in TP
            deeper = on_cpu and mode in (FSDP, TP) and world > 1
            deep = (log_prob_op(mode, DEEP_LAYERS), *(train_step_op(mode, n, DEEP_LAYERS) for n in (FEW, MANY)))
            across[mode] = EngineSeconds(world, mode, {n: seconds(train_step_op(mode, n)) for n in (FEW, MANY)},
                                         seconds(log_prob_op(mode)), seconds(switch_op(mode)),
                                         deep=tuple(seconds(op) for op in deep) if deeper else None,
                                         split_steps=tuple(seconds(op) for op in SPLIT_STEP_OPS) if mode == TP
                                         else None)
        if FSDP not in across:
            raise HfplanError(f"no runtime row {log_prob_op(FSDP)!r} (measured by another version of hfplan profile?)")
        gaps = None
        if "call_dispatch" in by_op:
            weight_sync_s = optional("weight_sync")
            plan = None
            if weight_sync_s is not None:
                from hfplan.profiler.call_gaps import rollout_probe_plan

                with tempfile.TemporaryDirectory(prefix="hfplan-refit-") as folder:
                    plan = rollout_probe_plan(profile, Path(folder))
            gaps = CallGaps(seconds("call_dispatch"), seconds("controller_call"), seconds("controller_step"),
                            seconds("controller_send"), rank_dispatch_s=optional("rank_dispatch"),
                            weight_sync_s=weight_sync_s, weight_sync_plan=plan,
                            task_dispatch_s=optional("task_dispatch"),
                            controller_task_cpu_s=optional("controller_task_cpu"))
        handed = [dict(steps=1, moved_bytes=float(r["moved_bytes"]), seconds=float(r["seconds"]))
                  for r in runtime_rows if str(r["op"]).startswith(OBJECT_STORE_PREFIX)]
        return cls(engines, across, gaps, handed, ray, worker_resident_gib if ray else 0.0)


def measure_runtime_inputs(torch, device: Device, profile: HardwareProfile, min_time: float, through_ray: bool = True,
                           across: dict[str, EngineSeconds] | None = None, engine_reps: int = ENGINE_REPS
                           ) -> RuntimeMeasurements:
    """Measure what fit_runtime fits (the module docstring's measurements). `through_ray` (and ray importable, no
    Ray session already in this process): the engines on one rank are timed where the executor runs them, in a
    Ray worker, and the executor's call gaps are measured; else the engines are timed here. `across`: the engine
    wrapped in FSDP2 and split by tensor parallelism, each timed over the profiled world (measure_collectives'
    processes, all computing at once, as a layout's ranks do) and in pipeline stages; without them, FSDP2 is
    timed over a world of one here."""
    ray_costs = _ray_worker(device, profile, min_time, engine_reps) if through_ray else None
    times = ray_costs.engines if ray_costs is not None else time_engines(torch, device, min_time, engine_reps)
    across = dict(across or {})
    if FSDP not in across:
        across[FSDP] = _engine_on_one_rank(torch, device, FSDP, engine_reps)
    if ray_costs is None:
        return RuntimeMeasurements(times, across, None, [], False)
    gaps = ray_costs.gaps
    # A worker as it runs calls, where the probe ran; else one that only imported.
    probed = gaps.worker_resident_gib if gaps is not None else None
    resident_gib = probed if probed is not None else ray_costs.resident_bytes / 2**30
    return RuntimeMeasurements(times, across, gaps, ray_costs.object_store, True, resident_gib)


def fit_runtime(profile: HardwareProfile, measured: RuntimeMeasurements) -> RuntimeFit:
    """The Runtime fields on `profile` (its rates fitted, its runtime not yet) from `measured`, with the rows
    behind them; the executor's call fields left at their defaults where the call gaps were not measured."""
    arch = CATALOG[MODEL]
    one = costs.SetShape(1, 1)
    times, across = measured.engines, measured.across
    # The executor's handover of tensors between workers (a separate rollout set's weight sync is fitted beyond
    # its bytes at that rate).
    store = object_store.object_store_link(measured.object_store)
    if store is not None:
        profile = profile.model_copy(update={"links": profile.links.model_copy(update={"object_store": store})})
    # Each decoder layer's fixed cost first (against the kernels alone): every other fixed cost is what a call
    # takes beyond its kernels and its layers' fixed costs. Only a CPU's: a GPU's host runs ahead of its kernels,
    # which the model charges instead.
    layers, layer_rows = (Runtime(), []) if times.depths is None else _layer_fixed(
        profile.model_copy(update={"runtime": Runtime()}), times.depths)
    bare = profile.model_copy(update={"runtime": layers})
    step_s, batch_s, continuous_s, plain = times.step, times.batch_step, times.continuous_step, times.plain
    step_model = costs.decode_step_time(bare, arch, Layout(), one, 1, PROBE_CONTEXT)
    batch_model = costs.decode_step_time(bare, arch, Layout(), one, BATCH, PROBE_CONTEXT)
    # A step's fixed cost grows with the sequences in it: the slope between a batch of one and of BATCH, and beyond
    # it the slope between BATCH and WIDE.
    sequence_us = max(0.0, fixed_us(batch_s, batch_model) - fixed_us(step_s, step_model)) / (BATCH - 1)
    wide_model = costs.decode_step_time(bare, arch, Layout(), one, WIDE, PROBE_CONTEXT)
    wide_us = max(0.0, fixed_us(times.wide_step, wide_model) - fixed_us(batch_s, batch_model)) / (WIDE - BATCH)
    rows = layer_rows + [_row(op, seconds, model) for op, seconds, model in zip(
        STEP_OPS, (step_s, batch_s, times.wide_step, continuous_s), (step_model, batch_model, wide_model, step_model),
        strict=True)]
    per_token = _token_fixed(bare, plain)
    rows += per_token.rows
    train = _train_fixed(bare, plain, per_token)
    # A switch in the training layout on one rank moves no weights: its time is the engines' fixed cost, per tensor.
    switch_us, switch_row = _switch_fixed(bare, plain, PLAIN)
    rows.append(switch_row)
    # The executor's own switch on one rank trained as it is: the rollout engine keeps the trained tensors.
    kept_us = None if plain.kept_switch is None else round(fixed_us(plain.kept_switch, 0.0), 2)
    rows += [] if plain.kept_switch is None else [_row(KEPT_SWITCH_OP, plain.kept_switch, 0.0)]
    fsdp = across[FSDP]
    # The wrapped and the split engines' costs per layer first (where timed at two depths), then what each pass
    # takes beyond them.
    layered, across_layers = bare, {}
    for engine in (fsdp, across.get(TP)):
        if engine is not None and engine.deep is not None:
            fields, layer_rows = _layers_across(layered, engine)
            rows += layer_rows
            across_layers.update(fields)
            layered = _with_runtime(layered, **fields)
    wrapped = _train_fixed(layered, fsdp, per_token)
    fsdp_switch_us, fsdp_switch_row = _switch_fixed(bare, fsdp, FSDP)
    rows.append(fsdp_switch_row)
    rows += train.rows + wrapped.rows
    # Tensor parallelism's costs on top of those of the engine it splits (one data-parallel rank): only where
    # a world was profiled.
    unsplit = wrapped if trains_through_fsdp(1, bare.compute.value_bytes) else train
    split = _train_fixed(layered, across[TP], per_token) if TP in across else unsplit
    rows += split.rows if TP in across else []
    tp_switch_us = 0.0
    if TP in across:
        split_switch_us, split_switch_row = _switch_fixed(bare, across[TP], TP)
        rows.append(split_switch_row)
        tp_switch_us = max(0.0, split_switch_us - (fsdp_switch_us if trains_through_fsdp(1, bare.compute.value_bytes)
                                                   else switch_us))
    gaps = measured.gaps
    if gaps is not None:
        rows += [_row("controller_step", gaps.controller_step_s, 0.0),
                 _row("controller_call", gaps.controller_call_s, 0.0), _row("call_dispatch", gaps.call_dispatch_s, 0.0),
                 _row("controller_send", gaps.controller_send_s, 0.0)]
        if gaps.task_dispatch_s is not None:
            rows.append(_row("task_dispatch", gaps.task_dispatch_s, 0.0))
        if gaps.controller_task_cpu_s is not None:
            rows.append(_row("controller_task_cpu", gaps.controller_task_cpu_s, 0.0))
        if gaps.rank_dispatch_s is not None:
            rows.append(_row("rank_dispatch", gaps.rank_dispatch_s, 0.0, world=2))
    runtime = layers.model_copy(update=dict(
                      forward_pass_us=round(train.forward_us, 2), forward_token_us=round(per_token.forward_us, 3),
                      train_token_us=round(per_token.train_us, 3),
                      engine_step_us=round(max(0.0, fixed_us(step_s, step_model) - sequence_us), 2),
                      engine_sequence_step_us=round(sequence_us, 2), engine_wide_sequences=BATCH,
                      engine_wide_sequence_step_us=round(wide_us, 2), switch_tensor_us=round(switch_us, 3),
                      kept_switch_us=kept_us,
                      fsdp_switch_tensor_us=round(fsdp_switch_us, 3), tp_switch_tensor_us=round(tp_switch_us, 3),
                      controller_call_us=round(gaps.controller_call_s * 1e6, 2) if gaps else 0.0,
                      call_dispatch_us=round(gaps.call_dispatch_s * 1e6, 2) if gaps else None,
                      task_dispatch_us=round(gaps.task_dispatch_s * 1e6, 2)
                      if gaps and gaps.task_dispatch_s is not None else None,
                      controller_task_cpu_us=round(gaps.controller_task_cpu_s * 1e6, 2)
                      if gaps and gaps.controller_task_cpu_s is not None else 0.0,
                      controller_step_us=round(gaps.controller_step_s * 1e6, 2) if gaps else 0.0,
                      controller_send_us=round(gaps.controller_send_s * 1e6, 2) if gaps else None,
                      rank_dispatch_us=round(gaps.rank_dispatch_s * 1e6, 2)
                      if gaps and gaps.rank_dispatch_s is not None else 0.0,
                      engine_step_continuous_us=round(max(0.0, fixed_us(continuous_s, step_model) - sequence_us),
                                                      2),
                      train_pass_us=round(train.pass_us, 2), optimizer_tensor_us=round(train.tensor_us, 3),
                      fsdp_forward_pass_us=round(wrapped.forward_us, 2), fsdp_train_pass_us=round(wrapped.pass_us, 2),
                      fsdp_optimizer_tensor_us=round(wrapped.tensor_us, 3),
                      tp_forward_pass_us=round(max(0.0, split.forward_us - unsplit.forward_us), 2),
                      tp_train_pass_us=round(max(0.0, split.pass_us - unsplit.pass_us), 2),
                      tp_optimizer_tensor_us=round(max(0.0, split.tensor_us - unsplit.tensor_us), 3),
                      **across_layers))
    # A generation's own fixed cost: what one of SHORT tokens took beyond its decode steps and its modelled prefill.
    prefill = costs.prefill_parts(bare.model_copy(update={"runtime": runtime}), arch, Layout(), one, 1, PROMPT).total
    rows.append(_row(GENERATE_CALL_OP, times.beyond_steps, prefill))
    runtime = runtime.model_copy(update={"generate_call_us": round(fixed_us(times.beyond_steps, prefill), 2)})
    if PP in across:
        pipelined, pipeline_rows = _pipeline_fixed(bare.model_copy(update={"runtime": runtime}), across[PP])
        rows += pipeline_rows
        runtime = runtime.model_copy(update=pipelined)
    if TP in across and across[TP].split_steps is not None:
        fitted = bare.model_copy(update={"runtime": runtime})
        collective_us, split_rows = _step_collective_fixed(fitted, across[TP])
        rows += split_rows
        runtime = runtime.model_copy(update={"step_collective_us": round(collective_us, 2)})
    if gaps is not None and gaps.weight_sync_s is not None:
        sync_us, sync_row = _weight_sync_fixed(bare.model_copy(update={"runtime": runtime}), gaps)
        rows.append(sync_row)
        runtime = runtime.model_copy(update={"weight_sync_us": round(sync_us, 2)})
    if store is not None:
        rows += [_row(f"{OBJECT_STORE_PREFIX}{int(r['moved_bytes'])}_bytes", r["seconds"],
                      object_store.handover_seconds(store, r["moved_bytes"]), world=2)
                 | {"moved_bytes": r["moved_bytes"]} for r in measured.object_store]
    return RuntimeFit(runtime, rows, measured.ray, round(measured.worker_resident_gib, 3), store)


# The training engine as one rank trains, over FSDP2 ranks, split by tp, in pipeline stages
PLAIN, FSDP, TP, PP = "plain", "fsdp", "tp", "pp"
# RoleModel's `fsdp` per mode: split by tp or pp, the engine wraps as the layout rule says (one data-parallel rank)
WRAPS_IN_FSDP = {PLAIN: False, FSDP: True, TP: None, PP: None}
SPLIT_STEP_OPS = ("tp_engine_step", f"tp_engine_step_{BATCH}_sequences")  # EngineSeconds.split_steps' rows
DEEP_OPS = ("deep_engine_log_prob", f"deep_train_step_{FEW}_micro_batches",
            f"deep_train_step_{MANY}_micro_batches")  # EngineSeconds.deep's rows (after the mode's prefix)
SPLIT_STEP_REPS = 3  # timed calls per round of steps_seconds for the split decode steps (ROUNDS rounds)
# The names of the runtime rows fit_runtime writes (and RuntimeMeasurements.from_rows reads back): the decode steps
# of one, BATCH and WIDE sequences and the continuous engine's, a generation beyond its steps, the kept switch, the
# update and log-prob call of one micro-batch of BATCH sequences, the object store's handovers by their bytes.
STEP_OPS = ("engine_step", f"engine_step_{BATCH}_sequences", f"engine_step_{WIDE}_sequences", "engine_step_continuous")
GENERATE_CALL_OP, KEPT_SWITCH_OP = "generate_call", "kept_hybrid_switch"
WIDE_OPS = (f"train_step_1_micro_batch_of_{BATCH}", f"engine_log_prob_{BATCH}_sequences")
OBJECT_STORE_PREFIX = "object_store_"


def mode_prefix(mode: str) -> str:
    return "" if mode == PLAIN else f"{mode}_"


def _of_depth(layers: int | None) -> str:
    return "" if layers is None else f"_{layers}_layers"


def train_step_op(mode: str, micro_batches: int, layers: int | None = None) -> str:
    """The row of an update of `micro_batches` micro-batches in `mode` (of the demo model with `layers` layers)."""
    return f"{mode_prefix(mode)}train_step_{micro_batches}_micro_batches{_of_depth(layers)}"


def log_prob_op(mode: str, layers: int | None = None) -> str:
    return f"{mode_prefix(mode)}engine_log_prob{_of_depth(layers)}"


def switch_op(mode: str) -> str:
    return f"{mode_prefix(mode)}hybrid_switch"


def depth_op(call: str, layers: int) -> str:
    """The row of DepthSeconds' `call` (log_prob, train_pass, step) at `layers` layers."""
    return f"depth_{call}{_of_depth(layers)}"


@dataclass(frozen=True)
class EngineSeconds:
    """Seconds of the training engine in `mode` over a world of `world` ranks: an actor update (one optimizer
    step) on FEW and MANY micro-batches of one sequence per data-parallel rank, and a log-prob call of one
    sequence per data-parallel rank."""

    world: int
    mode: str  # PLAIN, FSDP, TP or PP
    steps: dict[int, float]
    log_prob: float
    switch: float  # the hybrid engine's switch into generation and back, in the training layout, weights handed over
    wide: tuple[float, float] | None = None  # PLAIN only: (actor update, log-prob call) of one micro-batch of BATCH
    kept_switch: float | None = None  # PLAIN only: the same switch generating with the trained tensors themselves
    # On CPU only (PLAIN, and FSDP and TP over several ranks): a log-prob call and the updates of FEW and MANY
    # micro-batches of the demo model with DEEP_LAYERS decoder layers, timed in the same rounds as the others
    deep: tuple[float, float, float] | None = None
    split_steps: tuple[float, float] | None = None  # TP only: a decode step of one and of BATCH sequences, the
    # rollout engine generating over the tensor-parallel group in the training layout (as the executor does)

    @property
    def pass_s(self) -> float:
        """Seconds a training micro-batch adds to an update (FEW to MANY: the optimizer step drops out)."""
        return slope_s(self.steps[FEW], self.steps[MANY])

    @property
    def prefix(self) -> str:
        return mode_prefix(self.mode)

    @property
    def deep_pass_s(self) -> float:
        """pass_s of the deeper model (deep)."""
        _, few, many = self.deep
        return slope_s(few, many)

    def rows(self) -> list[dict]:
        """As raw profile rows (kind `engine`), for the parent process to turn into runtime rows."""
        return ([dict(kind="engine", op=train_step_op(self.mode, n), world=self.world, mode=self.mode, seconds=s)
                 for n, s in self.steps.items()]
                + [dict(kind="engine", op=log_prob_op(self.mode), world=self.world, mode=self.mode,
                        seconds=self.log_prob),
                   dict(kind="engine", op=switch_op(self.mode), world=self.world, mode=self.mode,
                        seconds=self.switch)]
                + [dict(kind="engine", op=op, world=self.world, mode=self.mode, seconds=s)
                   for op, s in zip(SPLIT_STEP_OPS, self.split_steps or (), strict=False)]
                + [dict(kind="engine", op=f"{self.prefix}{op}", world=self.world, mode=self.mode, seconds=s)
                   for op, s in zip(DEEP_OPS, self.deep or (), strict=False)])

    @classmethod
    def from_rows(cls, rows: list[dict]) -> dict[str, EngineSeconds]:
        """The engines' measurements among raw rows (from measure_collectives' worlds), by mode."""
        out = {}
        for mode in (FSDP, TP, PP):
            by_op = {r["op"]: r for r in rows if r.get("kind") == "engine" and r["mode"] == mode}
            if by_op:
                steps = {n: by_op[train_step_op(mode, n)]["seconds"] for n in (FEW, MANY)}
                log_prob = by_op[log_prob_op(mode)]
                split = tuple(by_op[op]["seconds"] for op in SPLIT_STEP_OPS if op in by_op)
                deep = tuple(by_op[f"{mode}_{op}"]["seconds"] for op in DEEP_OPS if f"{mode}_{op}" in by_op)
                out[mode] = cls(int(log_prob["world"]), mode, steps, log_prob["seconds"],
                                by_op[switch_op(mode)]["seconds"],
                                deep=deep if len(deep) == len(DEEP_OPS) else None,
                                split_steps=split if len(split) == len(SPLIT_STEP_OPS) else None)
        return out


def splits_by_tp(world: int) -> bool:
    """Whether the demo model trains split by tensor parallelism over the whole world (its KV heads, heads, MLP
    width and vocabulary divide by it): where not, no tensor-parallel engine is timed."""
    return world > 1 and shape_problem(CATALOG[MODEL], "train", world, 1) is None


def splits_by_pp(world: int) -> bool:
    """Whether the demo model trains in pipeline stages over the whole world (one stage a rank: the world divides
    its decoder layers): where not, no pipelined engine is timed."""
    return world > 1 and CATALOG[MODEL].layers % world == 0


def world_modes(world: int) -> tuple[str, ...]:
    """The engine modes timed across a profiled world of `world` ranks (every rank computing at once)."""
    return (FSDP, *((TP,) if splits_by_tp(world) else ()), *((PP,) if splits_by_pp(world) else ()))


def profiled_role(torch, kind: str, mode: str, layers: int | None = None):
    """The training engine (RoleModel) of the demo model (with `layers` decoder layers: its own by default) in
    `mode` over the process group this process is in."""
    import torch.distributed as dist

    from hfplan.executor.engines.training import RoleModel
    from hfplan.executor.mesh import ParallelDims, compute_dtype
    from hfplan.executor.models import build_model
    from hfplan.hyperparams import Hyperparameters

    world = dist.get_world_size()
    dims = {TP: ParallelDims(1, 1, 1, world), PP: ParallelDims(world, 1, 1, 1)}.get(mode, ParallelDims(1, 1, world, 1))
    mesh = dims.build(kind)
    model = build_model(MODEL, "lm", seed=0, dtype=torch.float32, layers=layers)
    return RoleModel(model, mesh, Hyperparameters(), kind, compute_dtype(kind), pad_id=0, lr=1e-6,
                     fsdp=WRAPS_IN_FSDP[mode])


def engine_seconds(torch, kind: str, mode: str, reps: int) -> EngineSeconds:
    """Time the executor's training engine on the process group this process is in (every rank calls this):
    each measurement the median of `reps` calls, each call the slowest rank's (a collective ends with its
    slowest rank)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    role = profiled_role(torch, kind, mode)

    calls = [_update_call(torch, role, FEW, 1), _update_call(torch, role, MANY, 1), log_prob_call(torch, role, 1),
             _switch(role, keep_trained=False, layouts=pipeline_switch(world) if mode == PP else None)]
    if mode == PLAIN:
        calls += [_update_call(torch, role, BATCH, BATCH), log_prob_call(torch, role, BATCH), _switch(role)]
    # The same calls of a deeper model, in the same rounds: the difference is the layers' own (on CPU; across a
    # world: FSDP2 over one rank in fp32 is not how a plan trains, which wraps only over several)
    deeper = kind == "cpu" and (mode == PLAIN or (mode in (FSDP, TP) and world > 1))
    if deeper:
        deep = profiled_role(torch, kind, mode, layers=DEEP_LAYERS)
        calls += [log_prob_call(torch, deep, 1), _update_call(torch, deep, FEW, 1), _update_call(torch, deep, MANY, 1)]
    # Every call timed in the same rounds (WorldClock.per_calls).
    timed = WorldClock(torch, kind, reps).per_calls(calls)
    few, many, one, switch = timed[:4]
    steps, deep_calls = {FEW: few, MANY: many}, tuple(timed[-len(DEEP_OPS):]) if deeper else None
    if mode == TP:
        return EngineSeconds(world, mode, steps, one, switch, deep=deep_calls,
                             split_steps=_split_steps(torch, kind, role))
    if mode != PLAIN:
        return EngineSeconds(world, mode, steps, one, switch, deep=deep_calls)
    wide_update, wide_log_prob, kept_switch = timed[4:7]
    return EngineSeconds(world, mode, steps, one, switch, (wide_update, wide_log_prob), kept_switch,
                         deep=deep_calls)


def _update_call(torch, role, n: int, micro: int):
    """An actor update (one optimizer step) of `role` over n sequences of PROMPT + LONG tokens, micro-batches of
    `micro`."""
    vocab = CATALOG[MODEL].vocab
    batch = {"prompts": torch.randint(1, vocab, (n, PROMPT)), "responses": torch.randint(1, vocab, (n, LONG)),
             "response_mask": torch.ones(n, LONG, dtype=torch.long),
             "old_log_probs": torch.zeros(n, LONG), "advantages": torch.ones(n, LONG)}
    return lambda: role.update_actor(batch, mini_batches=1, epochs=1, micro_batch=micro, use_kl_loss=False)


def log_prob_call(torch, role, n: int):
    """A log-prob call of `role` over n sequences of PROMPT + LONG tokens, in one micro-batch (the profile's, and
    the split engine probe's: hfplan.profiler.pace)."""
    vocab = CATALOG[MODEL].vocab
    rows = {"prompts": torch.randint(1, vocab, (n, PROMPT)), "responses": torch.randint(1, vocab, (n, LONG)),
            "response_mask": torch.ones(n, LONG, dtype=torch.long)}
    return lambda: role.log_probs(**rows, micro_batch=n)


def _switch_fixed(bare: HardwareProfile, measured: EngineSeconds, mode: str) -> tuple[float, dict]:
    """Microseconds per parameter tensor of a switch in the training layout beyond its modelled collectives,
    and its row: over `measured.world` ranks, data-parallel (PLAIN over one rank, FSDP) or split by tp."""
    arch, world = CATALOG[MODEL], measured.world
    train = TrainConfig(tp=world) if mode == TP else TrainConfig(dp=world)
    gen = GenConfig(tp=world) if mode == TP else GenConfig(dp=world)
    model = costs.transition_time(bare, arch, train, gen, costs.SetShape(world, world))
    per_tensor_us = fixed_us(measured.switch, model) / stage_parameter_tensors(arch, 1, "lm")
    return per_tensor_us / bare.compute.host_slowdown(world), _row(switch_op(mode), measured.switch, model, world)


def pipeline_switch(world: int) -> tuple[TrainConfig, GenConfig]:
    """The switch timed of the engine in pipeline stages over `world` ranks: into generation on every rank alone,
    as a pipelined actor of the search's colocated plans generates (resharded by plan)."""
    return TrainConfig(pp=world), GenConfig(dp=world)


def _switch(role, keep_trained: bool = True, layouts: tuple[TrainConfig, GenConfig] | None = None):
    """One switch of the hybrid engine over `role` in its training layout (or by `layouts`, resharded by plan), as
    a call: the rollout engine given the generation weights, then released, and the engine back in training
    (executor.runtime's generate). keep_trained=False: the weights are handed over at every switch even where
    the executor keeps them (the rollout engine's cost per tensor, which a weight sync and every other switch
    pay)."""
    from hfplan.executor.engines.hybrid import HybridEngine

    hybrid, engine = HybridEngine(role, layouts, keep_trained=keep_trained), _rollout_engine(role)

    def switch() -> None:
        engine.load_weights(hybrid.enter_generation(), presharded=hybrid.presharded)
        engine.release_weights()
        hybrid.exit_generation()

    return switch


def _rollout_engine(role):
    """A rollout engine for the hybrid engine over `role`, as the executor builds it in the training layout: split by
    tensor parallelism, it generates over the role's tensor-parallel group and takes its weight shards as they are
    (one without the group would gather every tensor whole)."""
    from hfplan.executor.mesh import TP as TP_DIM
    from hfplan.executor.rollout.torch_engine import TorchRolloutEngine

    group = role.mesh[TP_DIM].get_group() if role.dims.tp > 1 else None
    return TorchRolloutEngine(None, pad_id=0, eos_id=-1, tp_group=group)


def _split_steps(torch, kind: str, role) -> tuple[float, float]:
    """Seconds per decode step of the rollout engine split by tensor parallelism over `role`'s group, for one and
    for BATCH sequences (steps_seconds, each timing every rank's same calls, the slowest rank's)."""
    from hfplan.executor.engines.hybrid import HybridEngine

    hybrid, engine = HybridEngine(role, keep_trained=False), _rollout_engine(role)
    prompts = torch.randint(1, CATALOG[MODEL].vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(kind)
    engine.load_weights(hybrid.enter_generation(), presharded=hybrid.presharded)
    try:
        one, batch = steps_seconds(WorldClock(torch, kind, SPLIT_STEP_REPS),
                                   [(engine, prompts), (engine, prompts.repeat(BATCH, 1))], 0.0)
    finally:
        engine.release_weights()
        hybrid.exit_generation()
    return one, batch


class WorldClock:
    """Timing of a call that every rank of this process group makes at once: `reps` calls after a warm-up, the
    ranks meeting before each, each call the slowest rank's time (a collective ends with its slowest rank), the
    median kept. Its count is fixed, so every rank makes the same collectives (an adaptive count, as
    Clock.per_call sizes its loop on one rank's time, would differ between ranks and leave a collective unmatched)."""

    def __init__(self, torch, kind: str, reps: int) -> None:
        self.torch, self.kind, self.reps = torch, kind, reps
        self.clock = Clock(torch, kind)

    def per_call(self, fn, min_time: float = 0.0) -> float:
        """Seconds per call of fn (`min_time` is not used: the count is fixed)."""
        return self.per_calls([fn])[0]

    def per_calls(self, fns: list) -> list[float]:
        """Seconds per call of each of fns, timed in interleaved rounds (one call of each per round): a machine
        whose speed moves by the second (a VM's host) stretches every one of them alike, so the differences the
        runtime's fits take between them (more micro-batches against fewer, a call against its parts) hold."""
        import torch.distributed as dist

        for fn in fns:
            fn()  # warm-up
        seconds: list[list[float]] = [[] for _ in fns]
        for _ in range(self.reps):
            for fn, taken in zip(fns, seconds, strict=True):
                dist.barrier()
                self.clock.sync()
                start = time.perf_counter()
                fn()
                self.clock.sync()
                took = self.torch.tensor([time.perf_counter() - start], dtype=self.torch.float64, device=self.kind)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                taken.append(float(took.item()))
        return [typical(taken) for taken in seconds]


def _weight_sync_fixed(fitted: HardwareProfile, gaps: CallGaps) -> tuple[float, dict]:
    """Microseconds of the rollout probe's weight sync beyond what the simulator prices of it on `fitted` (the
    engines' cost per tensor, the bytes' transfer) with no fixed cost of its own (Runtime.weight_sync_us), and its
    row."""
    from hfplan.dataflow.registry import ROLLOUT
    from hfplan.simulator.mapping import PlanCosts

    plan = gaps.weight_sync_plan
    bare = fitted.model_copy(update={"runtime": fitted.runtime.model_copy(update={"weight_sync_us": 0.0})})
    modelled = PlanCosts.of_plan(plan, bare).switch_seconds(ROLLOUT)
    return fixed_us(gaps.weight_sync_s, modelled), _row("weight_sync", gaps.weight_sync_s, modelled, world=2)


def _step_collective_fixed(fitted: HardwareProfile, measured: EngineSeconds) -> tuple[float, list[dict]]:
    """Microseconds of each tensor-parallel collective of a generation step (Runtime.step_collective_us, in place
    of the link's latency), and its rows: the rollout engine's decode steps split over `measured.world` ranks (of
    one and of BATCH sequences), each the value at which its modelled step on `fitted` (the unsplit engine's fixed
    costs fitted, the host's sharing and the link's term for the bytes in it) meets the timing; the mean of the
    two. The rows compare the timings with the step as the link's model alone prices its collectives."""
    arch, world = CATALOG[MODEL], measured.world
    where = costs.SetShape(world, world)
    cases = list(zip((1, BATCH), measured.split_steps, SPLIT_STEP_OPS, strict=True))

    def step(batch: int, collective_us: float | None) -> float:
        hw = _with_runtime(fitted, tp_step_collective_us=0.0, step_collective_us=collective_us)
        return costs.decode_step_time(hw, arch, Layout(tp=world), where, batch, PROBE_CONTEXT)

    per_collective = [_linear_fixed_us(seconds, lambda us, batch=batch: step(batch, us)) for batch, seconds, _ in cases]
    rows = [_row(op, seconds, step(batch, None), world) for batch, seconds, op in cases]
    return sum(per_collective) / len(per_collective), rows


PROBE_US = 1000.0  # a fixed cost set on a profile to read how much of it the model charges a call


def _with_runtime(hw: HardwareProfile, **fields: float | None) -> HardwareProfile:
    """`hw` with these runtime fields set."""
    return hw.model_copy(update={"runtime": hw.runtime.model_copy(update=fields)})


def _linear_fixed_us(measured: float, modelled) -> float:
    """The fixed cost x (us) at which `modelled(x)`, a call's modelled seconds with x in one of the profile's
    runtime fields (the model is linear in each), equals `measured` (never negative): the model itself says how
    often, and how slowed by the host's sharing, a call pays it."""
    at_zero = modelled(0.0)
    per_us = (modelled(PROBE_US) - at_zero) / PROBE_US
    return max(0.0, (measured - at_zero) / per_us) if per_us > 0 else 0.0


def _pipeline_fixed(fitted: HardwareProfile, measured: EngineSeconds) -> tuple[dict[str, float], list[dict]]:
    """Runtime.pp_train_pass_us, pp_forward_pass_us and reshard_tensor_us, and their rows: the engine in pipeline
    stages over `measured.world` ranks (one stage a rank), beyond its model on `fitted` (every other fixed cost
    fitted). A training micro-batch's from the slope of a step's time over its micro-batches (the optimizer step
    drops out), a forward's from a log-prob call of one micro-batch (each micro-batch crosses every stage, and
    the pipeline's fill and drain are the model's), a resharding switch's from the switch into generation on
    every rank alone (pipeline_switch)."""
    arch, world = CATALOG[MODEL], measured.world
    where, tokens = costs.SetShape(world, world), PROMPT + LONG
    train = TrainConfig(pp=world, micro_batch=1)

    def step(hw: HardwareProfile, n: int) -> float:
        return costs.train_step_time(hw, arch, train, where, n, tokens, "lm")

    def slope(hw: HardwareProfile) -> float:
        return slope_s(step(hw, FEW), step(hw, MANY))

    train_us = _linear_fixed_us(measured.pass_s, lambda us: slope(_with_runtime(fitted, pp_train_pass_us=us)))
    forward_us = _linear_fixed_us(measured.log_prob,
                                  lambda us: log_prob_price(_with_runtime(fitted, pp_forward_pass_us=us), PP, world))
    train_layout, gen = pipeline_switch(world)

    def switch(hw: HardwareProfile) -> float:
        return costs.transition_time(hw, arch, train_layout, gen, where)

    reshard_us = _linear_fixed_us(measured.switch, lambda us: switch(_with_runtime(fitted, reshard_tensor_us=us)))
    rows = [_row(train_step_op(PP, n), measured.steps[n], step(fitted, n), world) for n in (FEW, MANY)]
    rows += [_row(log_prob_op(PP), measured.log_prob, log_prob_price(fitted, PP, world), world),
             _row(switch_op(PP), measured.switch, switch(fitted), world)]
    return {"pp_train_pass_us": round(train_us, 2), "pp_forward_pass_us": round(forward_us, 2),
            "reshard_tensor_us": round(reshard_us, 3)}, rows


@dataclass(frozen=True)
class _TrainFixed:
    pass_us: float
    tensor_us: float
    forward_us: float
    rows: list[dict]


@dataclass(frozen=True)
class _TokenFixed:
    train_us: float
    forward_us: float
    rows: list[dict]


def _token_fixed(bare: HardwareProfile, plain: EngineSeconds) -> _TokenFixed:
    """The fixed costs per token of the engine as one rank trains: an update and a log-prob call of one
    micro-batch of BATCH sequences against the same of one sequence, each beyond its modelled kernels, over the
    tokens between them."""
    arch, one, tokens = CATALOG[MODEL], costs.SetShape(1, 1), PROMPT + LONG
    update_model = {n: costs.train_step_time(bare, arch, TrainConfig(micro_batch=n), one, n, tokens, "lm")
                    for n in (1, BATCH)}
    forward_model = {n: costs.inference_time(bare, arch, InferConfig(micro_batch=n), one, n, tokens, "lm")
                     for n in (1, BATCH)}
    wide_update, wide_log_prob = plain.wide
    more = (BATCH - 1) * tokens
    train_us = max(0.0, fixed_us(wide_update, update_model[BATCH]) - fixed_us(plain.steps[1], update_model[1])) / more
    forward_us = max(0.0, fixed_us(wide_log_prob, forward_model[BATCH])
                     - fixed_us(plain.log_prob, forward_model[1])) / more
    rows = [_row(WIDE_OPS[0], wide_update, update_model[BATCH]), _row(WIDE_OPS[1], wide_log_prob, forward_model[BATCH])]
    return _TokenFixed(train_us, forward_us, rows)


def _train_fixed(bare: HardwareProfile, measured: EngineSeconds, per_token: _TokenFixed) -> _TrainFixed:
    """The training engine's fixed costs in the measured mode (as one rank trains, wrapped in FSDP2 or split by
    tensor parallelism over the measured world): a step of n micro-batches takes n passes and one optimizer
    step, so its time beyond the modelled kernels and collectives is n * pass + step; FEW and MANY micro-batches
    give both. The step's share is spread over the model's parameter tensors (the optimizer, the clipping and the
    zeroing visit each one). Also a log-prob call of one micro-batch through the same engine, beyond its modelled
    forward (with FSDP2: gathering the weights for the call and freeing them after, on top of the pass). A pass's
    fixed cost is what is left after `per_token`'s for its sequence's tokens."""
    world = measured.world
    modelled = {n: mode_step_price(bare, measured.mode, world, n) for n in (FEW, MANY)}
    beyond = {n: measured.steps[n] - modelled[n] for n in (FEW, MANY)}
    pass_s = max(0.0, slope_s(beyond[FEW], beyond[MANY]))
    step_s = max(0.0, beyond[FEW] - FEW * pass_s)
    tokens = PROMPT + LONG
    forward_model = log_prob_price(bare, measured.mode, world)
    rows = [_row(train_step_op(measured.mode, n), measured.steps[n], modelled[n], world) for n in (FEW, MANY)]
    rows.append(_row(log_prob_op(measured.mode), measured.log_prob, forward_model, world))
    # Measured with the world's ranks computing at once: a shared host's slowdown (the cost model's, for a set of
    # `world` ranks on a node) is taken off, as the model puts it back on a set's fixed costs.
    shared = bare.compute.host_slowdown(world)
    return _TrainFixed(max(0.0, pass_s * 1e6 / shared - tokens * per_token.train_us),
                       step_s * 1e6 / stage_parameter_tensors(CATALOG[MODEL], 1, "lm") / shared,
                       max(0.0, fixed_us(measured.log_prob, forward_model) / shared - tokens * per_token.forward_us),
                       rows)


def log_prob_price(hw: HardwareProfile, mode: str, world: int, layers: int | None = None) -> float:
    """What `hw` prices the engine's log-prob call of one sequence per data-parallel rank (log_prob_call) at, in
    `mode` over `world` ranks of a node (of the demo model with `layers` decoder layers: its own by default),
    beyond the controller's dispatch of it (the engine's call timed alone). Split by tensor parallelism or in
    pipeline stages it is a trained role's forward, wrapped as the layout rule wraps its one data-parallel rank
    (as a plan's call of it is costed)."""
    fsdp = mode == FSDP or (mode in (TP, PP) and trains_through_fsdp(1, hw.compute.value_bytes))
    tp, pp = (world, 1) if mode == TP else (1, world) if mode == PP else (1, 1)
    dp = world // (tp * pp)
    return (costs.inference_time(hw, _demo_arch(layers), InferConfig(tp=tp, pp=pp, dp=dp, micro_batch=1),
                                 costs.SetShape(world, world), dp, PROMPT + LONG, "lm", dp if fsdp else 1, fsdp)
            - costs.call_dispatch(hw))


def mode_step_price(hw: HardwareProfile, mode: str, world: int, micro_batches: int, layers: int | None = None) -> float:
    """What `hw` prices an actor update (_update_call) of `micro_batches` micro-batches of one sequence per
    data-parallel rank at, through the engine as one rank trains (PLAIN), wrapped in FSDP2 or split by tensor
    parallelism over `world` ranks of a node (of the demo model with `layers` decoder layers: its own by
    default)."""
    fsdp = mode == FSDP
    tp, dp = (world, 1) if mode == TP else (1, world)
    train = TrainConfig(tp=tp, dp=dp, micro_batch=1, shard="full" if fsdp else "replicated")
    return costs.train_step_time(hw, _demo_arch(layers), train, costs.SetShape(world, world), micro_batches * dp,
                                 PROMPT + LONG, "lm")


def _demo_arch(layers: int | None):
    arch = CATALOG[MODEL]
    return arch if layers is None else replace(arch, layers=layers)


def _layers_across(fitted: HardwareProfile, measured: EngineSeconds) -> tuple[dict[str, float], list[dict]]:
    """Runtime.fsdp_layer_forward_us and fsdp_layer_train_us (tp_'s for `measured.mode` TP), and their rows: what
    the engine's log-prob call and training micro-batch across `measured.world` ranks took at the deeper depth
    less at its own, each the value at which the same difference of its model on `fitted` (the plain engine's
    layer costs fitted, the host's sharing) meets the measured one."""
    mode, world = measured.mode, measured.world
    shallow, deep = CATALOG[MODEL].layers, DEEP_LAYERS

    def log_prob(hw: HardwareProfile, layers: int) -> float:
        return log_prob_price(hw, mode, world, layers)

    def train_pass(hw: HardwareProfile, layers: int) -> float:
        return slope_s(*(mode_step_price(hw, mode, world, n, layers) for n in (FEW, MANY)))

    def fitted_us(measured_s: float, model, field: str) -> float:
        def added(us: float) -> float:
            hw = _with_runtime(fitted, **{field: us})
            return model(hw, deep) - model(hw, shallow)
        return round(_linear_fixed_us(measured_s, added), 2)

    deep_log_prob, deep_few, deep_many = measured.deep
    fields = {f"{mode}_layer_forward_us": fitted_us(deep_log_prob - measured.log_prob, log_prob,
                                                    f"{mode}_layer_forward_us"),
              f"{mode}_layer_train_us": fitted_us(measured.deep_pass_s - measured.pass_s, train_pass,
                                                  f"{mode}_layer_train_us")}
    priced = _with_runtime(fitted, **fields)  # the rows as the profile prices them, these figures in
    rows = [_row(log_prob_op(mode, deep), deep_log_prob, log_prob(priced, deep), world)]
    rows += [_row(train_step_op(mode, n, deep), seconds,
                  mode_step_price(priced, mode, world, n, deep), world)
             for n, seconds in ((FEW, deep_few), (MANY, deep_many))]
    return fields, rows


def _engine_on_one_rank(torch, device: Device, mode: str, reps: int) -> EngineSeconds:
    with _world_of_one(torch, device):
        return engine_seconds(torch, device.kind, mode, reps)


@contextmanager
def _world_of_one(torch, device: Device) -> Iterator[None]:
    """A torch.distributed world of this process alone (the training engine's mesh needs one), on loopback."""
    import torch.distributed as dist

    from hfplan.executor.loopback import gloo_on_loopback

    with tempfile.TemporaryDirectory(prefix="hfplan-profile-") as folder, gloo_on_loopback():
        init = Path(folder, "rendezvous").as_uri()
        dist.init_process_group("nccl" if device.kind == "cuda" else "gloo", init_method=init, rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@dataclass(frozen=True)
class Generations:
    """One (engine, prompts) case of generations_seconds: seconds per decode step, and what a generation of
    SHORT tokens took beyond its decode steps (its prefill and the call's own fixed cost)."""

    step: float
    beyond_steps: float


def steps_seconds(clock: Clock | WorldClock, cases: Sequence[tuple[object, object]], min_time: float) -> list[float]:
    """Seconds per decode step of each (engine, prompts) case (generations_seconds)."""
    return [case.step for case in generations_seconds(clock, cases, min_time)]


def generations_seconds(clock: Clock | WorldClock, cases: Sequence[tuple[object, object]], min_time: float
                        ) -> list[Generations]:
    """Each (engine, prompts) case's seconds per decode step: the time between responses of SHORT and LONG
    tokens over the decode steps it counted between them (the prefills, the same in both, drop out). Each length
    of each case is timed in ROUNDS rounds, the cases in turn within a round, and the medians kept: a burst of
    other work on a shared machine, or a slower stretch of a virtual one, seldom spans most rounds of a case, and
    falls on every case alike when it does. (Timed case after case, one burst over one case's short runs made
    its slope negative, and a slow stretch over one whole case made it slower than a case of 8 sequences: the
    fixed costs are fitted from their differences.)"""
    from hfplan.executor.rollout.base import SamplingParams

    timed = [{SHORT: [], LONG: []} for _ in cases]
    steps: list[dict[int, int]] = [{} for _ in cases]
    for _ in range(ROUNDS):
        for (engine, prompts), times, counted in zip(cases, timed, steps, strict=True):
            for tokens in (SHORT, LONG):
                params = SamplingParams(max_new_tokens=tokens)  # sampled, as a run samples
                times[tokens].append(clock.per_call(lambda engine=engine, prompts=prompts, params=params:
                                                    engine.generate(prompts, params), min_time / ROUNDS))
                counted[tokens] = engine.stats.decode_steps
    out = []
    for times, counted in zip(timed, steps, strict=True):
        step = (typical(times[LONG]) - typical(times[SHORT])) / (counted[LONG] - counted[SHORT])
        out.append(Generations(step, typical(times[SHORT]) - counted[SHORT] * step))
    return out


def step_seconds(clock: Clock, engine, prompts, min_time: float) -> float:
    """steps_seconds of one case."""
    return steps_seconds(clock, [(engine, prompts)], min_time)[0]


@dataclass(frozen=True)
class RayCosts:
    """What is measured through Ray: a Ray worker's own resident memory, the engines timed in it, and the
    executor's call gaps (None where the probe run failed: the rest of the profile stands)."""

    resident_bytes: int
    engines: EngineTimes
    gaps: CallGaps | None
    object_store: list[dict]  # raw rows: tensors handed between two workers (hfplan.profiler.object_store)


def _ray_worker(device: Device, profile: HardwareProfile, min_time: float, engine_reps: int) -> RayCosts | None:
    """None without ray or when a Ray session is already running in this process (it is not ours to measure
    or stop)."""
    try:
        import ray
    except ImportError:
        return None
    from hfplan.executor.compat import local_ray_options

    if ray.is_initialized():
        return None
    gpus = 1 if device.kind == "cuda" else 0
    ranks = min(2, device.world_size)  # the call-gap probe's second run needs two workers' slots (placement.bundle)
    with tempfile.TemporaryDirectory(prefix="hfplan-profile-ray-") as folder:
        ray.init(num_cpus=ranks, num_gpus=gpus * ranks, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False, **local_ray_options(folder))
        try:
            timer = ray.remote(num_gpus=gpus)(_EngineTimer).remote()
            resident = ray.get(timer.resident_bytes.remote(), timeout=300)
            engines = ray.get(timer.time_engines.remote(device, min_time, engine_reps), timeout=900)
            ray.kill(timer)  # its device and memory go back before the probe's worker starts
            handed = object_store.measure_object_store(ray)
            return RayCosts(resident, engines, _probe_gaps(profile, ranks), handed)
        finally:
            ray.shutdown()


def _probe_gaps(profile: HardwareProfile, ranks: int) -> CallGaps | None:
    from hfplan.executor.errors import RunFailed

    try:
        return measure_call_gaps(profile, ranks)
    except (RunFailed, HfplanError, ValueError) as failure:
        logger.warning("the executor's call gaps were not measured (the probe run failed: %s)", failure)
        return None


class _EngineTimer:
    def resident_bytes(self) -> int:
        """Peak resident memory of this Ray worker once it has imported what an executor worker imports to
        build its roles, measured as the executor measures its workers': the worker's own memory, before any
        model."""
        import hfplan.executor.runtime  # noqa: F401  (torch, transformers, the engines)
        from hfplan.executor.host_memory import peak_resident_bytes

        return peak_resident_bytes()

    def time_engines(self, device: Device, min_time: float, engine_reps: int) -> EngineTimes:
        """time_engines in this worker, with the threads an executor worker of `device` gets."""
        import torch

        if device.kind == "cpu":
            torch.set_num_threads(device.threads)
        else:
            torch.cuda.set_device(0)  # Ray exposes exactly the actor's GPU
        return time_engines(torch, device, min_time, engine_reps)
