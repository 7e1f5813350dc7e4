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
