"""User algorithms from the `hfplan.algorithms` entry-point group: a package installed on the path is
found by a fresh process, which searches and simulates its algorithm with no other change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hfplan

PLUGIN = '''
"""A user's algorithm: GRPO-like, with roles of its own names and no reference model."""
from hfplan.dataflow.registry import Algorithm
from hfplan.dataflow.roles import ACTOR, REWARD

SEQ = ("prompts", "responses", "response_mask")


def program(roles, prompts, ctl):
    batch = roles["policy"].generate(prompts, n=ctl.samples_per_prompt)
    batch = batch | roles["judge"].score(batch.select(*SEQ))
    batch = batch | roles["policy"].log_prob(batch.select(*SEQ))
    batch = batch | ctl.step("group_norm", batch)
    return roles["policy"].update(batch.select(*SEQ, "old_log_probs", "advantages"))


ALGORITHM = Algorithm("judged-grpo", program, {"policy": ACTOR, "judge": REWARD}, min_samples_per_prompt=2)
'''


def _install(site: Path) -> None:
    """What `pip install` leaves behind: the module and its dist-info with the entry point."""
    (site / "judged_grpo.py").write_text(PLUGIN)
    info = site / "judged_grpo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: judged-grpo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hfplan.algorithms]\njudged-grpo = judged_grpo:ALGORITHM\n")


def _hfplan(site: Path, *args: str) -> subprocess.CompletedProcess:
    root = Path(hfplan.__file__).parent.parent
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(root)])}
    return subprocess.run([sys.executable, "-c", "from hfplan.cli import app; app()", *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.slow
def test_an_installed_algorithm_is_searched_and_simulated(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    workload = tmp_path / "judged.yaml"
    workload.write_text(textwrap.dedent("""\
        algorithm: judged-grpo
        models: {policy: qwen2.5-0.5b, judge: "rule:vowel-fraction"}
        prompt_len: 128
        response_len: 128
        batch_prompts: 16
        samples_per_prompt: 4
        mini_batches: 2
        """))
    best = tmp_path / "best.json"
    found = _hfplan(site, "search", "--gpus", "4", "--workload", str(workload), "--out", str(best), "--jobs", "1",
                    "--no-compare")
    assert found.returncode == 0, found.stderr
    plan = json.loads(best.read_text())
    assert [s["models"] for s in plan["placement"]] == [["policy"]]
    assert sorted(s["role"] + "." + s["op"] for s in plan["estimate"]["timeline"] if s["kind"] == "compute") == [
        "controller.group_norm", "judge.score", "policy.generate", "policy.log_prob", "policy.update"]
    simulated = _hfplan(site, "simulate", str(best), "--json")
    assert simulated.returncode == 0, simulated.stderr
    assert json.loads(simulated.stdout)["iteration_s"] == pytest.approx(plan["estimate"]["iteration_s"], rel=1e-12)


@pytest.mark.slow
def test_a_broken_entry_point_names_itself(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    (site / "judged_grpo.py").write_text("ALGORITHM = 42\n")
    workload = tmp_path / "judged.yaml"
    workload.write_text('algorithm: judged-grpo\nmodels: {policy: tiny, judge: "rule:vowel-fraction"}\n')
    done = _hfplan(site, "search", "--gpus", "1", "--workload", str(workload), "--no-compare")
    assert done.returncode == 2
    assert "entry point 'judged-grpo' of hfplan.algorithms" in done.stderr and "not an" in done.stderr


@pytest.mark.parametrize("module", ["hfplan", "hfplan.cli"])
def test_python_dash_m_runs_the_command_line(module):
    done = subprocess.run([sys.executable, "-m", module, "catalog"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tiny-arith" in done.stdout
