"""Target frameworks as search rules: hfplan's own space, verl, OpenRLHF.

A target is what one framework can run, in the form of the other systems' mappings (strategies.Rules):
the placements it expresses, its training, inference and generation layouts, and the settings one of
its flags fixes for several roles at once (Rules.agree). Every rule is a function that says why a plan
is outside it (None when it is inside); the search keeps what they accept and `hfplan export` refuses
what they reject with their reason, so the two never disagree.

Read from the released wheels (facts only: key names, flags, what goes to which resource pool; the key and
flag lists are written by scripts/export_keys.py):
- verl 0.9.1, verl-0.9.1-py3-none-any.whl: verl/trainer/config/_generated_ppo_trainer.yaml and
  _generated_ppo_megatron_trainer.yaml (every key), verl/trainer/ppo/v1/trainer_base.py (resource pools: actor,
  rollout, reference and critic in the global pool, the reward model there or in its own), verl/workers/engine/fsdp
  (fsdp_size meshes, reshard_after_forward = ZeRO-3 vs ZeRO-2), verl/experimental/reward_loop (the reward model
  served by vLLM replicas of reward.reward_model.rollout's tensor-parallel size, whatever the training backend).
- OpenRLHF 0.11.2, openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl: openrlhf/cli/train_ppo_ray.py (flags,
  placement groups, colocation, vLLM engines), openrlhf/utils/utils.py (one DeepSpeed strategy for every model),
  openrlhf/trainer/ray/ppo_actor.py and ppo_critic.py (micro-batch and gradient-checkpointing flags shared by
  actor and critic).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hfplan.errors import HfplanError
from hfplan.layout import ROLLOUT
from hfplan.plan import GenConfig, InferConfig, Plan, RoleParallelism, TrainConfig
from hfplan.planner.search import Progress, SearchResult, merge_results, search
from hfplan.planner.space import set_partitions
from hfplan.planner.strategies import Facets, Rules
from hfplan.spec import Cluster, Workload

TARGETS = ("hfplan", "verl", "openrlhf")


@dataclass(frozen=True)
class Source:
    """The framework release a target's rules and exported keys were read from (its wheel on the package index)."""

    framework: str
    package: str  # the name pip installs
    version: str
    wheel: str  # the wheel file the key lists were read from
    files: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.framework} {self.version} (pip install {self.package}=={self.version})"


VERL = Source("verl", "verl", "0.9.1", "verl-0.9.1-py3-none-any.whl",
              ("verl/trainer/config/_generated_ppo_trainer.yaml",
               "verl/trainer/config/_generated_ppo_megatron_trainer.yaml", "verl/trainer/ppo/v1/trainer_base.py",
               "verl/workers/engine/fsdp/transformer_impl.py", "verl/experimental/reward_loop/reward_model.py"))
OPENRLHF = Source("OpenRLHF", "openrlhf", "0.11.2", "openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl",
                  ("openrlhf/cli/train_ppo_ray.py", "openrlhf/utils/utils.py", "openrlhf/trainer/ray/ppo_actor.py",
                   "openrlhf/trainer/ray/ppo_critic.py"))

Sets = Sequence[tuple[Sequence[str], int | None]]  # colocated roles and their GPUs (None: not sized yet)


@dataclass(frozen=True)
class Target:
    name: str
    summary: str  # what its rules allow, one line
    source: Source | None
    variants: tuple[Rules, ...]  # searched one by one; the best plan of any wins
    workload_problem: Callable[[Workload], str | None]
    placement_problem: Callable[[Workload, Sets], str | None]
    train_problem: Callable[[str, TrainConfig], str | None] | None = None  # behind every variant's Rules.train
    infer_problem: Callable[[str, InferConfig], str | None] | None = None  # behind Rules.infer
    gen_problem: Callable[[GenConfig], str | None] | None = None  # behind Rules.gen

    def plan_problem(self, plan: Plan) -> str | None:
        """Why this target cannot run `plan` (None when it can)."""
        if plan.workload.staleness and self is not HFPLAN:
            return (f"the plan runs asynchronously (staleness {plan.workload.staleness}), and its export is written "
                    "for synchronous runs (a search writes the synchronous best beside it, as OUT.sync.json)")
        problem = self.workload_problem(plan.workload)
        if problem:
            return problem
        sets = [(group.models, group.gpus) for group in plan.placement]
        problem = self.placement_problem(plan.workload, sets)
        if problem:
            return problem
        for role, par in plan.parallelism.items():
            for check, layout in ((self.train_problem, par.train), (self.infer_problem, par.infer)):
                problem = check(role, layout) if check is not None and layout is not None else None
                if problem:
                    return problem
            if par.gen is not None and par.gen.pp > 1:  # the search never makes one (layout.unsupported_layout)
                return f"{role} generates with pp={par.gen.pp}: the exported rollout engines run one pipeline stage"
            problem = self.gen_problem(par.gen) if self.gen_problem is not None and par.gen is not None else None
            if problem:
                return f"{role}: {problem}"
        return facets_problem(self.variant_of(plan), plan.parallelism)

    def variant_of(self, plan: Plan) -> Rules:
        """The variant whose generation engine the plan uses (a rollout set or the hybrid engine)."""
        rollout = ROLLOUT in plan.placed_roles
        return next((r for r in self.variants if r.rollout == rollout), self.variants[0])


# -- rule plumbing -----------------------------------------------------------------------------------------
def _ok(problem: Callable[..., str | None], *args: object) -> bool:
    return problem(*args) is None


def _gen_ok(problem: Callable[[GenConfig], str | None], train: TrainConfig | None, gen: GenConfig) -> bool:
    return problem(gen) is None


def _rules(name: str, placements, *, rollout: bool, train=None, infer=None, gen=None, agree=None) -> Rules:
    """Rules from problem functions (module-level functions and partials: the process pool pickles them)."""
    return Rules(name, placements=placements, rollout=rollout, executable=False,
                 train=functools.partial(_ok, train) if train else None,
                 infer=functools.partial(_ok, infer) if infer else None,
                 gen=functools.partial(_gen_ok, gen) if gen else None,
                 agree=agree)


def _vllm_engine(framework: str, gen: GenConfig) -> str | None:
    """Both frameworks generate with vLLM (verl also SGLang), whose scheduler replaces finished sequences
    (continuous batching) in a paged KV cache (blocks allocated as tokens are generated)."""
    if gen.batching != "continuous":
        return (f"generation batching={gen.batching}: {framework}'s rollout engines (vLLM) batch continuously, "
                "so a plan costed with static waves would not describe them")
    if gen.kv_cache != "paged":
        return (f"generation kv_cache={gen.kv_cache}: {framework}'s rollout engines (vLLM) page their KV cache, "
                "so a plan costed with room reserved per sequence would not describe them")
    return None


def facets_problem(rules: Rules, parallelism: dict[str, RoleParallelism]) -> str | None:
    """Two roles (or two layouts of one role) giving one setting different values."""
    seen: dict[str, tuple[str, object]] = {}
    for role, par in parallelism.items():
        for name, value in rules.facets(role, par):
            if name in seen and seen[name][1] != value:
                other, was = seen[name]
                return f"{rules.name} has one {name}; this plan gives {other} {was} and {role} {value}"
            seen.setdefault(name, (role, value))
    return None


def allowed_placements(workload: Workload, problem: Callable[[Workload, Sets], str | None],
                       rollout: bool) -> tuple[tuple[tuple[str, ...], ...], ...]:
    roles = tuple(workload.model_roles) + ((ROLLOUT,) if rollout else ())
    return tuple(p for p in set_partitions(roles) if problem(workload, [(s, None) for s in p]) is None)


def _on(gpus: int | None) -> str:
    return f" on {gpus} GPUs" if gpus else ""


def _set_of(sets: Sets, role: str) -> tuple[Sequence[str], int | None] | None:
    return next((s for s in sets if role in s[0]), None)


def _even_steps(framework: str, per_step: int, role: str, train: TrainConfig) -> str | None:
    """Both frameworks give every data-parallel rank the same share of a mini-batch, in whole micro-batches."""
    if per_step % train.dp:
        return (f"{role}: the {per_step} sequences of a mini-batch do not split evenly over dp={train.dp} "
                f"({framework} gives every data-parallel rank the same share)")
    if (per_step // train.dp) % train.micro_batch:
        return (f"{role}: micro-batch {train.micro_batch} does not divide the {per_step // train.dp} sequences "
                f"each data-parallel rank gets per mini-batch ({framework} runs whole micro-batches)")
    return None


def _shared_models(framework: str, workload: Workload) -> str | None:
    if "reference" in workload.models and workload.models["reference"] != workload.models["actor"]:
        return (f"{framework} loads the reference from the actor's model path; this workload's reference "
                f"({workload.models['reference']}) is not its actor ({workload.models['actor']})")
    return None


# -- hfplan ----------------------------------------------------------------------------------------------
def _nothing(*_: object) -> str | None:
    return None


def simple_target(rules: Rules, summary: str = "") -> Target:
    """A target that is one rule set and nothing else (hfplan's own; the described mappings of --compare)."""
    return Target(rules.name, summary, None, (rules,), _nothing, _nothing)


HFPLAN = simple_target(Rules(), "every placement and layout hfplan's executor runs")


# -- verl ------------------------------------------------------------------------------------------------
VERL_ALGORITHMS = {"ppo": "gae", "grpo": "grpo", "remax": "remax"}  # algorithm.adv_estimator


def verl_backends(par: RoleParallelism) -> set[str]:
    """verl's training backends that express a role's layout: FSDP (tp = pp = 1; fsdp_size and
    reshard_after_forward give full, hybrid and ZeRO-2 sharding; model.enable_gradient_checkpointing recomputes
    whole layers, full only) and Megatron (tp, pp; weights replicated over data ranks, optimizer states sharded
    with use_distributed_optimizer; override_transformer_config.recompute_granularity selective or full;
    virtual_pipeline_model_parallel_size for interleaved stages)."""
    layout = par.train if par.train is not None else par.infer
    flat = layout.tp == 1 and layout.pp == 1
    if par.train is None:
        return {"fsdp", "megatron"} if flat else {"megatron"}
    t, out = par.train, set()
    if flat and (t.dp == 1 or t.shard in ("full", "zero2", "hybrid")) and t.recompute != "selective" \
            and t.virtual_stages == 1:
        out.add("fsdp")
    if t.dp == 1 or t.shard in ("replicated", "zero1"):
        out.add("megatron")
    return out


def _verl_workload(workload: Workload) -> str | None:
    if workload.algorithm not in VERL_ALGORITHMS:
        return (f"verl's main_ppo has no {workload.algorithm} trainer (it runs "
                f"{', '.join(VERL_ALGORITHMS)} through algorithm.adv_estimator)")
    if workload.batch_prompts % workload.mini_batches:
        return (f"verl counts ppo_mini_batch_size in prompts: {workload.mini_batches} mini-batches do not divide "
                f"the {workload.batch_prompts} prompts")
    return _shared_models("verl", workload)


def _verl_placement(workload: Workload, sets: Sets) -> str | None:
    rollout = _set_of(sets, ROLLOUT)
    if rollout is not None:
        return ("verl generates with its hybrid engine on the actor's GPUs (actor_rollout_ref.hybrid_engine); "
                f"this plan has a separate rollout engine{_on(rollout[1])}")
    pool = _set_of(sets, "actor")[0]
    for role in workload.model_roles:
        roles, gpus = _set_of(sets, role)
        if role in pool or (role == "reward" and len(roles) == 1):  # reward_model.enable_resource_pool
            continue
        others = [r for r in roles if r != role]
        where = (f"with {' and '.join(others)}{_on(gpus)}" if others
                 else f"on its own {gpus} GPUs" if gpus else "on GPUs of its own")
        return (f"verl runs the {role} in the actor's pool (trainer.nnodes x trainer.n_gpus_per_node; only the "
                f"reward model may have a pool of its own); this plan puts it {where}")
    return None


def _verl_train(per_step: int, role: str, train: TrainConfig) -> str | None:
    if not verl_backends(RoleParallelism(train=train)):
        return (f"{role} trains with tp={train.tp} pp={train.pp}, shard={train.shard} and recompute={train.recompute}: "
                "verl's Megatron backend (tensor and pipeline parallelism, selective recomputation) shards at most "
                "the optimizer states (use_distributed_optimizer), and its FSDP backend has no tensor or pipeline "
                "parallelism and recomputes whole layers only")
    return _even_steps("verl", per_step, role, train)


def _verl_infer(role: str, infer: InferConfig) -> str | None:
    """verl's reward loop serves the reward model with vLLM replicas (reward.reward_model.rollout), outside the
    training backend; its rollout config refuses a vLLM pipeline (pipeline_model_parallel_size > 1)."""
    if role == "reward" and infer.pp > 1:
        return (f"reward infers with pp={infer.pp}: verl serves the reward model with vLLM replicas "
                "(reward.reward_model.rollout), which run one pipeline stage")
    return None


def _verl_facets(role: str, par: RoleParallelism) -> Facets:
    backends = verl_backends(par)
    out: list[tuple[str, object]] = []
    if len(backends) == 1 and role != "reward":  # the reward loop's vLLM servers are outside the backend
        out.append(("training backend (fsdp or megatron config)", next(iter(backends))))
    if role == "critic" and "megatron" in backends:
        # Megatron's critic computes values with its ppo_micro_batch_size_per_gpu (no forward micro-batch key).
        if par.train is not None:
            out.append(("critic micro-batch under Megatron (critic.ppo_micro_batch_size_per_gpu)",
                        par.train.micro_batch))
        if par.infer is not None:
            out.append(("critic micro-batch under Megatron (critic.ppo_micro_batch_size_per_gpu)",
                        par.infer.micro_batch))
    return tuple(out)


def verl_target(workload: Workload) -> Target:
    per_step = workload.sequences // workload.mini_batches
    train = functools.partial(_verl_train, per_step)
    gen = functools.partial(_vllm_engine, "verl")
    rules = _rules("verl", allowed_placements(workload, _verl_placement, rollout=False), rollout=False, train=train,
                   infer=_verl_infer, gen=gen, agree=_verl_facets)
    return Target("verl", "actor, critic and reference in one pool with the hybrid engine (the reward model there "
                  "or in its own pool); FSDP training (tp = pp = 1; full, hybrid of any fsdp_size, or ZeRO-2; full "
                  "recomputation) or Megatron (tp x pp, virtual stages; replicated or ZeRO-1; selective or full "
                  "recomputation); vLLM rollout, continuous batching in a paged KV cache, any tensor-parallel size; "
                  "the reward model served by vLLM (any tensor-parallel size, one pipeline stage)",
                  VERL,
                  (rules,), _verl_workload, _verl_placement, train, _verl_infer, gen_problem=gen)


# -- OpenRLHF --------------------------------------------------------------------------------------------
OPENRLHF_ALGORITHMS = {"ppo": "gae", "grpo": "group_norm"}  # --algo.advantage.estimator
ZERO_STAGES = {"replicated": 0, "zero1": 1, "zero2": 2, "full": 3}  # --ds.zero_stage
_PAIRS = ({"actor", "reference"}, {"critic", "reward"})  # --train.colocate_actor_ref, --train.colocate_critic_reward


def _openrlhf_workload(workload: Workload) -> str | None:
    if workload.algorithm not in OPENRLHF_ALGORITHMS:
        return (f"OpenRLHF's train_ppo_ray has no {workload.algorithm} estimator (it runs "
                f"{', '.join(OPENRLHF_ALGORITHMS)} through --algo.advantage.estimator)")
    return _shared_models("OpenRLHF", workload)


def _openrlhf_placement(workload: Workload, sets: Sets) -> str | None:
    rollout = _set_of(sets, ROLLOUT)
    if rollout is None:
        if len(sets) > 1:
            return ("OpenRLHF colocates vLLM with the actor only under --train.colocate_all, which puts every model "
                    f"on the actor's GPUs; this plan splits them into {len(sets)} sets")
        return None
    if len(rollout[0]) > 1:
        others = " and ".join(r for r in rollout[0] if r != ROLLOUT)
        return (f"OpenRLHF's vLLM engines run on GPUs of their own (or with every model, --train.colocate_all); "
                f"this plan puts them with {others}{_on(rollout[1])}")
    for roles, gpus in sets:
        if len(roles) > 1 and set(roles) not in _PAIRS:
            return ("OpenRLHF colocates only actor with reference (--train.colocate_actor_ref) and critic with "
                    f"reward (--train.colocate_critic_reward); this plan puts {' and '.join(roles)} together"
                    f"{_on(gpus)}")
    return None


def _openrlhf_train(per_step: int, role: str, train: TrainConfig) -> str | None:
    if train.tp > 1 or train.pp > 1:
        return (f"{role} trains with tp={train.tp} pp={train.pp}: OpenRLHF trains with DeepSpeed ZeRO, data "
                "parallel only")
    if train.shard not in ZERO_STAGES:
        return f"{role} shard={train.shard}: OpenRLHF's --ds.zero_stage is 0 to 3 (no hybrid sharding groups)"
    if train.recompute == "selective":
        return (f"{role} recompute=selective: OpenRLHF's --actor.gradient_checkpointing_enable recomputes whole "
                "layers (full)")
    return _even_steps("OpenRLHF", per_step, role, train)


def _openrlhf_infer(sequences: int, role: str, infer: InferConfig) -> str | None:
    if infer.tp > 1 or infer.pp > 1:
        return f"{role} infers with tp={infer.tp} pp={infer.pp}: OpenRLHF runs its models data parallel only"
    if role == "actor" and sequences // infer.micro_batch < infer.dp:
        return (f"actor: {sequences} sequences in micro-batches of {infer.micro_batch} are fewer than its "
                f"{infer.dp} GPUs (train_ppo_ray.py asserts at least one per actor process)")
    return None


def _openrlhf_facets(role: str, par: RoleParallelism) -> Facets:
    out: list[tuple[str, object]] = []
    if par.train is not None:
        if par.train.dp > 1:
            out.append(("ZeRO stage (--ds.zero_stage)", par.train.shard))
        out.append(("training micro-batch (--train.micro_batch_size)", par.train.micro_batch))
        out.append(("gradient checkpointing (--actor.gradient_checkpointing_enable)", par.train.recompute))
    if par.infer is not None:
        out.append(("forward micro-batch (--rollout.micro_batch_size)", par.infer.micro_batch))
    return tuple(out)


def openrlhf_target(workload: Workload) -> Target:
    per_step = workload.sequences // workload.mini_batches
    train = functools.partial(_openrlhf_train, per_step)
    infer = functools.partial(_openrlhf_infer, workload.sequences)
    gen = functools.partial(_vllm_engine, "OpenRLHF")
    variants = []
    for rollout in (True, False):
        placements = allowed_placements(workload, _openrlhf_placement, rollout)
        variants.append(_rules("OpenRLHF", placements, rollout=rollout, train=train, infer=infer, gen=gen,
                               agree=_openrlhf_facets))
    return Target("openrlhf", "vLLM engines (continuous batching in a paged KV cache, any tensor-parallel size) on "
                  "their own GPUs, actor with or without the reference, critic with or without the reward model, "
                  "or everything colocated (--train.colocate_all); DeepSpeed ZeRO stage 0-3 for every model, data "
                  "parallel only; one training and one forward micro-batch and gradient checkpointing (full) for all",
                  OPENRLHF,
                  tuple(variants), _openrlhf_workload, _openrlhf_placement, train, infer, gen_problem=gen)


# -- lookup and search -----------------------------------------------------------------------------------
def get_target(name: str, workload: Workload) -> Target:
    """The target `name` for `workload`; HfplanError for an unknown name or a workload it cannot run."""
    makers = {"hfplan": lambda w: HFPLAN, "verl": verl_target, "openrlhf": openrlhf_target}
    if name not in makers:
        raise HfplanError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    target = makers[name](workload)
    problem = target.workload_problem(workload)
    if problem:
        raise HfplanError(f"target {name}: {problem}")
    return target


def search_target(target: Target, workload: Workload, cluster: Cluster, top_k: int = 5,
                  progress: Progress | None = None, jobs: int = 1, time_limit: float | None = None,
                  engines: tuple[str, ...] = ("torch",)) -> SearchResult:
    """The best plans within the target's rules: each variant searched exactly (or until time_limit, as search
    does), the best of all kept. hfplan's own target is the search's default space (idle GPUs allowed; `engines`,
    its rollout engines)."""
    if target is HFPLAN:
        return search(workload, cluster, top_k=top_k, progress=progress, jobs=jobs, time_limit=time_limit,
                      engines=engines)
    # A target's plans are exported to run synchronously: a workload's staleness is an allowance, not a demand
    workload = workload.model_copy(update={"staleness": 0})
    results, errors = [], []
    for rules in target.variants:
        if rules.placements == ():
            continue
        try:
            results.append(search(workload, cluster, top_k=top_k, progress=progress, jobs=jobs, rules=rules,
                                  time_limit=time_limit))
        except HfplanError as error:
            errors.append(str(error))
    if not results:
        if not errors:
            raise HfplanError(f"{target.name} expresses no placement of this workload's roles")
        # The variant that names the fewest GPUs that would fit says the most.
        raise HfplanError(min(errors, key=lambda e: "at least" not in e))
    return results[0] if len(results) == 1 else merge_results(results, top_k)
