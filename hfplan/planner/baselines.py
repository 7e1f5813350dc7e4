"""Other RLHF systems' mappings, searched on the same simulator within each system's own rules.

Each system is a set of rules on hfplan's strategy space; the best plan within those rules is found by
the same exact search, so the comparison shows what the mapping itself costs, not a tuning gap.
NeMo-Aligner and DeepSpeed-Chat are described by their mappings (their inference-only roles may use
any layout: each serves them with tensor or ZeRO parallelism of its own, which the cost model
expresses as a layout); OpenRLHF is the `--target openrlhf` rule set, read from its launcher.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfplan.errors import HfplanError
from hfplan.plan import GenConfig, Plan, TrainConfig
from hfplan.planner.strategies import Rules
from hfplan.planner.targets import Target, openrlhf_target, search_target, simple_target
from hfplan.spec import Cluster, Workload


@dataclass(frozen=True)
class Baseline:
    name: str
    description: str
    target: Target


def _own_engine(gen: GenConfig) -> bool:
    # described by their mappings: they generate with the engines hfplan's executor has (reserved KV caches), so
    # the comparison with hfplan's own plan is one of mappings
    return gen.kv_cache == "reserved"


def _same_layout(train: TrainConfig | None, gen: GenConfig) -> bool:
    return train is not None and (gen.tp, gen.pp, gen.dp) == (train.tp, train.pp, train.dp) and _own_engine(gen)


def _whole_model(train: TrainConfig | None, gen: GenConfig) -> bool:
    return gen.tp == 1 and gen.pp == 1 and _own_engine(gen)


def _megatron(role: str, train: TrainConfig) -> bool:
    # tensor, pipeline and data parallelism; weights replicated across data ranks, the optimizer states
    # too or sharded by Megatron's distributed optimizer (ZeRO-1)
    return train.shard in ("replicated", "zero1")


def _zero3(role: str, train: TrainConfig) -> bool:
    # DeepSpeed ZeRO-3: no tensor or pipeline parallelism, every state sharded over all data-parallel ranks
    return train.tp == 1 and train.pp == 1 and (train.shard == "full" or train.dp == 1)


def baselines(workload: Workload) -> list[Baseline]:
    together = ((tuple(workload.model_roles),),)
    openrlhf = openrlhf_target(workload)
    return [
        Baseline("NeMo-Aligner-like", "all roles colocated; Megatron 3D parallelism (weights replicated across data "
                 "ranks, optimizer states replicated or ZeRO-1); the actor generates in its training layout (no "
                 "resharding)",
                 simple_target(Rules("NeMo-Aligner-like", placements=together, train=_megatron, gen=_same_layout,
                                     executable=False))),
        Baseline("DeepSpeed-Chat-like", "all roles colocated; ZeRO-3 training; the whole actor is gathered on every "
                 "GPU for generation",
                 simple_target(Rules("DeepSpeed-Chat-like", placements=together, train=_zero3, gen=_whole_model,
                                     executable=False))),
        Baseline("OpenRLHF", f"--target openrlhf ({openrlhf.source.label}): {openrlhf.summary}", openrlhf),
    ]


@dataclass(frozen=True)
class BaselineResult:
    baseline: Baseline
    plan: Plan | None
    reason: str = ""  # why no plan fits, when plan is None

    @property
    def iteration_s(self) -> float | None:
        return self.plan.estimate.iteration_s if self.plan is not None and self.plan.estimate else None


def compare(workload: Workload, cluster: Cluster, jobs: int = 1) -> list[BaselineResult]:
    out = []
    for baseline in baselines(workload):
        target = baseline.target
        try:
            problem = target.workload_problem(workload)
            if problem:
                raise HfplanError(problem)
            result = search_target(target, workload, cluster, top_k=1, jobs=jobs)
        except HfplanError as error:
            out.append(BaselineResult(baseline, None, str(error)))
            continue
        out.append(BaselineResult(baseline, result.best))
    return out
