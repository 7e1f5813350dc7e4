"""`hfplan export`: the command that runs a plan on another framework (verl, OpenRLHF)."""

from __future__ import annotations

from hfplan.errors import HfplanError
from hfplan.export.common import Export
from hfplan.plan import Plan

EXPORT_TARGETS = ("verl", "openrlhf")


def export_plan(plan: Plan, to: str, source: str = "the plan") -> Export:
    """The command (and file) that runs `plan` on framework `to`; HfplanError when it cannot."""
    if to == "verl":
        from hfplan.export import verl as exporter
    elif to == "openrlhf":
        from hfplan.export import openrlhf as exporter
    else:
        raise HfplanError(f"unknown export target {to!r}; choose one of {', '.join(EXPORT_TARGETS)}")
    return exporter.export(plan, source)
