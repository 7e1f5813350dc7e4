"""`hfplan search` through typer's CliRunner (and once through the real script): the plan it writes, the
candidates CSV, the tables it prints, and one-line errors that leave no plan file behind."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from hfplan import cli
from hfplan.cli import PARALLELISM_LEGEND
from hfplan.plan import ROLLOUT, load_plan
from hfplan.planner import space
from hfplan.planner.baselines import compare
from hfplan.planner.report import describe_role
from hfplan.simulator.engine import simulate_plan
from hfplan.spec import load_workload, make_cluster
from tests.support.cli import assert_user_error as _assert_user_error
from tests.support.cli import invoke as _invoke

HFPLAN = Path(sys.executable).with_name("hfplan")
SYSTEMS = ("NeMo-Aligner-like", "DeepSpeed-Chat-like", "OpenRLHF")
STATUSES = {"evaluated", "pruned", "infeasible"}


@pytest.fixture
def wide_console(monkeypatch):
    """Render rich output 200 columns wide, whatever the environment says, so cells are not cropped."""
    monkeypatch.setattr(cli, "console", Console(width=200))


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _covers(row: dict, placement: tuple[tuple[str, ...], ...], allocation: tuple[int, ...]) -> bool:
    """Does a CSV row stand for this (placement, allocation)? A `*` in gpus stands for any size."""
    roles = tuple(tuple(group.split("+")) for group in row["placement"].split(" | "))
    sizes = row["gpus"].split(" | ")
    if roles != placement or len(sizes) != len(allocation):
        return False
    return all(s == "*" or int(s) == a for s, a in zip(sizes, allocation, strict=True))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`hfplan search --gpus 16 --out X --csv Y --top 3` on the default workload, run once."""
    folder = tmp_path_factory.mktemp("search")
    out, table = folder / "best.json", folder / "all.csv"
    mp = pytest.MonkeyPatch()
    mp.setattr(cli, "console", Console(width=200))
    try:
        result = _invoke("search", "--gpus", 16, "--out", out, "--csv", table, "--top", 3, "--jobs", 1)
    finally:
        mp.undo()
    return result, out, table


# -- happy paths ----------------------------------------------------------------------------------
def test_search_writes_a_valid_plan_with_estimate_and_timeline(default_run):
    result, out, _ = default_run
    assert result.exit_code == 0, (result.output, result.exception)
    plan = load_plan(out)
    assert plan.workload == load_workload("ppo-llama2-7b")
    assert plan.cluster.gpus == 16 and plan.cluster.hardware == "a100-80g"
    assert plan.estimate is not None and plan.estimate.timeline
    assert sum(s.gpus for s in plan.placement) + plan.estimate.idle_gpus == 16
    simulated = simulate_plan(plan).estimate
    assert plan.estimate.iteration_s == pytest.approx(simulated.iteration_s, rel=1e-12)
    assert plan.estimate.timeline == simulated.timeline
    assert not list(out.parent.glob(".*.tmp")), "no temporary files left beside the plan"


def test_search_csv_accounts_for_every_allocation_with_status_and_reason(default_run):
    result, out, table = default_run
    assert result.exit_code == 0
    rows = _rows(table)
    assert rows
    assert {"placement", "gpus", "status", "iteration_s", "reason"} <= set(rows[0])
    assert {r["status"] for r in rows} <= STATUSES
    for row in rows:
        if row["status"] == "evaluated":
            assert float(row["iteration_s"]) > 0
            assert "*" not in row["gpus"]
        else:
            assert row["reason"], row
    evaluated = [(r["placement"], r["gpus"]) for r in rows if r["status"] == "evaluated"]
    assert len(evaluated) == len(set(evaluated))
    # every (placement, allocation) of the space is accounted for by some row
    workload = load_workload("ppo-llama2-7b")
    roles = tuple(workload.model_roles)
    for placement in space.set_partitions(roles) + space.set_partitions((*roles, ROLLOUT)):
        for allocation in space.allocations(len(placement), 16, 8, idle=True):
            assert any(_covers(r, placement, allocation) for r in rows), (placement, allocation)
    # the plan written is the fastest row
    plan = load_plan(out)
    best = min(float(r["iteration_s"]) for r in rows if r["status"] == "evaluated")
    assert plan.estimate.iteration_s == pytest.approx(best, abs=1e-4)
    best_row = next(r for r in rows if r["status"] == "evaluated" and float(r["iteration_s"]) == best)
    assert best_row["placement"] == " | ".join("+".join(s.models) for s in plan.placement)
    assert best_row["gpus"] == " | ".join(str(s.gpus) for s in plan.placement)


def table_rows(lines: list[str], first: str = r"\d+") -> list[list[list[str]]]:
    """The rows of a rich table whose first cell matches `first`: each row a list of cells, each cell its lines
    (a row goes on over the following lines of the table)."""
    rows: list[list[list[str]]] = []
    for line in lines:
        if "│" not in line:
            rows.append(None)  # the table (or this row) ended
            continue
        cells = [cell.strip() for cell in line.split("│")]
        if re.fullmatch(first, cells[0]):
            rows.append([[cell] if cell else [] for cell in cells])
        elif rows and rows[-1] is not None:
            for cell, more in zip(rows[-1], cells, strict=True):
                if more:
                    cell.append(more)
    return [row for row in rows if row is not None]


def placement_lines(plan) -> list[str]:
    idle = plan.estimate.idle_gpus
    return [f"{' + '.join(s.models)} ({s.gpus} GPUs, {peak:.1f} GiB)"
            for s, peak in zip(plan.placement, plan.estimate.peak_memory_gib, strict=True)] + (
        [f"idle ({idle} GPU{'s' if idle > 1 else ''})"] if idle else [])


def test_search_prints_the_top_table_and_the_comparison(default_run):
    result, out, _ = default_run
    assert result.exit_code == 0
    text = result.stdout
    plan = load_plan(out)
    assert "top 3 plans: ppo-llama2-7b on 16 x a100-80g" in text
    lines = text.splitlines()
    rows = table_rows(lines)
    assert [row[0] for row in rows] == [["1"], ["2"], ["3"]]
    times = [float(row[3][0]) for row in rows]
    assert times == sorted(times)
    assert rows[0][1] == placement_lines(plan)
    assert rows[0][2] == [f"{role}: {describe_role(par)}" for role, par in plan.parallelism.items()]
    assert rows[0][3] == [f"{plan.estimate.iteration_s:.2f}"]
    assert rows[0][4] == [f"{plan.estimate.tokens_per_s:,.0f}"]
    assert len({tuple(row[1]) for row in rows}) == 3  # distinct placements and allocations
    # the comparison: each system's time and hfplan's speedup over it, computed here on the same simulator
    assert "other systems" in text
    systems = {row[0][0]: row for row in table_rows(lines, "|".join(SYSTEMS))}
    for item in compare(plan.workload, make_cluster(16, "a100-80g")):
        row = systems[item.baseline.name]
        if item.plan is None:
            assert row[0] == [item.baseline.name, "does not fit"] and row[1] == [item.reason]
            continue
        # under its name, its placement; then its layouts, like hfplan's rows
        assert row[0] == [item.baseline.name, *placement_lines(item.plan)]
        assert row[1] == [f"{role}: {describe_role(par)}" for role, par in item.plan.parallelism.items()]
        assert row[2] == [f"{item.iteration_s:.2f}"]
        assert row[4] == [f"{item.iteration_s / plan.estimate.iteration_s:.2f}x"]
        assert f"{item.baseline.name}: {item.baseline.description}" in " ".join(text.split())
    assert "searched 67 placements" in text  # PPO's 15 with the hybrid engine, 52 with a rollout set
    assert PARALLELISM_LEGEND in " ".join(text.split())


def test_no_compare_skips_the_comparison(tmp_path, wide_console):
    out = tmp_path / "best.json"
    result = _invoke("search", "--gpus", 8, "--workload", "ppo-qwen2.5-0.5b", "--out", out, "--no-compare",
                     "--jobs", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    assert load_plan(out).estimate is not None
    assert re.search(r"top \d+ plans", result.stdout)
    assert "other systems" not in result.stdout
    for name in SYSTEMS:
        assert name not in result.stdout


def test_partial_node_twelve_gpus(tmp_path, wide_console):
    out = tmp_path / "plan12.json"
    result = _invoke("search", "--gpus", 12, "--workload", "ppo-qwen2.5-0.5b", "--out", out, "--no-compare",
                     "--top", 2, "--jobs", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    plan = load_plan(out)
    assert plan.cluster.gpus == 12 and plan.cluster.gpus_per_node == 8
    assert sum(s.gpus for s in plan.placement) + plan.estimate.idle_gpus == 12
    assert all(s.gpus in space.set_sizes(12, 8) for s in plan.placement)


def test_workload_file_and_hardware_options(tmp_path, wide_console):
    spec = {"algorithm": "grpo", "models": {"actor": "qwen2.5-0.5b", "reference": "qwen2.5-0.5b",
                                            "reward": "rule:vowel-fraction"},
            "prompt_len": 128, "response_len": 128, "batch_prompts": 8, "samples_per_prompt": 2, "mini_batches": 2}
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "best.json"
    result = _invoke("search", "--gpus", 4, "--workload", path, "--hardware", "h100-80g", "--gpus-per-node", 2,
                     "--out", out, "--jobs", 2)
    assert result.exit_code == 0, (result.output, result.exception)
    plan = load_plan(out)
    assert plan.cluster.hardware == "h100-80g" and plan.cluster.gpus_per_node == 2
    assert plan.workload.algorithm == "grpo"


def test_default_out_is_best_json_in_the_working_folder(tmp_path, monkeypatch, wide_console):
    monkeypatch.chdir(tmp_path)
    result = _invoke("search", "--gpus", 8, "--workload", "ppo-qwen2.5-0.5b", "--no-compare", "--jobs", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    assert load_plan(tmp_path / "best.json").estimate is not None


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "needles"), [
    (["--gpus", 8, "--workload", "no-such-workload"], ["unknown workload", "no-such-workload"]),
    (["--gpus", 8, "--hardware", "no-such-gpu"], ["unknown hardware", "no-such-gpu"]),
    (["--gpus", 0], ["--gpus", "0"]),
    (["--gpus", -4], ["--gpus"]),
    (["--gpus", 8, "--gpus-per-node", 3], ["--gpus-per-node", "3"]),
    (["--gpus", 8, "--workload", "missing.yaml"], ["not found"]),
], ids=["workload", "hardware", "zero-gpus", "negative-gpus", "node-size", "workload-file"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, needles):
    out = tmp_path / "best.json"
    result = _invoke("search", *args, "--out", out, "--no-compare", "--jobs", 1)
    _assert_user_error(result, *needles)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_too_few_gpus_names_the_minimum_and_why(tmp_path):
    out = tmp_path / "best.json"
    result = _invoke("search", "--gpus", 4, "--workload", "ppo-llama2-70b", "--out", out, "--jobs", 1)
    line = _assert_user_error(result, "at least", "GiB")
    minimum = int(line.split("at least")[1].split()[0])
    assert minimum > 4
    assert not out.exists()


def test_output_folder_missing(tmp_path):
    out = tmp_path / "missing" / "best.json"
    result = _invoke("search", "--gpus", 8, "--workload", "ppo-qwen2.5-0.5b", "--out", out, "--jobs", 1)
    _assert_user_error(result, "missing")
    assert not out.parent.exists()


def test_csv_folder_missing_fails_before_writing_the_plan(tmp_path):
    out = tmp_path / "best.json"
    result = _invoke("search", "--gpus", 8, "--workload", "ppo-qwen2.5-0.5b", "--out", out,
                     "--csv", tmp_path / "nowhere" / "all.csv", "--jobs", 1)
    _assert_user_error(result, "nowhere")
    assert not out.exists()


def test_failed_search_leaves_an_existing_plan_untouched(tmp_path):
    out = tmp_path / "best.json"
    out.write_text("previous plan\n")
    result = _invoke("search", "--gpus", 4, "--workload", "ppo-llama2-70b", "--out", out, "--jobs", 1)
    _assert_user_error(result, "at least")
    assert out.read_text() == "previous plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.json"]


def test_real_script_reports_one_line_without_traceback(tmp_path):
    assert HFPLAN.exists()
    out = tmp_path / "best.json"
    done = subprocess.run([str(HFPLAN), "search", "--gpus", "0", "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not out.exists()


def test_idle_gpus_are_shown_in_the_table(tmp_path, wide_console):
    """65 GPUs: the best plan is the 64-GPU one, with one GPU idle, said in its placement cell and the plan."""
    out = tmp_path / "best.json"
    result = _invoke("search", "--gpus", 65, "--out", out, "--no-compare", "--top", 2, "--jobs", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    plan = load_plan(out)
    assert plan.estimate.idle_gpus == 65 - sum(s.gpus for s in plan.placement) > 0
    rows = table_rows(result.stdout.splitlines())
    assert rows[0][1] == placement_lines(plan)
    assert rows[0][1][-1].startswith("idle (")


def test_a_cluster_beyond_the_search_is_refused_with_the_reason(tmp_path):
    out = tmp_path / "best.json"
    result = _invoke("search", "--gpus", 1_000_000, "--out", out, "--jobs", 1)
    _assert_user_error(result, "1,000,000", "beyond the search", "32,768")
    assert not out.exists()
    result = _invoke("search", "--gpus", 4100, "--out", out, "--jobs", 1)
    _assert_user_error(result, "4,100", "not whole nodes", "4,096")
    assert not out.exists()


def test_a_long_search_shows_its_progress(monkeypatch):
    """The CLI's bar appears once a search has run past its delay (here at once), fed by the library's
    progress callback: a bar per stage, the walk ending complete."""
    from hfplan.planner.search import search

    monkeypatch.setattr(cli._progress, "DELAY_S", 0.0)
    shown = cli._progress()
    progress = shown.__enter__()
    try:
        search(load_workload("ppo-qwen2.5-0.5b"), make_cluster(8), top_k=1, progress=progress)
        assert shown._live
        assert {"bounding placements", "searching allocations"} <= set(shown._tasks)
        walk = shown._bar.tasks[shown._tasks["searching allocations"]]
        assert walk.completed == walk.total > 0
    finally:
        shown.__exit__(None, None, None)


def test_the_best_says_whether_it_is_optimal_or_its_proven_gap(tmp_path, wide_console):
    """A finished walk prints 'optimal'; one cut by --time-limit prints the gap to the least bound it left open."""
    out = tmp_path / "best.json"
    args = ("search", "--gpus", 16, "--workload", "grpo-qwen2.5-1.5b", "--out", out, "--no-compare", "--jobs", 1)
    finished = _invoke(*args)
    assert finished.exit_code == 0, (finished.output, finished.exception)
    assert "best (optimal):" in finished.stdout and "left open" not in finished.stdout
    cut = _invoke(*args, "--time-limit", 0)
    assert cut.exit_code == 0, (cut.output, cut.exception)
    gap = re.search(r"best \(within (\d+\.\d\d)% of optimal\):", cut.stdout)
    assert gap is not None and float(gap.group(1)) > 0, cut.stdout
    assert "left open by --time-limit" in cut.stdout


def test_past_2048_gpus_the_walk_stops_by_default(tmp_path, wide_console, monkeypatch):
    """A search that names no --time-limit walks to the end up to 2,048 GPUs and stops after 60 s past that
    (default_time_limit); the CLI uses that default (checked on a small cluster given a default of 0 s), and
    `--time-limit inf` walks to the end."""
    from hfplan.planner import search as search_module

    assert search_module.default_time_limit(make_cluster(2048)) is None
    assert search_module.default_time_limit(make_cluster(2056)) == search_module.DEFAULT_TIME_LIMIT_S == 60.0
    monkeypatch.setattr(search_module, "default_time_limit", lambda cluster: 0.0)
    args = ("search", "--gpus", 16, "--workload", "grpo-qwen2.5-1.5b", "--out", tmp_path / "best.json",
            "--no-compare", "--jobs", 1)
    cut = _invoke(*args)
    assert cut.exit_code == 0, (cut.output, cut.exception)
    assert "left open by --time-limit 0" in cut.stdout
    finished = _invoke(*args, "--time-limit", "inf")
    assert finished.exit_code == 0, (finished.output, finished.exception)
    assert "best (optimal):" in finished.stdout and "left open" not in finished.stdout
