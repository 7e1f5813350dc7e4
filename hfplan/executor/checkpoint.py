"""The tensors of a checkpoint: each trained role's model and optimizer, and each worker's random streams.

A trained role's state is saved with torch.distributed.checkpoint (DCP) by every rank of its set together,
sharded as the role's training layout is (each rank writes its own shards, the coordinator the metadata),
and loads into any layout of the same model: DCP reshards on load, so a checkpoint of a 2-rank FSDP
role loads on 1 rank, sharded or replicated. The state dicts come from DCP's get_state_dict on the role's
`.module` and `.optimizer` (the attributes every training engine keeps), so FQNs are the plain model's.

Loading never runs arbitrary pickled code: DCP's `.metadata` (a pickle) goes through an unpickler that
knows only DCP's metadata classes, and the non-tensor values DCP stores (optimizer settings) and the RNG
files go through torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hfplan.executor import compat

ROLES_FOLDER = "roles"
RNG_FOLDER = "rng"
METADATA_FILE = ".metadata"


class UnsafeCheckpoint(Exception):
    """A checkpoint file holds something other than what hfplan writes (it is never executed)."""


def role_folder(checkpoint: Path, role: str) -> Path:
    return checkpoint / ROLES_FOLDER / role


def rng_file(checkpoint: Path, set_index: int, rank: int) -> Path:
    return checkpoint / RNG_FOLDER / f"set-{set_index}-rank-{rank}.pt"


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata and nothing else: any other class or function in the file is refused."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in compat.DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"refers to {module}.{name}, which DCP metadata never holds")


def read_metadata(folder: Path) -> Metadata:
    """A DCP folder's metadata, read without executing anything in it."""
    path = folder / METADATA_FILE
    try:
        with path.open("rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpoint as bad:
        raise UnsafeCheckpoint(f"{path}: {bad}") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as bad:
        raise UnsafeCheckpoint(f"{path}: not DCP metadata ({type(bad).__name__}: {bad})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by `read_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (optimizer settings) read by torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as bad:
            raise UnsafeCheckpoint(f"value {read_item.dest_index.fqn}: {str(bad).splitlines()[0]}") from None
        # DCP's own load_bytes places the value (public API) but unpickles in full: hand it the value the
        # safe load accepted, saved again here, never the file's bytes.
        checked = io.BytesIO()
        torch.save(loaded, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _state_dicts(trained) -> dict:
    """The role's model and optimizer state dicts by the HF model's FQNs: a pipeline rank's own names
    (`stages.0.backbone.layers.0...` on every rank, for each of its stages) are mapped to the whole model's,
    so that stages never collide and a checkpoint loads into a plain model or another layout (another pp or
    number of virtual stages)."""
    model_state, optim_state = get_state_dict(trained.module, trained.optimizer)
    names = trained.names
    if names is None:
        return {"model": model_state, "optim": optim_state}
    return {"model": {names[k]: v for k, v in model_state.items()},
            "optim": {"state": {names[k]: v for k, v in optim_state["state"].items()},
                      "param_groups": [group | {"params": [names[p] for p in group["params"]]}
                                       for group in optim_state["param_groups"]]}}


def _stage_state_dicts(trained, state: dict) -> dict:
    """`_state_dicts`' inverse, after a load."""
    if trained.names is None:
        return state
    back = {hf: own for own, hf in trained.names.items()}
    optim = state["optim"]
    return {"model": {back[k]: v for k, v in state["model"].items()},
            "optim": {"state": {back[k]: v for k, v in optim["state"].items()},
                      "param_groups": [group | {"params": [back[p] for p in group["params"]]}
                                       for group in optim["param_groups"]]}}


def save_trained(trained, folder: Path) -> None:
    """Save a trained role's model and optimizer into a DCP folder. A collective over the role's set."""
    dcp.save(_state_dicts(trained), storage_writer=FileSystemWriter(str(folder)))


def load_trained(trained, folder: Path) -> None:
    """Load a trained role's model and optimizer state from a DCP folder, into this run's layout (resharded
    as needed). The optimizer's settings (learning rate, weight decay) stay this run's: only its state (moments,
    step counts) comes from the checkpoint. A collective over the role's set."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in trained.optimizer.param_groups]
    state = _state_dicts(trained)
    # This run's parameter groups: a checkpoint holds one list of names per group, and of pipeline stages
    # (each with its own list) only one stage's.
    groups = [dict(group) for group in state["optim"]["param_groups"]]
    dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner())
    state["optim"]["param_groups"] = groups
    state = _stage_state_dicts(trained, state)
    set_state_dict(trained.module, trained.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for group, kept in zip(trained.optimizer.param_groups, settings, strict=True):
        group.update(kept)


def load_model_weights(folder: Path, model: nn.Module) -> None:
    """Load the model part of a role's DCP folder into a plain (unsharded) model, in this process alone."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist: meant so
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(state["model"])


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    """This process's random streams: torch's global CPU (and CUDA) generator, and each role's own."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    state |= {f"generator/{role}": generator.get_state() for role, generator in generators.items()}
    return state


def save_rng(path: Path, generators: dict[str, torch.Generator]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(generators), path)


def read_rng(path: Path) -> dict[str, torch.Tensor]:
    """An RNG file's states, loaded with weights_only (tensors only)."""
    try:
        state = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as bad:
        raise UnsafeCheckpoint(f"{path}: not an RNG state file ({str(bad).splitlines()[0]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UnsafeCheckpoint(f"{path}: not an RNG state file (expected tensors by name)")
    return state


def restore_rng(path: Path, generators: dict[str, torch.Generator]) -> None:
    state = read_rng(path)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for role, generator in generators.items():
        generator.set_state(state[f"generator/{role}"])


def reseed(generators: dict[str, torch.Generator], seed: int) -> None:
    """Fresh streams from `seed`, for a resume whose ranks are not the checkpoint's."""
    torch.manual_seed(seed)
    for generator in generators.values():
        generator.manual_seed(seed)
