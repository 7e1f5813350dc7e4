"""Asynchronous RLHF (Workload.staleness): the workload and plan checks, the off-policy correction of the
actor's loss, and the simulator's steady-state pipelined window on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from hfplan.dataflow.ops import BEHAVIOUR, GENERATE_WRITES
from hfplan.errors import HfplanError
from hfplan.executor.engines import losses
from hfplan.hyperparams import Hyperparameters
from hfplan.plan import WEIGHT_SYNC_OP, plan_from_dict
from hfplan.simulator.engine import Scheduled, run_calls, run_window, simulate_plan
from hfplan.simulator.pipeline import Pipelined
from hfplan.simulator.trace import Dag, Edge, Node, trace
from hfplan.spec import load_workload, workload_from_dict

ACTOR_SET, ROLLOUT_SET = 0, 1
TRANSFER = 0.5  # seconds of any edge between two sets in the hand-computed cases


def _edge_seconds(src: int, dst: int, nbytes: float) -> float:
    return 0.0 if src == dst else TRANSFER


def _calls(generate: float, log_prob: float, update: float, sync: float) -> list[Scheduled]:
    """generate on the rollout set (after the weight sync), then the actor's log_prob and update on its own set."""
    gen = Node(0, "actor", "generate", "generation", 8, (), GENERATE_WRITES)
    lp = Node(1, "actor", "log_prob", "preparation", 8, (Edge(0, 1.0, ("responses",)),), ("old_log_probs",))
    up = Node(2, "actor", "update", "training", 8, (Edge(0, 1.0, ("responses",)), Edge(1, 1.0, ("old_log_probs",))),
              ("actor_metrics",))
    return [Scheduled(gen, ROLLOUT_SET, generate, sync, "rollout"), Scheduled(lp, ACTOR_SET, log_prob, 0.0, None),
            Scheduled(up, ACTOR_SET, update, 0.0, None)]


@pytest.mark.parametrize(("generate", "expected"), [
    # generation longer: max(10, 0.5 + 3 + 4) + 2 = 12
    (10.0, 12.0),
    # training longer: max(5, 0.5 + 3 + 4) + 2 = 9.5
    (5.0, 9.5),
])
def test_window_is_the_longer_side_plus_the_sync(generate, expected):
    calls = _calls(generate, log_prob=3.0, update=4.0, sync=2.0)
    window = run_window(calls, _edge_seconds, tokens=100)
    assert window.iteration_s == pytest.approx(expected)
    # the synchronous iteration is the sum: 2 + generate + 0.5 + 3 + 4
    assert run_calls(calls, _edge_seconds, 100).iteration_s == pytest.approx(2 + generate + 7.5)
    syncs = [s for s in window.spans if s.op == WEIGHT_SYNC_OP]
    assert len(syncs) == 1
    assert (syncs[0].start, syncs[0].end) == (pytest.approx(expected - 2.0), pytest.approx(expected))
    gen = next(s for s in window.spans if s.op == "generate")
    update = next(s for s in window.spans if s.op == "update")
    assert gen.start == 0.0 and gen.start < update.end and update.start < gen.end  # they overlap
    assert sum(window.stages().values()) == pytest.approx(expected)
    dag = Dag("hand", tuple(c.node for c in calls))
    fast = Pipelined.of(dag, [c.set for c in calls], _edge_seconds)
    assert fast.window([c.seconds for c in calls], 2.0) == pytest.approx(expected)


def test_the_window_keeps_each_generations_fetch_by_the_controller():
    """Two generations (ReMax's sampled and greedy) each fetched by a rule on the controller: the window merges
    them into one earlier call, but each rule still waits for its own generation's outputs, in the planner's
    longest path as in the engine's window (schedule.controller_fetches applies to the traced program)."""
    controller = -1
    sampled = Node(0, "actor", "generate", "generation", 8, (), GENERATE_WRITES)
    greedy = Node(1, "actor", "generate", "generation", 8, (), GENERATE_WRITES, greedy=True)
    score_greedy = Node(2, "reward", "score", "preparation", 8, (Edge(1, 1.0, ("responses",)),), ("rewards",))
    score = Node(3, "reward", "score", "preparation", 8, (Edge(0, 1.0, ("responses",)),), ("rewards",))
    calls = [Scheduled(sampled, ROLLOUT_SET, 1.0, 0.0, "rollout"), Scheduled(greedy, ROLLOUT_SET, 1.0, 0.0, None),
             Scheduled(score_greedy, controller, 0.0, 0.0, None), Scheduled(score, controller, 0.0, 0.0, None)]
    dag = Dag("hand", tuple(c.node for c in calls))
    fast = Pipelined.of(dag, [c.set for c in calls], _edge_seconds)
    # window ids: the earlier generations 0, then the traced calls shifted by one: both scores read call 0.
    assert fast.precedence.deps[3] == ((0, TRANSFER),) and fast.precedence.deps[4] == ((0, TRANSFER),)
    durations = [c.seconds for c in calls]
    assert fast.window(durations, 0.0) == pytest.approx(run_window(calls, _edge_seconds, tokens=100).iteration_s)


def _split_plan(staleness: int, rollout: bool = True) -> dict:
    workload = {"algorithm": "grpo", "models": {"actor": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"},
                "prompt_len": 16, "response_len": 16, "batch_prompts": 4, "samples_per_prompt": 2,
                "mini_batches": 1, "staleness": staleness}
    one = {"tp": 1, "pp": 1, "dp": 1}
    placement = [{"models": ["actor", "reference"], "gpus": 1}]
    parallelism = {"actor": {"train": one, "infer": one}, "reference": {"infer": one}}
    if rollout:
        placement.append({"models": ["rollout"], "gpus": 1})
        parallelism["rollout"] = {"gen": one}
    else:
        parallelism["actor"]["gen"] = one
    return {"version": 2, "workload": workload, "cluster": {"gpus": 2, "gpus_per_node": 2, "hardware": "a100-80g"},
            "placement": placement, "parallelism": parallelism}


def test_staleness_needs_a_separate_rollout_set():
    with pytest.raises(HfplanError, match="staleness 1 needs a separate 'rollout' set"):
        plan_from_dict(_split_plan(1, rollout=False), "p.json")
    assert plan_from_dict(_split_plan(1), "p.json").workload.staleness == 1
    shared = _split_plan(1)
    shared["placement"] = [{"models": ["reference"], "gpus": 1}, {"models": ["actor", "rollout"], "gpus": 1}]
    with pytest.raises(HfplanError, match="needs generation on GPUs that no training uses; the 'rollout' set also "
                                          "holds actor"):
        plan_from_dict(shared, "p.json")
    with pytest.raises(HfplanError, match="staleness"):
        workload_from_dict({**_split_plan(0)["workload"], "staleness": -1}, "w")


def test_simulated_split_plan_overlaps_generation_and_training():
    """A whole plan: the asynchronous iteration is max(generation, the rest) + the sync; the synchronous one
    their sum (the same calls)."""
    sync_plan = plan_from_dict(_split_plan(0), "p.json")
    async_plan = plan_from_dict(_split_plan(1), "p.json")
    spans = simulate_plan(sync_plan).estimate.timeline
    gen = sum(s.end - s.start for s in spans if s.op == "generate")
    sync = sum(s.end - s.start for s in spans if s.op == WEIGHT_SYNC_OP)
    estimate = simulate_plan(async_plan).estimate
    rest_end = max(s.end for s in estimate.timeline if s.phase != "generation")
    assert gen > 0 and sync > 0 and rest_end > 0
    assert estimate.iteration_s == pytest.approx(max(gen, rest_end) + sync)
    assert estimate.iteration_s < simulate_plan(sync_plan).estimate.iteration_s


def test_trace_reads_behaviour_log_probs_only_off_policy():
    for name in ("ppo-qwen2.5-0.5b", "grpo-qwen2.5-0.5b", "remax-qwen2.5-0.5b", "safe-rlhf-qwen2.5-0.5b"):
        workload = load_workload(name)
        on = [n for n in trace(workload).nodes if n.label == "actor.update"][0]
        off = [n for n in trace(workload.model_copy(update={"staleness": 1})).nodes if n.label == "actor.update"][0]
        assert BEHAVIOUR not in on.reads and BEHAVIOUR in off.reads, name


def _loss(behaviour: torch.Tensor | None, cap: float = 2.0):
    torch.manual_seed(0)
    log_probs = (-torch.rand(3, 5)).requires_grad_()
    old = log_probs.detach() - 0.1 * torch.rand(3, 5)
    batch = {"response_mask": torch.ones(3, 5), "old_log_probs": old, "advantages": torch.randn(3, 5)}
    if behaviour is not None:
        batch[BEHAVIOUR] = behaviour(old)
    loss, stats = losses.actor_objective(log_probs, torch.zeros(3, 5), batch, 15.0,
                                         Hyperparameters(off_policy_cap=cap), use_kl_loss=False)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, stats, grad


def test_behaviour_equal_to_old_changes_nothing():
    loss, stats, grad = _loss(None)
    same, same_stats, same_grad = _loss(lambda old: old.clone())
    assert torch.equal(loss, same) and torch.equal(grad, same_grad)
    assert same_stats["behaviour_weight"].item() == pytest.approx(1.0)
    assert "behaviour_weight" not in stats


def test_importance_weights_scale_each_token_and_are_truncated():
    _, _, grad = _loss(None)
    # behaviour half as likely as old: weight 2 (at the cap of 2), so every token's gradient doubles
    _, stats, doubled = _loss(lambda old: old - math.log(2.0))
    assert torch.allclose(doubled, 2 * grad) and stats["behaviour_weight"].item() == pytest.approx(2.0)
    # a 10x less likely behaviour is truncated at the cap too
    _, _, capped = _loss(lambda old: old - math.log(10.0))
    assert torch.allclose(capped, 2 * grad)
    # behaviour twice as likely: weight 1/2
    _, _, halved = _loss(lambda old: old + math.log(2.0))
    assert torch.allclose(halved, 0.5 * grad)


def test_search_reports_the_synchronous_and_the_asynchronous_best():
    from hfplan.planner.search import search
    from hfplan.planner.targets import get_target, search_target
    from hfplan.spec import make_cluster

    workload = load_workload("grpo-qwen2.5-0.5b").model_copy(update={"staleness": 2})
    cluster = make_cluster(8)
    result = search(workload, cluster, top_k=3)
    sync, pipelined = result.synchronous, result.asynchronous
    assert sync.workload.staleness == 0 and pipelined.workload.staleness == 1
    rollout_set = next(g.models for g in pipelined.placement if "rollout" in g.models)
    assert "actor" not in rollout_set
    assert all("actor" not in next(g.models for g in p.placement if "rollout" in g.models)
               for p in result.top if p.workload.staleness)
    assert result.best.estimate.iteration_s == min(sync.estimate.iteration_s, pipelined.estimate.iteration_s)
    # the search's own bound agreed with the engine on every plan it ran (search._leaf); the plan's estimate
    # is the pipelined window's, which no synchronous schedule of the same plan beats
    as_sync = simulate_plan(pipelined.model_copy(update={"workload": sync.workload}))
    assert pipelined.estimate.iteration_s < as_sync.estimate.iteration_s
    assert sync.estimate.iteration_s == search(sync.workload, cluster, top_k=1).best.estimate.iteration_s
    # a target's plans are exported to run synchronously
    verl = search_target(get_target("verl", workload), workload, cluster, top_k=1)
    assert verl.best.workload.staleness == 0


def test_cli_search_prints_both_bests_and_writes_both_plans(tmp_path, monkeypatch):
    import yaml
    from rich.console import Console

    from hfplan import cli
    from hfplan.plan import load_plan
    from tests.support.cli import invoke

    monkeypatch.setattr(cli, "console", Console(width=400))
    spec = tmp_path / "w.yaml"
    spec.write_text(yaml.safe_dump({"algorithm": "grpo", "staleness": 1, "batch_prompts": 256,
                                    "samples_per_prompt": 4,
                                    "models": {"actor": "qwen2.5-0.5b", "reference": "qwen2.5-0.5b",
                                               "reward": "qwen2.5-0.5b"}}))
    out = tmp_path / "best.json"
    result = invoke("search", "--gpus", 8, "--workload", spec, "--out", out, "--no-compare", "--jobs", 1)
    assert result.exit_code == 0, result.output
    sync, pipelined = load_plan(tmp_path / "best.sync.json"), load_plan(tmp_path / "best.async.json")
    assert (sync.workload.staleness, pipelined.workload.staleness) == (0, 1)
    speedup = sync.estimate.iteration_s / pipelined.estimate.iteration_s
    assert f"speedup {speedup:.2f}x over the synchronous best" in result.output
    assert load_plan(out).estimate.iteration_s == min(sync.estimate.iteration_s, pipelined.estimate.iteration_s)


def test_export_refuses_an_asynchronous_plan():
    from hfplan.export.common import checked_target

    with pytest.raises(HfplanError, match=r"runs asynchronously \(staleness 1\)"):
        checked_target(plan_from_dict(_split_plan(1), "p.json"), "verl")
