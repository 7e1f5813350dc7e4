"""A CPU worker's peak memory as hfplan measures it: its own, not Ray's object store.

A process's peak resident set (VmHWM, or ru_maxrss) counts every page it has mapped, the shared pages of Ray's
object store among them: a separate rollout set's weight sync writes its buckets there on one worker and reads
them in place on another, and each then shows the pages it touched. On the project's 2-core VM (2026-12-07,
`small-arith` with a rollout set, 12 iterations) that was 133 MiB in both workers, about three times the 45 MiB
synced each iteration, grown from 88 MiB after 4 iterations as the store placed each sync's objects anew. That
memory is Ray's: its object store is sized when Ray starts (`object_store_memory`), is shared by every process of
the node, and is counted once there; on a GPU it is not device memory at all. So a worker's peak is its peak
resident set less the shared memory it maps when asked. Shared pages only grow while a process runs (the store
keeps its pages), so this is at most the peak without them and falls short of it only by what the object store
added after that peak. The store's pages show as shared memory (RssShmem) where Ray keeps its store in /dev/shm,
as it does on Linux when /dev/shm has room for it; where it falls back to a file elsewhere (a container's small
/dev/shm), its pages count as that file's (RssFile) and stay in the figure.
"""

from __future__ import annotations

import resource
from pathlib import Path

STATUS = Path("/proc/self/status")


def _status_kib(text: str, field: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def peak_resident_bytes(status: str | None = None) -> int:
    """This process's peak resident memory less the shared memory it maps now (`status`: /proc/self/status's
    text, read when not given); ru_maxrss where the kernel gives no such file."""
    if status is None:
        try:
            status = STATUS.read_text()
        except OSError:
            status = ""
    peak, shared = _status_kib(status, "VmHWM"), _status_kib(status, "RssShmem")
    if peak is None:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    return (peak - (shared or 0)) * 1024
