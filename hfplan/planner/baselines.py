"""Other RLHF systems' fixed mappings, searched on the same simulator within each system's own rules.

Each system is a set of rules on hfplan's strategy space; the best plan within those rules is found by
the same exact search, so the comparison shows what the mapping itself costs, not a tuning gap.
Roles that only run inference may use any layout in every system (each of these systems serves them
with tensor or ZeRO parallelism of its own, which the cost model expresses as a layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfplan.errors import HfplanError
from hfplan.plan import ROLLOUT, GenConfig, Plan, TrainConfig
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.spec import Cluster, Workload


@dataclass(frozen=True)
class Baseline:
    name: str
    description: str
    rules: Rules


def _same_layout(train: TrainConfig | None, gen: GenConfig) -> bool:
    return train is not None and (gen.tp, gen.pp, gen.dp) == (train.tp, train.pp, train.dp)


def _whole_model(train: TrainConfig | None, gen: GenConfig) -> bool:
    return gen.tp == 1 and gen.pp == 1


def _megatron(role: str, train: TrainConfig) -> bool:
    return not train.shard  # tensor, pipeline and data parallelism, weights replicated across data ranks


def _zero3(role: str, train: TrainConfig) -> bool:
    # DeepSpeed ZeRO-3: no tensor or pipeline parallelism, parameters sharded over all data-parallel ranks
    return train.tp == 1 and train.pp == 1 and (train.shard or train.dp == 1)


def baselines(workload: Workload) -> list[Baseline]:
    roles = tuple(workload.model_roles)
    together = ((roles,),)
    apart = (tuple((r,) for r in roles) + ((ROLLOUT,),),)
    return [
        Baseline("NeMo-Aligner-like", "all roles colocated; Megatron 3D parallelism; the actor generates in its "
                 "training layout (no resharding)",
                 Rules("NeMo-Aligner-like", placements=together, train=_megatron, gen=_same_layout)),
        Baseline("DeepSpeed-Chat-like", "all roles colocated; ZeRO-3 training; the whole actor is gathered on every "
                 "GPU for generation",
                 Rules("DeepSpeed-Chat-like", placements=together, train=_zero3, gen=_whole_model)),
        Baseline("OpenRLHF-like", "every role on its own power-of-two group of GPUs; ZeRO-3 training; a separate "
                 "generation engine (any tensor parallelism) receives the actor's weights each iteration",
                 Rules("OpenRLHF-like", placements=apart, rollout=True, train=_zero3, power_of_two_sets=True)),
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
        try:
            result = search(workload, cluster, top_k=1, jobs=jobs, rules=baseline.rules)
        except HfplanError as error:
            out.append(BaselineResult(baseline, None, str(error)))
            continue
        out.append(BaselineResult(baseline, result.best))
    return out
