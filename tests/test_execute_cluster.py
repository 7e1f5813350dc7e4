"""Sets land where the plan says on a multi-node Ray cluster (two simulated nodes on this machine)."""

from __future__ import annotations

import os
import tempfile

import pytest

from hfplan.executor.controller import ExecuteOptions, execute
from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload

pytestmark = pytest.mark.slow


@pytest.fixture
def two_node_cluster(no_ray_driver):
    """A cluster of its own (two nodes); this process joins it only through the run's `--address`."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.TemporaryDirectory(prefix="hfray-")  # short: Ray's socket paths must stay under 108 bytes
    os.makedirs(os.path.join(temp.name, "ray"))
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp.name  # where cluster_utils records the cluster's address
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 2}, "include_dashboard": False, "temp_dir": temp.name,
        "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=2, resources={"node_b": 2}, node_ip_address="127.0.0.1", temp_dir=temp.name)
    cluster.wait_for_nodes()
    # cluster.address names the machine's address, but the nodes listen on loopback only: connect as
    # `hfplan execute --address 127.0.0.1:PORT` does.
    address = f"127.0.0.1:{cluster.address.rsplit(':', 1)[1]}"
    try:
        yield address
    finally:
        ray.shutdown()
        cluster.shutdown()
        temp.cleanup()
        if previous is None:
            os.environ.pop("RAY_TMPDIR")
        else:
            os.environ["RAY_TMPDIR"] = previous


def test_each_set_is_packed_on_one_node(two_node_cluster, tmp_path):
    import ray

    plan = cpu_plan(tiny_workload("grpo", ARITH_GRPO), [(("actor",), 2), (("reference",), 2)])
    plan = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpus_per_node": 2})})
    summary = execute(plan, ExecuteOptions(iterations=1, out=tmp_path / "run", address=two_node_cluster,
                                           call_timeout_s=120, start_timeout_s=120))
    ray.init(address=two_node_cluster, logging_level="ERROR", log_to_driver=False)
    placed: dict[str, set[str]] = {}
    for worker, node in summary.nodes.items():
        placed.setdefault(worker.split(" rank")[0], set()).add(node)
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2
    assert set(placed) == {"set 0", "set 1"}
    assert all(len(ids) == 1 for ids in placed.values()), placed
    assert placed["set 0"] != placed["set 1"]
    assert placed["set 0"] | placed["set 1"] == nodes
