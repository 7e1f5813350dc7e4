"""Processes sharing a host's cores (Compute.host_parallelism): the slowdown rule, which parts of a call it slows,
the profiler's figure from its two timings, and the runtime fit taking it off what it measured across the world."""

import pytest

from hfplan.plan import GenConfig, InferConfig, Layout, TrainConfig
from hfplan.profiler import runtime
from hfplan.profiler.host_share import fit_parallelism
from hfplan.profiles.hardware import Runtime, load_hardware
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs
from hfplan.simulator.costs import NOT_COMPUTED, SetShape

TINY = CATALOG["tiny"]
FIXED = Runtime(forward_pass_us=300, engine_step_us=200, engine_sequence_step_us=10, train_pass_us=900,
                optimizer_tensor_us=20, switch_tensor_us=40, fsdp_forward_pass_us=2000, fsdp_train_pass_us=5000,
                fsdp_optimizer_tensor_us=90, fsdp_switch_tensor_us=150, forward_token_us=1.5, train_token_us=2.5)


def shared(hw, parallelism):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"host_parallelism": parallelism}),
                                 "runtime": FIXED})


def test_the_slowdown_is_the_ranks_over_the_hosts_parallelism_and_never_a_speedup(toy_hw):
    assert toy_hw.compute.host_slowdown(8) == 1.0  # GPUs: each computes on its own
    one_core = shared(toy_hw, 1.0).compute
    assert [one_core.host_slowdown(k) for k in (1, 2, 4)] == [1.0, 2.0, 4.0]
    cores = shared(toy_hw, 1.5).compute
    assert [cores.host_slowdown(k) for k in (1, 2, 3)] == [1.0, pytest.approx(2 / 1.5), 2.0]


@pytest.mark.parametrize("parallelism", [1.0, 1.6])
def test_a_set_of_ranks_on_a_shared_host_computes_slower_and_communicates_as_measured(toy_hw, parallelism):
    """A call's kernels and fixed costs are slowed by the host's sharing; its collectives, measured with the
    world's processes all running, and its dispatch are not. A set of one rank per node is not slowed."""
    alone, host = shared(toy_hw, None), shared(toy_hw, parallelism)
    slowdown = 2 / parallelism
    pair = SetShape(2, 2)
    calls = {
        "decode": lambda hw, where: costs.decode_step_parts(hw, TINY, Layout(tp=2), where, 4, 64),
        "prefill": lambda hw, where: costs.prefill_parts(hw, TINY, Layout(tp=2), where, 4, 32),
        "forward": lambda hw, where: costs.inference_parts(hw, TINY, InferConfig(dp=2), where, 8, 64, "lm", 2, True),
        "train": lambda hw, where: costs.train_step_parts(hw, TINY, TrainConfig(tp=2, micro_batch=2), where, 8, 64,
                                                          "lm"),
    }
    for name, call in calls.items():
        plain, slowed = call(alone, pair), call(host, pair)
        assert set(plain) == set(slowed), name
        assert any(part in NOT_COMPUTED and seconds > 0 for part, seconds in plain.items()), name
        for part, seconds in plain.items():
            expected = seconds if part in NOT_COMPUTED else slowdown * seconds
            assert slowed[part] == pytest.approx(expected, rel=1e-12), (name, part)
        across_nodes = SetShape(2, 1)  # one rank per node: each host runs one
        assert call(host, across_nodes) == call(alone, across_nodes), name
    # A switch: the engines' fixed cost per tensor slowed, the all-gather not.
    train, gen = TrainConfig(dp=2), GenConfig(tp=2)
    moved = costs.transition_time(alone, TINY, train, gen, pair) - costs._engine_weights_fixed(alone, TINY, gen, train)
    assert costs.transition_time(host, TINY, train, gen, pair) == pytest.approx(
        moved + slowdown * costs._engine_weights_fixed(alone, TINY, gen, train))


def test_a_pipelines_stages_take_turns_so_fewer_of_its_ranks_share_the_host(toy_hw):
    """Generation runs a step's stages one after another (1 / pp of the ranks compute at once); a pipelined
    update over m micro-batches keeps each stage busy m of m + pp - 1 slots."""
    alone, one_core = shared(toy_hw, None), shared(toy_hw, 1.0)
    pair, pipeline = SetShape(2, 2), Layout(pp=2)
    decode = costs.decode_step_parts(one_core, TINY, pipeline, pair, 4, 64)
    assert decode == costs.decode_step_parts(alone, TINY, pipeline, pair, 4, 64)  # one rank at a time: no sharing
    assert costs.pipeline_busy(2, 2, 1) == pytest.approx(2 / 3)
    assert costs.pipeline_busy(1, 2, 0) == 1.0
    train = TrainConfig(pp=2, micro_batch=2)  # 4 sequences: 2 micro-batches, 1 bubble slot
    plain, slowed = (costs.train_step_parts(hw, TINY, train, pair, 4, 64, "lm") for hw in (alone, one_core))
    for part, seconds in plain.items():
        expected = seconds if part in NOT_COMPUTED else 2 * (2 / 3) * seconds  # 4/3 ranks at once on one core
        assert slowed[part] == pytest.approx(expected, rel=1e-12), part


def test_four_ranks_of_one_host_compute_slower_than_two_and_communicate_as_measured(toy_hw):
    """One node of 4 ranks on one core: kernels 4x as slow as alone, collectives as the profile timed them (a rank
    waiting in one leaves its core to another: bench/oversubscribed.py)."""
    alone, one_core = shared(toy_hw, None), shared(toy_hw, 1.0)
    four, layout = SetShape(4, 4), Layout(tp=2, dp=2)
    plain, slowed = (costs.decode_step_parts(hw, TINY, layout, four, 4, 64) for hw in (alone, one_core))
    assert plain["tp_comm"] > 0 and slowed["tp_comm"] == plain["tp_comm"]
    assert slowed["gemm"] == pytest.approx(4 * plain["gemm"], rel=1e-12)


def test_the_oversubscription_bench_prints_the_simulator_s_own_rule():
    from tests.support.scripts import load_bench

    bench = load_bench("oversubscribed")
    rule = bench.simulator_ratios("cpu", 4, 2)
    compute = load_hardware("cpu").compute
    assert rule == {"burst": pytest.approx(compute.host_slowdown(4) / compute.host_slowdown(2)), "all_reduce": 1.0}


def test_the_parallelism_is_the_world_times_alone_over_together():
    rows = [dict(kind="sharing", op="probe_alone", world=2, seconds=0.010),
            dict(kind="sharing", op="probe_together", world=2, seconds=0.016),
            dict(kind="collective", op="all_reduce", world=2, seconds=1.0)]
    assert fit_parallelism(rows) == pytest.approx(1.25)
    assert fit_parallelism(rows[1:]) is None  # not measured (a GPU world, or a world of one)


def test_fixed_costs_timed_across_the_world_are_fitted_as_one_rank_alone_would_pay_them():
    """The fit inverts the model: seconds the cost model gives an FSDP2 engine over two ranks of a host of
    parallelism 1.25, with known fixed costs, fitted back (against that host's kernels) to those fixed costs."""
    world, mode = 2, runtime.FSDP
    host = load_hardware("cpu")
    host = host.model_copy(update={"compute": host.compute.model_copy(update={"host_parallelism": 1.25})})
    truth = host.model_copy(update={"runtime": FIXED})
    bare = host.model_copy(update={"runtime": Runtime()})
    where, tokens = SetShape(world, world), runtime.PROMPT + runtime.LONG
    train = TrainConfig(dp=world, micro_batch=1, shard="full")
    steps = {n: costs.train_step_time(truth, TINY, train, where, n * world, tokens, "lm")
             for n in (runtime.FEW, runtime.MANY)}
    log_prob = costs.inference_time(truth, TINY, InferConfig(dp=world, micro_batch=1), where, world, tokens, "lm",
                                    world, True)
    switch = costs.transition_time(truth, TINY, train, GenConfig(dp=world), where)
    measured = runtime.EngineSeconds(world, mode, steps, log_prob, switch)
    per_token = runtime._TokenFixed(FIXED.train_token_us, FIXED.forward_token_us, [])
    fitted = runtime._train_fixed(bare, measured, per_token)
    assert fitted.pass_us == pytest.approx(FIXED.fsdp_train_pass_us, rel=1e-6)
    assert fitted.tensor_us == pytest.approx(FIXED.fsdp_optimizer_tensor_us, rel=1e-6)
    assert fitted.forward_us == pytest.approx(FIXED.fsdp_forward_pass_us, rel=1e-6)
    switch_us, _ = runtime._switch_fixed(bare, measured, mode)
    assert switch_us == pytest.approx(FIXED.fsdp_switch_tensor_us, rel=1e-6)


# -- sets of one plan computing at once on a shared host (simulator/sharing.py) -----------------------------------

def _stretches(ranks, slowdown, work):
    """Run `work` [(set, start, seconds)] on SharedHosts; each stretch's end."""
    import simpy

    from hfplan.simulator.sharing import SharedHosts

    env = simpy.Environment()
    hosts = SharedHosts(env, ranks, slowdown)
    ends = {}

    def stretch(key, index, start, seconds):
        yield env.timeout(start)
        yield from hosts.compute(index, seconds)
        ends[key] = env.now

    for key, (index, start, seconds) in enumerate(work):
        env.process(stretch(key, index, start, seconds))
    env.run()
    return [ends[key] for key in range(len(work))]


def test_two_sets_on_one_core_share_it_while_both_compute():
    """One rank each on a host that computes one rank's worth at a time: A (2 s of work) alone until B (1 s)
    starts at 0.5 s, then both at half speed until B ends at 0.5 + 2 x 1 = 2.5 s; A has 2 - 0.5 - 1 = 0.5 s of
    work left, alone again: it ends at 3.0 s."""
    ranks = {0: {0: 1}, 1: {0: 1}}
    assert _stretches(ranks, lambda k: float(k), [(0, 0.0, 2.0), (1, 0.5, 1.0)]) == pytest.approx([3.0, 2.5])
    # On hosts of their own, or on a host that computes both at full speed, each takes its own seconds.
    apart = {0: {0: 1}, 1: {1: 1}}
    assert _stretches(apart, lambda k: float(k), [(0, 0.0, 2.0), (1, 0.5, 1.0)]) == pytest.approx([2.0, 1.5])
    assert _stretches(ranks, lambda k: 1.0, [(0, 0.0, 2.0), (1, 0.5, 1.0)]) == pytest.approx([2.0, 1.5])


def test_a_set_already_priced_for_its_own_ranks_slows_only_by_the_others():
    """Set 0 has 2 ranks on the host (its seconds already priced at slowdown(2) = 2 on a 1-core host), set 1 one
    rank: together 3 ranks, so set 0 runs at 2/3 of its pace and set 1 at 1/3 while both compute."""
    ranks = {0: {0: 2}, 1: {0: 1}}
    # Both start at 0: set 1's 1 s takes 3 s (set 0 has done 2 of its 4 s); set 0's last 2 s alone: ends at 5.
    assert _stretches(ranks, lambda k: float(k), [(0, 0.0, 4.0), (1, 0.0, 1.0)]) == pytest.approx([5.0, 3.0])


def _split_plan(hardware):
    from hfplan.planner.search import search
    from hfplan.planner.strategies import Rules
    from hfplan.spec import load_workload, make_cluster

    workload = load_workload("demo")
    rest = tuple(role for role in workload.model_roles if role != "actor")
    rules = Rules(name="split", placements=((("actor",), rest),))
    return search(workload, make_cluster(2, hardware), rules=rules).best


def test_sets_of_a_split_plan_on_one_shared_host_are_simulated_slower_than_alone(tmp_path):
    """The demo's actor on one process and the other roles on another, on a 2-process CPU host: with
    host_parallelism 1 their overlapping calls share the core, so the iteration is longer than the schedule with
    each set alone (engine.critical_path, the search's bound), and the critical path still adds up to it. The
    search evaluates its leaves on that engine, so its estimate is the simulation's."""
    from hfplan.simulator.engine import critical_path, simulate_plan
    from hfplan.simulator.trace import trace
    from hfplan.spec import Cluster

    cpu = load_hardware("cpu")
    paths = {}
    for name, parallelism in (("one-core", 1.0), ("own-cores", None)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(cpu.model_copy(update={"name": name, "compute": cpu.compute.model_copy(
            update={"host_parallelism": parallelism, "idle_wake": None})}).to_yaml())  # sharing alone
    plan = _split_plan(str(paths["one-core"]))
    assert [group.models for group in plan.placement][0] == ["actor"] and len(plan.placement) == 2
    sim = simulate_plan(plan)
    bound = critical_path(trace(plan.workload), sim.costs)
    assert sim.timeline.iteration_s > bound * 1.01
    assert sum(sim.timeline.stages().values()) == pytest.approx(sim.timeline.iteration_s)
    assert plan.estimate.iteration_s == pytest.approx(sim.timeline.iteration_s)
    # The same plan on the profile without sharing: the engine is the bound.
    alone = plan.model_copy(update={"cluster": Cluster(gpus=2, gpus_per_node=2, hardware=str(paths["own-cores"]))})
    alone_sim = simulate_plan(alone)
    assert alone_sim.timeline.iteration_s == pytest.approx(critical_path(trace(plan.workload), alone_sim.costs))


def test_the_search_finds_the_brute_force_best_when_sets_share_a_host(tmp_path):
    """arith-grpo's actor and reference on a process each of a one-core host: every strategy choice run on the
    engine (with the sets sharing the core) against the search, which prunes with each set alone."""
    from hfplan.planner.search import search
    from hfplan.planner.strategies import Rules
    from hfplan.simulator.costs import CostMemo
    from hfplan.spec import load_workload, make_cluster
    from tests.support.search_references import brute_force

    cpu = load_hardware("cpu")
    path = tmp_path / "one-core.yaml"
    path.write_text(cpu.model_copy(update={"name": "one-core", "compute": cpu.compute.model_copy(
        update={"host_parallelism": 1.0})}).to_yaml())
    workload, cluster = load_workload("arith-grpo"), make_cluster(2, str(path))
    placement = (("actor",), ("reference",))
    reference = brute_force(workload, cluster, placement, (1, 1), CostMemo())
    best = search(workload, cluster, rules=Rules(name="split", placements=(placement,))).best
    assert reference.feasible > 100
    assert best.estimate.iteration_s == pytest.approx(reference.best_s, rel=1e-12)
