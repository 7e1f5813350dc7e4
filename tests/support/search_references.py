"""The exhaustive reference the search is checked against (tests/test_search.py, tests/test_program_shapes.py),
written without the planner's strategies or search modules, and the small models and profiles its cases use.

For every placement (set partition of the model roles, with the hybrid engine or a rollout set), every allocation
of at most the cluster's GPUs to its sets, and every role's raw strategies (space.train_configs / infer_configs /
gen_configs, less what the executor's pre-flight refuses), exhaustive() costs each colocated set's every
combination by the simulator's own rules (mapping.set_memory of its roles' memory, mapping.call_seconds of its
calls, PlanCosts.switch_seconds) and runs the simpy engine on the cartesian product of the sets' combinations,
leaving out only combinations no faster on any call than another of the same set; each pair's best is then costed
as one PlanCosts mapping and must take the time found. brute_force() multiplies everything out with PlanCosts, to
check that on pairs small enough.

A case's reference takes up to about 4 s (8 s for the slow cases, 2026-12-06): Lab.reference builds each once per
test session (a cache in this module, keyed by the case, which with MODEL_CONFIGS and PROFILES decides the workload
and cluster), whichever module and Lab asks first.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import yaml

from hfplan.dataflow.registry import get_algorithm
from hfplan.layout import ON_CONTROLLER, generating_role
from hfplan.plan import ROLLOUT, RoleParallelism
from hfplan.planner import space
from hfplan.planner.search import search
from hfplan.simulator import engine
from hfplan.simulator.costs import CostMemo
from hfplan.simulator.mapping import PlanCosts, call_seconds, role_memory, set_memory
from hfplan.simulator.schedule import switch_points
from hfplan.simulator.trace import Node, trace
from hfplan.spec import Cluster, Workload, make_cluster, workload_from_dict

RULE = "rule:vowel-fraction"

# Small decoder-only models written as HF config.json files. Few layers and heads keep the strategy
# product small enough for an exhaustive search; hidden sizes are large enough that the choices matter.
MODEL_CONFIGS = {
    # training tp 1 only (one KV head); inference and generation may use tp 2 (KV heads replicated)
    "kv1": {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 4096, "vocab_size": 32000},
    # tp up to 2 for training, 4 for inference; pp 1 or 2
    "wide": {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
             "intermediate_size": 4096, "vocab_size": 32000},
    # one layer, one head: a single layout (1, 1, A) on A GPUs
    "flat": {"num_hidden_layers": 1, "hidden_size": 1024, "num_attention_heads": 1, "num_key_value_heads": 1,
             "intermediate_size": 4096, "vocab_size": 32000},
    # ~0.25B parameters: on the TIGHT profile (3.5 GiB usable) the actor cannot train unsharded on one
    # device, colocated sets overflow, and the KV cache left to generation limits its batch
    "mha": {"num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 8192, "vocab_size": 16000},
    "flatbig": {"num_hidden_layers": 1, "hidden_size": 2048, "num_attention_heads": 1, "num_key_value_heads": 1,
                "intermediate_size": 8192, "vocab_size": 16000},
    # one layer, eight KV heads: a large KV cache per token, so generation runs in waves on CPU memory
    "kv8": {"num_hidden_layers": 1, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
            "intermediate_size": 2048, "vocab_size": 32000},
    "flat1k": {"num_hidden_layers": 1, "hidden_size": 1024, "num_attention_heads": 1, "num_key_value_heads": 1,
               "intermediate_size": 3072, "vocab_size": 1000},
}


# Hardware profiles written by the tests, so that edits to the shipped ones do not move the cases.
TIGHT = "tight"  # the shipped a100-80g rates with 4.5 GiB (3.5 usable), 2 per node: memory decides, not speed
CPU = "cpu-fixed"  # the shipped 'cpu' profile's values when these tests were written (fp32, 3.5 GiB usable)
PROFILES = {
    TIGHT: {
        "name": "tight-test", "description": "a100 rates, 4.5 GiB", "measured": False, "date": None,
        "backend": "nccl", "gpus_per_node": 2,
        "compute": {"peak_tflops": 312, "matmul_efficiency": 0.859, "kernel_overhead_us": 4.0, "value_bytes": 2},
        "memory": {"capacity_gib": 4.5, "reserved_gib": 1.0, "bandwidth_gbps": 2039, "efficiency": 0.88},
        "links": {"intra_node": {"bandwidth_gbps": 300, "efficiency": 0.77, "latency_us": 2.0},
                  "inter_node": {"bandwidth_gbps": 25, "efficiency": 0.9, "latency_us": 6.0},
                  "host": {"bandwidth_gbps": 32, "efficiency": 0.8, "latency_us": 10.0}},
    },
    CPU: {
        "name": "cpu-fixed", "description": "CPU processes, fixed for tests", "measured": False, "date": None,
        "backend": "gloo", "gpus_per_node": 4,
        "compute": {"peak_tflops": 0.096, "matmul_efficiency": 0.7, "kernel_overhead_us": 10.0, "value_bytes": 4},
        "memory": {"capacity_gib": 4, "reserved_gib": 0.5, "bandwidth_gbps": 10, "efficiency": 0.8},
        "links": {"intra_node": {"bandwidth_gbps": 2, "efficiency": 0.8, "latency_us": 50.0},
                  "inter_node": {"bandwidth_gbps": 1.25, "efficiency": 0.8, "latency_us": 100.0},
                  "host": {"bandwidth_gbps": 10, "efficiency": 0.8, "latency_us": 5.0}},
    },
}


@dataclass(frozen=True)
class Case:
    algorithm: str
    models: dict  # role -> MODEL_CONFIGS key, or a rule
    gpus: int
    per_node: int
    hardware: str = "a100-80g"
    prompt_len: int = 256
    response_len: int = 256
    batch_prompts: int = 2
    samples_per_prompt: int = 1
    mini_batches: int = 1
    top_k: int = 3

    def __hash__(self) -> int:
        return hash(repr(self))


@dataclass
class PairResult:
    best_s: float  # math.inf when no strategy choice fits
    pars: dict[str, RoleParallelism] | None
    feasible: int  # complete strategy choices that fit memory
    infeasible: int
    runs: int = 0  # simpy runs it took


def brute_force(workload: Workload, cluster: Cluster, placement, allocation, memo: CostMemo) -> PairResult:
    """One (placement, allocation) by the full cartesian product of its roles' strategies, each costed with
    PlanCosts and run on the simpy engine: what exhaustive() must agree with."""
    per_node, dag = cluster.gpus_per_node, trace(workload)
    rollout = any(ROLLOUT in group for group in placement)
    sets = list(zip(placement, allocation, strict=True))
    roles = [role for group, _ in sets for role in group]
    options = [space.role_strategies(workload, role, gpus, per_node, rollout) for group, gpus in sets for role in group]
    result = PairResult(math.inf, None, 0, 0)
    for combo in itertools.product(*options):
        pars = dict(zip(roles, combo, strict=True))
        plan_costs = PlanCosts(workload, sets, pars, cluster.profile, per_node, memo)
        if plan_costs.infeasible_reason:
            result.infeasible += 1
            continue
        result.feasible += 1
        result.runs += 1
        seconds = engine.run(dag, plan_costs).iteration_s
        if seconds < result.best_s:
            result.best_s, result.pars = seconds, pars
    return result


@dataclass
class SetChoices:
    """Every strategy combination of one colocated set's roles: how many there are, and of those that fit
    its GPUs, the ones no other fitting one beats on every call (calls: the set's scheduled calls)."""

    total: int
    fitting: int
    front: list[tuple[tuple[tuple[Node, float, float, str | None], ...], dict[str, RoleParallelism]]]


def _undominated(vectors: list[tuple[float, ...]]) -> list[int]:
    """Indices of vectors no other is <= on every entry (of equal ones, the first). Taken in order of their
    sums, a vector's dominators come before it (summing is monotone), and a dropped one's dominator is kept."""
    array = np.array(vectors, dtype=float).reshape(len(vectors), -1)
    kept = np.empty_like(array)  # the kept vectors, in the order kept
    kept_at: list[int] = []
    for i in sorted(range(len(array)), key=lambda i: (float(array[i].sum()), i)):
        if not kept_at or not (kept[:len(kept_at)] <= array[i]).all(axis=1).any():
            kept[len(kept_at)] = array[i]
            kept_at.append(i)
    return sorted(kept_at)


def set_choices(workload: Workload, cluster: Cluster, sets: list, index: int, options: dict, memo: CostMemo
                ) -> SetChoices:
    """Cost every combination of set `index`'s strategies in the mapping `sets`, keeping the undominated ones among
    those that fit. A set's memory and its calls' seconds depend on its own roles alone (the test checks it for each
    pair's best, costed as one mapping), so each combination costs only this set, as PlanCosts would: its memory
    by mapping.set_memory of its roles' role_memory, each call by mapping.call_seconds at that memory's KV-cache
    room, and each switch by PlanCosts.switch_seconds; each of those pure functions is asked once per distinct
    argument (a role's memory per strategy, a call per strategy and room) rather than once per combination."""
    roles = sets[index][0]
    gpus = sets[index][1]
    hw, per_node = cluster.profile, cluster.gpus_per_node
    filler = {role: options[role][0] for group, _ in sets for role in group}
    where = PlanCosts(workload, sets, filler, hw, per_node, memo)  # where calls run: no strategy needed
    dag = trace(workload)
    points = switch_points(dag, where.layout_role, generating_role(workload))
    # each call of this set: the role whose layout runs it, and the role switching layout before it (or None)
    calls_of_set = [(node, where.layout_role(node), points.get(node.id)) for node in dag.nodes
                    if where.set_of(node) == index]
    needs = {role: [role_memory(workload, role, par, hw.compute.value_bytes, hw.compute.attention,
                                vllm_tokens=hw.runtime.vllm_batched_tokens) for par in options[role]]
             for role in roles}
    seconds_of: dict[tuple, float] = {}
    switch_of: dict[tuple, float] = {}
    total, fitting, costed = 0, 0, []
    for combo in itertools.product(*(range(len(options[role])) for role in roles)):
        total += 1
        pick = dict(zip(roles, combo, strict=True))
        mem = set_memory(workload, hw, index, roles, gpus, {r: needs[r][k] for r, k in pick.items()}, where.generator)
        if mem.reason:
            continue
        fitting += 1
        calls = []
        for node, role, switch_role in calls_of_set:
            key = (node.id, pick[role], mem.kv_budget if node.kind == "generate" else None)
            if key not in seconds_of:
                seconds_of[key] = call_seconds(workload, hw, per_node, node, role, options[role][pick[role]], gpus,
                                               mem.kv_budget, memo)
            switch = 0.0
            if switch_role is not None:
                if (switch_role, pick[switch_role]) not in switch_of:
                    pars = {**filler, switch_role: options[switch_role][pick[switch_role]]}
                    switch_of[(switch_role, pick[switch_role])] = PlanCosts(workload, sets, pars, hw, per_node,
                                                                            memo).switch_seconds(switch_role)
                switch = switch_of[(switch_role, pick[switch_role])]
            calls.append((node, seconds_of[key], switch, switch_role))
        costed.append((tuple(calls), {r: options[r][k] for r, k in pick.items()}))
    vectors = [tuple(x for _, seconds, switch, _ in calls for x in (seconds, switch)) for calls, _ in costed]
    return SetChoices(total, fitting, [costed[i] for i in _undominated(vectors)] if costed else [])


def exhaustive(workload: Workload, cluster: Cluster) -> dict[tuple, PairResult]:
    """The best iteration time of every (placement, allocation) using at most the cluster's GPUs.

    Every combination of strategies within each colocated set is costed; across sets it takes the cartesian
    product of each set's undominated combinations and runs each on the simpy engine. That drops only
    choices no faster anywhere than one kept: a set's costs depend on its own strategies alone, and the
    engine's schedule (each call after its inputs and after the previous call of its set) never ends
    earlier when a call takes longer. brute_force() checks this on pairs small enough to multiply out."""
    per_node, dag, memo = cluster.gpus_per_node, trace(workload), CostMemo()
    out, by_set, strategies = {}, {}, {}
    for placement in space.own_placements(workload):
        rollout = any(ROLLOUT in group for group in placement)
        for allocation in space.allocations(len(placement), cluster.gpus, per_node, idle=True):
            assert sum(allocation) <= cluster.gpus
            sets = list(zip(placement, allocation, strict=True))
            for group, gpus in sets:
                for role in group:
                    if (role, gpus, rollout) not in strategies:
                        strategies[(role, gpus, rollout)] = space.role_strategies(workload, role, gpus, per_node,
                                                                                  rollout)
            options = {role: strategies[(role, gpus, rollout)] for group, gpus in sets for role in group}
            if not all(options.values()):
                out[(placement, allocation)] = PairResult(math.inf, None, 0, 0)
                continue
            where = PlanCosts(workload, sets, {}, cluster.profile, per_node, memo)
            actor_set = where.set_index["actor"]
            choices = []
            for index, (group, gpus) in enumerate(sets):
                # a set's costs: its roles, its size, the engine; a rollout set's weight sync also whether the
                # actor shares its node
                key = (group, gpus, rollout, ROLLOUT in group and where.same_node(actor_set, index))
                if key not in by_set:
                    by_set[key] = set_choices(workload, cluster, sets, index, options, memo)
                choices.append(by_set[key])
            total, fitting = math.prod(c.total for c in choices), math.prod(c.fitting for c in choices)
            result = PairResult(math.inf, None, fitting, total - fitting)
            controller = [engine.Scheduled(n, ON_CONTROLLER, 0.0, 0.0, None) for n in dag.nodes
                          if where.set_of(n) == ON_CONTROLLER]
            for combo in itertools.product(*(c.front for c in choices)):
                calls = sorted([*controller, *(engine.Scheduled(node, index, seconds, switch, role)
                                               for index, (calls, _) in enumerate(combo)
                                               for node, seconds, switch, role in calls)], key=lambda c: c.node.id)
                seconds = engine.run_calls(calls, where.edge_seconds, workload.tokens_per_iteration).iteration_s
                result.runs += 1
                if seconds < result.best_s:
                    result.best_s, result.pars = seconds, {r: p for _, pars in combo for r, p in pars.items()}
            if result.pars is not None:  # the best choice, costed as one mapping, takes the time found
                plan_costs = PlanCosts(workload, sets, result.pars, cluster.profile, per_node)
                assert not plan_costs.infeasible_reason
                assert engine.run(dag, plan_costs).iteration_s == pytest.approx(result.best_s, rel=1e-12)
            out[(placement, allocation)] = result
    return out


# -- the cases' workloads and references ----------------------------------------------------------------------
_REFERENCES: dict[Case, dict[tuple, PairResult]] = {}  # this test session's references, by case


class Lab:
    """Workloads and clusters of cases (model configs and profiles written to `folder`), with each case's
    exhaustive reference (once per session) and search result (once per Lab). `cases`: the cases by name, for
    reference() and search()."""

    def __init__(self, folder, cases: dict[str, Case] | None = None) -> None:
        self.cases = cases or {}
        self.paths = {}
        for name, fields in MODEL_CONFIGS.items():
            path = folder / f"{name}.json"
            path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **fields}))
            self.paths[name] = str(path)
        self.profiles = {}
        for name, data in PROFILES.items():
            path = folder / f"{name}.yaml"
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            self.profiles[name] = str(path)
        self.hardware = self.profiles[TIGHT]
        self._search: dict[str, object] = {}

    def workload(self, case: Case) -> Workload:
        models = {role: ref if ref.startswith("rule:") else self.paths[ref] for role, ref in case.models.items()}
        assert set(models) == set(get_algorithm(case.algorithm).roles)
        spec = {"algorithm": case.algorithm, "models": models, "prompt_len": case.prompt_len,
                "response_len": case.response_len, "batch_prompts": case.batch_prompts,
                "samples_per_prompt": case.samples_per_prompt, "mini_batches": case.mini_batches}
        return workload_from_dict(spec, "test")

    def cluster(self, case: Case) -> Cluster:
        return make_cluster(case.gpus, self.profiles.get(case.hardware, case.hardware), case.per_node)

    def reference(self, name: str) -> dict[tuple, PairResult]:
        case = self.cases[name]
        if case not in _REFERENCES:
            _REFERENCES[case] = exhaustive(self.workload(case), self.cluster(case))
        return _REFERENCES[case]

    def search(self, name: str):
        if name not in self._search:
            case = self.cases[name]
            self._search[name] = search(self.workload(case), self.cluster(case), top_k=case.top_k)
        return self._search[name]
