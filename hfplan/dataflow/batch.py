"""Batch: the named fields that flow between RLHF calls (prompts, responses, log-probs, rewards...).

A plain mapping whose values are whatever the backend uses: tensors or futures in the executor,
symbolic placeholders in the tracer. Dataflow programs merge batches with `|` and hand each call only
the fields it needs with `select`, which is also what tells the tracer the call's data dependencies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Batch(dict):
    def __or__(self, other: Mapping[str, Any]) -> Batch:  # type: ignore[override]
        merged = Batch(self)
        merged.update(other)
        return merged

    def select(self, *names: str) -> Batch:
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"batch lacks field(s) {', '.join(missing)}; it has {', '.join(sorted(self))}")
        return Batch({n: self[n] for n in names})

    def rename(self, **new_names: str) -> Batch:
        """rename(rewards="baseline_rewards") returns the batch with `rewards` called `baseline_rewards`."""
        return Batch({new_names.get(k, k): v for k, v in self.items()})
