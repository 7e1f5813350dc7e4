"""`hfplan simulate` and `hfplan catalog` through typer's CliRunner (and once through the real script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hfplan import cli
from hfplan.plan import Estimate, GenConfig, InferConfig, RoleParallelism, TrainConfig, load_plan
from hfplan.profiles.hardware import shipped_names
from hfplan.profiles.models import CATALOG
from hfplan.simulator.engine import simulate_plan
from hfplan.spec import ALGORITHM_ROLES, BUILTIN_WORKLOADS, load_workload, make_cluster
from tests.support.cli import assert_user_error as _assert_user_error
from tests.support.cli import invoke as _invoke
from tests.support.plans import build_plan, sample_plan

HFPLAN = Path(sys.executable).with_name("hfplan")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def wide_console(monkeypatch):
    """Render rich output 200 columns wide, whatever the environment says, so cells are not cropped."""
    monkeypatch.setattr(cli, "console", Console(width=200))




# -- happy paths ----------------------------------------------------------------------------------
def test_simulate_prints_tables_and_iteration_time(plan_file, wide_console):
    result = _invoke("simulate", plan_file)
    assert result.exit_code == 0, result.output
    expected = simulate_plan(sample_plan()).estimate
    out = result.stdout
    for title in ("timeline (one iteration)", "stages", "peak memory per GPU"):
        assert title in out
    for call in ("generate", "log_prob", "values", "score", "update", "reshard", "gae"):
        assert call in out
    assert "set 0: actor+critic (16 GPUs)" in out
    assert "set 2: reward (8 GPUs)" in out
    assert f"iteration: {expected.iteration_s:.2f} s" in out
    assert f"{expected.tokens_per_s:,.0f} tokens/s" in out
    assert f"({expected.tokens_per_s / 32:,.0f} per GPU)" in out
    for phase, seconds in expected.stages.items():
        assert any(phase in line and f"{seconds:.2f}" in line for line in out.splitlines()), phase


def test_simulate_json_prints_the_estimate(plan_file):
    result = _invoke("simulate", plan_file, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing but JSON on stdout
    estimate = Estimate.model_validate(data)
    expected = simulate_plan(sample_plan()).estimate
    assert estimate.iteration_s == pytest.approx(expected.iteration_s, rel=1e-12)
    assert estimate.stages == pytest.approx(expected.stages)
    assert estimate.peak_memory_gib == expected.peak_memory_gib
    assert len(estimate.timeline) == len(expected.timeline)
    assert {"iteration_s", "tokens_per_s", "stages", "peak_memory_gib", "timeline"} <= set(data)


def test_simulate_writes_a_png_timeline(plan_file, tmp_path):
    chart = tmp_path / "chart.png"
    result = _invoke("simulate", plan_file, "--timeline", chart, "--json")
    assert result.exit_code == 0, result.output
    data = chart.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_simulate_writes_an_html_timeline(plan_file, tmp_path, wide_console):
    chart = tmp_path / "chart.HTML"
    result = _invoke("simulate", plan_file, "--timeline", chart)
    assert result.exit_code == 0, result.output
    text = chart.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "<svg" in text and "</svg>" in text
    # One bar per drawn span, with its tooltip naming the call.
    assert "actor.generate [generation, compute]" in text
    assert "set 1: reference (8 GPUs)" in text
    assert f"timeline written to {chart}" in result.stdout


def test_simulate_refuses_other_timeline_suffixes_before_any_work(tmp_path):
    chart = tmp_path / "chart.txt"
    # The plan does not even exist: the timeline name must be refused first.
    result = _invoke("simulate", tmp_path / "missing.json", "--timeline", chart)
    _assert_user_error(result, "--timeline", ".png or .html")
    assert not chart.exists()


def test_simulate_refuses_a_timeline_in_a_missing_folder(plan_file, tmp_path):
    result = _invoke("simulate", plan_file, "--timeline", tmp_path / "nowhere" / "chart.png")
    _assert_user_error(result, "does not exist")


def test_simulate_out_writes_the_plan_with_its_estimate(plan_file, tmp_path):
    out = tmp_path / "with-estimate.json"
    result = _invoke("simulate", plan_file, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    written = load_plan(out)
    original = load_plan(plan_file)
    assert original.estimate is None
    assert written.estimate is not None
    assert written.model_copy(update={"estimate": None}) == original
    assert written.estimate.iteration_s == pytest.approx(json.loads(result.stdout)["iteration_s"], rel=1e-12)
    # Simulating the written plan again gives the same estimate.
    again = _invoke("simulate", out, "--json")
    assert json.loads(again.stdout) == json.loads(result.stdout)


def test_simulate_out_to_a_missing_folder(plan_file, tmp_path):
    _assert_user_error(_invoke("simulate", plan_file, "--out", tmp_path / "nowhere" / "p.json"), "does not exist")


# -- bad inputs -----------------------------------------------------------------------------------
def _write(tmp_path, data) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _plan_dict() -> dict:
    return json.loads(sample_plan().to_json())


def test_missing_plan_file(tmp_path):
    _assert_user_error(_invoke("simulate", tmp_path / "nope.json"), "not found", "nope.json")


def test_malformed_json(tmp_path):
    _assert_user_error(_invoke("simulate", _write(tmp_path, '{"version": 1,')), "not valid JSON")


def test_not_an_object(tmp_path):
    _assert_user_error(_invoke("simulate", _write(tmp_path, [1, 2])), "JSON object")


def test_wrong_version(tmp_path):
    data = _plan_dict() | {"version": 7}
    _assert_user_error(_invoke("simulate", _write(tmp_path, data)), "version 7")


def test_unknown_hardware(tmp_path):
    data = _plan_dict()
    data["cluster"]["hardware"] = "tpu-v9"
    line = _assert_user_error(_invoke("simulate", _write(tmp_path, data)), "unknown hardware", "tpu-v9")
    assert "a100-80g" in line  # names the known ones


def test_unknown_model_in_the_workload(tmp_path):
    data = _plan_dict()
    data["workload"]["models"]["critic"] = "gpt-17b"
    _assert_user_error(_invoke("simulate", _write(tmp_path, data)), "unknown model", "gpt-17b")


def test_invalid_placement(tmp_path):
    data = _plan_dict()
    data["placement"] = data["placement"][:2]  # the reward model is no longer placed
    _assert_user_error(_invoke("simulate", _write(tmp_path, data)), "reward")


def test_plan_that_does_not_fit(tmp_path):
    plan = build_plan(load_workload("ppo-llama2-7b"), [(["actor", "reference", "reward"], 16), (["critic"], 1)],
                      cluster=make_cluster(32))
    path = tmp_path / "big.json"
    path.write_text(plan.to_json())
    _assert_user_error(_invoke("simulate", path), "does not fit", "set 1 (critic)")


def test_a_tp_that_splits_no_kv_heads_is_refused(tmp_path):
    """qwen2.5-1.5b: 12 heads, 2 KV heads; tp 3 divides the heads but neither divides nor is a multiple of 2."""
    workload = load_workload("ppo-llama2-7b").model_copy(update={"models": {
        "actor": "qwen2.5-1.5b", "critic": "qwen2.5-1.5b", "reference": "qwen2.5-1.5b", "reward": "qwen2.5-1.5b"}})
    plan = build_plan(workload, [(["actor", "critic", "reward"], 4), (["reference"], 3)], cluster=make_cluster(8),
                      overrides={"reference": RoleParallelism(infer=InferConfig(tp=3, dp=1))})
    path = tmp_path / "kv.json"
    path.write_text(plan.to_json())
    _assert_user_error(_invoke("simulate", path), "reference infer layout", "tp=3", "2 KV heads")


def test_generation_layout_that_does_not_nest(tmp_path):
    actor = RoleParallelism(train=TrainConfig(tp=4, dp=3), infer=InferConfig(tp=4, dp=3), gen=GenConfig(tp=4, dp=3))
    plan = build_plan(load_workload("ppo-llama2-7b"), [(["actor", "critic", "reference", "reward"], 12)],
                      cluster=make_cluster(16), overrides={"actor": actor})
    data = json.loads(plan.to_json())
    data["parallelism"]["actor"]["gen"] = {"tp": 3, "pp": 1, "dp": 4}  # 3 does not nest with training's 4
    path = tmp_path / "nest.json"
    path.write_text(json.dumps(data))
    _assert_user_error(_invoke("simulate", path), "tp=3")


def test_real_script_reports_one_line_without_traceback(tmp_path):
    assert HFPLAN.exists()
    data = _plan_dict() | {"version": 3}
    done = subprocess.run([str(HFPLAN), "simulate", str(_write(tmp_path, data))], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert "unsupported version 3" in done.stderr
    assert "Traceback" not in done.stderr


# -- catalog --------------------------------------------------------------------------------------
def _catalog_names() -> list[str]:
    return [*CATALOG, *shipped_names(), *ALGORITHM_ROLES, "rule:vowel-fraction", "rule:distinct-chars",
            *BUILTIN_WORKLOADS]


def test_catalog_lists_the_names(wide_console):
    result = _invoke("catalog")
    assert result.exit_code == 0, result.output
    words = set(result.stdout.replace(",", " ").replace("(", " ").replace(")", " ").split())
    missing = [name for name in _catalog_names() if name not in words]
    assert missing == []
    assert f"workloads ({len(BUILTIN_WORKLOADS)}; default ppo-llama2-7b)" in result.stdout


def test_catalog_lists_full_model_names_at_80_columns(monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=80))
    result = _invoke("catalog")
    assert result.exit_code == 0
    words = set(result.stdout.replace(",", " ").split())
    assert [name for name in CATALOG if name not in words] == []
