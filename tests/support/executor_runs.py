"""Shared pieces of the executor's end-to-end tests: CPU plans of the demo workloads and the session's
Ray cluster."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import hfplan
from hfplan.spec import make_cluster, workload_from_dict
from tests.support.plans import build_plan
from tests.support.processes import TAG, Cli, free_port, stop_all, wait_for

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
def local_ray_head(temp_dir: Path, num_cpus: int = 8, timeout: float = 180) -> Iterator[str]:
    """A Ray head on this machine (`ray start --block`, loopback, no dashboard) for the length of the block;
    yields its address, which this process (`connect`) and `hfplan execute --address` join. Every process of
    the cluster carries a tag in its environment, and all are killed by pid at the end."""
    tag = uuid.uuid4().hex
    port = free_port()
    root = str(Path(hfplan.__file__).parent.parent)
    env = os.environ | {"PYTHONPATH": root, TAG: tag, "RAY_AUTH_MODE": "disabled"}
    log = temp_dir / "head.log"
    with log.open("w") as sink:
        head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                                 f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                                 f"--object-store-memory={2**29}", "--include-dashboard=false",
                                 "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                                stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cli = Cli(head, tag, log)
    try:
        wait_for(lambda: "Ray runtime started" in cli.output(), timeout, "Ray head", cli)
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        ray.shutdown()
        stop_all(cli)


def connect(address: str) -> None:
    """This process as a driver of the cluster at `address` (in-process `execute` then runs on it)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
