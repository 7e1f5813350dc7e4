"""The private torch and Ray APIs the executor needs where no public one does the job: every use in this module.

tests/test_compat.py pins each of them, so that a Ray upgrade that moves or changes one fails there, by
name, instead of silently elsewhere (README, "Upgrading"). Everything else in hfplan uses public APIs only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# The classes and functions a DCP `.metadata` pickle refers to (checkpoint.read_metadata rebuilds these and
# nothing else). Some are private to torch: a torch that renames one writes metadata this list refuses.
DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


def on_loopback(address: str) -> bool:
    """Whether a Ray address (HOST:PORT) is this machine's loopback, where no other machine's node can join."""
    return address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost")


def reach_clusters_through_loopback() -> None:
    """Make `ray.init(address="127.0.0.1:PORT")` connect through loopback. Ray rewrites a loopback address
    to the machine's own address unless it believes multi-machine clusters are off (its Windows / macOS
    default); a cluster whose nodes listen on loopback only is reached only through loopback. The switch,
    `ray._private.ray_constants.ENABLE_RAY_CLUSTER`, has a public environment variable
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) that Ray reads once, when `ray` is first imported: too early for a
    process that imported Ray before it knew its address. Process-wide and for good, as Ray's default is."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def local_ray_options(temp_dir: str) -> dict[str, str]:
    """ray.init's options for a Ray that hfplan starts itself: its node on 127.0.0.1 (nothing listens on
    other interfaces) and its session files under `temp_dir`. Ray documents both as hidden options of
    ray.init; a Ray without them refuses the call (Unknown keyword argument), it does not ignore them."""
    return {"_node_ip_address": "127.0.0.1", "_temp_dir": temp_dir}


def actor_id(handle) -> str:
    """The hex id of the actor behind a Ray actor handle: what a RayActorError's public `actor_id` names.
    Ray gives a handle no public id (an actor learns its own from the runtime context only)."""
    return handle._actor_id.hex()


def raylet_reports_into(log: Path) -> Callable[[], None]:
    """Send the errors Ray's raylets publish to the driver (a worker died, with its exit detail) to `log`
    instead of the terminal; returns what undoes it. Ray's driver prints them to stdout from a thread of its
    own (`listen_error_messages`, through the module function `print_to_stdstream`, looked up at each call),
    whatever `log_to_driver` says; hfplan names the failure itself. Other output is printed as Ray would."""
    from ray._private import worker as ray_worker

    shown = ray_worker.print_to_stdstream

    def raylet_into_log(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            shown(data, ignore_prefix=ignore_prefix)
            return
        try:
            with log.open("a") as sink:
                sink.writelines(f"(raylet) {line}\n" for line in data.get("lines", []))
        except OSError:  # the run folder is gone (a refused or interrupted start removes it): nothing to keep
            return

    ray_worker.print_to_stdstream = raylet_into_log

    def restore() -> None:
        ray_worker.print_to_stdstream = shown

    return restore
