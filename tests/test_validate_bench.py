"""bench/validate.py's grid: its workloads (PPO, GRPO, ReMax; larger demo models or another model on request) and
its placements beyond the colocated layouts (the actor apart; a separate rollout engine), all simulated, nothing
run."""

from __future__ import annotations

import math

import pytest

from tests.support.scripts import load_bench

BENCH = load_bench("validate")  # it imports execute_layouts beside it


def test_the_grid_runs_ppo_grpo_and_remax_on_the_demo_models_or_another():
    from hfplan.layout import ROLLOUT

    own = BENCH.workloads()
    assert {name: w.algorithm for name, w in own.items()} == {"demo": "ppo", "arith-grpo": "grpo",
                                                              "demo-remax": "remax"}
    assert set(own["demo-remax"].models) == {"actor", "reference", "reward"}
    swapped = BENCH.workloads("qwen2.5-0.5b")
    for name, workload in swapped.items():
        assert workload.models["reward"] == own[name].models["reward"]  # rule rewards stay
        assert {ref for role, ref in workload.models.items() if role != "reward"} == {"qwen2.5-0.5b"}
    larger = BENCH.workloads(small=True)  # the second model size: each demo model's larger counterpart
    assert {role: ref for role, ref in larger["demo"].models.items() if role != "reward"} == {
        "actor": "small", "critic": "small", "reference": "small"}
    assert larger["arith-grpo"].models["actor"] == "small-arith"
    assert [larger[name].models["reward"] for name in own] == [own[name].models["reward"] for name in own]
    placed = dict(BENCH.placed_plans(own["demo"], "cpu"))
    split, rollout = placed["split 1|1"], placed["rollout 1+1"]
    assert [group.models for group in split.placement] == [["actor"], ["critic", "reference"]]
    assert [group.gpus for group in split.placement] == [1, 1]
    assert [group.models for group in rollout.placement][-1] == [ROLLOUT]
    assert sum(group.gpus for group in rollout.placement) == 2


def test_a_point_s_spread_and_error_are_over_its_repeats():
    from hfplan.validation.compare import Comparison, Figure

    def run(measured: float) -> Comparison:
        return Comparison(calls=[], stages={}, iteration=Figure.of(1.0, measured), memory_gib={})

    point = BENCH.Point("p", [run(0.8), run(1.0), run(1.25)], [0.1, 0.0, 0.3], [1.1, 0.9, 1.0])
    assert point.median == 1.0 and point.error == 0.0
    assert point.spread == (1.25 - 0.8) / 1.0


def test_the_paced_error_stretches_the_simulated_time_by_the_runs_pace():
    from hfplan.validation.compare import Comparison, Figure

    def run(measured: float, stage_measured: float) -> Comparison:
        return Comparison(calls=[], stages={"generation": Figure.of(0.5, stage_measured),
                                            "training": Figure.of(0.2, 0.0)},  # nothing measured: left out
                          iteration=Figure.of(1.0, measured), memory_gib={})

    point = BENCH.Point("p", [run(1.2, 0.6), run(1.5, 0.75)], [0.0, 0.0], [1.2, 1.5])
    assert point.pace == pytest.approx(1.35)
    assert point.paced_error == pytest.approx((1.0 * 1.35 - 1.35) / 1.35)
    assert point.paced_stage_errors() == pytest.approx([(0.5 * 1.2 - 0.6) / 0.6, (0.5 * 1.5 - 0.75) / 0.75])


def test_a_saved_run_is_costed_again_against_its_own_measurements(tmp_path, capsys):
    """--save keeps each run's costed plan and measured figures; --recost simulates the plan again and compares it
    with those figures: here a record whose measurements are the simulation's own, halved."""
    import json

    from hfplan.plan import colocated_plan, phase_seconds
    from hfplan.profiles.hardware import load_hardware
    from hfplan.simulator.engine import simulate_plan
    from hfplan.validation.compare import Comparison, Figure

    plan = colocated_plan(BENCH.workloads()["arith-grpo"], 1, 1, 1, "cpu")
    estimate = simulate_plan(plan).estimate
    stages = phase_seconds(estimate.timeline)
    measured = Comparison(calls=[], stages={p: Figure.of(0.0, s / 2) for p, s in stages.items()},
                          iteration=Figure.of(0.0, estimate.iteration_s / 2), memory_gib={"set 0": Figure.of(0.0, 1.0)})
    record = BENCH.run_record(plan, measured, 0.0, 1.0, 1.0, math.nan)
    again = BENCH.recosted(json.loads(json.dumps(record)), None)
    assert again.iteration.simulated == pytest.approx(estimate.iteration_s)
    assert again.iteration.error == pytest.approx(1.0)
    assert {p: f.error for p, f in again.stages.items()} == pytest.approx({p: 1.0 for p in stages})
    # Costed with the parallelism measured around the run: the profile's own changes nothing; one core's worth
    # slows even one process, which shares its host with the controller's CPU.
    profiled = load_hardware("cpu").compute.host_parallelism
    assert BENCH.recosted(record, None, profiled).iteration.simulated == pytest.approx(estimate.iteration_s)
    assert BENCH.recosted(record, None, 1.0).iteration.simulated > estimate.iteration_s
    saved = tmp_path / "grid.json"
    saved.write_text(json.dumps({"date": "d", "iterations": 3, "runs": 1, "points": {"a": [record]}}))
    BENCH.summary(BENCH.recost(saved, None))
    out = capsys.readouterr().out
    assert "per stage 100.0%" in out and "iteration 100.0%" in out
    assert "host parallelism around the runs" in out and "at the machine's pace and parallelism" in out
    assert "split engine's pace" not in out  # no run measured it
    pair = colocated_plan(BENCH.workloads()["arith-grpo"], 1, 1, 2, "cpu")
    paired = BENCH.run_record(pair, measured, 0.0, 1.0, 1.0, 1.3)
    saved.write_text(json.dumps({"date": "d", "iterations": 3, "runs": 1, "points": {"a": [record], "b": [paired]}},
                                allow_nan=True))
    points = BENCH.recost(saved, None)
    assert [p.spans_processes for p in points] == [False, True]
    BENCH.summary(points)
    out = capsys.readouterr().out
    assert "split engine's pace against the profile's" in out and "median 1.30, range 1.30-1.30" in out
    assert "+100.0% over the 1 others" in out and "over the 1 plans with a set of several processes" in out
    assert (BENCH.recosted(paired, None, 1.0).iteration.simulated
            > BENCH.recosted(paired, None).iteration.simulated)  # the profile's 1.87 against 1.0 around the run
