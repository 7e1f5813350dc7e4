"""What a person reads: tables readable at 80 columns, the parallelism legend, other systems' rows with their
placement and why one does not fit, summary counts that agree with the CSV, thousands separators, the
simulate timeline without zero-second transfers, Gantt charts, the profiler's flags, and the README's word."""

from __future__ import annotations

import csv
import re
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.console import Console

from hfplan import cli
from hfplan.plan import Span, load_plan
from hfplan.planner.baselines import baselines, compare
from hfplan.profiler import command, report
from hfplan.profiler.fit import LinkFit, RooflineFit
from hfplan.simulator import gantt
from hfplan.simulator.engine import simulate_plan
from tests.support.cli import invoke
from tests.support.plans import sample_plan

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _console(monkeypatch, width: int) -> None:
    monkeypatch.setattr(cli, "console", Console(width=width))


def _flat(text: str) -> str:
    return " ".join(text.split())


# -- search tables ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def narrow_run(tmp_path_factory):
    """ppo-llama2-13b on 8 GPUs, with the comparison (two systems do not fit), at 80 columns."""
    folder = tmp_path_factory.mktemp("narrow")
    mp = pytest.MonkeyPatch()
    _console(mp, 80)
    try:
        result = invoke("search", "--gpus", 8, "--workload", "ppo-llama2-13b", "--out", folder / "best.json",
                        "--top", 3, "--jobs", 1)
    finally:
        mp.undo()
    assert result.exit_code == 0, result.output
    return result.stdout, load_plan(folder / "best.json")


def test_tables_fit_80_columns_without_cutting_names(narrow_run):
    text, plan = narrow_run
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text
    flat = _flat(text)
    for word in (*plan.workload.model_roles, "optimizer", "parallelism"):  # never cut: `actor+critic+r...`
        assert text.count(word[:-1]) == len(re.findall(rf"\b{word}\b", text)), word
    for name in (b.name for b in baselines(plan.workload)):
        assert name in text
    assert cli.PARALLELISM_LEGEND in flat


def test_other_systems_show_their_mapping_or_why_it_does_not_fit(narrow_run):
    text, plan = narrow_run
    rows = {}
    for line in text[text.index("other systems"):].splitlines():
        cells = [cell.strip() for cell in line.split("│")]
        if len(cells) == 5:
            if cells[0] in {b.name for b in baselines(plan.workload)}:
                rows[cells[0]] = [[c] if c else [] for c in cells]
            elif rows and not cells[-1]:
                for cell, more in zip(list(rows.values())[-1], cells, strict=True):
                    if more:
                        cell.append(more)
    results = compare(plan.workload, plan.cluster, jobs=1)
    assert set(rows) == {r.baseline.name for r in results}
    assert any(r.plan is None for r in results) and any(r.plan is not None for r in results)
    for item in results:
        first, layouts, iteration, _, speedup = rows[item.baseline.name]
        if item.plan is None:
            assert first == [item.baseline.name, "does not fit"]
            assert " ".join(layouts) == item.reason and "GiB" in item.reason  # why: memory per GPU
            assert speedup == ["-"]
            continue
        assert " ".join(first[1:]) == " ".join(" + ".join(s.models) + f" ({s.gpus} GPUs, {peak:.1f} GiB)"
                                           for s, peak in zip(item.plan.placement,
                                                              item.plan.estimate.peak_memory_gib, strict=True))
        assert all(role + ":" in " ".join(layouts) for role in item.plan.parallelism)
        assert iteration == [f"{item.iteration_s:.2f}"]
        assert speedup == [f"{item.iteration_s / plan.estimate.iteration_s:.2f}x"]


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big")
    mp = pytest.MonkeyPatch()
    _console(mp, 200)
    try:
        result = invoke("search", "--gpus", 256, "--workload", "ppo-qwen2.5-0.5b", "--out", folder / "best.json",
                        "--csv", folder / "all.csv", "--no-compare", "--jobs", 1)
    finally:
        mp.undo()
    assert result.exit_code == 0, result.output
    with (folder / "all.csv").open(newline="") as f:
        return result.stdout, list(csv.DictReader(f))


def test_summary_counts_agree_with_the_csv(big_run):
    text, rows = big_run
    summary = _flat(text[text.index("searched"):])
    found = re.search(r"([\d,]+) candidates, ([\d,]+) evaluated, ([\d,]+) pruned by bounds, ([\d,]+) infeasible",
                      summary)
    assert found, summary
    total, evaluated, pruned, infeasible = (int(g.replace(",", "")) for g in found.groups())
    counts = Counter(row["status"] for row in rows)
    assert (total, evaluated, pruned, infeasible) == (len(rows), counts["evaluated"], counts["pruned"],
                                                      counts["infeasible"])


def test_numbers_of_four_digits_or_more_have_thousands_separators(big_run):
    text, rows = big_run
    assert len(rows) >= 1000  # so the summary has such numbers
    summary = text[text.index("searched"):]
    assert f"{len(rows):,} candidates" in _flat(summary)
    for line in text.splitlines():
        words = re.sub(r"\d+\.\d+", "", line.replace(",", ""))  # decimals aside
        for number in re.findall(r"(?<![\w./-])\d{4,}(?![\w.])", words):
            assert f"{int(number):,}" in line, (number, line)


# -- simulate --------------------------------------------------------------------------------------


def _timeline_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"\b(compute|transfer|transition|dispatch)\b", line)]


def test_simulate_hides_zero_second_transfers_unless_all(plan_file, monkeypatch):
    _console(monkeypatch, 200)
    spans = simulate_plan(sample_plan()).estimate.timeline
    zero = [s for s in spans if s.kind in ("transfer", "dispatch") and s.end - s.start < cli.ZERO_S]
    assert zero and len(zero) < len(spans)
    shown = _timeline_rows(invoke("simulate", plan_file).stdout)
    everything = invoke("simulate", plan_file, "--all").stdout
    assert len(shown) == len(spans) - len(zero)
    assert len(_timeline_rows(everything)) == len(spans)
    assert f"{len(zero)} transfers and dispatches of under half a millisecond not shown (--all shows them)" in \
        invoke("simulate", plan_file).stdout
    assert "not shown" not in everything


def test_gantt_leaves_off_labels_that_do_not_fit_and_zero_length_bars():
    spans = [Span(role="actor", op="generate", phase="generation", set=0, start=0.0, end=90.0),
             Span(role="critic", op="values", phase="preparation", set=0, start=90.0, end=90.5),  # too narrow
             Span(role="controller", op="actor.generate->controller.gae", phase="preparation", set=-1, start=90.0,
                  end=90.0001, kind="transfer"),  # a zero-length transfer
             Span(role="actor", op="update", phase="training", set=0, start=90.5, end=100.0)]
    page = gantt.timeline_chart(Path("t.html"), spans, ["set 0: actor+critic (8 GPUs)"], "ppo on 8 x a100-80g")
    svg = page.decode()
    assert svg.count("<rect") == 3  # the transfer is not drawn
    assert "actor.generate-&gt;controller.gae" not in svg
    assert ">controller</text>" not in svg  # nothing visible on the controller's row: no row
    labels = re.findall(r'text-anchor="middle">([^<]+)</text>', svg)
    assert "actor.generate" in labels and "actor.update" in labels
    assert "critic.values" not in labels  # no room in its bar ...
    assert "critic.values [preparation, compute]" in svg  # ... but its tooltip is there
    png = gantt.timeline_chart(Path("t.png"), spans, ["set 0: actor+critic (8 GPUs)"], "title")
    assert png.startswith(b"\x89PNG")


def test_chart_titles_name_the_workload_and_hardware_not_paths(tmp_path, monkeypatch):
    profile = tmp_path / "profiles" / "my-site.yaml"
    profile.parent.mkdir()
    profile.write_text((ROOT / "hfplan/profiles/hardware/a100-80g.yaml").read_text())
    plan = sample_plan()
    plan = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"hardware": str(profile)})})
    title = cli.plan_title(plan)
    assert title == "ppo llama2-7b, 1,024 prompts x 1, 1,024+1,024 tokens, on 32 x a100-80g"
    assert str(tmp_path) not in title
    assert cli.display_name(str(tmp_path / "myqwen" / "config.json")) == "myqwen"
    assert cli.display_name(str(tmp_path / "wl.yaml")) == "wl"
    assert cli.display_name("ppo-qwen2.5-7b") == "ppo-qwen2.5-7b" and cli.display_name("qwen2.5-7b") == "qwen2.5-7b"
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    chart = tmp_path / "chart.html"
    assert invoke("simulate", path, "--timeline", chart, "--json").exit_code == 0
    assert f"<title>{title}</title>" in chart.read_text()


# -- profile report --------------------------------------------------------------------------------
def _profile_result(errors_pct: list[float], rms: float):
    """A profiling result as the report reads it: fits and layer rows with the given errors."""
    rows = pd.DataFrame({"kind": "layer", "op": ["decode"] * len(errors_pct), "dtype": "fp32", "batch": 1,
                         "seq": 0, "context": 64, "tp": 1, "tokens": 1, "seconds": 6.3e-4, "predicted_s": 1.5e-4,
                         "error_pct": errors_pct})
    fit = LinkFit(latency_s=1e-5, bytes_per_s=1e9, rms_rel_error=rms, points=8)
    fits = SimpleNamespace(roofline=RooflineFit(overhead_s=1e-6, flops_per_s=1e12, bytes_per_s=1e11,
                                                rms_rel_error=0.05, points=20),
                           intra=fit, host=None, per_collective={"all_reduce": fit})
    return SimpleNamespace(fits=fits, measurements=rows)


def test_profile_flags_errors_above_25_percent():
    # decode steps measured 0.63 ms, predicted 0.15 ms: -76%
    result = _profile_result([-76.0, -10.0], rms=0.30)
    note = report.flag_note(result)
    assert note is not None and note.startswith("! error above 25%")
    assert "decode predictions (1 of 2, worst 76%)" in note
    assert "intra-node link fit (rms 30%)" in note and "all_reduce alone fit (rms 30%)" in note
    assert "roofline" not in note
    assert report.flag_note(_profile_result([-25.0, 12.0], rms=0.1)) is None


# -- README, git, install hint ----------------------------------------------------------------------
def test_readme_explains_the_parallelism_notation():
    for term in ("t2p8d4", "mb1", "fsdp", "recompute", "gen t4p1d16"):
        assert term in README, term


def test_missing_torch_hint_matches_the_readme():
    install = re.search(r"pip install '[^']+'", command.INSTALL_HINT).group(0)
    assert install in README


def test_generated_charts_are_ignored_by_git():
    done = subprocess.run(["git", "check-ignore", "best.html", "best.png", "best.json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.stdout.split() == ["best.html", "best.png", "best.json"]
