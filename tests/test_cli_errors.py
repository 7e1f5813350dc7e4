"""Every usage error of every command (typer's own included) is one line and exit code 2; output paths that
cannot be written are refused before any work and leave nothing behind; Ctrl-C exits 130 cleanly; --version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import hfplan
from tests.support.cli import assert_user_error, invoke

HFPLAN = Path(sys.executable).with_name("hfplan")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("args", "needles"), [
    (["search", "--gpus", "abc"], ["search", "--gpus", "valid integer"]),
    (["search", "--gpus", 8, "--top", 0], ["--top", "greater than or equal to 1"]),
    (["search", "--gpus", 8, "--jobs", 0], ["--jobs", "greater than or equal to 1"]),
    (["search"], ["Missing option", "--gpus"]),
    (["search", "--gpus", 8, "--no-such-flag"], ["--no-such-flag"]),
    (["simulate"], ["Missing argument", "PLAN"]),
    (["simulate", "a.json", "b.json"], ["b.json"]),
    (["profile", "--world-size", "two"], ["--world-size"]),
    (["no-such-command"], ["No such command", "no-such-command"]),
], ids=["not-an-int", "top-0", "jobs-0", "missing-option", "unknown-option", "missing-argument", "extra-argument",
        "profile-not-an-int", "unknown-command"])
def test_usage_errors_are_one_line_and_exit_2(args, needles):
    line = assert_user_error(invoke(*args), *needles)
    assert "--help" in line  # and says where the usage is


def test_real_script_usage_error_is_one_line():
    done = subprocess.run([str(HFPLAN), "search", "--gpus", "abc"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("error: hfplan search: Invalid value for '--gpus'")


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"hfplan {hfplan.__version__}\n"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == hfplan.__version__


def test_gpus_per_node_above_gpus_is_refused(tmp_path):
    out = tmp_path / "best.json"
    assert_user_error(invoke("search", "--gpus", 4, "--gpus-per-node", 8, "--out", out), "--gpus-per-node 8",
                      "--gpus 4")
    assert not out.exists()


# -- output paths ---------------------------------------------------------------------------------
def _search(*args):
    return invoke("search", "--gpus", 8, "--workload", "ppo-qwen2.5-0.5b", "--no-compare", "--jobs", 1, *args)


def test_search_out_is_a_folder(tmp_path):
    assert_user_error(_search("--out", tmp_path), "--out", "folder")
    assert list(tmp_path.iterdir()) == []


def test_search_csv_is_a_folder_and_no_plan_is_left_behind(tmp_path):
    out = tmp_path / "best.json"
    folder = tmp_path / "csvs"
    folder.mkdir()
    assert_user_error(_search("--out", out, "--csv", folder), "--csv", "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csvs"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")
def test_search_csv_in_proc(tmp_path):
    out = tmp_path / "best.json"
    assert_user_error(_search("--out", out, "--csv", "/proc/self/all.csv"), "--csv /proc/self/all.csv")
    assert not out.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_search_out_to_a_device_leaves_it_a_device():
    assert_user_error(_search("--out", "/dev/full"), "not a regular file")
    assert Path("/dev/full").is_char_device()


def test_two_outputs_naming_one_file_are_refused_before_any_work(tmp_path):
    out = tmp_path / "best.json"
    assert_user_error(_search("--out", out, "--csv", tmp_path / "." / "best.json"),
                      "--out and --csv name the same file")
    assert not out.exists()
    chart = tmp_path / "chart.html"
    assert_user_error(invoke("simulate", tmp_path / "no-plan.json", "--timeline", chart, "--out", chart),
                      "--timeline and --out name the same file")


def test_search_through_a_symlink_writes_its_target(tmp_path):
    target = tmp_path / "plans" / "mine.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "best.json"
    link.symlink_to(target)
    result = _search("--out", link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert target.read_text().startswith("{")


def test_simulate_outputs_that_cannot_be_written(tmp_path):
    plan = tmp_path / "plan.json"
    assert _search("--out", plan).exit_code == 0
    assert_user_error(invoke("simulate", plan, "--out", tmp_path), "--out", "folder")
    folder = tmp_path / "chart.png"
    folder.mkdir()
    assert_user_error(invoke("simulate", plan, "--timeline", folder), "--timeline", "folder")
    # a good timeline with a bad --out: neither is written
    chart = tmp_path / "good.html"
    assert_user_error(invoke("simulate", plan, "--timeline", chart, "--out", tmp_path / "no" / "p.json"),
                      "does not exist")
    assert not chart.exists()


# -- Ctrl-C -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_during_the_strategy_pool_exits_130_without_worker_tracebacks(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C does, while the worker pool costs strategies."""
    process = subprocess.Popen([str(HFPLAN), "search", "--gpus", "1024", "--workload", "safe-rlhf-llama2-70b",
                                "--jobs", "2", "--out", str(tmp_path / "best.json")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=_default_ctrl_c)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(_children(process.pid)) < 2:
            time.sleep(0.1)
        assert len(_children(process.pid)) >= 2, "the worker pool never started"
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 130, stderr
    assert stdout == ""
    assert [line for line in stderr.splitlines() if line.strip()] == ["error: interrupted"]
    assert not (tmp_path / "best.json").exists()


def _default_ctrl_c() -> None:
    """A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored across exec (Python
    then installs no handler): give the command the disposition a terminal's foreground job has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> list[str]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("command", ["execute", "export-model"])
@pytest.mark.parametrize("missing", ["torch", "ray", "transformers"])
def test_the_executor_commands_without_the_execute_extra_say_how_to_install_it(command, missing, plan_file,
                                                                              monkeypatch):
    """A core-only install: Python's own way of marking a module absent (None in sys.modules)."""
    monkeypatch.setitem(sys.modules, missing, None)
    assert_user_error(invoke(command, plan_file), f"hfplan {command} needs the execute extra", missing,
                      "pip install '.[execute]'")


def test_cost_of_a_tp_that_splits_no_kv_heads_is_refused():
    """qwen2.5-7b: 28 heads, 4 KV heads; tp 14 divides the heads but neither divides nor is a multiple of 4."""
    result = invoke("cost", "forward", "--model", "qwen2.5-7b", "--hardware", "a100-80g", "--tp", 14, "--batch", 8)
    assert_user_error(result, "--tp 14 on qwen2.5-7b", "4 KV heads")
