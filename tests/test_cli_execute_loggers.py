"""`hfplan execute --logger ... --samples K --config FILE` end to end: every file of the run folder, the samples'
scores against the reward itself, the progress lines; and the refusals that come before anything starts."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil

import pytest

from hfplan.dataflow.rewards import load_reward
from tests.support.cli import assert_user_error, invoke

pytest.importorskip("torch", reason="hfplan execute needs the execute extra")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_its_package_is_refused_before_anything_starts(demo_plan_file, tmp_path):
    assert_user_error(invoke("execute", demo_plan_file, "--out", tmp_path / "run", "--logger", "jsonl,wandb"),
                      "--logger wandb needs the wandb package", "pip install '.[wandb]'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("text", "needle"), [
    ("iterations: 2\nsampels: 2\n", "unknown option 'sampels'"),
    ("set: {actor_lr: fast}\n", "actor_lr"),
    ("loggers: [jsonl, mlflow]\n", "mlflow: unknown logger"),
    ("iterations: [2\n", "not valid YAML"),
])
def test_a_bad_config_file_is_one_line_before_anything_starts(demo_plan_file, tmp_path, text, needle):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert_user_error(invoke("execute", demo_plan_file, "--out", tmp_path / "run", "--config", config),
                      f"--config {config}", needle)
    assert not (tmp_path / "run").exists()


def test_a_bad_logger_name_on_the_command_line(demo_plan_file, tmp_path):
    assert_user_error(invoke("execute", demo_plan_file, "--out", tmp_path / "run", "--logger", "csv,mlflow"),
                      "--logger mlflow: unknown logger")


@pytest.mark.slow
def test_loggers_samples_and_config_in_one_run(demo_cli_run, tmp_path, ray_driver):
    """conftest's demo_cli_run (test_cli_execute's learning claim reads it too): the file gives the length, the
    progress interval, a learning rate and 3 samples; the command line gives the loggers and 2 samples, which win.
    The demo's reward is a rule: each sample's reward is the rule's score of its own text. Then, in a copy of the
    run, `--resume --iterations 5` alone continues with the run's own options: every file goes on."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hfplan.executor.prompts import builtin_prompts

    result, done = demo_cli_run.result, demo_cli_run.out
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    shutil.copytree(done, run)

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    with (run / "metrics.csv").open(newline="") as stream:
        table = list(csv.DictReader(stream))
    assert list(table[0]) == list(metrics[0])  # same names, same order
    assert [float(r["reward"]) for r in table] == [m["reward"] for m in metrics]
    accumulator = EventAccumulator(str(run / "tensorboard"))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == set(metrics[0]) - {"iteration"}
    assert [(e.step, e.value) for e in accumulator.Scalars("reward")] == \
        [(m["iteration"], pytest.approx(m["reward"], rel=1e-6)) for m in metrics]

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(s["iteration"], s["row"]) for s in samples] == [(i, row) for i in range(4) for row in (0, 1)]
    prompts = set(builtin_prompts("tiny"))
    rule = load_reward("rule:vowel-fraction")
    for sample in samples:
        assert sample["prompt"] in prompts
        assert sample["reward"] == pytest.approx(rule.fn([sample["prompt"]], [sample["response"]], {})[0])
    shown = [line for line in result.stderr.splitlines() if line.startswith("  sample: ")]
    assert len(shown) == 4  # each iteration's progress line (log_every 1) shows its first sample
    for line, first in zip(shown, samples[::2], strict=True):
        assert json.dumps(first["prompt"], ensure_ascii=False) in line

    resolved = json.loads((run / "run_config.json").read_text())
    assert resolved == {"iterations": 4, "data": None, "seed": 0, "out": str(done), "checkpoint_every": 1,
                        "keep": 4, "log_every": 1, "loggers": ["jsonl", "csv", "tensorboard"], "samples": 2,
                        "long_prompts": "truncate", "eval_data": None, "eval_every": None, "set": {"actor_lr": 1e-2}}

    result = invoke("execute", demo_cli_run.plan_file, "--out", run, "--resume", "--iterations", 5, "--address",
                    ray_driver)
    assert result.exit_code == 0, result.output
    assert json.loads((run / "run_config.json").read_text()) == resolved | {"iterations": 5, "out": str(run)}
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [
        0, 1, 2, 3, 4]
    with (run / "metrics.csv").open(newline="") as stream:
        assert [r["iteration"] for r in csv.DictReader(stream)] == ["0", "1", "2", "3", "4"]
    accumulator = EventAccumulator(str(run / "tensorboard"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("reward")] == [0, 1, 2, 3, 4]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(s["iteration"], s["row"]) for s in samples] == [(i, row) for i in range(5) for row in (0, 1)]
    assert len([line for line in result.stderr.splitlines() if line.startswith("  sample: ")]) == 1


@pytest.mark.slow
def test_a_reward_models_samples_are_decoded_with_the_runs_tokenizer(shared_runs):
    """GRPO with a reward *model* (test_execute's, on a set of its own): the controller has only token ids, and
    decodes the samples' rows itself. K above the iteration's 8 sequences gives all of them: their rewards average
    to the metrics' reward, and each prompt's 4 samples come together."""
    from hfplan.executor.prompts import builtin_prompts
    from tests.support.executor_runs import REWARD_MODEL_RUN, reward_model_plan

    summary = shared_runs.get(reward_model_plan(), **REWARD_MODEL_RUN)
    run = summary.out
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["row"] for s in samples] == list(range(8))
    assert len({s["prompt"] for s in samples[:4]}) == len({s["prompt"] for s in samples[4:]}) == 1
    # prompt_len is 8 bytes here: each prompt is what the model read, a built-in prompt's last 8
    assert {s["prompt"] for s in samples} <= {prompt[-8:] for prompt in builtin_prompts("tiny")}
    assert sum(s["reward"] for s in samples) / 8 == pytest.approx(summary.iterations[0]["reward"], rel=1e-5)
    assert not (run / "metrics.jsonl").exists()  # only the loggers asked for
    with (run / "metrics.csv").open(newline="") as stream:
        assert float(next(csv.DictReader(stream))["reward"]) == summary.iterations[0]["reward"]
