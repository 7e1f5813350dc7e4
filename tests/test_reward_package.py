"""The example reward package (examples/hfplan-reward-example), pip-installed into a folder of its own that the
`hfplan` processes get on PYTHONPATH: its entry point is listed and found, and a real GRPO run scores with it,
each sampled response against its own prompt's `answer` column. The reward runs in the controller (the
`hfplan execute` process) only, so the Ray workers never need the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hfplan
from tests.support.executor_runs import cpu_plan, tiny_workload

ROOT = Path(hfplan.__file__).parent.parent
EXAMPLE = ROOT / "examples" / "hfplan-reward-example"

# A user's own reward function (the `module:function` form) that records what it was called with, then scores
# with the installed package's entry point, loaded by name as a run loads it.
AUDIT = '''
import json, os
from hfplan.dataflow.rewards import load_reward

EXACT = load_reward("rule:answer-exact")


def score(prompts, responses, columns):
    scores = EXACT.fn(prompts, responses, columns)
    with open(os.environ["REWARD_AUDIT_LOG"], "a") as log:
        log.write(json.dumps({"prompts": prompts, "responses": responses, "columns": columns,
                              "scores": list(scores)}) + "\\n")
    return scores
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example installed by pip (offline, with this environment's setuptools) into a folder of its own; pip
    builds in the source tree, so it builds a copy."""
    work = tmp_path_factory.mktemp("reward-package")
    source = work / "source"
    shutil.copytree(EXAMPLE, source)
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
                    "--no-index", "--target", str(target), str(source)], check=True, timeout=120)
    return target


def hfplan_cli(paths: list[Path], *args, timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([*map(str, paths), str(ROOT)]), "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", "from hfplan.cli import app; app()", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def answer_of(prompt: str) -> int:
    op, a, b, _ = prompt.split()
    return int(a) + int(b) if op == "add" else int(a) - int(b)


@pytest.mark.slow
def test_the_catalog_lists_the_installed_rule(site):
    done = hfplan_cli([site], "catalog")
    assert done.returncode == 0, done.stderr
    assert "rule:answer-exact" in done.stdout


@pytest.mark.slow
def test_a_run_scores_each_sample_against_its_prompts_answer_column(site, tmp_path, ray_cluster):
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "reward_audit.py").write_text(textwrap.dedent(AUDIT))
    prompts = ["add 3 4 =", "sub 9 2 =", "add 12 5 =", "sub 30 1 =", "add 1 1 =", "sub 7 7 ="]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": answer_of(p), "source": "test"}) + "\n"
                            for p in prompts))
    workload = tiny_workload("grpo", {"actor": "tiny-arith", "reference": "tiny-arith",
                                      "reward": "reward_audit:score"})
    plan = tmp_path / "plan.json"
    plan.write_text(cpu_plan(workload, [(("actor", "reference"), 1)]).to_json())
    log = tmp_path / "audit.jsonl"
    os.environ["REWARD_AUDIT_LOG"] = str(log)  # the subprocess inherits it
    try:
        done = hfplan_cli([audit, site], "execute", plan, "--data", data, "--out", tmp_path / "run", "--iterations",
                          2, "--address", ray_cluster)
    finally:
        del os.environ["REWARD_AUDIT_LOG"]
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(calls) == len(metrics) == 2
    n = workload.samples_per_prompt
    for call, iteration in zip(calls, metrics, strict=True):
        rows = call["prompts"]
        assert len(rows) == workload.batch_prompts * n
        assert all(rows[i] == rows[i - i % n] for i in range(len(rows)))  # a prompt's samples are consecutive
        assert call["columns"] == {"answer": [answer_of(p) for p in rows], "source": ["test"] * len(rows)}
        expected = [1.0 if r.split()[:1] == [str(answer_of(p))] else 0.0 for p, r in zip(rows, call["responses"],
                                                                                          strict=True)]
        assert call["scores"] == expected
        assert iteration["reward"] == pytest.approx(sum(expected) / len(expected))


@pytest.mark.slow
def test_a_reward_that_raises_fails_the_run_naming_it(site, tmp_path, ray_cluster):
    data = tmp_path / "prompts.jsonl"  # no `answer` column: the example's function raises
    data.write_text("".join(json.dumps({"prompt": p, "source": "test"}) + "\n" for p in ["add 3 4 =", "sub 9 2 ="]))
    workload = tiny_workload("grpo", {"actor": "tiny-arith", "reference": "tiny-arith",
                                      "reward": "hfplan_reward_example:answer_close"})
    plan = tmp_path / "plan.json"
    plan.write_text(cpu_plan(workload, [(("actor", "reference"), 1)]).to_json())
    done = hfplan_cli([site], "execute", plan, "--data", data, "--out", tmp_path / "run", "--iterations", 1,
                      "--address", ray_cluster)
    assert done.returncode == 1, done.stderr
    assert ("run failed: role reward: reward hfplan_reward_example:answer_close raised on a batch of 8 rows: "
            "ValueError: the prompts file needs an 'answer' column (it has: source)") in done.stderr
    assert "Traceback" not in done.stderr
