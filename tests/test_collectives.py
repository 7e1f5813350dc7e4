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
    # 16 ranks, 8 per node, all 8 GPUs of each node busy. Intra part: reduce-scatter and all-gather in
    # the node (2 * 7/8 of N over NVLink). Inter part: a ring of 2 nodes over N/8 bytes per GPU, each
    # GPU getting 1/8 of the node's network bandwidth.
    intra = 2 * 7 * INTRA_ALPHA + 2 * 7 / 8 * N / INTRA_BW
    # NCCL pipelines the phases: every latency is paid, and the slower link's bandwidth term.
    latency = 2 * 7 * INTRA_ALPHA + 2 * 1 * INTER_ALPHA
    intra = 2 * 7 / 8 * N / INTRA_BW  # 35 ms
    inter = 2 * 1 / 2 * (N / 8) / (INTER_BW / 8)  # 125 ms: the network is the bottleneck
    assert coll.all_reduce(toy_hw, Group(16, 8, 8), N) == pytest.approx(latency + max(intra, inter), rel=1e-12)


def test_all_gather_one_rank_per_node_by_hand(toy_hw):
    # DP 4 across 4 nodes (one rank each), the node's other 7 GPUs busy with their own DP groups.
    expected = 3 * INTER_ALPHA + 3 / 4 * N / (INTER_BW / 8)
    assert coll.all_gather(toy_hw, Group(4, 1, 8), N) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_two_per_node_by_hand(toy_hw):
    # 8 ranks, 2 per node on 4 nodes, 2 busy GPUs per node.
    latency = 2 * 1 * INTRA_ALPHA + 2 * 3 * INTER_ALPHA
    intra = 2 * 1 / 2 * N / INTRA_BW
    inter = 2 * 3 / 4 * (N / 2) / (INTER_BW / 2)
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


def test_two_level_phases_overlap_where_the_intra_node_link_is_the_slower(toy_hw):
    # A fast network (80e9 B/s per node, 10 GPUs' worth): 16 ranks, 8 per node, all 8 GPUs busy.
    fast = toy_hw.model_copy(update={"links": toy_hw.links.model_copy(update={
        "inter_node": toy_hw.links.inter_node.model_copy(update={"bandwidth_gbytes_per_s": 100})})})
    latency = 2 * 7 * INTRA_ALPHA + 2 * 1 * INTER_ALPHA
    intra = 2 * 7 / 8 * N / INTRA_BW  # 35 ms over NVLink
    inter = 2 * 1 / 2 * (N / 8) / (80e9 / 8)  # 12.5 ms over the network, hidden behind NVLink
    assert coll.all_reduce(fast, Group(16, 8, 8), N) == pytest.approx(latency + intra, rel=1e-12)
    assert intra > inter


def nvls(hw):
    return hw.model_copy(update={"links": hw.links.model_copy(update={
        "intra_node": hw.links.intra_node.model_copy(update={"nvls": True})})})


def test_nvls_all_reduce_in_a_node_by_hand(toy_hw):
    # NVLink SHARP: each GPU sends N to the switch and receives the reduced N: two steps, N / bandwidth.
    assert coll.all_reduce(nvls(toy_hw), Group(8, 8, 8), N) == pytest.approx(2 * INTRA_ALPHA + N / INTRA_BW)
    ring = coll.all_reduce(toy_hw, Group(8, 8, 8), N)
    assert ring / coll.all_reduce(nvls(toy_hw), Group(8, 8, 8), N) == pytest.approx(1.75, rel=1e-3)  # 2 x 7/8
    # All-gather and reduce-scatter keep the ring.
    assert coll.all_gather(nvls(toy_hw), Group(8, 8, 8), N) == coll.all_gather(toy_hw, Group(8, 8, 8), N)


def test_nvls_two_level_all_reduce_by_hand(toy_hw):
    latency = 2 * INTRA_ALPHA + 2 * 1 * INTER_ALPHA
    intra = N / INTRA_BW
    inter = 2 * 1 / 2 * (N / 8) / (INTER_BW / 8)
    assert coll.all_reduce(nvls(toy_hw), Group(16, 8, 8), N) == pytest.approx(latency + max(intra, inter))


def test_shipped_profiles_reduce_in_the_switch_only_on_hopper():
    from hfplan.profiles.hardware import load_hardware

    assert [load_hardware(n).links.intra_node.nvls for n in ("a100-80g", "h100-80g", "h200-141g", "cpu")] == [
        False, True, True, False]
