"""Training shard modes (plan.TrainConfig.shard): what each keeps per GPU and moves per step, by hand; the
migration of the old boolean; the executor's mesh and what it refuses; the hybrid engine's gather groups."""

from __future__ import annotations

import json

import pytest

from hfplan.errors import HfplanError
from hfplan.layout import generation_groups, resharding, unsupported_layout
from hfplan.plan import GenConfig, TrainConfig, plan_from_dict
from hfplan.planner import space
from hfplan.simulator import sharding
from hfplan.simulator.costs import SetShape
from hfplan.simulator.memory import train_resident_bytes, train_transient_bytes
from tests.support.plans import sample_plan

# small_arch (conftest): 2 layers of 36992, embedding 16640, final norm 64, LM head 16640.
P = 2 * 36992 + 16640 + 64 + 16640
ALPHA, BW = 1e-6, 5e10  # toy_hw's intra-node link


def _config(shard: str, dp: int = 8, group: int | None = None, **kw) -> TrainConfig:
    return TrainConfig(dp=dp, shard=shard, shard_group=group, **kw)


@pytest.mark.parametrize(("config", "bf16", "fp32"), [
    # bf16: weights 2, fp32 gradients 4, optimizer 12 (fp32 master 4 + two Adam moments 8); fp32: 4 + 4 + 8.
    (_config("replicated"), 2 + 4 + 12, 4 + 4 + 8),
    (_config("zero1"), 2 + 4 + 12 / 8, 4 + 4 + 8 / 8),  # optimizer states split 8 ways
    (_config("zero2"), 2 + (4 + 12) / 8, 4 + (4 + 8) / 8),  # and gradients
    (_config("full"), 18 / 8, 16 / 8),  # everything
    (_config("hybrid", group=4), 18 / 4, 16 / 4),  # everything, within groups of 4
    (_config("full", dp=1), 18, 16),  # one rank: nothing to split
])
def test_resident_bytes_per_parameter_by_hand(small_arch, config, bf16, fp32):
    assert sharding.resident_bytes_per_param(config, 2) == pytest.approx(bf16)
    assert sharding.resident_bytes_per_param(config, 4) == pytest.approx(fp32)
    assert train_resident_bytes(small_arch, config, "lm", 2) == pytest.approx(bf16 * P)


def test_only_modes_that_split_weights_gather_layers(small_arch):
    """Full and hybrid sharding gather one layer at a time (and prefetch the next); the others hold all weights."""
    base = train_transient_bytes(small_arch, _config("replicated", dp=2), 4, 16, "lm")
    for shard, group, extra in (("zero1", None, 0), ("zero2", None, 0), ("full", None, 2 * 2 * 36992)):
        got = train_transient_bytes(small_arch, _config(shard, dp=2, group=group), 4, 16, "lm")
        assert got - base == pytest.approx(extra), shard
    hybrid = train_transient_bytes(small_arch, _config("hybrid", dp=4, group=2), 4, 16, "lm")
    assert hybrid - train_transient_bytes(small_arch, _config("replicated", dp=4), 4, 16, "lm") == \
        pytest.approx(2 * 2 * 36992)


def _ring(ranks: int, nbytes: float, passes: int = 1) -> float:
    """toy_hw's intra-node ring: passes x (ranks - 1) latencies, passes x (ranks - 1) / ranks of the bytes."""
    return passes * (ranks - 1) * ALPHA + passes * (ranks - 1) / ranks * nbytes / BW


UNITS = 3  # full and hybrid sharding's FSDP units of small_arch: its 2 decoder layers and the root


def _by_unit(ranks: int, nbytes: float, passes: int = 1) -> float:
    """A full or hybrid sharding collective: one ring per FSDP unit, the bytes in even shares."""
    return UNITS * _ring(ranks, nbytes / UNITS, passes)


@pytest.mark.parametrize(("shard", "group", "n_micro", "expected"), [
    # nothing hidden (forward = backward = 0): 4 ranks on one node, gradients 4P, weights 2P bytes
    ("replicated", None, 3, _ring(4, 4 * P, passes=2)),  # one all-reduce per step
    ("zero1", None, 3, _ring(4, 4 * P) + _ring(4, 2 * P)),  # one reduce-scatter, one all-gather of the weights
    ("zero2", None, 3, 3 * _ring(4, 4 * P) + _ring(4, 2 * P)),  # a reduce-scatter per micro-batch
    ("full", None, 2, 2 * (2 * _by_unit(4, 2 * P) + _by_unit(4, 4 * P))),  # gathers before forward and backward
    # groups of 2 adjacent ranks, then an all-reduce of the gradient half across the 2 groups
    ("hybrid", 2, 2, 2 * (2 * _by_unit(2, 2 * P) + _by_unit(2, 4 * P)) + _by_unit(2, 4 * P / 2, passes=2)),
])
def test_step_communication_by_hand(toy_hw, small_arch, shard, group, n_micro, expected):
    config = _config(shard, dp=4, group=group)
    got = sharding.exposed_step_comm(toy_hw, small_arch, config, SetShape(4, 8), "lm", 0.0, 0.0, n_micro)
    assert got == pytest.approx(expected, rel=1e-12)


def test_bf16_gradient_reduction_moves_half_the_bytes(toy_hw, small_arch):
    # Compute.gradient_reduce_bytes 2 (FSDP1 reducing in its bf16 param_dtype): the reduce-scatter moves 2P, not 4P.
    hw = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"gradient_reduce_bytes": 2})})
    got = sharding.exposed_step_comm(hw, small_arch, _config("full", dp=4), SetShape(4, 8), "lm", 0.0, 0.0, 2)
    assert got == pytest.approx(2 * 3 * _by_unit(4, 2 * P), rel=1e-12)
    got = sharding.exposed_step_comm(hw, small_arch, _config("replicated", dp=4), SetShape(4, 8), "lm", 0.0, 0.0, 1)
    assert got == pytest.approx(_ring(4, 2 * P, passes=2), rel=1e-12)


def test_backward_hides_the_gradient_reduction_but_not_the_weight_gather(toy_hw, small_arch):
    where, long = SetShape(4, 8), 10.0
    assert sharding.exposed_step_comm(toy_hw, small_arch, _config("replicated", dp=4), where, "lm", 0, long, 3) == 0
    zero1 = sharding.exposed_step_comm(toy_hw, small_arch, _config("zero1", dp=4), where, "lm", 0, long, 3)
    assert zero1 == pytest.approx(_ring(4, 2 * P))


def _slowed(hw, slowdown: float):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"overlap_slowdown": slowdown})})


def test_compute_beside_a_collective_runs_slower(toy_hw):
    """Compute 1.25 times slower while the collective runs: a short one adds comm * 0.25 / 1.25, one outlasting the
    slowed compute all it outlasts the compute by; the two meet at comm = 1.25 x compute."""
    hw = _slowed(toy_hw, 0.25)
    assert sharding.exposed_beside(hw, 1.0, 10.0) == pytest.approx(0.2)
    assert sharding.exposed_beside(hw, 20.0, 10.0) == pytest.approx(10.0)
    assert sharding.exposed_beside(hw, 12.5, 10.0) == pytest.approx(2.5)
    assert sharding.exposed_beside(toy_hw, 1.0, 10.0) == 0.0  # no slowdown: hidden
    # More compute never shortens compute + what the collective adds.
    totals = [c + sharding.exposed_beside(hw, 12.0, c) for c in (0.0, 5.0, 9.0, 9.6, 10.0, 20.0)]
    assert totals == sorted(totals)


def _in_line(hw):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"overlaps_collectives": False})})


def test_collectives_run_in_line_where_the_device_cannot_overlap_them(toy_hw, small_arch):
    """CPU processes (no streams: FSDP2 waits on each collective): however long the compute beside it, a collective
    costs all its time, and a step's communication is every collective whole."""
    hw = _in_line(toy_hw)
    assert sharding.exposed_beside(hw, 1.0, 10.0) == 1.0
    assert sharding.exposed_beside(hw, 20.0, 10.0) == 20.0
    gather, scatter = _by_unit(4, 2 * P), _by_unit(4, 4 * P)
    got = sharding.exposed_step_comm(hw, small_arch, _config("full", dp=4), SetShape(4, 8), "lm", 10.0, 10.0, 3)
    assert got == pytest.approx(3 * (2 * gather + scatter), rel=1e-12)
    got = sharding.exposed_step_comm(hw, small_arch, _config("replicated", dp=4), SetShape(4, 8), "lm", 0, 10.0, 3)
    assert got == pytest.approx(_ring(4, 4 * P, passes=2), rel=1e-12)


def test_full_sharding_leaves_the_first_and_last_layers_collectives_exposed(toy_hw, small_arch):
    """Layer by layer, each gather beside the layer before it: however long the passes, the forward's and the
    backward's first gather and the backward's last reduce-scatter (one layer's share each) stay exposed."""
    gather, scatter = _by_unit(4, 2 * P), _by_unit(4, 4 * P)
    layer = 36992 / P
    got = sharding.exposed_step_comm(toy_hw, small_arch, _config("full", dp=4), SetShape(4, 8), "lm", 10.0, 10.0, 3)
    assert got == pytest.approx(3 * layer * (2 * gather + scatter), rel=1e-12)
    slowed = sharding.exposed_step_comm(_slowed(toy_hw, 0.25), small_arch, _config("full", dp=4), SetShape(4, 8),
                                        "lm", 10.0, 10.0, 3)
    beside = (1 - layer) * (2 * gather + scatter)  # the rest, beside compute 1.25 times slower
    assert slowed == pytest.approx(got + 3 * beside * 0.25 / 1.25, rel=1e-12)


def test_optimizer_step_runs_on_the_shard_of_the_optimizer_states():
    assert [sharding.optimizer_fraction(_config(s, group=g)) for s, g in
            (("replicated", None), ("zero1", None), ("zero2", None), ("full", None), ("hybrid", 2))] == \
        [1, 1 / 8, 1 / 8, 1 / 8, 1 / 2]


# -- the plan field -------------------------------------------------------------------------------------
def test_boolean_shard_migrates_on_read():
    assert TrainConfig.model_validate({"dp": 4, "shard": True}).shard == "full"
    assert TrainConfig.model_validate({"dp": 4, "shard": False}).shard == "replicated"
    data = json.loads(sample_plan().to_json())
    for par in data["parallelism"].values():
        if par["train"] is not None:
            par["train"]["shard"] = True
            del par["train"]["shard_group"]
    plan = plan_from_dict(data, "old")
    assert {p.train.shard for p in plan.parallelism.values() if p.train is not None} == {"full"}
    assert '"shard": "full"' in plan.to_json()  # written back in the new form


@pytest.mark.parametrize(("fields", "needle"), [
    ({"dp": 8, "shard": "hybrid"}, "needs shard_group"),
    ({"dp": 8, "shard": "hybrid", "shard_group": 3}, "must divide dp=8"),
    ({"dp": 8, "shard": "hybrid", "shard_group": 8}, "strictly between 1 and dp"),
    ({"dp": 8, "shard": "full", "shard_group": 4}, "for shard 'hybrid' only"),
    ({"dp": 8, "shard": "zero3"}, "'replicated', 'zero1', 'zero2', 'full' or 'hybrid'"),
])
def test_bad_shard_modes_are_refused(fields, needle):
    data = json.loads(sample_plan().to_json())
    role = next(r for r, p in data["parallelism"].items() if p["train"] is not None)
    data["parallelism"][role]["train"].update(fields)
    with pytest.raises(HfplanError, match="plan test") as caught:
        plan_from_dict(data, "test")
    assert needle in str(caught.value)


# -- executor and hybrid engine ---------------------------------------------------------------------------
def test_executor_mesh_is_replicas_by_shard_group():
    pytest.importorskip("torch")
    from hfplan.executor.mesh import ParallelDims

    def replicas_by_shard(config):
        dims = ParallelDims.of(config)
        return dims.replicate, dims.shard

    assert replicas_by_shard(_config("replicated")) == (8, 1)
    assert replicas_by_shard(_config("full")) == (1, 8)
    assert replicas_by_shard(_config("hybrid", group=2)) == (4, 2)


def test_executor_refuses_zero1_and_zero2_and_search_leaves_them_out(small_arch):
    for shard in ("zero1", "zero2"):
        assert "FSDP2" in unsupported_layout(small_arch, "train", _config(shard))
    assert unsupported_layout(small_arch, "train", _config("hybrid", group=4)) is None
    modes = {c.shard for c in space.train_configs(small_arch, 16, 8, 32)}
    assert modes == {"replicated", "full", "hybrid"}
    assert {c.shard for c in space.train_configs(small_arch, 16, 8, 32, executable=False)} == \
        {"replicated", "zero1", "zero2", "full", "hybrid"}


def test_hybrid_engine_gathers_within_the_shard_group():
    train, gen = _config("hybrid", dp=8, group=4), GenConfig(dp=8)
    plan = resharding(train, gen)
    assert plan.own_fraction == pytest.approx(1 / 4) and plan.group == 4
    assert generation_groups(train, gen) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for shard in ("zero1", "zero2"):  # whole weights on every rank: nothing to gather
        assert resharding(_config(shard), gen).received_fraction == 0


def test_each_fsdp_unit_pays_its_own_latency(toy_hw, small_arch):
    """The same bytes gathered unit by unit cost the ring's latency once per unit (the 2 layers and the root)
    where one collective of the whole stage would pay it once."""
    whole = _ring(4, 2 * P)
    got = sharding.weight_gather_seconds(toy_hw, small_arch, _config("full", dp=4), SetShape(4, 8), "lm", 4)
    assert got == pytest.approx(whole + (UNITS - 1) * 3 * ALPHA, rel=1e-12)
    assert sharding.fsdp_units(small_arch, 1) == UNITS and sharding.fsdp_units(small_arch, 2) == 2
