"""From fitted rates to a HardwareProfile in the simulator's schema, with a description of its origin."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from hfplan.profiler.device import Device
from hfplan.profiler.fit import LinkFit, RooflineFit
from hfplan.profiles.hardware import GIB, Compute, GemmTiling, HardwareProfile, Link, Links, MeasuredCollective, Memory


@dataclass(frozen=True)
class Fits:
    roofline: RooflineFit
    best_matmul_flops: float  # best rate of any single matmul shape
    best_copy_bytes: float  # best streaming rate of the large copies (bytes/s)
    intra: LinkFit | None  # None: fewer than two processes, nothing measured
    host: LinkFit | None  # None: CPU (device memory is host memory)
    per_collective: dict[str, LinkFit]


def _rate_and_efficiency(measured: float, nominal: float | None) -> tuple[float, float]:
    """(nominal, measured/nominal); the measured rate itself with efficiency 1 where no nominal is known
    or the measurement beats it."""
    if nominal is None or measured >= nominal:
        return measured, 1.0
    return nominal, measured / nominal


def device_tiling(device: Device, base: HardwareProfile) -> GemmTiling | None:
    """The GEMM tiling the measured profile carries (and its matmul sweep is fitted with): the base profile's
    tiles on this device's own SM count; none on CPU, whose matmul rate is the plain roofline fit."""
    if device.kind != "cuda" or device.sm_count is None or base.compute.gemm is None:
        return None
    return base.compute.gemm.model_copy(update={"sm_count": device.sm_count})


def device_attention_rate(device: Device, base: HardwareProfile) -> tuple[tuple[int, float], ...] | None:
    """The flash attention kernel's rate the measured profile carries, not measured by the profiler: the base
    profile's (a fraction of the datasheet peak, by sequence length) on a GPU; none on CPU, whose attention runs at
    its fitted matmul rate."""
    if device.kind != "cuda":
        return None
    return base.compute.attention_rate


def _round(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def _measured_collectives(device: Device, fits: Fits) -> tuple[MeasuredCollective, ...]:
    """Each collective's own fit, on a CPU host: gloo runs each with an algorithm of its own and reduces on the
    cores, which the link's fit (over every collective, robust to the ones that stray) does not describe (on the
    project's VM its all-reduce and reduce-scatter took 1-1.4 ms at 16 bytes, its all-gather of 256 MiB 10x the
    link's time). On CUDA, NCCL's collectives are the link's protocols."""
    if device.kind != "cpu":
        return ()
    return tuple(MeasuredCollective(op=op, latency_us=_round(fit.latency_s * 1e6),
                                    bandwidth_gbytes_per_s=_round(fit.bytes_per_s / 1e9))
                 for op, fit in fits.per_collective.items() if op != "p2p")


def build_profile(device: Device, fits: Fits, base: HardwareProfile, name: str, versions: str,
                  sweep_note: str) -> HardwareProfile:
    nominal = device.nominal
    peak_flops = nominal.peak_tflops * 1e12 if nominal.peak_tflops else fits.best_matmul_flops
    matmul_efficiency = min(1.0, fits.roofline.flops_per_s / peak_flops)
    # On CPU the best streaming copy stands in for the datasheet bandwidth.
    bandwidth, mem_eff = _rate_and_efficiency(fits.roofline.bytes_per_s / 1e9,
                                              nominal.memory_gbps or fits.best_copy_bytes / 1e9)
    capacity = device.capacity_bytes / GIB
    # Taken before anything is allocated (runtime context, other processes) plus headroom for
    # collective buffers and allocator fragmentation.
    reserved = min(capacity * 0.5, device.used_bytes / GIB + 0.05 * capacity)
    if fits.intra is not None:
        link_bw, link_eff = _rate_and_efficiency(fits.intra.bytes_per_s / 1e9, nominal.link_gbps)
        intra = Link(bandwidth_gbytes_per_s=_round(link_bw), efficiency=_round(link_eff),
                     latency_us=_round(fits.intra.latency_s * 1e6), collectives=_measured_collectives(device, fits))
    else:
        intra = base.links.intra_node
    if fits.host is not None:
        host_bw, host_eff = _rate_and_efficiency(fits.host.bytes_per_s / 1e9, base.links.host.bandwidth_gbytes_per_s)
        host = Link(bandwidth_gbytes_per_s=_round(host_bw), efficiency=_round(host_eff),
                    latency_us=_round(fits.host.latency_s * 1e6))
    else:
        host = base.links.host
    attention_rate = device_attention_rate(device, base)
    # Datasheet figures the profiler does not measure, a GPU's alone: its CUDA cores' fp32 peak and its L2 bandwidth
    # (what a per-query-head decode attention runs at), and the stack's decode attention kernel.
    gpu = device.kind == "cuda"
    vector_tflops = base.compute.vector_tflops if gpu else None
    l2 = base.memory.l2_gbytes_per_s if gpu else None
    overlap_slowdown = base.compute.overlap_slowdown if gpu else 0.0
    carried = ["inter-node link"] + (["intra-node link"] if fits.intra is None else []) \
        + (["host link"] if fits.host is None else []) + (["flash attention rate"] if attention_rate else []) \
        + (["fp32 CUDA-core peak"] if vector_tflops else []) + (["L2 bandwidth"] if l2 else []) \
        + (["compute slowdown beside a collective"] if overlap_slowdown else [])
    description = (
        f"Measured by hfplan profile on {device.world_size} x {device.name} ({device.kind}, "
        f"{device.backend}; {versions}). Compute: {sweep_note}; kernel overhead, matmul rate and memory "
        f"bandwidth fitted to the roofline by robust least squares on relative error"
        + (f" (each matmul's FLOPs scaled by its tile, wave and short-K efficiency on {device.sm_count} SMs, "
           f"tiles of base profile '{base.name}')" if device_tiling(device, base) is not None else "")
        + "; peak "
        f"{'from the datasheet' if nominal.peak_tflops else 'is the best measured matmul rate'}. "
        + (f"Intra-node link: alpha-beta fit (bus bandwidth) of all-reduce, all-gather, reduce-scatter and "
           f"point-to-point across {device.world_size} processes"
           + ("; each collective also fitted on its own, every call timed after a millisecond of compute on every "
              "rank" if device.kind == "cpu" else "") + ". " if fits.intra is not None else "")
        + ("Host link: fit of pinned host<->device copies. " if fits.host is not None else "")
        + f"Not measured, carried over from base profile '{base.name}': {', '.join(carried)}."
    )
    return HardwareProfile(
        name=name,
        description=description,
        measured=True,
        date=datetime.date.today().isoformat(),
        backend=device.backend,
        gpus_per_node=device.count,
        compute=Compute(peak_tflops=_round(peak_flops / 1e12), matmul_efficiency=_round(matmul_efficiency),
                        kernel_overhead_us=_round(fits.roofline.overhead_s * 1e6),
                        value_bytes=2 if device.kind == "cuda" else 4,  # bf16 on GPUs, fp32 on CPUs
                        gemm=device_tiling(device, base), attention_rate=attention_rate,
                        decode_attention=base.compute.decode_attention if gpu else "grouped",
                        vector_tflops=vector_tflops, overlap_slowdown=overlap_slowdown,
                        overlaps_collectives=gpu),  # CPU: no streams, FSDP2's collectives run in line
        memory=Memory(capacity_gib=_round(capacity), reserved_gib=_round(reserved, 3),
                      bandwidth_gbytes_per_s=_round(bandwidth), efficiency=_round(mem_eff), l2_gbytes_per_s=l2),
        links=Links(intra_node=intra, inter_node=base.links.inter_node, host=host),
    )
