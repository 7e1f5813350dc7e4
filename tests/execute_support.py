"""Shared pieces of the executor's end-to-end tests: CPU plans of the demo workloads and a Ray session."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from hfplan.spec import make_cluster, workload_from_dict
from tests.helpers_plans import build_plan

TINY_PPO = {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}
ARITH_GRPO = {"actor": "tiny-arith", "reference": "tiny-arith", "reward": "rule:arith-exact"}


def tiny_workload(algorithm: str = "ppo", models: dict | None = None, **shape):
    spec = {"algorithm": algorithm, "models": models or TINY_PPO, "prompt_len": 8, "response_len": 8,
            "batch_prompts": 4, "mini_batches": 2, "hyperparameters": {"actor_lr": 1e-3, "critic_lr": 1e-3}}
    if algorithm == "grpo":
        spec |= {"batch_prompts": 2, "samples_per_prompt": 4, "mini_batches": 1}
    return workload_from_dict(spec | shape, "test")


def cpu_plan(workload, sets: Sequence[tuple[Sequence[str], int]], shard: bool = True, micro_batch: int = 1):
    """A data-parallel plan on CPU "GPUs": every layout tp = pp = 1."""
    gpus = sum(n for _, n in sets)
    return build_plan(workload, sets, cluster=make_cluster(gpus, "cpu"), tp=1, gen_tp=1, micro_batch=micro_batch,
                      infer_micro_batch=4, shard=shard)


@contextlib.contextmanager
def ray_session(tmp_dir: str, num_cpus: int = 4):
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=num_cpus, _temp_dir=tmp_dir, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()
