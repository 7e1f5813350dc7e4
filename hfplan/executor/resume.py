"""A run's checkpoint folders: what each holds, how one is committed, which one a resume starts from.

    OUT/checkpoints/iteration-000004/
        manifest.json        the run it belongs to (algorithm, models, seed, prompts), its placement and
                             layouts, the iteration, and the SHA-256 of every other file; written last
        controller.json      the controller's state: data position, Safe-RLHF's multiplier, metrics and
                             the measured timeline so far
        roles/<role>/        each trained role's model and optimizer, DCP (hfplan.executor.checkpoint)
        rng/set-S-rank-R.pt  each worker's random streams

A checkpoint is written into `.partial-iteration-N` and renamed to `iteration-N` once every piece is in,
so a folder with the final name is always complete; the newest `keep` complete ones are kept. Before a
resume reads any tensor, every file is checked against its manifest's checksum (hashlib only: a damaged
checkpoint is refused before torch or Ray start).
The controller's only random stream is the prompt order, a function of the seed and the data position.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from hfplan.errors import HfplanError
from hfplan.layout import facts_of
from hfplan.plan import PlacementSet, Plan, RoleParallelism

CHECKPOINTS_FOLDER = "checkpoints"
MANIFEST_FILE = "manifest.json"
CONTROLLER_FILE = "controller.json"
FORMAT = 2  # 2: the manifest lists each file's SHA-256; 1 (read, never written): no checksums
LATEST = "latest"
_NAME = re.compile(r"^iteration-(\d+)$")
_PARTIAL = ".partial-"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RunIdentity(_Strict):
    """What a resumed run must share with the checkpoint's: the same program over the same models, and
    the same seed and prompts (the data order and the initial weights of the untrained roles)."""

    algorithm: str
    models: dict[str, str]  # role -> model reference
    seed: int
    prompts: int
    prompts_sha256: str


class Manifest(_Strict):
    format: Literal[1, 2] = FORMAT
    iteration: int  # iterations done
    run: RunIdentity
    heads: dict[str, str]  # trained role -> "lm" | "scalar"
    placement: list[PlacementSet]
    parallelism: dict[str, RoleParallelism]
    files: dict[str, str] = {}  # path relative to the checkpoint folder -> SHA-256 (format 2)

    @property
    def trained_roles(self) -> list[str]:
        return list(self.heads)


class ControllerSnapshot(_Strict):
    iteration: int
    data_position: int  # prompts handed out so far
    lagrange: float | None  # Safe-RLHF's multiplier, once set
    metrics: list[dict[str, int | float]]
    timeline: list[dict]


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    manifest: Manifest
    controller: ControllerSnapshot

    def same_layout(self, plan: Plan) -> bool:
        """Whether the plan runs every role on the checkpoint's sets, ranks and layouts (then every worker
        gets back its own random streams)."""
        return self.manifest.placement == plan.placement and self.manifest.parallelism == plan.parallelism


def run_identity(plan: Plan, seed: int, prompts: list[str], columns: Mapping[str, list] | None = None) -> RunIdentity:
    """What a resumed run must share with the checkpoint's. The data's other columns (what a reward function reads)
    count with the prompts when there are any."""
    digest = hashlib.sha256("\0".join(prompts).encode())
    if columns:
        digest.update(json.dumps(columns, sort_keys=True, default=str).encode())
    return RunIdentity(algorithm=plan.workload.algorithm, models=dict(plan.workload.models), seed=seed,
                       prompts=len(prompts), prompts_sha256=digest.hexdigest())


def manifest_of(plan: Plan, run: RunIdentity, iteration: int) -> Manifest:
    """The manifest of a checkpoint; its file checksums are added by `commit`, once every file is in."""
    heads = {role: facts_of(plan.workload, role).head for role in plan.workload.model_roles
             if facts_of(plan.workload, role).trains}
    return Manifest(iteration=iteration, run=run, heads=heads, placement=plan.placement,
                    parallelism=plan.parallelism)


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def folder_digests(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file under a checkpoint folder but its manifest, by relative path."""
    return {path.relative_to(folder).as_posix(): file_digest(path) for path in sorted(folder.rglob("*"))
            if path.is_file() and path.relative_to(folder).as_posix() != MANIFEST_FILE}


def damage(folder: Path, manifest: Manifest) -> str | None:
    """What is wrong with a checkpoint's files against its manifest's checksums (None: intact, or a format-1
    checkpoint, which has none)."""
    for name, expected in manifest.files.items():
        path = folder / name
        if not path.is_file():
            return f"file {name} is missing"
        try:
            if file_digest(path) != expected:
                return f"file {name} does not match its checksum (truncated or altered)"
        except OSError as bad:
            return f"file {name} cannot be read ({bad.strerror})"
    return None


def checkpoints_folder(out: Path) -> Path:
    return out / CHECKPOINTS_FOLDER


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of a run folder, oldest first."""
    return _complete_in(checkpoints_folder(out))


def _complete_in(folder: Path) -> list[Path]:
    """The complete checkpoints of a checkpoints folder, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in folder.iterdir()
             if (m := _NAME.match(path.name)) and (path / MANIFEST_FILE).is_file()]
    return [path for _, path in sorted(found)]


def latest(out: Path) -> Path | None:
    found = complete_checkpoints(out)
    return found[-1] if found else None


def _read_model(path: Path, model: type[_Strict]):
    try:
        return model.model_validate_json(path.read_bytes())
    except OSError as bad:
        raise HfplanError(f"checkpoint file {path}: cannot read it ({bad.strerror})") from None
    except ValidationError as bad:
        first = bad.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise HfplanError(f"checkpoint file {path}: not an hfplan checkpoint ({where}: {first['msg']})") from None


def verified_checkpoint(folder: Path) -> Checkpoint:
    """A checkpoint's manifest and controller state, every file checked against the manifest's checksums;
    torch-free, so a damaged checkpoint is refused before any worker or library starts."""
    if not (folder / MANIFEST_FILE).is_file():
        raise HfplanError(f"{folder}: not a complete hfplan checkpoint (no {MANIFEST_FILE})")
    manifest = _read_model(folder / MANIFEST_FILE, Manifest)
    problem = damage(folder, manifest)
    if problem is not None:
        intact = newest_intact(folder.parent, before=manifest.iteration)
        instead = (f"; the newest intact checkpoint is {intact.name}: continue from it with --resume "
                   f"{iteration_of(intact)}" if intact is not None else "; no older intact checkpoint is left")
        raise HfplanError(f"checkpoint {folder} is damaged: {problem}{instead}")
    controller = _read_model(folder / CONTROLLER_FILE, ControllerSnapshot)
    if controller.iteration != manifest.iteration:
        raise HfplanError(f"checkpoint {folder}: {CONTROLLER_FILE} is at iteration {controller.iteration} but "
                          f"{MANIFEST_FILE} at {manifest.iteration}")
    return Checkpoint(folder, manifest, controller)


def iteration_of(folder: Path) -> int:
    """The iteration of a checkpoint folder named `iteration-NNNNNN`."""
    match = _NAME.match(folder.name)
    assert match is not None, folder
    return int(match.group(1))


def newest_intact(folder: Path, before: int) -> Path | None:
    """The newest complete checkpoint in a checkpoints folder older than iteration `before` whose files match
    their checksums."""
    for path in reversed([p for p in _complete_in(folder) if iteration_of(p) < before]):
        try:
            if damage(path, _read_model(path / MANIFEST_FILE, Manifest)) is None:
                return path
        except HfplanError:
            continue
    return None


def read_checkpoint(folder: Path) -> Checkpoint:
    """`verified_checkpoint`, then `check_tensor_headers`."""
    return check_tensor_headers(verified_checkpoint(folder))


def check_tensor_headers(found: Checkpoint) -> Checkpoint:
    """A safe look at a checkpoint's tensor files' headers (DCP metadata, RNG files): nothing in them is
    executed, and a file hfplan never writes is one HfplanError line (also where its checksum was forged)."""
    from hfplan.executor import checkpoint as tensors

    try:
        for role in found.manifest.trained_roles:
            tensors.read_metadata(tensors.role_folder(found.folder, role))
        for index, group in enumerate(found.manifest.placement):
            for rank in range(group.gpus):
                tensors.read_rng(tensors.rng_file(found.folder, index, rank))
    except tensors.UnsafeCheckpoint as bad:
        raise HfplanError(f"checkpoint refused: {bad}") from None
    return found


def check_matches(found: Checkpoint, run: RunIdentity, iterations: int) -> None:
    """Refuse (one line) a checkpoint of another run: other algorithm, roles, models, seed or prompts."""
    theirs, where = found.manifest.run, found.folder
    if theirs.algorithm != run.algorithm:
        raise HfplanError(f"checkpoint {where} is of a {theirs.algorithm} run, the plan runs {run.algorithm}")
    if set(theirs.models) != set(run.models):
        raise HfplanError(f"checkpoint {where} has roles {', '.join(theirs.models)}; the plan has "
                          f"{', '.join(run.models)}")
    for role, ref in run.models.items():
        if theirs.models[role] != ref:
            raise HfplanError(f"checkpoint {where} was trained with {role} model {theirs.models[role]}, the plan "
                              f"names {ref}")
    if theirs.seed != run.seed:
        raise HfplanError(f"--seed {run.seed}: checkpoint {where} was written by a run with --seed {theirs.seed}; "
                          "resume with the same seed")
    if (theirs.prompts, theirs.prompts_sha256) != (run.prompts, run.prompts_sha256):
        raise HfplanError(f"the prompts ({run.prompts}) are not those of checkpoint {where}'s run "
                          f"({theirs.prompts}); resume with the same --data")
    if found.manifest.iteration >= iterations:
        raise HfplanError(f"--iterations {iterations}: checkpoint {where} has done {found.manifest.iteration} "
                          "iterations already; ask for more to resume")


def chosen_checkpoint(out: Path, choice: str) -> Path:
    """The folder `--resume CHOICE` names: `latest` (the newest complete checkpoint in `out`), an iteration
    number (that checkpoint of `out`), or a checkpoint folder's path."""
    if choice == LATEST:
        newest = latest(out)
        if newest is None:
            raise HfplanError(f"--resume: no complete checkpoint in {checkpoints_folder(out)}")
        return newest
    if choice.isdigit():
        folder = checkpoints_folder(out) / _name(int(choice))
        if not (folder / MANIFEST_FILE).is_file():
            have = ", ".join(str(iteration_of(p)) for p in complete_checkpoints(out)) or "none"
            raise HfplanError(f"--resume {choice}: {out} has no complete checkpoint of iteration {int(choice)} "
                              f"(complete: {have})")
        return folder
    folder = Path(choice)
    if not folder.is_dir():
        raise HfplanError(f"--resume {choice}: not latest, an iteration number, or a checkpoint folder")
    return folder


def starting_point(out: Path, resume: str | None, run: RunIdentity, iterations: int) -> Checkpoint | None:
    """The checkpoint a run starts from (`--resume latest|ITERATION|PATH`), verified and checked against the
    run, torch-free; None for a fresh run, which is refused where earlier checkpoints would mix with its own."""
    newest = latest(out)
    if resume is None:
        if newest is not None:
            raise HfplanError(f"--out {out} holds checkpoints of an earlier run (latest: {newest.name}); continue "
                              "it with --resume, or give another --out")
        return None
    found = verified_checkpoint(chosen_checkpoint(out, resume))
    check_matches(found, run, iterations)
    return found


def clear_partial(out: Path) -> None:
    """Remove checkpoints a stopped run left half-written."""
    folder = checkpoints_folder(out)
    if folder.is_dir():
        for path in folder.iterdir():
            if path.name.startswith(_PARTIAL):
                shutil.rmtree(path, ignore_errors=True)


def start_partial(out: Path, iteration: int) -> Path:
    """An empty folder for the checkpoint of `iteration`, under its temporary name."""
    partial = checkpoints_folder(out) / f"{_PARTIAL}{_name(iteration)}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _name(iteration: int) -> str:
    return f"iteration-{iteration:06d}"


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as sink:
        sink.write(text)
        sink.flush()
        os.fsync(sink.fileno())


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, manifest: Manifest, controller: ControllerSnapshot, keep: int) -> Path:
    """Finish a checkpoint whose tensors are in `partial`: its controller state, then its manifest, then the
    rename to its final name. The oldest complete checkpoints beyond `keep` are removed."""
    _write_synced(partial / CONTROLLER_FILE, controller.model_dump_json() + "\n")
    manifest = manifest.model_copy(update={"format": FORMAT, "files": folder_digests(partial)})
    _write_synced(partial / MANIFEST_FILE, manifest.model_dump_json(indent=2) + "\n")
    final = partial.parent / _name(manifest.iteration)
    if final.exists():  # never the case in one run's sequence; kept safe: the old one leaves after the rename
        aside = partial.parent / f"{_PARTIAL}old-{final.name}"
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(partial, final)
    _sync_folder(final.parent)
    for old in complete_checkpoints(final.parent.parent)[:-keep]:
        with contextlib.suppress(OSError):
            os.rename(old, old.parent / f"{_PARTIAL}gone-{old.name}")  # no longer complete, then removed
        shutil.rmtree(old.parent / f"{_PARTIAL}gone-{old.name}", ignore_errors=True)
    return final


def controller_snapshot(iteration: int, data_position: int, lagrange: float | None, metrics: list[dict],
                        timeline: list[dict]) -> ControllerSnapshot:
    return ControllerSnapshot(iteration=iteration, data_position=data_position, lagrange=lagrange,
                              metrics=metrics, timeline=json.loads(json.dumps(timeline)))
