"""Evaluation on held-out prompts, without a run: the options and the run configuration's keys refused or read
back before anything starts, when an evaluation is due, the dataflow's evaluation program on every algorithm (the
numpy backend), and how an evaluation's samples and timeline entries are marked."""

from __future__ import annotations

import json

import pytest

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.evaluation import evaluate, scoring_roles
from hfplan.dataflow.registry import algorithms, get_algorithm
from hfplan.errors import HfplanError
from hfplan.executor import preflight
from hfplan.executor.controller import ExecuteOptions, IterationReport, timeline_entry
from hfplan.executor.evaluation import due, eval_metrics
from hfplan.executor.run_config import RunConfig, resolve, write_config
from hfplan.executor.samples import Sample
from hfplan.plan import Span
from tests.support.cli import assert_user_error, invoke
from tests.support.executor_runs import cpu_plan, tiny_workload
from tests.support.numpy_backend import VOCAB, Backend, NumpyRole


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)]).to_json())
    return path


# -- options --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("content", "args", "needle"), [
    (None, ["--eval-every", "0"], "--eval-every"),
    (None, ["--eval-every", "2"], "--eval-every 2 needs --eval-data PATH"),
    (None, ["--eval-data", "{dir}/none.jsonl"], "--eval-data: dataset not found"),
    ("{not json\n", ["--eval-data", "{file}"], "--eval-data: dataset {file}: line 1 is not JSON"),
    ('{"question": "hi"}\n', ["--eval-data", "{file}", "--eval-every", "1"], "line 1 has no 'prompt' field"),
], ids=["every-0", "every-without-data", "missing-file", "not-json", "no-prompt-column"])
def test_bad_eval_options_are_one_line_before_anything_starts(plan_file, tmp_path, content, args, needle):
    file = tmp_path / "held-out.jsonl"
    if content is not None:
        file.write_text(content)
    args = [a.format(dir=tmp_path, file=file) for a in args]
    assert_user_error(invoke("execute", plan_file, "--out", tmp_path / "run", *args),
                      needle.format(file=file))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("text", "needle"), [
    ("eval_every: 0\n", "--config {config}: field eval_every"),
    ("eval_every: 2\n", "--eval-every 2 needs --eval-data"),
    ("eval_data: {dir}/none.jsonl\n", "--eval-data: dataset not found"),
])
def test_bad_eval_keys_of_a_config_file(plan_file, tmp_path, text, needle):
    config = tmp_path / "run.yaml"
    config.write_text(text.format(dir=tmp_path))
    assert_user_error(invoke("execute", plan_file, "--out", tmp_path / "run", "--config", config),
                      needle.format(config=config))
    assert not (tmp_path / "run").exists()


def test_the_library_refuses_what_the_command_line_cannot_give():
    with pytest.raises(HfplanError, match="^--eval-every must be at least 1, got 0$"):
        preflight.check_eval_options("held-out.jsonl", 0)
    preflight.check_eval_options("held-out.jsonl", None)  # after the last iteration only
    preflight.check_eval_options(None, None)


def test_eval_keys_are_written_and_read_back_on_resume(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    options = ExecuteOptions(iterations=3, out=out, eval_data="held-out.jsonl", eval_every=2)
    write_config(options.config(), out)
    assert json.loads((out / "run_config.json").read_text())["eval_data"] == "held-out.jsonl"
    resumed = resolve({"out": str(out), "iterations": 6}, None, "latest")
    assert (resumed.eval_data, resumed.eval_every, resumed.iterations) == ("held-out.jsonl", 2, 6)
    assert ExecuteOptions.from_config(resumed).eval_every == 2
    assert resolve({"out": str(out), "eval_every": 3}, None, "latest").eval_every == 3  # given again: it wins
    assert RunConfig().eval_data is None and RunConfig().eval_every is None


def test_long_held_out_prompts_follow_long_prompts(tmp_path):
    pytest.importorskip("tokenizers")  # the tiny model's codec
    plan = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)])  # prompt_len 8: 8 bytes
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text(json.dumps({"prompt": "a prompt far longer than eight bytes"}) + "\n")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "short"}) + "\n")
    options = ExecuteOptions(out=tmp_path / "run", data=str(data), eval_data=str(held_out), long_prompts="refuse")
    with pytest.raises(HfplanError, match="1 of 1 --eval-data prompts are longer than the workload's prompt_len"):
        preflight.check(plan, options)
    checked = preflight.check(plan, ExecuteOptions(out=tmp_path / "run", data=str(data), eval_data=str(held_out)))
    assert "--eval-data prompts" in checked.truncated and checked.eval_set.prompts == [
        "a prompt far longer than eight bytes"]


# -- when ------------------------------------------------------------------------------------------
def test_an_evaluation_follows_every_nth_iteration_and_the_last():
    assert [done for done in range(1, 8) if due(done, 3, 7)] == [3, 6, 7]
    assert [done for done in range(1, 5) if due(done, None, 4)] == [4]
    assert [done for done in range(1, 4) if due(done, 1, 3)] == [1, 2, 3]


def test_eval_metrics_name_each_score_as_the_training_metrics_do():
    import numpy as np

    fields = {"prompts": np.zeros((2, 3)), "responses": np.zeros((2, 4)),
              "response_mask": np.array([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=np.float32),
              "rewards": np.array([0.5, 1.0]), "costs": np.array([2.0, 0.0]), "novelty": np.array([1.0, 3.0])}
    assert eval_metrics(fields, 1.5) == {"eval/response_len": 3.0, "eval/reward": 0.75, "eval/cost": 1.0,
                                         "eval/novelty": 2.0, "eval_s": 1.5}


# -- the dataflow's program -------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", sorted(algorithms()))
def test_the_evaluation_generates_greedily_and_scores_with_every_scoring_role(algorithm):
    spec = get_algorithm(algorithm)
    models = {r: "rule:vowel-fraction" if f.may_be_rule else "tiny" for r, f in spec.roles.items()}
    workload = tiny_workload(algorithm, models)
    backend = Backend(workload)
    roles = {name: NumpyRole(name, facts, backend) for name, facts in spec.roles.items()}
    prompts = Batch(prompts=backend.rng.integers(0, VOCAB, size=(3, workload.prompt_len)))
    out = Batch(evaluate(roles, prompts, spec)).resolve()
    scorers = scoring_roles(spec)
    assert scorers == [r for r in ("reward", "cost") if r in spec.roles]
    assert [c.label for c in backend.calls] == ["actor.generate(greedy)"] + [f"{r}.score" for r in scorers]
    assert all(c.sequences == 3 for c in backend.calls)  # one greedy answer per prompt, nothing updated
    assert set(out) == {"prompts", "responses", "response_mask"} | {spec.roles[r].output for r in scorers}


# -- marks ------------------------------------------------------------------------------------------
def test_eval_samples_and_spans_are_marked_apart():
    assert Sample(0, 1, "p", "r", 0.5).as_json() == {"iteration": 0, "row": 1, "prompt": "p", "response": "r",
                                                      "reward": 0.5}
    assert Sample(0, 1, "p", "r", 0.5, eval=True).as_json()["eval"] is True
    span = Span(role="actor", op="generate", phase="generation", set=0, start=0.0, end=1.0)
    assert timeline_entry(IterationReport(2, {}, [span])) == {"iteration": 2, "spans": [span.model_dump()]}
    entry = timeline_entry(IterationReport(2, {}, [span], eval_spans=[span]))
    assert entry["spans"] == entry["eval_spans"] == [span.model_dump()]
