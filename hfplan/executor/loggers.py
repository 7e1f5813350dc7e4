"""Where a run's metrics go, one row per iteration (`hfplan execute --logger jsonl,csv,tensorboard,wandb`).

Every backend gets the same rows under the same names (those of `controller.iteration_metrics`); a logger is
opened with the rows a resumed run's checkpoint already holds and continues after them:

    jsonl        OUT/metrics.jsonl     rewritten from those rows, then one JSON object per line
    csv          OUT/metrics.csv       rewritten from those rows, then one row per iteration; a metric name not in the
                                       header yet widens it: the file is rewritten (atomically) with the new column
                                       appended, empty in the earlier rows
    tensorboard  OUT/tensorboard/      an event file per run (scalars, step = iteration); a run starts with a session
                                       start at its first iteration, so TensorBoard drops what an earlier run of the
                                       folder logged from that iteration on
    wandb        OUT/wandb/            a W&B run (offline unless WANDB_MODE says otherwise), step = iteration

tensorboard and wandb are optional packages, imported only when asked for; `check_available` refuses a missing
one before anything starts.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from hfplan.errors import HfplanError
from hfplan.files import write_atomically

METRICS_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
TENSORBOARD_FOLDER = "tensorboard"
WANDB_FOLDER = "wandb"
STEP = "iteration"  # the metric that numbers the rows: tensorboard's and wandb's step, not a scalar of its own

# name -> (module it imports, extra that installs it); None: nothing beyond the core install
LOGGERS: dict[str, tuple[str, str] | None] = {"jsonl": None, "csv": None, "tensorboard": ("tensorboard", "loggers"),
                                               "wandb": ("wandb", "wandb")}
DEFAULT_LOGGERS = ("jsonl",)

Row = Mapping[str, float]


class MetricsLogger(Protocol):
    """One backend: `log` gets each iteration's metrics as it is recorded, `close` ends the run's output."""

    def log(self, metrics: Row) -> None: ...

    def close(self) -> None: ...


def parse_names(value: str | Sequence[str]) -> tuple[str, ...]:
    """`jsonl,csv` (or a list of names) as a tuple of known logger names, in order, each once."""
    names = [part.strip() for part in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    names = [name for name in names if name]
    if not names:
        raise HfplanError(f"--logger: name at least one of {', '.join(LOGGERS)}")
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise HfplanError(f"--logger {unknown[0]}: unknown logger; known: {', '.join(LOGGERS)}")
    return tuple(dict.fromkeys(names))


def check_available(names: Sequence[str]) -> None:
    """Refuse a logger whose optional package is not installed, naming the extra that installs it."""
    for name in names:
        needs = LOGGERS[name]
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            raise HfplanError(f"--logger {name} needs the {needs[0]} package, not installed: pip install "
                              f"'.[{needs[1]}]' in the hfplan checkout (or pip install {needs[0]})")


class JsonlLogger:
    """metrics.jsonl: one JSON object per iteration (standard JSON: a non-finite value never gets this far)."""

    def __init__(self, out: Path, history: Sequence[Row]) -> None:
        self.path = out / METRICS_FILE
        write_atomically(self.path, "".join(_json_line(row) for row in history))

    def log(self, metrics: Row) -> None:
        with self.path.open("a") as sink:
            sink.write(_json_line(metrics))

    def close(self) -> None:
        pass


def _json_line(row: Row) -> str:
    return json.dumps(dict(row), allow_nan=False) + "\n"


class CsvLogger:
    """metrics.csv: a header of every metric name seen so far (`iteration` first, then in order of first
    appearance) and one row per iteration; a metric an iteration lacks is an empty cell."""

    def __init__(self, out: Path, history: Sequence[Row]) -> None:
        self.path = out / CSV_FILE
        self.rows: list[dict] = [dict(row) for row in history]
        self.columns: list[str] = [STEP]
        for row in self.rows:
            self._widen(row)
        self._rewrite()

    def _widen(self, row: Row) -> bool:
        new = [name for name in row if name not in self.columns]
        self.columns += new
        return bool(new)

    def _text(self, rows: Sequence[Row], header: bool) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, self.columns, restval="", lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    def _rewrite(self) -> None:
        write_atomically(self.path, self._text(self.rows, header=True))

    def log(self, metrics: Row) -> None:
        self.rows.append(dict(metrics))
        if self._widen(metrics):
            self._rewrite()
        else:
            with self.path.open("a") as sink:
                sink.write(self._text([metrics], header=False))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars in an event file under OUT/tensorboard/, written with tensorboard's own writer (no torch)."""

    def __init__(self, out: Path, first_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        folder = out / TENSORBOARD_FOLDER
        folder.mkdir(exist_ok=True)
        self.writer = EventFileWriter(str(folder))
        # What an earlier run of this folder logged from `first_step` on is superseded (a resumed run repeats the
        # iterations after its checkpoint): TensorBoard purges it on reading this session start.
        self.writer.add_event(Event(wall_time=time.time(), step=first_step,
                                    session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def log(self, metrics: Row) -> None:
        values = [self._summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()
                  if name != STEP]
        self.writer.add_event(self._event(wall_time=time.time(), step=int(metrics[STEP]),
                                          summary=self._summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in OUT/wandb/: offline (`wandb sync` uploads it later) unless WANDB_MODE is set.
    A resumed run is a new W&B run of the same name and group whose steps continue from its checkpoint's."""

    def __init__(self, out: Path, config: Mapping[str, object]) -> None:
        import wandb

        folder = out / WANDB_FOLDER
        folder.mkdir(exist_ok=True)
        name = out.resolve().name
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hfplan"), dir=str(out), name=name,
                              group=name, config=dict(config),
                              mode=None if "WANDB_MODE" in os.environ else "offline")

    def log(self, metrics: Row) -> None:
        self.run.log({name: value for name, value in metrics.items() if name != STEP}, step=int(metrics[STEP]))

    def close(self) -> None:
        self.run.finish()


class RunLoggers:
    """Every logger of a run, written to together; a context manager that closes them all."""

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: Row) -> None:
        for logger in self.loggers:
            logger.log(metrics)

    def close(self) -> None:
        for logger in self.loggers:
            with contextlib.suppress(Exception):  # one backend failing to close leaves the others' files whole
                logger.close()
        self.loggers = []

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_loggers(names: Sequence[str], out: Path, history: Sequence[Row], first_step: int,
                 config: Mapping[str, object] | None = None) -> RunLoggers:
    """The run's loggers in `out`, continuing after `history` (the rows a resumed checkpoint holds; empty for a
    fresh run) from iteration `first_step`. `config`: the run's resolved options, for backends that keep them."""
    opened: list[MetricsLogger] = []
    try:
        for name in names:
            if name == "jsonl":
                opened.append(JsonlLogger(out, history))
            elif name == "csv":
                opened.append(CsvLogger(out, history))
            elif name == "tensorboard":
                opened.append(TensorBoardLogger(out, first_step))
            elif name == "wandb":
                opened.append(WandbLogger(out, config or {}))
            else:
                raise HfplanError(f"--logger {name}: unknown logger; known: {', '.join(LOGGERS)}")
    except BaseException:
        RunLoggers(opened).close()
        raise
    return RunLoggers(opened)
