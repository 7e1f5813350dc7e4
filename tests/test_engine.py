"""The simpy engine on hand-made plans: serialisation per set, overlap across sets, switches, transfers,
memory refusals, and agreement with the independent critical-path computation."""

from __future__ import annotations

import math

import pytest

from hfplan.errors import HfplanError
from hfplan.plan import EDGE, GenConfig, InferConfig, RoleParallelism, TrainConfig
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs, mapping
from hfplan.simulator.engine import critical_path, run, simulate_plan
from hfplan.simulator.trace import trace
from hfplan.spec import load_workload, make_cluster
from tests.support.plans import build_plan, role_parallelism, small_workload

ALL_PPO = ["actor", "critic", "reference", "reward"]
ALL_SAFE = ["actor", "critic", "reference", "reward", "cost", "cost_critic"]

# llama2-7b by hand: per layer 4*4096^2 (q, k, v, o) + 3*4096*11008 (MLP) + 2*4096 (norms) = 202,383,360;
# 32 layers + embedding 32000*4096 + final norm 4096 + untied LM head 32000*4096.
LLAMA2_7B_LM_PARAMS = 32 * 202_383_360 + 32000 * 4096 + 4096 + 32000 * 4096
LLAMA2_7B_SCALAR_PARAMS = 32 * 202_383_360 + 32000 * 4096 + 4096 + 4096 + 1


def _w(algorithm: str):
    return load_workload(f"{algorithm}-llama2-7b")


def _plans() -> dict:
    """Named plans covering every algorithm, colocated / split / standalone, a rollout engine and a rule reward."""
    rule_ppo = small_workload("ppo", models={"actor": "qwen2.5-0.5b", "critic": "qwen2.5-0.5b",
                                             "reference": "qwen2.5-0.5b", "reward": "rule:vowel-fraction"})
    return {
        "ppo-colocated": lambda: build_plan(_w("ppo"), [(ALL_PPO, 32)]),
        "ppo-split": lambda: build_plan(_w("ppo"), [(["actor", "critic"], 16), (["reference"], 8), (["reward"], 8)]),
        "ppo-standalone": lambda: build_plan(_w("ppo"), [([r], 8) for r in ALL_PPO]),
        "ppo-rollout": lambda: build_plan(_w("ppo"), [(["actor", "critic"], 16), (["rollout"], 8),
                                                      (["reference", "reward"], 8)]),
        "grpo-colocated": lambda: build_plan(_w("grpo"), [(["actor", "reference", "reward"], 16)]),
        "grpo-split": lambda: build_plan(_w("grpo"), [(["actor"], 16), (["reference", "reward"], 8)]),
        "remax-split": lambda: build_plan(_w("remax"), [(["actor", "reward"], 16), (["reference"], 8)]),
        "remax-standalone": lambda: build_plan(_w("remax"), [(["actor"], 16), (["reference"], 8), (["reward"], 8)]),
        "safe-colocated": lambda: build_plan(_w("safe-rlhf"), [(ALL_SAFE, 32)]),
        "safe-split": lambda: build_plan(_w("safe-rlhf"), [(["actor", "critic", "cost_critic"], 16),
                                                           (["reference", "reward", "cost"], 16)]),
        "qwen-ppo-rule-reward": lambda: build_plan(rule_ppo, [(["actor", "critic", "reference"], 4)]),
        "qwen-grpo-small": lambda: build_plan(small_workload("grpo"), [(["actor"], 2), (["reference", "reward"], 2)]),
    }


PLANS = _plans()


def _compute(timeline, set_index=None):
    return [s for s in timeline.spans if s.kind == "compute" and (set_index is None or s.set == set_index)]


def _span(timeline, role, op, kind="compute"):
    found = [s for s in timeline.spans if s.role == role and s.op == op and s.kind == kind]
    assert len(found) == 1, (role, op, kind, found)
    return found[0]


def _hw():
    return make_cluster(8).profile


def _dispatch(plan) -> float:
    """What each call on a set costs its worker before its work (a dispatch span on the timeline)."""
    return plan.cluster.profile.runtime.call_dispatch_s()


# -- serialisation and program order ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PLANS))
def test_calls_on_one_set_serialise_in_program_order(name):
    plan = PLANS[name]()
    sim = simulate_plan(plan)
    dag = trace(plan.workload)
    for index in range(len(plan.placement)):
        spans = sorted(_compute(sim.timeline, index), key=lambda s: s.start)
        nodes = [n for n in dag.nodes if sim.costs.set_of(n) == index]
        assert [f"{s.role}.{s.op}" for s in spans] == [n.label for n in nodes], f"set {index}"
        for before, after in zip(spans, spans[1:], strict=False):
            assert after.start >= before.end - 1e-9, f"set {index}: {before} overlaps {after}"
        # Each call lasts what the cost model says for it: its dispatch on the worker, drawn before it, and its work.
        dispatches = sorted((s for s in sim.timeline.spans if s.kind == "dispatch" and s.set == index
                             and EDGE not in s.op), key=lambda s: s.start)
        assert len(dispatches) == len(spans)
        for span, dispatch, node in zip(spans, dispatches, nodes, strict=True):
            assert dispatch.end <= span.start + 1e-12 and (dispatch.role, dispatch.op) == (node.role, node.op)
            assert (span.end - span.start) + (dispatch.end - dispatch.start) == pytest.approx(
                sim.costs.node_seconds(node), rel=1e-9, abs=1e-12)
        # A switch on a set never overlaps a call on it.
        for switch in (s for s in sim.timeline.spans if s.kind == "transition" and s.set == index):
            assert all(switch.end <= s.start + 1e-9 or switch.start >= s.end - 1e-9 for s in spans)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_iteration_time_equals_critical_path(name):
    plan = PLANS[name]()
    sim = simulate_plan(plan)
    assert sim.timeline.iteration_s > 0
    assert sim.timeline.iteration_s == pytest.approx(critical_path(trace(plan.workload), sim.costs), rel=1e-12)
    assert run(trace(plan.workload), sim.costs).iteration_s == sim.timeline.iteration_s  # deterministic
    assert sim.estimate.iteration_s == sim.timeline.iteration_s


@pytest.mark.parametrize("name", sorted(PLANS))
def test_estimate_fields(name):
    plan = PLANS[name]()
    sim = simulate_plan(plan)
    est = sim.estimate
    w = plan.workload
    assert w.tokens_per_iteration == w.batch_prompts * w.samples_per_prompt * (w.prompt_len + w.response_len)
    assert est.tokens_per_s == pytest.approx(w.tokens_per_iteration / est.iteration_s, rel=1e-12)
    assert est.stages == sim.timeline.stages()
    assert len(est.peak_memory_gib) == len(plan.placement)
    usable = plan.cluster.profile.memory.capacity_gib - plan.cluster.profile.memory.reserved_gib
    assert all(0 < peak <= usable + 1e-3 for peak in est.peak_memory_gib)
    assert list(est.timeline) == list(sim.timeline.spans)
    assert [s.start for s in est.timeline] == sorted(s.start for s in est.timeline)
    assert all(s.end >= s.start for s in est.timeline)


# -- concurrency across sets --------------------------------------------------------------------------
def test_inference_on_disjoint_sets_overlaps():
    plan = PLANS["ppo-standalone"]()
    sim = simulate_plan(plan)
    tl = sim.timeline
    dispatch = _dispatch(plan)
    generate = _span(tl, "actor", "generate")
    calls = [_span(tl, "actor", "log_prob"), _span(tl, "critic", "values"), _span(tl, "reference", "log_prob"),
             _span(tl, "reward", "score")]
    assert {s.set for s in calls} == {0, 1, 2, 3}
    # All four run at once: the latest start comes before the earliest end.
    assert max(s.start for s in calls) < min(s.end for s in calls)
    # Sets of 8 on 8-GPU nodes each sit on their own node: the sequences cross the inter-node link,
    # 1024 x (1024 + 1024 token ids of 8 bytes + 1024 fp32 mask values) bytes at 25 GB/s x 0.9 + 6 us.
    hop = 1024 * 1024 * 20 / (25e9 * 0.9) + 6e-6
    assert _span(tl, "actor", "log_prob").start == pytest.approx(generate.end + dispatch)  # same set: no transfer
    for span in calls[1:]:
        assert span.start == pytest.approx(generate.end + hop + dispatch, rel=1e-12)
        transfer = _span(tl, span.role, f"actor.generate->{span.role}.{span.op}", kind="transfer")
        assert (transfer.start, transfer.set) == (pytest.approx(generate.end), span.set)
        assert transfer.end - transfer.start == pytest.approx(hop, rel=1e-9)


def test_remax_reference_on_its_own_set_overlaps_the_greedy_generation():
    """Calls start when their inputs arrive, not at a stage barrier: the reference can score the sampled
    responses while the actor is still generating the greedy baseline."""
    plan = PLANS["remax-standalone"]()
    tl = simulate_plan(plan).timeline
    sampled, greedy = _span(tl, "actor", "generate"), _span(tl, "actor", "generate(greedy)")
    reference = _span(tl, "reference", "log_prob")
    assert greedy.start == pytest.approx(sampled.end + _dispatch(plan))
    assert sampled.end < reference.start < greedy.end
    # Phases overlap in time; the stages follow the critical path, so they still add up to the iteration.
    stages = tl.stages()
    assert sum(stages.values()) == pytest.approx(tl.iteration_s, rel=1e-12)


# -- colocated versus standalone ------------------------------------------------------------------------
def test_moving_the_reference_to_its_own_set():
    w = _w("ppo")
    cluster = make_cluster(32)
    colocated = simulate_plan(build_plan(w, [(ALL_PPO, 16)], cluster=cluster))
    split_plan = build_plan(w, [(["actor", "critic", "reward"], 16), (["reference"], 8)], cluster=cluster)
    split = simulate_plan(split_plan)
    a, b = colocated.timeline, split.timeline
    hw = cluster.profile
    ref_node = next(n for n in trace(w).nodes if n.label == "reference.log_prob")

    # The standalone reference costs what call_seconds says for 8 GPUs, and starts once generation is
    # done and the sequences have crossed to its node (set 0 takes nodes 0-1, set 1 node 2).
    ref_b = _span(b, "reference", "log_prob")
    assert ref_b.set == 1
    expected = mapping.call_seconds(w, hw, 8, ref_node, "reference", split_plan.parallelism["reference"], 8, 0.0)
    assert ref_b.end - ref_b.start == pytest.approx(expected - _dispatch(split_plan), rel=1e-9)
    hop = 1024 * 1024 * 20 / (hw.links.inter_node.bandwidth_gbytes_per_s * 1e9 * hw.links.inter_node.efficiency) \
        + hw.links.inter_node.latency_us * 1e-6
    assert ref_b.start == pytest.approx(_span(b, "actor", "generate").end + hop + _dispatch(split_plan), rel=1e-12)

    # On 16 GPUs (colocated) the same call is faster than on 8.
    ref_a = _span(a, "reference", "log_prob")
    assert ref_a.end - ref_a.start < ref_b.end - ref_b.start

    # The colocated set loses the reference call; every other call keeps its duration, except generation,
    # which gets the reference's freed memory as KV cache and can only get faster.
    assert colocated.costs.memory[0].kv_budget < split.costs.memory[0].kv_budget
    durations_a = {(s.role, s.op): s.end - s.start for s in _compute(a, 0)}
    durations_b = {(s.role, s.op): s.end - s.start for s in _compute(b, 0)}
    assert set(durations_a) - set(durations_b) == {("reference", "log_prob")}
    for key, seconds in durations_b.items():
        if key == ("actor", "generate"):
            assert seconds <= durations_a[key] + 1e-9
        else:
            assert seconds == pytest.approx(durations_a[key], rel=1e-12), key

    def busy(tl):
        return sum(s.end - s.start for s in tl.spans if s.set == 0 and s.kind != "transfer")

    dispatch = _dispatch(split_plan)
    assert busy(b) <= busy(a) - (ref_a.end - ref_a.start) - dispatch + 1e-9
    # The reference finishes before set 0's last preparation call, so the iteration shortens by exactly
    # what set 0 no longer does (the call and its dispatch).
    assert ref_b.end < _span(b, "reward", "score").end
    saved = (ref_a.end - ref_a.start + dispatch
             + durations_a[("actor", "generate")] - durations_b[("actor", "generate")])
    assert b.iteration_s == pytest.approx(a.iteration_s - saved, rel=1e-9)


# -- layout switches --------------------------------------------------------------------------------
def _actor_plan(train: TrainConfig, gen: GenConfig, gpus: int = 16):
    w = _w("grpo")
    actor = RoleParallelism(train=train, infer=InferConfig(tp=train.tp, pp=train.pp, dp=train.dp, micro_batch=4),
                            gen=gen)
    return build_plan(w, [(["actor"], gpus), (["reference", "reward"], 8)], cluster=make_cluster(32),
                      overrides={"actor": actor})


def test_resharding_transition_before_generate_by_hand():
    plan = _actor_plan(TrainConfig(tp=4, dp=4, micro_batch=2), GenConfig(tp=2, dp=8))
    tl = simulate_plan(plan).timeline
    switch = _span(tl, "actor", "reshard", kind="transition")
    generate = _span(tl, "actor", "generate")
    assert (switch.set, switch.phase, switch.start) == (0, "generation", pytest.approx(_dispatch(plan)))
    assert generate.start == pytest.approx(switch.end)
    # Training shard per GPU: 1/(tp 4) of the model, split again over dp 4 by FSDP = 1/16; generation
    # shard = 1/2. Ranks are pp-major, then dp, then tp: the pieces of a GPU's half sit on its tp
    # neighbour (stride 1) and on its 4 FSDP peers (stride 4) = 8 GPUs, 4 on each of the 2 nodes.
    # A ring all-gather of the half model's bf16 bytes through all 8 (NCCL's ring across nodes, in its Simple
    # protocol), its chunks through both links at once (every step's latency, the slower bandwidth term): each
    # GPU passes 7/8 of the bytes at 300 GB/s x 0.77 in the node, and the node boundary carries the ring's whole
    # stream at the share of the node's 25 GB/s x 0.9 its 4 GPUs have (1/8 each); Simple's 8.4 us, then 6 steps
    # in a node at NVLink's 3.4 us (more than the 3 us network overhead) and 1 across the network at 14 us.
    # The bytes: a GPU receives 1/2 - 1/16 of every split tensor, and 3/4 of the norms (replicated over tp,
    # so whole in the generation shard; FSDP-sharded over 4); the ring's result is 8/7 of what each GPU
    # receives.
    assert CATALOG["llama2-7b"].params("lm") == LLAMA2_7B_LM_PARAMS
    norms = (2 * CATALOG["llama2-7b"].layers + 1) * CATALOG["llama2-7b"].hidden
    nbytes = 2 * ((LLAMA2_7B_LM_PARAMS - norms) * (1 / 2 - 1 / 16) + norms * 3 / 4) * 8 / 7
    expected = (8.4 + 6 * 3.4 + 14.0) * 1e-6 + max(7 / 8 * nbytes / (300e9 * 0.77),
                                                   7 / 8 * nbytes / (4 * 25e9 * 0.9 / 8))
    assert switch.end - switch.start == pytest.approx(expected, rel=1e-9)
    # One switch in; the way back is only marked (priced with the way in) where the executor runs it.
    transitions = [(s.op, s.end - s.start) for s in tl.spans if s.kind == "transition"]
    assert transitions == [("reshard", switch.end - switch.start), ("reshard back", 0.0)]


def test_no_transition_when_generation_reuses_the_training_shards():
    # Replicated training (no FSDP) with the same tp and pp: each GPU already holds its generation shard.
    plan = _actor_plan(TrainConfig(tp=4, dp=4, micro_batch=2, shard=False), GenConfig(tp=4, dp=4))
    tl = simulate_plan(plan).timeline
    # Nothing moves in; the way back's mark (no seconds) still closes generation where the executor leaves it.
    assert [(s.op, s.end - s.start) for s in tl.spans if s.kind == "transition"] == [("reshard back", 0.0)]
    assert _span(tl, "actor", "generate").start == pytest.approx(_dispatch(plan))


def test_fsdp_training_pays_a_gather_even_with_the_same_tp():
    plan = _actor_plan(TrainConfig(tp=4, dp=4, micro_batch=2, shard=True), GenConfig(tp=4, dp=4))
    switch = _span(simulate_plan(plan).timeline, "actor", "reshard", kind="transition")
    # The 1/4 generation shard is gathered from its dp = 4 FSDP peers, tp = 4 ranks apart: ranks 0, 4 on
    # node 0 and 8, 12 on node 1, one ring through the four (NCCL's Simple protocol): each passes 3/4 of the
    # bytes, at 300 GB/s x 0.77 in the node and at the 2 GPUs' share (1/8 each) of 25 GB/s x 0.9 across the
    # nodes; pipelined, Simple's 8.4 us, 2 steps in a node at 3.4 us, 1 across at 14 us. A GPU receives 3/16 of
    # every split tensor and 3/4 of the norms; the ring's result is 4/3 of that. FSDP2 unshards unit by unit: 33
    # rings (32 layers and the root), each paying the latencies, the bytes split among them.
    norms = (2 * CATALOG["llama2-7b"].layers + 1) * CATALOG["llama2-7b"].hidden
    nbytes = 2 * ((LLAMA2_7B_LM_PARAMS - norms) * (1 / 4 - 1 / 16) + norms * 3 / 4) * 4 / 3
    expected = 33 * (8.4 + 2 * 3.4 + 14.0) * 1e-6 + max(3 / 4 * nbytes / (300e9 * 0.77),
                                                        3 / 4 * nbytes / (2 * 25e9 * 0.9 / 8))
    assert switch.end - switch.start == pytest.approx(expected, rel=1e-9)


def test_remax_pays_one_transition_for_two_generations():
    tl = simulate_plan(PLANS["remax-split"]()).timeline
    switches = [s for s in tl.spans if s.kind == "transition" and s.op == "reshard"]
    assert len(switches) == 1
    assert switches[0].end == pytest.approx(_span(tl, "actor", "generate").start)
    greedy = _span(tl, "actor", "generate(greedy)")
    backs = [s for s in tl.spans if s.op == "reshard back"]
    assert len(backs) == 1 and backs[0].start > greedy.end  # one way back, after both generations


def test_rollout_engine_syncs_weights_before_generating():
    plan = PLANS["ppo-rollout"]()
    sim = simulate_plan(plan)
    tl = sim.timeline
    rollout_set = plan.set_of("rollout")
    sync = _span(tl, "rollout", "weight sync", kind="transition")
    generate = _span(tl, "actor", "generate")
    assert sync.set == generate.set == rollout_set
    assert (sync.start, generate.start) == (pytest.approx(_dispatch(plan)), pytest.approx(sync.end))
    # Only the rollout engine switches: the actor's own set never holds a generation layout.
    assert [s.role for s in tl.spans if s.kind == "transition"] == ["rollout"]
    # Each of the 8 rollout GPUs receives its tp=2 shard of bf16 weights; the node's link carries all 8
    # (the sets of 16 and 8 lie on different nodes): 8 x 2 x (half the split params + the norms whole) bytes
    # at 25 GB/s x 0.9 + 6 us; and one round trip through the controller, where Ray resolves the buckets the loads
    # take as arguments.
    norms = (2 * CATALOG["llama2-7b"].layers + 1) * CATALOG["llama2-7b"].hidden
    round_trip = sim.costs.hw.runtime.controller_call_us * 1e-6
    assert round_trip > 0
    expected = 8 * 2 * ((LLAMA2_7B_LM_PARAMS - norms) / 2 + norms) / (25e9 * 0.9) + 6e-6 + round_trip
    assert sync.end - sync.start == pytest.approx(expected, rel=1e-9)
    assert costs.weight_sync_time(sim.costs.hw, CATALOG["llama2-7b"], plan.parallelism["rollout"].gen,
                                  costs.SetShape(8, 8), same_node=False) == pytest.approx(expected, rel=1e-12)


# -- controller and rules -------------------------------------------------------------------------------
def test_controller_and_rule_calls_run_on_the_host_row():
    plan = PLANS["qwen-ppo-rule-reward"]()
    tl = simulate_plan(plan).timeline
    score, step = _span(tl, "reward", "score"), _span(tl, "controller", "gae")
    assert score.set == step.set == -1
    assert score.end == score.start and step.end == step.start  # host work costs nothing
    hw = plan.cluster.profile
    w = plan.workload
    # The rule reads the sequences over PCIe from the GPUs: 64 x (256 + 256 ids x 8 B + 256 mask x 4 B).
    nbytes = 64 * (256 * 8 + 256 * 8 + 256 * 4)
    host = hw.links.host
    hop = nbytes / (host.bandwidth_gbytes_per_s * 1e9 * host.efficiency) + host.latency_us * 1e-6
    assert score.start == pytest.approx(_span(tl, "actor", "generate").end + hop, rel=1e-9)
    assert w.sequences == 64


def test_the_controller_fetches_a_calls_outputs_once():
    """GRPO on one set: the rule reward fetches the generation's outputs, so the group normalisation that reads
    its response mask next finds it on the controller (no transfer, in the timeline or the longest path); PPO's
    advantage step still waits for the log-prob and value calls, whose outputs nothing fetched before it."""
    from hfplan.layout import ON_CONTROLLER
    from hfplan.simulator.schedule import controller_fetches

    grpo = build_plan(small_workload("grpo", models={"actor": "qwen2.5-0.5b", "reference": "qwen2.5-0.5b",
                                                     "reward": "rule:vowel-fraction"}), [(["actor", "reference"], 4)])
    dag = trace(grpo.workload)
    where = mapping.PlanCosts.of_plan(grpo)
    sets = [where.set_of(node) for node in dag.nodes]
    labels = {node.id: node.label for node in dag.nodes}
    fetched = {node.label: {labels[e.src] for e in node.deps} for node in controller_fetches(dag, sets).nodes}
    traced = {node.label: {labels[e.src] for e in node.deps} for node in dag.nodes}
    assert "actor.generate" in traced["controller.group_norm"]
    assert fetched["controller.group_norm"] == traced["controller.group_norm"] - {"actor.generate"}
    assert fetched["reward.score"] == traced["reward.score"]  # the first to read them waits for them
    on_sets = {node.label for node in dag.nodes if sets[node.id] != ON_CONTROLLER}
    assert {label: fetched[label] for label in on_sets} == {label: traced[label] for label in on_sets}
    timeline = simulate_plan(grpo).timeline
    assert not [s for s in timeline.spans if s.op.endswith(f"{EDGE}controller.group_norm")]  # score's is on it too
    assert [s for s in timeline.spans if s.op == f"actor.generate{EDGE}reward.score"]
    assert timeline.iteration_s == pytest.approx(critical_path(dag, where))
    ppo = PLANS["qwen-ppo-rule-reward"]()
    dag = trace(ppo.workload)
    where = mapping.PlanCosts.of_plan(ppo)
    sets = [where.set_of(node) for node in dag.nodes]
    labels = {node.id: node.label for node in dag.nodes}
    [gae] = [node for node in controller_fetches(dag, sets).nodes if node.label == "controller.gae"]
    assert {labels[e.src] for e in gae.deps} == {"actor.log_prob", "reference.log_prob", "critic.values",
                                                 "reward.score"}


# -- stages -----------------------------------------------------------------------------------------
def test_stages_of_a_single_set_tile_the_iteration():
    tl = simulate_plan(PLANS["ppo-colocated"]()).timeline
    stages = tl.stages()
    generate = _span(tl, "actor", "generate")
    gae = _span(tl, "controller", "gae")
    last = _span(tl, "actor", "update")
    # Generation: from the reshard at 0 to the end of generate. Preparation: until the controller's GAE.
    assert stages["generation"] == pytest.approx(generate.end)
    assert stages["preparation"] == pytest.approx(gae.end - generate.end)
    assert stages["training"] == pytest.approx(last.end - gae.end)
    assert sum(stages.values()) == pytest.approx(tl.iteration_s)
    assert last.end == tl.iteration_s


def test_tokens_per_second():
    sim = simulate_plan(PLANS["ppo-colocated"]())
    assert sim.timeline.tokens == 1024 * (1024 + 1024)
    assert sim.timeline.tokens_per_s == pytest.approx(1024 * 2048 / sim.timeline.iteration_s)


# -- memory -------------------------------------------------------------------------------------------
def test_a_set_that_does_not_fit_is_named():
    # The critic alone on one GPU: 18 bytes (bf16 weight, fp32 grad, master, two Adam moments) x 6.6 B
    # parameters = 111 GiB > 74 GiB usable on an 80 GiB A100.
    assert 18 * LLAMA2_7B_SCALAR_PARAMS / 2**30 > 74
    plan = build_plan(_w("ppo"), [(["actor", "reference", "reward"], 16), (["critic"], 1)],
                      cluster=make_cluster(32))
    with pytest.raises(HfplanError) as info:
        simulate_plan(plan)
    message = str(info.value)
    assert "does not fit" in message
    assert "set 1 (critic)" in message
    assert "set 0" not in message


def test_a_generating_set_without_room_for_the_kv_cache_is_named():
    plan = build_plan(_w("ppo"), [(ALL_PPO, 2)], cluster=make_cluster(8))
    with pytest.raises(HfplanError, match=r"set 0 \(actor, critic, reference, reward\).*KV cache"):
        simulate_plan(plan)


def test_a_plan_that_fits_reports_its_peak_under_the_usable_memory():
    sim = simulate_plan(PLANS["ppo-split"]())
    for m in sim.costs.memory:
        assert m.fits and m.peak <= m.usable
    assert not math.isinf(sim.timeline.iteration_s)


def test_role_parallelism_helper_shapes():
    par = role_parallelism("actor", 8, tp=4, gen_tp=2)
    assert (par.train.gpus, par.infer.gpus, par.gen.gpus) == (8, 8, 8)
    assert role_parallelism("reference", 8).train is None


def test_sets_sharing_a_node_transfer_over_nvlink():
    plan = PLANS["qwen-grpo-small"]()  # two sets of 2 GPUs: both on node 0
    tl = simulate_plan(plan).timeline
    generate, reference = _span(tl, "actor", "generate"), _span(tl, "reference", "log_prob")
    assert (generate.set, reference.set) == (0, 1)
    # 16 prompts x 4 samples = 64 sequences of 256 + 256 token ids (8 B) and 256 mask values (4 B),
    # over the intra-node link: 300 GB/s x 0.77, 2 us.
    hop = 64 * (256 * 8 + 256 * 8 + 256 * 4) / (300e9 * 0.77) + 2e-6
    assert reference.start == pytest.approx(generate.end + hop + _dispatch(plan), rel=1e-9)
