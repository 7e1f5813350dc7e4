"""Plan-building helpers shared by the engine and CLI tests (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence

from hfplan.plan import ROLLOUT, GenConfig, InferConfig, PlacementSet, Plan, RoleParallelism, TrainConfig
from hfplan.spec import ALGORITHM_ROLES, TRAINED_ROLES, Cluster, Workload, make_cluster, workload_from_dict


def small_workload(algorithm: str = "ppo", model: str = "qwen2.5-0.5b", **overrides) -> Workload:
    """A small workload written as a dict (one model for every role unless overridden)."""
    spec: dict = {
        "algorithm": algorithm,
        "models": {role: model for role in ALGORITHM_ROLES[algorithm]},
        "prompt_len": 256,
        "response_len": 256,
        "batch_prompts": 64,
        "mini_batches": 4,
    }
    if algorithm == "grpo":
        spec["batch_prompts"] = 16
        spec["samples_per_prompt"] = 4
    spec.update(overrides)
    return workload_from_dict(spec, "test")


def role_parallelism(role: str, gpus: int, *, tp: int = 4, gen_tp: int = 2, micro_batch: int = 2,
                     infer_micro_batch: int = 4, shard: bool = True, generates: bool | None = None,
                     recompute: str = "none", batching: str = "static", kv_cache: str = "reserved"
                     ) -> RoleParallelism:
    """A valid parallelism for `role` on a set of `gpus` GPUs: tp (capped by the set size) x dp."""
    tp = min(tp, gpus)
    gen_tp = min(gen_tp, gpus)
    if generates is None:
        generates = role in ("actor", ROLLOUT)
    trained = role in TRAINED_ROLES
    return RoleParallelism(
        train=TrainConfig(tp=tp, dp=gpus // tp, micro_batch=micro_batch, shard=shard, recompute=recompute)
        if trained else None,
        infer=InferConfig(tp=tp, dp=gpus // tp, micro_batch=infer_micro_batch) if role != ROLLOUT else None,
        gen=GenConfig(tp=gen_tp, dp=gpus // gen_tp, batching=batching, kv_cache=kv_cache) if generates else None,
    )


def build_plan(workload: Workload, sets: Sequence[tuple[Sequence[str], int]], cluster: Cluster | None = None,
               overrides: dict[str, RoleParallelism] | None = None, **par_kwargs) -> Plan:
    """A Plan with the given placement sets ((roles, gpus) each), default parallelism per role."""
    total = sum(g for _, g in sets)
    cluster = cluster or make_cluster(max(8, total), "a100-80g")
    placed = [r for roles, _ in sets for r in roles]
    parallelism = {}
    for roles, gpus in sets:
        for role in roles:
            generates = role == ROLLOUT or (role == "actor" and ROLLOUT not in placed)
            parallelism[role] = role_parallelism(role, gpus, generates=generates, **par_kwargs)
    parallelism.update(overrides or {})
    return Plan(workload=workload, cluster=cluster,
                placement=[PlacementSet(models=list(roles), gpus=gpus) for roles, gpus in sets],
                parallelism=parallelism)


def sample_plan() -> Plan:
    """A PPO plan of Llama-2-7B on four roles in three sets (32 A100s): the CLI tests' plan."""
    from hfplan.spec import load_workload

    return build_plan(load_workload("ppo-llama2-7b"), [(["actor", "critic"], 16), (["reference"], 8), (["reward"], 8)])
