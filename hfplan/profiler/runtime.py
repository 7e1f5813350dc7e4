"""Fixed costs the kernels do not show (HardwareProfile.runtime), measured on the executor's own engines.

Each is what one unit of work takes beyond what the cost model charges for its kernels on the profile just
fitted: a forward pass of the demo model through its HF module, a decode step of the executor's torch rollout
engine with static and with continuous batching (the slope of generation time over decode steps, so the
prefills drop out), a training micro-batch and an optimizer step of the executor's training engine (the slope of
a step's time over its micro-batches, and what is left at none) as it trains on one rank and wrapped in FSDP2
(over a world of one), a log-prob call through the FSDP2-wrapped engine, and a round trip of a call through a
Ray actor (how the controller reaches a worker).
torch and ray are passed in or imported here, only when `hfplan profile` runs.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hfplan.layout import stage_parameter_tensors
from hfplan.plan import Layout, TrainConfig
from hfplan.profiler.compute import compute_dtype
from hfplan.profiler.device import Device
from hfplan.profiler.timing import Clock
from hfplan.profiles.hardware import HardwareProfile, Runtime
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs

MODEL = "tiny"  # the demo model: its kernels are tiny, so what it takes is mostly the fixed cost
PROMPT = 8
SHORT, LONG = 2, 34  # response lengths whose time difference is LONG - SHORT decode steps
FEW, MANY = 1, 3  # micro-batches (of one sequence) per optimizer step: the difference is MANY - FEW passes
ROUNDS = 3
RAY_CALLS = 200


@dataclass(frozen=True)
class RuntimeFit:
    runtime: Runtime
    rows: list[dict]
    ray: bool  # whether the controller call was measured (ray importable)


def fixed_us(measured_s: float, predicted_s: float) -> float:
    """Microseconds of a unit of work beyond its modelled kernels (never negative)."""
    return max(0.0, measured_s - predicted_s) * 1e6


def _row(op: str, seconds: float, predicted: float) -> dict:
    return dict(kind="runtime", op=op, model=MODEL, seconds=seconds, predicted_s=predicted,
                error_pct=100.0 * (predicted - seconds) / seconds)


def measure_runtime(torch, device: Device, profile: HardwareProfile, min_time: float, ray_calls: int = RAY_CALLS
                    ) -> RuntimeFit:
    """Forward-pass, engine-step (static and continuous), training-pass, optimizer-step and (with ray)
    controller-call costs, with the rows behind them."""
    from hfplan.executor.models import build_model
    from hfplan.executor.rollout.torch_engine import TorchRolloutEngine

    bare = profile.model_copy(update={"runtime": Runtime()})  # kernels only
    arch = CATALOG[MODEL]
    one = costs.SetShape(1, 1)
    clock = Clock(torch, device.kind)
    model = build_model(MODEL, "lm", seed=0, dtype=compute_dtype(device)).to(device.kind).eval()
    prompts = torch.randint(1, arch.vocab, (1, PROMPT), device=device.kind)

    with torch.inference_mode():
        forward_s = clock.per_call(lambda: model(prompts), min_time)
    forward_model = costs.stage_pass(bare, arch, 1, 1, one, 1, PROMPT, "lm").forward
    # No token is -1: every response runs its length. The continuous engine has one slot for two prompts, so
    # it refills the slot (a batch of one every step, as the static engine's).
    static = TorchRolloutEngine(model, pad_id=0, eos_id=-1)
    continuous = TorchRolloutEngine(model, pad_id=0, eos_id=-1, batching="continuous", max_batch=1)
    step_s = _step_seconds(clock, static, prompts, min_time)
    continuous_s = _step_seconds(clock, continuous, prompts.repeat(2, 1), min_time)
    step_model = costs.decode_step_time(bare, arch, Layout(), one, 1, PROMPT + (SHORT + LONG) / 2)
    rows = [_row("forward_pass", forward_s, forward_model), _row("engine_step", step_s, step_model),
            _row("engine_step_continuous", continuous_s, step_model)]
    train = _train_fixed(torch, device, bare, clock, min_time, fsdp=False)
    wrapped = _train_fixed(torch, device, bare, clock, min_time, fsdp=True)
    rows += train.rows + wrapped.rows
    controller_us, measured_ray = 0.0, False
    call_s = _ray_round_trip(ray_calls)
    if call_s is not None:
        controller_us, measured_ray = call_s * 1e6, True
        rows.append(_row("controller_call", call_s, 0.0))
    runtime = Runtime(forward_pass_us=round(fixed_us(forward_s, forward_model), 2),
                      engine_step_us=round(fixed_us(step_s, step_model), 2),
                      controller_call_us=round(controller_us, 2),
                      engine_step_continuous_us=round(fixed_us(continuous_s, step_model), 2),
                      train_pass_us=round(train.pass_us, 2), optimizer_tensor_us=round(train.tensor_us, 3),
                      fsdp_forward_pass_us=round(wrapped.forward_us, 2), fsdp_train_pass_us=round(wrapped.pass_us, 2),
                      fsdp_optimizer_tensor_us=round(wrapped.tensor_us, 3))
    return RuntimeFit(runtime, rows, measured_ray)


@dataclass(frozen=True)
class _TrainFixed:
    pass_us: float
    tensor_us: float
    forward_us: float
    rows: list[dict]


def _train_fixed(torch, device: Device, bare: HardwareProfile, clock: Clock, min_time: float, fsdp: bool
                 ) -> _TrainFixed:
    """The training engine's fixed costs, as it trains on one rank (`fsdp` False) or wrapped in FSDP2 as over
    more ranks (True): a step of n micro-batches takes n passes and one optimizer step, so its time beyond the
    modelled kernels is n * pass + step; FEW and MANY micro-batches give both. The step's share is spread over
    the model's parameter tensors (the optimizer, the clipping and the zeroing visit each one). Also a log-prob
    call of one micro-batch through the same engine, beyond its modelled forward (with FSDP2: gathering the
    weights for the call and freeing them after, on top of the pass)."""
    arch = CATALOG[MODEL]
    seconds, forward_s = _train_engine_seconds(torch, device, clock, min_time, fsdp)
    modelled = {n: costs.train_step_time(bare, arch, TrainConfig(micro_batch=1), costs.SetShape(1, 1), n,
                                         PROMPT + LONG, "lm") for n in (FEW, MANY)}
    beyond = {n: seconds[n] - modelled[n] for n in (FEW, MANY)}
    pass_s = max(0.0, (beyond[MANY] - beyond[FEW]) / (MANY - FEW))
    step_s = max(0.0, beyond[FEW] - FEW * pass_s)
    forward_model = costs.stage_pass(bare, arch, 1, 1, costs.SetShape(1, 1), 1, PROMPT + LONG, "lm").forward
    engine = "fsdp_" if fsdp else ""
    rows = [_row(f"{engine}train_step_{n}_micro_batches", seconds[n], modelled[n]) for n in (FEW, MANY)]
    rows.append(_row(f"{engine}engine_log_prob", forward_s, forward_model))
    return _TrainFixed(pass_s * 1e6, step_s * 1e6 / stage_parameter_tensors(arch, 1, "lm"),
                       fixed_us(forward_s, forward_model), rows)


def _train_engine_seconds(torch, device: Device, clock: Clock, min_time: float, fsdp: bool
                          ) -> tuple[dict[int, float], float]:
    """Seconds of one actor update (one optimizer step) of the executor's training engine on FEW and MANY
    micro-batches of one sequence, each the best of ROUNDS rounds taken in turn, and of one log-prob call of
    one sequence through it."""
    from hfplan.executor.engines.training import RoleModel
    from hfplan.executor.mesh import ParallelDims
    from hfplan.executor.models import build_model
    from hfplan.hyperparams import Hyperparameters

    arch = CATALOG[MODEL]
    with _world_of_one(torch, device):
        mesh = ParallelDims(1, 1, 1, 1).build(device.kind)
        model = build_model(MODEL, "lm", seed=0, dtype=torch.float32)
        role = RoleModel(model, mesh, Hyperparameters(), device.kind, compute_dtype(device), pad_id=0, lr=1e-6,
                         fsdp=fsdp)
        timed, forward_s = dict.fromkeys((FEW, MANY), math.inf), math.inf
        for _ in range(ROUNDS):
            for n in (FEW, MANY):
                batch = {"prompts": torch.randint(1, arch.vocab, (n, PROMPT)),
                         "responses": torch.randint(1, arch.vocab, (n, LONG)),
                         "response_mask": torch.ones(n, LONG, dtype=torch.long),
                         "old_log_probs": torch.zeros(n, LONG), "advantages": torch.ones(n, LONG)}
                once = clock.per_call(lambda batch=batch: role.update_actor(batch, mini_batches=1, epochs=1,
                                                                            micro_batch=1, use_kl_loss=False),
                                      min_time / ROUNDS)
                timed[n] = min(timed[n], once)
            one = {key: batch[key][:1] for key in ("prompts", "responses", "response_mask")}
            forward_s = min(forward_s, clock.per_call(lambda one=one: role.log_probs(**one, micro_batch=1),
                                                      min_time / ROUNDS))
    return timed, forward_s


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


def _step_seconds(clock: Clock, engine, prompts, min_time: float) -> float:
    """Seconds per decode step of `engine` on `prompts`: the time between responses of SHORT and LONG tokens
    over the decode steps it counted between them (the prefills, the same in both, drop out). Each length is
    timed in ROUNDS rounds taken in turn, its best kept: a burst of other work on a shared machine seldom
    spans them all (one burst over the short runs alone would make the slope negative)."""
    from hfplan.executor.rollout.base import SamplingParams

    timed, steps = dict.fromkeys((SHORT, LONG), math.inf), {}
    for _ in range(ROUNDS):
        for tokens in (SHORT, LONG):
            params = SamplingParams(max_new_tokens=tokens, greedy=True)
            once = clock.per_call(lambda params=params: engine.generate(prompts, params), min_time / ROUNDS)
            timed[tokens] = min(timed[tokens], once)
            steps[tokens] = engine.stats.decode_steps
    return (timed[LONG] - timed[SHORT]) / (steps[LONG] - steps[SHORT])


def _ray_round_trip(calls: int) -> float | None:
    """Seconds of one synchronous call to a Ray actor on this machine (best of three rounds); None without ray
    or when a Ray session is already running in this process (it is not ours to measure or stop)."""
    try:
        import ray
    except ImportError:
        return None
    from hfplan.executor.compat import local_ray_options

    if calls < 1 or ray.is_initialized():
        return None
    with tempfile.TemporaryDirectory(prefix="hfplan-profile-ray-") as folder:
        ray.init(num_cpus=1, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                 **local_ray_options(folder))
        try:
            actor = ray.remote(_Echo).remote()
            ray.get(actor.ping.remote(), timeout=120)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(calls):
                    ray.get(actor.ping.remote(), timeout=60)
                best = min(best, (time.perf_counter() - start) / calls)
            return best
        finally:
            ray.shutdown()


class _Echo:
    def ping(self) -> None:
        return None
