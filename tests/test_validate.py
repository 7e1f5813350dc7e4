"""`hfplan validate`: the comparison math by hand, bad input in one line, and one short real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hfplan.plan import Span, phase_seconds
from hfplan.profiler.pace import profiled_split_seconds, profiled_step_seconds
from hfplan.profiles.hardware import Runtime, load_hardware
from hfplan.validation import machine
from hfplan.validation.compare import compare, kendall_tau, signed_error
from hfplan.validation.run import peak_gib_per_set, predicted_gib, side_by_side, with_profile
from tests.support.cli import assert_user_error, invoke
from tests.support.executor_runs import cpu_plan, tiny_workload


def span(role, op, phase, start, end, set_=0, kind="compute"):
    return Span(role=role, op=op, phase=phase, set=set_, start=start, end=end, kind=kind)


SIMULATED = [span("actor", "generate", "generation", 0.0, 2.0), span("actor", "log_prob", "preparation", 2.0, 2.5),
             span("actor", "update", "training", 2.5, 3.5), span("actor", "update", "training", 3.5, 4.5)]


def test_signed_error():
    assert signed_error(1.1, 1.0) == pytest.approx(0.1)
    assert signed_error(0.5, 1.0) == pytest.approx(-0.5)
    assert signed_error(1.0, 0.0) is None


def test_calls_matched_by_occurrence_and_averaged_over_iterations():
    run1 = [span("actor", "generate", "generation", 10.0, 14.0), span("actor", "log_prob", "preparation", 14, 14.5),
            span("actor", "update", "training", 14.5, 15.5), span("actor", "update", "training", 15.5, 17.5)]
    run2 = [span("actor", "generate", "generation", 0.0, 2.0), span("actor", "log_prob", "preparation", 2.0, 2.5),
            span("actor", "update", "training", 2.5, 3.5), span("actor", "update", "training", 3.5, 5.5),
            span("critic", "values", "preparation", 5.5, 6.0)]
    result = compare(SIMULATED, [run1, run2], [1.0], [2.0], ["set 0"])
    by_name = {(c.op, c.occurrence): c for c in result.calls}
    assert by_name[("generate", 0)].measured == pytest.approx(3.0)  # (4 + 2) / 2
    assert by_name[("generate", 0)].error == pytest.approx(-1 / 3)
    assert by_name[("update", 1)].measured == pytest.approx(2.0)  # the second update is matched with the second
    assert by_name[("update", 1)].error == pytest.approx(-0.5)
    assert result.stages["training"].measured == pytest.approx(3.0)
    assert result.stages["training"].simulated == pytest.approx(2.0)
    assert result.iteration.measured == pytest.approx((7.5 + 6.0) / 2)
    assert result.iteration.error == pytest.approx(4.5 / 6.75 - 1)
    assert result.memory_gib["set 0"].error == pytest.approx(-0.5)
    assert result.unmatched["measured"] == ["set 0 critic.values (preparation, compute) #0"]
    assert json.loads(json.dumps(result.to_json()))["iteration"]["error"] == pytest.approx(result.iteration.error)


def test_each_measured_figure_is_the_median_of_the_iterations_so_one_slow_iteration_does_not_move_it():
    def run(generate: float, update: float) -> list[Span]:
        return [span("actor", "generate", "generation", 0.0, generate),
                span("actor", "update", "training", generate, generate + update)]

    slow = run(40.0, 1.0)  # a hiccup in generation: the mean of the three would be 15
    result = compare(SIMULATED[:1], [run(2.0, 1.0), slow, run(3.0, 2.0)], [], [], [])
    (generate,) = [c for c in result.calls if c.op == "generate"]
    assert generate.measured == pytest.approx(3.0)
    assert result.stages["generation"].measured == pytest.approx(3.0)
    assert result.stages["training"].measured == pytest.approx(1.0)
    assert result.iteration.measured == pytest.approx(5.0)  # iterations of 3, 41 and 5 seconds


def test_transfers_are_matched_with_the_call_they_feed_by_the_one_it_waited_for_last():
    simulated = [span("actor", "critic.values->actor.update", "training", 0.5, 1.25, kind="transfer"),
                 span("actor", "generate->actor.update", "training", 0.0, 0.5, kind="transfer")]
    measured = [span("actor", "update", "training", 1.0, 2.0, kind="transfer")]
    (call,) = compare(simulated, [measured], [], [], []).calls
    assert (call.op, call.kind, call.simulated, call.error) == ("update", "transfer", 0.75, -0.25)


def test_phase_seconds_is_first_start_to_last_end():
    spans = [span("a", "x", "p", 1.0, 2.0), span("b", "y", "p", 1.5, 4.0, set_=1), span("a", "z", "q", 4.0, 4.25)]
    assert phase_seconds(spans) == {"p": 3.0, "q": 0.25}
    # A simulated dispatch is the gap before a measured call: it opens no phase window.
    assert phase_seconds([span("a", "x", "p", 0.5, 1.0, kind="dispatch"), *spans]) == {"p": 3.0, "q": 0.25}
    # Nor does a transfer into the phase's first call, made as soon as its data was (the simulator's rule); it
    # still ends a phase, and a phase of transfers alone spans them.
    early = span("b", "gen->y", "p", 0.25, 0.5, kind="transfer")
    late = span("b", "y->z", "p", 4.0, 4.5, kind="transfer")
    only = span("c", "z->w", "r", 5.0, 5.5, kind="transfer")
    assert phase_seconds([early, *spans, late, only]) == {"p": 3.5, "q": 0.25, "r": 0.5}


def test_dispatches_are_not_matched_and_the_greedy_generation_is_the_second_generate():
    simulated = [span("actor", "generate", "generation", 0.0, 0.1, kind="dispatch"),
                 span("actor", "generate", "generation", 0.1, 2.0),
                 span("actor", "generate", "generation", 2.0, 2.1, kind="dispatch"),
                 span("actor", "generate(greedy)", "generation", 2.1, 3.0)]
    measured = [span("actor", "generate", "generation", 0.2, 2.2),
                span("actor", "generate", "generation", 2.4, 3.4)]
    result = compare(simulated, [measured], [], [], [])
    assert [(c.op, c.occurrence, c.simulated, c.measured) for c in result.calls] == [
        ("generate", 0, pytest.approx(1.9), pytest.approx(2.0)),
        ("generate", 1, pytest.approx(0.9), pytest.approx(1.0))]
    assert result.unmatched == {"simulated": [], "measured": []}
    assert result.stages["generation"].simulated == pytest.approx(2.9)


def test_compare_needs_a_measured_iteration():
    with pytest.raises(ValueError):
        compare(SIMULATED, [], [], [], [])


def test_kendall_tau():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)


def test_kendall_tau_counts_only_the_pairs_the_measurements_settle():
    # The last two plans' measured ranges overlap: their swapped order is not counted, the other five pairs are.
    spans = [(0.9, 1.1), (1.9, 2.1), (3.0, 4.2), (3.9, 4.1)]
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4.1, 4.0], spans) == 1.0
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4.1, 4.0]) == pytest.approx(4 / 6)
    assert math.isnan(kendall_tau([1, 2], [1, 1.1], [(0.5, 1.5), (0.6, 1.6)]))
    with pytest.raises(ValueError):
        kendall_tau([1, 2], [1, 2], [(0, 1)])


def test_peak_per_set_and_side_by_side_rows():
    assert peak_gib_per_set({"set 0 rank 0": 2**30, "set 0 rank 1": 2**31, "set 1 rank 0": 2**29}, 2) == [2.0, 0.5]
    spans, rows = side_by_side([span("actor", "g", "generation", 0, 1, set_=1)],
                               [span("controller", "adv", "preparation", 0, 1, set_=-1)], ["set 0", "set 1"])
    assert rows[spans[0].set] == "simulated: set 1"
    assert rows[spans[1].set] == "measured: controller"


@pytest.fixture
def tiny_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)]).to_json())
    return path


def test_on_a_cpu_profile_the_worker_process_own_memory_is_compared_beside_the_plan(tiny_plan_file, tmp_path):
    """The executor measures a CPU worker's resident set, which holds the process itself; a GPU's allocated
    memory does not."""
    import yaml

    from hfplan.plan import load_plan
    from hfplan.profiles.hardware import SHIPPED_DIR

    plan = load_plan(tiny_plan_file)
    base = plan.cluster.profile.memory.worker_resident_gib
    assert plan.cluster.profile.on_host and base > 0
    assert predicted_gib(plan, [0.25, 1.0]) == pytest.approx([0.25 + base, 1.0 + base])
    gpu = yaml.safe_load((SHIPPED_DIR / "cpu.yaml").read_text()) | {"backend": "nccl"}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(gpu))
    assert predicted_gib(with_profile(plan, path), [0.25, 1.0]) == [0.25, 1.0]


def test_a_profile_given_is_the_one_simulated(tiny_plan_file, tmp_path):
    import yaml

    from hfplan.plan import load_plan
    from hfplan.profiles.hardware import SHIPPED_DIR
    from hfplan.simulator.engine import simulate_plan

    plan = load_plan(tiny_plan_file)
    shipped = simulate_plan(plan).estimate.iteration_s
    slower = yaml.safe_load((SHIPPED_DIR / "cpu.yaml").read_text())
    slower["compute"]["peak_tflops"] /= 4
    slower["memory"]["bandwidth_gbytes_per_s"] /= 4
    slower["runtime"] = {name: value * 4 for name, value in slower["runtime"].items() if value is not None}
    path = tmp_path / "slower.yaml"
    path.write_text(yaml.safe_dump(slower))
    assert simulate_plan(with_profile(plan, path)).estimate.iteration_s > 2 * shipped


def test_missing_plan(tmp_path):
    assert_user_error(invoke("validate", tmp_path / "none.json"), "plan file not found")


def test_malformed_plan(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert_user_error(invoke("validate", bad), "bad.json")


def test_unwritable_timeline(tiny_plan_file, tmp_path):
    target = tmp_path / "no-such-folder" / "t.png"
    assert_user_error(invoke("validate", tiny_plan_file, "--timeline", target, "--out", tmp_path / "run"),
                      "--timeline")
    assert not target.exists() and not (tmp_path / "run").exists()


def test_one_iteration_is_refused(tiny_plan_file, tmp_path):
    assert_user_error(invoke("validate", tiny_plan_file, "--iterations", 1, "--out", tmp_path / "run"),
                      "--iterations")


def test_an_address_where_nothing_answers_is_refused_in_one_line(tiny_plan_file, tmp_path, monkeypatch):
    read: list[bool] = []
    monkeypatch.setattr(machine.PaceProbe, "measure_before", lambda probe: read.append(True))
    assert_user_error(invoke("validate", tiny_plan_file, "--address", "127.0.0.1:9", "--connect-timeout", 0.5,
                             "--out", tmp_path / "run"), "127.0.0.1:9")
    assert not (tmp_path / "run").exists()
    assert read == []  # refused before the pace probes are read (they take seconds to start)


def test_two_iterations_compared_as_json(tiny_plan_file, tmp_path, ray_driver):
    chart = tmp_path / "both.html"
    result = invoke("validate", tiny_plan_file, "--iterations", 2, "--json", "--timeline", chart)
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["iterations"] == 2
    ops = {(c["role"], c["op"]) for c in body["calls"]}
    assert {("actor", "generate"), ("critic", "update"), ("reference", "log_prob")} <= ops
    for call in body["calls"]:
        if call["measured"] > 0:
            assert call["error"] == pytest.approx((call["simulated"] - call["measured"]) / call["measured"])
    assert body["iteration"]["measured"] > 0 and body["iteration"]["simulated"] > 0
    assert set(body["stages"]) >= {"generation", "preparation", "training"}
    (label, memory), = body["memory_gib"].items()
    assert memory["measured"] > 0 and memory["simulated"] > 0
    assert f"simulated: {label}" in chart.read_text() and f"measured: {label}" in chart.read_text()
    assert body["other_cpu_cores"] is None or body["other_cpu_cores"] >= 0.0
    assert body["rank_start_spread_s"] is None  # the tiny plan's sets are one rank each
    placed = json.loads(Path(tiny_plan_file).read_text())["cluster"]["gpus"]
    cluster = body["simulated_cluster"]  # the local run's processes on one node
    assert cluster["gpus"] == placed and cluster["gpus_per_node"] >= placed
    counts, workload = body["response_len_counts"], tiny_workload()  # the plan's: the compared iteration's responses
    assert 1 <= body["prompt_len"] <= workload.prompt_len  # the width the run padded the compared prompts to
    assert sum(n for _, n in counts) == workload.sequences
    assert all(1 <= length <= workload.response_len for length, _ in counts)
    assert body["response_len_mean"] == pytest.approx(sum(length * n for length, n in counts) / workload.sequences)
    pace = body["pace"]  # the tiny plan's profile was measured on CPU processes: the probe ran around the run
    assert pace["profiled_step_s"] == pytest.approx(profiled_step_seconds(load_hardware("cpu")))
    assert pace["profiled_parallelism"] == load_hardware("cpu").compute.host_parallelism
    assert pace["together"]["processes"] == load_hardware("cpu").gpus_per_node and pace["parallelism"] > 0
    assert pace["before_step_s"] > 0 and pace["after_step_s"] > 0
    assert pace["ratio"] == pytest.approx((pace["before_step_s"] + pace["after_step_s"]) / 2
                                          / pace["profiled_step_s"])
    split = pace["split"]  # the probes' split engine, against the profile's price of it
    assert split["processes"] == 2 and split["before_s"] > 0 and split["after_s"] > 0
    assert split["profiled_s"] == pytest.approx(profiled_split_seconds(load_hardware("cpu"), 2))


def test_the_rest_of_the_machine_is_its_busy_time_less_the_run_s_own_cpu():
    assert machine.busy_seconds("cpu  100 20 30 400 50 5 5 10 0 0", 100.0) == pytest.approx((100 + 20 + 30 + 10 + 10)
                                                                                           / 100)
    # A command name may hold spaces and parentheses: the fields follow the last ')'.
    line = "42 (ray::IDLE (x) y) S 7 42 42 0 -1 4194560 100 0 0 0 250 50 3 2 20 0 1 0 100 1000 10"
    assert machine.parse_process(line) == (42, 7, 250 + 50 + 3 + 2)
    rows = [(1, 0, 1000), (10, 1, 5), (11, 10, 7), (12, 11, 11), (20, 1, 100)]
    assert machine.tree_ticks(rows, 10) == 5 + 7 + 11
    before = machine.CpuSample(wall_s=0.0, busy_s=10.0, run_s=4.0)
    after = machine.CpuSample(wall_s=2.0, busy_s=13.0, run_s=5.0)
    assert machine.other_cores(before, after) == pytest.approx((3.0 - 1.0) / 2.0)
    assert machine.other_cores(before, machine.CpuSample(2.0, 10.5, 5.0)) == 0.0  # never below 0
    assert machine.other_cores(None, after) is None


BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def cpu_of(pid: int) -> float:
    import os

    return machine.parse_process(open(f"/proc/{pid}/stat").read())[2] / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(machine.sample() is None, reason="reads Linux's /proc")
def test_a_descendant_s_cpu_is_the_run_s_and_a_stranger_s_is_the_rest_of_the_machine_s():
    """Exact attribution, whatever the load: a busy child's CPU is inside the run's, a busy process that left the
    tree (re-parented when its shell exited) is inside the rest of the machine's."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=1.0)])
    time.sleep(0.1)
    before, child_before = machine.sample(), cpu_of(child.pid)
    time.sleep(0.6)
    child_cpu = cpu_of(child.pid) - child_before
    during = machine.sample()
    child.wait()
    assert child_cpu > 0.05  # it ran
    assert during.run_s - before.run_s >= child_cpu - 0.02  # one tick of slack per reading
    started = subprocess.run(["sh", "-c", f"{sys.executable} -c '{BUSY.format(seconds=1.5)}' >/dev/null 2>&1 & "
                              "echo $!"], check=True, capture_output=True, text=True)
    stranger = int(started.stdout)
    time.sleep(0.1)
    start, stranger_before = machine.sample(), cpu_of(stranger)
    time.sleep(0.6)
    stranger_cpu = cpu_of(stranger) - stranger_before
    end = machine.sample()
    assert stranger_cpu > 0.05
    # /proc/stat's per-CPU ticks and the process's own ticks are counted apart: a few ticks of slack between them
    # (three ticks fell short by a hair once, in a fresh clone's CI).
    assert machine.other_cores(start, end) * (end.wall_s - start.wall_s) >= stranger_cpu - 0.05


def test_the_profile_implies_the_probe_s_time_from_its_fit():
    """The probe's time at profiling is what the fit split it into: the step's fixed costs (per step, per
    sequence of one, and per layer of the 2-layer tiny model) on top of its modelled kernels; a profile not
    measured on CPU processes has none."""
    cpu = load_hardware("cpu")
    bare = profiled_step_seconds(cpu.model_copy(update={"runtime": Runtime()}))
    runtime = cpu.runtime.model_copy(update={"engine_step_us": 300.0, "engine_sequence_step_us": 20.0,
                                             "layer_step_us": 50.0})
    assert profiled_step_seconds(cpu.model_copy(update={"runtime": runtime})) == pytest.approx(bare + 420e-6)
    assert bare > 0
    assert profiled_step_seconds(load_hardware("a100-80g")) is None
    assert profiled_step_seconds(cpu.model_copy(update={"measured": False})) is None


def test_pace_is_the_probe_around_the_run_over_the_profile_s():
    pace = machine.Pace(profiled_s=200e-6, before_s=300e-6, after_s=500e-6)
    assert pace.ratio == pytest.approx(2.0)
    assert pace.to_json()["ratio"] == pytest.approx(2.0)
    assert pace.parallelism is None and pace.to_json()["together"] is None and pace.to_json()["split"] is None
    with machine.PaceProbe(None) as probe:  # nothing to compare with: no process is started
        assert probe.processes == []
        probe.measure_before()
        assert probe.finish() is None


def test_the_host_s_parallelism_around_the_run_is_the_probes_at_once_against_one_alone():
    """Two probes at once each 1.5x as long as one alone: the host did 2 x 1 / 1.5 = 1.33 processes' work at full
    speed (hfplan.profiler.host_share's measure, beside the profile's)."""
    sharing = machine.Sharing(world=2, before_s=450e-6, after_s=750e-6, profiled=1.87)
    pace = machine.Pace(profiled_s=200e-6, before_s=300e-6, after_s=500e-6, sharing=sharing)
    assert pace.parallelism == pytest.approx(2 * 400e-6 / 600e-6)
    body = pace.to_json()
    assert body["parallelism"] == pytest.approx(4 / 3) and body["profiled_parallelism"] == 1.87
    assert body["together"] == {"processes": 2, "before_step_s": 450e-6, "after_step_s": 750e-6}


def test_the_probe_processes_time_alone_then_together_then_the_split_engine_around_a_run():
    """The real probe processes (one alone, then both at once, then the engine's log-prob calls across them in their
    gloo group), as validate runs them on a CPU profile; their rendezvous folder is gone after."""
    with machine.PaceProbe(300e-6, world=2, profiled_parallelism=1.87, profiled_split_s=20e-3) as probe:
        assert len(probe.processes) == 2 and probe.before is None  # read once the run's workers are up
        rendezvous = Path(probe._rendezvous.name)
        probe.measure_before()
        pace = probe.finish()
    assert pace is not None and probe.processes == [] and not rendezvous.exists()
    assert pace.before_s > 0 and pace.after_s > 0
    assert pace.sharing.world == 2 and pace.sharing.before_s > 0 and pace.parallelism > 0
    probe = pace.split
    assert probe.world == 2 and probe.profiled_s == 20e-3 and probe.before_s > 0 and probe.after_s > 0
    assert pace.to_json()["split"]["ratio"] == pytest.approx(probe.ratio)


def test_a_split_probe_is_asked_only_of_several_processes():
    probe = machine.PaceProbe(300e-6, world=1, profiled_split_s=20e-3)
    assert probe.profiled_split_s is None  # one process splits nothing


def test_the_split_engine_s_pace_is_the_probe_around_the_run_over_the_profile_s_price():
    """The split probe's time by the profile is its price of the engine's log-prob calls across the host's
    processes (wrapped in FSDP2, split by tensor parallelism; the profile's fit of those calls) without the
    controller's dispatch; a profile with one process a node, or not measured on CPU processes, implies none."""
    from hfplan.profiler import runtime
    from hfplan.profiler.pace import split_modes

    cpu = load_hardware("cpu")
    assert split_modes(2) == (runtime.FSDP, runtime.TP)
    implied = profiled_split_seconds(cpu, 2)
    assert implied == pytest.approx(sum(runtime.log_prob_price(cpu, mode, 2) for mode in split_modes(2)))
    # Its tensor-parallel fixed cost is in it, once per pass
    more = cpu.model_copy(update={"runtime": cpu.runtime.model_copy(
        update={"tp_forward_pass_us": cpu.runtime.tp_forward_pass_us + 1000.0})})
    assert profiled_split_seconds(more, 2) > implied + 0.9e-3
    assert profiled_split_seconds(cpu, 1) is None
    assert profiled_split_seconds(cpu, cpu.gpus_per_node + 1) is None
    assert profiled_split_seconds(load_hardware("a100-80g"), 2) is None
    pace = machine.SplitPace(world=2, profiled_s=400e-6, before_s=500e-6, after_s=700e-6)
    assert pace.ratio == pytest.approx(1.5)
    assert pace.to_json() == {"processes": 2, "profiled_s": 400e-6, "before_s": 500e-6, "after_s": 700e-6,
                              "ratio": pytest.approx(1.5)}


def test_a_machine_that_moved_since_its_profile_is_named_by_what_moved():
    """Further than PACE_DRIFT from the profile's moment, on the step or on the split engine (either way: faster
    counts as much as slower), validate says so; within it, nothing."""
    from hfplan.profiler.pace import PACE_DRIFT

    steady = machine.Pace(profiled_s=100e-6, before_s=110e-6, after_s=110e-6)
    assert steady.drifted() is None
    slower = machine.Pace(profiled_s=100e-6, before_s=100e-6 * (1 + PACE_DRIFT) + 10e-6, after_s=130e-6)
    assert "the step's pace" in slower.drifted() and "split" not in slower.drifted()
    faster = machine.SplitPace(world=2, profiled_s=1e-3, before_s=0.7e-3, after_s=0.7e-3)
    moved = machine.Pace(profiled_s=100e-6, before_s=100e-6, after_s=100e-6, split=faster).drifted()
    assert "the split engine's 0.70x" in moved and "step" not in moved
