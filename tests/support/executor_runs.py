"""Shared pieces of the executor's end-to-end tests: CPU plans of the demo workloads, the session's
Ray cluster and the runs on it that several tests read."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import hfplan
from hfplan.spec import make_cluster, workload_from_dict
from tests.support.plans import build_plan
from tests.support.processes import TAG, Cli, free_port, stop_all, wait_for

if TYPE_CHECKING:
    from hfplan.executor.controller import RunSummary
    from hfplan.plan import Plan

TINY_PPO = {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}
ARITH_GRPO = {"actor": "tiny-arith", "reference": "tiny-arith", "reward": "rule:arith-exact"}


# The options of the runs that more than one module reads (SharedRuns): PPO on two ranks, the run test_resume
# resumes from; Safe-RLHF with a checkpoint after each iteration, the one its resume starts from.
PPO_TWO_RANKS_RUN = {"iterations": 4, "checkpoint_every": 2}
SAFE_RLHF_RUN = {"iterations": 3, "checkpoint_every": 1, "keep": 3}
# GRPO scored by a reward model: every sampled sequence in samples.jsonl, and no other logger.
REWARD_MODEL_RUN = {"iterations": 1, "samples": 100, "loggers": ("csv",)}


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


def safe_rlhf_plan():
    """Safe-RLHF with the actor and reference on one process, both critics on another."""
    models = {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction",
              "cost": "rule:distinct-chars", "cost_critic": "tiny"}
    return cpu_plan(tiny_workload("safe-rlhf", models), [(("actor", "reference"), 1), (("critic", "cost_critic"), 1)])


def reward_model_plan():
    """GRPO whose reward is a model, on a set of its own."""
    models = {"actor": "tiny", "reference": "tiny", "reward": "tiny"}
    return cpu_plan(tiny_workload("grpo", models), [(("actor", "reference"), 1), (("reward",), 1)])


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


class SharedRuns:
    """Runs of `execute` on the session's cluster that several tests read: each (plan, options) runs once a
    session, the first time a test asks for it, in a folder of its own. Starting a run's worker processes
    costs far more than its iterations, so tests that would launch the same run share it; a test that changes
    a shared run's folder (a resume into it) works on a copy."""

    def __init__(self, address: str, folder: Path) -> None:
        self.address, self.folder = address, folder
        self.done: dict[str, RunSummary] = {}

    def get(self, plan: Plan, **options) -> RunSummary:
        """The summary of `plan` run with `options` (ExecuteOptions' fields, but `out` and the timeouts); the
        run's folder is its `out`."""
        import ray

        from hfplan.executor.controller import ExecuteOptions, execute

        key = repr((plan.to_json(), sorted(options.items())))
        if key not in self.done:
            if not ray.is_initialized():
                connect(self.address)
            out = self.folder / f"run-{len(self.done)}"
            self.done[key] = execute(plan, ExecuteOptions(out=out, call_timeout_s=120, start_timeout_s=120,
                                                          **options))
        return self.done[key]
