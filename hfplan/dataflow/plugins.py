"""Installed code found by name: the entry points of a group, and `module:attribute` references.

The one way hfplan runs a user's code: import what an installed package (or the Python path) provides,
by its dotted name. Nothing is evaluated and no file path is executed; the user chose to install the
code, and it runs with hfplan's own rights.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re

from hfplan.errors import HfplanError

# `package.module:function` (or `module:Class.method`): what an entry point's value says too.
OBJECT_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def installed(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points of `group` in the installed packages, by name; nothing is imported."""
    return {point.name: point for point in importlib.metadata.entry_points(group=group)}


def load_entry_point(point: importlib.metadata.EntryPoint) -> object:
    """The object an entry point names; a broken one names itself in one line, not with its traceback."""
    try:
        return point.load()
    except Exception as error:
        raise HfplanError(f"entry point {point.name!r} of {point.group}: cannot load {point.value}: "
                          f"{_describe(error)}") from None


def import_object(ref: str) -> object:
    """The object `module:attribute` names, imported from the Python path (HfplanError in one line)."""
    if not OBJECT_REF.fullmatch(ref):
        raise HfplanError(f"{ref!r} is not module:attribute")
    module_name, _, attribute = ref.partition(":")
    try:
        found: object = importlib.import_module(module_name)
    except Exception as error:
        raise HfplanError(f"cannot import module {module_name} ({_describe(error)}); is the package that "
                          "provides it installed in this environment?") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise HfplanError(f"module {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    return found


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
