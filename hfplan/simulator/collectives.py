"""Alpha-beta cost of collectives, per link class, with GPUs of a node sharing its network links.

A group of `size` ranks may span nodes: `per_node` of its ranks share each node, and `busy_per_node`
GPUs of that node (this group's and others' running the same collective at the same time, e.g. all
data-parallel groups of a model) share the node's network interfaces. Collectives spanning nodes run as
NCCL's ring does: one ring through every rank of the group, each node's ranks adjacent on it, so every
node boundary carries the ring's whole stream (passes (size - 1) / size of the data per rank), not the
1/per_node share a hierarchical (reduce in the node first) scheme would send; nccl-tests' multi-node
all-reduce bus bandwidth is accordingly about the node's network bandwidth. The ring's chunks cross
NVLink and the network at once, so it pays every step's latency and the slower link's bandwidth term.
Where the intra-node link reduces in the switch (NVLink SHARP, `Link.nvls`: NVSwitch gen 3, H100/H200),
an all-reduce inside a node may run NCCL's NVLS algorithm (src/device/all_reduce.h, the one-node path): each
rank stages chunk h of its input in its own buffer of head h; head h loads its chunk reduced by the switch
(multimem.ld_reduce: the switch reads that chunk from every rank) and stores the result to every rank at once
(multimem.st). Each GPU's link so carries its whole buffer and its reduced chunk out, n (1 + 1/r), and as much
in, in two steps, at the NVLS rate (`Link.nvls_bytes_per_s`); against the ring's 2(r-1)/r n in 2(r-1) steps.
NCCL's tuner runs whichever its model finds faster (src/graph/tuning.cc), so the faster of the two is taken:
NVLS for large groups, the ring for a pair. NCCL runs NVLS across nodes only with CollNet (SHARP in the
network), which the profiles do not describe: groups spanning nodes take the ring.
A ring in a node over a link that lists protocols (`Link.protocols`: NCCL's LL, LL128 and Simple) runs in whichever
is fastest, as NCCL's tuner picks (ncclTopoGetAlgoTime: latency + bytes / bandwidth per algorithm and protocol):
each costs its fixed latency, its latency per ring step and the data at its share of the bus bandwidth. LL (8-byte
stores, 4 of data and 4 of flag) costs least per step and so carries small messages (a decode step's tensor-parallel
all-reduce); Simple carries large ones at the full bandwidth. A ring spanning nodes over an inter-node link that lists
protocols runs in whichever of those is fastest, priced as NCCL's tuning model prices a ring across nodes
(_protocol_ring_across_nodes); without them, every step pays its link's latency_us. An all-reduce spanning nodes
may also run NCCL's tree where the inter-node link lists its protocols (`Link.tree`, _tree_all_reduce): fewer
latencies (log2 of the nodes across the network) for a little less bandwidth, so small all-reduces over many nodes
take it, as NCCL's tuner has them do.
A collective the intra-node link measured on its own (`Link.collectives`: gloo's on a CPU host, whose all-reduce and
reduce-scatter do not follow its point-to-point alpha-beta) costs its own fit in a node.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hfplan.profiles.hardware import HardwareProfile, Link, Protocol, TreeProtocol


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


PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # a ring's passes over the data per collective


def collective_terms(op: str, world: int) -> tuple[float, float]:
    """(steps, bytes factor) of one collective over `world` ranks: time = steps*alpha + factor*n/bw.

    all-reduce of n bytes: 2(W-1) steps moving 2(W-1)/W*n per rank (the bus-bandwidth convention);
    all-gather (n = gathered result) and reduce-scatter (n = full input): W-1 steps, (W-1)/W*n;
    point-to-point: one step carrying n.
    """
    if op == "p2p":
        return 1.0, 1.0
    if world < 2:
        raise ValueError(f"{op} needs at least 2 ranks")
    if op not in PASSES:
        raise ValueError(f"unknown collective {op!r}")
    passes = PASSES[op]
    return float(passes * (world - 1)), passes * (world - 1) / world


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


def _nvls_all_reduce(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    """NCCL's NVLS all-reduce in one node (module docstring): n (1 + 1/r) bytes each way per GPU in two steps at the
    NVLS rate; infinite where the switch does not reduce or the group spans nodes."""
    intra = hw.links.intra_node
    if not intra.nvls or group.nodes > 1 or group.size <= 1:
        return math.inf
    latency = 2 * intra.latency_us if intra.nvls_latency_us is None else intra.nvls_latency_us
    return latency * 1e-6 + (1 + 1 / group.size) * nbytes / intra.nvls_bytes_per_s


def uses_nvls(hw: HardwareProfile, group: Group, nbytes: float) -> bool:
    """Whether an all-reduce of `nbytes` in `group` runs NVLS (faster than the ring there) rather than the ring."""
    return how_it_runs(hw, group, nbytes, "all_reduce") == "nvls"


def how_it_runs(hw: HardwareProfile, group: Group, nbytes: float, op: str) -> str:
    """How collective `op` runs: "nvls", the name of the ring's protocol (Link.protocols), "measured" (its own
    fit, Link.collectives) or "ring" (one latency per step at the full bandwidth)."""
    return min(_ways(hw, group, nbytes, op), key=lambda way: way[0])[1]  # ties: the first listed


def _protocol_ring(link: Link, protocol: Protocol, steps: int, moved: float) -> float:
    """One protocol's ring of `steps` steps in which each rank sends `moved` bytes (module docstring)."""
    rate = link.effective_bytes_per_s * protocol.bandwidth_fraction
    if protocol.max_gbytes_per_s is not None:
        rate = min(rate, protocol.max_gbytes_per_s * 1e9)
    return (protocol.base_us + steps * protocol.hop_us) * 1e-6 + moved / rate


def _protocol_ring_across_nodes(hw: HardwareProfile, group: Group, protocol: Protocol, passes: int,
                                moved: float) -> float:
    """One protocol's ring through every rank of a group spanning nodes, as NCCL's tuning model prices it
    (src/graph/tuning.cc, ncclTopoTuneModel, the ring's latency): of its passes (size - 1) steps, passes (nodes - 1)
    cross the network at the protocol's network latency per step (alone_hop_us with one rank per node), the others
    stay in a node at the intra-node link's latency for the protocol of that name (latency_us where it lists none),
    but no less than the protocol's overhead_us; the data at the protocol's share of the slower link's bandwidth."""
    intra = hw.links.intra_node
    r, n = group.per_node, group.nodes
    same = next((p for p in intra.protocols if p.name == protocol.name), None)
    intra_hop = max(intra.latency_us if same is None else same.hop_us, protocol.overhead_us)
    inter_hop = protocol.hop_us if r > 1 or protocol.alone_hop_us is None else protocol.alone_hop_us
    crossing = passes * (n - 1)
    latency = protocol.base_us + (passes * (group.size - 1) - crossing) * intra_hop + crossing * inter_hop
    rate = protocol.bandwidth_fraction * min(_inter_bandwidth(hw, group) * r,
                                             intra.effective_bytes_per_s if r > 1 else math.inf)
    if protocol.max_gbytes_per_s is not None:
        rate = min(rate, protocol.max_gbytes_per_s * 1e9)
    return latency * 1e-6 + moved / rate


def _tree_all_reduce(hw: HardwareProfile, group: Group, protocol: TreeProtocol, nbytes: float) -> float:
    """NCCL's tree all-reduce across nodes in one protocol, as its tuning model prices it (src/graph/tuning.cc): its
    base latency, then twice (up the tree and down) the node's chain of per_node - 1 NVLink steps and the
    floor(log2(nodes)) levels of the tree across the network; the data at half the algorithm bandwidth of its bus
    bandwidth (every byte goes up and comes down), a `bandwidth_fraction` of the ring's."""
    intra = hw.links.intra_node
    r, n = group.per_node, group.nodes
    latency = protocol.base_us + 2 * ((r - 1) * protocol.intra_hop_us + int(math.log2(n)) * protocol.hop_us)
    rate = protocol.bandwidth_fraction * min(_inter_bandwidth(hw, group) * r,
                                             intra.effective_bytes_per_s if r > 1 else math.inf)
    return latency * 1e-6 + 2 * nbytes / rate


def _ways(hw: HardwareProfile, group: Group, nbytes: float, op: str) -> list[tuple[float, str]]:
    """(seconds, how_it_runs) of each way the collective may run: the fastest runs (_ring)."""
    intra = hw.links.intra_node
    r, n = group.per_node, group.nodes
    passes = PASSES[op]
    measured = intra.measured(op) if n == 1 else None
    if measured is not None:
        steps, factor = collective_terms(op, group.size)
        return [(steps * measured.latency_us * 1e-6 + factor * nbytes / (measured.bandwidth_gbytes_per_s * 1e9),
                 "measured")]
    ways = [(_nvls_all_reduce(hw, group, nbytes), "nvls")] if passes == 2 else []
    moved = passes * (group.size - 1) / group.size * nbytes  # what each rank sends around the ring
    if n == 1 and intra.protocols:
        return ways + [(_protocol_ring(intra, p, passes * (r - 1), moved), p.name) for p in intra.protocols]
    if n > 1 and passes == 2:
        ways += [(_tree_all_reduce(hw, group, p, nbytes), f"tree-{p.name}") for p in hw.links.inter_node.tree]
    if n > 1 and hw.links.inter_node.protocols:
        return ways + [(_protocol_ring_across_nodes(hw, group, p, passes, moved), p.name)
                       for p in hw.links.inter_node.protocols]
    latency = passes * (r - 1) * intra.latency_us * 1e-6
    intra_time = moved / intra.effective_bytes_per_s if r > 1 else 0.0
    inter_time = 0.0
    if n > 1:
        latency += passes * (n - 1) * hw.links.inter_node.latency_us * 1e-6
        inter_time = moved / (_inter_bandwidth(hw, group) * r)
    return ways + [(latency + max(intra_time, inter_time), "ring")]


def _ring(hw: HardwareProfile, group: Group, nbytes: float, op: str) -> float:
    """`op`: all_gather or reduce_scatter (of an nbytes result: one pass of the ring), or all_reduce (two).

    In a node: a ring (or, for all-reduce where the switch reduces, NVLS where it is faster), in the fastest of the
    link's protocols where it lists them. Across nodes: NCCL's ring runs through every rank, so each rank sends
    passes (size - 1) / size of the data, and each node's network hop carries the whole ring's stream (the r ranks
    of the node pass it along over NVLink, one of them out of the node); the node's NICs are shared by the
    busy_per_node / per_node groups crossing it at once. The stream is pipelined in chunks through both links: every
    step's latency, and the slower link's bandwidth term."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return min(seconds for seconds, _ in _ways(hw, group, nbytes, op))


def all_reduce(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    return _ring(hw, group, nbytes, "all_reduce")


def all_gather(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    """nbytes: size of the gathered result on each rank."""
    return _ring(hw, group, nbytes, "all_gather")


def reduce_scatter(hw: HardwareProfile, group: Group, nbytes: float) -> float:
    """nbytes: size of the full input on each rank."""
    return _ring(hw, group, nbytes, "reduce_scatter")


def point_to_point(hw: HardwareProfile, nbytes: float, same_node: bool, busy_per_node: int = 1) -> float:
    if nbytes <= 0:
        return 0.0
    if same_node:
        link = hw.links.intra_node
        return _step(link, nbytes, link.effective_bytes_per_s)
    link = hw.links.inter_node
    return _step(link, nbytes, link.effective_bytes_per_s / max(1, busy_per_node))


def object_store_bytes(hw: HardwareProfile, nbytes: float) -> float:
    """The bytes of tensors handed from one of the executor's worker processes to another through Ray's object
    store (Links.object_store, which the profile must have), without a latency: the handover's fixed cost is the
    caller's, measured on its own path."""
    return nbytes / hw.links.object_store.effective_bytes_per_s


def host_transfer(hw: HardwareProfile, nbytes: float) -> float:
    """Device <-> host copy (data passing through the single controller)."""
    link = hw.links.host
    return _step(link, nbytes, link.effective_bytes_per_s)
