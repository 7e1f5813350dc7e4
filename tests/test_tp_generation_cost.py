"""Generation split by tensor parallelism: the cost of each collective of a generation step (Runtime.step_collective_us
in place of the link's latency; tp_step_collective_us on top of it, as older profiles say) in the cost model, its
fit from the profiler's split decode steps, and the profiler timing the split engine as the executor runs it (over
the role's tensor-parallel group, weight shards as they are)."""

import pytest
import torch
import torch.distributed as dist

from hfplan.plan import Layout
from hfplan.profiler import runtime
from hfplan.profiles.hardware import Runtime, load_hardware
from hfplan.profiles.models import CATALOG
from hfplan.simulator import collectives as coll
from hfplan.simulator import costs
from hfplan.simulator.costs import SetShape
from tests.support.worlds import run_world

TINY = CATALOG["tiny"]
FIXED = Runtime(engine_step_us=200, engine_sequence_step_us=10, switch_tensor_us=40)


def _with(hw, **fields):
    return hw.model_copy(update={"runtime": FIXED.model_copy(update=fields)})


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_a_split_generation_step_pays_the_fixed_cost_of_each_collective(step):
    hw = load_hardware("cpu")
    without, with_cost = _with(hw), _with(hw, tp_step_collective_us=50.0)
    where = SetShape(2, 2)

    def parts(profile, tp):
        layout = Layout(tp=tp)
        if step == "decode":
            return costs.decode_step_parts(profile, TINY, layout, where, 4, 20)
        return costs.prefill_parts(profile, TINY, layout, where, 4, 8)

    # Split by tp: every collective the step is charged pays the fixed cost once, as communication (measured with
    # every rank generating at once, so the host's sharing does not slow it again).
    added = parts(with_cost, 2)["tp_comm"] - parts(without, 2)["tp_comm"]
    assert added == pytest.approx(costs.step_tp_collectives(TINY) * 50e-6)
    assert parts(with_cost, 2).total - parts(without, 2).total == pytest.approx(added)
    # Unsplit: no collective, nothing added.
    assert parts(with_cost, 1).total == parts(without, 1).total


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_a_measured_step_collective_replaces_the_link_s_latency(step):
    """Runtime.step_collective_us: each collective of a split generation step costs that figure and the link's term
    for its bytes, whatever the link's latency (a step's collectives measured whole can be cheaper than the link's
    sweep says, where the ranks meet between small kernels); tp_step_collective_us is not added on top."""
    hw = load_hardware("cpu")
    where = SetShape(2, 2)

    def tp_comm(profile) -> float:
        if step == "decode":
            return costs.decode_step_parts(profile, TINY, Layout(tp=2), where, 4, 20)["tp_comm"]
        return costs.prefill_parts(profile, TINY, Layout(tp=2), where, 4, 8)["tp_comm"]

    slow_link = hw.model_copy(update={"links": hw.links.model_copy(update={"intra_node": hw.links.intra_node.model_copy(
        update={"latency_us": 10 * hw.links.intra_node.latency_us, "collectives": ()})})})
    fast_link = hw.model_copy(update={"links": hw.links.model_copy(update={"intra_node": hw.links.intra_node.model_copy(
        update={"collectives": ()})})})
    measured = {name: _with(profile, step_collective_us=300.0) for name, profile in (("slow", slow_link),
                                                                                        ("fast", fast_link))}
    assert tp_comm(_with(slow_link)) > tp_comm(_with(fast_link))  # the link's latency counts without the figure
    assert tp_comm(measured["slow"]) == pytest.approx(tp_comm(measured["fast"]), rel=1e-3)
    assert tp_comm(measured["fast"]) == pytest.approx(costs.step_tp_collectives(TINY) * 300e-6, rel=0.05)
    assert tp_comm(_with(fast_link, step_collective_us=300.0, tp_step_collective_us=50.0)) == pytest.approx(
        tp_comm(measured["fast"]))
    # Measured on two ranks of a node: a larger group pays the link's latency beyond that pair's on top.
    group, pair = costs.tp_group(4, SetShape(4, 4)), costs.STEP_COLLECTIVE_GROUP
    profile = measured["slow"]
    extra = coll.all_reduce(profile, group, 1.0) - coll.all_reduce(profile, pair, 1.0)
    assert extra > 0
    assert costs.step_all_reduce(profile, group, 64.0) == pytest.approx(
        300e-6 + extra + coll.all_reduce(profile, group, 64.0) - coll.all_reduce(profile, group, 1.0))


def test_the_fit_recovers_the_collective_cost_from_the_split_decode_steps():
    """The fit inverts the model: decode steps the cost model gives a tp-2 engine with a known collective cost (on a
    host of parallelism 1.4), fitted back against the same profile without it, give that cost."""
    host = load_hardware("cpu")
    host = host.model_copy(update={"compute": host.compute.model_copy(update={"host_parallelism": 1.4})})
    truth, fitted = _with(host, step_collective_us=800.0), _with(host)
    world, context = 2, runtime.PROMPT + (runtime.SHORT + runtime.LONG) / 2
    steps = tuple(costs.decode_step_time(truth, TINY, Layout(tp=world), SetShape(world, world), batch, context)
                  for batch in (1, runtime.BATCH))
    measured = runtime.EngineSeconds(world, runtime.TP, {runtime.FEW: 1.0, runtime.MANY: 2.0}, 0.1, 0.01,
                                     split_steps=steps)
    collective_us, rows = runtime._step_collective_fixed(fitted, measured)
    assert collective_us == pytest.approx(800.0, rel=1e-6)
    assert [r["op"] for r in rows] == list(runtime.SPLIT_STEP_OPS)
    # The raw rows carry the split steps to the parent process and back.
    assert runtime.EngineSeconds.from_rows(measured.rows())[runtime.TP].split_steps == steps


def _split_engine(rank: int, world: int) -> dict:
    from hfplan.executor.engines.hybrid import HybridEngine
    from hfplan.executor.rollout.base import SamplingParams

    torch.set_num_threads(1)
    role = runtime.profiled_role(torch, "cpu", runtime.TP)
    hybrid, engine = HybridEngine(role, keep_trained=False), runtime._rollout_engine(role)
    engine.load_weights(hybrid.enter_generation(), presharded=hybrid.presharded)
    prompts = torch.randint(1, TINY.vocab, (2, runtime.PROMPT), generator=torch.Generator().manual_seed(1))
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))
    # The collectives of a step, as the engine makes them: a prefill alone (one token), then one decode step more.
    collectives = []
    for name in ("all_reduce", "all_gather"):
        made = getattr(dist, name)
        setattr(dist, name, lambda *args, made=made, **kwargs: (collectives.append(1), made(*args, **kwargs))[1])
    counted = []
    for tokens in (1, 2):
        collectives.clear()
        engine.generate(prompts, SamplingParams(max_new_tokens=tokens), torch.Generator().manual_seed(0))
        counted.append(len(collectives))
    return {"embedding_rows": engine._w.embed.shape[0], "responses": rollout.responses,
            "prefill_collectives": counted[0], "decode_collectives": counted[1] - counted[0]}


def test_the_profiled_switch_hands_the_split_engine_its_shards_as_the_executor_does():
    """Split by tp, the profiler's rollout engine generates over the role's tensor-parallel group from the shards as
    they are (each rank holds half the vocabulary's embedding rows; before, an engine without the group gathered
    every tensor whole at each switch), and the ranks sample the same tokens. Its steps make the collectives the
    cost model counts (costs.step_tp_collectives)."""
    ranks = run_world(_split_engine, 2, timeout=180)
    assert [r["embedding_rows"] for r in ranks] == [TINY.vocab // 2] * 2
    assert torch.equal(ranks[0]["responses"], ranks[1]["responses"])
    # A prefill and a decode step each make as many collectives as the cost model charges a step.
    for rank in ranks:
        assert rank["prefill_collectives"] == rank["decode_collectives"] == costs.step_tp_collectives(TINY)
