"""`hfplan execute --config`: the file's options, the command line over them, a resumed run's own configuration
under both, and one line for every bad file."""

from __future__ import annotations

import json

import pytest

from hfplan.errors import HfplanError
from hfplan.executor.controller import ExecuteOptions
from hfplan.executor.run_config import RUN_CONFIG_FILE, RunConfig, parse_assignments, read_config, resolve, write_config


def test_a_yaml_file_gives_options_and_the_command_line_overrides_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("iterations: 3\nseed: 7\nloggers: jsonl,csv\nsamples: 2\nset: {actor_lr: 1e-4, kl_estimator: k2}\n")
    config = resolve({"seed": 1, "set": {"actor_lr": 2e-4}}, path)
    assert config.iterations == 3 and config.samples == 2 and config.loggers == ("jsonl", "csv")
    assert config.seed == 1  # given on the command line
    assert config.set == {"actor_lr": 2e-4, "kl_estimator": "k2"}  # merged key by key; YAML's "1e-4" typed
    assert config.keep == RunConfig().keep  # neither gave it: the default


def test_a_json_file_reads_the_same(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"iterations": 2, "loggers": ["csv"], "checkpoint_every": 1}))
    assert read_config(path) == {"iterations": 2, "loggers": ("csv",), "checkpoint_every": 1}


@pytest.mark.parametrize(("text", "needle"), [
    ("iteratons: 3\n", "unknown option 'iteratons'; known: iterations"),
    ("iterations: ten\n", "field iterations: Input should be a valid integer, got 'ten'"),
    ("iterations: 0\n", "field iterations"),
    ("samples: 2.5\n", "field samples"),
    ("loggers: [jsonl, mlflow]\n", "mlflow: unknown logger"),
    ("set: {nope: 1}\n", "field set: nope: unknown hyperparameter"),
    ("set: {actor_lr: fast}\n", "field set: actor_lr"),
    ("long_prompts: cut\n", "field long_prompts"),
    ("- iterations: 3\n", "expected a mapping at the top level"),
    ("iterations: [3\n", "not valid YAML"),
    ("", "expected a mapping"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, needle):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(HfplanError) as raised:
        resolve({}, path)
    message = str(raised.value)
    assert message.startswith(f"--config {path}: ") and needle in message, message
    assert "\n" not in message


def test_a_missing_file_and_malformed_json(tmp_path):
    with pytest.raises(HfplanError, match="file not found"):
        resolve({}, tmp_path / "none.yaml")
    (tmp_path / "run.json").write_text("{'iterations': 3}")
    with pytest.raises(HfplanError, match="not valid JSON"):
        resolve({}, tmp_path / "run.json")


def test_a_bad_command_line_value_names_the_option():
    with pytest.raises(HfplanError, match="^--long-prompts: Input should be 'truncate' or 'refuse'"):
        resolve({"long_prompts": "cut"})
    with pytest.raises(HfplanError, match="^--set nope: unknown hyperparameter"):
        parse_assignments(["nope=1"])
    assert parse_assignments(["actor_lr=1e-3", "actor_lr=2e-3"]) == {"actor_lr": 2e-3}


def test_a_resume_keeps_the_runs_own_options_unless_given_again(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    write_config(RunConfig(iterations=4, seed=5, out="somewhere-else", samples=3, loggers=("csv",),
                           set={"actor_lr": 1e-3, "gamma": 0.9}), out)
    config = resolve({"out": str(out), "iterations": 8, "set": {"gamma": 0.5}}, None, "latest")
    assert (config.iterations, config.seed, config.samples, config.loggers) == (8, 5, 3, ("csv",))
    assert config.set == {"actor_lr": 1e-3, "gamma": 0.5}
    assert config.out == str(out)  # never taken from the resumed run's configuration
    # the --config file sits between the resumed run's configuration and the command line
    path = tmp_path / "more.yaml"
    path.write_text("samples: 0\niterations: 6\n")
    config = resolve({"out": str(out), "iterations": 9}, path, "2")
    assert (config.samples, config.iterations, config.seed) == (0, 9, 5)
    # a checkpoint folder's own run folder
    other = tmp_path / "elsewhere"
    assert resolve({"out": str(other)}, None, str(out / "checkpoints" / "iteration-000002")).seed == 5
    # no configuration saved (a run of an older hfplan): the defaults
    assert resolve({"out": str(other)}, None, "latest").seed == 0


def test_the_written_configuration_reads_back_as_the_options(tmp_path):
    options = ExecuteOptions(iterations=3, data="d.jsonl", out=tmp_path, seed=2, overrides=("actor_lr=0.001",),
                             checkpoint_every=1, keep=3, loggers=("jsonl", "tensorboard"), samples=2, log_every=5)
    written = write_config(options.config(), tmp_path)
    assert written == tmp_path / RUN_CONFIG_FILE
    again = ExecuteOptions.from_config(read_back := RunConfig.model_validate_json(written.read_text()))
    assert again == options
    assert read_config(written) == read_back.model_dump()  # a run's configuration is a --config file too
