"""Alpha-beta cost of collectives, per link class, with GPUs of a node sharing its network links.

A group of `size` ranks may span nodes: `per_node` of its ranks share each node, and `busy_per_node`
GPUs of that node (this group's and others' running the same collective at the same time, e.g. all
data-parallel groups of a model) share the node's network interfaces. Collectives spanning nodes use
the two-level scheme (reduce-scatter inside the node, the inter-node step on 1/per_node of the data
per GPU, all-gather inside the node), which is what NCCL's tree and ring channels achieve in effect.
NCCL pipelines those phases over chunks of the message (NCCL 2.4's pipelined trees; a ring's chunks
cross NVLink and the network at once), so the intra- and inter-node links work at the same time: a
two-level collective pays every phase's latency and the slower link's bandwidth term, not their sum.
Where the intra-node link reduces in the switch (NVLink SHARP, `Link.nvls`: NVSwitch gen 3, H100/H200),
an all-reduce inside a node sends each GPU's data to the switch once and receives the reduced result
once (NCCL's NVLS algorithm): n bytes each way in two steps, against the ring's 2(r-1)/r n in 2(r-1).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hfplan.profiles.hardware import HardwareProfile, Link


@dataclass(frozen=True)
class Group:
    size: int
    per_node: int
    busy_per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1 or self.per_node > self.size or self.size % self.per_node:
            raise ValueError(f"bad group shape {self}")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node


@functools.lru_cache(maxsize=1 << 12)
def group_of(size: int, stride: int, set_gpus_per_node: int) -> Group:
    """Shape of a group of `size` ranks spaced `stride` apart in a set whose GPUs fill
    `set_gpus_per_node` slots of each node (ranks are numbered node by node). Cached: the cost model asks
    for few shapes, very often (a Group is immutable)."""
    return grid_group([(size, stride)], set_gpus_per_node)


def grid_group(dims: list[tuple[int, int]], set_gpus_per_node: int) -> Group:
    """Shape of a group whose ranks are all sums of i_k * stride_k (0 <= i_k < factor_k) for dims
    (factor_k, stride_k): e.g. a tensor-parallel block together with its data-parallel peers."""
    size = math.prod(f for f, _ in dims)
    busy = max(1, set_gpus_per_node)
    if size <= 1:
        return Group(1, 1, busy)
    per_node, extent = 1, 1
    for factor, stride in sorted(d for d in dims if d[0] > 1):
        span = (factor - 1) * stride + extent
        if span <= busy:
            per_node, extent = per_node * factor, span
            continue
        per_node *= max(1, min(factor, (busy - extent) // stride + 1)) if extent <= busy else 1
        break
    while size % per_node:
        per_node -= 1
    return Group(size, per_node, busy)


def _step(link: Link, nbytes: float, bandwidth: float) -> float:
    return nbytes / bandwidth + link.latency_us * 1e-6 if nbytes > 0 else 0.0


def _inter_bandwidth(hw: HardwareProfile, group: Group) -> float:
    """Bytes/s one GPU of the group gets across nodes: its share of the node's interfaces."""
    inter = hw.links.inter_node
    return inter.effective_bytes_per_s / max(1, group.busy_per_node)


def _ring(hw: HardwareProfile, group: Group, nbytes: float, passes: int) -> float:
    """`passes` = 1 for all-gather or reduce-scatter (of an nbytes result), 2 for all-reduce."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    intra = hw.links.intra_node
    r, n = group.per_node, group.nodes
    latency, intra_time, inter_time = 0.0, 0.0, 0.0
    if r > 1:
        if passes == 2 and intra.nvls:
            latency += 2 * intra.latency_us * 1e-6
            intra_time = nbytes / intra.effective_bytes_per_s
        else:
            latency += passes * (r - 1) * intra.latency_us * 1e-6
            intra_time = passes * (r - 1) / r * nbytes / intra.effective_bytes_per_s
    if n > 1:
        inter = hw.links.inter_node
        # Each of the r local GPUs carries 1/r of the data across nodes, all sharing the node's NICs.
        per_gpu = nbytes / r
        latency += passes * (n - 1) * inter.latency_us * 1e-6
        inter_time = passes * (n - 1) / n * per_gpu / _inter_bandwidth(hw, group)
    return latency + max(intra_time, inter_time)


def all_reduce(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    return _ring(hw, group, nbytes, passes=2)


def all_gather(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    """nbytes: size of the gathered result on each rank."""
    return _ring(hw, group, nbytes, passes=1)


def reduce_scatter(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    """nbytes: size of the full input on each rank."""
    return _ring(hw, group, nbytes, passes=1)


def point_to_point(hw: HardwareProfile, nbytes: float, same_node: bool, busy_per_node: int = 1) -> float:
    if nbytes <= 0:
        return 0.0
    if same_node:
        link = hw.links.intra_node
        return _step(link, nbytes, link.effective_bytes_per_s)
    link = hw.links.inter_node
    return _step(link, nbytes, link.effective_bytes_per_s / max(1, busy_per_node))


def host_transfer(hw: HardwareProfile, nbytes: float) -> float:
    """Device <-> host copy (data passing through the single controller)."""
    link = hw.links.host
    return _step(link, nbytes, link.effective_bytes_per_s)
