"""The machine at hand: which device, how many, its nominal rates, memory and cache sizes.

Nominal (datasheet) rates are only known for CUDA GPUs, by name; on CPU the profiler takes the best
measured rate as the peak. `torch` is passed in, never imported at module level.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.profiles.hardware import GIB

# Datasheet rates of known GPUs, matched on the name torch reports (first match wins):
# dense bf16 tensor-core TFLOP/s, HBM GB/s, NVLink GB/s each way per GPU, the shipped profile to
# carry unmeasured links from.
KNOWN_GPUS: tuple[tuple[str, float, float, float, str], ...] = (
    # H200: 989.4 TFLOP/s dense bf16, 4.8 TB/s HBM3e, NVLink 4 900 GB/s bidirectional.
    (r"H200", 989.4, 4800.0, 450.0, "h200-141g"),
    # H100 SXM: 989.4 TFLOP/s, 3.35 TB/s; H100 PCIe: 756 TFLOP/s, 2.0 TB/s, no NVLink switch.
    (r"H100.*PCIe", 756.0, 2000.0, 64.0, "h100-80g"),
    (r"H100|H800", 989.4, 3350.0, 450.0, "h100-80g"),
    # A100: 312 TFLOP/s; 80GB SXM 2.039 TB/s, 40GB 1.555 TB/s; NVLink 3 600 GB/s bidirectional.
    (r"A100.*PCIe", 312.0, 1935.0, 32.0, "a100-80g"),
    (r"A100.*40GB", 312.0, 1555.0, 300.0, "a100-80g"),
    (r"A100|A800", 312.0, 2039.0, 300.0, "a100-80g"),
    # L40S: 362 TFLOP/s dense bf16, 864 GB/s GDDR6, PCIe Gen4.
    (r"L40S", 362.0, 864.0, 32.0, "a100-80g"),
)
DEFAULT_GPU_BASE = "a100-80g"
CPU_BASE = "cpu"


@dataclass(frozen=True)
class Nominal:
    peak_tflops: float | None
    memory_gbps: float | None
    link_gbps: float | None
    base: str


def nominal_rates(device_name: str, kind: str) -> Nominal:
    if kind == "cpu":
        return Nominal(None, None, None, CPU_BASE)
    for pattern, tflops, hbm, nvlink, base in KNOWN_GPUS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return Nominal(tflops, hbm, nvlink, base)
    return Nominal(None, None, None, DEFAULT_GPU_BASE)


@dataclass(frozen=True)
class Device:
    """One device kind and the share of the machine each of `world_size` processes gets."""

    kind: str  # "cuda" or "cpu"
    name: str
    world_size: int
    count: int  # devices of this kind on the node (CPU: processes the node is planned for)
    threads: int  # CPU threads one device (process) uses
    cache_bytes: int  # last-level cache, to size buffers that must not stay cached
    capacity_bytes: float  # memory of one device
    used_bytes: float  # memory already taken on it before anything is allocated
    nominal: Nominal
    sm_count: int | None = None  # streaming multiprocessors of a CUDA device (None on CPU)
    cache_share_bytes: int | None = None  # CPU: the last-level cache over the cores that share it (Compute.cache_bytes)

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"


def default_device(torch) -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_world_size(torch, kind: str) -> int:
    if kind == "cuda":
        return max(1, torch.cuda.device_count())
    # One process per core is the useful maximum; CPU worlds stay small.
    return max(2, min(4, os.cpu_count() or 1))


def probe(torch, kind: str, world_size: int) -> Device:
    """Describe the device, checking that `world_size` of them are there."""
    if kind not in ("cuda", "cpu"):
        raise HfplanError(f"unknown device {kind!r}; use cuda or cpu")
    if world_size < 1:
        raise HfplanError(f"--world-size must be at least 1, got {world_size}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise HfplanError("--device cuda: no CUDA GPU is available to torch here (use --device cpu)")
        count = torch.cuda.device_count()
        if world_size > count:
            raise HfplanError(f"--world-size {world_size}: only {count} CUDA GPU(s) are visible")
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        return Device(kind="cuda", name=props.name, world_size=world_size, count=count, threads=1,
                      cache_bytes=int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20),
                      capacity_bytes=float(total), used_bytes=float(total - free),
                      nominal=nominal_rates(props.name, "cuda"), sm_count=int(props.multi_processor_count))
    if world_size > 4:
        raise HfplanError(f"--world-size {world_size}: CPU worlds are kept to at most 4 processes")
    cores = os.cpu_count() or 1
    # Host memory is shared by the processes; what other programs hold now is not counted against it
    # (it is not the machine's), only this runtime's own footprint (Python, torch) per process.
    caches = _caches()
    return Device(kind="cpu", name=_cpu_name(), world_size=world_size, count=world_size,
                  threads=max(1, cores // world_size), cache_bytes=_last_level_cache(caches),
                  cache_share_bytes=_last_level_cache_share(caches),
                  capacity_bytes=_host_memory() / world_size, used_bytes=_own_rss(),
                  nominal=nominal_rates("", "cpu"))


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpu_name() -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), flags=re.MULTILINE)
    import platform

    return (match.group(1).strip() if match else platform.processor() or platform.machine() or "cpu")


def _host_memory() -> float:
    """Bytes of host memory."""
    match = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), flags=re.MULTILINE)
    if match:
        return float(match.group(1)) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _own_rss() -> float:
    match = re.search(r"^VmRSS:\s+(\d+) kB", _read("/proc/self/status"), flags=re.MULTILINE)
    return float(match.group(1)) * 1024 if match else 0.5 * GIB


def _caches() -> list[tuple[int, int]]:
    """(bytes, CPUs sharing it) of each cache level of CPU 0, as sysfs lists them."""
    out = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        text = _read(str(index / "size")).strip()
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            size = int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]
            out.append((size, max(1, _cpu_count(_read(str(index / "shared_cpu_list")).strip()))))
    return out


def _cpu_count(cpu_list: str) -> int:
    """CPUs in a sysfs CPU list such as "0-3,8"; 0 where it cannot be read."""
    count = 0
    for part in filter(None, cpu_list.split(",")):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return 0
        count += int(high or low) - int(low) + 1
    return count


def _last_level_cache(caches: list[tuple[int, int]]) -> int:
    sizes = [size for size, _ in caches]
    return max(sizes) if sizes else 64 * 2**20


def _last_level_cache_share(caches: list[tuple[int, int]]) -> int | None:
    """The largest cache level over the CPUs that share it: what one process computing on each core may keep in it
    (None where sysfs does not say)."""
    if not caches:
        return None
    size, sharing = max(caches)
    return size // sharing
