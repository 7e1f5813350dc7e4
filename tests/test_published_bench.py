"""bench/published.py: its table of published measurements is complete and every case is priced."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "published.py"


def _bench():
    """bench/published.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("published_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


def test_the_table_covers_every_category_with_cited_cases():
    cases = BENCH.build_cases()
    assert len(cases) >= 30
    assert {c.category for c in cases} == set(BENCH.CATEGORIES)
    assert all(c.source.strip() and c.unit and c.published > 0 for c in cases)
    assert len({c.name for c in cases}) == len(cases)


def test_every_prediction_is_finite_and_positive():
    rows = BENCH.predict_all(BENCH.build_cases())
    assert all(math.isfinite(r.predicted) and r.predicted > 0 for r in rows)
    summary = BENCH.summaries(rows)
    assert [s.label for s in summary] == [*BENCH.CATEGORIES, "overall"]
    assert summary[-1].cases == len(rows)
