"""A run's options as one document: `hfplan execute PLAN --config run.yaml`, and OUT/run_config.json, the resolved
options a run starts with (what `--resume` continues with).

Precedence, lowest first: the defaults; on `--resume`, the resumed run's own `run_config.json` (every option but
`out`); the `--config` file; the options given on the command line. `set` (hyperparameter overrides) merges key by
key across those layers. The file is YAML, or JSON for a `.json` name (yaml.safe_load / json: never pickle); a
path in it (`data`, `eval_data`, `out`) is read from the working directory, as on the command line. Torch-free:
every error is one HfplanError line, raised before anything starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hfplan.errors import HfplanError, describe_validation_error
from hfplan.executor.loggers import DEFAULT_LOGGERS, parse_names
from hfplan.files import read_mapping, write_atomically
from hfplan.hyperparams import Hyperparameters, with_overrides

RUN_CONFIG_FILE = "run_config.json"
LATEST = "latest"  # as resume.LATEST (resume.py is not imported here: it needs nothing of it)
# Options a resume never takes from the resumed run's configuration: where this run writes.
NOT_RESUMED = ("out",)

Scalar = str | int | float | bool


class RunConfig(BaseModel):
    """Every option of `hfplan execute` that shapes a run (not where Ray is, nor what to draw)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    iterations: int = Field(default=40, ge=1)
    data: str | None = None
    seed: int = 0
    out: str = "run"
    checkpoint_every: int | None = Field(default=None, ge=1)
    keep: int = Field(default=2, ge=1)
    log_every: int = Field(default=10, ge=1)
    loggers: tuple[str, ...] = DEFAULT_LOGGERS
    samples: int = Field(default=0, ge=0)
    long_prompts: Literal["truncate", "refuse"] = "truncate"
    eval_data: str | None = None  # held-out prompts, evaluated greedily (hfplan.executor.evaluation)
    eval_every: int | None = Field(default=None, ge=1)  # None: only after the last iteration
    set: dict[str, Scalar] = Field(default_factory=dict)

    @field_validator("loggers", mode="before")
    @classmethod
    def _logger_names(cls, value: object) -> tuple[str, ...]:
        if isinstance(value, str | list | tuple):
            try:
                return parse_names(value)
            except HfplanError as bad:
                raise ValueError(str(bad).removeprefix("--logger ")) from None
        raise ValueError("expected a list of logger names or a comma-separated string")

    @field_validator("set")
    @classmethod
    def _hyperparameters(cls, value: dict[str, Scalar]) -> dict[str, Scalar]:
        return typed_overrides(value)

    @property
    def overrides(self) -> tuple[str, ...]:
        """`set` as `--set key=value` strings."""
        return tuple(f"{key}={value}" for key, value in self.set.items())


def typed_overrides(values: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """Hyperparameter overrides checked against the Hyperparameters model, each value of its field's type
    (YAML reads `1e-4` as a string)."""
    if not values:
        return {}
    try:
        checked = with_overrides(Hyperparameters(), [f"{key}={value}" for key, value in values.items()])
    except HfplanError as bad:
        raise ValueError(str(bad).removeprefix("--set ").removeprefix("--set: ").removeprefix("field ")) from None
    return {key: getattr(checked, key) for key in values}


def parse_assignments(assignments: list[str] | tuple[str, ...]) -> dict[str, Scalar]:
    """`--set key=value` strings as a mapping (checked, typed); the last of a repeated key wins."""
    pairs: dict[str, Scalar] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise HfplanError(f"--set {item!r}: expected key=value")
        pairs[key.strip()] = raw.strip()
    try:
        return typed_overrides(pairs)
    except ValueError as bad:
        raise HfplanError(f"--set {bad}") from None


def _validated(data: Mapping[str, object], where: str | None) -> RunConfig:
    """`data` as a RunConfig; an error is one line naming `where` and the key, or (where = None: the command
    line) the option."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as bad:
        first = bad.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            raise HfplanError(f"{where}: unknown option {key!r}; known: {', '.join(RunConfig.model_fields)}") \
                from None
        if where is None:
            message = describe_validation_error(bad).removeprefix(f"field {key}: ")
            raise HfplanError(f"--{key.split('.')[0].replace('_', '-')}: {message}") from None
        raise HfplanError(f"{where}: {describe_validation_error(bad)}") from None


def read_config(path: Path) -> dict[str, object]:
    """The options a `--config` file gives (only those it names), checked: one line for a missing or malformed
    file, an unknown key or a value of the wrong type."""
    if not path.is_file():
        raise HfplanError(f"--config {path}: {'not a file' if path.exists() else 'file not found'}")
    data = read_mapping(path, "--config")
    return _validated(data, f"--config {path}").model_dump(include=set(data))


def saved_config(out: Path, resume: str) -> dict[str, object] | None:
    """The configuration of the run a `--resume CHOICE` continues: the run_config.json of `out` for `latest` or
    an iteration, of the checkpoint's run folder for a checkpoint path (None where there is none: a run of an
    hfplan before run configurations, or a checkpoint folder moved out of its run)."""
    folder = out
    if resume != LATEST and not resume.isdigit():
        checkpoint = Path(resume)
        folder = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else out
    path = folder / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    data = read_mapping(path, "run configuration")
    return _validated(data, f"run configuration {path}").model_dump(exclude=set(NOT_RESUMED))


def resolve(given: Mapping[str, object], config_file: Path | None = None, resume: str | None = None) -> RunConfig:
    """The run's options: `given` (the options given on the command line, by RunConfig's names; `set` as a
    mapping) over the `--config` file over, on resume, the resumed run's run_config.json over the defaults."""
    given = _validated(given, None).model_dump(include=set(given))
    from_file = read_config(config_file) if config_file is not None else {}
    out = Path(str(given.get("out", from_file.get("out", RunConfig().out))))
    resumed = (saved_config(out, resume) or {}) if resume is not None else {}
    merged: dict[str, object] = {}
    overrides: dict[str, object] = {}
    for layer in (resumed, from_file, given):
        overrides |= dict(layer.get("set") or {})  # type: ignore[call-overload]
        merged |= {key: value for key, value in layer.items() if key != "set"}
    return _validated(merged | {"set": overrides}, "options")


def write_config(config: RunConfig, out: Path) -> Path:
    """OUT/run_config.json: the run's resolved options (written whole or not at all)."""
    path = out / RUN_CONFIG_FILE
    write_atomically(path, json.dumps(config.model_dump(mode="json"), indent=2) + "\n")
    return path
