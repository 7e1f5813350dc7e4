"""The private torch and Ray APIs of hfplan.executor.compat are still there and still do what hfplan relies on.

A failure here after an upgrade names the API that moved; fix compat.py (and the README's upgrading notes),
nothing else. The end-to-end uses run in the executor's tests (test_execute_cluster: loopback; test_faults:
the failed worker's rank from its actor id; test_checkpoint: DCP round trips).
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hfplan
from hfplan.executor import compat


def test_the_loopback_switch_keeps_a_loopback_address_as_ray_init_resolves_it():
    """In a fresh process: a test process already connected to a Ray answers with that node's address."""
    pytest.importorskip("ray")
    resolve = ("from ray._private import services; from hfplan.executor import compat; "
               "compat.reach_clusters_through_loopback(); "
               "print(services.canonicalize_bootstrap_address('127.0.0.1:6379'))")
    root = str(Path(hfplan.__file__).parent.parent)
    out = subprocess.run([sys.executable, "-c", resolve], capture_output=True, text=True, timeout=120, check=True,
                         env=os.environ | {"PYTHONPATH": root}).stdout.split()
    assert out == ["127.0.0.1:6379"], out  # without the switch Ray turns it into this machine's address


def test_ray_init_still_documents_the_local_options():
    ray = pytest.importorskip("ray")
    doc = inspect.getdoc(ray.init)
    for name in compat.local_ray_options("/tmp"):
        assert f"``{name}``" in doc, f"ray.init no longer documents {name}"


def test_an_actor_handle_still_has_the_id_a_dead_actor_error_names():
    ray = pytest.importorskip("ray")
    assert isinstance(inspect.getattr_static(ray.actor.ActorHandle, "_actor_id"), property)
    assert "actor_id" in inspect.signature(ray.exceptions.RayActorError.__init__).parameters
    assert ray.ActorID.nil().hex() == "ff" * len(ray.ActorID.nil().binary())


def test_every_class_dcp_metadata_may_name_still_exists():
    pytest.importorskip("torch")
    for module, names in compat.DCP_METADATA_CLASSES.items():
        for name in names:
            assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_of_this_torch_names_only_those_classes(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from hfplan.executor.checkpoint import read_metadata

    state = {"weight": torch.arange(6.0).reshape(2, 3), "settings": {"lr": 0.1, "betas": (0.9, 0.95)}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    metadata = read_metadata(tmp_path)  # refuses any class outside DCP_METADATA_CLASSES
    assert "weight" in metadata.state_dict_metadata


def test_the_raylets_reports_still_reach_the_terminal_through_the_function_compat_replaces(tmp_path):
    """Ray's error listener looks `print_to_stdstream` up at each call, so replacing the module function
    reroutes it; a raylet report then lands in the log, other output is still printed, and undoing it puts
    Ray's function back."""
    pytest.importorskip("ray")
    from ray._private import worker as ray_worker

    assert "print_to_stdstream" in ray_worker.listen_error_messages.__code__.co_names
    original, log = ray_worker.print_to_stdstream, tmp_path / "ray.log"
    printed = []

    def terminal(data, ignore_prefix):
        printed.append(data)

    ray_worker.print_to_stdstream = terminal
    try:
        restore = compat.raylet_reports_into(log)
        ray_worker.print_to_stdstream({"lines": ["A worker died"], "pid": "raylet", "is_err": False},
                                      ignore_prefix=False)
        ray_worker.print_to_stdstream({"lines": ["hello"], "pid": 42, "is_err": False}, ignore_prefix=False)
        restore()
        assert ray_worker.print_to_stdstream is terminal
        assert log.read_text() == "(raylet) A worker died\n"
        assert [d["lines"] for d in printed] == [["hello"]]
    finally:
        ray_worker.print_to_stdstream = original
