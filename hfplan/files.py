"""Reading and writing the user's files: one clear error per bad file, and no half-written outputs."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from hfplan.errors import HfplanError


def read_mapping(path: Path, what: str) -> dict:
    """Parse a JSON (.json) or YAML (anything else) file that must hold a mapping. `what` names the
    file in errors ("workload", "plan", ...)."""
    as_json = path.suffix == ".json"
    try:
        text = path.read_text()
        data = json.loads(text) if as_json else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as bad:
        first = str(bad).strip().splitlines()[0] if str(bad).strip() else type(bad).__name__
        raise HfplanError(f"{what} {path}: not valid {'JSON' if as_json else 'YAML'} ({first})") from None
    if not isinstance(data, dict):
        raise HfplanError(f"{what} {path}: expected a {'JSON object' if as_json else 'mapping'} at the top level")
    return data


def write_atomically(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees a half-written file."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise HfplanError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
