"""Prompts for a run: a parquet or JSONL file with a `prompt` column, or a demo model's built-in set.

The file's other columns (a reference answer, a test case...) travel with each prompt to the controller's
reward function (hfplan.dataflow.rewards), as plain Python values (JSON's, or pyarrow's to_pylist).
The order is a seeded shuffle per pass over the data, so a run (and a resumed run) sees the same
prompts at the same iteration for the same seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hfplan.errors import HfplanError

PROMPT_COLUMN = "prompt"


@dataclass(frozen=True)
class PromptSet:
    """Prompts and the data's other columns, one value per prompt (a JSONL line without a column has None)."""

    prompts: list[str]
    columns: dict[str, list] = field(default_factory=dict)


def read_prompts(path: str | Path) -> PromptSet:
    """The `prompt` column of a .parquet, .jsonl or .json-lines file, and its other columns."""
    path = Path(path)
    if not path.is_file():
        raise HfplanError(f"dataset not found: {path}")
    if path.suffix == ".parquet":
        prompts = _parquet_prompts(path)
    elif path.suffix in (".jsonl", ".json"):
        prompts = _jsonl_prompts(path)
    else:
        raise HfplanError(f"dataset {path}: expected a .parquet or .jsonl file")
    if not prompts.prompts:
        raise HfplanError(f"dataset {path}: no prompts")
    return prompts


def _parquet_prompts(path: Path) -> PromptSet:
    import pyarrow.lib
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pyarrow.lib.ArrowException, OSError) as bad:
        raise HfplanError(f"dataset {path}: not a readable parquet file ({bad})") from None
    if PROMPT_COLUMN not in schema.names:
        raise HfplanError(f"dataset {path}: no {PROMPT_COLUMN!r} column (columns: {', '.join(schema.names)})")
    table = pq.read_table(path)
    prompts = [_as_prompt(value, path, row) for row, value in enumerate(table.column(PROMPT_COLUMN).to_pylist())]
    return PromptSet(prompts, {name: table.column(name).to_pylist() for name in schema.names if name != PROMPT_COLUMN})


def _jsonl_prompts(path: Path) -> PromptSet:
    prompts, records = [], []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as bad:
                raise HfplanError(f"dataset {path}: line {number} is not JSON ({bad.msg})") from None
            if not isinstance(record, dict) or PROMPT_COLUMN not in record:
                raise HfplanError(f"dataset {path}: line {number} has no {PROMPT_COLUMN!r} field")
            prompts.append(_as_prompt(record[PROMPT_COLUMN], path, number))
            records.append(record)
    names = sorted({name for record in records for name in record} - {PROMPT_COLUMN})
    return PromptSet(prompts, {name: [record.get(name) for record in records] for name in names})


def _as_prompt(value: object, path: Path, row: int) -> str:
    if not isinstance(value, str):
        raise HfplanError(f"dataset {path}: prompt at row {row} is {type(value).__name__}, not text")
    return value


@dataclass(frozen=True)
class PromptBatch:
    """One iteration's prompts and their rows of the data's other columns."""

    prompts: list[str]
    columns: dict[str, list]


@dataclass
class PromptStream:
    """Batches of prompts, reshuffled (by seed and pass number) each time the data runs out."""

    prompts: list[str]
    batch: int
    seed: int
    position: int = 0  # prompts handed out so far
    columns: dict[str, list] = field(default_factory=dict)  # the data's other columns, aligned with prompts

    def __post_init__(self) -> None:
        self._orders: dict[int, np.ndarray] = {}

    def next_batch(self) -> PromptBatch:
        rows = [self._row(self.position + i) for i in range(self.batch)]
        self.position += self.batch
        return PromptBatch([self.prompts[r] for r in rows],
                           {name: [values[r] for r in rows] for name, values in self.columns.items()})

    def _row(self, index: int) -> int:
        epoch, offset = divmod(index, len(self.prompts))
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))}
        return int(self._orders[epoch][offset])
