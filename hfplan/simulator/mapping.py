"""Costs of one candidate mapping: seconds of each traced call, layout switches, memory of each set.

A mapping is a placement (colocated sets of roles with a GPU count each) plus each role's parallel
layouts; the same inputs a Plan holds, taken without building a Plan so that the search can evaluate
many of them quickly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from hfplan.layout import (
    ON_CONTROLLER,
    ROLLOUT,
    call_role,
    engine_max_seqs,
    facts_of,
    generating_role,
    generation_role,
    model_role,
    trains_through_fsdp,
    transfer_path,
)
from hfplan.plan import GenConfig, InferConfig, Plan, RoleParallelism, TrainConfig
from hfplan.profiles.hardware import GIB, HardwareProfile
from hfplan.profiles.models import ModelArch
from hfplan.simulator import collectives as coll
from hfplan.simulator import costs, memory
from hfplan.simulator.schedule import task_openers
from hfplan.simulator.trace import Dag, Node
from hfplan.spec import Workload


@dataclass(frozen=True)
class SetMemory:
    index: int
    roles: tuple[str, ...]
    resident: dict[str, float]  # bytes per GPU each role keeps
    transient: dict[str, float]  # bytes per GPU of the largest call of each role
    usable: float
    kv_budget: float  # bytes per GPU left for the KV cache during generation (0 if the set does not generate)
    reason: str  # empty when it fits

    @property
    def peak(self) -> float:
        return sum(self.resident.values()) + max(self.transient.values(), default=0.0)

    @property
    def fits(self) -> bool:
        return not self.reason


def head_of(workload: Workload, role: str) -> str:
    return facts_of(workload, role).head


def set_offsets(sizes: Sequence[int], gpus_per_node: int) -> list[int]:
    """First GPU of each set when sets are laid out largest first (so sub-node sets never straddle a
    node boundary), returned in the original order."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    offsets, start = [0] * len(sizes), 0
    for i in order:
        offsets[i] = start
        start += sizes[i]
    return offsets


def transfer_seconds(hw: HardwareProfile, src_set: int, dst_set: int, nbytes: float, same_node: bool) -> float:
    """Seconds to move `nbytes` of fields from one set to another (ON_CONTROLLER: the controller) along the path
    the executor takes (layout.transfer_path), `same_node`: whether the two sets share one node (PlanCosts.same_node;
    it matters only between two sets). A result for the controller also waits to reach it (Runtime.result_wait_s),
    and a call fed by the controller waits for it to be sent and started (Runtime.send_wait_s). Between two sets
    the result waits to reach the controller too: the controller owns the references it passes on, and the
    consumer's worker learns from it that the producer's outputs exist (Ray's ownership: an object's owner, the
    process that submitted the task making it, is told of its creation and answers every wait for it) before it
    fetches them straight from the producer."""
    path = transfer_path(src_set, dst_set)
    if path == "none":
        return 0.0
    if path == "host":  # with no bytes still a wait: a call the controller makes after a step of its own (trace)
        wait = (hw.runtime.result_wait_s() if dst_set == ON_CONTROLLER
                else hw.runtime.send_wait_s() if src_set == ON_CONTROLLER else 0.0)
        return (coll.host_transfer(hw, nbytes) if nbytes > 0 else 0.0) + wait
    if nbytes <= 0:
        return 0.0
    return hw.runtime.result_wait_s() + coll.point_to_point(hw, nbytes, same_node)


def least_transfer_seconds(hw: HardwareProfile, src_set: int, dst_set: int, nbytes: float) -> float:
    """transfer_seconds at the cheaper of sharing a node or not: a lower bound whatever the sets' sizes."""
    return min(transfer_seconds(hw, src_set, dst_set, nbytes, same) for same in (False, True))


class PlanCosts:
    def __init__(self, workload: Workload, placement: Sequence[tuple[Sequence[str], int]],
                 parallelism: Mapping[str, RoleParallelism], hw: HardwareProfile, gpus_per_node: int,
                 memo: costs.CostMemo | None = None) -> None:
        """memo: the cost tables to share (a search passes its own); a fresh one by default."""
        self.workload = workload
        self.memo = memo if memo is not None else costs.CostMemo()
        self.placement = [(tuple(roles), gpus) for roles, gpus in placement]
        self.parallelism = parallelism
        self.hw = hw
        self.gpus_per_node = gpus_per_node
        self.set_index = {role: i for i, (roles, _) in enumerate(self.placement) for role in roles}
        self.generator = generation_role(workload, self.set_index)
        self.offsets = set_offsets([g for _, g in self.placement], gpus_per_node)
        self._layout_roles: dict[tuple[str, str], str | None] = {}

    @classmethod
    def of_plan(cls, plan: Plan, hw: HardwareProfile | None = None) -> PlanCosts:
        """`plan` costed on its cluster's profile, or on `hw`."""
        return cls(plan.workload, [(g.models, g.gpus) for g in plan.placement], plan.parallelism,
                   plan.cluster.profile if hw is None else hw, plan.cluster.gpus_per_node)

    # -- where things run -------------------------------------------------------------------------
    def set_of(self, node: Node) -> int:
        """Placement set a call runs on; ON_CONTROLLER for the controller's steps and rule-based rewards."""
        role = self.layout_role(node)
        return ON_CONTROLLER if role is None else self.set_index[role]

    def nodes_of(self, index: int) -> tuple[int, int]:
        start = self.offsets[index]
        return start // self.gpus_per_node, (start + self.placement[index][1] - 1) // self.gpus_per_node

    def host_ranks(self) -> dict[int, dict[int, int]] | None:
        """Each set's ranks on each node it spans, where the profile's processes share a host's cores
        (Compute.host_parallelism) and two or more sets, or a set and the controller (ON_CONTROLLER: one process on
        the first node, where the profile measured its CPU, Runtime.controller_task_cpu_us), share a node; None
        where nothing can slow another."""
        if self.hw.compute.host_parallelism is None:
            return None
        ranks: dict[int, dict[int, int]] = {}
        for index, (_, gpus) in enumerate(self.placement):
            start, end = self.offsets[index], self.offsets[index] + gpus
            first, last = self.nodes_of(index)
            ranks[index] = {node: min(end, (node + 1) * self.gpus_per_node) - max(start, node * self.gpus_per_node)
                            for node in range(first, last + 1)}
        if self.hw.runtime.controller_task_cpu_us > 0:
            ranks[ON_CONTROLLER] = {0: 1}
        sets_on = Counter(node for per_node in ranks.values() for node in per_node)
        return ranks if any(count > 1 for count in sets_on.values()) else None

    def opening_tasks(self, dag: Dag) -> list[tuple[int, int]]:
        """(node id, its set's ranks) of each call that opens a Ray task on its set's workers
        (schedule.task_openers): the controller sends one task per rank."""
        sets = [self.set_of(node) for node in dag.nodes]
        return [(node_id, self.placement[sets[node_id]][1]) for node_id in task_openers(dag, sets)]

    def controller_cpu_seconds(self, dag: Dag) -> float:
        """The controller's CPU in one iteration beyond its steps and rules: Runtime.controller_task_cpu_s per Ray
        task it sends."""
        return sum(ranks for _, ranks in self.opening_tasks(dag)) * self.hw.runtime.controller_task_cpu_s()

    def same_node(self, a: int, b: int) -> bool:
        first_a, last_a = self.nodes_of(a)
        first_b, last_b = self.nodes_of(b)
        return first_a == last_a == first_b == last_b

    def arch(self, role: str) -> ModelArch:
        return self.workload.arch(model_role(self.workload, role))

    # -- seconds ----------------------------------------------------------------------------------
    def node_seconds(self, node: Node) -> float:
        index = self.set_of(node)
        if index < 0:
            return self.hw.runtime.controller_step_s()  # controller steps and rules: host work
        role = self.layout_role(node)
        return call_seconds(self.workload, self.hw, self.gpus_per_node, node, role, self.parallelism[role],
                            self.placement[index][1], self.memory[index].kv_budget, self.memo)

    def task_openings(self, dag: Dag) -> list[float]:
        """Seconds each call pays for opening a Ray task on its set's workers (by node id; 0 for the calls that
        follow another in one task, and for the controller's): Runtime.task_opening_s on its set's ranks, for the
        calls opening_tasks names."""
        openings = [0.0] * len(dag.nodes)
        for node_id, ranks in self.opening_tasks(dag):
            openings[node_id] = self.hw.runtime.task_opening_s(ranks)
        return openings

    def engine_batch(self, dag: Dag) -> int | None:
        """Sequences a generation replica runs at once: the largest batch any generate call of `dag` chose
        (every call's own fastest batch fits under it, so capping the engine there changes no call's cost);
        None when nothing generates on GPUs."""
        batches = [generation_cost(self.workload, self.hw, self.gpus_per_node, node, self.generator,
                                   self.parallelism[self.generator], self.placement[self.set_of(node)][1],
                                   self.memory[self.set_of(node)].kv_budget, self.memo).max_batch
                   for node in dag.nodes if node.kind == "generate" and self.set_of(node) >= 0]
        return max(batches, default=None)

    def layout_role(self, node: Node) -> str | None:
        """The placed role whose GPUs and layout run a call (None: the controller runs it); kept by (role, op), as a
        schedule asks it of each call several times."""
        key = (node.role, node.op)
        if key not in self._layout_roles:
            self._layout_roles[key] = call_role(self.workload, self.generator, node.role, node.op)
        return self._layout_roles[key]

    def switch_seconds(self, role: str) -> float:
        """Cost of one switch of `role` into its generation layout (schedule.switch_points says when):
        the hybrid engine's resharding, or a rollout engine's weight sync. Going back moves nothing (the
        generation copy is dropped, and inference shares the training layout): its engines' fixed cost is
        charged with the switch in (costs.transition_time)."""
        index = self.set_index[role]
        same = role == ROLLOUT and self.same_node(self.set_index[generating_role(self.workload)], index)
        return switch_seconds(self.workload, self.hw, self.gpus_per_node, role, self.parallelism[role],
                              self.placement[index][1], same, self.memo)

    def edge_seconds(self, src_set: int, dst_set: int, nbytes: float) -> float:
        """Seconds to move `nbytes` of fields along the path the executor takes (layout.transfer_path); a
        result for the controller also waits to reach it (Runtime.result_wait_s), and a call fed by the controller
        waits for it to be sent and started (Runtime.send_wait_s)."""
        same = transfer_path(src_set, dst_set) == "direct" and self.same_node(src_set, dst_set)
        return transfer_seconds(self.hw, src_set, dst_set, nbytes, same)

    # -- memory -----------------------------------------------------------------------------------
    @cached_property
    def memory(self) -> list[SetMemory]:
        return [
            set_memory(self.workload, self.hw, index, roles, gpus,
                       {r: role_memory(self.workload, r, self.parallelism[r], self.hw.compute.value_bytes,
                                       self.hw.compute.attention, vllm_tokens=self.hw.runtime.vllm_batched_tokens)
                        for r in roles}, self.generator)
            for index, (roles, gpus) in enumerate(self.placement)
        ]

    @property
    def infeasible_reason(self) -> str:
        return next((m.reason for m in self.memory if m.reason), "")

    def vllm_memory_utilization(self) -> float:
        """vLLM's gpu_memory_utilization that gives its KV cache the room this plan's generation was costed with
        (the generating set's kv_budget). vLLM budgets capacity x fraction for what it allocates itself - its
        copy of the weights, its activations' peak and the KV cache - and does not count memory held before it
        starts (the training states beside it) against the fraction (vLLM 0.32's worker, request_memory and
        determine_available_memory): so the fraction is those three over the GPU's capacity, rounded down."""
        generator = self.generator
        need = role_memory(self.workload, generator, self.parallelism[generator], self.hw.compute.value_bytes,
                           self.hw.compute.attention, vllm_tokens=self.hw.runtime.vllm_batched_tokens)
        budget = self.memory[self.set_index[generator]].kv_budget
        return math.floor(1000 * (need.vllm_own + budget) / (self.hw.memory.capacity_gib * GIB)) / 1000


@dataclass(frozen=True)
class RoleMemory:
    """Bytes per GPU one role needs: kept between calls, and during its largest non-generation call;
    for the role that generates, the extra weights and working memory of generation and the KV
    cache of one sequence."""

    resident: float
    transient: float
    gen_extra: float = 0.0
    kv: memory.KvSequence = memory.NO_KV
    gen_replicas: int = 1
    vllm_own: float = 0.0  # vLLM: what it allocates besides its KV cache (its copy of the shard, activations)
    vllm_fraction: float | None = None  # vLLM: the plan's gpu_memory_utilization, which caps its KV cache

    @property
    def kv_per_sequence(self) -> float:
        """The least KV-cache room generation starts with: one sequence at its longest."""
        return self.kv.longest


def train_resident(workload: Workload, role: str, train: TrainConfig, value_bytes: int) -> float:
    """Bytes per GPU of a trained role's states: they depend on its layout (tp, pp, dp, shard, shard_group) only."""
    return memory.train_resident_bytes(workload.arch(role), train, head_of(workload, role), value_bytes)


def train_transient(workload: Workload, role: str, train: TrainConfig, value_bytes: int,
                    attention: str = "flash") -> float:
    """Bytes per GPU of one optimizer step of a trained role (activations, logits, gathered layers)."""
    w = workload
    return memory.train_transient_bytes(w.arch(role), train, w.sequences // w.mini_batches, w.seq_len,
                                        head_of(w, role), value_bytes, attention)


def train_memory(workload: Workload, role: str, train: TrainConfig, value_bytes: int,
                 attention: str = "flash") -> tuple[float, float]:
    """(resident, transient) bytes per GPU of a trained role's states and of one optimizer step.
    attention: the hardware's attention kernel (HardwareProfile.compute.attention), as below."""
    return (train_resident(workload, role, train, value_bytes),
            train_transient(workload, role, train, value_bytes, attention))


def infer_transient(workload: Workload, role: str, infer: InferConfig, train: TrainConfig | None,
                    value_bytes: int, attention: str = "flash") -> float:
    """Bytes per GPU of one forward micro-batch (a sharded trained role also gathers layer weights)."""
    sharded = train if train is not None and train.shards("weights") > 1 else None
    return memory.infer_transient_bytes(workload.arch(role), infer, workload.seq_len, head_of(workload, role), sharded,
                                        value_bytes, attention)


def gen_memory(workload: Workload, gen: GenConfig, train: TrainConfig | None, value_bytes: int,
               attention: str = "flash", *, vllm_tokens: int) -> tuple[float, memory.KvSequence]:
    """(extra bytes while generating, KV-cache bytes of one sequence) per GPU. With a training layout
    (hybrid engine) the extra weights are those its switch makes (memory.generation_weights_bytes). `vllm_tokens`: the
    hardware's Runtime.vllm_batched_tokens, what vLLM profiles its activations with (engine_working)."""
    arch = workload.arch(generating_role(workload))
    kv = memory.kv_sequence(arch, gen, workload.prompt_len, workload.response_lengths, value_bytes)
    working = engine_working(workload, gen, value_bytes, attention, vllm_tokens)
    # A separate rollout set's synced shards are its resident weights (role_memory); the hybrid engine's switch
    # makes its tensors and holds one round of buffers, gone before the engine works.
    made = memory.generation_weights_bytes(arch, gen, train, value_bytes) if train is not None else 0.0
    buffers = memory.switch_buffer_bytes(arch, gen, train, value_bytes) if train is not None else 0.0
    if gen.engine != "vllm":
        return made + max(buffers, working), kv
    # vLLM copies the shards into its own (a rollout set keeps its synced ones to fill at the next sync; the hybrid
    # engine's are freed before vLLM allocates its working memory and KV cache): the phase peaks at the switch, at
    # the copy, or generating.
    shard = memory.generation_shard_bytes(arch, gen, value_bytes)
    return max(made + max(buffers, shard), shard + working), kv


def engine_working(workload: Workload, gen: GenConfig, value_bytes: int, attention: str, vllm_tokens: int) -> float:
    """Working memory the generation engine sets aside: hfplan's torch engine prefills one sequence at a time
    (memory.generation_working_bytes); vLLM what its profile run of `vllm_tokens` tokens peaks at, with the
    sampler's logits of the sequences it runs at once (the executor's max_num_seqs: gen.max_batch, or the
    replica's share of an iteration)."""
    arch = workload.arch(generating_role(workload))
    if gen.engine != "vllm":
        return memory.generation_working_bytes(arch, gen, workload.prompt_len, value_bytes, attention)
    return memory.vllm_working_bytes(arch, gen, vllm_tokens, engine_max_seqs(workload, gen), value_bytes)


def role_memory(workload: Workload, role: str, par: RoleParallelism, value_bytes: int,
                attention: str = "flash", *, vllm_tokens: int) -> RoleMemory:
    """value_bytes: the hardware's compute precision (HardwareProfile.compute.value_bytes); attention: its
    attention kernel (compute.attention: eager keeps score matrices, flash does not); vllm_tokens: its
    Runtime.vllm_batched_tokens (engine_working)."""
    v = value_bytes
    if role == ROLLOUT:
        resident, transient = memory.infer_resident_bytes(workload.arch(model_role(workload, role)), par.gen, "lm",
                                                          v), 0.0
    elif facts_of(workload, role).trains:
        resident, transient = train_memory(workload, role, par.train, v, attention)
    else:
        resident, transient = memory.infer_resident_bytes(workload.arch(role), par.infer, head_of(workload, role),
                                                          v), 0.0
    if par.infer is not None:
        transient = max(transient, infer_transient(workload, role, par.infer, par.train, v, attention))
    if par.gen is None:
        return RoleMemory(resident, transient)
    extra, kv = gen_memory(workload, par.gen, par.train if role != ROLLOUT else None, v, attention,
                           vllm_tokens=vllm_tokens)
    if par.gen.engine != "vllm":
        return RoleMemory(resident, transient, extra, kv, par.gen.dp)
    arch = workload.arch(generating_role(workload))
    own = memory.generation_shard_bytes(arch, par.gen, v) + engine_working(workload, par.gen, v, attention, vllm_tokens)
    return RoleMemory(resident, transient, extra, kv, par.gen.dp, own, par.gen.gpu_memory_utilization)


def set_memory(workload: Workload, hw: HardwareProfile, index: int, roles: Sequence[str], gpus: int,
               needs: Mapping[str, RoleMemory], generator: str) -> SetMemory:
    """Colocated roles: resident states add up, calls take turns, so the peak is the sum of resident
    states plus the largest call; generation's KV cache takes what is left, up to what it can use."""
    usable = hw.memory.usable_bytes
    resident = {r: needs[r].resident for r in roles}
    transient = {r: needs[r].transient for r in roles if needs[r].transient > 0}
    held = sum(resident.values())
    kv_budget, reason = 0.0, ""
    if generator in roles:
        need = needs[generator]
        kv_budget = max(0.0, usable - held - need.gen_extra)
        if need.vllm_fraction is not None:  # vLLM's KV cache: what its fraction of the GPU leaves it, at most
            kv_budget = min(kv_budget, max(0.0, need.vllm_fraction * hw.memory.capacity_gib * GIB - need.vllm_own))
        if kv_budget < need.kv_per_sequence:
            reason = (f"set {index} ({', '.join(roles)}): no room for the KV cache of one sequence "
                      f"({memory.gib(need.kv_per_sequence):.2f} GiB) after "
                      f"{memory.gib(held + need.gen_extra):.1f} GiB of weights and states; "
                      f"{memory.gib(usable):.1f} GiB usable per GPU")
        per_replica = math.ceil(workload.sequences / need.gen_replicas)
        kv_needed = need.kv.held(per_replica, per_replica)
        transient[f"{generator}.generate"] = need.gen_extra + min(kv_budget, kv_needed)
    peak = held + max(transient.values(), default=0.0)
    if not reason and peak > usable:
        parts = ", ".join(f"{r} {memory.gib(b):.1f}" for r, b in resident.items())
        biggest = max(transient, key=transient.get) if transient else "-"
        reason = (f"set {index} ({', '.join(roles)}) on {gpus} GPUs needs {memory.gib(peak):.1f} GiB per "
                  f"GPU > {memory.gib(usable):.1f} GiB usable (resident GiB: {parts}; largest call: "
                  f"{biggest} {memory.gib(transient.get(biggest, 0.0)):.1f} GiB)")
    return SetMemory(index, tuple(roles), resident, transient, usable, kv_budget, reason)


def call_seconds(workload: Workload, hw: HardwareProfile, gpus_per_node: int, node: Node, role: str,
                 par: RoleParallelism, gpus: int, kv_budget: float, memo: costs.CostMemo | None = None) -> float:
    """Seconds of one traced call of `role` (the generating role for generate) on its set of `gpus`."""
    if node.kind == "generate":
        return generation_cost(workload, hw, gpus_per_node, node, role, par, gpus, kv_budget, memo).seconds
    w, where = workload, costs.SetShape(gpus, gpus_per_node)
    arch = w.arch(model_role(w, role))
    head = head_of(w, role)
    if node.kind == "forward":
        shards = par.train.shards("weights") if par.train is not None else 1
        fsdp = par.train is not None and trains_through_fsdp(par.train.dp, hw.compute.value_bytes)
        return costs.inference_time(hw, arch, par.infer, where, node.sequences, w.seq_len, head, shards, fsdp,
                                    memo=memo)
    if node.kind == "update":
        return costs.update_time(hw, arch, par.train, where, node.sequences, w.seq_len, head, w.mini_batches,
                                 w.epochs, memo=memo)
    raise ValueError(f"no cost for {node.label}")


def generation_cost(workload: Workload, hw: HardwareProfile, gpus_per_node: int, node: Node, role: str,
                    par: RoleParallelism, gpus: int, kv_budget: float,
                    memo: costs.CostMemo | None = None) -> costs.GenerationCost:
    """One traced generate call of the generating `role` on its set of `gpus` (seconds, batch, waves)."""
    w = workload
    return costs.generation_time(hw, w.arch(model_role(w, role)), par.gen, costs.SetShape(gpus, gpus_per_node),
                                 node.sequences, w.prompt_len, w.response_len, kv_budget, memo=memo,
                                 lengths=w.response_lengths)


def switch_seconds(workload: Workload, hw: HardwareProfile, gpus_per_node: int, role: str, par: RoleParallelism,
                   gpus: int, same_node_as_actor: bool = False, memo: costs.CostMemo | None = None) -> float:
    """Training -> generation layout: the hybrid engine's resharding of the actor, or the weight sync of
    a separate rollout engine."""
    arch, where = workload.arch(generating_role(workload)), costs.SetShape(gpus, gpus_per_node)
    if role == ROLLOUT:
        return costs.weight_sync_time(hw, arch, par.gen, where, same_node_as_actor)
    return costs.transition_time(hw, arch, par.train, par.gen, where, memo=memo)
