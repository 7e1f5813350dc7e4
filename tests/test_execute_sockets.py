"""What a local run listens on beyond loopback: only Ray's processes (their gRPC servers bind every
interface whatever the node address; torch's rendezvous store runs inside a Ray worker) and the driver,
as the README's security section says. The test cannot tell the store from Ray's own servers inside a
worker process: it fails on a listener of any other process, not on one of those."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hfplan.executor.controller import ExecuteOptions, execute
from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload

pytestmark = pytest.mark.slow
LISTEN = "0A"


def listening() -> set[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket of this machine (/proc/net/tcp, tcp6)."""
    found = set()
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            found.add((_address(address, width), int(port, 16), fields[9]))
    return found


def _address(hex_address: str, width: int) -> str:
    if width == 8:
        return ".".join(str(int(hex_address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return "::1" if hex_address == "0" * 24 + "01000000" else f"ipv6:{hex_address}"


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def owners() -> dict[str, str]:
    """Socket inode -> the command line of the process holding it."""
    found = {}
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            command = Path(f"/proc/{proc}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for fd in os.listdir(f"/proc/{proc}/fd"):
                target = os.readlink(f"/proc/{proc}/fd/{fd}")
                if target.startswith("socket:["):
                    found[target[8:-1]] = command
        except OSError:
            continue
    return found


# Processes allowed to listen beyond loopback, each named in the README: Ray's own, and this driver
# (Ray's core worker in it, and torch's TCP store in set rank 0 workers, which are ray:: processes).
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "ray/dashboard", "ray/_private", "ray/autoscaler")


def test_a_local_run_listens_on_loopback_only(tmp_path, no_ray_driver):
    """A run that starts its own Ray (not the session's cluster): what hfplan's local start listens on."""
    import ray

    assert not ray.is_initialized()
    before = listening()
    wide: dict[tuple[str, int], str] = {}

    def look(report) -> None:
        held = owners()
        for address, port, inode in listening() - before:
            if not is_loopback(address):
                wide[(address, port)] = held.get(inode, "?")

    plan = cpu_plan(tiny_workload("grpo", ARITH_GRPO), [(("actor", "reference"), 2)])
    execute(plan, ExecuteOptions(iterations=1, out=tmp_path / "run", call_timeout_s=120, start_timeout_s=120), look)
    me = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    unexpected = {key: who for key, who in wide.items()
                  if not any(name in who for name in RAY_PROCESSES) and who.strip() != me}
    assert not unexpected, unexpected
