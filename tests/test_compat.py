"""The private Ray APIs of hfplan.executor.compat are still there and still do what hfplan relies on.

A failure here after an upgrade names the API that moved; fix compat.py (and the README's upgrading notes),
nothing else. The end-to-end uses run in the executor's tests (test_execute_cluster: loopback; test_faults:
the failed worker's rank from its actor id).
"""

from __future__ import annotations

import inspect

import pytest

ray = pytest.importorskip("ray")

from hfplan.executor import compat  # noqa: E402


def test_the_loopback_switch_keeps_a_loopback_address_as_ray_init_resolves_it():
    from ray._private import ray_constants, services

    before = ray_constants.ENABLE_RAY_CLUSTER
    try:
        compat.reach_clusters_through_loopback()
        assert ray_constants.ENABLE_RAY_CLUSTER is False
        # what ray.init does with an address before connecting to it
        assert services.canonicalize_bootstrap_address("127.0.0.1:6379") == "127.0.0.1:6379"
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def test_ray_init_still_documents_the_local_options():
    doc = inspect.getdoc(ray.init)
    for name in compat.local_ray_options("/tmp"):
        assert f"``{name}``" in doc, f"ray.init no longer documents {name}"


def test_an_actor_handle_still_has_the_id_a_dead_actor_error_names():
    assert isinstance(inspect.getattr_static(ray.actor.ActorHandle, "_actor_id"), property)
    assert "actor_id" in inspect.signature(ray.exceptions.RayActorError.__init__).parameters
    assert ray.ActorID.nil().hex() == "ff" * len(ray.ActorID.nil().binary())
