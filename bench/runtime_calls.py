"""One iteration's worker calls of a colocated plan through the executor's runtime, without its controller: in
plain processes and in Ray actors, each beside the simulator's figure for the call.

What it separates, where `hfplan validate` of a plan misses: what a call costs as the simulator prices it (the plain
processes), what running it in a Ray actor adds, and (against validate's figures for the same plan) what the
executor's controller and task dispatch add. On every rank the calls run in an iteration's order: the actor's
generation (entering its generation layout, as the executor's `reshard` then `generate`), its way back, each role's
forward (critic values, actor and reference log-probs, a reward model's scores), then each trained role's update on
random advantages (rewards come from the controller). Ranks meet only where the calls' own collectives make them.
The modes alternate (plain, Ray, plain, ...); each figure is a rank's median over the rounds after the first three.
Asserts nothing about time.

    RAY_AUTH_MODE=disabled python bench/runtime_calls.py PLAN [--rounds N] [--repeats N] [--profile PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

WARM = 3  # rounds left out of each median


def iteration_calls(rank: int, world: int, plan_json: str, init: str, rounds: int) -> dict[str, float]:
    """Median seconds of each call on this rank over `rounds` iterations (the first WARM left out)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from hfplan.executor.runtime import build_runtimes
    from hfplan.hyperparams import Hyperparameters
    from hfplan.plan import Plan

    torch.set_num_threads(1)  # as the executor's CPU workers
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    plan = Plan.model_validate_json(plan_json)
    roles = build_runtimes(plan, Hyperparameters(), 0, 0, "cpu")
    workload = plan.workload
    vocab = roles["actor"].model.config.vocab_size
    prompts = np.random.default_rng(rank).integers(1, vocab, (workload.sequences // world, workload.prompt_len))
    seconds: dict[str, list[float]] = {}

    def timed(name: str, call, *args):
        start = time.perf_counter()
        out = call(*args)
        seconds.setdefault(name, []).append(time.perf_counter() - start)
        return out

    forwards = [(role, op) for role, op in (("critic", "values"), ("actor", "log_prob"), ("reference", "log_prob"),
                                            ("reward", "score"))
                if role in roles and not (role == "actor" and workload.reuse_policy_log_probs)]
    for i in range(rounds):
        generated = timed("actor.generate", roles["actor"].run, "generate", {"prompts": prompts}, {}, [])
        timed("actor.reshard back", roles["actor"].leave_generation, [])
        fields = {name: generated[name] for name in ("prompts", "responses", "response_mask")}
        outputs = {role: timed(f"{role}.{op}", roles[role].run, op, fields, {}, []) for role, op in forwards}
        advantages = np.random.default_rng(i).standard_normal(fields["response_mask"].shape).astype(np.float32)
        policy = fields | outputs.get("actor", {}) | outputs.get("reference", {}) | {"advantages": advantages}
        timed("actor.update", roles["actor"].run, "update", policy, {}, [])
        if "critic" in roles and roles["critic"].facts.trains:
            (values,) = outputs["critic"].values()
            critic = fields | outputs["critic"] | {"returns": values + advantages}
            timed("critic.update", roles["critic"].run, "update", critic, {}, [])
    dist.barrier()
    dist.destroy_process_group()
    return {name: statistics.median(taken[WARM:]) for name, taken in seconds.items()}


def _plain_rank(rank: int, world: int, plan_json: str, init: str, rounds: int, results) -> None:
    try:
        results.put((rank, iteration_calls(rank, world, plan_json, init, rounds)))
    except Exception as error:  # the parent names it (the other ranks then fail at their next collective)
        results.put((rank, f"rank {rank}: {type(error).__name__}: {error}"))


def in_processes(plan_json: str, world: int, rounds: int) -> list[dict[str, float]]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="hfplan-calls-") as folder:
        init = Path(folder, "rendezvous").as_uri()
        ranks = [context.Process(target=_plain_rank, args=(r, world, plan_json, init, rounds, results))
                 for r in range(world)]
        for process in ranks:
            process.start()
        out = dict(results.get(timeout=600) for _ in ranks)
        for process in ranks:
            process.join()
    failed = [value for value in out.values() if isinstance(value, str)]
    if failed:
        raise RuntimeError(failed[0])
    return [out[r] for r in range(world)]


def in_ray_actors(plan_json: str, world: int, rounds: int) -> list[dict[str, float]]:
    import ray

    @ray.remote(num_cpus=1)
    class Rank:
        def calls(self, rank: int, init: str) -> dict[str, float]:
            return iteration_calls(rank, world, plan_json, init, rounds)

    ray.init(num_cpus=world, include_dashboard=False, logging_level="ERROR", _node_ip_address="127.0.0.1")
    try:
        with tempfile.TemporaryDirectory(prefix="hfplan-calls-") as folder:
            init = Path(folder, "rendezvous").as_uri()
            ranks = [Rank.remote() for _ in range(world)]
            return ray.get([actor.calls.remote(r, init) for r, actor in enumerate(ranks)], timeout=600)
    finally:
        ray.shutdown()


def simulated_calls(plan) -> dict[str, float]:
    """The simulator's seconds per call, as these are timed: the actor's generation with its switch into it (and
    the way back, which the simulator prices with the way in and marks at no cost)."""
    from hfplan.plan import RESHARD_BACK_OP, RESHARD_OP
    from hfplan.simulator.engine import simulate_plan

    out: dict[str, float] = {}
    for span in simulate_plan(plan).estimate.timeline:
        if span.kind in ("compute", "transition") and span.role != "controller":
            name = f"{span.role}.{'generate' if span.op in (RESHARD_OP, RESHARD_BACK_OP) else span.op}"
            out[name] = out.get(name, 0.0) + span.end - span.start
    return out


def refuse(message: str) -> None:
    print(f"runtime_calls.py: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="plan JSON with every role on one placement set")
    parser.add_argument("--rounds", type=int, default=25, help="iterations per mode (the first 3 left out)")
    parser.add_argument("--repeats", type=int, default=1, help="plain and Ray runs, alternating, of each")
    parser.add_argument("--profile", type=Path, default=None, help="hardware profile YAML the plan is simulated on")
    args = parser.parse_args()
    from hfplan.errors import HfplanError
    from hfplan.plan import Plan
    from hfplan.validation.run import with_profile

    try:
        plan = with_profile(Plan.model_validate_json(args.plan.read_text()), args.profile)
    except (OSError, ValueError, HfplanError) as error:
        refuse(f"{args.plan}: {str(error).splitlines()[0]}")
    if len(plan.placement) != 1 or args.rounds <= WARM:
        refuse(f"needs a plan with one placement set (this one has {len(plan.placement)}) and --rounds above {WARM}")
    world = plan.placement[0].gpus
    simulated = simulated_calls(plan)
    runs = []
    for _ in range(args.repeats):
        runs.append(("plain", in_processes(plan.to_json(), world, args.rounds)))
        runs.append(("Ray", in_ray_actors(plan.to_json(), world, args.rounds)))
    print(f"{args.plan}: {world} rank(s), {args.rounds} rounds a mode; ms a call, each rank's median")
    print(f"{'call':<22}{'simulated':>10}" + "".join(f"{mode:>16}" for mode, _ in runs))
    for name in runs[0][1][0]:
        row = f"{name:<22}" + (f"{simulated[name] * 1e3:>10.2f}" if name in simulated else f"{'-':>10}")
        row += "".join(f"{' / '.join(f'{ranks[r][name] * 1e3:.1f}' for r in range(world)):>16}" for _, ranks in runs)
        print(row)


if __name__ == "__main__":
    main()
