"""Alpha-beta collectives, by hand, on the toy profile of conftest.py:
intra-node 5e10 B/s per GPU with alpha 1 us; inter-node 8e9 B/s per node with alpha 10 us."""

import pytest

from hfplan.profiles.hardware import Protocol
from hfplan.simulator import collectives as coll
from hfplan.simulator.collectives import Group, group_of

INTRA_BW, INTRA_ALPHA = 100e9 * 0.5, 1e-6
INTER_BW, INTER_ALPHA = 10e9 * 0.8, 10e-6
N = 1e9  # bytes


@pytest.mark.parametrize(
    ("size", "stride", "set_per_node", "shape"),
    [
        (1, 1, 8, (1, 1, 8)),  # a group of one
        (8, 1, 8, (8, 8, 8)),  # TP 8 in one node
        (4, 2, 8, (4, 4, 8)),  # DP 4 strided by TP 2: ranks 0, 2, 4, 6, one node
        (16, 1, 8, (16, 8, 8)),  # 16 adjacent ranks: two nodes of 8
        (4, 8, 8, (4, 1, 8)),  # DP 4 strided by TP 8: one rank on each of four nodes
        (4, 4, 8, (4, 2, 8)),  # ranks 0, 4 | 8, 12
        (8, 1, 2, (8, 2, 2)),  # a set using 2 GPUs of each node
        (2, 4, 4, (2, 1, 4)),  # ranks 0 | 4 with 4 per node
        (4, 1, 4, (4, 4, 4)),
    ],
)
def test_group_of_shapes(size, stride, set_per_node, shape):
    group = group_of(size, stride, set_per_node)
    assert (group.size, group.per_node, group.busy_per_node) == shape
    assert group.nodes == shape[0] // shape[1]


@pytest.mark.parametrize(("size", "per_node"), [(0, 1), (4, 0), (4, 8), (6, 4)])
def test_bad_group_shape_is_refused(size, per_node):
    with pytest.raises(ValueError, match="bad group shape"):
        Group(size, per_node, 8)


def test_all_reduce_intra_node_by_hand(toy_hw):
    # Ring of 8: 2 * 7 steps of alpha, each GPU sends and receives 2 * 7/8 of the data.
    expected = 2 * 7 * INTRA_ALPHA + 2 * 7 / 8 * N / INTRA_BW
    assert coll.all_reduce(toy_hw, Group(8, 8, 8), N) == pytest.approx(expected, rel=1e-12)


def test_all_gather_and_reduce_scatter_intra_node_by_hand(toy_hw):
    expected = 3 * INTRA_ALPHA + 3 / 4 * N / INTRA_BW
    assert coll.all_gather(toy_hw, Group(4, 4, 8), N) == pytest.approx(expected, rel=1e-12)
    assert coll.reduce_scatter(toy_hw, Group(4, 4, 8), N) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_is_reduce_scatter_plus_all_gather(toy_hw):
    for group in (Group(8, 8, 8), Group(16, 8, 8), Group(4, 1, 8), Group(8, 2, 2)):
        both = coll.reduce_scatter(toy_hw, group, N) + coll.all_gather(toy_hw, group, N)
        assert coll.all_reduce(toy_hw, group, N) == pytest.approx(both, rel=1e-12)


def test_all_reduce_spanning_two_nodes_by_hand(toy_hw):
    # 16 ranks, 8 per node, all 8 GPUs of each node busy. NCCL's ring runs through all 16: each rank sends
    # 2 * 15/16 of the data, over NVLink and, at each node boundary, over the node's whole network (one ring).
    latency = 2 * 7 * INTRA_ALPHA + 2 * 1 * INTER_ALPHA
    moved = 2 * 15 / 16 * N
    intra, inter = moved / INTRA_BW, moved / INTER_BW  # 37.5 ms, 234 ms: the network is the bottleneck
    assert coll.all_reduce(toy_hw, Group(16, 8, 8), N) == pytest.approx(latency + max(intra, inter), rel=1e-12)


def test_two_node_all_reduce_is_never_faster_than_its_slower_phase_plus_the_fill(toy_hw):
    # The phases of a hierarchical scheme (reduce-scatter and all-gather in the node; the inter-node ring on 1/8 of
    # the data per GPU, on its 1/8 of the NICs) bound the ring from below, with every step's latency (the fill).
    latency = 2 * 7 * INTRA_ALPHA + 2 * 1 * INTER_ALPHA
    for inter_gbytes in (1, 10, 100, 1000):
        hw = toy_hw.model_copy(update={"links": toy_hw.links.model_copy(update={
            "inter_node": toy_hw.links.inter_node.model_copy(update={"bandwidth_gbytes_per_s": inter_gbytes})})})
        bandwidth = inter_gbytes * 1e9 * 0.8
        intra_phase = 2 * 7 / 8 * N / INTRA_BW
        inter_phase = 2 * 1 / 2 * (N / 8) / (bandwidth / 8)
        assert coll.all_reduce(hw, Group(16, 8, 8), N) >= latency + max(intra_phase, inter_phase)


def test_all_gather_one_rank_per_node_by_hand(toy_hw):
    # DP 4 across 4 nodes (one rank each), the node's other 7 GPUs busy with their own DP groups.
    expected = 3 * INTER_ALPHA + 3 / 4 * N / (INTER_BW / 8)
    assert coll.all_gather(toy_hw, Group(4, 1, 8), N) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_two_per_node_by_hand(toy_hw):
    # 8 ranks, 2 per node on 4 nodes, 2 busy GPUs per node: the ring's stream crosses each node boundary on the
    # node's whole network (2 groups' worth of NICs shared by 2 busy GPUs, one group).
    latency = 2 * 1 * INTRA_ALPHA + 2 * 3 * INTER_ALPHA
    moved = 2 * 7 / 8 * N
    intra, inter = moved / INTRA_BW, moved / INTER_BW
    assert coll.all_reduce(toy_hw, Group(8, 2, 2), N) == pytest.approx(latency + max(intra, inter), rel=1e-12)


def test_more_busy_gpus_per_node_slow_inter_node_collectives(toy_hw):
    times = [coll.all_reduce(toy_hw, Group(4, 1, busy), N) for busy in (1, 2, 4, 8)]
    assert times == sorted(times) and len(set(times)) == 4
    # Only the bandwidth term scales with the number of GPUs sharing the NICs.
    bandwidth_term = 2 * 3 / 4 * N / INTER_BW
    assert times[3] - times[0] == pytest.approx(7 * bandwidth_term, rel=1e-9)


def test_busy_gpus_do_not_slow_intra_node_collectives(toy_hw):
    assert coll.all_reduce(toy_hw, Group(8, 8, 8), N) == coll.all_reduce(toy_hw, Group(8, 8, 1), N)


def test_spanning_nodes_is_slower_than_staying_in_one(toy_hw):
    assert coll.all_reduce(toy_hw, Group(8, 4, 4), N) > coll.all_reduce(toy_hw, Group(8, 8, 8), N)


def test_trivial_collectives_cost_nothing(toy_hw):
    assert coll.all_reduce(toy_hw, Group(1, 1, 8), N) == 0.0
    assert coll.all_gather(toy_hw, Group(8, 8, 8), 0) == 0.0
    assert coll.point_to_point(toy_hw, 0, same_node=False) == 0.0


def test_point_to_point_by_hand(toy_hw):
    assert coll.point_to_point(toy_hw, N, same_node=True) == pytest.approx(N / INTRA_BW + INTRA_ALPHA)
    assert coll.point_to_point(toy_hw, N, same_node=False) == pytest.approx(N / INTER_BW + INTER_ALPHA)
    assert coll.point_to_point(toy_hw, N, same_node=False, busy_per_node=4) == pytest.approx(
        N / (INTER_BW / 4) + INTER_ALPHA)


def test_host_transfer_by_hand(toy_hw):
    assert coll.host_transfer(toy_hw, N) == pytest.approx(N / (20e9 * 0.5) + 3e-6)


def test_ring_across_nodes_is_bound_by_nvlink_where_the_network_is_faster(toy_hw):
    # A fast network (80e9 B/s per node): 16 ranks, 8 per node, all 8 GPUs busy.
    fast = toy_hw.model_copy(update={"links": toy_hw.links.model_copy(update={
        "inter_node": toy_hw.links.inter_node.model_copy(update={"bandwidth_gbytes_per_s": 100})})})
    latency = 2 * 7 * INTRA_ALPHA + 2 * 1 * INTER_ALPHA
    moved = 2 * 15 / 16 * N
    intra, inter = moved / INTRA_BW, moved / 80e9  # the network's share is hidden behind NVLink's
    assert coll.all_reduce(fast, Group(16, 8, 8), N) == pytest.approx(latency + intra, rel=1e-12)
    assert intra > inter


def nvls(hw, efficiency=None):
    return hw.model_copy(update={"links": hw.links.model_copy(update={
        "intra_node": hw.links.intra_node.model_copy(update={"nvls": True, "nvls_efficiency": efficiency})})})


def test_nvls_all_reduce_in_a_node_by_hand(toy_hw):
    # NVLink SHARP: each GPU's link carries its whole buffer to the switch and its reduced chunk back out, and the
    # reduced chunks of all 8 in: N (1 + 1/8) each way, in two steps; NVLS's rate unset: the link's (5e10 B/s).
    expected = 2 * INTRA_ALPHA + 1.125 * N / INTRA_BW
    assert coll.all_reduce(nvls(toy_hw), Group(8, 8, 8), N) == pytest.approx(expected)
    ring = coll.all_reduce(toy_hw, Group(8, 8, 8), N)
    assert ring == pytest.approx(14 * INTRA_ALPHA + 1.75 * N / INTRA_BW)  # 2 x 7/8
    assert coll.uses_nvls(nvls(toy_hw), Group(8, 8, 8), N)
    # All-gather and reduce-scatter keep the ring.
    assert coll.all_gather(nvls(toy_hw), Group(8, 8, 8), N) == coll.all_gather(toy_hw, Group(8, 8, 8), N)


def test_nvls_runs_at_its_own_rate_and_only_where_faster_than_the_ring(toy_hw):
    # At 0.4 of the 100 GB/s link: 1.125 N / 4e10 = 28.1 ms, faster than the ring's 35.0 ms on 8 GPUs.
    slow = nvls(toy_hw, 0.4)
    assert coll.all_reduce(slow, Group(8, 8, 8), N) == pytest.approx(2 * INTRA_ALPHA + 1.125 * N / 4e10)
    # At 0.25: 45 ms, slower than the ring: NCCL's tuner runs the ring.
    slower = nvls(toy_hw, 0.25)
    assert coll.all_reduce(slower, Group(8, 8, 8), N) == coll.all_reduce(toy_hw, Group(8, 8, 8), N)
    assert not coll.uses_nvls(slower, Group(8, 8, 8), N)
    # A pair: NVLS moves 1.5 N each way (30 ms), the ring N (20 ms): the ring.
    assert coll.all_reduce(nvls(toy_hw), Group(2, 2, 2), N) == pytest.approx(2 * INTRA_ALPHA + N / INTRA_BW)
    assert not coll.uses_nvls(nvls(toy_hw), Group(2, 2, 2), N)


def test_nvls_is_not_used_across_nodes(toy_hw):
    # NCCL runs NVLS across nodes only with CollNet: a group spanning nodes takes the ring.
    assert coll.all_reduce(nvls(toy_hw), Group(16, 8, 8), N) == coll.all_reduce(toy_hw, Group(16, 8, 8), N)


def test_a_small_all_reduce_costs_at_least_its_latency():
    # 1 KiB over 2 nodes of 8 (14 NVLink and 2 network steps, the profile's latency per step) and in one node, where
    # the profile lists NCCL's protocols: LL, 6.6 us + 14 x 0.6 us (test_protocols_of_the_a100_profile_by_hand).
    from hfplan.profiles.hardware import load_hardware

    hw = load_hardware("a100-80g")
    # across nodes, NCCL's LL tree (the inter-node link's tree): 6.8 us, then up and down the node's chain of 7
    # NVLink steps at 0.6 us and 1 level of the tree at 5 us; its LL ring would take 6.6 + 28 x 1 + 2 x 2.7 us
    assert coll.all_reduce(hw, Group(16, 8, 8), 1024) >= (6.8 + 2 * (7 * 0.6 + 5.0)) * 1e-6
    assert coll.how_it_runs(hw, Group(16, 8, 8), 1024, "all_reduce") == "tree-LL"
    assert coll.all_gather(hw, Group(16, 8, 8), 1024) >= (6.6 + 14 * 1.0 + 2.7) * 1e-6  # no tree: the LL ring
    assert coll.all_reduce(hw, Group(8, 8, 8), 1024) >= (6.6 + 14 * 0.6) * 1e-6
    assert coll.all_reduce(hw, Group(8, 8, 8), 1024) < 1.01 * (6.6 + 14 * 0.6) * 1e-6  # the bytes are nothing


def protocols(hw, *rows, nvls_latency_us=None):
    """hw with its intra-node link listing the protocols (name, base_us, hop_us, fraction, cap GB/s)."""
    listed = tuple(Protocol(name=n, base_us=b, hop_us=h, bandwidth_fraction=f, max_gbytes_per_s=c)
                   for n, b, h, f, c in rows)
    return hw.model_copy(update={"links": hw.links.model_copy(update={
        "intra_node": hw.links.intra_node.model_copy(update={"protocols": listed,
                                                              "nvls_latency_us": nvls_latency_us})})})


FAST_START = ("FAST_START", 5.0, 0.5, 0.5, 20.0)  # 5 us + 0.5 us a step, half the 5e10 B/s link, at most 2e10 B/s
FULL_RATE = ("FULL_RATE", 10.0, 2.0, 1.0, None)  # 10 us + 2 us a step, the whole link


@pytest.mark.parametrize(("nbytes", "expected", "runs_as"), [
    # 8 KiB all-reduce on 8 GPUs: 14 steps, each rank sends 2 x 7/8 x 8192 = 14336 bytes.
    (8192, 5e-6 + 14 * 0.5e-6 + 14336 / 20e9, "FAST_START"),  # 12.0 us + 0.7 us; FULL_RATE 38 us
    # 64 MiB: FAST_START 12 us + 5.87 ms, FULL_RATE 38 us + 2.35 ms.
    (64 * 2**20, 10e-6 + 14 * 2e-6 + 1.75 * 64 * 2**20 / INTRA_BW, "FULL_RATE"),
])
def test_a_ring_in_a_node_runs_its_fastest_protocol_by_hand(toy_hw, nbytes, expected, runs_as):
    hw = protocols(toy_hw, FAST_START, FULL_RATE)
    assert coll.all_reduce(hw, Group(8, 8, 8), nbytes) == pytest.approx(expected, rel=1e-12)
    assert coll.how_it_runs(hw, Group(8, 8, 8), nbytes, "all_reduce") == runs_as
    # The profile's one latency per step is no longer paid in the node: 14 x 1 us + the bytes at the full rate.
    assert coll.all_reduce(toy_hw, Group(8, 8, 8), nbytes) == pytest.approx(14e-6 + 1.75 * nbytes / INTRA_BW)
    assert coll.how_it_runs(toy_hw, Group(8, 8, 8), nbytes, "all_reduce") == "ring"


def test_all_gather_by_protocol_by_hand(toy_hw):
    # 4 ranks: 3 steps, each rank sends 3/4 of 4 KiB = 3072 bytes; FAST_START 5 + 1.5 us + 0.15 us.
    hw = protocols(toy_hw, FAST_START, FULL_RATE)
    assert coll.all_gather(hw, Group(4, 4, 8), 4096) == pytest.approx(6.5e-6 + 3072 / 20e9, rel=1e-12)
    assert coll.reduce_scatter(hw, Group(4, 4, 8), 4096) == coll.all_gather(hw, Group(4, 4, 8), 4096)


def test_rings_spanning_nodes_keep_the_latency_per_step(toy_hw):
    # The protocols describe a node's link alone: a ring through two nodes pays each link's latency_us per step.
    hw = protocols(toy_hw, FAST_START, FULL_RATE)
    for group in (Group(16, 8, 8), Group(4, 1, 8), Group(8, 2, 2)):
        assert coll.all_reduce(hw, group, 8192) == coll.all_reduce(toy_hw, group, 8192)


def across_nodes(hw, *rows):
    """hw with its inter-node link listing the protocols (name, base_us, hop_us, alone_hop_us, overhead_us,
    fraction)."""
    listed = tuple(Protocol(name=n, base_us=b, hop_us=h, alone_hop_us=a, overhead_us=o, bandwidth_fraction=f)
                   for n, b, h, a, o, f in rows)
    return hw.model_copy(update={"links": hw.links.model_copy(update={
        "inter_node": hw.links.inter_node.model_copy(update={"protocols": listed})})})


NET_FAST = ("FAST_START", 5.0, 3.0, 6.0, 1.0, 0.5)  # beside the node's FAST_START (0.5 us a step)
NET_FULL = ("FULL_RATE", 10.0, 12.0, 12.0, 3.0, 1.0)  # beside the node's FULL_RATE (2 us a step)


@pytest.mark.parametrize(("group", "nbytes", "expected", "runs_as"), [
    # 16 ranks on 2 nodes: 30 steps, 2 across the network. 8 KiB (each rank sends 15360 bytes): FAST_START 5 us +
    # 28 x max(0.5, 1) + 2 x 3 us = 39 us, the bytes at half of min(8 GPUs x 1e9 B/s of the NICs, NVLink 5e10);
    # FULL_RATE 10 + 28 x 3 + 2 x 12 = 118 us + 1.9 us.
    (Group(16, 8, 8), 8192, 39e-6 + 15360 / 4e9, "FAST_START"),
    # 1e9 bytes: FULL_RATE 118 us + 1.875e9 / 8e9 beats FAST_START's 39 us + 1.875e9 / 4e9.
    (Group(16, 8, 8), N, 118e-6 + 1.875 * N / 8e9, "FULL_RATE"),
    # one rank on each of 4 nodes (8 GPUs of each busy): 6 steps, all across the network, at the alone latency:
    # FAST_START 5 + 6 x 6 = 41 us + 12288 bytes at half of 1e9 B/s; FULL_RATE 82 us + 12.3 us.
    (Group(4, 1, 8), 8192, 41e-6 + 12288 / 0.5e9, "FAST_START"),
])
def test_rings_spanning_nodes_run_the_networks_protocols_by_hand(toy_hw, group, nbytes, expected, runs_as):
    hw = across_nodes(protocols(toy_hw, FAST_START, FULL_RATE), NET_FAST, NET_FULL)
    assert coll.all_reduce(hw, group, nbytes) == pytest.approx(expected, rel=1e-12)
    assert coll.how_it_runs(hw, group, nbytes, "all_reduce") == runs_as
    # all-gather: half the steps across (1 of 15), half the bytes
    if group == Group(16, 8, 8) and nbytes == 8192:
        assert coll.all_gather(hw, group, nbytes) == pytest.approx((5 + 14 * 1.0 + 3) * 1e-6 + 7680 / 4e9)


def test_a_ring_spanning_nodes_is_never_faster_than_its_slower_phase_plus_the_latency(toy_hw):
    # with the network's protocols and its tree as without: every step's latency (the fill: the least of the
    # rings' and the tree's) and the slower link's bytes (the tree sends more of them)
    hw = with_tree(across_nodes(protocols(toy_hw, FAST_START, FULL_RATE), NET_FAST, NET_FULL), TREE_FAST)
    for nbytes in (1024, 2**20, N):
        moved = 2 * 15 / 16 * nbytes
        fill = min(5 + 28 * 1.0 + 2 * 3, 10 + 28 * 3 + 2 * 12, 4 + 2 * (7 * 0.5 + 5)) * 1e-6
        slower = max(moved / INTRA_BW, moved / INTER_BW)
        assert coll.all_reduce(hw, Group(16, 8, 8), nbytes) >= fill + slower


def with_tree(hw, *rows):
    """hw with its inter-node link listing tree protocols (name, base_us, intra_hop_us, hop_us, fraction)."""
    from hfplan.profiles.hardware import TreeProtocol

    listed = tuple(TreeProtocol(name=n, base_us=b, intra_hop_us=i, hop_us=h, bandwidth_fraction=f)
                   for n, b, i, h, f in rows)
    return hw.model_copy(update={"links": hw.links.model_copy(update={
        "inter_node": hw.links.inter_node.model_copy(update={"tree": listed})})})


TREE_FAST = ("FAST_START", 4.0, 0.5, 5.0, 0.25)


@pytest.mark.parametrize(("group", "nbytes", "expected", "runs_as"), [
    # 2 nodes of 8: 4 us + 2 x (7 chain steps x 0.5 us + 1 tree level x 5 us) = 21 us, then 2 x 8 KiB at a quarter
    # of the ring's 8e9 B/s; the FAST_START ring takes 42.8 us (test_rings_spanning_nodes_run_the_networks_...)
    (Group(16, 8, 8), 8192, 21e-6 + 2 * 8192 / 2e9, "tree-FAST_START"),
    # 8 nodes of 8: 3 levels, 4 + 2 x (3.5 + 15) = 41 us + 8.2 us; the ring: 5 + 112 x 1 + 14 x 3 us + 4 us
    (Group(64, 8, 8), 8192, 41e-6 + 2 * 8192 / 2e9, "tree-FAST_START"),
    # 1e9 bytes: the tree's 1 s against the FULL_RATE ring's 0.23 s
    (Group(16, 8, 8), N, 118e-6 + 1.875 * N / 8e9, "FULL_RATE"),
])
def test_an_all_reduce_across_nodes_may_run_the_tree_by_hand(toy_hw, group, nbytes, expected, runs_as):
    hw = with_tree(across_nodes(protocols(toy_hw, FAST_START, FULL_RATE), NET_FAST, NET_FULL), TREE_FAST)
    assert coll.all_reduce(hw, group, nbytes) == pytest.approx(expected, rel=1e-12)
    assert coll.how_it_runs(hw, group, nbytes, "all_reduce") == runs_as
    # the tree is an all-reduce's only: an all-gather keeps the ring; in one node there is no tree
    ring_only = across_nodes(protocols(toy_hw, FAST_START, FULL_RATE), NET_FAST, NET_FULL)
    assert coll.all_gather(hw, group, nbytes) == coll.all_gather(ring_only, group, nbytes)
    assert coll.all_reduce(hw, Group(8, 8, 8), nbytes) == coll.all_reduce(ring_only, Group(8, 8, 8), nbytes)


def test_nvls_latency_by_hand(toy_hw):
    # NVLS with its own latency (25 us) against the protocols' rings: 8 KiB takes FAST_START's 12.7 us ring, 1 GiB
    # NVLS's 25 us + 1.125 GiB / 5e10 B/s.
    hw = nvls(protocols(toy_hw, FAST_START, FULL_RATE, nvls_latency_us=25.0))
    assert coll.how_it_runs(hw, Group(8, 8, 8), 8192, "all_reduce") == "FAST_START"
    assert not coll.uses_nvls(hw, Group(8, 8, 8), 8192)
    assert coll.all_reduce(hw, Group(8, 8, 8), N) == pytest.approx(25e-6 + 1.125 * N / INTRA_BW, rel=1e-12)
    assert coll.uses_nvls(hw, Group(8, 8, 8), N)


def test_protocols_of_the_a100_profile_by_hand():
    """NCCL's tuning model (src/graph/tuning.cc, 2.21.5 to 2.30.7) on 8 A100s, bus bandwidth 300 x 0.77 GB/s: an
    8 KiB all-reduce (a decode step's tensor-parallel one) runs LL, 6.6 + 14 x 0.6 us + 14336 bytes at LL's cap of
    87.7 GB/s; 1 GiB runs Simple, 8.4 + 14 x 3.4 us + 2 x 7/8 GiB at the full rate; between, LL128."""
    from hfplan.profiles.hardware import load_hardware

    hw = load_hardware("a100-80g")
    small = coll.all_reduce(hw, Group(8, 8, 8), 8192)
    assert small == pytest.approx((6.6 + 14 * 0.6) * 1e-6 + 14336 / 87.7e9, rel=1e-12)
    assert coll.how_it_runs(hw, Group(8, 8, 8), 8192, "all_reduce") == "LL"
    large = coll.all_reduce(hw, Group(8, 8, 8), 2**30)
    assert large == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + 1.75 * 2**30 / (300e9 * 0.77), rel=1e-12)
    assert coll.how_it_runs(hw, Group(8, 8, 8), 2**30, "all_reduce") == "Simple"
    # 4 MiB (each rank sends 1.75 x 4 MiB = 7,340,032 bytes): LL 15.0 + 83.7 us; LL128 14 + 14 x 1.9 = 40.6 us +
    # the bytes at 0.92 x 231 GB/s, 34.5 us; Simple 56.0 + 31.8 us.
    mid = coll.all_reduce(hw, Group(8, 8, 8), 4 * 2**20)
    assert mid == pytest.approx(40.6e-6 + 7340032 / (0.92 * 300e9 * 0.77), rel=1e-12)
    assert coll.how_it_runs(hw, Group(8, 8, 8), 4 * 2**20, "all_reduce") == "LL128"


def test_collective_time_never_falls_as_the_message_grows():
    from hfplan.profiles.hardware import load_hardware

    for name in ("a100-80g", "h100-80g"):
        hw = load_hardware(name)
        for group in (Group(2, 2, 8), Group(8, 8, 8)):
            times = [coll.all_reduce(hw, group, 2.0**k) for k in range(0, 34)]
            assert times == sorted(times)


def test_shipped_profiles_reduce_in_the_switch_only_on_hopper():
    from hfplan.profiles.hardware import load_hardware

    assert [load_hardware(n).links.intra_node.nvls for n in ("a100-80g", "h100-80g", "h200-141g", "cpu")] == [
        False, True, True, False]


def test_a_collective_measured_on_its_own_costs_its_own_fit_in_a_node_only(toy_hw):
    """gloo's reduce-scatter measured at 1.2 ms a step and 0.7 GB/s (Link.collectives): in a node it costs that
    fit (3 steps and 3/4 of the input on a ring of 4), by hand; the other collectives keep the link's, and a group
    spanning nodes the ring across them."""
    from hfplan.profiles.hardware import MeasuredCollective

    measured = MeasuredCollective(op="reduce_scatter", latency_us=1200.0, bandwidth_gbytes_per_s=0.7)
    links = toy_hw.links.model_copy(update={"intra_node": toy_hw.links.intra_node.model_copy(
        update={"collectives": (measured,)})})
    hw = toy_hw.model_copy(update={"links": links})
    assert coll.reduce_scatter(hw, Group(4, 4, 8), N) == pytest.approx(3 * 1.2e-3 + 3 / 4 * N / 0.7e9, rel=1e-12)
    assert coll.how_it_runs(hw, Group(4, 4, 8), N, "reduce_scatter") == "measured"
    assert coll.all_gather(hw, Group(4, 4, 8), N) == pytest.approx(coll.all_gather(toy_hw, Group(4, 4, 8), N))
    assert coll.reduce_scatter(hw, Group(16, 8, 8), N) == pytest.approx(coll.reduce_scatter(toy_hw, Group(16, 8, 8),
                                                                                             N))
