"""Alpha-beta collectives, by hand, on the toy profile of conftest.py:
intra-node 5e10 B/s per GPU with alpha 1 us; inter-node 8e9 B/s per node with alpha 10 us."""

import pytest

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
    # 1 KiB over 8 GPUs of one node (ring: 14 steps) and over 2 nodes of 8 (14 NVLink and 2 network steps).
    from hfplan.profiles.hardware import load_hardware

    hw = load_hardware("a100-80g")
    intra, inter = hw.links.intra_node.latency_us * 1e-6, hw.links.inter_node.latency_us * 1e-6
    assert coll.all_reduce(hw, Group(8, 8, 8), 1024) >= 14 * intra
    assert coll.all_reduce(hw, Group(16, 8, 8), 1024) >= 14 * intra + 2 * inter
    assert coll.all_reduce(hw, Group(8, 8, 8), 1024) < 1.01 * 14 * intra  # the bytes are nothing beside it


def test_shipped_profiles_reduce_in_the_switch_only_on_hopper():
    from hfplan.profiles.hardware import load_hardware

    assert [load_hardware(n).links.intra_node.nvls for n in ("a100-80g", "h100-80g", "h200-141g", "cpu")] == [
        False, True, True, False]
