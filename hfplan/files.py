"""Reading and writing the user's files: one clear error per bad file, and no half-written outputs."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
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


def _target(path: Path, what: str) -> Path:
    """The regular file an output will replace: symlinks followed; folders, devices, pipes refused."""
    label = f"{what} {path}" if what else str(path)
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise HfplanError(f"cannot write {label}: it is a folder; give a file name")
    if target.exists() and not target.is_file():
        raise HfplanError(f"cannot write {label}: not a regular file (a device, pipe or socket is never replaced)")
    if not target.parent.is_dir():
        raise HfplanError(f"cannot write {label}: folder {path.parent} does not exist")
    return target


def _oserror(label: str, error: OSError) -> HfplanError:
    return HfplanError(f"cannot write {label}: {error.strerror or type(error).__name__}")


def check_writable(path: Path, what: str) -> None:
    """Refuse an output path before any work starts: a folder, a missing or unwritable folder, a device.
    `what` names the option in the error ("--out")."""
    target = _target(path, what)
    try:
        fd, probe = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as error:
        raise _oserror(f"{what} {path}", error) from None
    os.close(fd)
    os.unlink(probe)


def check_new_folder(path: Path, what: str) -> None:
    """Refuse a folder an output will be written into (a run folder) before any work starts: a file in its
    place, a missing parent (hfplan makes the folder itself, never its parents, as for a file), a folder that
    cannot be written. It is not created here."""
    if path.exists() and not path.is_dir():
        raise HfplanError(f"{what} {path}: exists and is not a folder")
    where = path if path.is_dir() else path.parent
    if not where.is_dir():
        raise HfplanError(f"{what} {path}: folder {where} does not exist (hfplan makes {path.name}, never the "
                          "folders above it)")
    if not os.access(where, os.W_OK | os.X_OK):
        raise HfplanError(f"{what} {path}: folder {where} is not writable")


def check_outputs(outputs: Sequence[tuple[Path | None, str]]) -> None:
    """check_writable for each (path, option) given (None: not asked for), and no two naming one file."""
    given = [(path, what) for path, what in outputs if path is not None]
    for path, what in given:
        check_writable(path, what)
    seen: dict[str, str] = {}
    for path, what in given:
        target = os.path.realpath(path)
        if target in seen:
            raise HfplanError(f"{seen[target]} and {what} name the same file ({path}); give each output its own")
        seen[target] = what


def _stage(target: Path, label: str, data: str | bytes) -> str:
    """Write `data` to a new temporary file beside `target`, with ordinary permissions; return its path."""
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as error:
        raise _oserror(label, error) from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise _oserror(label, error) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_outputs(files: Sequence[tuple[Path, str | bytes]]) -> None:
    """Write several outputs all or nothing as far as the file system allows: every file is written in full
    to a temporary file beside its target first, and only then renamed over it, so a failure leaves neither
    a half-written file nor some outputs of this run without the others."""
    targets = [_target(Path(path), "") for path, _ in files]
    if len(set(targets)) < len(targets):
        raise HfplanError(f"two outputs name the same file: {', '.join(str(p) for p, _ in files)}")
    staged: list[tuple[str, Path, str]] = []
    try:
        for (path, data), target in zip(files, targets, strict=True):
            staged.append((_stage(target, str(path), data), target, str(path)))
        for tmp, target, label in staged:
            try:
                os.replace(tmp, target)
            except OSError as error:
                raise _oserror(label, error) from None
    finally:
        for tmp, _, _ in staged:
            Path(tmp).unlink(missing_ok=True)


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees a half-written file."""
    write_outputs([(Path(path), data)])
